"""MoE in a repeating pattern of layers (``ModelSpec.moe_layer_pattern``; Llama 4 Maverick's
every other layer, Megatron-Core ``--moe-layer-freq``'s list): parameters and FLOPs per layer
kind, the trace's blocks in the pattern's order, per-stage activation memory, and the fast
path against replay where chunks hold the same kinds in different orders."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from analysis.fastpath import estimate
from replay import get_system
from tests.conftest import layer_kinds, replayed
from tracegen import ConfigError, ModelSpec, Strategy, generate
from tracegen.fit import check_fits_model
from tracegen.flops import model_flop_per_step, recompute_flop_per_step
from tracegen.memory import activation_bytes_per_layer, inflight_microbatches
from tracegen.memory import estimate as memory_estimate

MOE = ModelSpec(name="mp", num_layers=8, hidden_size=256, num_attention_heads=8,
                num_kv_heads=4, ffn_hidden_size=1024, vocab_size=1024, seq_len=256,
                activation="swiglu", num_experts=8, experts_per_token=2,
                moe_ffn_hidden_size=128, shared_expert_ffn_hidden_size=128)
DM = dataclasses.replace(MOE, name="dm", moe_layer_pattern="DM")
DDM = dataclasses.replace(MOE, name="ddm", moe_layer_pattern="DDM")
SYSTEM = get_system("dgx-h100")


def test_parameters_and_flops_count_each_layer_kind() -> None:
    """Four dense and four MoE layers cost what four dense first layers and four MoE ones do
    (Megatron-LM's count per layer kind), whatever their order."""
    first4 = dataclasses.replace(MOE, first_dense_layers=4)
    assert DM.dense_layers_in(range(8)) == 4 and DDM.dense_layers_in(range(8)) == 6
    assert DM.num_params() == first4.num_params()
    assert model_flop_per_step(DM, 4) == model_flop_per_step(first4, 4)
    for modules in (("core_attn",), ("mlp",), ("moe",), ("shared_experts",)):
        assert (recompute_flop_per_step(DM, 4, "selective", modules=modules)
                == recompute_flop_per_step(first4, 4, "selective", modules=modules))
    dense = MOE.dense_view()
    assert DDM.num_params() - MOE.num_params() == 6 * (dense.layer_params()
                                                      - MOE.layer_params())


def test_the_trace_runs_the_layers_in_the_patterns_order(tmp_path: Path) -> None:
    """pp 2 of 4 layers each under "DDM" (layer i dense unless i % 3 == 2): stage 0 D D M D,
    stage 1 D M D D."""
    s = Strategy(pp=2, dp=2, ep=2, global_batch_size=4)
    generate(DDM, s, tmp_path, mode="representative")
    kind = {True: "dense", False: "moe"}
    assert layer_kinds(tmp_path, 0) == {i: kind[i % 3 != 2] for i in range(4)}
    last = max(int(p.name.split(".")[1]) for p in tmp_path.glob("*.et"))
    assert layer_kinds(tmp_path, last) == {i: kind[i % 3 != 2] for i in range(4, 8)}


@pytest.mark.parametrize("kw", [dict(), dict(recompute="full", recompute_num_layers=1)])
def test_a_stage_holds_each_layer_kinds_activations(kw: dict) -> None:
    """Stage 0 (layers 0-3 of "DM"): 2 dense + 2 MoE layers' bytes × the micro-batches in
    flight; with the first layer recomputed, that (dense) layer's recomputed bytes and the
    other three kept."""
    s = Strategy(pp=2, dp=2, ep=2, global_batch_size=8, **kw)  # type: ignore[arg-type]
    moe, dense = (activation_bytes_per_layer(DM, s), activation_bytes_per_layer(DM.dense_view(),
                                                                                 s))
    got = memory_estimate(DM, s, 0, 10**6, act_per_layer=moe).activations_bytes
    if not s.recompute_num_layers:
        assert got == int((2 * dense + 2 * moe) * inflight_microbatches(s, 0))
    else:
        none = Strategy(pp=2, dp=2, ep=2, global_batch_size=8)
        kept_dense = activation_bytes_per_layer(DM.dense_view(), none)
        kept_moe = activation_bytes_per_layer(DM, none)
        assert got == int((dense + kept_dense + 2 * kept_moe) * inflight_microbatches(s, 0))


@pytest.mark.parametrize("kw", [
    dict(), dict(pp=1, dp=4), dict(vpp=2, schedule="interleaved_1f1b"),
    dict(recompute="full", recompute_num_layers=1),
    dict(recompute="selective", recompute_modules="mlp,moe_act"),
    dict(zero_stage=3, pp=1, dp=4), dict(tp=2, sequence_parallel=True)])
@pytest.mark.parametrize("model", [DM, DDM], ids=["DM", "DDM"])
def test_fast_path_equals_replay_with_a_moe_pattern(model: ModelSpec, kw: dict) -> None:
    """Under "DDM" with pp 2, vpp 2 the chunks (layers 0-1, 2-3, 4-5, 6-7) run D D, M D, D M,
    D D: two chunks of one dense layer each in opposite orders, which the fast path tells
    apart by where each starts in the pattern."""
    base: dict[str, object] = dict(pp=2, dp=2, ep=2, global_batch_size=8,
                                   dp_bucket_params=100_000)
    s = Strategy(**{**base, **kw})  # type: ignore[arg-type]
    ref = replayed(model, s, SYSTEM)
    assert estimate(model, s, SYSTEM).step_time_s == pytest.approx(ref.step_time_s, rel=0.005)


def test_a_bad_pattern_is_said_with_its_fix() -> None:
    with pytest.raises(ConfigError, match=r"moe_layer_pattern is a string of M .* got 'DX'"):
        dataclasses.replace(MOE, moe_layer_pattern="DX")
    with pytest.raises(ConfigError, match=r"with at least one M; got 'DD'"):
        dataclasses.replace(MOE, moe_layer_pattern="DD")
    with pytest.raises(ConfigError, match=r"leaves none of the 2 layers MoE"):
        dataclasses.replace(MOE, num_layers=2, moe_layer_pattern="DDM")
    with pytest.raises(ConfigError, match=r"moe_layer_pattern / .* are set but num_experts"):
        dataclasses.replace(MOE.dense_view(), moe_layer_pattern="DM")
    # the dense layers' MLP is there to recompute (every-layer MoE refuses 'mlp')
    s = Strategy(dp=2, global_batch_size=8, recompute="selective", recompute_modules="mlp")
    check_fits_model(s, DM)
    with pytest.raises(ConfigError, match="every layer of this model is mixture-of-experts"):
        check_fits_model(s, MOE)


def test_a_dense_layer_computes_beside_the_moe_layers_expert_reduce_scatter() -> None:
    """ZeRO-3 without prefetch, backward: each dense layer gathers on the dense stream alone
    and computes while the MoE layer before it still reduce-scatters its experts' gradients,
    its kernels slowed for it (κ, as replay runs them) — Mixtral's shape with experts in
    every other layer and a dense MLP four experts wide (the agreement bench's draw, seed
    613: 2.3% fast before the walk's passes carried it)."""
    from tracegen import get_model

    m = dataclasses.replace(get_model("mixtral-8x7b"), moe_layer_pattern="MD",
                            ffn_hidden_size=4 * 14336)  # (the draw's dense MLP)
    s = Strategy(pp=3, dp=16, cp=2, ep=2, global_batch_size=48, schedule="gpipe",
                 recompute="full", zero_stage=3, last_stage_layers=1, expert_tp=1,
                 adam_moments_dtype="bf16")
    system = get_system("dgx-b200")
    ref = replayed(m, s, system)
    assert estimate(m, s, system).step_time_s == pytest.approx(ref.step_time_s, rel=0.005)
