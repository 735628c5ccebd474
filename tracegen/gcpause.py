"""Pause Python's cyclic garbage collector around the phases that allocate millions of objects.

Building a stage program (``PNode`` per op), encoding it and replaying a trace set create
millions of small containers and free almost none of them until the phase ends; none of them
form reference cycles, so reference counting reclaims them all. The cyclic collector
nevertheless rescans the growing heap every few hundred allocations, which took about half of
``generate`` (40 → 17-23 s) and a fifth of ``replay`` (31 → 24 s) on a 64-stage 1T-parameter
set. The collector is re-enabled (if it was on) when the phase returns or raises.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def gc_paused(fn: Callable[P, R]) -> Callable[P, R]:
    """Run ``fn`` with the cyclic collector off; nested uses leave it to the outermost."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()

    return wrapper
