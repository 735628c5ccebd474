"""Grouped-query attention against trainsim's own device measurement:
``bench/device/measure_hopper.py`` section ``attention_gqa`` on an H200 SXM on 2026-12-04
(``bench/device/results/h200-2026-12-04-gqa-run1.json``): causal calls of 8, 16 and 64 query
heads of 128 at 2K and 8K tokens (16K tokens a call), each with as many K/V heads, a quarter
and an eighth as many (Llama 3's 8 K/V heads of 64: 1 a rank at tp 8), cuDNN 9.19 and
FlashAttention-2. The compute model costs attention by its query heads' FLOPs and reads no
K/V head count: the measurement says how far that holds. No GPU is needed."""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from typing import Any

import pytest

from analysis.device_runs import RESULTS
from replay import get_system
from replay.compute import RooflineCompute
from tracegen import Strategy, get_model
from tracegen import ops as O

RUN = RESULTS / "h200-2026-12-04-gqa-run1.json"


@cache
def _pairs() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(GQA call, the same call with a K/V head per query head) for every GQA call measured."""
    with RUN.open(encoding="utf-8") as f:
        rows = [r for r in json.load(f)["attention_gqa"] if "error" not in r]
    full = {(r["backend"], r["seq"], r["heads"]): r for r in rows if r["kv_heads"] == r["heads"]}
    return [(r, full[r["backend"], r["seq"], r["heads"]]) for r in rows
            if r["kv_heads"] < r["heads"]]


def test_the_measurement_covers_both_kernels_and_both_lengths() -> None:
    pairs = _pairs()
    assert len(pairs) == 24
    assert {(g["backend"], g["seq"]) for g, _ in pairs} == {
        (b, s) for b in ("cudnn", "flash") for s in (2048, 8192)}


@pytest.mark.parametrize(("pass_", "low", "high"), [("fwd_ms", 0.95, 1.01),
                                                    ("bwd_ms", 1.0, 1.08)])
def test_sharing_kv_heads_leaves_the_forward_and_slows_the_backward_a_little(
        pass_: str, low: float, high: float) -> None:
    """GQA over MHA time at the same query heads: the forward 0-4% faster (it reads fewer K/V,
    computes the same), the backward 1-7% slower (dK and dV summed over each group: 3-7% at
    2K tokens, 1-3% at 8K)."""
    ratios = [g[pass_] / m[pass_] for g, m in _pairs()]
    assert low < min(ratios) and max(ratios) < high
    if pass_ == "bwd_ms":
        short = [g[pass_] / m[pass_] for g, m in _pairs() if g["seq"] == 2048]
        long = [g[pass_] / m[pass_] for g, m in _pairs() if g["seq"] == 8192]
        assert min(short) > 1.02 and max(long) < 1.035


def test_the_model_costs_gqa_attention_as_its_query_heads() -> None:
    """The compute model reads no K/V head count: Llama 3 8B's attention (32 query heads, 8
    K/V) costs what the same layer with 32 K/V heads costs, forward and backward: the
    kernels' own GQA cost (above, at most 7% of the attention backward) is not modelled."""
    m = get_model("llama3-8b")
    mha = dataclasses.replace(m, num_kv_heads=m.num_attention_heads)
    s = Strategy(global_batch_size=1)
    c = RooflineCompute(get_system("hgx-h200").gpu)

    def attn(model: Any) -> list[O.Op]:
        fwd = [it for it in O.layer_fwd(model, s) if isinstance(it, O.Op)
               and it.kind == "attention"]
        bwd = [it for it in O.layer_bwd(model, s) if isinstance(it, O.Op)
               and it.kind == "attention"]
        return fwd + bwd

    assert [c.op_time_ns(op) for op in attn(m)] == [c.op_time_ns(op) for op in attn(mha)]
