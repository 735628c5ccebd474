"""The preset catalog: named models, read from ``presets/models.toml``."""

from __future__ import annotations

import math
import tomllib
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from tracegen._config import load_mapping
from tracegen.errors import ConfigError, did_you_mean
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
            f"no preset model named {name!r}; {did_you_mean(name, table)}presets: "
            f"{', '.join(table)} "
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


def resolve_model(name_or_file: str | Path, seq_len: int = 0, documents: str = "") -> ModelSpec:
    """A preset name, the path of a TOML/JSON model file, or a Hugging Face ``config.json``
    (``tracegen.hf_config``); any of them with ``@seqN`` appended, or ``seq_len`` given, is that
    model trained at sequence length N (the name ``with_seq_len`` gives it). A Hugging Face
    config needs one of the two: it does not say what a run trains at. ``@docMEAN~SIGMA``
    appended last, or ``documents`` given as ``MEAN~SIGMA``, trains it under a document mask
    (``with_documents``)."""
    if documents:
        mean, sigma = parse_documents(documents)
        return with_documents(resolve_model(name_or_file, seq_len), mean, sigma)
    s = str(name_or_file)
    base, sep, docs = s.rpartition(DOC_SUFFIX)
    if sep and base and s not in _model_table() and not Path(s).exists():
        mean, sigma = parse_documents(docs, example=f"{base}{DOC_SUFFIX}2000~1.0")
        return with_documents(resolve_model(base, seq_len), mean, sigma)
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


# Keys a transformers config.json has and a trainsim model file never does
HF_ONLY_KEYS = frozenset({"num_hidden_layers", "intermediate_size", "architectures",
                          "num_key_value_heads", "max_position_embeddings"})


def _model_file(path: Path, seq_len: int) -> ModelSpec:
    """A trainsim model file, or a Hugging Face config (named after its folder where the file
    is the usual ``config.json``)."""
    data = load_mapping(path, what="model file")
    if not is_hf_config(data):
        hf_keys = sorted(HF_ONLY_KEYS & set(data))
        if hf_keys:  # (read as a trainsim file it would be a list of unknown keys)
            raise ConfigError(f"{path} looks like a Hugging Face config.json "
                              f"({', '.join(hf_keys)}) without its model_type: add the "
                              "family's (e.g. \"model_type\": \"llama\", \"qwen3_moe\"), "
                              "or write a trainsim model file (`trainsim catalog NAME` prints "
                              "one)", what="model file")
        if "seq_len" not in data and not seq_len:
            raise ConfigError(f"{path} has no seq_len: add seq_len = N (tokens a sequence) to "
                              "it, or give --seq-len N", what="model file")
        # --seq-len (or @seqN) gives a file without its own seq_len one
        given = {"seq_len": seq_len} if "seq_len" not in data else {}
        return ModelSpec.from_dict({"name": path.stem, **given, **data})
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
    name, docs = _split_documents(model)
    base = name.rpartition(SEQ_SUFFIX)[0] or name
    return ModelSpec.from_dict({**model.to_dict(), "seq_len": seq_len,
                                "name": f"{base}{SEQ_SUFFIX}{seq_len}{docs}"})


DOC_SUFFIX = "@doc"  # ``llama3-8b@doc2000~1.0``: trained on documents of 2,000 tokens, log-σ 1


def parse_documents(text: str, *, example: str = "2000~1.0") -> tuple[int, float]:
    """``MEAN[~SIGMA]``: the mean document length in tokens and the log-σ of their lengths
    (``ModelSpec.document_mean_tokens``, ``document_length_sigma``; σ 0 where not given)."""
    mean, _, sigma = text.partition("~")
    try:
        out = int(mean), float(sigma or 0)
    except ValueError:
        out = (0, 0.0)
    if out[0] <= 0 or not math.isfinite(out[1]):
        raise ConfigError(f"{text!r}: give the documents as MEAN[~SIGMA], the mean length in "
                          f"whole tokens and the σ of the lengths' logarithm, e.g. {example}",
                          what="model")
    return out


def with_documents(model: ModelSpec, mean_tokens: int, sigma: float) -> ModelSpec:
    """``model`` trained on documents of ``mean_tokens`` on average (log-σ ``sigma``) under a
    document mask, named ``NAME@docMEAN~SIGMA`` (the name resolves back to it)."""
    name, _ = _split_documents(model)
    return ModelSpec.from_dict({**model.to_dict(), "document_mean_tokens": mean_tokens,
                                "document_length_sigma": sigma,
                                "name": f"{name}{DOC_SUFFIX}{mean_tokens}~{_short(sigma)}"})


def _short(x: float) -> str:
    """The shortest text that reads back as ``x`` ("1" for 1.0, "0.1", "1.2345678"): the name
    must resolve to the same σ (a sweep's workers rebuild the model from it)."""
    text = repr(float(x))
    return text[:-2] if text.endswith(".0") else text


def _split_documents(model: ModelSpec) -> tuple[str, str]:
    """The model's name without its document suffix, and the suffix ("" without one)."""
    if not model.document_mean_tokens:
        return model.name, ""
    base, sep, docs = model.name.rpartition(DOC_SUFFIX)
    return (base, sep + docs) if sep and base else (model.name, "")
