"""Helpers to build frozen dataclass configs from untrusted dicts and files."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import operator
import tomllib
from pathlib import Path
from typing import Any, TypeGuard, TypeVar

from tracegen.errors import ConfigError, unknown_key

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
    problems = [unknown_key(k, fields) for k in data if k not in fields]
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


class _FieldKinds:
    """A config class's fields by kind, read once: the int, bool, float and string ones
    (``Literal`` aliases count as strings), and a getter of each kind's values as a tuple."""

    def __init__(self, cls: type) -> None:
        kinds: dict[str, type] = {"int": int, "bool": bool, "float": float, "str": str}
        self.names: dict[str, tuple[str, ...]] = {k: () for k in kinds}
        for f in dataclasses.fields(cls):
            ann = str(f.type)
            kind = ann if ann in kinds else "str"
            self.names[kind] = (*self.names[kind], f.name)
        self.order = tuple(n for k in kinds for n in self.names[k])
        self.get = operator.attrgetter(*self.order)
        self.types = tuple(t for k, t in kinds.items() for _ in self.names[k])


_KINDS: dict[type, _FieldKinds] = {}


def field_type_problems(obj: Any) -> list[str]:
    """What is wrong with the field types of a config built directly (in Python, in a notebook)
    rather than by ``build``: each int field must be an integer — a NumPy integer or a whole
    float (a pandas column's) is taken as one and stored as an ``int`` — each bool field true
    or false (NumPy's too), each string field a string. One comparison of type tuples when all
    are plain (a sweep builds many)."""
    kinds = _KINDS.get(type(obj))
    if kinds is None:
        kinds = _KINDS[type(obj)] = _FieldKinds(type(obj))
    values = kinds.get(obj)
    if tuple(map(type, values)) == kinds.types:
        return []
    problems = []
    for name, value, want in zip(kinds.order, values, kinds.types, strict=True):
        fixed, problem = _coerced(want, name, value)
        if problem:
            problems.append(problem)
        elif fixed is not value:
            object.__setattr__(obj, name, fixed)
    return problems


def _coerced(kind: type, name: str, value: Any) -> tuple[Any, str | None]:
    """(the value as the field's type, or a problem naming what it must be)."""
    if kind is int:
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return int(value), None
        if isinstance(value, float) and value.is_integer():
            return int(value), None
        return value, f"{name} must be an integer, got {value!r}"
    if kind is bool:
        if isinstance(value, bool) or getattr(getattr(value, "dtype", None), "kind", "") == "b":
            return bool(value), None
        return value, f"{name} must be true or false, got {value!r}"
    if kind is float:
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(
                value):
            return float(value), None
        return value, f"{name} must be a finite number, got {value!r}"
    if isinstance(value, str):
        return value, None
    return value, f"{name} must be a string, got {value!r}"
