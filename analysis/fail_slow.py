"""Stragglers over a whole run: fail-slow episodes (a GPU that keeps running, slower).

Wu et al. 2024 (Falcon, arXiv:2410.12588) characterise them on a production cluster of over
10,000 GPUs: CPU/GPU computation and cross-node network causes, episodes lasting from tens of
seconds to nearly ten hours; the usual remedy is to notice one and treat it as a fail-stop
(checkpoint and restart). A study's ``[fail_slow]`` table says how often, how long and how slow:

::

    [fail_slow]
    rate_per_gpu_hour = 2e-5     # episodes per GPU per hour
    mean_duration_s = 3600       # durations exponential with this mean
    slowdown = 2.0               # the slow GPU's kernels take 2× as long
    detect_s = 600               # optional: evicted after this long (a restart, counted as
                                 # a failure under each policy); absent: ridden out

The model, per strategy (DESIGN.md, "Fail-slow episodes"):

* **A step with one slow GPU.** Synchronous training waits for it: its tensor-parallel group at
  every collective, its data-parallel peers at the gradient reduction, the other stages of its
  pipeline at each hand-over. Its stage runs at the slowed compute (the fast path on a GPU
  with every throughput divided by ``slowdown`` and launches that much longer; communication
  is not slowed), and the schedule is walked with that one stage slowed
  (``fastpath.estimate_stages``: its wait hidden where the schedule leaves slack, its
  optimizer step slowed too). A slow GPU is equally likely on every stage: the step factor is
  the mean over stages (the worst, on the bottleneck stage, is reported beside it). Replay
  with the stage slowed is the reference (tested within 1% a stage).
* **How much of the run is slowed.** Episodes arrive at ``rate · gpus`` per hour and overlap
  as an M/G/∞ queue: the number in progress is Poisson with mean ``rate · gpus · E[slow
  time]``, so the share of wall time with at least one is ``p = 1 − exp(−that mean)``
  (concurrent episodes are taken to slow the step no more than one: they stall the same
  synchronous step). With ``detect_s`` an episode is slow for ``E[min(D, detect_s)] =
  D(1 − e^{−detect_s/D})`` and a share ``e^{−detect_s/D}`` of them end in an eviction.
* **Goodput.** Progress runs at 1/f of the healthy rate a share p of the time:
  ``g = 1 − p(1 − 1/f)``, multiplied into each recovery policy's goodput; evictions add to the
  failure rate the policies are costed with.

Compute stragglers only; slow NICs over a run are ``analysis.slow_links`` (the same episodes).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from analysis.fastpath import estimate, estimate_stages
from analysis.resilience import HOUR_S, number
from replay.hardware import SystemSpec
from tracegen import ConfigError, ModelSpec, Strategy

KEYS = {"rate_per_gpu_hour", "mean_duration_s", "slowdown", "detect_s"}
MAX_SLOWDOWN = 1000.0


@dataclasses.dataclass(frozen=True, slots=True)
class FailSlow:
    rate_per_gpu_hour: float
    mean_duration_s: float
    slowdown: float
    detect_s: float | None = None  # None: episodes are ridden out

    def slow_s_per_episode(self) -> float:
        """E[min(D, detect_s)] for exponential D (the slowed time of one episode)."""
        d = self.mean_duration_s
        return d if self.detect_s is None else d * -math.expm1(-self.detect_s / d)

    def evicted_share(self) -> float:
        return 0.0 if self.detect_s is None else math.exp(-self.detect_s / self.mean_duration_s)

    def active_share(self, gpus: int) -> float:
        """Share of wall time with at least one episode in progress (M/G/∞ occupancy)."""
        return -math.expm1(-self.rate_per_gpu_hour * gpus * self.slow_s_per_episode() / HOUR_S)

    def evicted_rate_per_gpu_hour(self) -> float:
        return self.rate_per_gpu_hour * self.evicted_share()


def fail_slow_from(spec: dict[str, Any]) -> FailSlow:
    """A study's ``[fail_slow]`` table, checked (every problem named in one error)."""
    check_keys(spec, "fail_slow", KEYS)
    slowdown = number("fail_slow", "slowdown", spec["slowdown"], positive=True)
    if not 1 <= slowdown <= MAX_SLOWDOWN:
        raise ConfigError(f"slowdown = {slowdown:g}: it is how many times longer the slow GPU's "
                          f"kernels take, from 1 to {MAX_SLOWDOWN:g} (2.0 is half speed; below "
                          "1 it would be faster, far above it has failed: a [failures] matter)",
                          what="study [fail_slow]")
    return episodes(spec, "fail_slow", slowdown)


def check_keys(spec: dict[str, Any], table: str, keys: set[str],
               optional: str = "detect_s") -> None:
    """Unknown and missing keys of an episodes table (``keys``; ``optional`` may be absent),
    all named in one error."""
    unknown = sorted(set(spec) - keys)
    missing = sorted(keys - {optional} - set(spec))
    if unknown or missing:
        raise ConfigError((["unknown keys " + ", ".join(unknown)] if unknown else [])
                          + (["missing " + ", ".join(missing)] if missing else [])
                          + [f"keys: {', '.join(sorted(keys))} ({optional} optional)"],
                          what=f"study [{table}]")


def episodes(spec: dict[str, Any], table: str, slowdown: float) -> FailSlow:
    """The episodes of a checked table (``check_keys``) with the step ``slowdown`` they cause."""
    detect = spec.get("detect_s")
    return FailSlow(number(table, "rate_per_gpu_hour", spec["rate_per_gpu_hour"], positive=True),
                    number(table, "mean_duration_s", spec["mean_duration_s"], positive=True),
                    slowdown,
                    None if detect is None else number(table, "detect_s", detect, positive=True))


def slowed_system(system: SystemSpec, slowdown: float) -> SystemSpec:
    """``system`` with a GPU whose every kernel takes ``slowdown`` times as long: its peaks and
    HBM bandwidth divided by it, its launch overhead multiplied (the network is untouched)."""
    g = system.gpu
    gpu = dataclasses.replace(
        g, peak_bf16_TFLOPs=g.peak_bf16_TFLOPs / slowdown,
        peak_fp16_TFLOPs=g.peak_fp16_TFLOPs / slowdown,
        peak_fp8_TFLOPs=g.peak_fp8_TFLOPs / slowdown, peak_fp4_TFLOPs=g.peak_fp4_TFLOPs / slowdown,
        peak_fp32_TFLOPs=g.peak_fp32_TFLOPs / slowdown, hbm_GBps=g.hbm_GBps / slowdown,
        launch_overhead_us=g.launch_overhead_us * slowdown)
    return dataclasses.replace(system, gpu=gpu)


def pipeline_bound_s(stage_s: list[float], microbatches: int, chunks: int) -> float:
    """T = m · max tᵢ + (Σ tᵢ − max tᵢ)/v: exact for 1F1B and interleaved 1F1B with alike
    stages ((m + (p − 1)/v) · t), the bottleneck-paced bound with unequal ones."""
    worst = max(stage_s)
    return microbatches * worst + (sum(stage_s) - worst) / chunks


def stage_factors(model: ModelSpec, s: Strategy, system: SystemSpec, slowdown: float,
                  placed: Mapping[int, SystemSpec] | None = None) -> list[float]:
    """Per pipeline stage: the step time with one slow GPU on that stage over the healthy
    step, both from the fast path (a caller's step may be a replay's: the ratio is the
    model's). At pp 1 the slowed fast path itself (every rank waits for the slow one).
    ``placed``: stages on another system's GPUs (a ``[mixed]`` cluster), each slowed as its own
    GPU is."""
    return stage_factors_on(model, s, system, lambda x: slowed_system(x, slowdown), placed)


def stage_factors_on(model: ModelSpec, s: Strategy, system: SystemSpec,
                     slowing: Callable[[SystemSpec], SystemSpec],
                     placed: Mapping[int, SystemSpec] | None = None) -> list[float]:
    """Per pipeline stage: the step with that stage's system made ``slowing`` of it
    (``estimate_stages``: the schedule walked) over the healthy step; at pp 1, the slowed
    system's estimate over it. ``placed``: stages on other systems in both steps (the healthy
    step is then theirs too: ``mixed.placed_fast``'s)."""
    where = dict(placed or {})
    healthy = estimate_stages(model, s, system, where).step_time_s
    slow = {id(x): slowing(x) for x in (system, *where.values())}  # one each: memos key by it
    if s.pp == 1:
        return [estimate(model, s, slow[id(system)]).step_time_s / healthy]
    return [estimate_stages(model, s, system,
                            {**where, j: slow[id(where.get(j, system))]}).step_time_s / healthy
            for j in range(s.pp)]


def step_factors(model: ModelSpec, s: Strategy, system: SystemSpec, slowdown: float,
                 placed: Mapping[int, SystemSpec] | None = None,
                 weights: list[float] | None = None) -> tuple[float, float]:
    """(mean over stages — a slow GPU is as likely on each, or as ``weights`` say —, worst)
    of ``stage_factors``."""
    return mean_and_worst(stage_factors(model, s, system, slowdown, placed), weights)


def mean_and_worst(factors: list[float], weights: list[float] | None = None
                   ) -> tuple[float, float]:
    """(the step factor of an episode on a stage drawn with ``weights`` — how likely one is on
    each: alike where None, or a ``[mixed]`` cluster's other GPUs at their own rate —, the
    worst)."""
    w = weights or [1.0] * len(factors)
    return sum(f * x for f, x in zip(factors, w, strict=True)) / sum(w), max(factors)


def progress(fs: FailSlow, gpus: int, factor: float) -> float:
    """Share of the healthy progress rate kept: 1 − p(1 − 1/f)."""
    return 1 - fs.active_share(gpus) * (1 - 1 / factor)


def describe(row: dict[str, Any]) -> str:
    """What the episodes cost, in words, from a resilience row's ``fail_slow_*`` columns (the
    CLI's line under each strategy's table and the report's under its policies)."""
    return episode_text(row, "fail_slow", f"fail-slow: one GPU {row['fail_slow_slowdown']:g}× "
                        "slower", "on the bottleneck stage")


def episode_text(row: dict[str, Any], table: str, head: str, worst: str) -> str:
    """The sentence of ``describe`` for a study table's episodes (``table``: the columns'
    prefix) with the one slow part named by ``head`` and its worst stage by ``worst``."""
    line = (f"{head} stretches a step {row[f'{table}_step_factor']:.2f}× ({worst} "
            f"{row[f'{table}_worst_step_factor']:.2f}×); episodes in progress "
            f"{row[f'{table}_active_share']:.1%} of the time: {row[f'{table}_loss']:.2%} of "
            "goodput, included above")
    if row.get(f"{table}_detect_s") is not None:
        line += (f"; {row[f'{table}_evicted_share']:.0%} of episodes outlast "
                 f"{row[f'{table}_detect_s']:g} s and are evicted (counted among the failures)")
    return line
