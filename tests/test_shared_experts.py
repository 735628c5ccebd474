"""Shared experts (``ModelSpec.shared_expert_ffn_hidden_size``, Megatron-Core's
``--moe-shared-expert-intermediate-size``; DeepSeekMoE, Qwen2-MoE): every token passes through
them beside its routed experts. Parameters, FLOPs, the trace's ops, activation memory and the
fast path against replay."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from analysis.fastpath import estimate
from replay import get_system
from tests.conftest import read_et, replayed
from tracegen import ConfigError, ModelSpec, Strategy, generate, get_model
from tracegen.fit import check_fits_model
from tracegen.flops import model_flop_per_step
from tracegen.memory import activation_bytes_per_layer
from tracegen.ops import Comm
from tracegen.program import RoleProgram

ROUTED = ModelSpec(name="se", num_layers=4, hidden_size=256, num_attention_heads=8,
                   num_kv_heads=4, ffn_hidden_size=512, vocab_size=1024, seq_len=256,
                   activation="swiglu", num_experts=8, experts_per_token=2,
                   moe_ffn_hidden_size=128)
SHARED = dataclasses.replace(ROUTED, name="se-shared", shared_expert_ffn_hidden_size=384)
SYSTEM = get_system("dgx-h100")


def test_qwen2_moe_counts_its_published_total_and_active_parameters() -> None:
    """Qwen2-57B-A14B (Qwen2 report, Table 1): 57B parameters, 14B activated per token — the
    activated ones being attention, the router, top-8 of 64 experts and the shared experts."""
    m = get_model("qwen2-57b-a14b")
    assert m.num_params() / 1e9 == pytest.approx(57.4, abs=0.05)
    h, up = m.hidden_size, 3
    active = m.num_layers * (h * (m.q_size + 2 * m.kv_size) + m.q_size * h
                             + up * h * (m.moe_ffn_hidden_size * m.experts_per_token
                                         + m.shared_expert_ffn_hidden_size)
                             + h * m.num_experts) + m.embedding_params()
    assert active / 1e9 == pytest.approx(14.2, abs=0.1)


def test_flops_count_the_shared_experts_as_megatron_does() -> None:
    """Megatron-LM's count: (moe_ffn·topk + shared)·g in the MLP term, g = 1.5 gated."""
    b, s, n_l, h = 8, SHARED.seq_len, SHARED.num_layers, SHARED.hidden_size
    extra = model_flop_per_step(SHARED, b) - model_flop_per_step(ROUTED, b)
    assert extra == round(12 * b * s * n_l * h * h * 1.5 * 384 / h)


def _layer_ops(trace_dir: Path) -> set[str]:
    _, nodes = read_et(next(iter(sorted(trace_dir.glob("*.0.et")))))
    return {hit.group(1) for n in nodes
            if (hit := re.search(r"\.L0\.([a-z0-9_]+)$", n.name)) is not None}


def test_every_token_runs_the_shared_experts_forward_and_backward(tmp_path: Path) -> None:
    s = Strategy(tp=2, pp=1, dp=2, ep=2, sequence_parallel=True, global_batch_size=4)
    generate(SHARED, s, tmp_path / "shared", mode="representative")
    generate(ROUTED, s, tmp_path / "routed", mode="representative")
    added = _layer_ops(tmp_path / "shared") - _layer_ops(tmp_path / "routed")
    assert added == {"shared_fc1", "shared_act", "shared_fc2", "shared_fc1_dgrad",
                     "shared_fc1_wgrad", "shared_act_bwd", "shared_fc2_dgrad",
                     "shared_fc2_wgrad"}
    # the GEMMs see all of the micro-batch's tokens (gathered over TP), the width split by tp
    fc1 = next(it for it in RoleProgram(SHARED, s, 0)._layer_list("layer", "fwd")
               if it.name == "shared_fc1")
    assert (fc1.m, fc1.n, fc1.k) == (SHARED.seq_len, 2 * 384 // 2, SHARED.hidden_size)


def test_folded_experts_leave_the_shared_ones_their_tp_collectives() -> None:
    """MoE parallel folding routes each rank's own tokens with no TP collective; the shared
    experts, a tensor-parallel MLP, gather the sequence-parallel input and reduce-scatter their
    output themselves (and the conjugates in backward)."""
    from tracegen.ops import layer_bwd, layer_fwd

    s = Strategy(tp=2, dp=2, ep=4, expert_tp=1, sequence_parallel=True, global_batch_size=2)
    tp = [(it.name, it.coll) for it in layer_fwd(SHARED, s) + layer_bwd(SHARED, s)
          if getattr(it, "axis", "") == "tp" and it.name.startswith("shared")]
    assert tp == [("shared_ag", "ALL_GATHER"), ("shared_rs", "REDUCE_SCATTER"),
                  ("shared_rs_bwd", "ALL_GATHER"), ("shared_ag_bwd", "REDUCE_SCATTER")]
    routed = [it for it in layer_fwd(ROUTED, s) if getattr(it, "axis", "") == "tp"
              and not it.name.startswith(("ln1", "attn", "qkv"))]
    assert routed == []


def test_shared_experts_are_dense_parameters_split_by_tp() -> None:
    """They join the data-parallel (dense) gradient group, not the expert one."""
    s = Strategy(tp=2, dp=4, ep=4, global_batch_size=4)
    with_shared = RoleProgram(SHARED, s, 0).layer_block()
    without = RoleProgram(ROUTED, s, 0).layer_block()
    assert with_shared.dense - without.dense == 3 * 256 * 384 // 2
    assert with_shared.expert == without.expert


@pytest.mark.parametrize("sp", [False, True])
def test_activations_keep_the_shared_experts_outputs(sp: bool) -> None:
    """FC1 out (2·up·fs bytes per token) and the activation out (2·fs), split over tp; their
    input is the routed experts' (the norm output), kept once."""
    s = Strategy(tp=2, sequence_parallel=sp, global_batch_size=1)
    extra = activation_bytes_per_layer(SHARED, s) - activation_bytes_per_layer(ROUTED, s)
    assert extra == SHARED.seq_len * (2 * 2 * 384 + 2 * 384) // 2


@pytest.mark.parametrize("kw", [dict(), dict(pp=2, zero_stage=1), dict(precision="fp8"),
                                dict(tp_comm_overlap=True), dict(zero_stage=3, pp=1, dp=4),
                                dict(ep=4, expert_tp=1), dict(ep=4, expert_tp=1, pp=2)])
def test_fast_path_equals_replay_with_shared_experts(kw: dict) -> None:
    base: dict[str, object] = dict(tp=2, dp=2, ep=2, sequence_parallel=True,
                                   global_batch_size=8, dp_bucket_params=100_000)
    s = Strategy(**{**base, **kw})  # type: ignore[arg-type]
    ref = replayed(SHARED, s, SYSTEM)
    assert estimate(SHARED, s, SYSTEM).step_time_s == pytest.approx(ref.step_time_s, rel=0.005)
    assert ref.step_time_s > replayed(ROUTED, s, SYSTEM).step_time_s


@pytest.mark.parametrize(("model_kw", "strategy_kw", "message"), [
    (dict(num_experts=0, experts_per_token=0, moe_ffn_hidden_size=0), None,
     "are set but num_experts is 0"),
    (dict(shared_expert_ffn_hidden_size=-1), None, "shared_expert_ffn_hidden_size must be ≥ 0"),
    (dict(shared_expert_ffn_hidden_size=385), dict(tp=2), "not divisible by tp 2"),
])
def test_impossible_shared_experts_say_what_is_wrong(model_kw: dict, strategy_kw: dict | None,
                                                      message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        m = dataclasses.replace(SHARED, **model_kw)
        check_fits_model(Strategy(**(strategy_kw or {})), m)  # type: ignore[arg-type]


def test_a_runs_file_may_give_the_shared_experts_width(tmp_path: Path) -> None:
    """An extra ``shared_expert_ffn_hidden_size`` column, read when present (empty: none)."""
    from tests.test_moe_folding import _row_inputs

    got = _row_inputs(tmp_path, shared_expert_ffn_hidden_size=512, expert_tp=0, ep=4)
    assert not isinstance(got, str), got
    assert got.model.shared_expert_ffn_hidden_size == 512
    plain = _row_inputs(tmp_path, shared_expert_ffn_hidden_size="", expert_tp=0, ep=4)
    assert not isinstance(plain, str), plain
    assert plain.model.shared_expert_ffn_hidden_size == 0
    dense = _row_inputs(tmp_path, first_dense_layers=2, expert_tp=0, ep=4)
    assert not isinstance(dense, str), dense
    assert dense.model.first_dense_layers == 2


# ---- Megatron-Core's "shared_experts" recompute module -------------------------------------

@pytest.mark.parametrize(("kw", "names"), [
    (dict(), ["shared_fc1", "shared_act", "shared_fc2"]),
    (dict(tp=2, sequence_parallel=True, expert_tp=1, ep=4, dp=2),
     ["shared_ag", "shared_fc1", "shared_act", "shared_fc2", "shared_rs"])])
def test_recomputing_the_shared_experts_reruns_them(kw: dict, names: list[str]) -> None:
    """Their FC1, activation and FC2 run again before the backward; folded, with the TP gather
    and reduce-scatter they do themselves. Named beside ``moe`` they run once, with the layer."""
    base: dict[str, object] = dict(dp=4, ep=2, global_batch_size=4, recompute="selective",
                                   recompute_modules="shared_experts")
    s = Strategy(**{**base, **kw})  # type: ignore[arg-type]
    prog = RoleProgram(SHARED, s, 0)
    assert [it.name for it in prog.selective_items(s.selective_modules)] == names
    both = dataclasses.replace(s, recompute_modules="moe,shared_experts")
    got = [it.name for it in prog.selective_items(both.selective_modules)]
    assert [n for n in got if n.startswith("shared_")] == names


def test_recomputing_the_shared_experts_drops_their_outputs() -> None:
    """Per token: their FC1 output (2·2·384 bytes, gated) and activation output (2·384)."""
    base = Strategy(dp=4, ep=2, global_batch_size=4, recompute="selective")
    shared = dataclasses.replace(base, recompute_modules="core_attn,shared_experts")
    got = activation_bytes_per_layer(SHARED, base) - activation_bytes_per_layer(SHARED, shared)
    assert got == pytest.approx(SHARED.seq_len * (2 * 2 * 384 + 2 * 384), abs=1)


def test_recomputing_the_shared_experts_costs_their_forward() -> None:
    from tracegen.flops import recompute_flop_per_step

    extra = recompute_flop_per_step(SHARED, 2, "selective", modules=("shared_experts",))
    assert extra == 2 * 2 * SHARED.seq_len * SHARED.num_layers * 256 * 3 * 384
    s = Strategy(pp=2, dp=2, ep=2, global_batch_size=8, recompute="selective",
                 recompute_modules="layernorm,shared_experts")
    ref = replayed(SHARED, s, SYSTEM)
    assert estimate(SHARED, s, SYSTEM).step_time_s == pytest.approx(ref.step_time_s, rel=0.005)
    with pytest.raises(ConfigError, match="'shared_experts' recomputes a MoE layer's shared"):
        check_fits_model(s, ROUTED)


# ---- Megatron-Core's --moe-shared-expert-overlap -------------------------------------------

@pytest.mark.parametrize("kw", [dict(dp=4, ep=4), dict(tp=2, dp=2, ep=4, expert_tp=1,
                                                        sequence_parallel=True),
                                dict(tp=2, dp=2, ep=2, sequence_parallel=True, precision="fp8")])
def test_shared_experts_beside_the_dispatch(kw: dict) -> None:
    """Dispatch ‖ shared FC1 and combine ‖ shared FC2, forward and backward (their data
    gradients): the fast path equals replay, and the step is shorter than with the shared
    experts after the routed ones."""
    from tracegen.ops import layer_bwd, layer_fwd

    base: dict[str, object] = dict(pp=2, global_batch_size=8, moe_shared_expert_overlap=True)
    s = Strategy(**{**base, **kw})  # type: ignore[arg-type]
    fwd = [it.name for it in layer_fwd(SHARED, s)]
    assert fwd[fwd.index("moe_dispatch") + 1] == "shared_fc1"  # (an FP8 cast goes before both)
    assert fwd[fwd.index("moe_combine") + 1] == "shared_fc2"
    bwd = layer_bwd(SHARED, s)
    names = [it.name for it in bwd]
    for comm, gemm_ in (("moe_combine_bwd", "shared_fc2_dgrad"),
                        ("moe_dispatch_bwd", "shared_fc1_dgrad")):
        c = bwd[names.index(comm)]
        assert isinstance(c, Comm) and c.overlapped
        assert names[names.index(comm) + 1] == gemm_
    ref = replayed(SHARED, s, SYSTEM).step_time_s
    assert estimate(SHARED, s, SYSTEM).step_time_s == pytest.approx(ref, rel=0.005)
    after = dataclasses.replace(s, moe_shared_expert_overlap=False)
    assert ref < replayed(SHARED, after, SYSTEM).step_time_s


@pytest.mark.parametrize(("model", "kw"), [
    (ROUTED, dict(dp=4, ep=2)), (SHARED, dict(dp=4, ep=1)),
    (SHARED, dict(dp=4, ep=2, moe_dispatcher="deepep"))])
def test_shared_expert_overlap_needs_shared_experts_ep_and_the_all_to_all(
        model: ModelSpec, kw: dict) -> None:
    s = Strategy(global_batch_size=4, moe_shared_expert_overlap=True, **kw)
    with pytest.raises(ConfigError, match="it needs shared experts, ep > 1 and moe_dispatcher"):
        check_fits_model(s, model)
