"""Catalog shapes, pipeline-schedule properties and the activation-memory formulas."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tracegen import ConfigError, ModelSpec, Strategy, get_model, model_names
from tracegen.memory import (
    activation_bytes_per_layer,
    estimate,
    inflight_microbatches,
    unit_params,
)
from tracegen.schedule import stage_order
from tracegen.units import GiB

# Published parameter counts (billions) of the presets: the name says it, or the source does.
PUBLISHED_B = {"gpt-1t": 1008.0, "gpt3-175b": 175.0, "mixtral-8x7b": 46.7,
               "nemotron4-340b": 340.0, "nemotron4-15b": 15.6, "qwen3-235b-a22b": 235.0,
               "qwen3-30b-a3b": 30.5, "qwen2-57b-a14b": 57.0,
               "glm4.5-355b-a32b": 355.0, "deepseek-v3": 671.0,
               "llama4-scout": 109.0, "llama4-maverick": 400.0}  # (Meta 2025)


@pytest.mark.parametrize("name", model_names())
def test_preset_parameter_count_matches_its_name(name: str) -> None:
    m = get_model(name)
    published = PUBLISHED_B.get(name)
    if published is None:
        published = float(re.findall(r"(\d+(?:\.\d+)?)b$", name)[0])
    assert m.num_params() / 1e9 == pytest.approx(published, rel=0.04)


def test_catalog_has_every_requested_family() -> None:
    names = set(model_names())
    for n in ("gpt-1.7b", "gpt-1t", "gpt3-175b", "llama2-7b", "llama2-13b", "llama2-70b",
              "llama3-8b", "llama3-70b", "llama3.1-8b", "llama3.1-70b", "llama3.1-405b",
              "nemotron4-15b", "nemotron4-340b", "mixtral-8x7b"):
        assert n in names


@given(m=st.integers(1, 12), p=st.integers(1, 8), v=st.integers(1, 3),
       kind=st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b"]), data=st.data())
def test_schedule_runs_each_pass_once_and_backward_after_forward(m, p, v, kind, data) -> None:
    if kind == "interleaved_1f1b":
        m *= p  # Megatron's interleaved schedule needs m % p == 0
    else:
        v = 1
    stage = data.draw(st.integers(0, p - 1))
    order = stage_order(kind, m=m, p=p, v=v, stage=stage)
    assert sorted(order) == sorted((ph, j, c) for ph in "FB" for j in range(m) for c in range(v))
    pos = {x: i for i, x in enumerate(order)}
    assert all(pos[("F", j, c)] < pos[("B", j, c)] for j in range(m) for c in range(v))
    if kind == "1f1b":  # at most p - stage micro-batches in flight (Narayanan et al. 2021 §2.2.1)
        live = peak = 0
        for ph, _, _ in order:
            live += 1 if ph == "F" else -1
            peak = max(peak, live)
        assert peak == min(p - stage, m) == inflight_microbatches(
            Strategy(pp=p, dp=1, global_batch_size=m), stage)


def _peak_in_flight(order: list[tuple[str, int, int]]) -> int:
    live = peak = 0
    for ph, _, _ in order:
        live += 1 if ph == "F" else -1
        peak = max(peak, live)
    return peak


def test_megatron_cores_grouped_schedule_table() -> None:
    """The example in Megatron-Core's schedules.py (``get_schedule_table``): pp 2, N 3, m 5,
    vpp 2 runs virtual micro-batches 0-9 as micro-batches 0 1 2 0 1 2 3 4 3 4 of chunks
    0 0 0 1 1 1 0 0 1 1 — the last group holds the 2 left — and backwards mirror the chunks."""
    s = Strategy(pp=2, vpp=2, dp=1, schedule="interleaved_1f1b", global_batch_size=5,
                 microbatch_group_size=3)
    order = stage_order(s.order_id, m=5, p=2, v=2, stage=1)
    fwd = [(mb, ch) for ph, mb, ch in order if ph == "F"]
    bwd = [(mb, ch) for ph, mb, ch in order if ph == "B"]
    assert [mb for mb, _ in fwd] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [ch for _, ch in fwd] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert bwd == [(mb, 1 - ch) for mb, ch in fwd]
    # the last stage's warm-up: (p − 1 − 1)·2 + (v − 1)·N = 3 forwards, then 1F1B
    assert [ph for ph, _, _ in order[:5]] == ["F", "F", "F", "F", "B"]


@given(p=st.integers(2, 6), v=st.integers(2, 3), m=st.integers(2, 20), data=st.data())
def test_grouped_interleaving_holds_what_the_memory_model_counts(p, v, m, data) -> None:
    """Any micro-batch group Megatron-Core accepts runs every pass once, each backward after
    its forward; a stage's peak of chunk passes in flight is the warm-up + 1 (at most m·v)
    that ``inflight_microbatches`` counts; and a group of pp is the default order."""
    fits = [n for n in range(p, m + 1) if not 0 < m % n < p]
    if not fits:
        with pytest.raises(ConfigError):
            Strategy(pp=p, vpp=v, dp=1, schedule="interleaved_1f1b", global_batch_size=m,
                     microbatch_group_size=data.draw(st.integers(1, m + 2)))
        return
    n = data.draw(st.sampled_from(fits))
    s = Strategy(pp=p, vpp=v, dp=1, schedule="interleaved_1f1b", global_batch_size=m,
                 microbatch_group_size=n)
    stage = data.draw(st.integers(0, p - 1))
    order = stage_order(s.order_id, m=m, p=p, v=v, stage=stage)
    assert sorted(order) == sorted((ph, j, c) for ph in "FB" for j in range(m) for c in range(v))
    pos = {x: i for i, x in enumerate(order)}
    assert all(pos[("F", j, c)] < pos[("B", j, c)] for j in range(m) for c in range(v))
    assert _peak_in_flight(order) == inflight_microbatches(s, stage) * v
    if n == p:
        assert order == stage_order("interleaved_1f1b", m=m, p=p, v=v, stage=stage)


@given(p=st.integers(2, 6), v=st.integers(2, 3), rounds=st.integers(1, 3), data=st.data())
def test_default_interleaving_holds_what_the_memory_model_counts(p, v, rounds, data) -> None:
    """Megatron-Core's interleaved order (m = p too: no longer every forward first) peaks at
    the chunk passes ``inflight_microbatches`` counts on every stage."""
    m, stage = rounds * p, data.draw(st.integers(0, p - 1))
    s = Strategy(pp=p, vpp=v, dp=1, schedule="interleaved_1f1b", global_batch_size=m)
    order = stage_order("interleaved_1f1b", m=m, p=p, v=v, stage=stage)
    assert _peak_in_flight(order) == inflight_microbatches(s, stage) * v


GPT = dict(b=1, s=2048, h=12288, a=96)  # GPT-3 175B shapes (Korthikanti et al. 2022, Table 3)


@pytest.mark.parametrize("dropout", [0.1, 0.0])
@pytest.mark.parametrize("t", [1, 8])
@pytest.mark.parametrize(("sp", "recompute"), [(False, "none"), (True, "none"),
                                               (True, "selective"), (False, "full"),
                                               (True, "full")])
def test_korthikanti_activation_memory(t: int, sp: bool, recompute: str, dropout: float) -> None:
    """Korthikanti et al. 2022 eqs. (2)-(5), with standard (non-flash) attention. Without
    dropout their §4.1 terms lose the two sbh masks (after attention, after the MLP), the
    attention-dropout mask (as²b) and its output (2as²b): 10 → 8 and 5as/h → 2as/h."""
    m = dataclasses.replace(get_model("gpt3-175b"), dropout=dropout)
    s = Strategy(tp=t, sequence_parallel=sp and t > 1, recompute=recompute)  # type: ignore[arg-type]
    sp = sp and t > 1
    b, seq, h, a = GPT["b"], GPT["s"], GPT["h"], GPT["a"]
    sbh = seq * b * h
    rep, scores = (10, 5) if dropout else (8, 2)
    attn = scores * a * seq / (h * t)
    expected = {
        (False, "none"): sbh * (rep + 24 / t + attn),
        (True, "none"): sbh * ((rep + 24) / t + attn),
        (True, "selective"): sbh * (rep + 24) / t,
        (False, "selective"): sbh * (rep + 24 / t),
        (False, "full"): 2 * sbh,
        (True, "full"): 2 * sbh / t,
    }[(sp, recompute)]
    got = activation_bytes_per_layer(m, s, flash_attention=False)
    assert got == pytest.approx(expected, rel=1e-9)


def test_models_trained_without_dropout_say_so() -> None:
    """Presets of models that train without dropout carry 0, GPT-3 keeps Megatron's 0.1; and
    a bad probability is refused with what it must be."""
    assert get_model("gpt3-175b").dropout == 0.1
    for name in ("llama3.1-405b", "llama2-70b", "mixtral-8x7b", "qwen3-235b-a22b",
                 "nemotron4-340b"):
        assert get_model(name).dropout == 0.0, name
    with pytest.raises(ConfigError, match=r"dropout is a probability in \[0, 1\)"):
        dataclasses.replace(get_model("gpt3-175b"), dropout=1.0)


@pytest.mark.parametrize("flash", [True, False])
def test_full_recompute_holds_one_rebuilt_layer(flash: bool) -> None:
    """Checkpoints of every layer plus one layer rebuilt in full (Chen et al. 2016 §3): the
    transient is exactly one layer of one micro-batch without recompute."""
    m = get_model("gpt3-175b")
    s = Strategy(tp=8, pp=1, dp=1, micro_batch_size=2, global_batch_size=2,
                 sequence_parallel=True, recompute="full")
    got = estimate(m, s, 0, 10**9, flash_attention=flash)
    none = Strategy(tp=8, pp=1, dp=1, micro_batch_size=2, global_batch_size=2,
                    sequence_parallel=True, recompute="none")
    assert got.transient_bytes == activation_bytes_per_layer(m, none, flash_attention=flash)
    assert estimate(m, none, 0, 10**9).transient_bytes == 0


def test_zero3_state_is_fsdp_full_precision_shards_plus_gathered_weights() -> None:
    """FSDP keeps fp32 parameter shards as the master copy: 4 + 4 + 8 = 16 bytes per parameter
    over the shard group, plus two gathered 16-bit copies and the fp32 gradient of the largest
    weight (for GPT-3 on one stage, the 51,200 × 12,288 embedding)."""
    m = get_model("gpt3-175b")
    s = Strategy(tp=1, pp=1, dp=64, micro_batch_size=1, global_batch_size=64, zero_stage=3)
    n = 64 * 10**9
    e = estimate(m, s, 0, n)
    assert (e.weights_bytes, e.gradients_bytes, e.optimizer_bytes) == (4 * n // 64, 4 * n // 64,
                                                                       8 * n // 64)
    assert unit_params(m, s, 0) == 51200 * 12288
    assert e.transient_bytes == 51200 * 12288 * (2 + 2 + 4)
    s1 = Strategy(tp=1, pp=1, dp=64, micro_batch_size=1, global_batch_size=64, zero_stage=1)
    assert estimate(m, s1, 0, n).transient_bytes == 0


def test_zero3_feasibility_boundary_of_narayanan_2021() -> None:
    """Narayanan et al. 2021 (SC21), Table 2 and its note: the 530B model with ZeRO-3 and
    micro-batch 4 did not fit on 560 A100-80GB, so 640 GPUs were used. With the attention of that
    stack (unfused: the score tensors are rebuilt by full recompute), the memory model puts the
    boundary between the two."""
    m = ModelSpec(name="gpt-530b", num_layers=105, hidden_size=20480, num_attention_heads=128,
                  num_kv_heads=128, ffn_hidden_size=81920, vocab_size=51200, seq_len=2048,
                  activation="gelu")

    def total_GiB(gpus: int) -> float:
        s = Strategy(tp=1, pp=1, dp=gpus, micro_batch_size=4, global_batch_size=4 * gpus,
                     recompute="full", zero_stage=3)
        return estimate(m, s, 0, m.num_params(), flash_attention=False).total_bytes / GiB

    assert total_GiB(560) > 80 >= total_GiB(640)


# MosaicML's llm-foundry throughput tables (scripts/train/benchmarking/README.md): runs that
# completed, each at the largest micro-batch or sequence its table lists for that model and GPU
# (MPT shapes from the llm-foundry pretrain YAMLs: d_model, heads, layers; ffn 4·d, vocab 50368;
# FSDP FULL_SHARD on 8 GPUs per node; no dropout: MPTConfig's resid_pdrop, emb_pdrop and
# attn_pdrop default to 0). (model, seq, GPUs, micro-batch, activation checkpointing, GPU GiB.)
MPT_SHAPES = {"125m": (768, 12, 12), "350m": (1024, 16, 24), "1b": (2048, 16, 24),
              "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40),
              "30b": (7168, 56, 48), "70b": (8192, 64, 80)}
MPT_RAN = [("7b", 65536, 8, 1, True, 80), ("1b", 32768, 8, 1, False, 80),
           ("350m", 65536, 8, 1, False, 80), ("125m", 65536, 8, 1, False, 80),
           ("30b", 8192, 8, 1, True, 80), ("7b", 2048, 8, 6, False, 80),
           ("13b", 8192, 8, 1, True, 40), ("1b", 16384, 8, 1, False, 40),
           ("3b", 8192, 8, 1, False, 40), ("7b", 2048, 8, 12, True, 40)]


@pytest.mark.parametrize(("name", "seq", "gpus", "mbs", "ckpt", "hbm"), MPT_RAN)
def test_published_mosaicml_runs_fit(name: str, seq: int, gpus: int, mbs: int, ckpt: bool,
                                     hbm: int) -> None:
    """Runs that completed must fit the GPU they ran on (FlashAttention, as they used)."""
    d, heads, layers = MPT_SHAPES[name]
    m = ModelSpec(name=f"mpt-{name}", num_layers=layers, hidden_size=d,
                  num_attention_heads=heads, ffn_hidden_size=4 * d, vocab_size=50368,
                  seq_len=seq, dropout=0.0)
    s = Strategy(dp=gpus, zero_stage=3, recompute="full" if ckpt else "none",
                 micro_batch_size=mbs, global_batch_size=mbs * gpus)
    assert estimate(m, s, 0, m.num_params()).total_bytes / GiB <= hbm


def test_an_uneven_interleaved_end_stage_holds_its_chunks_in_flight_by_their_size() -> None:
    """7 layers on pp 2 × vpp 2 with the embedding counted as a layer: stage 0's chunks hold
    1 and 2 layers. Its order (p 2, v 2, 4 micro-batches) runs F(0,c0) F(1,c0) F(0,c1) F(1,c1)
    F(2,c0) B(0,c1) …: three chunk-0 and two chunk-1 passes in flight at the peak, 3·1 + 2·2
    = 7 layers' activations, not the stage average (4 + 1)/2 passes × 3 layers = 7.5."""
    m = ModelSpec(name="u", num_layers=7, hidden_size=256, num_attention_heads=8,
                  ffn_hidden_size=1024, vocab_size=1024, seq_len=256)
    s = Strategy(pp=2, vpp=2, schedule="interleaved_1f1b", global_batch_size=4,
                 account_for_embedding_in_pipeline_split=True)
    assert [len(s.chunk_layers(7, g)) for g in (0, 2)] == [1, 2]
    act = activation_bytes_per_layer(m, s)
    assert estimate(m, s, 0, 10**6).activations_bytes == 7 * act
    # the other stage's chunks are even: the whole-stage count, (2·0 + 2 + 1)/2 passes × 4
    assert estimate(m, s, 1, 10**6).activations_bytes == int(4 * act * inflight_microbatches(
        s, 1))


def test_llama3_first_stage_holds_no_activations_for_its_embedding_chunk() -> None:
    """Llama 3 405B on 8,192 GPUs (pp 16, vpp 8, 32 micro-batches in groups of 16): at the end
    of the warm-up stage 0 has run 143 forwards — 16 through each of its 8 chunks and 15 more
    through chunk 0, which holds only the embedding — so 7 chunks × 16 passes × 1 layer."""
    m = get_model("llama3.1-405b")
    s = Strategy(tp=8, pp=16, dp=64, vpp=8, schedule="interleaved_1f1b", micro_batch_size=1,
                 global_batch_size=2048, sequence_parallel=True, zero_stage=2,
                 account_for_embedding_in_pipeline_split=True,
                 account_for_loss_in_pipeline_split=True)
    act = activation_bytes_per_layer(m, s)
    assert estimate(m, s, 0, 10**9).activations_bytes == 7 * 16 * act
