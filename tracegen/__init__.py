"""tracegen: model + strategy → per-rank Chakra execution traces."""

from __future__ import annotations

__version__ = "0.1.0"

from tracegen.catalog import get_model, model_names, resolve_model, with_seq_len
from tracegen.errors import ConfigError, ReplayError, TraceFormatError, TrainsimError
from tracegen.model import ModelSpec
from tracegen.strategy import Strategy
from tracegen.traceset import TraceSetSummary, generate, read_manifest

__all__ = [
    "ConfigError",
    "ModelSpec",
    "ReplayError",
    "Strategy",
    "TraceFormatError",
    "TraceSetSummary",
    "TrainsimError",
    "__version__",
    "generate",
    "get_model",
    "model_names",
    "read_manifest",
    "resolve_model",
    "with_seq_len",
]
