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


def resolve_model(name_or_file: str | Path) -> ModelSpec:
    """A preset name, or the path of a TOML/JSON model file."""
    s = str(name_or_file)
    if s in _model_table():
        return get_model(s)
    if s.endswith((".toml", ".json")) or Path(s).exists():
        return ModelSpec.from_file(s)
    return get_model(s)
