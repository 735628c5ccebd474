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


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``did you mean 'tp'? `` for the known name nearest a misspelt one (difflib's ratio
    ≥ 0.6), or nothing where none is near."""
    near = difflib.get_close_matches(name, list(known), n=1)
    return f"did you mean {near[0]!r}? " if near else ""


def unknown_key(key: str, known: Iterable[str], *, label: str = "unknown key") -> str:
    """``unknown key 'tpp' (did you mean 'tp'? known keys: ...)``: a misspelt key named with the
    nearest known one, and every known key."""
    names = sorted(known)
    return f"{label} {key!r} ({did_you_mean(key, names)}known keys: {', '.join(names)})"


class TraceFormatError(TrainsimError):
    """A Chakra trace file or trace set that cannot be read."""


class ReplayError(TrainsimError):
    """A trace set that cannot be simulated to completion."""
