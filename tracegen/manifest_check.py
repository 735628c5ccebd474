"""The fields of a trace set's manifest that replay reads, checked once when it is read: a hand
edited or damaged ``manifest.json`` is named field by field as a ``TraceFormatError``, never a
``KeyError`` from deep inside replay."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MODES = ("full", "representative")
COORD_FIELDS = 5  # rank, pp, dp, cp, tp (``coords_order``)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def manifest_problems(data: dict[str, Any]) -> list[str]:
    """What is missing or malformed among the fields replay reads (empty: none)."""
    out: list[str] = []

    def want(key: str, ok: Callable[[Any], object], what: str) -> bool:
        if key not in data:
            out.append(f"'{key}' is missing")
            return False
        try:
            good = bool(ok(data[key]))
        except (TypeError, ValueError, AttributeError, KeyError, IndexError):
            good = False
        if not good:
            out.append(f"'{key}' must be {what}, got {_short(data[key])}")
        return good

    want("name", lambda v: isinstance(v, str) and v, "a non-empty string")
    want("mode", lambda v: v in MODES, "'full' or 'representative'")
    want("model", lambda v: isinstance(v, dict), "an object (the model's fields)")
    want("strategy", lambda v: isinstance(v, dict) and _int(v.get("global_batch_size"))
         and v["global_batch_size"] >= 1 and isinstance(v.get("recompute"), str),
         "an object with global_batch_size ≥ 1 and recompute")
    want("stages", lambda v: isinstance(v, list) and v and all(
        isinstance(s, dict) and isinstance(s["memory"]["total_GiB"], int | float) for s in v),
         "a list of stages, each with memory.total_GiB")
    if not want("world_size", lambda v: _int(v) and v >= 1, "a whole number ≥ 1"):
        return out
    world = data["world_size"]

    def rank(r: Any) -> bool:
        return _int(r) and 0 <= r < world

    within = f"ranks in 0..{world - 1}"
    want("ranks_written", lambda v: isinstance(v, list) and v and all(map(rank, v)),
         f"a non-empty list of {within}")
    want("multiplicity", lambda v: isinstance(v, dict) and all(
        str(k).isdigit() and rank(int(k)) and _int(m) and m >= 1 for k, m in v.items()),
         f"an object of {within} → count ≥ 1")
    want("groups", lambda v: isinstance(v, dict) and all(
        isinstance(g, dict) and isinstance(g["axis"], str) and isinstance(g["ranks"], list)
        and g["ranks"] and all(map(rank, g["ranks"])) for g in v.values()),
         f"an object of groups, each {{axis, ranks}} with {within}")
    want("coords", lambda v: isinstance(v, list) and all(
        isinstance(c, list) and len(c) == COORD_FIELDS and rank(c[0])
        and all(_int(x) and x >= 0 for x in c) for c in v),
         f"a list of [rank, pp, dp, cp, tp] rows with {within}")
    return out
