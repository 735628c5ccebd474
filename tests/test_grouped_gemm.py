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
from replay.compute import RooflineCompute
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


@given(share=hs.integers(1, 1 << 13), n=hs.sampled_from([512, 1536, 3072, 7168]),
       k=hs.sampled_from([512, 2048, 4096, 7168]), groups=hs.integers(2, 64))
def test_a_grouped_gemm_is_its_experts_gemms_one_after_another(
        share: int, n: int, k: int, groups: int) -> None:
    """Each expert's GEMM runs on its own tiles, in turn (measured on an H200: the four streams
    Transformer Engine spreads them over do not fill the GPU side by side): the group's
    tensor-core time is ``groups`` times one expert's, each kernel launched, and it is never
    faster than one GEMM of all the rows."""
    rows = share * groups
    one, grouped = gemm("g", rows, n, k, "bf16"), grouped_gemm("g", rows, n, k, "bf16", groups)
    expert = gemm("e", share, n, k, "bf16")
    assert grouped.flop == one.flop == groups * expert.flop and grouped.bytes >= one.bytes
    assert grouped_gemm("g", rows, n, k, "bf16", 1) == one
    cost = H100.explain(*_key(grouped))
    assert cost.compute_ns == pytest.approx(groups * H100.explain(*_key(expert)).compute_ns,
                                            abs=groups)
    assert cost.launch_ns == groups * H100.gpu.launch_overhead_ns
    assert _ns(grouped) >= _ns(one)


def _key(op: Op) -> tuple[object, ...]:
    return (op.kind, op.flop, op.bytes, op.m, op.n, DTYPE_CODE[op.dtype], False, op.k,
            op.splits, op.groups)


def test_each_kernel_of_a_group_pays_its_launch_gap() -> None:
    """A memory-bound group pays one launch gap per expert's kernel beside what its bytes take
    (the streams do not hide them: ``bench/device`` 2026-12-04)."""
    gap = H100.gpu.launch_overhead_ns
    ops = [Op("t", "gemm", 8, 1 << 24, 1, 1, 1, groups=g) for g in (1, 2, 4, 5, 8, 9)]
    assert [_ns(op) - _ns(ops[0]) for op in ops] == [0, gap, 3 * gap, 4 * gap, 7 * gap, 8 * gap]


def test_few_tokens_per_expert_slow_the_weight_gradient() -> None:
    """Qwen3-235B's experts (h 4,096, 1,536 wide) with 8,192 copies on a rank: on 16 experts
    each weight gradient reduces over 512 tokens, on one GEMM over 8,192 — the short reduction
    runs at the K curve's 512 point (``GPUSpec.gemm_k_factor``), 20-30% slower, and each of the
    16 kernels is launched: 35% slower in all (an H200 measured 1.47× for the 4,096-wide fc2's
    weight gradients over 512 tokens each, ``bench/device`` 2026-12-04)."""
    rows, n, k = 8192, 2 * 1536, 4096
    one = gemm("w_wgrad", k, n, rows, "bf16")
    grouped = grouped_gemm_bwd(grouped_gemm("w", rows, n, k, "bf16", 16))[1]
    assert (grouped.m, grouped.n, grouped.k, grouped.flop) == (k, n, rows // 16, one.flop)
    ratio = _ns(grouped, True) / _ns(one, True)
    kf, gap = H100.gpu.gemm_k_factor, H100.gpu.launch_overhead_ns
    slower = kf(rows, "bf16") / kf(rows // 16, "bf16")
    assert ratio == pytest.approx((slower * (_ns(one, True) - gap) + 16 * gap) / _ns(one, True),
                                  rel=0.01)
    assert 1.3 < ratio < 1.4


def test_the_trace_carries_the_group(tmp_path: Path) -> None:
    """The writer puts ``gemm_groups`` on a grouped GEMM's node; the reader takes it back and
    replay times it as the group."""
    s = Strategy(dp=8, ep=8, global_batch_size=8)
    generate(dataclasses.replace(MOE, num_layers=1), s, tmp_path)
    rank = read_et(next(tmp_path.glob("*.0.et")), 0)
    groups = {n.name.rsplit(".", 1)[-1]: n.attrs.get("gemm_groups")
              for n in rank.nodes if "expert_fc" in n.name}
    assert groups and set(groups.values()) == {8}, groups


def test_an_op_is_read_as_its_trace_node_is() -> None:
    """``op_time_ns`` / ``explain_op`` time a tracegen op as replay times its node: the
    backward flag from the name (an attention's ``_bwd``), the group and splits carried."""
    ops = [grouped_gemm("expert_fc1", 8192, 3072, 4096, "bf16", 16),
           *grouped_gemm_bwd(grouped_gemm("expert_fc1", 8192, 3072, 4096, "bf16", 16)),
           Op("flash_attn_bwd", "attention", 10**12, 0, 4096, 4096, 128, "bf16")]
    for op in ops:
        assert H100.op_time_ns(op) == H100.explain_op(op).total_ns == _ns(
            op, op.name.endswith("_bwd"))
    fwd = dataclasses.replace(ops[-1], name="flash_attn")
    assert H100.op_time_ns(fwd) < H100.op_time_ns(ops[-1])  # the backward runs slower
