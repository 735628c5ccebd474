"""Helpers to build frozen dataclass configs from untrusted dicts and files."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path
from typing import Any, TypeVar

from tracegen.errors import ConfigError

T = TypeVar("T")


def load_mapping(path: Path, *, what: str) -> dict[str, Any]:
    """Read a TOML or JSON file into a dict, with a clear error for anything else."""
    if not path.is_file():
        raise ConfigError(f"file {str(path)!r} does not exist", what=what)
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        data = json.loads(text) if path.suffix.lower() == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(
            f"{path} is not valid {'JSON' if path.suffix.lower() == '.json' else 'TOML'}: {exc}",
            what=what,
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a table of keys, got {type(data).__name__}", what=what)
    return data


def build(cls: type[T], data: dict[str, Any], *, what: str) -> T:
    """Construct ``cls`` from ``data``, rejecting unknown keys and wrong types with one message."""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    problems = [
        f"unknown key {k!r} (known keys: {', '.join(sorted(fields))})"
        for k in data
        if k not in fields
    ]
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        if name not in fields:
            continue
        problem = _type_problem(name, value, fields[name].type)
        if problem:
            problems.append(problem)
        else:
            kwargs[name] = value
    required = [
        n
        for n, f in fields.items()
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and n not in data
    ]
    problems += [f"missing required key {n!r}" for n in required]
    if problems:
        raise ConfigError(problems, what=what)
    return cls(**kwargs)


def _type_problem(name: str, value: Any, annotation: Any) -> str | None:
    ann = str(annotation)
    if ann.startswith("int") or ann == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            return f"{name} must be an integer, got {value!r}"
    elif ann.startswith("bool"):
        if not isinstance(value, bool):
            return f"{name} must be true or false, got {value!r}"
    elif ann.startswith("str") or ann.startswith("Literal") or ann.endswith("Name"):
        if not isinstance(value, str):
            return f"{name} must be a string, got {value!r}"
    elif ann.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, int | float):
            return f"{name} must be a number, got {value!r}"
    return None
