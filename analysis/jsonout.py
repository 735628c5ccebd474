"""JSON that every parser reads: Python writes an infinite or NaN float as ``Infinity`` /
``NaN``, which JSON (RFC 8259) does not have — browsers' ``JSON.parse`` and jq refuse the whole
file. A run that never finishes (no goodput: days to train ∞) is written as ``null``."""

from __future__ import annotations

import json
import math
from typing import Any


def finite(obj: Any) -> Any:
    """``obj`` with every non-finite float replaced by None (in dicts, lists and tuples)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, **kw: Any) -> str:
    """Strict JSON text of ``obj`` (non-finite floats as null), with a final newline."""
    return json.dumps(finite(obj), allow_nan=False, **kw) + "\n"
