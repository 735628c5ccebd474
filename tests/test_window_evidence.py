"""Sliding-window attention against trainsim's own device measurement:
``bench/device/measure_window.py`` on an H200 SXM on 2026-12-04 (results committed under
``bench/device/results/``). The image had no FlashAttention, Transformer Engine or cuDNN
frontend with a window; FlexAttention (``torch.compile``d, block-sparse) timed causal calls of
512-16K tokens and windows of 128-4,096 in 4K-32K tokens. What the model takes from it is a
ratio, not a rate: a windowed call runs at the efficiency of a causal call whose queries see as
many keys on average (the key length 2·pairs/s), less its band's edge (``band_edge``), with the
occupancy of its own query tiles. No GPU is needed: the numbers are data."""

from __future__ import annotations

import itertools
import json
import math
from functools import cache
from typing import Any

import pytest

from analysis.device_runs import RESULTS
from replay import get_system
from replay.compute import RooflineCompute, band_edge
from tracegen.units import DTYPE_CODE

RUN = RESULTS / "h200-2026-12-04-window-run1.json"
HEADS, HEAD_DIM, TOKENS = 16, 128, 16384  # the script's calls (measure_window.py)


@cache
def _flex() -> list[dict[str, Any]]:
    with RUN.open(encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return [r for r in data["window_flex"] if "skipped" not in r]


def _causal_eff(keys: float, key: str) -> float:
    """The measured causal efficiency at ``keys`` tokens, log-linear between the lengths
    measured (16K tokens a call)."""
    pts = sorted((r["seq"], r[key]) for r in _flex() if r["window"] == 0)
    for (s0, e0), (s1, e1) in itertools.pairwise(pts):
        if s0 <= keys <= s1:
            t = math.log(keys / s0) / math.log(s1 / s0)
            return e0 + t * (e1 - e0)
    raise AssertionError(f"{keys} keys is outside the causal calls measured")


def _model_eff(seq: int, kv: int, batch: int, backward: bool) -> float:
    """The compute model's efficiency for one call of the script's shape (H200 preset)."""
    pairs2 = seq * kv  # (the op's FLOPs carry 2·s·n·d·b·heads whatever its kind)
    flop = 2 * batch * pairs2 * HEAD_DIM * HEADS * (5 if backward else 2) // 2
    c = RooflineCompute(get_system("hgx-h200").gpu)
    return c.explain("attention", flop, 0, seq, kv, DTYPE_CODE["bf16"], backward,
                     HEAD_DIM).efficiency


def _windows() -> list[dict[str, Any]]:
    # (below 512 keys the causal curve has no measured point to read a window against)
    return [r for r in _flex() if r["window"] and r["keys_equiv"] >= 512]


def test_the_measurement_is_flexattention_on_an_h200() -> None:
    with RUN.open(encoding="utf-8") as f:
        data = json.load(f)
    assert data["kernels"][0]["device"] == "NVIDIA H200"
    assert len(_windows()) == 6 and {r["window"] for r in _windows()} == {512, 1024, 4096}


@pytest.mark.parametrize("key", ["fwd_eff", "bwd_eff"])
def test_a_window_runs_as_a_causal_call_of_its_key_length_less_its_band_edge(key: str) -> None:
    """Measured windowed / causal efficiency at the same key length against the model's (band
    edge and the two calls' tile occupancy): within 4% for every window of 512-4,096 tokens in
    4K-32K-token sequences (forward and backward). Without the band edge the windows of 512
    and 1,024 would be 10% and 6% too fast."""
    backward = key == "bwd_eff"
    for r in _windows():
        seq, kv = r["seq"], r["keys_equiv"]
        measured = r[key] / _causal_eff(kv, key)
        model = (_model_eff(seq, kv, r["batch"], backward)
                 / _model_eff(kv, kv, TOKENS // kv, backward))
        assert model == pytest.approx(measured, rel=0.04), (seq, r["window"])
    r512 = next(r for r in _windows() if r["window"] == 512)
    assert r512[key] / _causal_eff(r512["keys_equiv"], key) < 0.92  # (1.0 without the edge)


def test_the_band_edge_is_one_key_tile_a_query_tile() -> None:
    """(n + 128)/(n + 256): a causal row wastes half a 128-key tile at its diagonal, a window's
    row a whole one more; 1 where the op is not a window (its key length not below its
    queries')."""
    assert band_edge(16384, 1984) == pytest.approx(2112 / 2240)
    assert band_edge(4096, 4096) == band_edge(2048, 4096) == band_edge(4096, 0) == 1.0


def test_the_runs_cudnn_calls_repeat_the_curves_measurement() -> None:
    """The same run's causal cuDNN calls, 512-16K tokens at 16K tokens a call, against run 4's
    (the presets' fit): within 3% at every length, another machine."""
    with RUN.open(encoding="utf-8") as f:
        now = {r["seq"]: r["fwd_tflops"] for r in json.load(f)["window_cudnn"]
               if r["kernel"] == "cudnn"}
    with (RESULTS / "h200-2026-11-30-run4.json").open(encoding="utf-8") as f:
        then = {r["seq"]: r["fwd_tflops"] for r in json.load(f)["attention"]
                if r.get("backend") == "cudnn" and r.get("causal") and r.get("d") == 128}
    assert sorted(now) == sorted(then) == [512, 1024, 2048, 4096, 8192, 16384]
    for seq, tflops in now.items():
        assert tflops == pytest.approx(then[seq], rel=0.03)
