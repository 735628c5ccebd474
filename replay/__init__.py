"""replay: discrete-event simulation of any Chakra trace set with GPU and network models."""

from __future__ import annotations

from replay.api import replay
from replay.hardware import SystemSpec, get_system, resolve_system, system_names
from replay.results import ReplayResult
from replay.traceset import TraceSet, load_trace_set

__all__ = ["ReplayResult", "SystemSpec", "TraceSet", "get_system", "load_trace_set", "replay",
           "resolve_system", "system_names"]
