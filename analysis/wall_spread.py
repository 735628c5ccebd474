"""How far a run's wall-clock time strays from its expectation under failures: percentiles
beside Daly's mean (``analysis.resilience``), for a planner who needs the date the run ends
nine times in ten, not on average.

Checkpoint/restart (global restart, in-memory, hot spares). With exponential failures at rate
λ = 1/M each segment of T = τ + δ seconds is attempted until one attempt survives it: the
failed attempts before n segments succeed are negative binomial, K ~ NB(n, p = e^{−λT})
(n = W/τ segments, the count the closed form's mean takes). Each failed attempt costs
Y = X + Rr: X, when the failure struck, exponential conditioned below T, and Rr the restart,
which starts again whenever a failure interrupts it (the same process with a stretch of R;
Daly 2006 §2's model, the one ``monte_carlo_wall_s`` simulates). So the wall time is

    n·T + Σ_{i=1}^{K} Y_i,

a compound negative binomial whose mean n·M·e^{R/M}·(e^{T/M} − 1) is Daly's eq. 13. Its
distribution: P(K = k) exactly, and the sum of k costs as a normal of k times Y's mean and
variance (exact moments: a geometric number of truncated exponentials, a compound sum's
variance E[N]·Var[X] + Var[N]·E[X]²); a spare pool's restarts are a swap or, when no spare is
free, a global restart (``resilience.spare_miss``), and up to ``EXACT_MISSES`` failures the
number that found no spare is summed over exactly (binomial). A checkpoint that persists W
after it is taken adds W to the restart, as the mean's form does (exact there; in the spread an
approximation: a failure inside W rolls a whole segment back).

Replica-local restart and elastic shrink lose a fixed ℓ a failure (``ettr_replica_local``,
``ettr_elastic``) and roll nothing back: the run is a first passage of progress t − ℓ·N(t)
(N Poisson at λ) to W, whose time has mean W/(1 − λℓ) and variance W·λℓ²/(1 − λℓ)³ (the
inverse Gaussian's, Brownian motion with drift: Folks & Chhikara 1978): a point at W with
the chance of no failure at all, e^{−W/M}, and the rest a normal of the remaining moments.

A rate counted from n failures is itself uncertain (±1/√n): ``rate_mttfs`` takes its Gamma
posterior at equal-probability points and the percentiles come from the mixture of the wall
clock's distributions over them (``mixture_quantiles``).

Weibull-shaped GPUs: the job's failures superpose many GPUs' processes and tend to a Poisson
process (Palm–Khintchine), as the closed forms assume; the tests check exponential processes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

QUANTILES = (0.1, 0.5, 0.9)
EXACT_MISSES = 64  # up to this many failures, the restarts that found no spare summed exactly
SPAN = 12.0  # the failure count's range: its mean ± SPAN standard deviations (+ PAD)
PAD = 30
MAX_TERMS = 200_000  # past this many failure counts, the whole sum is normal (its CLT)
_BISECT = 80


def _stretch(length_s: float, lam: float) -> tuple[float, float]:
    """Mean and variance of the time to get ``length_s`` without a failure, starting again at
    each (failures at rate ``lam``): length + a geometric number of exponentials cut below it."""
    if length_s <= 0:
        return 0.0, 0.0
    p = math.exp(-lam * length_s)
    n_mean, n_var = math.expm1(lam * length_s), math.expm1(lam * length_s) / p
    m, v = _truncated_exp(length_s, lam)
    return length_s + n_mean * m, n_mean * v + n_var * m * m


def _truncated_exp(below_s: float, lam: float) -> tuple[float, float]:
    """Mean and variance of an exponential of rate ``lam`` conditioned below ``below_s``."""
    x = lam * below_s
    if x < 1e-6:  # (uniform on the stretch, to first order)
        return below_s / 2, below_s * below_s / 12
    q = -math.expm1(-x)  # P(X < below)
    e = math.exp(-x)
    mean = 1 / lam - below_s * e / q
    second = (2 / lam**2 - e * (below_s**2 + 2 * below_s / lam + 2 / lam**2)) / q
    return mean, max(0.0, second - mean * mean)


# A distribution as a mixture: (probabilities, means, standard deviations; 0: a point mass)
Mixture = tuple[np.ndarray, np.ndarray, np.ndarray]
RATE_POINTS = 24  # equal-probability points of the rate's Gamma posterior


def checkpoint_restart_quantiles(work_s: float, interval_s: float, checkpoint_s: float,
                                 restarts: Sequence[tuple[float, float]], mttf_s: float,
                                 persist_s: float = 0.0,
                                 quantiles: Sequence[float] = QUANTILES, *,
                                 rate_count: float = 0.0) -> tuple[float, ...]:
    """Wall-clock percentiles of ``work_s`` of failure-free training checkpointed every
    ``interval_s`` (``checkpoint_s`` each) against a job MTTF, each failure followed by a
    restart of R seconds with probability w for (w, R) in ``restarts`` (one (1, R) without a
    spare pool; the swap and the global restart with one). ``rate_count``: the failures the
    rate was estimated from (``rate_mttfs``; 0: the rate taken as exact). Infinite where no
    segment or restart can be expected to finish."""
    parts = checkpoint_restart_parts(work_s, interval_s, checkpoint_s, restarts, mttf_s,
                                     persist_s, rate_count=rate_count)
    return (tuple(math.inf for _ in quantiles) if parts is None
            else mixture_quantiles(parts, quantiles))


def checkpoint_restart_parts(work_s: float, interval_s: float, checkpoint_s: float,
                             restarts: Sequence[tuple[float, float]], mttf_s: float,
                             persist_s: float = 0.0, *, rate_count: float = 0.0
                             ) -> list[Mixture] | None:
    """``checkpoint_restart_quantiles``' distribution: one mixture per rate point (equal
    weights), or None where no segment or restart can be expected to finish."""
    parts = []
    for mttf in rate_mttfs(mttf_s, rate_count):
        lam, seg = 1 / mttf, interval_s + checkpoint_s
        if lam * max(seg, *(r + persist_s for _, r in restarts)) > 700:
            return None
        parts.append(_checkpoint_restart(work_s, interval_s, checkpoint_s, restarts, mttf,
                                         persist_s))
    return parts


def rate_mttfs(mttf_s: float, rate_count: float) -> list[float]:
    """The job MTTF, or where its rate was estimated from ``rate_count`` failures, the MTTFs
    at ``RATE_POINTS`` equal-probability points of the rate's posterior: Gamma with shape the
    count and mean the rate (a Poisson rate's conjugate posterior under a flat prior on its
    logarithm), its quantiles by Wilson & Hilferty's cube-root normal (1931)."""
    if rate_count <= 0:
        return [mttf_s]
    k = rate_count
    out = []
    for i in range(RATE_POINTS):
        z = _z((i + 0.5) / RATE_POINTS)
        g = max(1e-9, 1 - 1 / (9 * k) + z * math.sqrt(1 / (9 * k))) ** 3
        out.append(mttf_s / g)  # (g: the rate over its mean)
    return out


def _checkpoint_restart(work_s: float, interval_s: float, checkpoint_s: float,
                        restarts: Sequence[tuple[float, float]], mttf_s: float,
                        persist_s: float) -> Mixture:
    """The wall clock at one rate as a mixture: n·T plus the compound sum, over each failure
    count (and count of global restarts), or one normal where the counts are too many."""
    lam, seg = 1 / mttf_s, interval_s + checkpoint_s
    n = work_s / interval_s
    p = math.exp(-lam * seg)
    x_mean, x_var = _truncated_exp(seg, lam)
    parts = [(w, *_stretch(r + persist_s, lam)) for w, r in restarts if w > 0]
    k_mean, k_var = n * (1 - p) / p, n * (1 - p) / p**2
    base = n * seg
    if k_mean == 0:
        return np.ones(1), np.full(1, base), np.zeros(1)
    lo = max(0, math.floor(k_mean - SPAN * math.sqrt(k_var)) - PAD)
    hi = math.ceil(k_mean + SPAN * math.sqrt(k_var)) + PAD
    if hi - lo > MAX_TERMS:  # (a sum of that many costs: normal)
        return _normal(base, k_mean, k_var, x_mean, x_var, parts)
    k = np.arange(lo, hi + 1, dtype=float)
    first = math.lgamma(lo + n) - math.lgamma(n) - math.lgamma(lo + 1) + n * math.log(p) + (
        lo * math.log1p(-p))  # P(K = k + 1) / P(K = k) = (k + n)/(k + 1)·(1 − p)
    steps = np.log((k[:-1] + n) / (k[:-1] + 1)) + math.log1p(-p)
    pmf = np.exp(first + np.concatenate(([0.0], np.cumsum(steps))))
    means, variances, weights = _cost_sums(k, x_mean, x_var, parts)
    probs = pmf[:, None] * weights
    keep = probs > 0
    return probs[keep] / probs.sum(), base + means[keep], np.sqrt(variances[keep])


def _cost_sums(k: np.ndarray, x_mean: float, x_var: float,
               parts: list[tuple[float, float, float]]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each failure count k (rows), the mixture of normals the sum of k failures' costs
    is: (means, variances, weights), one column per count of restarts of the second kind
    where there are two (exactly, binomially, up to ``EXACT_MISSES`` failures), else one."""
    if len(parts) == 1 or k.max() > EXACT_MISSES:
        w = np.array([x[0] for x in parts])
        r_mean = float(np.dot(w, [x[1] for x in parts]))
        r_var = float(np.dot(w, [x[2] + x[1] ** 2 for x in parts])) - r_mean**2
        mean, var = x_mean + r_mean, x_var + r_var
        return (k * mean)[:, None], (k * var)[:, None], np.ones((len(k), 1))
    (w0, m0, v0), (w1, m1, v1) = parts
    j = np.arange(EXACT_MISSES + 1, dtype=float)[None, :]
    kk = k[:, None]
    valid = j <= kk
    fact = np.cumsum(np.log(np.maximum(np.arange(EXACT_MISSES + 1, dtype=float), 1.0)))
    rest = np.maximum(kk - j, 0).astype(int)  # log k! from a table (k ≤ EXACT_MISSES here)
    log_binom = fact[kk.astype(int)] - fact[j.astype(int)] - fact[rest]
    weights = np.where(valid, np.exp(log_binom + j * math.log(w1) + rest * math.log(w0)), 0.0)
    means = kk * x_mean + (kk - j) * m0 + j * m1
    variances = kk * x_var + (kk - j) * v0 + j * v1
    return np.where(valid, means, 0.0), np.where(valid, variances, 0.0), weights


def mixture_cdf(parts: Sequence[Mixture]) -> Callable[[float], float]:
    """The distribution function of an equal-weight mixture of ``parts`` (one per rate point):
    each a weighted sum of normals, a point mass where a component's deviation is 0."""
    probs = np.concatenate([x[0] for x in parts]) / len(parts)
    means = np.concatenate([x[1] for x in parts])
    sds = np.concatenate([x[2] for x in parts])
    point = sds == 0

    def cdf(x: float) -> float:
        z = np.where(point, np.where(x >= means, np.inf, -np.inf),
                     (x - means) / np.where(point, 1.0, sds))
        return float(np.dot(probs, _phi(z)))

    return cdf


def mixture_quantiles(parts: Sequence[Mixture], quantiles: Sequence[float] = QUANTILES
                      ) -> tuple[float, ...]:
    """The quantiles of an equal-weight mixture of ``parts`` (one per rate point), by bisection
    on its distribution function (``mixture_cdf``)."""
    means = np.concatenate([x[1] for x in parts])
    sds = np.concatenate([x[2] for x in parts])
    point = sds == 0
    cdf = mixture_cdf(parts)

    bottom = float((means - SPAN * sds).min())
    top = float((means + SPAN * sds).max()) + 1.0
    out = []
    for q in quantiles:
        lo, hi = bottom, top
        for _ in range(_BISECT):
            mid = (lo + hi) / 2
            if cdf(mid) >= q:
                hi = mid
            else:
                lo = mid
            if hi - lo <= 1e-7 * abs(hi):
                break
        jumps = means[point & (means >= lo) & (means <= hi)]  # (a point mass the CDF jumps at)
        out.append(float(jumps.max()) if len(jumps) else hi)
    return tuple(out)


def _phi(z: np.ndarray) -> np.ndarray:
    """The standard normal's distribution function, vectorized: erf by Abramowitz & Stegun
    7.1.26 (|error| < 1.5·10⁻⁷; NumPy has no erf and SciPy is not a dependency)."""
    x = np.abs(z) / math.sqrt(2)
    t = 1 / (1 + 0.3275911 * x)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027
                                                                           + t * 1.061405429))))
    with np.errstate(over="ignore", invalid="ignore"):
        erf = 1 - poly * np.exp(-x * x)
    erf = np.where(np.isinf(x), 1.0, erf)
    return np.asarray(0.5 * (1 + np.sign(z) * erf))


def _normal(base: float, k_mean: float, k_var: float, x_mean: float, x_var: float,
            parts: list[tuple[float, float, float]]) -> Mixture:
    """The compound sum as one normal of its mean and variance (many failures)."""
    w = [x[0] for x in parts]
    r_mean = sum(wi * x[1] for wi, x in zip(w, parts, strict=True))
    r_var = sum(wi * (x[2] + x[1] ** 2) for wi, x in zip(w, parts, strict=True)) - r_mean**2
    y_mean, y_var = x_mean + r_mean, x_var + r_var
    sd = math.sqrt(k_mean * y_var + k_var * y_mean**2)
    return np.ones(1), np.full(1, base + k_mean * y_mean), np.full(1, sd)


def fixed_loss_quantiles(work_s: float, loss_s: float, mttf_s: float,
                         quantiles: Sequence[float] = QUANTILES, *,
                         rate_count: float = 0.0) -> tuple[float, ...]:
    """Wall-clock percentiles of ``work_s`` when each failure (rate 1/``mttf_s``) costs a fixed
    ``loss_s`` and nothing rolls back: the first passage's mean W/(1 − ρ) and variance
    W·λℓ²/(1 − ρ)³, ρ = λℓ — with the chance of no failure at all, e^{−W/M}, as a point at W
    and the rest a normal of the remaining moments. ``rate_count`` as for checkpoint/restart."""
    parts = fixed_loss_parts(work_s, loss_s, mttf_s, rate_count=rate_count)
    return (tuple(math.inf for _ in quantiles) if parts is None
            else mixture_quantiles(parts, quantiles))


def fixed_loss_parts(work_s: float, loss_s: float, mttf_s: float, *, rate_count: float = 0.0
                     ) -> list[Mixture] | None:
    """``fixed_loss_quantiles``' distribution, one mixture per rate point, or None where the
    failures' loss outpaces the work (ρ ≥ 1)."""
    parts = []
    for mttf in rate_mttfs(mttf_s, rate_count):
        rho = loss_s / mttf
        if rho >= 1:
            return None
        mean = work_s / (1 - rho)
        var = work_s * loss_s * loss_s / mttf / (1 - rho) ** 3
        none = math.exp(-work_s / mttf)  # P(no failure at all): the run ends at W
        if none >= 1 - 1e-12:
            parts.append((np.ones(1), np.full(1, work_s), np.zeros(1)))
            continue
        rest_mean = (mean - none * work_s) / (1 - none)
        rest_var = max(0.0, (var + mean**2 - none * work_s**2) / (1 - none) - rest_mean**2)
        parts.append((np.array([none, 1 - none]), np.array([work_s, rest_mean]),
                      np.array([0.0, math.sqrt(rest_var)])))
    return parts


def _z(q: float) -> float:
    """The standard normal's q-quantile (bisection on erfc: no SciPy)."""
    lo, hi = -40.0, 40.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if 0.5 * math.erfc(-mid / math.sqrt(2)) < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
