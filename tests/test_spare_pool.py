"""Hot spares from a pool of finite size: the share of failures that find every spare in
repair (an M/G/∞ queue: Poisson in repair, seen by Poisson arrivals) against a simulation of
the pool, the mean restart between the swap and the global restart, and the tables checked."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis import resilience as R
from analysis.evaluate import resilience_frame
from analysis.study import study_from_dict


def _simulated_miss(in_repair: float, spares: int, repair: str, seed: int,
                    failures: int = 200_000) -> float:
    """Failures at rate 1 (Poisson), each host back after a repair time of mean ``in_repair``
    (fixed, or exponential): the share that find ``spares`` or more hosts still in repair."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0, failures))
    rep = (np.full(failures, in_repair) if repair == "fixed"
           else rng.exponential(in_repair, failures))
    back = t + rep
    # hosts still in repair when failure i arrives: earlier failures whose repair ends later
    order = np.sort(back)
    ended = np.searchsorted(order, t, side="right")  # repairs ended by t_i (all started before)
    started = np.arange(failures)  # failures before i
    busy = started - np.minimum(ended, started)
    warm = int(10 * in_repair) + 100  # (skip the empty pool's start)
    return float(np.mean(busy[warm:] >= spares))


@pytest.mark.parametrize(("in_repair", "spares", "repair"), [
    (2.0, 3, "fixed"), (7.8, 8, "exponential"), (7.8, 14, "fixed"), (30.0, 36, "exponential")])
def test_the_miss_share_is_the_poisson_tail_whatever_the_repair_time(
        in_repair: float, spares: int, repair: str) -> None:
    """Palm's theorem: the count in repair is Poisson with mean λT for any repair-time
    distribution, and arrivals see it (PASTA) — a simulated pool agrees within sampling."""
    closed = R.spare_miss(in_repair, spares)
    sim = _simulated_miss(in_repair, spares, repair, seed=spares)
    se = math.sqrt(closed * (1 - closed) / 20_000) + 1e-3  # (correlated samples: generous)
    assert abs(sim - closed) < 4 * se, (sim, closed)


@settings(max_examples=50, deadline=None)
@given(in_repair=st.floats(0.01, 200.0), spares=st.integers(0, 300))
def test_more_spares_never_miss_more_and_the_sizing_is_the_fewest(
        in_repair: float, spares: int) -> None:
    miss = R.spare_miss(in_repair, spares)
    assert 0.0 <= R.spare_miss(in_repair, spares + 1) <= miss <= 1.0
    need = R.spares_for(in_repair, 0.01)
    assert R.spare_miss(in_repair, need) <= 0.01
    assert need == 0 or R.spare_miss(in_repair, need - 1) > 0.01


def _rows(**hot_spares: object) -> dict[str, dict]:
    data = {"model": "llama3.1-405b", "system": "dgx-h100", "gpus": 16384,
            "global_batch_size": 2048, "tokens": 15.6e12,
            "strategies": [{"tp": 8, "pp": 16, "vpp": 8, "schedule": "interleaved_1f1b",
                            "micro_batch_size": 1, "sequence_parallel": True,
                            "zero_stage": 1, "account_for_embedding_in_pipeline_split": True,
                            "account_for_loss_in_pipeline_split": True}],
            "failures": {"preset": "llama3-16k-h100"}}
    if hot_spares:
        data["policies"] = {"hot_spares": hot_spares}
    study = study_from_dict(data)
    return {r["policy"]: r for r in
            resilience_frame(study, study.strategies[0]).iter_rows(named=True)}


def test_a_pool_makes_hot_spares_a_mix_of_the_swap_and_the_global_restart() -> None:
    """Llama 3 405B on 16,384 H100s (job MTTF 3.1 h): hosts back after a day are ~7.8 in
    repair on average. No pool: the swap every time, as before. 8 spares: about half the
    failures find none and restart as the global restart does; 16: almost all find one;
    0: the global restart's restart. Goodput rises with the spares, between the two."""
    free, glob = _rows()["hot_spares"], _rows()["global_restart"]
    assert free["spare_miss"] is None
    day = 24 * 3600.0
    rows = {n: _rows(spares=n, repair_s=day)["hot_spares"] for n in (0, 8, 16)}
    in_repair = day / free["job_mttf_s"]
    assert 7 < in_repair < 8.5
    hosts = 16384 // 8  # (DGX H100: the host is the node; idle spares fail as often)
    for n, r in rows.items():
        miss = R.spare_miss(R.pool_in_repair(in_repair, n, hosts, 1.0), n)
        assert r["spare_miss"] == pytest.approx(miss)
        assert r["restart_s"] == pytest.approx(
            (1 - miss) * free["restart_s"] + miss * glob["restart_s"])
    assert rows[0]["restart_s"] == pytest.approx(glob["restart_s"])
    assert 0.3 < rows[8]["spare_miss"] < 0.6 and rows[16]["spare_miss"] < 0.01
    assert glob["goodput"] <= rows[0]["goodput"] + 1e-12  # (its interval may differ by a step)
    assert rows[0]["goodput"] < rows[8]["goodput"] < rows[16]["goodput"] <= free["goodput"]


@pytest.mark.parametrize(("table", "says"), [
    ({"spares": 8}, "spares needs repair_s too"),
    ({"repair_s": 3600}, "repair_s needs spares too"),
    ({"spares": 2.5, "repair_s": 3600}, "spares must be a whole number of hosts"),
    ({"spares": -1, "repair_s": 3600}, "spares must be a number ≥ 0"),
    ({"stall_s": 10}, "it takes \\['idle_failure_factor', 'repair_s', 'spares'\\]"),
])
def test_a_pool_is_checked_when_the_study_is_read(table: dict, says: str) -> None:
    with pytest.raises(R.ConfigError, match=says):
        _rows(**table)


def test_resilience_says_how_often_the_pool_is_empty_and_what_would_do(tmp_path) -> None:
    """The CLI's line under the table: the miss share, the mean in repair, the pool for 1%."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    study = (Path(__file__).resolve().parent.parent / "analysis" / "studies" /
             "llama3-405b-failures.toml").read_text()
    f = tmp_path / "pool.toml"
    f.write_text(study.replace("[restart]", "[policies.hot_spares]\nspares = 8\n"
                                            "repair_s = 86400\n\n[restart]"))
    r = subprocess.run([sys.executable, "-m", "analysis.cli", "resilience", str(f)],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLUMNS": "300"})
    assert r.returncode == 0, r.stderr
    words = " ".join(r.stdout.split())
    job = 86400 / _rows()["hot_spares"]["job_mttf_s"]
    in_repair = R.pool_in_repair(job, 8, 2048, 1.0)
    miss = R.spare_miss(in_repair, 8)
    assert (f"hot_spares: 8 spare hosts, a failed one back after 24 h ({in_repair:.1f} in "
            f"repair on average): {miss:.1%} of failures find none") in words
    need = R.spares_for(job, 0.01, 2048, 1.0)
    assert f"{need} spares leave fewer than 1% without one" in words


def test_the_report_says_it_too(tmp_path) -> None:
    """`trainsim report` of a comparison whose study gives hot spares a pool: the same line
    under the recovery-policy table (from the results' columns alone)."""
    import subprocess
    import sys

    from tests.studies import write_study

    study = write_study(tmp_path)
    study.write_text(study.read_text() + "\n[policies.hot_spares]\nspares = 1\n"
                                         "repair_s = 36000\n")
    out = tmp_path / "out"
    cli = [sys.executable, "-m", "analysis.cli"]
    for args in (["compare", str(study), "-o", str(out), "--workers", "1"],
                 ["report", str(out), "-o", str(out)]):
        r = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
    md = " ".join((out / "report.md").read_text().split())
    assert "hot_spares: 1 spare host, a failed one back after 10 h" in md
    assert "of failures find none and restart as global_restart does" in md


def test_absurd_pools_and_repairs_answer_at_once() -> None:
    """A trillion spares, or repairs a trillion failures long, are refused by no check but
    must not hang the sum: the tail beyond twelve standard deviations is taken as none, and
    past a million hosts in repair the normal form stands in (it meets the exact sum there)."""
    assert R.spare_miss(7.8, 10**12) == 0.0 and R.spares_for(7.8, 0.01) == 16
    assert R.spare_miss(1e26, 5) == 1.0
    a = 1e12
    assert R.spares_for(a, 0.01) == pytest.approx(a + 2.3263 * math.sqrt(a), abs=2e3)
    edge = R.EXACT_MEAN
    for k in (0.0, 1.0, 2.0):
        spares = round(edge + k * math.sqrt(edge))
        assert R.spare_miss(edge * (1 + 1e-9), spares) == pytest.approx(
            R.spare_miss(edge, spares), abs=2e-3)


def test_a_pool_that_rarely_runs_dry_is_said_so_not_as_zero() -> None:
    """Hosts back after two hours against a 49-hour MTTF: 0.04 in repair, and four spares
    almost never run out — said as such, not as 0.0 and 0.0%."""
    from analysis.evaluate import spare_line

    mttf = 49.5 * 3600
    row = {"spare_miss": R.spare_miss(7200 / mttf, 4), "spares": 4, "spare_repair_s": 7200.0,
           "job_mttf_s": mttf}
    line = spare_line(row)
    assert line is not None
    assert "(0.04 in repair on average): under 0.1% of failures find none" in line
    assert spare_line({"spare_miss": None}) is None


def _simulated_miss_with_idle_failures(job_hosts: int, spares: int, repair: float,
                                       factor: float, seed: int,
                                       failures: int = 100_000) -> float:
    """A pool whose idle spares fail too: the job's hosts fail at rate 1 together (each at
    1/H), each idle spare at ``factor``/H; every failed host is back after ``repair``. The
    share of the job's failures that find no spare free."""
    rng = np.random.default_rng(seed)
    back: list[float] = []  # repair completions, a heap
    import heapq

    t, job_failures, missed = 0.0, 0, 0
    while job_failures < failures:
        idle = max(spares - len(back), 0)
        rate = 1.0 + factor * idle / job_hosts
        t_next = t + rng.exponential(1.0 / rate)
        if back and back[0] <= t_next:  # a host comes back first: redraw (memoryless)
            t = heapq.heappop(back)
            continue
        t = t_next
        if rng.random() < 1.0 / rate:  # the job's
            job_failures += 1
            missed += len(back) >= spares
        heapq.heappush(back, t + repair)
    return missed / failures


@pytest.mark.parametrize(("hosts", "spares", "repair", "factor"), [
    (16, 4, 4.0, 1.0), (8, 6, 5.0, 1.0), (32, 10, 8.0, 3.0)])
def test_idle_spares_that_fail_fill_the_repair_queue_as_the_mean_field_says(
        hosts: int, spares: int, repair: float, factor: float) -> None:
    """Idle spares fail too (``idle_failure_factor`` times a job host's rate): the hosts in
    repair are then the job's λT plus the idle spares' failures, E[(S − N)⁺]·f/H of λ each —
    the mean-field fixed point ``pool_in_repair``, against a simulated pool where that rate
    follows the spares actually idle: within a fifth of what the idle failures add to the
    miss share (+0.01 of sampling), where leaving them out misses all of it (pools large
    against the job, as here, 4-10 spares on 8-32 hosts, make the effect large enough to see;
    the mean field errs high — a full repair queue leaves fewer spares idle to fail — by
    0.028 of 0.16 in the last case)."""
    sim = _simulated_miss_with_idle_failures(hosts, spares, repair, factor, seed=spares)
    mean = R.pool_in_repair(repair, spares, hosts, factor)
    closed, without = R.spare_miss(mean, spares), R.spare_miss(repair, spares)
    assert mean > repair
    assert abs(sim - closed) < 0.2 * (closed - without) + 0.01, (sim, closed, without)
    assert abs(sim - closed) < abs(sim - without)


@settings(max_examples=60, deadline=None)
@given(job=st.floats(0.01, 100.0), spares=st.integers(0, 200), hosts=st.integers(1, 10**5),
       factor=st.floats(0.0, 3.0))
def test_the_pool_mean_lies_between_the_job_alone_and_every_spare_failing(
        job: float, spares: int, hosts: int, factor: float) -> None:
    """λT ≤ m ≤ λT·(1 + f·S/H): idle spares add at most all S failing at f/H each; none
    where f is 0; the sizing still leaves at most 1% without a spare."""
    m = R.pool_in_repair(job, spares, hosts, factor)
    assert job * (1 - 1e-12) <= m <= job * (1 + factor * spares / hosts) * (1 + 1e-9)
    assert R.pool_in_repair(job, spares, hosts, 0.0) == job
    need = R.spares_for(job, 0.01, hosts, factor)
    assert R.spare_miss(R.pool_in_repair(job, need, hosts, factor), need) <= 0.01
