"""Document masking (``ModelSpec.document_mean_tokens``, ``document_length_sigma``): packed
sequences attend within their documents. The expected pairs of a sequence against documents
cut at random from a simulated stream; the closed forms of one length; the limits; the
attention op, under context parallelism too; MFU's count; names, files and studies; the fast
path against replay; bad input refused."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from chakra.src.third_party.utils.protolib import encodeMessage
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from analysis import data_stragglers as DS
from analysis import pipeline_imbalance as PI
from analysis.cli import app
from analysis.fastpath import chunk_times_s, estimate
from analysis.strategy_row import strategy_from_row
from analysis.study import study_from_dict
from replay import get_system, replay
from replay.compute import RooflineCompute
from tests.conftest import read_et, replayed
from tracegen import ConfigError, ModelSpec, Strategy, generate, get_model, resolve_model
from tracegen import ops as O
from tracegen.catalog import with_seq_len
from tracegen.documents import (
    busiest_rank_factor,
    document_mask,
    masked_pairs,
    rank_pairs,
    sequence_pairs,
)
from tracegen.flops import attention_len, model_flop_per_step

SYSTEM = get_system("dgx-h100")
SMALL = ModelSpec(name="small", num_layers=12, hidden_size=512, num_attention_heads=8,
                  num_kv_heads=4, ffn_hidden_size=1024, vocab_size=4096, seq_len=4096,
                  activation="swiglu", dropout=0.0)


def _simulated_pairs(seq: int, mean: float, sigma: float, sequences: int, seed: int) -> float:
    """Mean Σ ℓ²/2 over ``sequences`` consecutive sequences cut from a stream of log-normal
    documents, the stream started far before the first cut (so the cut falls anywhere in a
    document, as in a long concatenated corpus)."""
    rng = np.random.default_rng(seed)
    mu = math.log(mean) - sigma * sigma / 2
    count = int(sequences * seq / mean * 1.3) + 2_000
    lengths = np.exp(rng.normal(mu, sigma, count)) if sigma else np.full(count, float(mean))
    ends = np.cumsum(lengths)
    start = ends[1_000] + rng.uniform(0, mean)
    cuts = start + seq * np.arange(sequences + 1)
    assert cuts[-1] < ends[-1]
    total = 0.0
    for a, b in itertools.pairwise(cuts):
        inside = ends[(ends > a) & (ends < b)]
        pieces = np.diff(np.concatenate(([a], inside, [b])))
        total += float((pieces * pieces).sum()) / 2
    return total / sequences


@pytest.mark.parametrize(("seq", "mean", "sigma"), [
    (8192, 2000, 0.0), (8192, 2000, 1.0), (8192, 600, 1.5), (32768, 3000, 1.2),
    (4096, 20000, 1.0), (2048, 2048, 0.5)])
def test_the_expected_pairs_match_a_simulated_stream(seq: int, mean: int, sigma: float) -> None:
    """The renewal closed form against 4,000 sequences cut from simulated documents: within
    3% (the heavier tails' sampling error; a fixed length within 0.5%)."""
    got = masked_pairs(seq, mean, sigma)
    sim = _simulated_pairs(seq, mean, sigma, 4000, seed=seq + mean)
    assert got == pytest.approx(sim, rel=0.005 if sigma == 0 else 0.03)


@given(seq=st.integers(16, 1 << 20), d=st.integers(1, 1 << 22))
@settings(max_examples=200, deadline=None)
def test_documents_of_one_length_have_closed_forms(seq: int, d: int) -> None:
    """σ = 0: s·d/2 − d²/6 for d ≤ s (s/d aligned documents less the two end pieces a random
    cut leaves), s²/2 − s³/(6d) beyond (one boundary in the sequence with probability s/d)."""
    want = seq * d / 2 - d * d / 6 if d <= seq else seq * seq / 2 - seq**3 / (6 * d)
    assert masked_pairs(seq, d, 0.0) == pytest.approx(want, rel=1e-9)


@given(seq=st.integers(64, 1 << 18), mean=st.integers(1, 1 << 22),
       sigma=st.floats(0.0, 3.0), grow=st.floats(1.01, 50.0))
@settings(max_examples=200, deadline=None)
def test_the_pairs_lie_between_none_and_causal_and_grow_with_the_documents(
        seq: int, mean: int, sigma: float, grow: float) -> None:
    """Never more than a causal sequence's s²/2 nor less than the tokens' own pairs' bound 0;
    longer documents on average never attend less; the equivalent length within 1..s."""
    p = masked_pairs(seq, mean, sigma)
    assert 0 <= p <= seq * seq / 2
    assert masked_pairs(seq, mean * grow, sigma) >= p * (1 - 1e-9)
    assert 1 <= document_mask(seq, mean, sigma).length <= seq


def test_documents_far_longer_than_the_sequence_attend_as_one() -> None:
    """A mean of a thousand sequences: within 0.1% of causal (σ 0 and 1)."""
    for sigma in (0.0, 1.0):
        assert document_mask(8192, 8192 * 1000, sigma).share(8192) > 0.999


def _attention(m: ModelSpec, s: Strategy) -> list[O.Op]:
    return [it for it in O.layer_fwd(m, s) if isinstance(it, O.Op) and it.kind == "attention"]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_attention_op_carries_the_masked_pairs(cp: int) -> None:
    """4·b·P·d·heads forward FLOPs (P the expected pairs), read at the equivalent causal
    length 2P/s; under context parallelism a rank's share P/cp, its calls at 2P/s/cp (every
    document split over the ranks, as Transformer Engine's THD format splits it), the ring's
    K/V transfer unchanged."""
    docs = dataclasses.replace(SMALL, document_mean_tokens=700, document_length_sigma=1.0)
    s = Strategy(cp=cp, micro_batch_size=2, global_batch_size=2)
    mask = docs.document_mask
    assert mask is not None
    ops, full = _attention(docs, s), _attention(SMALL, s)
    heads, d = SMALL.num_attention_heads, SMALL.head_dim
    assert sum(o.flop for o in ops) == pytest.approx(4 * 2 * mask.pairs / cp * d * heads,
                                                     rel=1e-6)
    assert sum(o.flop for o in ops) < 0.5 * sum(o.flop for o in full)
    assert all(o.n == max(1, mask.length // cp) for o in ops)
    assert [o.bytes for o in ops] == [o.bytes for o in full]
    comms = [it for it in O.layer_fwd(docs, s) if isinstance(it, O.Comm)]
    assert comms == [it for it in O.layer_fwd(SMALL, s) if isinstance(it, O.Comm)]


def test_mfu_counts_the_pairs_the_mask_leaves() -> None:
    """The model FLOP count's attention length is 2P/s, so the count falls with the documents,
    and documents far longer than the sequence count as the full model."""
    docs = dataclasses.replace(SMALL, document_mean_tokens=500, document_length_sigma=1.0)
    mask = docs.document_mask
    assert mask is not None
    assert attention_len(docs) == pytest.approx(2 * mask.pairs / SMALL.seq_len)
    assert model_flop_per_step(docs, 8) < model_flop_per_step(SMALL, 8)
    long = dataclasses.replace(SMALL, document_mean_tokens=10**9)
    assert model_flop_per_step(long, 8) == pytest.approx(model_flop_per_step(SMALL, 8), rel=1e-5)


def test_a_document_mask_shortens_a_long_sequences_step() -> None:
    """Llama 3 8B at 32K tokens on 8 H100s: shorter documents, a shorter step; documents far
    longer than the sequence within 0.5% of causal; memory unchanged (FlashAttention keeps no
    scores either way)."""
    m = resolve_model("llama3-8b@seq32768")
    s = Strategy(tp=8, sequence_parallel=True, global_batch_size=1, recompute="selective")
    steps = [estimate(dataclasses.replace(m, document_mean_tokens=n,
                                          document_length_sigma=1.0), s, SYSTEM)
             for n in (1000, 4000, 16000, 10**9)]
    times = [e.step_time_s for e in steps]
    assert times == sorted(times)
    full = estimate(m, s, SYSTEM)
    assert times[-1] == pytest.approx(full.step_time_s, rel=0.005)
    assert times[0] < 0.7 * full.step_time_s
    assert {e.peak_memory_GiB for e in steps} == {full.peak_memory_GiB}


@pytest.mark.parametrize("kw", [
    dict(pp=2, global_batch_size=4),
    dict(pp=2, vpp=3, schedule="interleaved_1f1b", global_batch_size=4, recompute="full"),
    dict(cp=2, tp=2, sequence_parallel=True, global_batch_size=2),
    dict(cp=4, cp_comm_type="all_gather", global_batch_size=2),
])
def test_the_fast_path_agrees_with_replay(kw: dict[str, object]) -> None:
    m = dataclasses.replace(SMALL, document_mean_tokens=900, document_length_sigma=1.3)
    s = Strategy(**kw)  # type: ignore[arg-type]
    ref = replayed(m, s, SYSTEM).step_time_s
    assert estimate(m, s, SYSTEM).step_time_s == pytest.approx(ref, rel=0.02)


def test_the_name_says_the_documents_and_resolves_back() -> None:
    """``NAME@seqN@docMEAN~SIGMA``: --model, --documents and a study's documents key give the
    same model; another sequence length keeps the documents."""
    m = resolve_model("llama3-8b", 16384, "2000~1.5")
    assert m.name == "llama3-8b@seq16384@doc2000~1.5"
    assert (m.document_mean_tokens, m.document_length_sigma) == (2000, 1.5)
    assert resolve_model(m.name) == m
    assert resolve_model("llama3-8b@doc2000~1.5", 16384) == m
    again = with_seq_len(m, 4096)
    assert again.name == "llama3-8b@seq4096@doc2000~1.5"
    assert resolve_model(again.name) == again
    study = study_from_dict({"model": "llama3-8b", "seq_len": 16384, "documents": "2000~1.5",
                             "system": "dgx-h100", "gpus": 8, "global_batch_size": 8})
    assert study.model == m and resolve_model(study.model_ref) == m
    odd = resolve_model("llama3-8b", 0, "2000~1.23456789012")
    assert resolve_model(odd.name) == odd  # (every digit of σ kept in the name)
    plain = resolve_model("llama3-8b@doc700")
    assert (plain.document_mean_tokens, plain.document_length_sigma) == (700, 0.0)


@pytest.mark.parametrize(("fields", "message"), [
    ({"document_mean_tokens": -5}, "document_mean_tokens is the mean document length"),
    ({"document_mean_tokens": 10**20}, "in [0, 2³¹)"),
    ({"document_mean_tokens": 900, "document_length_sigma": 7.0}, "in [0, 5]"),
    ({"document_mean_tokens": 900, "document_length_sigma": -1.0}, "in [0, 5]"),
    ({"document_length_sigma": 1.0}, "give the mean document length"),
    ({"document_mean_tokens": 900, "sliding_window": 256}, "beside a sliding window"),
])
def test_a_bad_document_mask_is_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        dataclasses.replace(SMALL, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["x", "0", "-3~1", "2000~abc", "2000~nan"])
def test_a_malformed_documents_text_says_the_form(text: str) -> None:
    with pytest.raises(ConfigError, match=r"MEAN\[~SIGMA\]"):
        resolve_model("llama3-8b", 0, text)
    with pytest.raises(ConfigError, match=r"MEAN\[~SIGMA\]"):
        resolve_model(f"llama3-8b@doc{text}")


def test_estimate_says_the_mask_and_its_share() -> None:
    result = CliRunner().invoke(app, [
        "estimate", "--model", "llama3-8b", "--documents", "2000~1", "--gpus", "8", "--tp", "8",
        "--sp", "--mbs", "1", "--gbs", "8", "--system", "dgx-h100"])
    assert result.exit_code == 0, result.output
    assert "llama3-8b@doc2000~1" in result.output
    share = get_model("llama3-8b").seq_len
    mask = document_mask(share, 2000, 1.0)
    assert f"{mask.share(share):.0%} of causal attention's pairs" in " ".join(
        result.output.split())


# --- stragglers from data: the replica whose sequences attended most (analysis/data_stragglers)


def _pair_moments(seq: int, mean: float, sigma: float) -> tuple[float, float]:
    """Mean and variance of one simulated sequence's pairs."""
    pairs = sequence_pairs(seq, mean, sigma)
    return float(pairs.mean()), float(pairs.var(ddof=1))


def _expected_excess(pairs: np.ndarray, n: int, k: int) -> float:
    """An independent check of the walk at one stage: E[max over k replicas of a sum of n
    sequences' pairs] less the mean sum — √n·sd·e(k) from 30 sequences on (the central limit
    theorem), else by resampling ``pairs`` (the sum is skewed there)."""
    if k <= 1:
        return 0.0
    if n >= 30:
        return math.sqrt(n) * float(pairs.std(ddof=1)) * DS.expected_max_normal(k)
    rng = np.random.default_rng(0)
    rounds = int(max(20, min(500, 20_000_000 // (k * n))))
    best = [float(rng.choice(pairs, size=(k, n)).sum(axis=1).max()) for _ in range(rounds)]
    return float(np.mean(best)) - n * float(pairs.mean())


def test_simulated_sequences_attend_as_the_closed_form_says() -> None:
    """The simulated sequences' mean pairs within 2% of the renewal closed form; documents of
    exactly one sequence's length cut at random give pieces x and s − x, x uniform: mean s²/3
    and variance s⁴/180 (both within 3%)."""
    for args in [(8192, 2000, 1.0), (32768, 3000, 1.2), (4096, 700, 0.0)]:
        mean, _ = _pair_moments(*args)
        assert mean == pytest.approx(masked_pairs(*args), rel=0.02), args
    mean, var = _pair_moments(8192, 8192, 0.0)
    assert mean == pytest.approx(8192**2 / 3, rel=0.03)
    assert var == pytest.approx(8192**4 / 180, rel=0.03)


@pytest.mark.parametrize(("k", "want"), [(2, 0.56419), (3, 0.84628), (5, 1.16296),
                                         (10, 1.53875), (100, 2.50759)])
def test_the_expected_largest_normal(k: int, want: float) -> None:
    """Tippett's (1925) table of the expected largest of k standard normals."""
    assert DS.expected_max_normal(k) == pytest.approx(want, abs=2e-5)


def test_resampling_agrees_with_the_normal_form_where_both_hold() -> None:
    """Sums of normal draws are normal at any count: below 30 sequences the resampled excess
    and √n·sd·e(k) agree within 5%; one replica waits for none."""
    pairs = np.random.default_rng(3).normal(100.0, 10.0, 50_000)
    for n, k in ((4, 16), (12, 64)):
        want = math.sqrt(n) * pairs.std(ddof=1) * DS.expected_max_normal(k)
        assert _expected_excess(pairs, n, k) == pytest.approx(want, rel=0.05)
    assert _expected_excess(pairs, 4, 1) == 0.0


def test_the_wait_grows_with_the_replicas_and_shrinks_with_their_sequences() -> None:
    """Llama 3 8B at 32 K tokens, 2,000-token documents: more replicas wait longer for their
    slowest; more sequences a replica vary less, as 1/√n; the wait never passes what every
    sequence attending causally would add; no mask, no straggler."""
    m = resolve_model("llama3-8b@seq32768@doc2000~1")
    hw = SYSTEM

    def wait(dp: int, gbs: int) -> DS.DataStraggler:
        d = DS.data_straggler(m, Strategy(tp=8, dp=dp, sequence_parallel=True,
                                          global_batch_size=gbs), hw)
        assert d is not None
        return d

    few, many = wait(4, 64), wait(32, 512)
    assert wait(1, 16).wait_s == 0.0
    assert 0 < few.wait_s < many.wait_s
    assert wait(4, 256).variation == pytest.approx(few.variation / 2, rel=1e-9)
    mask = m.document_mask
    assert mask is not None
    for d in (few, many, wait(64, 64)):
        assert d.wait_s < d.attention_s * (1 / mask.share(m.seq_len) - 1)
    assert DS.data_straggler(get_model("llama3-8b"), Strategy(global_batch_size=1), hw) is None


def test_estimate_prints_the_wait_and_writes_it(tmp_path: Path) -> None:
    out = tmp_path / "e.json"
    result = CliRunner().invoke(app, [
        "estimate", "--model", "llama3-8b@seq32768@doc2000~1", "--gpus", "64", "--tp", "8",
        "--sp", "--mbs", "1", "--gbs", "64", "--system", "dgx-h100", "--json", str(out)])
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "the slowest of 8 replicas keeps the step waiting" in said
    got = json.loads(out.read_text())["data_straggler"]
    assert got["replicas"] == 8 and got["sequences"] == 8 and got["wait_s"] > 0
    assert f"~{got['wait_s']:.4f} s" in said


DOC_STUDY = {"model": "llama3-8b", "seq_len": 32768, "documents": "4000~1",
             "system": "dgx-h100", "gpus": 512, "global_batch_size": 512, "tokens": 1e11,
             "failures": {"preset": "llama3-16k-h100"},
             "strategies": [{"tp": 8, "sequence_parallel": True, "micro_batch_size": 1}]}


def test_a_runs_goodput_pays_the_wait_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every policy's goodput is the one without the wait times step / (step + wait), the
    checkpoint interval untouched (the wait slows progress; it is no failure)."""
    from analysis.evaluate import resilience_rows

    study = study_from_dict(DOC_STUDY, name="docs")
    s = study.strategies[0]
    fast = estimate(study.model, s, study.system)
    rows = resilience_rows(study, s, fast)
    d = DS.data_straggler(study.model, s, study.system)
    assert d is not None and d.wait_s > 0
    keep = fast.step_time_s / (fast.step_time_s + d.wait_s)
    monkeypatch.setattr(DS, "data_straggler", lambda *a: dataclasses.replace(d, wait_s=0.0))
    without = {r["policy"]: r for r in resilience_rows(study, s, fast)}
    for r in rows:
        assert r["data_straggler_loss"] == pytest.approx(1 - keep, rel=1e-12)
        assert r["checkpoint_interval_s"] == without[r["policy"]]["checkpoint_interval_s"]
        assert r["goodput"] == pytest.approx(without[r["policy"]]["goodput"] * keep, rel=1e-12)


def test_resilience_says_what_uneven_documents_cost(tmp_path: Path) -> None:
    f = tmp_path / "docs.toml"
    f.write_text('model = "llama3-8b"\nseq_len = 32768\ndocuments = "4000~1"\n'
                 'system = "dgx-h100"\ngpus = 512\nglobal_batch_size = 512\ntokens = 1e11\n'
                 '[failures]\npreset = "llama3-16k-h100"\n'
                 '[[strategies]]\ntp = 8\nsequence_parallel = true\nmicro_batch_size = 1\n')
    result = CliRunner().invoke(app, ["resilience", str(f)], env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "uneven documents: a replica's attention varies by" in said
    assert "of goodput, included above" in said


def test_a_sweep_without_failures_says_the_wait_beside_its_ranking(tmp_path: Path) -> None:
    """It ranks by the mean step, and says what the slowest replica adds to the first ones
    (the wait of #1 as ``data_straggler`` gives it)."""
    f = tmp_path / "docs.toml"
    f.write_text('model = "llama3-8b"\nseq_len = 32768\ndocuments = "4000~1"\n'
                 'system = "dgx-h100"\ngpus = 64\nglobal_batch_size = 64\n[search]\n'
                 'tp = [2, 8]\npp = [1]\nmicro_batch_size = [1]\nsequence_parallel = [true]\n'
                 'zero_stage = [1]\nrecompute = ["none"]\n')
    out = tmp_path / "sweep"
    result = CliRunner().invoke(app, ["sweep", str(f), "--out", str(out), "--top-k", "1"],
                                env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    study = study_from_dict({"model": "llama3-8b", "seq_len": 32768, "documents": "4000~1",
                             "system": "dgx-h100", "gpus": 64, "global_batch_size": 64})
    best = pl.read_parquet(out / "results.parquet").row(0, named=True)
    d = DS.data_straggler(study.model, strategy_from_row(best), study.system)
    assert d is not None
    assert f"not in the ranking: #1 +{d.wait_s / best['step_time_s']:.1%} (dp 32)" in said


# --- uneven micro-batches in a 1F1B pipeline (analysis/pipeline_imbalance)


@given(p=st.integers(1, 9), m=st.integers(1, 24), f=st.floats(0.1, 5.0),
       b=st.floats(0.1, 5.0))
@settings(max_examples=60, deadline=None)
def test_alike_micro_batches_take_the_textbook_1f1b_step(p: int, m: int, f: float,
                                                         b: float) -> None:
    """Equal stages, equal micro-batches, no sends: (m + p − 1)·(f + b) (Narayanan et al.
    2021 §2.2.1), fewer micro-batches than stages included."""
    got = PI.makespan(np.full((p, m, 2), f), np.full((p, m, 2), b))
    assert got == pytest.approx([(m + p - 1) * (f + b)] * 2, rel=1e-12)


@given(p=st.integers(1, 6), m=st.integers(1, 12), seed=st.integers(0, 10**6))
@settings(max_examples=60, deadline=None)
def test_a_slower_op_never_shortens_the_step(p: int, m: int, seed: int) -> None:
    """The walk is a longest path: lengthening any one op never shortens it; it is never
    below the busiest stage's own work nor above all the work one op after another; one
    stage is the sum of its micro-batches."""
    rng = np.random.default_rng(seed)
    f, b = rng.uniform(0.1, 3.0, (p, m, 1)), rng.uniform(0.1, 3.0, (p, m, 1))
    base = float(PI.makespan(f, b)[0])
    s, j = rng.integers(p), rng.integers(m)
    longer = f.copy()
    longer[s, j] += rng.uniform(0.01, 2.0)
    assert float(PI.makespan(longer, b)[0]) >= base - 1e-12
    busiest = float((f + b).sum(axis=1).max())
    assert busiest - 1e-9 <= base <= float((f + b).sum()) + 1e-9
    if p == 1:
        assert base == pytest.approx(busiest, rel=1e-12)


def test_the_expected_largest_of_resampled_draws() -> None:
    """One draw: the mean; many: the largest; between, a resampling's average max (within
    its sampling error)."""
    draws = np.random.default_rng(5).gamma(2.0, 1.0, 400)
    assert PI.expected_max(draws, 1) == pytest.approx(draws.mean(), rel=1e-12)
    assert PI.expected_max(draws, 10**6) == pytest.approx(draws.max(), rel=1e-9)
    rng = np.random.default_rng(6)
    sim = rng.choice(draws, size=(20_000, 16)).max(axis=1).mean()
    assert PI.expected_max(draws, 16) == pytest.approx(sim, rel=0.01)


def test_a_pipeline_adds_bubbles_and_a_one_stage_walk_is_the_replica_sum() -> None:
    """Llama 3 70B at 32 K tokens: with a pipeline the wait holds one replica's own bubbles
    (positive, and part of the wait); at one stage, with attention linear in the pairs, the
    walk gives the replicas' sums as the closed form and resampling do (within 8%: draws)."""
    m = resolve_model("llama3-70b@seq32768@doc4000~1")
    piped = Strategy(tp=8, pp=4, dp=2, sequence_parallel=True, global_batch_size=64,
                     recompute="selective")
    d = DS.data_straggler(m, piped, SYSTEM)
    assert d is not None and 0 < d.pipeline_s < d.wait_s
    flat = Strategy(tp=8, cp=2, dp=4, sequence_parallel=True, global_batch_size=64,
                    recompute="selective")
    one = DS.data_straggler(m, flat, SYSTEM)
    assert one is not None and one.pipeline_s == 0.0 and one.wait_s > 0
    pairs = DS.sequence_pairs(m.seq_len, 4000, 1.0)

    def linear(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return 0.004 * y, 0.01 * y

    walked, _ = DS.replica_wait(flat, chunk_times_s(m, flat, SYSTEM), pairs[:, None], linear,
                                [m.num_layers])
    n = flat.global_batch_size // flat.dp
    want = 0.014 * m.num_layers * _expected_excess(pairs, n, flat.dp) / float(pairs.mean())
    assert walked == pytest.approx(want, rel=0.08)


@pytest.mark.parametrize(("schedule", "pp", "vpp"), [("1f1b", 4, 1),
                                                    ("interleaved_1f1b", 2, 2),
                                                    ("zb_h1", 4, 1), ("zb_v", 2, 2)])
def test_the_walk_matches_replay_of_a_pipeline_with_uneven_micro_batches(
        tmp_path: Path, schedule: str, pp: int, vpp: int) -> None:
    """A full-mode trace set whose 8 micro-batches' attention ops are scaled (1.9× to 0.4×
    their FLOPs, the rest untouched) is replayed; the walk of the schedule with the same ops'
    times and the fast path's sends gives how much longer the step gets, to float precision
    (without the sends it had been 5% short on 1F1B)."""
    m = ModelSpec(name="long", num_layers=8, hidden_size=1024, num_attention_heads=16,
                  num_kv_heads=8, ffn_hidden_size=2048, vocab_size=4096, seq_len=8192,
                  activation="swiglu", dropout=0.0)
    s = Strategy(pp=pp, vpp=vpp, schedule=schedule, global_batch_size=8)  # type: ignore[arg-type]
    y = np.array([1.6, 0.5, 1.0, 1.9, 0.4, 0.8, 1.2, 0.6])
    generate(m, s, tmp_path, mode="full")
    alike = replay(tmp_path, SYSTEM, contention=False).step_time_s
    name = re.compile(r"^[FB](\d+)\..*flash_attn(_bwd)?$")
    for f in sorted(tmp_path.glob("trainsim.*.et")):
        meta, nodes = read_et(f)
        for node in nodes:
            if (hit := name.match(node.name)) is not None:
                for a in node.attr:
                    if a.name == "num_ops":
                        a.int64_val = round(a.int64_val * y[int(hit.group(1))])
        with open(f, "wb") as out:
            encodeMessage(out, meta)
            for node in nodes:
                encodeMessage(out, node)
    uneven = replay(tmp_path, SYSTEM, contention=False).step_time_s
    compute = RooflineCompute(SYSTEM.gpu)

    def op_s(ops: list[O.Item], v: float) -> float:
        a = next(o for o in ops if isinstance(o, O.Op) and o.kind == "attention")
        return compute.op_time_ns(dataclasses.replace(a, flop=round(a.flop * v))) / 1e9

    fwd, bwd = O.layer_fwd(m, s), O.layer_bwd(m, s)
    per = m.num_layers // (pp * vpp)  # layers a chunk
    extra_f = np.array([op_s(fwd, v) - op_s(fwd, 1.0) for v in y])[None, :, None] * per
    extra_b = np.array([op_s(bwd, v) - op_s(bwd, 1.0) for v in y])[None, :, None] * per
    times = chunk_times_s(m, s, SYSTEM)
    base_f, base_b, base_w = (np.broadcast_to(np.array(x)[:, None, None], (pp * vpp, 8, 1))
                              if x else None for x in (times.fwd, times.bwd, times.wgt))
    assert (base_w is not None) == schedule.startswith("zb")
    walked = (PI.makespan(base_f + extra_f, base_b + extra_b, schedule, pp, times.sends, base_w)[0]
              - PI.makespan(base_f, base_b, schedule, pp, times.sends, base_w)[0])
    assert estimate(m, s, SYSTEM).step_time_s == pytest.approx(alike, rel=1e-3)
    assert walked == pytest.approx(uneven - alike, rel=1e-6)


@given(p=st.integers(2, 8), v=st.integers(2, 4), rounds=st.integers(1, 4),
       f=st.floats(0.1, 5.0), b=st.floats(0.1, 5.0))
@settings(max_examples=40, deadline=None)
def test_alike_micro_batches_take_the_textbook_interleaved_step(p: int, v: int, rounds: int,
                                                                f: float, b: float) -> None:
    """Interleaved 1F1B, m a multiple of p, every chunk f/v and b/v: m·(f + b) + (p − 1)·(f +
    b)/v (Narayanan et al. 2021 §2.2.2: the bubble shrinks v times)."""
    m = rounds * p
    got = PI.makespan(np.full((p * v, m, 1), f / v), np.full((p * v, m, 1), b / v),
                      "interleaved_1f1b", p)
    assert got[0] == pytest.approx(m * (f + b) + (p - 1) * (f + b) / v, rel=1e-9)


_cost = st.integers(1, 10_000)


@given(p=st.integers(1, 5), m=st.integers(1, 12), data=st.data())
@settings(max_examples=60, deadline=None)
def test_the_zero_bubble_walks_agree_with_the_fast_paths(p: int, m: int,
                                                         data: st.DataObject) -> None:
    """Alike micro-batches: the walk's ZB-H1 and ZB-V steps are the fast path's own walkers'
    (``zb_walk.zero_bubble``, ``zbv_walk.zero_bubble_v``: written apart, with their W passes
    and sends), on random integer costs a stage and chunk."""
    from analysis.zb_walk import zero_bubble
    from analysis.zbv_walk import zero_bubble_v

    def costs(n: int) -> list[int]:
        return data.draw(st.lists(_cost, min_size=n, max_size=n))

    f, b, w, c = costs(p), costs(p), costs(p), costs(p)

    def grid(x: list[int]) -> np.ndarray:
        return np.broadcast_to(np.array(x, dtype=float)[:, None, None], (len(x), m, 1))

    got = PI.makespan(grid(f), grid(b), "zb_h1", p, tuple(map(float, c)), grid(w))[0]
    assert got == max(zero_bubble(m, f, b, w, c))
    fv, bv, wv = ([(x[k], x[k + p]) for k in range(p)] for x in (costs(2 * p), costs(2 * p),
                                                                  costs(2 * p)))

    def by_chunk(x: list[tuple[int, int]]) -> np.ndarray:  # (global chunk: s, then 2p − 1 − s)
        return grid([x[g][0] if g < p else x[2 * p - 1 - g][1] for g in range(2 * p)])

    got = PI.makespan(by_chunk(fv), by_chunk(bv), "zb_v", p, tuple(map(float, c)),
                      by_chunk(wv))[0]
    assert got == max(zero_bubble_v(m, fv, bv, wv, c)[0])


def test_one_pipelined_replica_is_said_to_wait_for_its_bubbles() -> None:
    """With one replica there is no slowest one: the sentence speaks of the pipeline's
    bubbles; with several, of the slowest."""
    row = {"data_replicas": 1.0, "data_variation": 0.1, "data_wait_s": 1.2,
           "data_straggler_loss": 0.03}
    assert "leave bubbles in the pipeline: each step takes 1.2 s longer" in DS.describe(row)
    assert "slowest of 8 replicas" in DS.describe({**row, "data_replicas": 8.0})


def test_chunk_times_add_up_to_their_stages() -> None:
    """The fast path's chunk times: a stage's chunks add up to its pass, the embedding's and
    the head's chunks the longer ones, a send between the stages each way, short against a
    chunk (Llama 3 8B, pp 2, vpp 2)."""
    m = resolve_model("llama3-8b")
    s = Strategy(pp=2, vpp=2, schedule="interleaved_1f1b", global_batch_size=8)
    times = chunk_times_s(m, s, SYSTEM)
    fwd, bwd, sends = times.fwd, times.bwd, times.sends
    assert times.wgt == ()  # (W passes only under a zero-bubble schedule)
    assert len(times.opt) == 2 and all(0 < o < fwd[0] for o in times.opt)  # (a stage's Adam)
    fast = estimate(m, s, SYSTEM)
    for stage in range(2):
        assert fwd[stage] + fwd[stage + 2] == pytest.approx(fast.stage_fwd_s[stage], rel=1e-9)
        assert bwd[stage] + bwd[stage + 2] == pytest.approx(fast.stage_bwd_s[stage], rel=1e-9)
    assert fwd[3] > fwd[1] and fwd[0] > fwd[2]  # (the head; the embedding)
    assert len(sends) == 2 and all(0 < c < 0.1 * fwd[1] for c in sends)  # (a hop each way)


# --- a context-parallel split of the whole packed sequence (Strategy.cp_balance = "sequence")


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_each_ranks_share_adds_up_to_the_sequence(cp: int) -> None:
    """Split whole into 2·cp chunks, rank r holding r and 2·cp − 1 − r: the ranks' pairs add
    up to the sequence's, sequence by sequence; with documents far longer than the sequence
    (one causal piece) every rank holds s²/2/cp — the split's causal balance."""
    per = rank_pairs(8192, 3000, 1.2, cp)
    assert per.shape[1] == cp
    assert np.allclose(per.sum(axis=1), sequence_pairs(8192, 3000, 1.2), rtol=1e-9)
    long = rank_pairs(8192, 10**9, 0.5, cp)
    one = long[np.isclose(long.sum(axis=1), 8192**2 / 2)]  # (the sequences with no boundary)
    assert len(one) > 0.99 * len(long)
    assert np.allclose(one, 8192**2 / 2 / cp, rtol=1e-9)


def test_the_busiest_rank_sets_the_pace_and_more_sequences_even_it_out() -> None:
    """Documents of 4,000 tokens in 32 K sequences: the busiest rank holds more than the
    mean one (more so with more ranks); four sequences a micro-batch even it out; documents
    far longer than the sequence are balanced."""
    one = [busiest_rank_factor(32768, 4000, 1.0, cp, 1) for cp in (2, 4, 8)]
    assert 1 < one[0] < one[1] < one[2]
    assert busiest_rank_factor(32768, 4000, 1.0, 4, 4) < one[1]
    assert busiest_rank_factor(32768, 10**9, 1.0, 4, 1) == pytest.approx(1.0, abs=1e-3)


def test_a_whole_sequence_split_charges_the_busiest_rank() -> None:
    """Under "sequence" a rank's attention FLOPs are the balanced split's times the busiest
    rank's factor; without a document mask the balance changes nothing; the fast path agrees
    with replay."""
    docs = dataclasses.replace(SMALL, document_mean_tokens=700, document_length_sigma=1.0)
    even = Strategy(cp=4, micro_batch_size=2, global_batch_size=2)
    whole = dataclasses.replace(even, cp_balance="sequence")
    factor = busiest_rank_factor(SMALL.seq_len, 700, 1.0, 4, 2)
    assert factor > 1
    assert sum(o.flop for o in _attention(docs, whole)) == pytest.approx(
        factor * sum(o.flop for o in _attention(docs, even)), rel=1e-6)
    assert O.layer_fwd(SMALL, whole) == O.layer_fwd(SMALL, even)
    assert estimate(docs, whole, SYSTEM).step_time_s > estimate(docs, even, SYSTEM).step_time_s
    ref = replayed(docs, dataclasses.replace(whole, pp=2, global_batch_size=4), SYSTEM)
    assert estimate(docs, dataclasses.replace(whole, pp=2, global_batch_size=4),
                    SYSTEM).step_time_s == pytest.approx(ref.step_time_s, rel=0.02)
