"""Resilience over a run: closed forms against Monte Carlo, the Young/Daly optimum, and two
published cases (Llama 3's interruption count; FT-HSDP's 44% → 80%)."""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from analysis import resilience as R
from tracegen import ConfigError

# (MTTF s, checkpoint s, restart s, intervals of work) — short and long MTTF, cheap and costly
# checkpoints and restarts.
MC_CASES = [(1800, 60, 600, 40), (3600, 10, 120, 60), (900, 5, 300, 80), (20_000, 300, 900, 20)]


@pytest.mark.parametrize(("mttf", "delta", "restart", "n"), MC_CASES)
def test_closed_form_matches_monte_carlo(mttf: float, delta: float, restart: float, n: int
                                         ) -> None:
    tau = R.daly_interval_s(delta, mttf)
    work = n * tau
    closed = R.expected_wall_s(work, tau, delta, restart, mttf)
    runs = 400
    sims = R.monte_carlo_wall_s(work, tau, delta, restart, mttf, runs=runs, seed=7)
    se = sims.std(ddof=1) / math.sqrt(runs)
    assert abs(sims.mean() - closed) < 4 * se, (sims.mean(), closed, se)


@pytest.mark.parametrize(("mttf", "delta"), [(3600, 30), (11_000, 2), (900, 10), (86_400, 600)])
def test_daly_interval_is_the_numerical_optimum(mttf: float, delta: float) -> None:
    grid = np.geomspace(delta / 10, mttf * 3, 20_000)
    ettr = [R.ettr_checkpoint_restart(t, delta, 300, mttf) for t in grid]
    best = grid[int(np.argmax(ettr))]
    assert R.daly_interval_s(delta, mttf) == pytest.approx(best, rel=0.03)
    assert R.young_interval_s(delta, mttf) == pytest.approx(best, rel=0.10)


def test_llama3_interruption_count_is_reproduced() -> None:
    """419 unexpected interruptions in 54 days on 16,384 GPUs (Dubey et al. 2024, Table 5)."""
    f = R.FAILURE_PRESETS["llama3-16k-h100"]
    days = 54 * R.DAY_S
    assert days / f.job_mttf_s(16_384) == pytest.approx(419)
    counts = R.monte_carlo_failures(f, 16_384, days, runs=300, seed=3)
    se = counts.std(ddof=1) / math.sqrt(len(counts))
    assert abs(counts.mean() - 419) < 4 * se
    assert counts.std() == pytest.approx(math.sqrt(419), rel=0.15)  # Poisson
    assert sum(R.LLAMA3_CAUSES.values()) == 419


def test_ft_hsdp_case_moves_goodput_from_44_to_80_percent() -> None:
    """Salpekar et al. 2026: at O(100K) GPUs, a ~10 min global stall per failure gives ~44%
    effective training time; ~3 min replica-local recovery gives ~80%. Scenario: the 131,072-GPU
    projection (MTTF ≈ 15 min), global restart R = 10 min with 10 s async checkpoints at Daly's
    interval; replica-local: 3 min stall, one of 128 replicas restarts for 10 min, no rollback."""
    f = R.FAILURE_PRESETS["projection-131k-15min"]
    mttf = f.job_mttf_s(131_072)
    assert mttf == pytest.approx(900)
    costs = {"global_restart": R.RecoveryCosts(checkpoint_s=10, restart_s=600),
             "replica_local": R.RecoveryCosts(checkpoint_s=0, restart_s=600, stall_s=180,
                                              replicas=128)}
    frame = R.policy_frame(failure=f, gpus=131_072, work_s=30 * R.DAY_S, costs=costs)
    goodput = dict(zip(frame["policy"], frame["goodput"], strict=True))
    assert goodput["global_restart"] == pytest.approx(0.44, abs=0.02)
    assert goodput["replica_local"] == pytest.approx(0.80, abs=0.02)


def test_larger_jobs_fail_more_often() -> None:
    f = R.FAILURE_PRESETS["llama3-16k-h100"]
    assert f.job_mttf_s(32_768) == pytest.approx(f.job_mttf_s(16_384) / 2)


@pytest.mark.parametrize(("spec", "message"), [
    ({"rate_per_gpu_hour": -1.0}, "rate_per_gpu_hour must be a positive number, got -1.0"),
    ({"preset": "nope"}, "no failure preset 'nope'"),
    ({"rate": 1e-5}, "give preset = NAME or rate_per_gpu_hour"),
    ({"rate_per_gpu_hour": 1e-5, "weibull_shape": 0}, "weibull_shape must be > 0"),
])
def test_bad_failure_specs(spec: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        R.failure_model(spec)


JOB = R.JobShape(gpus=1024, params=70 * 10**9, model_parallel=32, dp=32,
                 nic_bytes_per_s=50e9, step_time_s=10.0, shrunk_throughput=31 / 32)


@pytest.mark.parametrize(("checkpoint", "restart", "policies", "message"), [
    ({"storage_GBps": "fast"}, {}, {}, "[checkpoint] storage_GBps must be a positive number"),
    ({"host_copy_GBps": 0}, {}, {}, "[checkpoint] host_copy_GBps must be a positive number"),
    ({}, {"warmup_s": float("inf")}, {}, "[restart] warmup_s must be a number ≥ 0, got inf"),
    ({}, {"init_s": [60]}, {}, "[restart] init_s must be a number ≥ 0"),
    ({}, {}, {"replica_local": {"stall_s": -1}}, "[policies.replica_local] stall_s must be"),
    ({}, {}, {"replica_local": 5}, "[policies.replica_local] must be a table"),
    ({}, {}, {"replica": {}}, "unknown [policies] ['replica']"),
    ({}, {}, {"hot_spares": {"stall_s": 1}}, "[policies.hot_spares] has no ['stall_s']"),
])
def test_bad_recovery_tables_are_named(checkpoint: dict, restart: dict, policies: dict,
                                       message: str) -> None:
    """Found by fuzzing studies: text, lists and infinities in these tables had raised
    ValueError / TypeError / OverflowError from inside the cost model."""
    with pytest.raises(ConfigError) as info:
        R.recovery_costs(JOB, checkpoint, restart, policies)
    assert message in str(info.value)


@pytest.mark.parametrize(("tables", "message"), [
    # a misspelt key had been dropped in silence: the default 200 GB/s costed instead
    ({"checkpoint": {"mode": "sync", "storage_gbps": 0.5}},
     "unknown [checkpoint] key(s) ['storage_gbps']; known: mode, storage_GBps"),
    ({"restart": {"warmup": 60}}, "unknown [restart] key(s) ['warmup']"),
    ({"failures": {"preset": "llama3"}}, "no failure preset 'llama3'"),
    ({"failures": {"rate_per_gpu_hour": -1}}, "rate_per_gpu_hour must be a positive number"),
    ({"policies": {"replica": {}}}, "unknown [policies] ['replica']"),
])
def test_resilience_tables_are_checked_when_the_study_is_read(tables: dict, message: str
                                                              ) -> None:
    """Before any strategy is costed: each table is read only after a strategy's step (the
    failure model only for one that fits), so a sweep would have screened and replayed first,
    and a study whose strategies all exceed memory never reported the typo."""
    from analysis.study import study_from_dict

    base = {"model": "gpt-1.7b", "system": "dgx-h100", "gpus": 8, "global_batch_size": 8,
            "strategies": [{"tp": 2}]}
    with pytest.raises(ConfigError) as info:
        study_from_dict({**base, **tables})
    assert message in str(info.value)
    study_from_dict({**base, "failures": {"preset": "llama3-16k-h100"},
                     "checkpoint": {"mode": "sync", "storage_GBps": 0.5}})


def test_a_job_that_cannot_progress_has_zero_goodput_not_an_overflow() -> None:
    """Restarts hundreds of MTTFs long: Daly's expected wall time is infinite and goodput 0;
    the Monte Carlo, which would draw failures for ever, says why instead of hanging."""
    assert R.expected_wall_s(3600, 600, 30, 10**6, 600) == math.inf
    assert R.ettr_checkpoint_restart(600, 30, 10**6, 600) == 0
    with pytest.raises(ConfigError, match="almost never completes"):
        R.monte_carlo_wall_s(3600, 600, 30, 10**6, 600, runs=2)


@given(interval=st.floats(0.0, 1e5), step=st.floats(0.1, 600.0),
       mttf=st.floats(30.0, 1e6), delta=st.floats(0.0, 600.0), restart=st.floats(0.0, 3600.0))
@example(interval=1.0, step=0.1, mttf=30.0, delta=0.0, restart=0.0)  # 10 steps exactly
def test_the_checkpoint_interval_is_whole_steps_the_better_neighbour_of_dalys(
        interval: float, step: float, mttf: float, delta: float, restart: float) -> None:
    """A trainer checkpoints between steps: the interval used is a whole number of steps, at
    least one, and no other whole number of steps within one of it does better."""
    ettr = functools.partial(R.ettr_checkpoint_restart, checkpoint_s=delta, restart_s=restart,
                             mttf_s=mttf)
    got = R.whole_steps_interval_s(interval, step, ettr)
    n = got / step
    assert n == pytest.approx(round(n), abs=1e-9) and round(n) >= 1
    assert abs(got - interval) < step or (interval < step and round(n) == 1)
    for k in (round(n) - 1, round(n) + 1):
        # strictly inside one step (k·step rounded: 9 · 0.1 lands 1e-16 inside 1.0's step)
        if k >= 1 and abs(k * step - interval) < step * (1 - 1e-9):
            assert ettr(k * step) <= ettr(got) * (1 + 1e-12)


def test_a_step_longer_than_dalys_interval_checkpoints_every_step(tmp_path: Path) -> None:
    """A one-hour MTTF and 2 s checkpoints give Daly's τ ≈ 118 s: a 300 s step is checkpointed
    after each step (a sub-step interval is no schedule), with the goodput that implies."""
    f = R.FailureModel(name="x", rate_per_gpu_hour=1 / 1024)
    costs = {"global_restart": R.RecoveryCosts(checkpoint_s=2.0, restart_s=300.0)}
    assert R.daly_interval_s(2.0, 3600) < 300
    (row,) = R.policy_rows(failure=f, gpus=1024, work_s=3e5, costs=costs, step_s=300.0)
    assert row["checkpoint_interval_s"] == 300.0
    assert row["goodput"] == pytest.approx(R.ettr_checkpoint_restart(300.0, 2.0, 300.0, 3600))
    (free,) = R.policy_rows(failure=f, gpus=1024, work_s=3e5, costs=costs)
    assert row["goodput"] < free["goodput"]  # the continuous optimum had been unreachable


def test_a_failure_rate_that_allows_no_progress_is_explained_in_strict_json(
        tmp_path: Path) -> None:
    """10 failures a GPU-hour (a per-job or per-day figure in the wrong key): goodput 0, days to
    train infinite — said in words, and written to the JSON as null (Python's Infinity is not
    JSON: browsers and jq refuse the file)."""
    study = (Path(__file__).resolve().parent.parent / "analysis" / "studies" / (
        "llama3-405b-failures.toml")).read_text()
    f = tmp_path / "typo.toml"
    f.write_text(study.replace('preset = "llama3-16k-h100"', "rate_per_gpu_hour = 10"))
    out = tmp_path / "s.json"
    r = subprocess.run([sys.executable, "-m", "analysis.cli", "resilience", str(f),
                        "--summary", str(out)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    words = " ".join(r.stdout.split())
    assert "no progress" in words and "rate_per_gpu_hour is per GPU and hour" in words
    assert "storage_GBps" not in words  # the rate is the culprit, not the storage

    def refuse(token: str) -> None:
        raise AssertionError(f"non-JSON constant {token}")

    data = json.loads(out.read_text(), parse_constant=refuse)["policies"]
    assert all(v["goodput"] == 0 and v["expected_wall_clock_s"] is None for v in data.values())


def test_resilience_refuses_a_study_without_a_token_budget(tmp_path: Path) -> None:
    """No tokens (or 0): days, GPU-hours and failures would be a run of nothing's, zeros in a
    table; refused instead, saying what to set (no traceback)."""
    study = (Path(__file__).resolve().parent.parent / "analysis" / "studies" / (
        "llama3-405b-failures.toml")).read_text()
    for name, text in (("none", study.replace("tokens = 15.6e12\n", "")),
                       ("zero", study.replace("tokens = 15.6e12", "tokens = 0"))):
        assert text != study
        f = tmp_path / f"{name}.toml"
        f.write_text(text)
        r = subprocess.run([sys.executable, "-m", "analysis.cli", "resilience", str(f)],
                           capture_output=True, text=True, timeout=300,
                           env={**os.environ, "COLUMNS": "200"})
        said = " ".join((r.stdout + r.stderr).split())
        assert r.returncode != 0 and "Traceback" not in said
        assert "resilience prices a training run: set tokens" in said


def test_a_comparison_without_a_token_budget_gives_goodput_not_days(tmp_path: Path) -> None:
    """``compare`` of a study with [failures] and no tokens: each policy's goodput (a rate,
    whatever the run's length) and the best policy by it; no time to train (it would be one
    step's). With the budget, the same goodput and the days."""
    from analysis.compare import failure_columns
    from analysis.fastpath import estimate
    from analysis.study import load_study

    text = (Path(__file__).resolve().parent.parent / "analysis" / "studies" / (
        "llama3-405b-failures.toml")).read_text()
    f = tmp_path / "none.toml"
    f.write_text(text.replace("tokens = 15.6e12\n", ""))
    cols = {}
    for name, path in (("none", f), ("budget", Path(__file__).resolve().parent.parent
                                     / "analysis" / "studies" / "llama3-405b-failures.toml")):
        study = load_study(path)
        s = study.strategies[0]
        fast = estimate(study.model, s, study.system)
        cols[name] = failure_columns(study, s, fast.step_time_s, fast, None)
    none, budget = cols["none"], cols["budget"]
    assert none["time_to_train_s"] is None and none["best_policy_time_to_train_s"] is None
    assert none["goodput"] == pytest.approx(budget["goodput"], rel=1e-9)
    assert budget["time_to_train_s"] > 30 * 86400  # (15.6T tokens: weeks)
    assert none["best_policy_goodput"] >= none["goodput"]


def test_resilience_cli_writes_summary_and_plots(tmp_path: Path) -> None:
    study = Path(__file__).resolve().parent.parent / "analysis" / "studies" / (
        "llama3-405b-failures.toml")
    out = tmp_path / "s.json"
    r = subprocess.run([sys.executable, "-m", "analysis.cli", "resilience", str(study),
                        "--summary", str(out), "--plots", str(tmp_path / "plots")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())["policies"]
    assert set(data) == set(R.POLICIES)
    for v in data.values():
        for key in ("goodput", "expected_wall_clock_s", "checkpoint_interval_s",
                    "expected_failures"):
            assert key in v
        assert 0 < v["goodput"] <= 1
    assert data["hot_spares"]["goodput"] > data["global_restart"]["goodput"]
    assert len(list((tmp_path / "plots").glob("*.png"))) == 2
    (shape,) = json.loads(out.read_text())["strategy_shapes"].values()
    assert shape["fits"] and shape["peak_memory_GiB"] <= 80
    assert "fits in 80 GiB" in r.stdout and "DOES NOT FIT" not in r.stdout
    # its FSDP as ZeRO-2 reducing every micro-batch's gradients, as the memory it is costed
    # with needs: labelled so, and no note that its ZeRO-2 reduces once a step
    assert "-z2-pmb-" in r.stdout and "note: ZeRO-2 is costed" not in r.stdout
    # --summary -: the same JSON alone on stdout, the tables on stderr
    piped = subprocess.run([sys.executable, "-m", "analysis.cli", "resilience", str(study),
                            "--summary", "-"], capture_output=True, text=True, timeout=300)
    assert piped.returncode == 0, piped.stderr
    assert json.loads(piped.stdout) == json.loads(out.read_text())
    assert "fits in 80 GiB" in piped.stderr


def test_resilience_flags_a_strategy_that_does_not_fit(tmp_path: Path) -> None:
    """Llama 3 405B on pp 16 without interleaving and with ZeRO-1 (gradients not sharded)
    needs ~87 GiB a GPU: the policies are still tabulated, but the run is flagged as one that
    cannot start, in the output and in the summary."""
    study = Path(__file__).resolve().parent.parent / "analysis" / "studies" / (
        "llama3-405b-failures.toml")
    text = study.read_text()
    head = text[:text.index("[[strategies]]")]
    tail = text[text.index("[failures]"):]
    bad = tmp_path / "bad.toml"
    bad.write_text(head + "[[strategies]]\ntp = 8\npp = 16\nmicro_batch_size = 1\n"
                   "sequence_parallel = true\nzero_stage = 1\nfirst_stage_layers = 7\n"
                   "last_stage_layers = 7\n\n" + tail)
    out = tmp_path / "s.json"
    r = subprocess.run([sys.executable, "-m", "analysis.cli", "resilience", str(bad),
                        "--summary", str(out)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    assert "DOES NOT FIT in 80 GiB" in r.stdout
    (shape,) = json.loads(out.read_text())["strategy_shapes"].values()
    assert not shape["fits"] and shape["peak_memory_GiB"] > 80
    # and it is told the least recompute that fits, in the study file's words
    hint = shape["fit_hint"]
    assert hint["peak_memory_GiB"] <= 80 and hint["step_time_s"] > shape["step_time_s"]
    words = " ".join(r.stdout.split())
    fields = (f'recompute = "full", recompute_num_layers = {hint["recompute_num_layers"]}'
              if hint["recompute_num_layers"] else f'recompute = "{hint["recompute"]}"')
    assert f"({fields}): {hint['peak_memory_GiB']:.1f} GiB" in words
    # and the sharding that fits: ZeRO-2's sharded gradients, without recomputing anything
    shard = shape["shard_hint"]
    assert shard["zero_stage"] >= 2 and shard["peak_memory_GiB"] <= 80
    assert f"(zero_stage = {shard['zero_stage']}" in words


def test_restart_cost_grows_with_job_size() -> None:
    def restart(gpus: int) -> float:
        job = R.JobShape(gpus=gpus, params=70 * 10**9, model_parallel=32, dp=gpus // 32,
                         nic_bytes_per_s=50e9, step_time_s=10.0, shrunk_throughput=0.99)
        return R.recovery_costs(job, {}, {})["global_restart"].restart_s

    assert restart(16_384) > restart(1024) > 0
    assert restart(16_384) - restart(1024) == pytest.approx(3.0 * (16_384 - 1024) / 1000)
    with pytest.raises(ConfigError, match=r"unknown \[restart\] key"):
        R.recovery_costs(R.JobShape(gpus=8, params=1, model_parallel=1, dp=8,
                                    nic_bytes_per_s=1e9, step_time_s=1, shrunk_throughput=1),
                         {}, {"boot_s": 1})


def test_per_node_rates_and_presets_have_sources() -> None:
    f = R.failure_model({"rate_per_node_hour": 8e-4}, gpus_per_host=8)
    assert f.rate_per_gpu_hour == pytest.approx(1e-4)
    assert all(p.source for p in R.FAILURE_PRESETS.values())
    opt = R.FAILURE_PRESETS["opt-175b-992-a100"]
    assert 56 * R.DAY_S / opt.job_mttf_s(992) == pytest.approx(53.5)


def test_resilience_keeps_every_strategy_of_a_study(tmp_path: Path) -> None:
    """The default study's first and third layouts share the short label
    (tp8-pp8-dp16-vpp3-mbs1: recompute and ZeRO differ): each is its own table, summary entry
    and pair of plots under its full name (one had replaced the other)."""
    study = Path(__file__).resolve().parent.parent / "analysis" / "studies" / "default.toml"
    out = tmp_path / "s.json"
    r = subprocess.run([sys.executable, "-m", "analysis.cli", "resilience", str(study),
                        "--summary", str(out), "--plots", str(tmp_path / "plots")],
                       capture_output=True, text=True, timeout=300, env={"COLUMNS": "300"})
    assert r.returncode == 0, r.stderr
    names = list(json.loads(out.read_text())["strategies"])
    assert len(names) == len(set(names)) == 4
    assert "tp8-pp8-dp16-vpp3-mbs1-interleaved_1f1b-rcs-z1-sp" in names
    assert "tp8-pp8-dp16-vpp3-mbs1-interleaved_1f1b-rcf-z0" in names
    assert len(list((tmp_path / "plots").glob("*.png"))) == 8
    assert all(f"default: {n} on 1024 GPUs" in r.stdout for n in names)


def test_a_node_rate_on_gb200_is_a_compute_trays() -> None:
    """A study's ``rate_per_node_hour`` is a host's (a server's; GB200 NVL72's 4-GPU compute
    tray), not the NVLink domain's: on the 72-GPU rack it spreads over 4 GPUs, as on a DGX
    over its 8 — dividing by 72 would make each GPU 18 times too reliable. The resilience
    frame of a tray's rate is that of a quarter of it a GPU."""
    from analysis.evaluate import resilience_frame
    from analysis.study import study_from_dict
    from replay import get_system

    gb200 = get_system("gb200-nvl72")
    assert gb200.node.gpus_per_node == 72 and gb200.node.host_gpus == 4
    assert get_system("dgx-h100").node.host_gpus == 8

    def frame(failures: dict[str, float]) -> Any:
        study = study_from_dict({"model": "llama3-8b", "system": "gb200-nvl72", "gpus": 144,
                                 "global_batch_size": 144, "failures": failures,
                                 "strategies": [{"dp": 144, "micro_batch_size": 1}]})
        return resilience_frame(study, study.strategies[0])

    tray = frame({"rate_per_node_hour": 8e-4})
    assert tray.equals(frame({"rate_per_gpu_hour": 2e-4}))
    assert not tray.equals(frame({"rate_per_gpu_hour": 8e-4 / 72}))


def test_a_per_gpu_weibull_shape_is_said_to_leave_the_goodputs_as_they_are(
        tmp_path: Path) -> None:
    """weibull_shape is accepted, but the closed forms take the job's MTTF (the superposition
    of many GPUs' failures is Poisson): the goodputs equal the exponential ones, and the CLI
    says why instead of ignoring the key in silence."""
    study = (Path(__file__).resolve().parent.parent / "analysis" / "studies" /
             "llama3-405b-failures.toml").read_text()
    goodputs = []
    for shape in ("", "\nweibull_shape = 0.7"):
        f = tmp_path / f"w{len(goodputs)}.toml"
        f.write_text(study.replace('preset = "llama3-16k-h100"',
                                   f"rate_per_gpu_hour = 2e-5{shape}"))
        out = tmp_path / f"w{len(goodputs)}.json"
        r = subprocess.run([sys.executable, "-m", "analysis.cli", "resilience", str(f),
                            "--summary", str(out)], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "COLUMNS": "300"})
        assert r.returncode == 0, r.stderr
        assert ("Palm–Khintchine" in r.stdout) is bool(shape)
        goodputs.append({k: p["goodput"] for k, p in json.loads(out.read_text())["policies"].items()})
    assert goodputs[0] == goodputs[1]
