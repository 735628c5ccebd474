"""The preset catalog: named models, read from ``presets/models.toml``."""

from __future__ import annotations

import tomllib
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from tracegen.errors import ConfigError
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


SEQ_SUFFIX = "@seq"  # ``llama3-8b@seq32768``: the model trained at another sequence length


def resolve_model(name_or_file: str | Path) -> ModelSpec:
    """A preset name, or the path of a TOML/JSON model file; either with ``@seqN`` appended is
    that model trained at sequence length N (the name ``with_seq_len`` gives it)."""
    s = str(name_or_file)
    if s in _model_table():
        return get_model(s)
    if s.endswith((".toml", ".json")) or Path(s).exists():
        return ModelSpec.from_file(s)
    base, sep, length = s.rpartition(SEQ_SUFFIX)
    if sep and base:
        if not length.isdigit():
            raise ConfigError(f"{s!r}: write the sequence length after {SEQ_SUFFIX} as a whole "
                              f"number of tokens, e.g. {base}{SEQ_SUFFIX}8192", what="model")
        return with_seq_len(resolve_model(base), int(length))
    return get_model(s)


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
