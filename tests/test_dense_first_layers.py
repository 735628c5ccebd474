"""A MoE model's dense first layers (``ModelSpec.first_dense_layers``; DeepSeek's and GLM-4.5's
first_k_dense_replace, Megatron-Core ``--moe-layer-freq [0]*N+[1]*rest``): parameters, FLOPs,
the trace's blocks, per-stage activation memory and the fast path against replay."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from analysis.fastpath import estimate
from replay import get_system
from tests.conftest import layer_kinds, replayed
from tracegen import ConfigError, ModelSpec, Strategy, generate, get_model
from tracegen.flops import model_flop_per_step
from tracegen.memory import activation_bytes_per_layer, inflight_microbatches
from tracegen.memory import estimate as memory_estimate

MOE = ModelSpec(name="df", num_layers=8, hidden_size=256, num_attention_heads=8,
                num_kv_heads=4, ffn_hidden_size=1024, vocab_size=1024, seq_len=256,
                activation="swiglu", num_experts=8, experts_per_token=2,
                moe_ffn_hidden_size=128, shared_expert_ffn_hidden_size=128)
DENSE3 = dataclasses.replace(MOE, name="df3", first_dense_layers=3)
SYSTEM = get_system("dgx-h100")


def test_glm45_counts_its_published_parameters() -> None:
    """GLM-4.5 (355B-A32B): 3 dense layers then 89 MoE layers; 352.8 B without its one
    multi-token-prediction layer (not modelled), within 1% of the published 355 B."""
    m = get_model("glm4.5-355b-a32b")
    assert m.first_dense_layers == 3
    assert m.num_params() / 1e9 == pytest.approx(355, rel=0.01)
    routed = dataclasses.replace(m, first_dense_layers=0)
    dense = m.dense_view()
    assert m.num_params() - routed.num_params() == 3 * (dense.layer_params()
                                                        - routed.layer_params())


def test_flops_count_each_layer_kind_with_its_own_mlp() -> None:
    """Megatron-LM's count per layer kind: the dense layers' MLP term with ffn_hidden_size,
    the MoE layers' with top-k experts plus the shared ones."""
    b = 4
    per_layer = (model_flop_per_step(MOE, b) - model_flop_per_step(MOE.dense_view(), b)) / 8
    got = model_flop_per_step(DENSE3, b) - model_flop_per_step(MOE, b)
    assert got == pytest.approx(-3 * per_layer, abs=2)


def test_the_trace_runs_dense_mlps_in_the_first_layers(tmp_path: Path) -> None:
    """pp 2 of 4 layers each: stage 0's layers 0-2 dense, 3 MoE; stage 1 all MoE."""
    s = Strategy(pp=2, dp=2, ep=2, global_batch_size=4)
    generate(DENSE3, s, tmp_path, mode="representative")
    assert layer_kinds(tmp_path, 0) == {0: "dense", 1: "dense", 2: "dense", 3: "moe"}
    last = max(int(p.name.split(".")[1]) for p in tmp_path.glob("*.et"))
    assert layer_kinds(tmp_path, last) == {4: "moe", 5: "moe", 6: "moe", 7: "moe"}


@pytest.mark.parametrize("kw", [dict(), dict(vpp=2, schedule="interleaved_1f1b"),
                                dict(recompute="full", recompute_num_layers=2)])
def test_a_stage_holds_each_layer_kinds_activations(kw: dict) -> None:
    """Stage 0 (layers 0-3): 3 dense + 1 MoE layers' bytes × the micro-batches in flight (whole
    stages of 1F1B; interleaved, its chunks' passes walked — chunk 0 (layers 0-1) dense,
    chunk 1 (layers 4-5) MoE)."""
    s = Strategy(pp=2, dp=2, ep=2, global_batch_size=8, **kw)  # type: ignore[arg-type]
    moe, dense = (activation_bytes_per_layer(DENSE3, s),
                  activation_bytes_per_layer(DENSE3.dense_view(), s))
    got = memory_estimate(DENSE3, s, 0, 10**6, act_per_layer=moe).activations_bytes
    if s.vpp == 1 and not s.recompute_num_layers:
        assert got == int((3 * dense + moe) * inflight_microbatches(s, 0))
    elif s.recompute_num_layers:  # layers 0-1 recomputed (dense), 2 (dense) and 3 kept
        none = Strategy(pp=2, dp=2, ep=2, global_batch_size=8)
        kept_dense = activation_bytes_per_layer(DENSE3.dense_view(), none)
        kept_moe = activation_bytes_per_layer(DENSE3, none)
        assert got == int((2 * dense + kept_dense + kept_moe) * inflight_microbatches(s, 0))
    else:
        # order (p 2, v 2, m 4, stage 0): F(0,c0) F(1,c0) F(0,c1) F(1,c1) F(2,c0) B(0,c1)
        # F(3,c0) B(1,c1) …: chunk 0 holds the 2 (heavier) dense layers, chunk 1 2 MoE ones;
        # the peak is after F(3,c0), four chunk-0 passes and one chunk-1 pass in flight
        assert dense > moe
        assert got == 4 * 2 * dense + 1 * 2 * moe


@pytest.mark.parametrize("kw", [dict(), dict(pp=1, dp=4), dict(vpp=2, schedule="interleaved_1f1b"),
                                dict(recompute="full", recompute_num_layers=2),
                                dict(recompute="selective", recompute_modules="mlp,moe_act"),
                                dict(zero_stage=3, pp=1, dp=4), dict(tp=2, sequence_parallel=True)])
def test_fast_path_equals_replay_with_dense_first_layers(kw: dict) -> None:
    base: dict[str, object] = dict(pp=2, dp=2, ep=2, global_batch_size=8,
                                   dp_bucket_params=100_000)
    s = Strategy(**{**base, **kw})  # type: ignore[arg-type]
    ref = replayed(DENSE3, s, SYSTEM)
    assert estimate(DENSE3, s, SYSTEM).step_time_s == pytest.approx(ref.step_time_s, rel=0.005)


def test_dense_first_layers_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"first_dense_layers must be in 0\.\.num_layers"):
        dataclasses.replace(MOE, first_dense_layers=8)
    with pytest.raises(ConfigError, match=r"first_dense_layers / .* are set but num_experts is 0"):
        dataclasses.replace(MOE.dense_view(), first_dense_layers=1)


def test_one_stage_with_dense_first_layers_keeps_the_closed_form() -> None:
    """A single stage (pp 1) is no uneven pipeline: walking it lost GPipe's back-to-back
    overlap of prefetched ZeRO-3 gathers, 4.5% slow on this draw of the agreement bench (seed
    235: a tied 16-layer MoE, one dense layer, cp 2, ep 4, 2-GPU nodes)."""
    m = ModelSpec(name="drawn", num_layers=16, hidden_size=2560, num_attention_heads=16,
                  num_kv_heads=8, ffn_hidden_size=7680, vocab_size=65536, seq_len=2048,
                  activation="swiglu", tied_embeddings=True, num_experts=4, experts_per_token=2,
                  moe_ffn_hidden_size=1024, first_dense_layers=1)
    s = Strategy(pp=1, dp=64, cp=2, ep=4, micro_batch_size=4, global_batch_size=1024,
                 schedule="gpipe", zero_stage=3, zero3_prefetch=True)
    a100 = get_system("dgx-a100-80gb")
    system = dataclasses.replace(a100, node=dataclasses.replace(a100.node, gpus_per_node=2))
    ref = replayed(m, s, system)
    assert estimate(m, s, system).step_time_s == pytest.approx(ref.step_time_s, rel=0.005)
