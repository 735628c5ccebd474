"""A MoE layer's experts as a grouped GEMM (Megatron-Core's ``TEGroupedMLP``: one GEMM per local
expert, Transformer Engine's ``GroupedLinear``): what the ops carry, how long the GPU model
says they take against one GEMM of the same FLOPs, and that the trace says it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as hs

from replay import get_system
from replay.compute import GROUPED_GEMM_STREAMS, RooflineCompute
from replay.reader import read_et
from tests.test_deepep import MOE
from tracegen import Strategy, generate
from tracegen.ops import (
    ACT_BYTES,
    DTYPE_BYTES,
    Op,
    gemm,
    grouped_gemm,
    grouped_gemm_bwd,
    layer_bwd,
    layer_fwd,
)
from tracegen.units import DTYPE_CODE

H100 = RooflineCompute(get_system("dgx-h100").gpu)
H, F = MOE.hidden_size, MOE.moe_ffn_hidden_size
TOKENS = MOE.seq_len  # micro-batch 1, tp 1


def _ns(op: Op, backward: bool = False) -> int:
    return H100.op_ns(op.kind, op.flop, op.bytes, op.m, op.n, DTYPE_CODE[op.dtype], backward,
                      op.k, op.splits, op.groups)


def _experts(ep: int) -> dict[str, Op]:
    s = Strategy(dp=64, ep=ep, global_batch_size=64)
    return {it.name: it for it in [*layer_fwd(MOE, s), *layer_bwd(MOE, s)]
            if isinstance(it, Op) and it.name.startswith("expert_fc")}


def test_each_expert_runs_its_share_of_the_tokens() -> None:
    """64 experts at ep 8: 8 on a rank, each with an eighth of the rank's tokens·k copies. The
    forward and data-gradient GEMMs are that short; each weight gradient reduces over them."""
    ops = _experts(8)
    copies = TOKENS * MOE.experts_per_token
    share = copies // 8
    fc1, fc2 = ops["expert_fc1"], ops["expert_fc2"]
    assert {o.groups for o in ops.values()} == {8}
    assert (fc1.m, fc1.n, fc1.k) == (share, 2 * F, H)  # SwiGLU: gate and up together
    assert (ops["expert_fc1_dgrad"].m, ops["expert_fc1_dgrad"].n) == (share, H)
    assert (ops["expert_fc1_wgrad"].m, ops["expert_fc1_wgrad"].n,
            ops["expert_fc1_wgrad"].k) == (H, 2 * F, share)
    assert (fc2.m, fc2.n, fc2.k) == (share, H, F)
    # the FLOPs of one GEMM over all the copies; every expert's weights read
    assert fc1.flop == gemm("x", copies, 2 * F, H, "bf16").flop
    e = DTYPE_BYTES["bf16"]
    assert fc1.bytes == copies * H * e + 8 * H * 2 * F * e + copies * 2 * F * ACT_BYTES
    assert {o.name: o.flop for o in ops.values()} == {
        o.name: o.flop for o in layer_fwd(MOE, Strategy(dp=64, ep=64, global_batch_size=64))
        + layer_bwd(MOE, Strategy(dp=64, ep=64, global_batch_size=64))
        if isinstance(o, Op) and o.name.startswith("expert_fc")}  # same work per rank


def test_one_expert_per_rank_is_a_plain_gemm() -> None:
    assert {o.groups for o in _experts(64).values()} == {1}


@given(rows=hs.integers(1, 1 << 16), n=hs.sampled_from([512, 1536, 3072, 7168]),
       k=hs.sampled_from([512, 2048, 4096, 7168]), groups=hs.integers(2, 64))
def test_a_grouped_gemm_is_one_gemm_of_its_flops_plus_weights_and_launches(
        rows: int, n: int, k: int, groups: int) -> None:
    """Split over experts along the tokens, the same FLOPs fill the GPU as one GEMM of all the
    rows would; the group reads every expert's weights and launches a kernel per expert on
    each of four streams: never faster than the one GEMM, and one group is exactly it."""
    one, grouped = gemm("g", rows, n, k, "bf16"), grouped_gemm("g", rows, n, k, "bf16", groups)
    assert grouped.flop == one.flop and grouped.bytes >= one.bytes
    assert grouped_gemm("g", rows, n, k, "bf16", 1) == one
    launches = -(-groups // GROUPED_GEMM_STREAMS)
    assert _ns(one) <= _ns(grouped) <= max(
        _ns(one), _ns(dataclasses.replace(one, bytes=grouped.bytes))
    ) + (launches - 1) * H100.gpu.launch_overhead_ns


def test_the_kernels_of_a_group_share_four_streams() -> None:
    """A memory-bound group pays one launch gap per kernel on each of Transformer Engine's four
    streams, in turn: 1-4 GEMMs one gap, 5-8 two, beside what its bytes take."""
    gap = H100.gpu.launch_overhead_ns
    ops = [Op("t", "gemm", 8, 1 << 24, 1, 1, 1, groups=g) for g in (1, 2, 4, 5, 8, 9)]
    assert [_ns(op) - _ns(ops[0]) for op in ops] == [0, 0, 0, gap, gap, 2 * gap]
    assert GROUPED_GEMM_STREAMS == 4


def test_few_tokens_per_expert_slow_the_weight_gradient() -> None:
    """Qwen3-235B's experts (h 4,096, 1,536 wide) with 8,192 copies on a rank: on 16 experts
    each weight gradient reduces over 512 tokens, on one GEMM over 8,192 — the short reduction
    runs at the K curve's 512 point (``GPUSpec.gemm_k_factor``), 20-30% slower."""
    rows, n, k = 8192, 2 * 1536, 4096
    one = gemm("w_wgrad", k, n, rows, "bf16")
    grouped = grouped_gemm_bwd(grouped_gemm("w", rows, n, k, "bf16", 16))[1]
    assert (grouped.m, grouped.n, grouped.k, grouped.flop) == (k, n, rows // 16, one.flop)
    ratio = _ns(grouped, True) / _ns(one, True)
    kf = H100.gpu.gemm_k_factor
    assert ratio == pytest.approx(kf(rows, "bf16") / kf(rows // 16, "bf16"), rel=0.03)
    assert 1.2 < ratio < 1.3


def test_the_trace_carries_the_group(tmp_path: Path) -> None:
    """The writer puts ``gemm_groups`` on a grouped GEMM's node; the reader takes it back and
    replay times it as the group."""
    s = Strategy(dp=8, ep=8, global_batch_size=8)
    generate(dataclasses.replace(MOE, num_layers=1), s, tmp_path)
    rank = read_et(next(tmp_path.glob("*.0.et")), 0)
    groups = {n.name.rsplit(".", 1)[-1]: n.attrs.get("gemm_groups")
              for n in rank.nodes if "expert_fc" in n.name}
    assert groups and set(groups.values()) == {8}, groups
