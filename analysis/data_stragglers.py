"""Stragglers from data: under a document mask sequences attend unevenly, and the step waits
for the data-parallel replica whose sequences attended most — and, inside a pipeline, for the
bubbles its uneven micro-batches leave.

A sequence's pairs X (``tracegen.documents``) vary with where the cuts fall among the
documents (``sequence_pairs`` simulates them). A replica runs m micro-batches of mbs
sequences a step, sampled independently (Megatron-Core's ``GPTDataset`` shuffles its
samples); each stage's forward and backward of a micro-batch is the fast path's with its
attention at the micro-batch's pairs (``attention_curve``), and the replica's step is the
walk of its schedule over them (``pipeline_imbalance.makespan``; at one stage their sum). Every
replica's gradients are reduced together at the step's end, so the step takes the slowest
replica's: the expected largest of dp draws (their order statistics, or beyond the draws
mean + sd·e(dp), e(k) the expected largest of k standard normals: e(2) = 1/√π; Tippett 1925,
"On the extreme individuals and the range of samples"; the tests hold the walk to the same
for sums of sequences in closed form and by resampling).

Stragglers in production training are not only hardware's (Lin et al. 2025, "Understanding
Stragglers in Large Model Training Using What-if Analysis", OSDI: ByteDance's five-month
trace); WLB-LLM (Wang et al. 2025, OSDI, Meta) traces the imbalance of 4D-parallel training
to input-dependent attention over documents of uneven length, at the pipeline and context-
parallel levels, and packs micro-batches by their attention work to remove it — this wait is
what a planner would save. Context parallelism's ranks wait for the busiest one where the
packed sequence is split whole (``Strategy.cp_balance``: each micro-batch's busiest rank is
drawn); Transformer Engine's per-document split leaves them balanced.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from analysis.fastpath import ChunkTimes
from replay.compute import RooflineCompute
from replay.hardware import SystemSpec
from tracegen import ModelSpec, Strategy
from tracegen import ops as O
from tracegen.documents import rank_pairs, sequence_pairs


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


# Draws of a replica's micro-batches (each a walk of its schedule, vectorized over them), fewer
# where chunks × micro-batches × draws would pass WALK_CELLS (~160 MB an array of the walk)
REPLICA_DRAWS = 2_000
MIN_REPLICA_DRAWS = 200
WALK_CELLS = 20_000_000
CURVE_POINTS = 65  # where the attention kernels' times are evaluated, interpolated between

# Seconds of one layer's attention a micro-batch, forward and backward, for micro-batches whose
# sequences attend y times the mean pairs (an array of y)
AttentionCurve = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


def data_straggler(model: ModelSpec, s: Strategy, system: SystemSpec) -> DataStraggler | None:
    """The expected wait for the replica whose sequences attended most, and with a pipeline
    each replica's own bubbles from uneven micro-batches (``replica_wait``). None without a
    document mask."""
    if model.document_mask is None:
        return None
    pairs = sequence_pairs(model.seq_len, model.document_mean_tokens,
                           model.document_length_sigma)
    # what a micro-batch waits for: its sequences' pairs, or under a whole-sequence context-
    # parallel split the busiest rank's (``Strategy.cp_balance``)
    split = s.cp > 1 and s.cp_balance == "sequence"
    work = (rank_pairs(model.seq_len, model.document_mean_tokens, model.document_length_sigma,
                       s.cp) if split else pairs[:, None])
    n = s.global_batch_size // s.dp
    variation = float(pairs.std(ddof=1)) / math.sqrt(n) / float(pairs.mean())
    layers = [s.stage_layers(model.num_layers, stage) for stage in range(s.pp)]
    curve = attention_curve(model, s, system)
    fwd, bwd = curve(np.ones(1))
    attention_s = float(fwd[0] + bwd[0]) * max(layers) * s.num_microbatches
    chunks_s, chunk_layers = _walked_chunks(model, s, system)
    wait_s, own_s = replica_wait(s, chunks_s, work, curve, chunk_layers)
    if s.pp == 1:  # (one stage: the mean replica's step is the sum's, no bubbles; what the
        wait_s, own_s = wait_s - own_s, 0.0  # kernel curve moves the mean is no wait)
    return DataStraggler(s.dp, n, variation, attention_s, wait_s, own_s)


def replica_wait(s: Strategy, chunks_s: ChunkTimes, work: np.ndarray, curve: AttentionCurve,
                 layers: list[int]) -> tuple[float, float]:
    """``REPLICA_DRAWS`` draws (fewer on long walks: ``WALK_CELLS``) of a replica's m
    micro-batches (each mbs sequences drawn from the rows of ``work``: a sequence's pairs on
    each context-parallel rank, or in one column all of them; a micro-batch waits for its
    busiest column's sum), walked through its schedule (``pipeline_imbalance.makespan``; at
    one stage the sum): each global model chunk's forward and backward (``chunks_s``) with
    its layers' (``layers``) attention at the micro-batch's pairs (``curve``). Returns the step
    the slowest of dp replicas takes (the draws' order statistics up to dp = draws, a normal
    fit beyond) and one replica's mean, each beyond the walk of alike micro-batches. A
    zero-bubble schedule's W passes (``chunks_s.wgt``) hold no attention: they keep their
    time whatever the micro-batch's sequences."""
    from analysis.pipeline_imbalance import expected_max, makespan, walked_schedule

    rng = np.random.default_rng(1)
    m, b, p = s.num_microbatches, s.micro_batch_size, s.pp
    draws = max(MIN_REPLICA_DRAWS, min(REPLICA_DRAWS, WALK_CELLS // (len(layers) * m)))
    y = work[rng.integers(0, len(work), size=(m, draws, b))].sum(axis=2).max(axis=2)
    y /= y.mean()  # (their own mean: what the draws' mean strays by is no wait)
    at_f, at_b = curve(y)
    one_f, one_b = curve(np.ones(1))
    count = np.array(layers, dtype=float)[:, None, None]
    base_f, base_b = (np.array(x)[:, None, None] for x in (chunks_s.fwd, chunks_s.bwd))
    shape = (len(layers), m, 1)
    wgt = np.broadcast_to(np.array(chunks_s.wgt)[:, None, None], shape) if chunks_s.wgt else None
    order = walked_schedule(s.order_id)
    steps = makespan(base_f + count * (at_f - one_f[0])[None],
                     base_b + count * (at_b - one_b[0])[None], order, p, chunks_s.sends,
                     None if wgt is None else np.broadcast_to(wgt, (len(layers), m, draws)))
    alike = float(makespan(np.broadcast_to(base_f, shape), np.broadcast_to(base_b, shape),
                           order, p, chunks_s.sends, wgt)[0])
    mean = float(steps.mean())
    slowest = (mean if s.dp == 1 else expected_max(steps, s.dp) if s.dp <= draws
               else mean + float(steps.std(ddof=1)) * expected_max_normal(s.dp))
    return slowest - alike, mean - alike


def _walked_chunks(model: ModelSpec, s: Strategy, system: SystemSpec
                   ) -> tuple[ChunkTimes, list[int]]:
    """Each global model chunk's forward and backward of one micro-batch (a zero-bubble
    schedule's B and W passes) and the sends (the fast path's ``chunk_times_s``), and each
    chunk's layers."""
    from analysis.fastpath import chunk_times_s

    return chunk_times_s(model, s, system), [len(s.chunk_layers(model.num_layers, g))
                                              for g in range(s.pp * s.vpp)]


def attention_curve(model: ModelSpec, s: Strategy, system: SystemSpec) -> AttentionCurve:
    """One layer's core attention a micro-batch (forward; backward with the forward run again
    where recompute reruns it) when its sequences attend y times the mean pairs: each
    attention op's FLOPs y times, and its call length too (the equivalent causal length 2P/s:
    more pairs, longer pieces, a more efficient kernel), evaluated at ``CURVE_POINTS`` and
    interpolated."""
    compute = RooflineCompute(system.gpu)
    fwd = [op for op in O.layer_fwd(model, s) if isinstance(op, O.Op) and op.kind == "attention"]
    bwd = [op for op in O.layer_bwd(model, s) if isinstance(op, O.Op) and op.kind == "attention"]
    again = s.recompute == "full" or (s.recompute == "selective"
                                      and "core_attn" in s.recompute_modules.split(","))

    def seconds(ops: list[O.Op], y: float) -> float:
        return sum(compute.op_time_ns(dataclasses.replace(
            op, flop=max(1, round(op.flop * y)), m=max(1, round(op.m * y)),
            n=max(1, round(op.n * y)))) for op in ops) / 1e9

    def curve(y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        grid = np.linspace(float(y.min()), float(y.max()), CURVE_POINTS)
        f = np.array([seconds(fwd, g) for g in grid])
        b = np.array([seconds(bwd, g) for g in grid]) + (f if again else 0.0)
        return np.interp(y, grid, f), np.interp(y, grid, b)

    return curve


def describe(row: dict[str, Any]) -> str:
    """What the wait costs, in words, from a resilience row's ``data_*`` columns."""
    k, wait = round(row["data_replicas"]), f"{row['data_wait_s']:.3g} s"
    what = (f"the slowest of {k:,} replicas keeps each step waiting {wait} on average" if k > 1
            else f"uneven micro-batches leave bubbles in the pipeline: each step takes {wait} "
                 "longer on average")
    return (f"uneven documents: a replica's attention varies by {row['data_variation']:.1%} a "
            f"step, and {what}: {row['data_straggler_loss']:.2%} of goodput, included above")
