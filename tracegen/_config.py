"""Helpers to build frozen dataclass configs from untrusted dicts and files."""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from pathlib import Path
from typing import Any, TypeGuard, TypeVar

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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_finite_number(v: Any) -> TypeGuard[int | float]:
    """A finite number: TOML and JSON can spell nan and inf, which no config value means."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


# Annotation prefix → (check, what the value must be).
_TYPE_CHECKS: tuple[tuple[str, Any, str], ...] = (
    ("int", _is_int, "an integer"),
    ("bool", lambda v: isinstance(v, bool), "true or false"),
    ("str", lambda v: isinstance(v, str), "a string"),
    ("Literal", lambda v: isinstance(v, str), "a string"),
    ("float", is_finite_number, "a finite number"),
)


def _type_problem(name: str, value: Any, annotation: Any) -> str | None:
    ann = str(annotation)
    for prefix, check, what in _TYPE_CHECKS:
        if ann.startswith(prefix):
            return None if check(value) else f"{name} must be {what}, got {value!r}"
    return None
