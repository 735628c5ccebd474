"""The one error hierarchy of trainsim.

::

    TrainsimError                 base: the CLI catches this and prints ``Name: message``
    ├── ConfigError               a model, strategy, system or study that is invalid
    ├── TraceFormatError          a trace file or trace set that cannot be read
    └── ReplayError               a trace set that cannot be simulated to the end

Every message says what is wrong, with the offending values, and what would fix it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class TrainsimError(Exception):
    """Base of every error trainsim raises on purpose."""


class ConfigError(TrainsimError):
    """Invalid model, strategy, system or study input."""

    def __init__(self, problems: str | list[str], *, what: str = "configuration") -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.what = what
        if len(self.problems) == 1:
            msg = f"invalid {what}: {self.problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            msg = f"invalid {what} ({len(self.problems)} problems):\n{lines}"
        super().__init__(msg)


def unknown_key(key: str, known: Iterable[str], *, label: str = "unknown key") -> str:
    """``unknown key 'tpp' (did you mean 'tp'? known keys: ...)``: a misspelt key named with the
    nearest known one (difflib's ratio ≥ 0.6), and every known key."""
    names = sorted(known)
    near = difflib.get_close_matches(key, names, n=1)
    hint = f"did you mean {near[0]!r}? " if near else ""
    return f"{label} {key!r} ({hint}known keys: {', '.join(names)})"


class TraceFormatError(TrainsimError):
    """A Chakra trace file or trace set that cannot be read."""


class ReplayError(TrainsimError):
    """A trace set that cannot be simulated to completion."""
