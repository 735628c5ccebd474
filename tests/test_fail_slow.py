"""Fail-slow episodes over a run (``analysis.fail_slow``): the step with one slow GPU against
replay with that GPU's stage slowed, the closed forms of the episodes' occupancy and of the
pipeline bound, how they enter each recovery policy's goodput, and the study table's errors."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from analysis import fail_slow as F
from analysis.evaluate import resilience_rows
from analysis.fastpath import estimate, estimate_stages
from analysis.study import load_study
from replay import get_system, replay
from tracegen import ConfigError, ModelSpec, Strategy, generate

H100 = get_system("dgx-h100")
MODEL = ModelSpec(name="fs", num_layers=8, hidden_size=2048, num_attention_heads=16,
                  ffn_hidden_size=8192, vocab_size=32000, seq_len=2048, activation="swiglu")
STUDY = Path(__file__).resolve().parents[1] / "analysis" / "studies" / "llama3-405b-failures.toml"


@pytest.mark.parametrize("kw", [
    dict(tp=2, pp=1, dp=4), dict(tp=2, pp=2, dp=2), dict(tp=1, pp=4, dp=2),
    dict(tp=8, pp=4, dp=2), dict(tp=1, pp=4, dp=1, vpp=2, schedule="interleaved_1f1b"),
    dict(tp=1, pp=4, dp=2, schedule="gpipe"), dict(tp=1, pp=4, dp=2, schedule="zb_h1")])
def test_one_slow_gpus_step_is_replays_with_its_stage_slowed(tmp_path: Path, kw: dict) -> None:
    """Replay (the reference) slows the stage a representative stands for; the fast path
    walks the schedule with that stage slowed (``estimate_stages``). Each stage within 1% under
    every schedule (found within 0.1%; the pipeline bound this replaced had charged a slow
    stage all its extra time: up to 7% above replay under 1F1B, 5% below under interleaved and
    GPipe schedules, before a bottleneck last stage)."""
    s = Strategy(micro_batch_size=1, global_batch_size=8 * kw["dp"], sequence_parallel=kw[
        "tp"] > 1, **kw)
    generate(MODEL, s, tmp_path, mode="representative")
    healthy = replay(tmp_path, H100).step_time_s
    predicted = F.stage_factors(MODEL, s, H100, 2.0)
    reps = sorted(int(p.name.split(".")[1]) for p in tmp_path.glob("*.et"))
    assert len(reps) == s.pp == len(predicted)
    got = []
    for rep in reps:
        sc = tmp_path / "slow.toml"
        sc.write_text(f"[[straggler]]\nranks = [{rep}]\nslowdown = 2.0\n")
        got.append(replay(tmp_path, H100, scenario=sc).step_time_s / healthy)
    assert predicted == pytest.approx(got, rel=0.01)
    mean, worst = F.step_factors(MODEL, s, H100, 2.0)
    assert mean == pytest.approx(sum(got) / len(got), rel=0.01)
    assert worst == pytest.approx(max(got), rel=0.01) and min(got) > 1.05


def test_at_llama3_405b_scale_each_stage_is_replays(tmp_path: Path) -> None:
    """Meta's 405B strategy (16 stages, interleaved, vpp 8, dp 128, each micro-batch's
    gradients reduce-scattered) in representative mode, one GPU 2× slow: within 1% a stage of
    contention-free replay (found within 0.01%: 1.369 on stage 0). With link contention the
    healthy step is 2.5% longer (7.017 s against 6.846: the reduce-scatters share the NICs with
    the pipeline's sends), which the fast path does not model, and the factor 2.3% smaller;
    reducing once a step, the factors were within 0.4% either way."""
    study = load_study(STUDY)
    (s,) = study.strategies
    generate(study.model, s, tmp_path, mode="representative")
    healthy = replay(tmp_path, study.system, contention=False).step_time_s
    predicted = F.stage_factors(study.model, s, study.system, 2.0)
    reps = sorted(int(p.name.split(".")[1]) for p in tmp_path.glob("*.et"))
    for j in (0, s.pp // 2, s.pp - 1):
        sc = tmp_path / "slow.toml"
        sc.write_text(f"[[straggler]]\nranks = [{reps[j]}]\nslowdown = 2.0\n")
        got = replay(tmp_path, study.system, scenario=sc,
                     contention=False).step_time_s / healthy
        assert predicted[j] == pytest.approx(got, rel=0.01), (j, got)


@settings(max_examples=40, deadline=None)
@given(tp=st.sampled_from([1, 2, 8]), pp=st.sampled_from([2, 4]), dp=st.sampled_from([1, 2]),
       schedule=st.sampled_from(["1f1b", "gpipe", "interleaved_1f1b", "zb_h1"]),
       zero=st.sampled_from([0, 1, 3]), mb=st.sampled_from([1, 2]), data=st.data())
def test_the_spliced_pipeline_is_consistent_and_monotone(tp: int, pp: int, dp: int,
                                                         schedule: str, zero: int, mb: int,
                                                         data: st.DataObject) -> None:
    """``estimate_stages``: no stage on another system is ``estimate`` itself; every stage on
    the slowed system is that system's estimate (its sends and tails share the network); one
    slow stage lands between the healthy step and every stage slowed."""
    try:
        s = Strategy(tp=tp, pp=pp, dp=dp, micro_batch_size=mb, zero_stage=zero,
                     global_batch_size=mb * dp * 4 * pp, schedule=schedule,
                     vpp=2 if schedule == "interleaved_1f1b" else 1,
                     sequence_parallel=tp > 1)
    except ConfigError:
        assume(False)
        return
    slow = F.slowed_system(H100, data.draw(st.sampled_from([1.5, 2.0, 4.0])))
    healthy = estimate(MODEL, s, H100).step_time_s
    assert estimate_stages(MODEL, s, H100, {}).step_time_s == healthy
    every = estimate_stages(MODEL, s, H100, dict.fromkeys(range(pp), slow)).step_time_s
    assert every == pytest.approx(estimate(MODEL, s, slow).step_time_s, rel=1e-3)
    j = data.draw(st.integers(0, pp - 1))
    one = estimate_stages(MODEL, s, H100, {j: slow}).step_time_s
    assert healthy * (1 - 1e-9) <= one <= every * (1 + 1e-9)


@given(t=st.floats(1e-3, 10.0), m=st.integers(1, 512), p=st.integers(1, 64),
       v=st.integers(1, 8))
def test_the_pipeline_bound_is_the_bubble_formula_for_alike_stages(t: float, m: int, p: int,
                                                                  v: int) -> None:
    """Alike stages: (m + (p − 1)/v) · t, 1F1B's and the interleaved schedule's step."""
    assert F.pipeline_bound_s([t] * p, m, v) == pytest.approx((m + (p - 1) / v) * t, rel=1e-9)


@given(rate=st.floats(1e-8, 1e-3), d=st.floats(1.0, 1e5), gpus=st.integers(1, 131_072),
       detect=st.one_of(st.none(), st.floats(1.0, 1e5)), f=st.floats(1.0, 10.0))
def test_occupancy_and_progress_closed_forms(rate: float, d: float, gpus: int,
                                             detect: float | None, f: float) -> None:
    fs = F.FailSlow(rate, d, 2.0, detect)
    slow = d if detect is None else d * (1 - math.exp(-detect / d))  # E[min(D, T)], D ~ Exp
    assert fs.slow_s_per_episode() == pytest.approx(slow, rel=1e-9)
    p = 1 - math.exp(-rate * gpus * slow / 3600)  # P(Poisson count ≥ 1)
    assert fs.active_share(gpus) == pytest.approx(p, rel=1e-6)  # (1 − e^−x loses digits)
    assert F.progress(fs, gpus, f) == pytest.approx(1 - p * (1 - 1 / f), rel=1e-9)
    assert 1 / f * (1 - 1e-12) <= F.progress(fs, gpus, f) <= 1
    evicted = 0.0 if detect is None else math.exp(-detect / d)
    assert fs.evicted_rate_per_gpu_hour() == pytest.approx(rate * evicted, rel=1e-9, abs=1e-300)


def _study(tmp_path: Path, table: str) -> Path:
    f = tmp_path / "fs.toml"
    f.write_text(STUDY.read_text() + "\n[fail_slow]\n" + table)
    return f


def test_episodes_ridden_out_scale_every_policys_goodput_and_evictions_are_failures(
        tmp_path: Path) -> None:
    base = load_study(STUDY)
    (s,) = base.strategies
    fast = estimate(base.model, s, base.system)
    healthy = {r["policy"]: r for r in resilience_rows(base, s, fast)}
    ridden = load_study(_study(tmp_path, "rate_per_gpu_hour = 2e-5\nmean_duration_s = 3600\n"
                                         "slowdown = 2.0\n"))
    rows = resilience_rows(ridden, s, fast)
    keep = 1 - rows[0]["fail_slow_loss"]
    mean, worst = F.step_factors(base.model, s, base.system, 2.0)
    assert keep == pytest.approx(F.progress(F.FailSlow(2e-5, 3600, 2.0), s.world_size, mean))
    assert 1 < mean <= worst < 2 and keep < 1
    for r in rows:  # the failure process is untouched: the same interval, goodput × keep
        h = healthy[r["policy"]]
        assert r["checkpoint_interval_s"] == h["checkpoint_interval_s"]
        assert r["goodput"] == pytest.approx(h["goodput"] * keep, rel=1e-12)
    evicted = load_study(_study(tmp_path, "rate_per_gpu_hour = 2e-5\nmean_duration_s = 3600\n"
                                          "slowdown = 2.0\ndetect_s = 600\n"))
    rows = resilience_rows(evicted, s, fast)
    share = math.exp(-600 / 3600)
    assert rows[0]["fail_slow_evicted_share"] == pytest.approx(share)
    for r in rows:  # episodes cut at 600 s cost less slowed time and more failures
        h = healthy[r["policy"]]
        assert r["job_mttf_s"] == pytest.approx(
            h["job_mttf_s"] / (1 + 2e-5 * share / (419 / (54 * 24 * 16_384))), rel=1e-9)
        assert r["fail_slow_loss"] < 1 - keep and r["goodput"] < h["goodput"]


@pytest.mark.parametrize(("table", "message"), [
    ("rate_per_gpu_hour = 2e-5\nmean_duration_s = 60\nslowdown = 0.5\n", "below 1 it would "
     "be faster"),
    ("rate_per_gpu_hour = 2e-5\nmean_duration_s = 60\nslowdown = 1e6\n", "from 1 to 1000"),
    ("rate_per_gpu_hour = 2e-5\nslowdown = 2.0\nlength = 3\n", "unknown keys length"),
    ("rate_per_gpu_hour = 2e-5\nslowdown = 2.0\n", "missing mean_duration_s"),
    ("rate_per_gpu_hour = -1\nmean_duration_s = 60\nslowdown = 2.0\n",
     "rate_per_gpu_hour must be a positive number"),
])
def test_a_bad_fail_slow_table_is_named_when_the_study_is_read(tmp_path: Path, table: str,
                                                               message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_study(_study(tmp_path, table))


def test_fail_slow_needs_the_failure_tables_its_evictions_are_costed_with(
        tmp_path: Path) -> None:
    text = STUDY.read_text().replace('[failures]\npreset = "llama3-16k-h100"\n', "")
    f = tmp_path / "nofail.toml"
    f.write_text(text + "\n[fail_slow]\nrate_per_gpu_hour = 2e-5\nmean_duration_s = 60\n"
                        "slowdown = 2.0\n")
    with pytest.raises(ConfigError, match=r"\[fail_slow\] needs a \[failures\] table"):
        load_study(f)


def test_resilience_cli_says_what_the_episodes_cost(tmp_path: Path) -> None:
    f = _study(tmp_path, "rate_per_gpu_hour = 2e-5\nmean_duration_s = 3600\nslowdown = 2.0\n"
                         "detect_s = 600\n")
    summary = tmp_path / "s.json"
    r = subprocess.run([sys.executable, "-m", "analysis.cli", "resilience", str(f),
                        "--summary", str(summary)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLUMNS": "250"})
    assert r.returncode == 0, r.stderr
    assert "fail-slow: one GPU 2× slower stretches a step" in r.stdout
    assert "85% of episodes outlast 600 s and are evicted" in r.stdout
    policy = json.loads(summary.read_text())["policies"]["global_restart"]
    assert policy["fail_slow_evicted_share"] == pytest.approx(math.exp(-600 / 3600))
    assert f"{policy['fail_slow_step_factor']:.2f}× (on the bottleneck" in r.stdout


def test_a_comparison_ranks_by_and_reports_what_the_episodes_cost(tmp_path: Path) -> None:
    """`trainsim compare` ranks by time to train with the episodes (slow GPUs and slow NICs)
    inside the goodput, and the report says what each cost under the best strategy's recovery
    policies."""
    from typer.testing import CliRunner

    from analysis.cli import app
    from tests.studies import write_study

    f = write_study(tmp_path / "s")
    f.write_text(f.read_text() + "\n[fail_slow]\nrate_per_gpu_hour = 0.01\n"
                                 "mean_duration_s = 1800\nslowdown = 3.0\n"
                                 "[slow_links]\nrate_per_gpu_hour = 0.01\n"
                                 "mean_duration_s = 600\nbandwidth_factor = 0.5\n")
    plain = write_study(tmp_path / "p")
    runs = {}
    for name, study in (("slow", f), ("plain", plain)):
        got = CliRunner().invoke(app, ["compare", str(study), "-o", str(tmp_path / name)])
        assert got.exit_code == 0, got.output
        runs[name] = pl.read_parquet(tmp_path / name / "results.parquet").sort("strategy")
    assert (runs["slow"]["goodput"] < runs["plain"]["goodput"]).all()
    assert runs["slow"]["step_time_s"].equals(runs["plain"]["step_time_s"])  # healthy steps
    rep = CliRunner().invoke(app, ["report", str(tmp_path / "slow"), "-o", str(tmp_path / "r")])
    assert rep.exit_code == 0, rep.output
    md = (tmp_path / "r" / "report.md").read_text()
    assert "fail-slow: one GPU 3× slower stretches a step" in md
    assert "slow links: none of this strategy's traffic crosses a NIC" in md  # (one node)
    html = (tmp_path / "r" / "report.html").read_text()
    assert 'id="fail-slow"' in html and 'id="slow-links"' in html
