"""Stragglers from data: under a document mask sequences attend unevenly, and the step waits
for the data-parallel replica whose sequences attended most.

A sequence's pairs X (``tracegen.documents``) vary with where the cuts fall among the
documents. A replica runs n = global batch / dp sequences a step, sampled independently
(Megatron-Core's ``GPTDataset`` shuffles its samples), so its attention work is a sum of n
draws of X: mean n·E[X], standard deviation √n·sd(X) (the central limit theorem). Every
replica's gradients are reduced together at the step's end, so the step takes the slowest:
E[max of dp such sums] = n·E[X] + √n·sd(X)·e(dp), with e(k) the expected largest of k standard
normals (e(2) = 1/√π; Tippett 1925, "On the extreme individuals and the range of samples");
for fewer than 30 sequences a replica, whose sums are skewed, the simulated sequences are
resampled instead.
The wait is that excess at the attention's rate on the busiest pipeline stage. Stragglers
in production training are not only hardware's (Lin et al. 2025, "Understanding Stragglers in
Large Model Training Using What-if Analysis", OSDI: ByteDance's five-month trace); WLB-LLM
(Wang et al. 2025, OSDI, Meta) traces the imbalance of 4D-parallel training to
input-dependent attention over documents of uneven length and packs micro-batches by their
attention work to remove it — which this wait is what a planner would save.

Left out: the variation of a micro-batch within the pipeline (stages waiting on each other
micro-batch by micro-batch, which adds to the wait), the kernel's efficiency changing with
the pieces' lengths (the mean's curve point is used), and context parallelism's ranks
(Transformer Engine splits every document over them: balanced within a replica).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np

from analysis.fastpath import FastEstimate
from replay.compute import RooflineCompute
from replay.hardware import SystemSpec
from tracegen import ModelSpec, Strategy
from tracegen import ops as O
from tracegen.documents import masked_pairs

# Simulated documents are capped here (memory ~100 MB at most); the moments keep at least
# MIN_SEQUENCES sequences' worth.
MAX_DOCUMENTS = 3_000_000
MIN_SEQUENCES = 400
SEQUENCES = 20_000


@functools.lru_cache(maxsize=64)
def sequence_pairs(seq: int, mean_tokens: float, sigma: float, *, seed: int = 0
                   ) -> np.ndarray:
    """One sequence's pairs (Σ ℓᵢ²/2 over its pieces) for sequences cut at independent random
    places from a simulated stream of log-normal documents (``SEQUENCES`` of them; fewer where
    the documents are short, at least ``MIN_SEQUENCES``); seeded, so the same inputs give the
    same answer."""
    rng = np.random.default_rng(seed)
    sequences = int(min(SEQUENCES, max(MIN_SEQUENCES, MAX_DOCUMENTS * mean_tokens / seq)))
    mu = math.log(mean_tokens) - sigma * sigma / 2
    docs = int(min(MAX_DOCUMENTS, sequences * seq / mean_tokens) * 1.2) + 1_000
    lengths = (np.exp(rng.normal(mu, sigma, docs)) if sigma
               else np.full(docs, float(mean_tokens)))
    ends = np.cumsum(lengths)
    squares = np.concatenate(([0.0], np.cumsum(lengths * lengths)))  # Σ L² of docs < i
    start = ends[min(500, docs // 4)]
    if ends[-1] - seq <= start:  # a sequence of over a million documents: its pieces average
        flat = np.full(MIN_SEQUENCES, masked_pairs(seq, mean_tokens, sigma))  # out (~1/√docs)
        flat.flags.writeable = False
        return flat
    a = rng.uniform(start, ends[-1] - seq, sequences)
    b = a + seq
    first = np.searchsorted(ends, a, side="right")  # the document a falls in
    last = np.searchsorted(ends, b, side="left")  # the document b − 0 falls in
    one = first == last
    head = np.minimum(ends[first], b) - a
    tail = b - ends[np.maximum(last - 1, 0)]
    whole = squares[last] - squares[np.minimum(first + 1, last)]  # documents wholly inside
    pairs = np.where(one, seq * seq / 2, (head * head + tail * tail + whole) / 2)
    pairs.flags.writeable = False  # (cached: shared by every caller)
    return pairs


def pair_moments(seq: int, mean_tokens: float, sigma: float, *, seed: int = 0
                 ) -> tuple[float, float]:
    """Mean and variance of ``sequence_pairs``."""
    pairs = sequence_pairs(seq, mean_tokens, sigma, seed=seed)
    return float(pairs.mean()), float(pairs.var(ddof=1))


# A replica of this many sequences or more is a normal sum (the central limit theorem); below
# it the sum's skew matters (one sequence can attend at most s²/2) and it is resampled.
CLT_SEQUENCES = 30
RESAMPLED_DRAWS = 20_000_000  # draws the resampling may take in all


def expected_excess(pairs: np.ndarray, n: int, k: int, *, seed: int = 0) -> float:
    """E[max over k replicas of a sum of n sequences' pairs] less the mean sum: √n·sd·e(k)
    from n = ``CLT_SEQUENCES`` on, else by resampling ``pairs`` (at least 20 rounds of k
    replicas, more while the draws allow, up to 500)."""
    if k <= 1:
        return 0.0
    if n >= CLT_SEQUENCES:
        return math.sqrt(n) * float(pairs.std(ddof=1)) * expected_max_normal(k)
    rng = np.random.default_rng(seed)
    rounds = int(max(20, min(500, RESAMPLED_DRAWS // (k * n))))
    best = [float(rng.choice(pairs, size=(k, n)).sum(axis=1).max()) for _ in range(rounds)]
    return float(np.mean(best)) - n * float(pairs.mean())


@functools.lru_cache(maxsize=256)
def expected_max_normal(k: int) -> float:
    """E[max of k independent standard normals]: ∫ x·k·φ(x)·Φ(x)^(k−1) dx (0 for one)."""
    if k <= 1:
        return 0.0
    x = np.linspace(-12.0, 12.0, 48_001)
    cdf = 0.5 * np.array([math.erfc(-v / math.sqrt(2.0)) for v in x])
    pdf = np.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    with np.errstate(under="ignore"):
        density = k * pdf * np.exp((k - 1) * np.log(np.maximum(cdf, 1e-300)))
    return float(np.trapezoid(x * density, x))


@dataclasses.dataclass(frozen=True, slots=True)
class DataStraggler:
    """What uneven sequences cost a step under a document mask."""

    replicas: int  # data-parallel replicas waiting for each other
    sequences: int  # sequences a replica runs a step
    variation: float  # the coefficient of variation of a replica's attention work a step
    attention_s: float  # the busiest stage's attention a step (the mean replica's)
    wait_s: float  # the expected step beyond the one of alike micro-batches
    pipeline_s: float = 0.0  # of which one replica's pipeline adds (uneven micro-batches)


# Draws of a pipelined replica's micro-batches (each a 1F1B walk, vectorized over them)
PIPELINE_DRAWS = 2_000


def data_straggler(model: ModelSpec, s: Strategy, system: SystemSpec,
                   fast: FastEstimate | None = None) -> DataStraggler | None:
    """The expected wait for the replica whose sequences attended most (None without a
    document mask); with a pipeline, each replica's own bubbles from uneven micro-batches
    too (``_pipelined``; ``fast``: the strategy's fast-path estimate, where the caller has
    it)."""
    mask = model.document_mask
    if mask is None:
        return None
    pairs = sequence_pairs(model.seq_len, model.document_mean_tokens,
                           model.document_length_sigma)
    n, mean = s.global_batch_size // s.dp, float(pairs.mean())
    variation = float(pairs.std(ddof=1)) / math.sqrt(n) / mean
    fwd_s, bwd_s = _layer_attention_s(model, s, system)
    layers = [s.stage_layers(model.num_layers, stage) for stage in range(s.pp)]
    attention_s = (fwd_s + bwd_s) * max(layers) * s.num_microbatches
    if s.pp == 1:
        wait_s = attention_s * expected_excess(pairs, n, s.dp) / (n * mean)
        return DataStraggler(s.dp, n, variation, attention_s, wait_s)
    if fast is None:
        from analysis.fastpath import estimate

        fast = estimate(model, s, system)
    wait_s, pipeline_s = _pipelined(s, fast, pairs, (fwd_s, bwd_s), layers)
    return DataStraggler(s.dp, n, variation, attention_s, wait_s, pipeline_s)


def _pipelined(s: Strategy, fast: FastEstimate, pairs: np.ndarray,
               attention: tuple[float, float], layers: list[int]) -> tuple[float, float]:
    """A pipelined replica: ``PIPELINE_DRAWS`` draws of its m micro-batches (each mbs
    sequences), every stage's forward and backward the fast path's (``fast``) with its
    attention scaled by the micro-batch's pairs over the mean, walked through 1F1B
    (``pipeline_imbalance.makespan``; interleaved and zero-bubble schedules walked so too,
    their chunks together); the step the slowest of dp replicas takes (the draws' order
    statistics up to dp = draws, a normal fit beyond) and one replica's mean, each beyond
    the walk of alike micro-batches."""
    from analysis.pipeline_imbalance import expected_max, makespan

    rng = np.random.default_rng(1)
    m, b = s.num_microbatches, s.micro_batch_size
    y = rng.choice(pairs, size=(m, PIPELINE_DRAWS, b)).sum(axis=2)
    y /= y.mean()  # (their own mean: what the draws' mean strays by is no wait)
    att_f = np.array(layers)[:, None, None] * attention[0]
    att_b = np.array(layers)[:, None, None] * attention[1]
    base_f = np.array(fast.stage_fwd_s)[:, None, None]
    base_b = np.array(fast.stage_bwd_s)[:, None, None]
    steps = makespan(base_f + att_f * (y[None] - 1), base_b + att_b * (y[None] - 1))
    alike = float(makespan(np.broadcast_to(base_f, (s.pp, m, 1)),
                           np.broadcast_to(base_b, (s.pp, m, 1)))[0])
    slowest = (expected_max(steps, s.dp) if s.dp <= PIPELINE_DRAWS
               else float(steps.mean() + steps.std(ddof=1) * expected_max_normal(s.dp)))
    return slowest - alike, float(steps.mean()) - alike


def _layer_attention_s(model: ModelSpec, s: Strategy, system: SystemSpec
                       ) -> tuple[float, float]:
    """Seconds one layer spends in core attention a micro-batch, forward and backward (the
    backward with the forward run again where recompute reruns it)."""
    compute = RooflineCompute(system.gpu)
    fwd = sum(compute.op_time_ns(op) for op in O.layer_fwd(model, s)
              if isinstance(op, O.Op) and op.kind == "attention")
    bwd = sum(compute.op_time_ns(op) for op in O.layer_bwd(model, s)
              if isinstance(op, O.Op) and op.kind == "attention")
    again = s.recompute == "full" or (s.recompute == "selective"
                                      and "core_attn" in s.recompute_modules.split(","))
    return fwd / 1e9, (bwd + (fwd if again else 0)) / 1e9


def describe(row: dict[str, Any]) -> str:
    """What the wait costs, in words, from a resilience row's ``data_*`` columns."""
    return (f"uneven documents: a replica's attention varies by {row['data_variation']:.1%} a "
            f"step, and the slowest of {row['data_replicas']:,.0f} replicas keeps each step "
            f"waiting {row['data_wait_s']:.3g} s on average: {row['data_straggler_loss']:.2%} "
            "of goodput, included above")
