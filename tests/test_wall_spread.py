"""The wall clock's percentiles under failures (analysis/wall_spread.py) against simulations of
the same processes, their closed-form moments, and where `trainsim resilience` shows them."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from analysis import wall_spread as WS
from analysis.resilience import expected_wall_s, monte_carlo_wall_s
from tests.test_cli import run

DAY = 86_400.0
CASES = {  # (work, τ, δ, R, MTTF, persist): many failures; none likely; some; a persist window
    "many": (30 * DAY, 1800.0, 30.0, 600.0, 3 * 3600.0, 0.0),
    "rare": (10 * DAY, 3600.0, 60.0, 1800.0, 20 * DAY, 0.0),
    "some": (5 * DAY, 1800.0, 30.0, 900.0, DAY, 0.0),
    "persist": (30 * DAY, 1800.0, 30.0, 600.0, 3 * 3600.0, 600.0),
}


@pytest.mark.parametrize("case", CASES)
def test_checkpoint_restart_percentiles_match_the_monte_carlo(case: str) -> None:
    """P10, P50 and P90 of the compound negative binomial against 2,000 simulated runs of the
    same process (``monte_carlo_wall_s``: failures during restarts, a persist window's
    rollback), within a tenth of the P10–P90 spread (or 0.02% of the run: a run likely to
    see no failure has no spread)."""
    work, tau, delta, r, mttf, persist = CASES[case]
    got = WS.checkpoint_restart_quantiles(work, tau, delta, [(1.0, r)], mttf, persist)
    sim = np.quantile(monte_carlo_wall_s(work, tau, delta, r, mttf, runs=2000, seed=11,
                                         persist_s=persist), WS.QUANTILES)
    tol = max(0.1 * (sim[2] - sim[0]), 2e-4 * work)
    assert np.abs(np.array(got) - sim).max() <= tol
    assert got[0] <= got[1] <= got[2]
    if case == "rare":  # most runs meet no failure: P10 and P50 are the failure-free wall
        assert got[0] == got[1] == pytest.approx(work / tau * (tau + delta), rel=1e-12)


@given(length=st.floats(1.0, 1e5), mttf=st.floats(10.0, 1e7))
@settings(max_examples=80)
def test_a_failure_free_stretch_takes_its_closed_form_mean(length: float, mttf: float) -> None:
    """The time to get L seconds without a failure, starting again at each: mean
    M·(e^{L/M} − 1) (the restart's factor in Daly's form); variance non-negative. (Past
    L/M ≈ 700 the public functions answer "infinite" before asking.)"""
    assume(length / mttf < 50)
    mean, var = WS._stretch(length, 1 / mttf)
    assert mean == pytest.approx(mttf * math.expm1(length / mttf), rel=1e-9)
    assert var >= 0


def test_the_compound_mean_is_dalys() -> None:
    """n·T + E[K]·E[Y] — what the percentiles are built from — is Daly's eq. 13."""
    work, tau, delta, r, mttf, _ = CASES["many"]
    lam, seg = 1 / mttf, tau + delta
    p = math.exp(-lam * seg)
    x_mean, _ = WS._truncated_exp(seg, lam)
    r_mean, _ = WS._stretch(r, lam)
    mean = work / tau * (seg + (1 - p) / p * (x_mean + r_mean))
    assert mean == pytest.approx(expected_wall_s(work, tau, delta, r, mttf), rel=1e-12)


def _simulate_pool(work: float, tau: float, delta: float, swap: float, fallback: float,
                   miss: float, mttf: float, runs: int, seed: int) -> np.ndarray:
    """Checkpoint/restart whose restart is the fallback with probability ``miss``."""
    rng = np.random.default_rng(seed)
    seg, out = tau + delta, np.empty(runs)
    for i in range(runs):
        t, done = 0.0, 0
        while done < round(work / tau):
            ttf = rng.exponential(mttf)
            if ttf >= seg:
                t, done = t + seg, done + 1
                continue
            t += ttf
            restart = fallback if rng.random() < miss else swap
            while (x := rng.exponential(mttf)) < restart:
                t += x
            t += restart
        out[i] = t
    return out


def test_a_spare_pool_mixes_swaps_and_global_restarts_exactly() -> None:
    """A few failures a run, a third finding no spare: the binomial sum over which restarts
    were global against a simulation (the mean restart alone would put P90 elsewhere)."""
    work, tau, delta, swap, fallback, miss, mttf = 4 * DAY, 3600.0, 30.0, 300.0, 4 * 3600.0, \
        1 / 3, 2 * DAY
    got = WS.checkpoint_restart_quantiles(work, tau, delta, [(1 - miss, swap), (miss, fallback)],
                                          mttf)
    sim = np.quantile(_simulate_pool(work, tau, delta, swap, fallback, miss, mttf, 4000, 5),
                      WS.QUANTILES)
    assert np.abs(np.array(got) - sim).max() <= 0.1 * (sim[2] - sim[0])
    mean_r = (1 - miss) * swap + miss * fallback
    blended = WS.checkpoint_restart_quantiles(work, tau, delta, [(1.0, mean_r)], mttf)
    assert abs(blended[2] - sim[2]) > abs(got[2] - sim[2])


def test_a_fixed_loss_a_failure_takes_the_first_passage_percentiles() -> None:
    """Replica-local and elastic recovery: progress t − ℓ·N(t) reaching W, N the failures in
    wall-clock time (the cluster fails during a stall too, as the mean's form says), simulated."""
    work, loss, mttf = 20 * DAY, 6 * 3600.0, 2 * DAY
    rng = np.random.default_rng(3)
    walls = []
    for _ in range(4000):
        t, failures = 0.0, 0
        while True:
            gap = rng.exponential(mttf)
            level = t - loss * failures
            if level + gap >= work:
                walls.append(t + work - level)
                break
            t, failures = t + gap, failures + 1
    sim = np.quantile(walls, WS.QUANTILES)
    got = WS.fixed_loss_quantiles(work, loss, mttf)
    assert np.abs(np.array(got) - sim).max() <= 0.1 * (sim[2] - sim[0])
    assert WS.fixed_loss_quantiles(work, mttf, mttf) == (math.inf,) * 3  # (no progress)


@given(q=st.floats(0.001, 0.999))
@settings(max_examples=60)
def test_the_normal_quantile_and_distribution_invert(q: float) -> None:
    z = WS._z(q)
    assert 0.5 * math.erfc(-z / math.sqrt(2)) == pytest.approx(q, abs=1e-9)
    assert float(WS._phi(np.array([z]))[0]) == pytest.approx(q, abs=2e-7)


def test_resilience_shows_the_spread(tmp_path: Path) -> None:
    """`trainsim resilience`: a P10–P90 column beside the expected days, and the summary's
    percentiles around the expectation."""
    summary = tmp_path / "s.json"
    r = run("resilience", "analysis/studies/default.toml", "--summary", str(summary))
    assert r.returncode == 0, r.stderr
    assert "P10–P90" in r.stdout
    assert "counted from 419 failures: ±4.9%" in " ".join(r.stdout.split())
    policies = json.loads(summary.read_text())["policies"]
    for row in policies.values():
        assert row["wall_clock_p10_s"] <= row["wall_clock_p50_s"] <= row["wall_clock_p90_s"]
        assert row["wall_clock_p10_s"] <= row["expected_wall_clock_s"] <= row["wall_clock_p90_s"]


@pytest.mark.parametrize("count", [419.0, 53.5, 5.0])
def test_the_rate_points_carry_its_posterior(count: float) -> None:
    """The rate's points (Wilson-Hilferty quantiles of Gamma(count)): mean the rate, relative
    deviation 1/√count."""
    rates = 1 / np.array(WS.rate_mttfs(1000.0, count)) * 1000.0
    assert rates.mean() == pytest.approx(1.0, abs=0.01)
    assert rates.std() == pytest.approx(1 / math.sqrt(count), rel=0.08)
    assert WS.rate_mttfs(1000.0, 0.0) == [1000.0]


def test_a_counted_rate_widens_the_spread_as_a_simulation_of_it_does() -> None:
    """A rate measured from 20 failures: each simulated run draws its rate from the Gamma
    posterior first; the percentiles follow, wider than at the rate alone."""
    work, tau, delta, r, mttf, _ = CASES["some"]
    count = 20.0
    rng = np.random.default_rng(8)
    walls = [monte_carlo_wall_s(work, tau, delta, r, mttf * count / rng.gamma(count),
                                runs=1, seed=i)[0] for i in range(1500)]
    sim = np.quantile(walls, WS.QUANTILES)
    got = WS.checkpoint_restart_quantiles(work, tau, delta, [(1.0, r)], mttf, rate_count=count)
    exact = WS.checkpoint_restart_quantiles(work, tau, delta, [(1.0, r)], mttf)
    assert np.abs(np.array(got) - sim).max() <= 0.1 * (sim[2] - sim[0])
    assert got[2] - got[0] > exact[2] - exact[0]
    loose = WS.fixed_loss_quantiles(20 * DAY, 6 * 3600.0, 2 * DAY, rate_count=count)
    tight = WS.fixed_loss_quantiles(20 * DAY, 6 * 3600.0, 2 * DAY)
    assert loose[2] - loose[0] > tight[2] - tight[0]


@pytest.mark.parametrize("bad", [0.5, -1.0, math.nan, math.inf])
def test_a_failure_count_below_one_is_refused(bad: float) -> None:
    from analysis.resilience import failure_model
    from tracegen.errors import ConfigError

    with pytest.raises(ConfigError, match="observed_failures"):
        failure_model({"rate_per_gpu_hour": 1e-5, "observed_failures": bad})


def test_the_days_range_prints_to_the_digit_where_they_differ() -> None:
    from analysis.evaluate import days_range

    row = {"wall_clock_p10_s": 19.17 * DAY, "wall_clock_p90_s": 19.23 * DAY}
    assert days_range(row) == "19.17–19.23"
    assert days_range({"wall_clock_p10_s": 0.9 * DAY, "wall_clock_p90_s": 0.9 * DAY}) == "0.9"
    assert days_range({"wall_clock_p10_s": None, "wall_clock_p90_s": None}) == "–"
    assert days_range({"wall_clock_p10_s": 1.0, "wall_clock_p90_s": math.inf}) == "–"


def test_the_time_to_train_plot_draws_the_spread_as_whiskers() -> None:
    """Each policy's bar carries its P10–P90 whisker (matplotlib's error bar), from the days."""
    import matplotlib

    matplotlib.use("Agg")
    import polars as pl

    from analysis import plots

    frame = pl.DataFrame({"policy": ["global_restart", "elastic_shrink"],
                          "goodput": [0.99, 0.92],
                          "expected_wall_clock_s": [26.5 * DAY, 28.8 * DAY],
                          "wall_clock_p10_s": [26.4 * DAY, 27.9 * DAY],
                          "wall_clock_p90_s": [26.6 * DAY, 29.6 * DAY]})
    ax = plots.time_to_train_by_policy(frame).axes[0]
    (whiskers,) = ax.containers[1:]  # (the bars, then the error bars)
    segments = whiskers.lines[2][0].get_segments()
    spans = [(round(a[0], 3), round(b[0], 3)) for a, b in segments]
    assert spans == [(26.4, 26.6), (27.9, 29.6)]
    bare = plots.time_to_train_by_policy(frame.drop("wall_clock_p10_s", "wall_clock_p90_s"))
    assert len(bare.axes[0].containers) == 1  # (no spread, no whiskers)


def test_the_time_to_train_plot_labels_goodput_as_the_tables_do() -> None:
    """A bar's goodput reads to a tenth of a percent, as the tables print it: 99.6% is not
    "100%" (a run that loses no time to failures), nor 99.4% beside it the same figure."""
    import matplotlib

    matplotlib.use("Agg")
    import polars as pl

    from analysis import plots

    frame = pl.DataFrame({"policy": ["global_restart", "elastic_shrink"],
                          "goodput": [0.9962, 0.9941],
                          "expected_wall_clock_s": [26.5 * DAY, 26.6 * DAY]})
    ax = plots.time_to_train_by_policy(frame).axes[0]
    assert [t.get_text().strip() for t in ax.texts] == ["goodput 99.6%", "goodput 99.4%"]


@given(case=st.sampled_from(sorted(CASES)), count=st.sampled_from([0.0, 8.0, 400.0]),
       loss=st.booleans())
@settings(max_examples=24, deadline=None)
def test_the_chance_by_a_date_inverts_the_percentiles(case: str, count: float,
                                                      loss: bool) -> None:
    """``mixture_cdf`` is the distribution the percentiles are read from: at each percentile
    it reaches its level (a point mass may carry it past), just below it it has not, and it
    only grows — for checkpoint/restart and for a fixed loss a failure, rates exact or
    counted."""
    work, tau, delta, restart, mttf, persist = CASES[case]
    parts = (WS.fixed_loss_parts(work, restart, mttf, rate_count=count) if loss else
             WS.checkpoint_restart_parts(work, tau, delta, [(1.0, restart)], mttf, persist,
                                         rate_count=count))
    assert parts is not None
    cdf = WS.mixture_cdf(parts)
    levels = (0.1, 0.5, 0.9)
    at = WS.mixture_quantiles(parts, levels)
    for q, x in zip(levels, at, strict=True):
        assert cdf(x) >= q - 1e-6
        assert cdf(x * (1 - 1e-6)) <= q + 1e-6
    grid = np.linspace(min(at) * 0.9, max(at) * 1.1, 40)
    values = [cdf(float(x)) for x in grid]
    assert all(b >= a - 1e-12 for a, b in itertools.pairwise(values))
