"""The preset catalog: named models, read from ``presets/models.toml``."""

from __future__ import annotations

import tomllib
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from tracegen._config import load_mapping
from tracegen.errors import ConfigError
from tracegen.hf_config import from_hf_config, is_hf_config
from tracegen.model import ModelSpec


@cache
def _model_table() -> dict[str, dict[str, Any]]:
    text = resources.files("tracegen.presets").joinpath("models.toml").read_text("utf-8")
    return tomllib.loads(text)


def model_names() -> list[str]:
    return list(_model_table())


def model_source(name: str) -> str:
    return str(_model_table()[name].get("source", ""))


def get_model(name: str) -> ModelSpec:
    table = _model_table()
    if name not in table:
        raise ConfigError(
            f"no preset model named {name!r}; presets: {', '.join(table)} "
            "(or pass a TOML/JSON model file)",
            what="model",
        )
    data = {k: v for k, v in table[name].items() if k != "source"}
    return ModelSpec.from_dict({"name": name, **data})


def model_toml(name: str) -> str:
    """A preset model as a trainsim model file (``trainsim catalog NAME``): its keys, its source
    as a comment, named after it — the start of a file for another model."""
    get_model(name)  # (an unknown name: the error that lists the presets)
    data = _model_table()[name]
    lines = [f"# {name}: {data['source']}" if data.get("source") else f"# {name}",
             f"name = {_toml_value(name)}"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in data.items() if k != "source"]
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(v)


SEQ_SUFFIX = "@seq"  # ``llama3-8b@seq32768``: the model trained at another sequence length


def resolve_model(name_or_file: str | Path, seq_len: int = 0) -> ModelSpec:
    """A preset name, the path of a TOML/JSON model file, or a Hugging Face ``config.json``
    (``tracegen.hf_config``); any of them with ``@seqN`` appended, or ``seq_len`` given, is that
    model trained at sequence length N (the name ``with_seq_len`` gives it). A Hugging Face
    config needs one of the two: it does not say what a run trains at."""
    s = str(name_or_file)
    if s in _model_table():
        model = get_model(s)
    elif s.endswith((".toml", ".json")) or Path(s).exists():
        model = _model_file(Path(s), seq_len)
    else:
        base, sep, length = s.rpartition(SEQ_SUFFIX)
        if not (sep and base):
            return get_model(s)  # (its error names the presets)
        if not length.isdigit() or int(length) == 0:
            raise ConfigError(f"{s!r}: write the sequence length after {SEQ_SUFFIX} as a whole "
                              f"number of tokens, e.g. {base}{SEQ_SUFFIX}8192", what="model")
        return resolve_model(base, seq_len or int(length))
    return with_seq_len(model, seq_len) if seq_len else model


def _model_file(path: Path, seq_len: int) -> ModelSpec:
    """A trainsim model file, or a Hugging Face config (named after its folder where the file
    is the usual ``config.json``)."""
    data = load_mapping(path, what="model file")
    if not is_hf_config(data):
        return ModelSpec.from_dict({"name": path.stem, **data})
    if isinstance(seq_len, bool) or not isinstance(seq_len, int):
        raise ConfigError(f"seq_len must be a whole number of tokens, got {seq_len!r}",
                          what="model")
    name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    return from_hf_config(data, name=name, seq_len=seq_len)


def with_seq_len(model: ModelSpec, seq_len: int) -> ModelSpec:
    """``model`` trained on sequences of ``seq_len`` tokens, named ``NAME@seqN`` so that tables
    and reports say so (and the name resolves back to it); the same model at its own length."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise ConfigError(f"seq_len must be a positive whole number of tokens, got {seq_len!r}",
                          what=f"model {model.name!r}")
    if seq_len == model.seq_len:
        return model
    base = model.name.rpartition(SEQ_SUFFIX)[0] or model.name
    return ModelSpec.from_dict({**model.to_dict(), "seq_len": seq_len,
                                "name": f"{base}{SEQ_SUFFIX}{seq_len}"})
