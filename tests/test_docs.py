"""The README's numbers are the tool's current numbers: its `make demo` table (replayed step
times of the default study) against the fast path, which tracks replay within 0.6% on these four
layouts. A physics change that moves a step by more than 1% fails here until the README is
updated (smaller drifts need a replay to see: `make demo`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from analysis.compare import strategy_fields
from analysis.fastpath import estimate
from analysis.study import load_study

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| (\d) \| (\S+) \| ([\d.]+) \| ([\d,]+) \|", re.MULTILINE)


def _readme_rows() -> dict[str, tuple[float, float]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return {m[2]: (float(m[3]), float(m[4].replace(",", ""))) for m in ROW.finditer(text)}


def test_readme_demo_table_matches_the_default_study() -> None:
    rows = _readme_rows()
    study = load_study(ROOT / "analysis" / "studies" / "default.toml")
    assert len(rows) == len(study.strategies) == 4
    tokens_per_step = study.global_batch_size * study.model.seq_len
    for s in study.strategies:
        label = strategy_fields(s)["strategy"]
        assert label in rows, f"README lacks {label}"
        step_s, tokens_per_s = rows[label]
        assert estimate(study.model, s, study.system).step_time_s == pytest.approx(step_s,
                                                                                  rel=0.01)
        assert tokens_per_step / step_s == pytest.approx(tokens_per_s, rel=0.001)
