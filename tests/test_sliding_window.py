"""Sliding-window attention (``ModelSpec.sliding_window``, ``window_pattern``): a windowed
layer's attention costs its band, s·w − w²/2 query-key pairs a sequence; a window as long as
the sequence is full causal attention; the pattern places the windowed layers, stage by stage;
context parallelism exchanges the halo each chunk's window reaches; the fast path agrees with
replay; a bad window is refused."""

from __future__ import annotations

import dataclasses
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.fastpath import estimate
from replay import get_system, replay
from tracegen import ConfigError, ModelSpec, Strategy, generate, get_model
from tracegen import ops as O
from tracegen.flops import model_flop_per_step
from tracegen.program import RoleProgram
from tracegen.window import cp_window

SYSTEM = get_system("dgx-h100")
SMALL = ModelSpec(name="small", num_layers=12, hidden_size=512, num_attention_heads=8,
                  num_kv_heads=4, ffn_hidden_size=1024, vocab_size=4096, seq_len=2048,
                  activation="swiglu", dropout=0.0)


def _attention(m: ModelSpec, s: Strategy) -> O.Op:
    return next(it for it in O.layer_fwd(m, s) if isinstance(it, O.Op) and it.kind == "attention")


@given(s_len=st.sampled_from([512, 1024, 4096, 8192]), w=st.integers(1, 9000),
       mbs=st.sampled_from([1, 2]), tp=st.sampled_from([1, 2, 4]))
@settings(max_examples=60, deadline=None)
def test_a_windowed_attention_costs_its_band(s_len: int, w: int, mbs: int, tp: int) -> None:
    """4·b·(s·w − w²/2)·d·heads forward FLOPs (the causal s²/2 at w ≥ s, where the op is the
    full layer's), its key length 2·pairs/s rounded up; K and V read whole either way."""
    m = dataclasses.replace(SMALL, seq_len=s_len, sliding_window=w)
    s = Strategy(tp=tp, micro_batch_size=mbs, global_batch_size=mbs)
    op, full = _attention(m, s), _attention(dataclasses.replace(m, sliding_window=0), s)
    heads, d = m.num_attention_heads // tp, m.head_dim
    if w >= s_len:
        assert op == full
        return
    assert op.flop == 2 * mbs * (2 * s_len * w - w * w) * d * heads
    assert op.flop == pytest.approx(4 * mbs * (s_len * w - w * w / 2) * d * heads)
    # (rounded up, a window within a token or two of the sequence reads the causal length)
    assert op.m == s_len and op.n == -(-(2 * s_len * w - w * w) // s_len) <= s_len
    assert op.bytes == full.bytes and op.flop < full.flop


def test_the_pattern_places_the_windowed_layers_stage_by_stage() -> None:
    """Gemma 3's five windowed layers in six over 12 layers on 4 stages of 3: the pattern
    restarts at layer 6, so stages 0 and 2 hold one full layer (layer 5, layer 11) and 1 and 3
    none; each stage's blocks name their kind in forward order."""
    m = dataclasses.replace(SMALL, sliding_window=256, window_pattern="SSSSSF")
    s = Strategy(pp=4, global_batch_size=4)
    kinds = [[(b.name, n) for b, n in RoleProgram(m, s, 0).chunk_runs(g)] for g in range(4)]
    assert kinds[0] == [("embedding", 1), ("window_layer", 3)]
    assert kinds[1] == [("window_layer", 2), ("layer", 1)]
    assert kinds[2] == [("window_layer", 3)]
    assert kinds[3] == [("window_layer", 2), ("layer", 1), ("lm_head", 1)]
    assert m.windowed_layers_in(range(12)) == 10


def test_a_window_shortens_the_step_and_a_full_length_one_changes_nothing() -> None:
    """Mistral 7B at 32K tokens: the step falls as the window shrinks; at 32K it is full
    attention's step exactly; model FLOPs (MFU's) fall with it."""
    m = dataclasses.replace(get_model("mistral-7b"), seq_len=32768)
    s = Strategy(tp=4, pp=2, dp=1, global_batch_size=8, recompute="selective",
                 sequence_parallel=True)
    steps = [estimate(dataclasses.replace(m, sliding_window=w), s, SYSTEM).step_time_s
             for w in (1024, 4096, 16384, 32768)]
    assert steps == sorted(steps) and steps[0] < 0.7 * steps[-1]
    full = dataclasses.replace(m, sliding_window=0)
    assert steps[-1] == estimate(full, s, SYSTEM).step_time_s
    assert model_flop_per_step(m, 8) < model_flop_per_step(full, 8)
    assert model_flop_per_step(dataclasses.replace(m, sliding_window=32768), 8) == (
        model_flop_per_step(full, 8))


def test_model_flops_count_the_band_as_the_full_count_counts_causal() -> None:
    """Megatron's count takes attention as s² a layer (twice the causal pairs); a windowed
    layer counts 2·s·w − w² (twice its band): half of Gemma 2's layers at 8K tokens and a
    window of 4K count 3/4 of the full term, the model's FLOPs less a quarter of it on half
    its layers."""
    m = get_model("gemma2-9b")
    full = dataclasses.replace(m, sliding_window=0, window_pattern="")
    b, s = 4, m.seq_len
    attention_term = 12 * b * s * m.num_layers * s * m.q_size  # (the count's s/h term: h²·s/h·q/h)
    saved = attention_term * 0.5 * (1 - (2 * s * 4096 - 4096**2) / s**2)
    assert model_flop_per_step(full, b) - model_flop_per_step(m, b) == pytest.approx(saved,
                                                                                      rel=1e-9)


def test_memory_does_not_change_with_the_window() -> None:
    """Fused attention keeps no score matrix: a windowed layer holds what a full one does."""
    m = get_model("gemma2-9b")
    s = Strategy(tp=4, pp=2, dp=1, global_batch_size=8, recompute="selective")
    full = dataclasses.replace(m, sliding_window=0, window_pattern="")
    assert estimate(m, s, SYSTEM).peak_memory_GiB == estimate(full, s, SYSTEM).peak_memory_GiB


@pytest.mark.parametrize("kw", [
    dict(pp=4, global_batch_size=8),
    dict(pp=2, vpp=3, schedule="interleaved_1f1b", global_batch_size=8, recompute="full",
         recompute_num_layers=1),
    dict(pp=3, global_batch_size=6, recompute="selective", schedule="zb_h1"),
    dict(tp=2, pp=2, global_batch_size=4, zero_stage=3, dp=2),
])
def test_the_fast_path_agrees_with_replay_on_a_pattern(kw: dict[str, object]) -> None:
    m = dataclasses.replace(SMALL, sliding_window=256, window_pattern="SSF")
    s = Strategy(**kw)  # type: ignore[arg-type]
    with tempfile.TemporaryDirectory() as tmp:
        generate(m, s, tmp, mode="representative")
        ref = replay(tmp, SYSTEM, contention=False).step_time_s
    assert estimate(m, s, SYSTEM).step_time_s == pytest.approx(ref, rel=0.02)


def test_the_trace_carries_each_layers_attention() -> None:
    """Every windowed layer's attention op a key length below its sequence, every full one's
    the sequence (the replayer's compute model reads the window from it)."""
    m = dataclasses.replace(SMALL, sliding_window=256, window_pattern="SF")
    s = Strategy(global_batch_size=1)
    prog = RoleProgram(m, s, 0)
    ns = [_attention_n(prog.block_items(b, "fwd")) for b in prog.blocks_of_chunk(0)
          if b.is_layer]
    assert ns == [480 if i % 2 == 0 else 2048 for i in range(12)]  # (2·2048·256 − 256²)/2048


def _attention_n(items: list[O.Item]) -> int:
    return next(it.n for it in items if isinstance(it, O.Op) and it.kind == "attention")


@pytest.mark.parametrize(("fields", "message"), [
    ({"sliding_window": -1}, "sliding_window must be ≥ 0"),
    ({"sliding_window": 256, "window_pattern": "SLF"}, "a string of S .* and F"),
    ({"window_pattern": "SF"}, "sliding_window is 0: give the window's length"),
    ({"sliding_window": 256, "window_pattern": "FF"}, "has no windowed layer"),
])
def test_a_bad_window_is_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(SMALL, **fields)  # type: ignore[arg-type]


def _brute_cp(seq: int, cp: int, w: int) -> tuple[int, int]:
    """The busiest rank's pairs and received halo tokens, position by position (a key both
    chunks' halos reach travels twice: each chunk's [halo, chunk] buffer is filled apart)."""
    chunk, best, recv = seq // (2 * cp), 0, 0
    for r in range(cp):
        own = (r, 2 * cp - 1 - r)
        best = max(best, sum(min(i + 1, w) for a in own
                             for i in range(a * chunk, (a + 1) * chunk)))
        mine = {k for b in own for k in range(b * chunk, (b + 1) * chunk)}
        recv = max(recv, sum(len(set(range(a * chunk - min(w - 1, a * chunk), a * chunk)) - mine)
                             for a in own))  # (each chunk's halo its own message: TE's pieces)
    return best, recv


@given(cp=st.integers(2, 8), chunk=st.integers(1, 24), w=st.integers(1, 200))
@settings(max_examples=200, deadline=None)
def test_a_context_parallel_ranks_window_and_halo_count_position_by_position(
        cp: int, chunk: int, w: int) -> None:
    """Transformer Engine's layout (rank r holds chunks r and 2·cp − 1 − r): the busiest
    rank's pairs and the halo it receives (min(w − 1, a·L) keys before each chunk a, less its
    own), as counted key by key; past (cp − 1)·L keys of reach K/V are gathered instead (no
    halo), as ``use_p2p_swa`` decides; under "all_gather" always."""
    seq = 2 * cp * chunk
    pairs, halo = _brute_cp(seq, cp, w)
    got = cp_window(seq, cp, w, "p2p")
    assert got.pairs == pairs == cp_window(seq, cp, w, "all_gather").pairs
    assert got.halo_tokens == (halo if w - 1 <= (cp - 1) * chunk else 0)
    assert cp_window(seq, cp, w, "all_gather").halo_tokens == 0


def test_context_parallelism_exchanges_the_halo_and_attends_the_busiest_band() -> None:
    """Mistral's 4,096-key window at 32 K tokens on cp 4 (chunks of 4,096): every rank past
    the first window attends 2·L·W pairs and receives its two chunks' 4,095-token halos (K
    and V of 8 heads of 128 at tp 2, its 4 heads: 2 KiB a token); the exchange is recorded
    as an all-gather moving those bytes into each rank, its backward returns them."""
    m = dataclasses.replace(get_model("mistral-7b"), seq_len=32768)
    s = Strategy(tp=2, cp=4, global_batch_size=1)
    items = O.layer_fwd(m, s)
    halo = next(it for it in items if isinstance(it, O.Comm) and it.name == "cp_kv_halo")
    attn = _attention(m, s)
    assert attn.flop == 4 * (2 * 4096 * 4096) * 128 * 16  # 32 heads over tp 2
    assert halo.size_bytes * 3 == 2 * 4095 * 2 * 4 * 128 * 2
    back = [it for it in O.layer_bwd(m, s) if isinstance(it, O.Comm) and it.axis == "cp"]
    assert [(c.coll, c.size_bytes * 3 // 4) for c in back] == [
        ("REDUCE_SCATTER", halo.size_bytes * 3)]
    assert estimate(m, s, SYSTEM).step_time_s < estimate(
        dataclasses.replace(m, sliding_window=0), s, SYSTEM).step_time_s


@pytest.mark.parametrize(("cp", "comm", "w"), [(2, "p2p", 256), (4, "p2p", 128),
                                               (2, "all_gather", 256), (4, "p2p", 2000)])
def test_the_fast_path_agrees_with_replay_under_context_parallelism(cp: int, comm: str,
                                                                      w: int) -> None:
    m = dataclasses.replace(SMALL, sliding_window=w, window_pattern="SF")
    s = Strategy(cp=cp, pp=2, global_batch_size=4, cp_comm_type=comm)  # type: ignore[arg-type]
    with tempfile.TemporaryDirectory() as tmp:
        generate(m, s, tmp, mode="representative")
        ref = replay(tmp, SYSTEM, contention=False).step_time_s
    assert estimate(m, s, SYSTEM).step_time_s == pytest.approx(ref, rel=0.02)


def test_chunked_attention_is_causal_attention_over_each_chunk() -> None:
    """Llama 4's local layers (``attention_chunk``): a query attends causally within its own
    chunk only — s/c causal sequences of c tokens, 4·b·(s/c)·c²/2·d·heads FLOPs, at the curve's
    efficiency at c with the whole sequence's tiles (no band edge: a chunk's diagonal wastes
    what a causal call's does); a chunk as long as the sequence is full attention; model FLOPs
    count a chunked layer as s·c; the fast path agrees with replay; context parallelism is
    refused."""
    m = dataclasses.replace(SMALL, attention_chunk=512, window_pattern="SSSF")
    s = Strategy(tp=2, micro_batch_size=2, global_batch_size=2)
    op = _attention(m.window_view(True), s)
    heads, d = m.num_attention_heads // 2, m.head_dim
    assert op.flop == 4 * 2 * (2048 // 512) * 512 * 512 * d * heads // 2
    assert (op.m, op.n) == (512, 512) and m.chunked and m.window == 512
    assert m.window_summary() == "512-token chunks, 3 layer(s) in 4"
    assert _attention(dataclasses.replace(m, attention_chunk=2048).window_view(True), s) == (
        _attention(dataclasses.replace(m, attention_chunk=0, window_pattern=""), s))
    full = dataclasses.replace(m, attention_chunk=0, window_pattern="")
    per_layer = 12 * 8 * 2048 * 2048 * m.q_size  # (the full count's attention term, 8 seqs)
    assert model_flop_per_step(full, 8) - model_flop_per_step(m, 8) == pytest.approx(
        per_layer * 9 * (1 - 512 / 2048), rel=1e-9)  # 9 of the 12 layers chunked
    st = Strategy(pp=2, global_batch_size=4)
    with tempfile.TemporaryDirectory() as tmp:
        generate(m, st, tmp, mode="representative")
        ref = replay(tmp, SYSTEM, contention=False).step_time_s
    assert estimate(m, st, SYSTEM).step_time_s == pytest.approx(ref, rel=0.02)
    assert estimate(m, st, SYSTEM).step_time_s < estimate(full, st, SYSTEM).step_time_s
    with pytest.raises(ConfigError, match="context parallelism with chunked attention"):
        estimate(m, Strategy(cp=2, global_batch_size=1), SYSTEM)


@pytest.mark.parametrize(("fields", "message"), [
    ({"attention_chunk": -1}, "attention_chunk must be ≥ 0"),
    ({"attention_chunk": 512, "sliding_window": 256}, "two kinds of local attention: set one"),
    ({"attention_chunk": 1000}, "seq_len 2048 is not a multiple of attention_chunk 1000"),
])
def test_a_bad_chunk_is_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(SMALL, **fields)  # type: ignore[arg-type]
