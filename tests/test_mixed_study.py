"""A study's ``[mixed]`` table: part of the cluster on another system's GPUs as whole pipeline
stages, every strategy of a comparison or a sweep placed there (first or last stages, layers
split by the stages' speeds), replayed with a ``[[gpu]]`` scenario on those stages, and its
row's flags the ``trainsim estimate --stage-system`` command of it."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shlex
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from analysis.cli import app
from analysis.compare import compare
from analysis.evaluate import resilience_frame
from analysis.mixed import mixed_estimate, place
from analysis.scaling import scaling
from analysis.study import load_study
from analysis.sweep import sweep
from replay import get_system, replay
from tests.studies import TINY_MODEL
from tracegen import ConfigError

A100 = get_system("dgx-a100-80gb")
STUDY = """model = "tiny.toml"
system = "dgx-h100"
gpus = 16
global_batch_size = 32
tokens = 1e9
{extra}
"""
MIXED = """
[mixed]
system = "dgx-a100-80gb"
gpus = 8
"""
STRATEGIES = """
[[strategies]]
tp = 2
pp = 2
micro_batch_size = 1

[[strategies]]
tp = 1
pp = 4
micro_batch_size = 1

[[strategies]]
tp = 2
pp = 2
vpp = 2
micro_batch_size = 1
"""


def _study(tmp: Path, extra: str) -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "tiny.toml").write_text(TINY_MODEL)
    path = tmp / "study.toml"
    path.write_text(STUDY.format(extra=extra))
    return path


def test_a_bad_mixed_table_is_refused_with_every_problem(tmp_path: Path) -> None:
    path = _study(tmp_path, '[mixed]\nsystem = 3\ngpus = 16\nbalance = "yes"\nnodes = 2\n')
    with pytest.raises(ConfigError) as err:
        load_study(path)
    text = str(err.value)
    for part in ("unknown key 'nodes'", "between 1 and 15, got 16", "system must be",
                 "balance is true or false"):
        assert part in text, text
    path = _study(tmp_path, MIXED + "[[strategies]]\ntp = 2\npp = 1\nmicro_batch_size = 1\n")
    with pytest.raises(ConfigError, match="strategy #1: 8 dgx-a100-80gb GPUs are not whole "
                                          "pipeline stages of tp2-pp1-dp8"):
        load_study(path)


def test_a_comparison_places_each_strategy_and_replay_confirms_it(tmp_path: Path) -> None:
    """Each row is the placement's estimate (the other GPUs on the first or last stages,
    whichever steps faster; layers split by speed), replayed within 1% with the A100 ranks on
    their own nodes' links; its flags, given to `trainsim estimate`, cost that same step."""
    study = load_study(_study(tmp_path, MIXED + STRATEGIES))
    rows = compare(study).to_dicts()
    assert len(rows) == 3
    for r in rows:
        original = next(s for s in study.strategies if s.label() in r["strategy"])
        placed = place(study.model, original, study.system, A100, 8, ref="dgx-a100-80gb")
        assert r["fast_step_time_s"] == placed.estimate.step_time_s
        assert r["status"] == "replayed"
        assert r["step_time_s"] == pytest.approx(r["fast_step_time_s"], rel=0.01)
        assert r["stage_systems"] == placed.stage_systems
        out = tmp_path / "e.json"
        got = CliRunner().invoke(app, ["estimate", "--model", str(tmp_path / "tiny.toml"),
                                       "--system", "dgx-h100", *shlex.split(r["flags"]),
                                       "--json", str(out)])
        assert got.exit_code == 0, got.stdout
        assert json.loads(out.read_text())["mixed"]["step_time_s"] == r["fast_step_time_s"]
    # either end is taken where it steps faster: never slower than the first stages
    s = study.strategies[1]
    first = mixed_estimate(study.model, s, study.system, {0: A100, 1: A100})
    assert place(study.model, s, study.system, A100, 8, balance=False).estimate.step_time_s \
        <= first.step_time_s


def test_a_sweep_rules_out_layouts_the_other_gpus_do_not_fill_and_resumes_only_itself(
        tmp_path: Path) -> None:
    path = _study(tmp_path, MIXED + "[search]\ntp = [1, 2]\npp = [1, 2, 4]\nvpp = [1]\n"
                  "micro_batch_size = [1]\nrecompute = [\"none\"]\nzero_stage = [1]\n"
                  "sequence_parallel = [false]\n")
    study = load_study(path)
    results, counts = sweep(study, tmp_path / "out", top_k=1, workers=1)
    assert counts["invalid"] == 2  # pp 1: one stage of 16 GPUs, not 8
    assert results.filter(pl.col("pp") == 1).is_empty()
    assert results["stage_systems"].is_not_null().all()
    assert all("--stage-system" in f for f in results["flags"])
    plain = load_study(_study(tmp_path / "plain", "[search]\ntp = [1, 2]\npp = [2]\n"))
    with pytest.raises(ConfigError, match="another study"):
        sweep(plain, tmp_path / "out", top_k=1, workers=1)
    with pytest.raises(ConfigError, match=r"\[mixed\] table fixes"):
        scaling(study, [16, 32], tmp_path / "scale")


def test_resilience_costs_the_placed_strategys_step(tmp_path: Path) -> None:
    path = _study(tmp_path, MIXED + STRATEGIES + "[failures]\nrate_per_gpu_hour = 0.01\n")
    study = load_study(path)
    s = study.strategies[0]
    frame = resilience_frame(study, s)
    placed = place(study.model, s, study.system, A100, 8, ref="dgx-a100-80gb")
    assert frame["step_time_s"][0] == placed.estimate.step_time_s


def test_estimate_places_the_other_gpus_itself_with_mixed(tmp_path: Path) -> None:
    """``--mixed GPUS=SYSTEM`` is ``--stage-system`` on ``place``'s stages: the same even and
    balanced steps, and the placement said."""
    from tracegen import Strategy, get_model

    model, h100 = get_model("llama3-70b"), get_system("dgx-h100")
    s = Strategy(tp=8, pp=8, dp=16, sequence_parallel=True, micro_batch_size=1,
                 global_batch_size=1024, zero_stage=1)
    placed = place(model, s, h100, A100, 512, ref="dgx-a100-80gb")
    args = ["estimate", "--model", "llama3-70b", "--gpus", "1024", "--tp", "8", "--pp", "8",
            "--sp", "--mbs", "1", "--gbs", "1024", "--zero", "1", "--system", "dgx-h100"]
    out = tmp_path / "m.json"
    got = CliRunner().invoke(app, [*args, "--mixed", "512=dgx-a100-80gb", "--json", str(out)])
    assert got.exit_code == 0, got.stdout
    assert f"--stage-system {placed.stage_systems}" in " ".join(got.stdout.split())
    mixed = json.loads(out.read_text())["mixed"]
    assert mixed["balanced"]["step_time_s"] == placed.estimate.step_time_s
    where = {j: A100 for j in placed.stages}
    assert mixed["step_time_s"] == mixed_estimate(model, s, h100, where).step_time_s
    both = CliRunner().invoke(app, [*args, "--mixed", "512=dgx-a100-80gb",
                                    "--stage-system", "0=dgx-a100-80gb"])
    assert both.exit_code != 0 and "not both" in str(both.exception)


def test_a_strategy_the_model_refuses_is_told_so_before_it_is_placed() -> None:
    """126 layers on pp 16 without an uneven split: the model's own message, not that of a
    pipeline layout placing 112 layers that the placement would have built from it."""
    from tracegen import Strategy, get_model

    s = Strategy(tp=8, pp=16, dp=128, sequence_parallel=True, micro_batch_size=1,
                 global_batch_size=2048, zero_stage=1)
    with pytest.raises(ConfigError, match="126 is not divisible by pp"):
        place(get_model("llama3.1-405b"), s, get_system("dgx-h100"), A100, 4096)


@pytest.mark.parametrize("table", ["fail_slow", "slow_links"])
def test_a_slow_gpu_or_nic_on_a_mixed_cluster_slows_its_own_systems_stage(
        tmp_path: Path, table: str) -> None:
    """A fail-slow GPU or a slow NIC on the placed cluster: each stage's factor is the mixed
    step with that stage's own system slowed (an A100 stage a slow A100, not a slow H100) over
    the mixed step; replay with the ``[[gpu]]`` scenario plus a straggler or a slow link on
    that stage's representative agrees within 1% a stage (replay without link contention, the
    fast path's reference, as in the one-system tests)."""
    from analysis import fail_slow, slow_links
    from tracegen import generate

    study = load_study(_study(tmp_path, MIXED + STRATEGIES))
    placed = place(study.model, study.strategies[1], study.system, A100, 8, ref="dgx-a100-80gb")
    s, where = placed.strategy, placed.where
    if table == "fail_slow":
        predicted = fail_slow.stage_factors(study.model, s, study.system, 2.0, where)
        extra = "[[straggler]]\nranks = [{rep}]\nslowdown = 2.0\n"
    else:
        predicted = slow_links.stage_factors(study.model, s, study.system, 0.25, where)
        extra = '[[link]]\nranks = [{rep}]\ntier = "nic"\nbandwidth_factor = 0.25\n'
    generate(study.model, s, tmp_path / "et", mode="representative", gpus=study.gpus)
    reps = sorted(int(p.name.split(".")[1]) for p in (tmp_path / "et").glob("*.et"))
    gpu = f'[[gpu]]\nranks = {[reps[j] for j in placed.stages]}\nsystem = "dgx-a100-80gb"\n'
    sc = tmp_path / "sc.toml"
    sc.write_text(gpu)
    healthy = replay(tmp_path / "et", study.system, scenario=sc, contention=False).step_time_s
    assert healthy == pytest.approx(placed.estimate.step_time_s, rel=0.01)
    got = []
    for rep in reps:
        sc.write_text(gpu + extra.format(rep=rep))
        got.append(replay(tmp_path / "et", study.system, scenario=sc, contention=False
                          ).step_time_s / healthy)
    assert predicted == pytest.approx(got, rel=0.01)
    # an A100 stage slowed is not an H100 stage slowed: the one-system factors differ
    one_system = (fail_slow.stage_factors(study.model, s, study.system, 2.0) if
                  table == "fail_slow" else
                  slow_links.stage_factors(study.model, s, study.system, 0.25))
    assert predicted != pytest.approx(one_system, rel=0.01)


def test_resilience_on_a_mixed_cluster_costs_its_slowest_nic_and_its_shrunk_replica(
        tmp_path: Path) -> None:
    """The checkpoint waits for the slower (A100, 200 Gb/s) NICs; the elastic replica fewer
    runs on the same stages (its throughput below the full job's, as on one system)."""
    from analysis.evaluate import job_shape
    from analysis.fastpath import estimate_stages

    study = load_study(_study(tmp_path, MIXED + STRATEGIES + "[failures]\n"
                                                             "rate_per_gpu_hour = 0.01\n"))
    placed = place(study.model, study.strategies[1], study.system, A100, 8, ref="dgx-a100-80gb")
    s = placed.strategy
    fast = estimate_stages(study.model, s, study.system, placed.where)
    job = job_shape(study, s, fast, placed.where)
    a100_nic = A100.scaleout.nic_Gbps_per_gpu / 8 * 1e9 * A100.scaleout.nic_efficiency
    assert job.nic_bytes_per_s == a100_nic < job_shape(study, s, fast).nic_bytes_per_s
    assert 0 < job.shrunk_throughput < 1
    frame = resilience_frame(study, study.strategies[1])
    assert frame["step_time_s"][0] == placed.estimate.step_time_s == fast.step_time_s


def test_a_mixed_studys_fit_hints_are_placed_there(tmp_path: Path) -> None:
    """Llama 3 70B at tp 4 · pp 4 without ZeRO does not fit on 512 H100 + 512 A100. The hints
    search places every candidate as the strategy is, layers split by speed, and costs it
    there: the sharding hint fits at the mixed step (~12 s), not at the all-H100 one (~8.5 s)
    it had been quoted at; ``trainsim resilience`` says so."""
    from analysis.glance import fit_hints
    from analysis.mixed import placed_fast, study_fit_hints

    (tmp_path / "study.toml").write_text(
        'model = "llama3-70b"\nsystem = "dgx-h100"\ngpus = 1024\nglobal_batch_size = 1024\n'
        'tokens = 1e12\n[mixed]\nsystem = "dgx-a100-80gb"\ngpus = 512\n[[strategies]]\n'
        'tp = 4\npp = 4\nmicro_batch_size = 1\nsequence_parallel = true\n'
        '[failures]\npreset = "llama3-16k-h100"\n')
    study = load_study(tmp_path / "study.toml")
    s = study.strategies[0]
    assert not placed_fast(study, s)[1].fits
    placed, one = study_fit_hints(study, s), fit_hints(study.model, s, study.system)
    assert placed[1] is not None and one[1] is not None
    for hint, alone in zip(placed, one, strict=True):
        if hint is None:
            continue
        fields = {k: v for k, v in hint.items() if k not in ("step_time_s", "peak_memory_GiB")}
        _, fast, _ = placed_fast(study, dataclasses.replace(s, **fields))
        assert fast.fits and hint["step_time_s"] == fast.step_time_s
        assert hint["peak_memory_GiB"] == fast.peak_memory_GiB
        assert hint["step_time_s"] > 1.2 * alone["step_time_s"]  # the A100 stages pace it
    got = CliRunner().invoke(app, ["resilience", str(tmp_path / "study.toml")])
    assert got.exit_code == 0, got.stdout
    text = " ".join(got.stdout.split())
    assert (f"it fits with ZeRO-{placed[1]['zero_stage']} (zero_stage = "
            f"{placed[1]['zero_stage']}): {placed[1]['peak_memory_GiB']:.1f} GiB, "
            f"{placed[1]['step_time_s']:.3f} s a step") in text
    assert "DOES NOT FIT in 80 GiB —" in text  # both GPUs hold 80 GiB: one figure
    smaller = tmp_path / "a100-40.toml"
    smaller.write_text((tmp_path / "study.toml").read_text().replace("a100-80gb", "a100-40gb"))
    got = CliRunner().invoke(app, ["resilience", str(smaller)])
    assert ("80 GiB on dgx-h100, 40 GiB on dgx-a100-40gb (each stage against its own)"
            in " ".join(got.stdout.split())), got.stdout



def test_estimate_on_a_mixed_cluster_that_does_not_fit_says_what_would() -> None:
    """tp 4 · pp 4 with 512 A100 40GB: neither split fits; the hint's flags, run again with
    the stages, give the step it quoted, and every stage fits; the all-H100 hint printed
    above it says it is for the H100s alone."""
    args = ["estimate", "--model", "llama3-70b", "--gpus", "1024", "--tp", "4", "--pp", "4",
            "--sp", "--mbs", "1", "--gbs", "1024", "--system", "dgx-h100"]
    got = CliRunner().invoke(app, [*args, "--mixed", "512=dgx-a100-40gb"])
    assert got.exit_code == 0, got.stdout
    text = " ".join(got.stdout.split())
    hint = text.split("on the mixed cluster it fits with ")[1]
    # the all-H100 hint above it says whose it is; only the mixed one is unqualified
    assert "on dgx-h100 alone it fits with " in text
    assert text.count("it fits with ") == 2, text
    flags = hint[hint.index("(") + 1:hint.index("):")]
    step = float(hint.split("GiB a GPU, ")[1].split(" s a step")[0])
    stages = text.split("(--stage-system ")[1].split(")")[0]
    again = CliRunner().invoke(app, [*args, *shlex.split(flags), "--stage-system", stages])
    assert again.exit_code == 0, again.stdout
    assert "--pipeline-layout" in flags and "on the mixed cluster it fits" not in again.stdout
    again_text = " ".join(again.stdout.split())
    assert f"mixed cluster: step time {step:.4f} s" in again_text
    assert "memory fits on every stage's own GPU" in again_text


def test_the_other_gpus_failure_rate_factor_scales_the_jobs_failure_rate(
        tmp_path: Path) -> None:
    """``failure_rate_factor = 3`` on 8 of 16 GPUs: the job fails (8 + 3·8)/16 = 2× as often
    (Poisson rates add): its MTTF halves, the goodput falls; the fingerprint tells the two
    studies apart; the table's errors are named."""
    from analysis.resume import fingerprint

    fail = "[failures]\nrate_per_gpu_hour = 0.001\n"
    plain = load_study(_study(tmp_path / "a", MIXED + STRATEGIES + fail))
    worse = load_study(_study(tmp_path / "b", MIXED + "failure_rate_factor = 3\n" + STRATEGIES
                              + fail))
    s = plain.strategies[0]
    a, b = resilience_frame(plain, s), resilience_frame(worse, s)
    assert b["job_mttf_s"][0] == pytest.approx(a["job_mttf_s"][0] / 2, rel=1e-12)
    assert (b["goodput"] < a["goodput"]).all()
    assert fingerprint(plain) != fingerprint(worse)
    assert "failure_rate_factor" not in fingerprint(plain)["mixed"]  # older folders match
    got = CliRunner().invoke(app, ["resilience", str(tmp_path / "b" / "study.toml")])
    assert "its GPUs fail 3× as often as [failures] says" in " ".join(got.stdout.split())
    for bad, message in (("failure_rate_factor = 0\n" + fail, "a positive number, got 0"),
                         ("failure_rate_factor = 2\n", "add a [failures] table")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_study(_study(tmp_path / "c", MIXED + bad + STRATEGIES))


EPISODES = """[fail_slow]
rate_per_gpu_hour = 0.002
mean_duration_s = 3600
slowdown = 2.0
detect_s = 600

[slow_links]
rate_per_gpu_hour = 0.001
mean_duration_s = 1800
bandwidth_factor = 0.25
"""


@pytest.mark.parametrize("table", ["fail_slow", "slow_links"])
def test_the_other_gpus_episode_rate_factor_weighs_their_stages(
        tmp_path: Path, table: str) -> None:
    """``fail_slow_rate_factor`` / ``slow_links_rate_factor = 3`` on the 8 A100s of 16: episodes
    arrive (8 + 3·8)/16 = 2× as often (the M/G/∞ occupancy's mean doubles: −ln(1 − share)
    twice the plain study's), and one lands on an A100 stage 3× as likely as on an H100 one,
    so the step factor is the stage factors' mean weighted 3 : 1 (the plain study's is
    unweighted); evictions (``detect_s``) add twice the rate to the failures; the other
    table, the fingerprint and the cluster's words say so; a bad factor is named."""
    from analysis import fail_slow, slow_links
    from analysis.cli_study import mixed_words
    from analysis.resume import fingerprint

    key = f"{table}_rate_factor"
    fail = "[failures]\nrate_per_gpu_hour = 0.001\n"
    plain = load_study(_study(tmp_path / "a", MIXED + STRATEGIES + fail + EPISODES))
    worse = load_study(_study(tmp_path / "b", MIXED + f"{key} = 3\n" + STRATEGIES + fail
                              + EPISODES))
    placed = place(plain.model, plain.strategies[1], plain.system, A100, 8)
    s, where = placed.strategy, placed.where
    assert len(where) == 2 and s.pp == 4  # two A100 stages of four
    a, b = (resilience_frame(x, x.strategies[1]) for x in (plain, worse))
    share_a, share_b = a[f"{table}_active_share"][0], b[f"{table}_active_share"][0]
    assert -math.log1p(-share_b) == pytest.approx(-2 * math.log1p(-share_a), rel=1e-12)
    module = fail_slow if table == "fail_slow" else slow_links
    factors = module.stage_factors(plain.model, s, plain.system,
                                   2.0 if table == "fail_slow" else 0.25, where)
    weights = [3.0 if j in where else 1.0 for j in range(4)]
    weighted = sum(f * w for f, w in zip(factors, weights, strict=True)) / sum(weights)
    assert b[f"{table}_step_factor"][0] == pytest.approx(weighted, rel=1e-12)
    assert a[f"{table}_step_factor"][0] == pytest.approx(sum(factors) / 4, rel=1e-12)
    assert weighted != pytest.approx(sum(factors) / 4, rel=1e-3)  # the stages differ
    other = "slow_links" if table == "fail_slow" else "fail_slow"
    assert b[f"{other}_loss"][0] == a[f"{other}_loss"][0]  # the other table's rate is its own
    if table == "fail_slow":  # evicted at twice the rate: the job's failures grow by that
        evicted = 0.002 * math.exp(-600 / 3600)
        assert 1 / b["job_mttf_s"][0] - 1 / a["job_mttf_s"][0] == pytest.approx(
            evicted * 16 / 3600, rel=1e-9)
    assert fingerprint(plain) != fingerprint(worse)
    assert key not in fingerprint(plain)["mixed"]  # (older folders match)
    words = {"fail_slow": "they run slow 3× as often as [fail_slow] says",
             "slow_links": "their NICs slow down 3× as often as [slow_links] says"}
    assert words[table] in mixed_words(worse)
    for bad, message in ((f"{key} = -1\n" + fail + EPISODES, "a positive number, got -1"),
                         (f"{key} = 2\n" + fail, f"add a [{table}] table")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_study(_study(tmp_path / "c", MIXED + bad + STRATEGIES))


def test_a_mixed_sweep_recomputes_to_fit_on_the_mixed_cluster(tmp_path: Path) -> None:
    """Llama 3 70B on 512 H100 + 512 A100 40GB: tp 4 · pp 4 steps fastest but does not fit;
    its least recompute that fits is searched with each candidate placed on the mixed
    cluster, and that variant — fitting every stage's own GPU — outranks every layout that
    fits as enumerated; replay confirms it within 1%."""
    (tmp_path / "study.toml").write_text(
        'model = "llama3-70b"\nsystem = "dgx-h100"\ngpus = 1024\nglobal_batch_size = 1024\n'
        '[mixed]\nsystem = "dgx-a100-40gb"\ngpus = 512\n[search]\ntp = [4, 8]\npp = [4, 8]\n'
        'vpp = [1]\nmicro_batch_size = [1]\nrecompute = ["none"]\nzero_stage = [1]\n'
        'sequence_parallel = [true]\n')
    study = load_study(tmp_path / "study.toml")
    results, counts = sweep(study, tmp_path / "out", top_k=1, workers=1)
    assert counts["recomputed_to_fit"] == 1
    top = results.row(0, named=True)
    assert top["recompute"] != "none" and top["fits"] and top["status"] == "replayed"
    assert top["step_time_s"] == pytest.approx(top["fast_step_time_s"], rel=0.01)
    parent = results.filter((pl.col("tp") == top["tp"]) & (pl.col("pp") == top["pp"])
                            & (pl.col("recompute") == "none"))
    assert parent["status"].to_list() == ["does not fit"]
    as_enumerated = results.filter(pl.col("fits") & (pl.col("recompute") == "none"))
    assert top["fast_step_time_s"] < as_enumerated["fast_step_time_s"].min()


def test_resilience_frame_takes_a_callers_estimate(tmp_path: Path) -> None:
    """Given the step (one system's estimate), the frame is the one it computes itself."""
    from analysis.fastpath import estimate

    study = load_study(_study(tmp_path, STRATEGIES + "[failures]\nrate_per_gpu_hour = 0.01\n"))
    s = study.strategies[0]
    given = resilience_frame(study, s, estimate(study.model, s, study.system))
    assert given.equals(resilience_frame(study, s))
