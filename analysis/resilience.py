"""Failures over a whole run: failure processes, checkpoint cost, restart cost, recovery policies,
goodput (effective training time ratio, ETTR) in closed form and by Monte Carlo.

Closed form (exponential failures, Daly 2006, "A higher order estimate of the optimum checkpoint
interval for restart dumps", FGCS 22, eq. 13): with job MTTF M, checkpoint interval τ (compute
between checkpoints), blocking checkpoint cost δ and restart cost R, the expected wall time to do
W seconds of failure-free work is

    T(W) = M · e^{R/M} · (e^{(τ+δ)/M} − 1) · W / τ,        ETTR = W / T(W).

Young (1974): τ* = √(2δM). Daly (2006) eq. 37: τ* = √(2δM)·[1 + ⅓√(δ/2M) + ⅑(δ/2M)] − δ (δ < 2M).
A checkpoint a restart can load only W after it is taken (written in the background, or copied
to a peer) sets τ ≥ W and adds W to R (``ettr_checkpoint_restart``).
The Monte Carlo runs the same process (failures also strike during restarts) and agrees with the
closed form within its statistical error (a test holds it to that).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import polars as pl

from analysis.checkpoint_share import checked_staging
from tracegen._config import is_finite_number
from tracegen.errors import ConfigError

HOUR_S = 3600.0
DAY_S = 86_400.0
Policy = Literal["global_restart", "in_memory", "hot_spares", "replica_local", "elastic_shrink"]
POLICIES: tuple[str, ...] = ("global_restart", "in_memory", "hot_spares", "replica_local",
                             "elastic_shrink")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FailureModel:
    """Failures per GPU-hour (a Poisson process per GPU; Weibull shape ≠ 1 for wear-in/out)."""

    name: str
    rate_per_gpu_hour: float
    weibull_shape: float = 1.0
    source: str = ""
    # the failures the rate was counted from (its relative uncertainty 1/√n: the spread of the
    # end date takes it, ``wall_spread.rate_mttfs``); 0: the rate taken as exact
    observed_failures: float = 0.0

    def __post_init__(self) -> None:
        if not (self.rate_per_gpu_hour > 0 and math.isfinite(self.rate_per_gpu_hour)):
            raise ConfigError(f"rate_per_gpu_hour must be a positive number, got "
                              f"{self.rate_per_gpu_hour}", what=f"failure model {self.name!r}")
        if self.weibull_shape <= 0:
            raise ConfigError(f"weibull_shape must be > 0, got {self.weibull_shape}",
                              what=f"failure model {self.name!r}")
        if not (is_finite_number(self.observed_failures) and (
                self.observed_failures == 0 or self.observed_failures >= 1)):
            raise ConfigError("observed_failures is the count of failures the rate was "
                              "measured from (at least 1), or 0 for a rate taken as exact, got "
                              f"{self.observed_failures!r}", what=f"failure model {self.name!r}")

    def job_mttf_s(self, gpus: int) -> float:
        """A job fails when any of its GPUs does: rates add (Kokolis et al. 2025 model)."""
        return HOUR_S / (self.rate_per_gpu_hour * gpus)


FAILURE_PRESETS: dict[str, FailureModel] = {
    # Dubey et al. 2024 (The Llama 3 Herd of Models), §3.3.4 and Table 5: 419 unexpected
    # interruptions in a 54-day snapshot of Llama 3 405B pre-training on 16,384 H100 GPUs.
    "llama3-16k-h100": FailureModel(
        name="llama3-16k-h100", rate_per_gpu_hour=419 / (54 * 24 * 16_384),
        source="Dubey et al. 2024, Table 5: 419 unexpected interruptions, 54 days, 16,384 GPUs",
        observed_failures=419),
    # The projection quoted by FT-HSDP (Salpekar et al. 2026) and Kokolis et al. 2025: a 131,072-
    # GPU job fails about every 15 minutes.
    "projection-131k-15min": FailureModel(
        name="projection-131k-15min", rate_per_gpu_hour=1 / (0.25 * 131_072),
        source="Kokolis et al. 2025 projection: MTTF ≈ 15 min at 131,072 GPUs"),
    # Susan Zhang's account of the OPT-175B logbook (Zhang et al. 2022 and the accompanying talk):
    # about 53-54 restarts in 56 days on 992 A100 80GB GPUs. These mix hardware failures with
    # restarts for numerical instability, so the rate is an upper bound for hardware alone.
    "opt-175b-992-a100": FailureModel(
        name="opt-175b-992-a100", rate_per_gpu_hour=53.5 / (56 * 24 * 992),
        source="OPT-175B logbook as told by Zhang: ~53-54 restarts in 56 days on 992 A100s",
        observed_failures=53.5),
}

# Llama 3 Table 5 cause mix of the 419 unexpected interruptions (counts).
LLAMA3_CAUSES: dict[str, int] = {
    "faulty GPU": 148, "GPU HBM3 memory": 72, "software bug": 54, "network switch/cable": 35,
    "host maintenance": 32, "GPU SRAM memory": 19, "GPU system processor": 17, "NIC": 7,
    "NCCL watchdog timeout": 7, "silent data corruption": 6, "GPU thermal interface": 6,
    "SSD": 3, "power supply": 3, "server chassis": 2, "IO expansion board": 2, "dependency": 2,
    "CPU": 2, "system memory": 2,
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RecoveryCosts:
    """Seconds lost per failure and per checkpoint, by mechanism (inputs; see DESIGN.md)."""

    checkpoint_s: float  # blocking time of one checkpoint (δ)
    restart_s: float  # detection + rescheduling + communicator init + load + warm-up (R)
    stall_s: float = 0.0  # replica-local / elastic: the whole job's pause while it reconfigures
    replicas: int = 1  # data-parallel replicas (units of replica-local recovery)
    degraded_throughput: float = 1.0  # elastic shrink: throughput fraction while shrunk
    repair_s: float = 0.0  # elastic shrink, hot spares' pool: time until the lost GPUs are back
    # hot spares: the pool's size (-1: never empty) and the restart when it is
    # (``spare_miss``): the global restart's, rescheduled onto whatever the cluster frees
    spares: int = -1
    fallback_restart_s: float = 0.0
    # hot spares: the job's hosts, and how often an idle spare fails against one of them
    # (``pool_in_repair``; 0 hosts: not known, idle spares taken not to fail)
    job_hosts: int = 0
    idle_failure_factor: float = 0.0
    # after its blocking part, until a restart can load the checkpoint (W): an async one's
    # background write to storage, an in-memory one's copy to a peer's host
    persist_s: float = 0.0


def young_interval_s(checkpoint_s: float, mttf_s: float) -> float:
    """Young 1974: τ* = √(2δM)."""
    return math.sqrt(2 * checkpoint_s * mttf_s)


def daly_interval_s(checkpoint_s: float, mttf_s: float) -> float:
    """Daly 2006 eq. 37 (higher-order optimum); M itself when δ ≥ 2M."""
    d, m = checkpoint_s, mttf_s
    if d >= 2 * m:
        return m
    x = d / (2 * m)
    return math.sqrt(2 * d * m) * (1 + math.sqrt(x) / 3 + x / 9) - d


def expected_wall_s(work_s: float, interval_s: float, checkpoint_s: float, restart_s: float,
                    mttf_s: float) -> float:
    """Daly 2006 eq. 13: expected wall time for ``work_s`` of failure-free compute."""
    m = mttf_s
    try:
        return m * math.exp(restart_s / m) * math.expm1((interval_s + checkpoint_s) / m) * (
            work_s / interval_s)
    except OverflowError:  # restarts or segments hundreds of MTTFs long: no progress at all
        return math.inf


def ettr_checkpoint_restart(interval_s: float, checkpoint_s: float, restart_s: float,
                            mttf_s: float, persist_s: float = 0.0) -> float:
    """ETTR of checkpoint/restart; ``persist_s`` (W ≤ τ + δ): a checkpoint can be restarted
    from only W after it is taken, so a failure in the next segment's first W rolls back one
    segment more. With exponential failures that is Daly's form with R + W in place of R,
    exactly in the long run: from either state (the last checkpoint durable or not) an attempt
    at a segment takes (1 − p)·e^{R/M}·M on average (p = e^{−(τ+δ)/M} its survival), the
    last attempt succeeded with probability p, and a success gains one segment where a failure
    in the window (probability 1 − e^{−W/M}) loses one: net progress p·e^{−W/M} an attempt,
    so a segment costs M·e^{(R+W)/M}·(e^{(τ+δ)/M} − 1) (``monte_carlo_wall_s`` agrees)."""
    return interval_s / expected_wall_s(interval_s, interval_s, checkpoint_s,
                                        restart_s + persist_s, mttf_s)


def ettr_replica_local(c: RecoveryCosts, mttf_s: float) -> float:
    """Only the failed data-parallel replica restarts; the others go on (FT-HSDP, Salpekar et al.
    2026). Per failure the job pauses ``stall_s`` and one of ``replicas`` replicas is missing for
    ``restart_s``: lost fraction per unit time (stall + restart/replicas) / M. No rollback."""
    lost = (c.stall_s + c.restart_s / max(c.replicas, 1)) / mttf_s
    return max(0.0, 1.0 - lost)


def ettr_elastic(c: RecoveryCosts, mttf_s: float) -> float:
    """Continue on fewer GPUs at ``degraded_throughput`` until repair, after a stall."""
    lost = (c.stall_s + c.repair_s * (1 - c.degraded_throughput)) / mttf_s
    return max(0.0, 1.0 - lost)


MAX_SURVIVAL_EXPONENT = 30.0


def monte_carlo_wall_s(work_s: float, interval_s: float, checkpoint_s: float, restart_s: float,
                       mttf_s: float, *, runs: int = 200, seed: int = 0,
                       weibull_shape: float = 1.0, persist_s: float = 0.0) -> np.ndarray:
    """Wall time of ``runs`` simulated executions of the checkpoint/restart process. Failures are
    a renewal process (exponential, or Weibull with the same mean) and can strike restarts.
    ``persist_s`` (at most a segment): a checkpoint becomes loadable that long after it is
    taken; a failure before then resumes from the one before (the checkpoint a restart loaded
    is loadable at once)."""
    if persist_s > interval_s + checkpoint_s:
        raise ConfigError(f"a checkpoint that persists for {persist_s:,.0f} s is taken every "
                          f"{interval_s + checkpoint_s:,.0f} s: the interval must be at least "
                          "the persist time", what="monte carlo")
    rng = np.random.default_rng(seed)
    scale = mttf_s / math.gamma(1 + 1 / weibull_shape)
    out = np.empty(runs)
    segment = interval_s + checkpoint_s
    # a segment (or restart) survives with probability exp(−(t/scale)^k): past e^-30 a run
    # would draw ~10^13 failures before finishing one
    if max(segment, restart_s) / scale > MAX_SURVIVAL_EXPONENT ** (1 / weibull_shape):
        raise ConfigError(f"a {max(segment, restart_s):,.0f} s segment or restart against a "
                          f"{mttf_s:,.0f} s MTTF almost never completes: the job makes no "
                          "progress (expected_wall_s gives its closed form, infinite)",
                          what="monte carlo")
    n_segments = math.ceil(work_s / interval_s)
    for i in range(runs):
        t, done, loaded = 0.0, 0, True  # (the last checkpoint loadable: at the start, a restart)
        while done < n_segments:
            ttf = scale * rng.weibull(weibull_shape)
            if ttf >= segment:
                t, done, loaded = t + segment, done + 1, False
                continue
            if not loaded and ttf < persist_s:
                done -= 1  # the checkpoint just taken was not yet written: one more lost
            t += ttf + _restart(rng, restart_s, scale, weibull_shape)
            loaded = True
        out[i] = t
    return out


def _restart(rng: np.random.Generator, restart_s: float, scale: float, k: float) -> float:
    """A restart of ``restart_s`` that begins again whenever a failure interrupts it."""
    spent = 0.0
    while True:
        ttf = scale * rng.weibull(k)
        if ttf >= restart_s:
            return spent + restart_s
        spent += ttf


def monte_carlo_failures(failure: FailureModel, gpus: int, duration_s: float, *, runs: int = 200,
                         seed: int = 0) -> np.ndarray:
    """Number of job interruptions in ``duration_s`` of running (restarts not counted)."""
    rng = np.random.default_rng(seed)
    mttf = failure.job_mttf_s(gpus)
    scale = mttf / math.gamma(1 + 1 / failure.weibull_shape)
    counts = np.empty(runs, dtype=np.int64)
    for i in range(runs):
        t, n = 0.0, 0
        while True:
            t += scale * rng.weibull(failure.weibull_shape)
            if t > duration_s:
                break
            n += 1
        counts[i] = n
    return counts


def policy_frame(*, failure: FailureModel, gpus: int, work_s: float,
                 costs: dict[str, RecoveryCosts], interval_s: float | None = None,
                 step_s: float | None = None, progress: float = 1.0) -> pl.DataFrame:
    """One row per recovery policy: goodput, expected wall clock and GPU-hours for ``work_s`` of
    failure-free training, expected failures, and the checkpoint interval used (whole steps of
    ``step_s`` where given)."""
    return pl.DataFrame(policy_rows(failure=failure, gpus=gpus, work_s=work_s, costs=costs,
                                    interval_s=interval_s, step_s=step_s, progress=progress))


def policy_rows(*, failure: FailureModel, gpus: int, work_s: float,
                costs: dict[str, RecoveryCosts], interval_s: float | None = None,
                step_s: float | None = None, progress: float = 1.0,
                spread: bool = False, by_s: float | None = None) -> list[dict[str, Any]]:
    """``policy_frame``'s rows as dicts (a sweep screens thousands: no frame per strategy).
    ``progress``: the share of the healthy rate kept between failures (fail-slow episodes,
    ``analysis.fail_slow``), multiplied into every policy's goodput. ``spread``: also the
    wall clock's 10th, 50th and 90th percentiles (``analysis.wall_spread``; None where not
    asked or where the policy's form has none), and with ``by_s`` the chance the run ends by
    then (``wall_clock_by_probability``)."""
    mttf = failure.job_mttf_s(gpus)
    rows = []
    for policy, given in costs.items():
        if policy not in POLICIES:
            raise ConfigError(f"unknown recovery policy {policy!r}; choose from "
                              f"{', '.join(POLICIES)}", what="resilience study")
        c, miss = _with_spare_pool(given, mttf)
        tau = interval_s or (daly_interval_s(c.checkpoint_s, mttf) if c.checkpoint_s > 0
                             else 0.0)
        # storage takes a checkpoint no faster than it writes one: the next waits for the last
        # (and ETTR is unimodal in τ, so the floor is the optimum where Daly's falls below it)
        tau = max(tau, c.persist_s)
        if step_s:
            tau = whole_steps_interval_s(tau, step_s, functools.partial(
                _ettr, policy, c, mttf), at_least_s=c.persist_s)
        ettr = _ettr(policy, c, mttf, tau) * progress
        wall = work_s / ettr if ettr > 0 else math.inf
        dist = (_wall_distribution(policy, given, miss, mttf, tau, work_s,
                                   failure.observed_failures) if spread else None)
        p10, p50, p90 = (None, None, None) if dist is None else (
            x / progress for x in dist.quantiles())
        by = {} if by_s is None else {  # (only where asked: no column of nulls otherwise)
            "wall_clock_by_probability": None if dist is None else dist.by(by_s * progress)}
        rows.append({"policy": policy, "goodput": ettr, "expected_wall_clock_s": wall,
                     "wall_clock_p10_s": p10, "wall_clock_p50_s": p50,
                     "wall_clock_p90_s": p90, **by,
                     "failure_rate_count": failure.observed_failures,
                     "expected_gpu_hours": wall * gpus / HOUR_S,
                     "expected_failures": wall / mttf, "checkpoint_interval_s": tau,
                     "job_mttf_s": mttf, "checkpoint_s": c.checkpoint_s,
                     "restart_s": c.restart_s, "persist_s": c.persist_s,
                     "spare_miss": miss, "spares": c.spares if miss is not None else None,
                     "spare_job_hosts": c.job_hosts if miss is not None else None,
                     "spare_idle_failure_factor": (c.idle_failure_factor if miss is not None
                                                   else None),
                     "spare_repair_s": c.repair_s if miss is not None else None})
    return rows


@dataclasses.dataclass(frozen=True, slots=True)
class WallDistribution:
    """The failure process's wall clock for a run (``analysis.wall_spread``'s mixtures, None
    where no attempt can be expected to finish) times ``scale`` (checkpoints' blocking)."""

    parts: list[Any] | None
    scale: float = 1.0

    def quantiles(self) -> tuple[float, ...]:
        from analysis.wall_spread import QUANTILES, mixture_quantiles

        if self.parts is None:
            return tuple(math.inf for _ in QUANTILES)
        return tuple(x * self.scale for x in mixture_quantiles(self.parts))

    def by(self, deadline_s: float) -> float:
        """The chance the run ends by ``deadline_s``."""
        from analysis.wall_spread import mixture_cdf

        return 0.0 if self.parts is None else mixture_cdf(self.parts)(deadline_s / self.scale)


def _wall_distribution(policy: str, c: RecoveryCosts, miss: float | None, mttf: float,
                       tau: float, work_s: float, count: float = 0.0
                       ) -> WallDistribution | None:
    """The failure process's wall clock for ``work_s`` (``analysis.wall_spread``):
    checkpoint/restart with its restarts (a spare pool's swap or, for the share ``miss`` that
    finds none, the global restart), or a fixed loss a failure for the policies that roll
    nothing back (their checkpoints' blocking on top); ``count``: the failures the rate was
    measured from, whose uncertainty they take too. None for continuous free checkpoints
    (τ = 0), whose form is the mean's only."""
    from analysis.wall_spread import checkpoint_restart_parts, fixed_loss_parts

    if policy in ("replica_local", "elastic_shrink"):
        loss = c.stall_s + (c.restart_s / max(c.replicas, 1) if policy == "replica_local"
                            else c.repair_s * (1 - c.degraded_throughput))
        scale = (tau + c.checkpoint_s) / tau if c.checkpoint_s > 0 and tau > 0 else 1.0
        return WallDistribution(fixed_loss_parts(work_s, loss, mttf, rate_count=count), scale)
    if tau <= 0:
        return None
    restarts = ([(1.0, c.restart_s)] if miss is None
                else [(1 - miss, c.restart_s), (miss, c.fallback_restart_s)])
    return WallDistribution(checkpoint_restart_parts(work_s, tau, c.checkpoint_s, restarts,
                                                     mttf, c.persist_s, rate_count=count))


# The Poisson tail is summed over mean ± POISSON_SPAN standard deviations (+ POISSON_PAD): the
# mass outside is below 1e-30; past EXACT_MEAN hosts in repair its normal form is used.
POISSON_SPAN, POISSON_PAD, EXACT_MEAN = 12.0, 30.0, 1e6
POOL_ITERATIONS = 50  # pool_in_repair's fixed point (converges in a few for any real pool)
MAX_SPARES = 10**9  # spares_for's search stops there (a pool past it is no answer)


def spare_miss(in_repair: float, spares: int) -> float:
    """The share of failures that find every spare in repair. Failed hosts wait for repair as
    an M/G/∞ queue — Poisson failures, any repair-time distribution — so the number in repair
    is Poisson with mean λ·T, the failures in a repair time (Palm's theorem; Takács 1962,
    *Introduction to the Theory of Queues*, ch. 3), and a failure finds that distribution
    (Poisson arrivals see time averages: Wolff 1982): P(N ≥ ``spares``). Repaired hosts go
    back to the pool. Idle spares that fail too: ``pool_in_repair`` gives the mean to pass."""
    if spares <= 0:
        return 1.0
    if in_repair <= 0:
        return 0.0
    lo, hi = _poisson_window(in_repair)
    if spares > hi:
        return 0.0
    if in_repair > EXACT_MEAN:  # (normal form, continuity-corrected: error O(1/√mean))
        return 0.5 * math.erfc((spares - 0.5 - in_repair) / math.sqrt(2 * in_repair))
    below = sum(math.exp(k * math.log(in_repair) - in_repair - math.lgamma(k + 1))
                for k in range(lo, spares))
    return min(1.0, max(0.0, 1.0 - below))


def _poisson_window(mean: float) -> tuple[int, int]:
    """The counts outside which a Poisson of ``mean`` has no mass worth summing."""
    width = POISSON_SPAN * math.sqrt(mean) + POISSON_PAD
    return max(0, math.floor(mean - width)), math.ceil(mean + width)


def pool_in_repair(job_in_repair: float, spares: int, job_hosts: int = 0,
                   idle_factor: float = 0.0) -> float:
    """The mean number of hosts in repair when idle spares fail too: the job's failures in a
    repair time (``job_in_repair``, λT) and the idle spares', each at ``idle_factor`` times a
    job host's rate λ/H, E[(S − N)⁺] of them idle on average. Mean-field: the arrival rate
    taken at its mean, N Poisson of the resulting mean m = λT · (1 + f · E[(S − N)⁺] / H), the
    fixed point found by iteration (a contraction: f·S/H is small for any real pool). Exact
    where no spare fails idle (f = 0 or H unknown); tests hold it to a simulated pool."""
    if spares <= 0 or job_hosts <= 0 or idle_factor <= 0 or job_in_repair <= 0:
        return job_in_repair
    m = job_in_repair
    for _ in range(POOL_ITERATIONS):
        idle = _mean_free(m, spares)
        m_next = job_in_repair * (1 + idle_factor * idle / job_hosts)
        if abs(m_next - m) <= 1e-12 * m:
            return m_next
        m = m_next
    return m


def _mean_free(mean: float, spares: int) -> float:
    """E[(S − N)⁺] for N Poisson of ``mean``: the spares idle on average."""
    lo, hi = _poisson_window(mean)
    return sum((spares - k) * math.exp(k * math.log(mean) - mean - math.lgamma(k + 1))
               for k in range(lo, min(spares, hi + 1)))


def spares_for(in_repair: float, miss: float, job_hosts: int = 0,
               idle_factor: float = 0.0) -> int:
    """The fewest spares that leave at most ``miss`` of failures without one (a bisection:
    the share falls as spares are added — a larger pool has more idle spares to fail, but
    each adds less than the one more spare it is)."""
    def misses(n: int) -> float:
        return spare_miss(pool_in_repair(in_repair, n, job_hosts, idle_factor), n)

    lo, hi = 0, _poisson_window(max(in_repair, 0.0))[1] + 1
    while misses(hi) > miss and hi < MAX_SPARES:  # (idle failures can ask for more)
        hi *= 2
    while lo < hi:
        mid = (lo + hi) // 2
        if misses(mid) > miss:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _with_spare_pool(c: RecoveryCosts, mttf: float) -> tuple[RecoveryCosts, float | None]:
    """Hot spares from a pool of ``c.spares`` (-1: never empty, as assumed before): the
    restart a failure costs on average — the swap where a spare is free, the global restart
    where none is — and the share of failures that find none (None: no pool given). Daly's
    form then takes the mean restart: exact in the long run's expected restart time, an
    approximation in its exponential (convex in R, so slightly optimistic where misses are
    neither rare nor certain)."""
    if c.spares < 0:
        return c, None
    miss = spare_miss(pool_in_repair(c.repair_s / mttf, c.spares, c.job_hosts,
                                     c.idle_failure_factor), c.spares)
    mean = (1 - miss) * c.restart_s + miss * c.fallback_restart_s
    return dataclasses.replace(c, restart_s=mean), miss


def _ettr(policy: str, c: RecoveryCosts, mttf: float, tau: float) -> float:
    if policy in ("replica_local", "elastic_shrink"):
        ettr = (ettr_replica_local(c, mttf) if policy == "replica_local"
                else ettr_elastic(c, mttf))
        if c.checkpoint_s > 0 and tau > 0:  # they still take periodic checkpoints
            ettr *= tau / (tau + c.checkpoint_s)
        return ettr
    if tau > 0:
        return ettr_checkpoint_restart(tau, c.checkpoint_s, c.restart_s, mttf, c.persist_s)
    return math.exp(-c.restart_s / mttf)  # free, continuous checkpoints: only the restart lost


def whole_steps_interval_s(interval_s: float, step_s: float,
                           ettr_of: Callable[[float], float], at_least_s: float = 0.0) -> float:
    """A checkpoint is taken between steps: the interval is a whole number of steps, at least
    one — of the two multiples around ``interval_s`` (Daly's optimum, a continuous quantity),
    the one with the better goodput. With steps long against the MTTF this decides: Daly's τ
    below one step is no schedule a trainer can run (a 0.0-minute interval had been shown).
    ``at_least_s``: no fewer steps than cover it (the time a checkpoint takes to persist)."""
    k = interval_s / step_s
    least = max(1, math.ceil(at_least_s / step_s * (1 - 1e-12)))
    steps = {max(least, math.floor(k)), max(least, math.ceil(k))}
    return max((n * step_s for n in sorted(steps)), key=ettr_of)


def goodput_vs_interval(*, c: RecoveryCosts, mttf_s: float, intervals_s: np.ndarray
                        ) -> pl.DataFrame:
    """ETTR of checkpoint/restart as a function of the interval (for the plot), at the
    intervals no shorter than a checkpoint takes to persist (none is taken more often)."""
    kept = intervals_s[intervals_s >= c.persist_s]
    return pl.DataFrame({
        "checkpoint_interval_s": kept,
        "goodput": [ettr_checkpoint_restart(t, c.checkpoint_s, c.restart_s, mttf_s, c.persist_s)
                    for t in kept]})


def checkpoint_bytes(params: int) -> int:
    """bf16 weights (2 B) + fp32 master weights and Adam moments (12 B) per parameter
    (Rajbhandari et al. 2020, ZeRO §3)."""
    return params * 14


# ---- a study's strategy under a failure scenario -------------------------------------------

def failure_model(spec: dict[str, object], *, gpus_per_host: int = 8) -> FailureModel:
    """From a study's [failures] table: ``preset = NAME``, or ``rate_per_gpu_hour`` or
    ``rate_per_node_hour`` (a node — a host: a server, or a GB200 compute tray, not the NVLink
    domain — fails as a whole: its rate is spread over its GPUs, ``NodeSpec.host_gpus``), with
    an optional Weibull ``weibull_shape``."""
    spec = dict(spec)
    if "rate_per_node_hour" in spec:
        node_rate = spec.pop("rate_per_node_hour")
        if "rate_per_gpu_hour" in spec or not isinstance(node_rate, int | float):
            raise ConfigError("give one of rate_per_gpu_hour or rate_per_node_hour (a number)",
                              what="failures")
        spec["rate_per_gpu_hour"] = float(node_rate) / gpus_per_host
    if "preset" in spec:
        name = str(spec.pop("preset"))
        if name not in FAILURE_PRESETS:
            raise ConfigError(f"no failure preset {name!r}; presets: "
                              f"{', '.join(FAILURE_PRESETS)}", what="failures")
        if spec:
            raise ConfigError(f"unexpected keys with a preset: {', '.join(spec)}",
                              what="failures")
        return FAILURE_PRESETS[name]
    unknown = set(spec) - {"rate_per_gpu_hour", "weibull_shape", "name", "source",
                           "observed_failures"}
    if unknown or "rate_per_gpu_hour" not in spec:
        raise ConfigError("give preset = NAME or rate_per_gpu_hour (failures per GPU per hour, "
                          "> 0) with optional weibull_shape and observed_failures (the count "
                          f"the rate was measured from); unknown keys: {sorted(unknown)}",
                          what="failures")
    rate = number("failures", "rate_per_gpu_hour", spec["rate_per_gpu_hour"], positive=True)
    shape = number("failures", "weibull_shape", spec.get("weibull_shape", 1.0))  # > 0: below
    seen = number("failures", "observed_failures", spec.get("observed_failures", 0))
    return FailureModel(name=str(spec.get("name", "custom")), rate_per_gpu_hour=rate,
                        weibull_shape=shape, source=str(spec.get("source", "")),
                        observed_failures=seen)


def number(table: str, key: str, value: object, *, positive: bool = False) -> float:
    """A value of a study table: a finite number ≥ 0 (> 0 where ``positive``: a rate or a
    bandwidth), or a ConfigError naming the table and key."""
    if not is_finite_number(value) or value < 0 or (positive and value == 0):
        kind = "a positive number" if positive else "a number ≥ 0"
        raise ConfigError(f"[{table}] {key} must be {kind}, got {value!r}", what="study")
    return float(value)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class JobShape:
    """What recovery costs depend on: sizes and bandwidths of one strategy on one system."""

    gpus: int
    params: int
    model_parallel: int  # tp · pp (· cp): GPUs that hold one full copy of the weights
    dp: int
    nic_bytes_per_s: float
    step_time_s: float
    shrunk_throughput: float  # tokens/s after losing one data-parallel replica, relative
    # a GPU's copy to host memory (the system's ``host_link_GBps``; 0: not given)
    host_bytes_per_s: float = 0.0
    # the most one GPU holds of the checkpoint, what it copies to host memory
    # (``analysis.checkpoint_share``); 0: one data-parallel replica's share, size / model_parallel
    staged_bytes: float = 0.0
    # the most one GPU holds of it, what a restarted GPU loads (0: ``staged_bytes``'s)
    load_bytes: float = 0.0
    # the hosts the job runs on (its GPUs over ``NodeSpec.host_gpus``; 0: not known)
    hosts: int = 0


# host_copy_GBps 0: a GPU's host link as its system gives it (``NodeSpec.host_link_GBps``:
# PCIe Gen5 55 GB/s measured, GB200's NVLink-C2C 256), else ``FALLBACK_HOST_COPY_GBPS``.
# staging: what a GPU copies to host memory, all it holds ("state_dict": PyTorch's distributed
# checkpoint) or the share it writes ("fully_parallel": Megatron-Core; ``checkpoint_share``).
# save_overhead_s: what a save costs the run beyond its copy — planning and barriers, and
# training slowed while the background write runs: a user's measurement; 0 by default, none
# being decomposed in public (Meta and Crusoe, PyTorch blog April 2025, Llama 3 70B on 1,856
# H200s: 0.78 s blocked with the staging copy in it, then tokens/s dipped for ~67 s, to 372
# of 700 at worst, the dip's integral not stated).
# storage_read_GBps: what a restart reads the checkpoint at, where it differs from the write
# rate (0: storage_GBps). Both are the rates a job achieves, not the storage's datasheet: on a
# 63-node B200 cluster saves averaged 16% of its 250 GB/s write bandwidth and restart loads
# 21.5% of its 700 GB/s read bandwidth, ~40 and ~150 GB/s (Lablup technical report,
# arXiv:2605.09370, 523 checkpoint events).
DEFAULT_CHECKPOINT = {"mode": "async", "storage_GBps": 200.0, "host_copy_GBps": 0.0,
                      "staging": "state_dict", "save_overhead_s": 0.0,
                      "storage_read_GBps": 0.0}
# where neither the study nor the system gives a host link: an assumption (a PCIe Gen4 x16
# link's 27.5 GB/s, ``replay/systems``, rounded down), as before the systems carried one
FALLBACK_HOST_COPY_GBPS = 25.0
# Restart components (seconds). Assumptions, not fitted to any run: rescheduling onto healthy
# nodes, framework start-up (``init_s``) plus communicator set-up that grows with the job
# (``init_s_per_1000_gpus``: rendezvous and NCCL initialisation scale with the number of ranks;
# MegaScale, Jiang et al. 2024 §3.4, reports tens of seconds at >10K GPUs after optimisation),
# and warm-up; checkpoint loading is computed from sizes and bandwidths. For scale, not
# fitted: Lablup's automatic retries of a 504-GPU B200 job came a median 11 min apart (IQR
# 10-11; arXiv:2605.09370), where these defaults give ~7 min before the load at 504 GPUs.
DEFAULT_RESTART = {"scheduling_s": 300.0, "init_s": 60.0, "init_s_per_1000_gpus": 3.0,
                   "warmup_s": 60.0, "spare_swap_s": 30.0}
# FT-HSDP (Salpekar et al. 2026): replica-local recovery stalls the job ~3 minutes per failure.
DEFAULT_POLICY = {"replica_local": {"stall_s": 180.0},
                  "elastic_shrink": {"stall_s": 180.0, "repair_s": 4 * HOUR_S},
                  # an idle spare host's failure rate over a working one's (``pool_in_repair``):
                  # 1, as often (a hot spare is powered and kept ready); 0, never
                  "hot_spares": {"idle_failure_factor": 1.0}}
# Given together or not at all (no default: a fleet's spare count and repair time are its
# own): hot spares drawn from a pool of ``spares`` hosts, each failed host back in the pool
# after ``repair_s`` on average (``spare_miss``). Without them the pool is never empty.
OPTIONAL_POLICY = {"hot_spares": ("spares", "repair_s")}


def _policies(policies: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each policy's parameters, the study's [policies.NAME] tables over the defaults."""
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown:
        raise ConfigError(f"unknown [policies] {unknown}; known: {', '.join(POLICIES)}",
                          what="study")
    out = {}
    for name in POLICIES:
        given = policies.get(name, {})
        if not isinstance(given, dict):
            raise ConfigError(f"[policies.{name}] must be a table, got {given!r}", what="study")
        takes = sorted({*DEFAULT_POLICY.get(name, {}), *OPTIONAL_POLICY.get(name, ())})
        extra = sorted(set(given) - set(takes))
        if extra:
            raise ConfigError(f"[policies.{name}] has no {extra}; it takes "
                              f"{takes or 'no parameters'}", what="study")
        table = {**DEFAULT_POLICY.get(name, {}), **given}
        out[name] = {k: number(f"policies.{name}", k, v) for k, v in table.items()}
        _check_pool(name, out[name])
    return out


def _check_pool(name: str, table: dict[str, float]) -> None:
    """A spare pool is its size and its hosts' repair time together; the size whole."""
    pool = OPTIONAL_POLICY.get(name, ())
    given = [k for k in pool if k in table]
    if given and len(given) < len(pool):
        missing = [k for k in pool if k not in table]
        raise ConfigError(f"[policies.{name}] {given[0]} needs {missing[0]} too (the pool's "
                          "size and how long a failed host takes to come back)", what="study")
    if "spares" in table and table["spares"] != int(table["spares"]):
        raise ConfigError(f"[policies.{name}] spares must be a whole number of hosts, got "
                          f"{table['spares']:g}", what="study")


@dataclasses.dataclass(frozen=True, slots=True)
class RecoveryInputs:
    """The [checkpoint], [restart] and [policies] tables checked, over their defaults."""

    mode: str
    storage_Bps: float
    host_Bps: float
    restart: dict[str, float]
    policies: dict[str, dict[str, float]]
    staging: str = "state_dict"
    save_overhead_s: float = 0.0
    read_Bps: float = 0.0  # a restart's read of the checkpoint (0: ``storage_Bps``)


def recovery_inputs(checkpoint: dict[str, object], restart: dict[str, object],
                    policies: dict[str, dict[str, object]] | None = None) -> RecoveryInputs:
    """The recovery tables of a study checked (a study checks them when it is loaded, before
    any strategy is costed): unknown keys and values of the wrong kind are named."""
    for table, given, known in (("checkpoint", checkpoint, DEFAULT_CHECKPOINT),
                                ("restart", restart, DEFAULT_RESTART)):
        unknown = set(given) - set(known)
        if unknown:
            raise ConfigError(f"unknown [{table}] key(s) {sorted(unknown)}; known: "
                              f"{', '.join(known)}", what="study")
    ck = {**DEFAULT_CHECKPOINT, **checkpoint}
    mode = ck["mode"]
    if mode not in ("sync", "async", "in_memory"):
        raise ConfigError(f"checkpoint mode must be sync, async or in_memory, got {mode!r}",
                          what="checkpoint")
    return RecoveryInputs(
        str(mode), number("checkpoint", "storage_GBps", ck["storage_GBps"], positive=True) * 1e9,
        (number("checkpoint", "host_copy_GBps", ck["host_copy_GBps"], positive=True) * 1e9
         if "host_copy_GBps" in checkpoint else 0.0),
        {k: number("restart", k, v) for k, v in {**DEFAULT_RESTART, **restart}.items()},
        _policies(policies or {}), checked_staging(ck["staging"]),
        number("checkpoint", "save_overhead_s", ck["save_overhead_s"]),
        (number("checkpoint", "storage_read_GBps", ck["storage_read_GBps"], positive=True)
         * 1e9 if "storage_read_GBps" in checkpoint else 0.0))


def recovery_costs(job: JobShape, checkpoint: dict[str, object], restart: dict[str, object],
                   policies: dict[str, dict[str, object]] | None = None
                   ) -> dict[str, RecoveryCosts]:
    """Per policy: checkpoint blocking time δ and restart cost R from sizes and bandwidths."""
    given = recovery_inputs(checkpoint, restart, policies)
    rs, pol, mode = given.restart, given.policies, given.mode
    size = checkpoint_bytes(job.params)
    shard = job.staged_bytes or size / job.model_parallel  # what a GPU copies
    held = job.load_bytes or shard  # what a restarted GPU loads
    storage = given.storage_Bps
    host = given.host_Bps or job.host_bytes_per_s or FALLBACK_HOST_COPY_GBPS * 1e9
    fixed = given.save_overhead_s
    delta = fixed + {"sync": size / storage, "async": shard / host, "in_memory": shard / host}[mode]
    init = rs["init_s"] + rs["init_s_per_1000_gpus"] * job.gpus / 1000
    base = rs["scheduling_s"] + init + rs["warmup_s"]
    load_storage = size / (given.read_Bps or storage)
    load_peer = held / job.nic_bytes_per_s
    # (a snapshot kept in memory reaches its peer at the NIC's rate: the share the GPU copied)
    send_peer = shard / job.nic_bytes_per_s
    # W: a synchronous save has written when the step resumes; an async one writes the whole
    # checkpoint in the background at the storage's aggregate rate; one kept in memory is safe
    # once a peer host holds its copy (Gemini, Wang et al. SOSP 2023: replicas in other
    # machines' CPU memory)
    persist = {"sync": 0.0, "async": size / storage, "in_memory": send_peer}[mode]
    costs = {
        "global_restart": RecoveryCosts(checkpoint_s=delta, restart_s=base + load_storage,
                                        persist_s=persist),
        "in_memory": RecoveryCosts(checkpoint_s=fixed + shard / host, restart_s=base + load_peer,
                                   persist_s=send_peer),
        "hot_spares": RecoveryCosts(
            checkpoint_s=delta, restart_s=rs["spare_swap_s"] + init + rs["warmup_s"]
            + load_storage, persist_s=persist, spares=int(pol["hot_spares"].get("spares", -1)),
            repair_s=pol["hot_spares"].get("repair_s", 0.0),
            fallback_restart_s=base + load_storage, job_hosts=job.hosts,
            idle_failure_factor=pol["hot_spares"]["idle_failure_factor"]),
        "replica_local": RecoveryCosts(
            checkpoint_s=delta, restart_s=base + load_peer,
            stall_s=pol["replica_local"]["stall_s"], replicas=job.dp, persist_s=persist),
        "elastic_shrink": RecoveryCosts(
            checkpoint_s=delta, restart_s=base + load_peer,
            stall_s=pol["elastic_shrink"]["stall_s"],
            repair_s=pol["elastic_shrink"]["repair_s"],
            degraded_throughput=job.shrunk_throughput, persist_s=persist),
    }
    return costs
