"""Activation offloading (``Strategy.cpu_offload_layers``, Megatron-Core --cpu-offloading
--cpu-offloading-num-layers): Megatron-Core's rules, the memory it frees, the MEM_STORE /
MEM_LOAD nodes the trace carries and their replay over the host link, and the fast path
against replay."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.fastpath import estimate
from analysis.glance import fit_hint, fit_hint_words
from replay import get_system, replay
from replay.hardware import SystemSpec
from replay.traceset import load_trace_set
from tracegen import ConfigError, ModelSpec, Strategy, generate
from tracegen import memory as M
from tracegen.vocab import MEM_LOAD_NODE, MEM_STORE_NODE

MODEL = ModelSpec(name="tiny", num_layers=6, hidden_size=1024, num_attention_heads=16,
                  ffn_hidden_size=4096, vocab_size=8192, seq_len=2048, activation="gelu")


def _s(n: int, **kw: object) -> Strategy:
    base: dict[str, object] = {"tp": 2, "dp": 2, "micro_batch_size": 1, "global_batch_size": 6,
                               "sequence_parallel": True, "cpu_offload_layers": n}
    base.update(kw)
    return Strategy(**base)  # type: ignore[arg-type]


def _host(system: str, gbps: float) -> SystemSpec:
    spec = get_system(system)
    return dataclasses.replace(spec, node=dataclasses.replace(spec.node, host_link_GBps=gbps))


def test_megatron_cores_rules_are_said_with_their_fix() -> None:
    with pytest.raises(ConfigError, match=r"needs pp 1.*set pp 1 or cpu_offload_layers 0"):
        _s(2, pp=2, dp=1)
    with pytest.raises(ConfigError, match=r"does not work with activation recomputation"):
        _s(2, recompute="full")
    with pytest.raises(ConfigError, match=r"'gpipe' holds all 3 micro-batches' .*use schedule "
                       r"'1f1b'"):
        _s(2, schedule="gpipe")  # (pp 1's GPipe runs every forward first; one micro-batch is
    _s(2, schedule="gpipe", global_batch_size=2)  # the same either way)
    with pytest.raises(ConfigError, match=r"must be below the model's 6 layers.*choose 1-5"):
        generate(MODEL, _s(6), "/nonexistent-never-written", mode="representative", gpus=4)
    bare = _host("dgx-h100", 0.0)
    with pytest.raises(ConfigError, match="gives no host_link_GBps"):
        estimate(MODEL, _s(2), bare)
    assert _s(3).label().endswith("-off3-mbs1") and "-off" not in _s(0).label()


@pytest.mark.parametrize("n", [1, 2, 5])
def test_the_peak_keeps_all_but_the_offloaded_layers_and_one_in_flight(n: int) -> None:
    """At pp 1 (one micro-batch in flight) the offloaded layers' activations leave the GPU,
    but one copy in flight (Transformer Engine's double buffer): N − 1 layers' bytes less."""
    act = M.activation_bytes_per_layer(MODEL, _s(0))
    params = 10**8
    base = M.estimate(MODEL, _s(0), 0, params).activations_bytes
    got = M.estimate(MODEL, _s(n), 0, params).activations_bytes
    assert base - got == (n - 1) * act


def test_the_trace_carries_each_offloaded_layers_copies(tmp_path: Path) -> None:
    """Per micro-batch, one MEM_STORE_NODE after each offloaded layer's forward and one
    MEM_LOAD_NODE before its backward, of the layer's activation bytes; each load reads its
    store; the forward of layer i + 1 waits for the store of layer i − 1 (double buffer)."""
    s = _s(3)
    generate(MODEL, s, tmp_path, mode="representative", gpus=4)
    rank = load_trace_set(tmp_path).ranks[0]
    by_id = {n.id: n for n in rank.nodes}
    stores = [n for n in rank.nodes if n.type == MEM_STORE_NODE]
    loads = [n for n in rank.nodes if n.type == MEM_LOAD_NODE]
    m = s.num_microbatches
    assert len(stores) == len(loads) == 3 * m
    size = M.activation_bytes_per_layer(MODEL, s)
    assert {n.attrs["tensor_size"] for n in stores + loads} == {size}
    assert {n.name.split(".")[-2] for n in stores} == {"L0", "L1", "L2"}
    for ld in loads:
        src = [by_id[d] for d in ld.data_deps if by_id[d].type == MEM_STORE_NODE]
        assert len(src) == 1 and src[0].name.replace("offload", "reload").split(".")[1:] == \
            ld.name.split(".")[1:]
    first_l2 = next(n for n in rank.nodes if n.name.startswith("F0.c0.L2."))
    assert any(by_id[d].name == "F0.c0.L0.offload" for d in first_l2.data_deps)


MOE = ModelSpec(name="tinymoe", num_layers=6, hidden_size=1024, num_attention_heads=16,
                num_kv_heads=4, ffn_hidden_size=4096, vocab_size=8192, seq_len=2048,
                activation="swiglu", num_experts=8, experts_per_token=2,
                moe_ffn_hidden_size=1024, first_dense_layers=1)


@settings(max_examples=16, deadline=None)
@given(n=st.integers(1, 5), gbps=st.sampled_from([2.0, 8.0, 55.0, 256.0]),
       system=st.sampled_from(["dgx-h100", "gb200-nvl72", "dgx-a100-80gb"]),
       moe=st.booleans(), zero=st.sampled_from([0, 1, 3]), prefetch=st.booleans())
def test_the_fast_path_follows_replay(n: int, gbps: float, system: str, moe: bool,
                                      zero: int, prefetch: bool) -> None:
    """The fast path walks one micro-batch's copies by the trace's rules
    (``Costs.offload_waits``; under ZeRO-3 with prefetched gathers a block takes the longer of
    its compute and its collectives): replay's copy streams and their waits to within 2%, from
    links that hide every copy to ones that pace every layer, dense or MoE (a dense first
    layer, experts over ep 2), with or without ZeRO (ZeRO-3's gathers prefetched or not: a
    MoE model's then walked on its two streams, the waits in its passes)."""
    import tempfile

    spec = _host(system, gbps)
    s = _s(n, ep=2 if moe else 1, zero_stage=zero, zero3_prefetch=zero == 3 and prefetch)
    model = MOE if moe else MODEL
    with tempfile.TemporaryDirectory() as d:
        generate(model, s, d, mode="representative", gpus=4)
        got = replay(d, spec).step_time_s
    assert estimate(model, s, spec).step_time_s == pytest.approx(got, rel=0.02)


def test_a_slow_link_paces_every_offloaded_layer(tmp_path: Path) -> None:
    """With copies far longer than a layer's compute the copies run end to end: per
    micro-batch N stores one after another, the forward done before the last (it waits only
    for the store two layers back), then N reloads, the first after the last store — 2N
    copies; with a link too fast to matter offloading adds nothing."""
    s, n = _s(4), 4
    copy_s = M.activation_bytes_per_layer(MODEL, s) / 0.5e9
    slow = _host("dgx-h100", 0.5)
    extra = estimate(MODEL, s, slow).step_time_s - estimate(MODEL, _s(0), slow).step_time_s
    assert extra == pytest.approx(s.num_microbatches * 2 * n * copy_s, rel=0.02)
    fast = _host("dgx-h100", 1e6)
    assert estimate(MODEL, s, fast).step_time_s == pytest.approx(
        estimate(MODEL, _s(0), fast).step_time_s, rel=1e-6)


def test_the_fit_hint_offers_offloading_where_it_fits_for_free() -> None:
    """Llama 3 70B under FSDP on GB200 at 2 × 8,192 tokens (NVIDIA's recipe offloads 40
    layers): the hint offloads the least count that fits, at 0.9% of the step over the
    rack's host link (replay gives the same), where recomputing 45 layers instead costs 17%."""
    from tracegen.catalog import get_model

    model = dataclasses.replace(get_model("llama3-70b"), seq_len=8192)
    s = Strategy(dp=64, micro_batch_size=2, global_batch_size=256, zero_stage=3,
                 zero3_prefetch=True, precision="fp8")
    system = get_system("gb200-nvl72")
    hint = fit_hint(model, s, system)
    assert hint is not None and hint["recompute"] == "none"
    k = hint["cpu_offload_layers"]
    assert 30 < k < 79 and hint["peak_memory_GiB"] <= 186
    assert not estimate(model, dataclasses.replace(s, cpu_offload_layers=k - 1), system).fits
    none = estimate(model, s, system).step_time_s
    assert none < hint["step_time_s"] < 1.02 * none
    assert fit_hint_words(hint)[1] == f"--cpu-offload-layers {k}"


def _drawn(layers: int, hidden: int, heads: int, ffn: int, vocab: int, seq: int,
           **kw: object) -> ModelSpec:
    base: dict[str, object] = dict(name="drawn", num_layers=layers, hidden_size=hidden,
                                   num_attention_heads=heads, ffn_hidden_size=ffn,
                                   vocab_size=vocab, seq_len=seq, head_dim=64)
    return ModelSpec(**{**base, **kw})  # type: ignore[arg-type]


# The agreement bench's draws (``--models --offload --opt-offload``) the fast path had missed
# by more than 2%, each now within it (DESIGN.md, "Activation offloading"):
REGRESSIONS = {
    # seed 604: ZeRO-3 with prefetch on a MoE model — its dense and expert gathers run on their
    # own streams, side by side; walked as one after the other, a layer looked long enough to
    # hide its copy (−6.2%)
    "two-gather-streams": (
        _drawn(10, 1024, 8, 2176, 65536, 1024, num_kv_heads=8, tied_embeddings=True,
               num_experts=4, experts_per_token=1, moe_ffn_hidden_size=512),
        Strategy(tp=2, dp=32, ep=4, sequence_parallel=True, global_batch_size=192,
                 zero_stage=3, tp_comm_overlap=True, expert_tp=1, zero3_prefetch=True,
                 cpu_offload_layers=8), "dgx-h100"),
    # seed 606: overlapped parameter gathers beside a copy-bound forward — their delay walked
    # without the copies came out negative (−8.1%)
    "param-gathers": (
        _drawn(8, 2048, 32, 8192, 65536, 4096, num_kv_heads=2),
        Strategy(dp=64, cp=2, global_batch_size=128, zero_stage=1, overlap_param_gather=True,
                 cpu_offload_layers=6, optimizer_offload_fraction=0.1), "dgx-b200"),
    # seed 606: ZeRO-3 without prefetch on a MoE model — the backward's reload waits, put at
    # the pass's end, hid behind the streams' draining (−2.2%)
    "z3-two-streams": (
        _drawn(8, 512, 8, 1536, 128256, 4096, num_kv_heads=8, activation="swiglu",
               num_experts=8, experts_per_token=2, moe_ffn_hidden_size=2048),
        Strategy(tp=8, dp=16, ep=2, micro_batch_size=4, global_batch_size=64, zero_stage=3,
                 precision="fp8", overlap_grad_reduce=False, cpu_offload_layers=2),
        "dgx-b200"),
    # seed 607: ZeRO-3 without prefetch — a store's wait held the next layer's blocking
    # gathers too, where only its compute waits (+1.6% without the MoE pattern, +2.3% with)
    "gathers-beside-stores": (
        _drawn(8, 5120, 40, 4096, 65536, 2048, num_kv_heads=4, head_dim=128,
               activation="swiglu", tied_embeddings=True, num_experts=16, experts_per_token=2,
               moe_ffn_hidden_size=2048, moe_layer_pattern="MD"),
        Strategy(tp=2, dp=64, micro_batch_size=4, global_batch_size=256, zero_stage=3,
                 overlap_grad_reduce=False, cpu_offload_layers=6), "dgx-a100-80gb"),
    # seed 611: overlapped gradient reduce-scatters beside a reload-paced backward — their
    # interference charged on top of the waits it runs inside (+3.3%)
    "buckets-beside-reloads": (
        _drawn(24, 4096, 32, 8320, 32000, 2048, num_kv_heads=8, head_dim=128,
               activation="relu", tied_embeddings=True),
        Strategy(tp=2, dp=12, cp=2, sequence_parallel=True, micro_batch_size=2,
                 global_batch_size=24, schedule="gpipe", zero_stage=2, cpu_offload_layers=22),
        "dgx-h100"),
}


@pytest.mark.parametrize("case", sorted(REGRESSIONS))
def test_the_agreement_benchs_offloading_draws_stay_within_2_percent(case: str) -> None:
    model, s, system = REGRESSIONS[case]
    import tempfile

    spec = get_system(system)
    with tempfile.TemporaryDirectory() as d:
        generate(model, s, d, mode="representative")
        got = replay(d, spec, contention=False).step_time_s
    none = estimate(model, dataclasses.replace(s, cpu_offload_layers=0), spec).step_time_s
    assert got > 1.01 * none  # (the copies cost something here: the fast path must see it)
    assert estimate(model, s, spec).step_time_s == pytest.approx(got, rel=0.02)
