"""Megatron's data-parallel communication around the optimizer: ``--overlap-param-gather`` (the
distributed optimizer's parameter all-gathers open the next step) and, without
``--overlap-grad-reduce``, the gradient buckets after the backward (``finalize_model_grads``)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import polars as pl
import pytest

from analysis.fastpath import estimate
from replay import get_system, replay
from tracegen import ModelSpec, Strategy, generate
from tracegen import ops as O
from tracegen.dp_comm import bucket_plan, dp_group_size
from tracegen.program import RoleProgram

MODEL = ModelSpec(name="dpov", num_layers=8, hidden_size=1024, num_attention_heads=16,
                  ffn_hidden_size=4096, vocab_size=8192, seq_len=1024)
MOE = ModelSpec(name="dpmoe", num_layers=4, hidden_size=512, num_attention_heads=8,
                ffn_hidden_size=1024, vocab_size=4096, seq_len=512, activation="swiglu",
                num_experts=4, experts_per_token=2, moe_ffn_hidden_size=512)
SYSTEM = get_system("dgx-h100")
BASE = Strategy(dp=16, zero_stage=1, micro_batch_size=1, global_batch_size=32,
                dp_bucket_params=5_000_000)


def _timeline(model: ModelSpec, s: Strategy, tmp: Path) -> tuple[float, pl.DataFrame]:
    generate(model, s, tmp, mode="representative")
    res = replay(tmp, SYSTEM, contention=False)
    return res.step_time_s, res.timeline


@pytest.mark.parametrize(("model", "s"), [
    (MODEL, BASE),
    (MODEL, dataclasses.replace(BASE, pp=2, dp=8, global_batch_size=16)),
    (MODEL, dataclasses.replace(BASE, pp=2, dp=8, vpp=2, schedule="interleaved_1f1b",
                                global_batch_size=16)),
    (MOE, Strategy(dp=4, ep=2, zero_stage=2, global_batch_size=8, dp_bucket_params=1_000_000)),
])
def test_bucket_plan_is_what_the_backward_issues(model: ModelSpec, s: Strategy) -> None:
    """``bucket_plan`` (what the overlapped gathers and the fast path use) names the same
    buckets as the backward issues, on every stage and axis."""
    for stage in range(s.pp):
        prog = RoleProgram(model, s, stage)
        prog.build()
        planned = Counter()
        for c in range(s.vpp):
            blocks = prog.blocks_of_chunk(c * s.pp + stage, labels=False)
            for axis in ("dp", "edp"):
                size = dp_group_size(s, axis)
                if size > 1:
                    planned.update((axis, -(-n // size) * size)
                                   for _, n in bucket_plan(blocks, axis, s.dp_bucket_params))
        assert planned == Counter(prog.param_gathers)
        assert len(prog.param_gathers) > 1


def test_overlapped_gathers_open_the_step(tmp_path: Path) -> None:
    """With overlap the gathers run from the start of the step, each layer's first forward
    waits for its bucket, and nothing is gathered after the optimizer."""
    s = dataclasses.replace(BASE, overlap_param_gather=True)
    _, tl = _timeline(MODEL, s, tmp_path)
    tl = tl.filter(pl.col("rank") == 0)
    gathers = tl.filter(pl.col("name").str.contains("param_all_gather")).sort("start_s")
    assert gathers.height == len(bucket_plan(RoleProgram(MODEL, s, 0).blocks_of_chunk(0), "dp",
                                             s.dp_bucket_params))
    assert gathers["start_s"][0] == 0.0
    opt = tl.filter(pl.col("name").str.contains("adam_step"))
    assert gathers["end_s"].max() < opt["start_s"].min()
    first_fwd = tl.filter(pl.col("name").str.starts_with("F0.c0.L")).sort("start_s")
    assert first_fwd["start_s"][0] >= gathers["end_s"][0] - 1e-12


def test_one_bucket_leaves_nothing_to_hide_and_small_ones_save_at_most_the_gathers(
        tmp_path: Path) -> None:
    """One bucket holds every parameter: the first layer waits for all of it, so the step is
    as long as gathering after the optimizer (to the ns). With small buckets the step is
    shorter, by no more than the gathers took."""
    one = dataclasses.replace(BASE, dp_bucket_params=10**12)
    t_off, _ = _timeline(MODEL, one, tmp_path / "a")
    t_on, _ = _timeline(MODEL, dataclasses.replace(one, overlap_param_gather=True), tmp_path / "b")
    assert t_on == pytest.approx(t_off, abs=1e-9)
    t_off, tl = _timeline(MODEL, BASE, tmp_path / "c")
    t_on, _ = _timeline(MODEL, dataclasses.replace(BASE, overlap_param_gather=True),
                        tmp_path / "d")
    g = tl.filter((pl.col("rank") == 0) & pl.col("name").str.contains("param_all_gather"))
    gathered_s = (g["end_s"] - g["start_s"]).sum()
    assert t_on < t_off
    assert t_off - t_on <= gathered_s + 1e-9
    fast = estimate(MODEL, dataclasses.replace(BASE, overlap_param_gather=True), SYSTEM)
    # to the tens of ns: the fast path rounds each block's slowed forward to a ns, replay its
    # re-rated kernel ends (4 ns apart without the attention occupancy term, 18 with it)
    assert fast.step_time_s == pytest.approx(t_on, abs=5e-8)


@pytest.mark.parametrize("zero", [0, 3])
def test_overlap_param_gather_changes_nothing_without_a_post_step_gather(zero: int) -> None:
    s = dataclasses.replace(BASE, zero_stage=zero)
    on = dataclasses.replace(s, overlap_param_gather=True)
    assert estimate(MODEL, on, SYSTEM).step_time_s == estimate(MODEL, s, SYSTEM).step_time_s
    names = [n.name for n in RoleProgram(MODEL, on, 0).build()]
    assert names == [n.name for n in RoleProgram(MODEL, s, 0).build()]


def test_unoverlapped_grad_buckets_follow_the_last_send(tmp_path: Path) -> None:
    """Without overlap_grad_reduce the buckets run after the whole backward, as Megatron's
    finalize_model_grads does: the last stage has issued its last input gradient's send first,
    so the stage before it is not held up."""
    s = dataclasses.replace(BASE, pp=2, dp=8, global_batch_size=16, overlap_grad_reduce=False)
    t_off, tl = _timeline(MODEL, s, tmp_path)
    last = tl.filter(pl.col("rank") == s.world_size // 2)
    sends = last.filter(pl.col("name").str.ends_with("send_grad"))
    buckets = last.filter(pl.col("name").str.contains("grad_reduce_scatter"))
    assert buckets.height > 1 and buckets["start_s"].min() >= sends["start_s"].max()
    assert estimate(MODEL, s, SYSTEM).step_time_s == pytest.approx(t_off, rel=1e-6)
    nbytes = sum(n.comm_bytes for n in RoleProgram(MODEL, s, 1).build()
                 if "grad_reduce_scatter" in n.name)
    params = sum(RoleProgram(MODEL, s, 1).stage_params().values())
    assert nbytes >= params * O.GRAD_REDUCE_BYTES  # every gradient is reduced once (padded)
