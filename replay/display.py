"""How results show in a REPL and in Jupyter: a one-line ``repr`` with the figures a planner
looks for first, and an HTML table (Jupyter's ``_repr_html_`` convention, as pandas and polars
frames have) — not the dump of a 100,000-row timeline that a dataclass's repr would print."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

# (key, label, format) of the step figures, in the order shown
FIGURES: tuple[tuple[str, str, str], ...] = (
    ("step_time_s", "step time s", ".4f"), ("tokens_per_s", "tokens/s", ",.0f"),
    ("mfu", "MFU", ".1%"), ("hfu", "HFU", ".1%"), ("peak_memory_GiB", "peak memory GiB", ".1f"),
    ("peak_host_memory_GiB", "host memory GiB a host", ".1f"), ("fits", "fits", ""))


def figures(values: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, text) of each figure ``values`` holds."""
    return [(label, format(values[k], fmt)) for k, label, fmt in FIGURES
            if values.get(k) is not None]


def one_line(kind: str, title: str, values: dict[str, Any]) -> str:
    inner = ", ".join(f"{label} {text}" for label, text in figures(values))
    return f"<{kind} {title}: {inner}>"


def html_table(title: str, rows: Sequence[tuple[str, str]], below: str = "") -> str:
    """A two-column table of (label, text) under a title; ``below``: more HTML after it."""
    body = "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th>"
                   f"<td style='text-align:right'>{html.escape(v)}</td></tr>" for k, v in rows)
    return (f"<div><b>{html.escape(title)}</b><table>{body}</table>{below}</div>")
