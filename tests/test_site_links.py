"""Degraded links between sites over a run (``analysis.site_links``): the step during an
episode against replay on the degraded system, the closed forms of the goodput kept, what a
strategy's placement across the sites makes of an episode, and the study table's errors."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis import site_links as S
from analysis.evaluate import resilience_rows
from analysis.fastpath import estimate
from analysis.study import Study, load_study, study_from_dict
from replay import replay
from tracegen import ConfigError, generate

DATA = Path(__file__).parent / "data"
STUDY = DATA / "two-sites-study.toml"
TABLE = ("[site_links]\nrate_per_hour = 0.002\nmean_duration_s = 7200\n"
         "bandwidth_factor = 0.5\nlatency_us = 600\n")


def _without_table(study: Study) -> Study:
    return dataclasses.replace(study, site_links={})


def _study(tmp_path: Path, table: str) -> Path:
    """The example study with its [site_links] replaced by ``table``."""
    text = STUDY.read_text(encoding="utf-8").split("\n[site_links]")[0] + "\n" + table
    f = tmp_path / "study.toml"
    f.write_text(text.replace('system = "two-sites-h100.toml"',
                              f'system = "{DATA / "two-sites-h100.toml"}"'), encoding="utf-8")
    return f


@pytest.mark.parametrize("which", [0, 1], ids=["pp1-rings-across", "pp2-split-at-the-sites"])
def test_an_episodes_step_is_replays_on_the_degraded_system(tmp_path: Path, which: int) -> None:
    """Representative-mode replay (without link contention, the fast path's reference) of the
    healthy system and of the one an episode leaves: the step ratio is the fast path's within
    0.5% (found: equal to 1e-7)."""
    study = load_study(STUDY)
    s = study.strategies[which]
    ep = S.site_links_from(study.site_links)
    generate(study.model, s, tmp_path, mode="representative")
    healthy = replay(tmp_path, study.system, contention=False).step_time_s
    slowed = replay(tmp_path, S.degraded(study.system, ep), contention=False).step_time_s
    assert S.step_factor(study.model, s, study.system, ep) == pytest.approx(
        slowed / healthy, rel=0.005)


def test_where_the_groups_cross_the_sites_decides_the_cost() -> None:
    """The links between the sites are one pool split among the flows that cross at once
    (``network._out``). pp 1's data-parallel rings cross with a NIC flow each, which half the
    links still carry at the NICs' rate: only the longer path's latency (600 µs for 250)
    costs, 1.7%; pp 2 split at the sites sends every replica's activations across at once:
    8.5%. At a quarter of the bandwidth the pool binds both. Links as fast as before with the
    same latency cost nothing, nor does any episode to a job inside one site."""
    study = load_study(STUDY)
    ep = S.site_links_from(study.site_links)
    rings, split = (S.step_factor(study.model, s, study.system, ep) for s in study.strategies)
    assert 1.0 < rings < 1.03 and 1.05 < split < 1.15
    half = S.SiteLinkEpisodes(1.0, 3600.0, 0.5)
    assert S.step_factor(study.model, study.strategies[0], study.system, half) == 1.0
    quarter = S.SiteLinkEpisodes(1.0, 3600.0, 0.25)
    assert all(S.step_factor(study.model, s, study.system, quarter) > 1.15
               for s in study.strategies)
    same = S.SiteLinkEpisodes(1.0, 3600.0, 1.0)
    assert S.step_factor(study.model, study.strategies[0], study.system, same) == 1.0
    inside = study_from_dict({"model": "llama3-70b", "system": str(DATA / "two-sites-h100.toml"),
                              "gpus": 4096, "global_batch_size": 1024,
                              "strategies": [{"tp": 8, "micro_batch_size": 1}]}, name="one")
    assert S.step_factor(inside.model, inside.strategies[0], inside.system, ep) == 1.0


def test_the_goodput_kept_is_the_closed_form_for_every_policy() -> None:
    """p = 1 − exp(−λ·E[D]) of the time in an episode, the step f× longer meanwhile: every
    policy's goodput is the study's without the table times 1 − p(1 − 1/f), the failure
    process (and so the checkpoint interval) untouched."""
    study = load_study(STUDY)
    s = study.strategies[0]
    fast = estimate(study.model, s, study.system)
    rows = resilience_rows(study, s, fast)
    healthy = {r["policy"]: r for r in resilience_rows(_without_table(study), s, fast)}
    p = 1 - math.exp(-0.002 * 7200 / 3600)
    f = rows[0]["site_links_step_factor"]
    keep = 1 - p * (1 - 1 / f)
    assert rows[0]["site_links_active_share"] == pytest.approx(p, rel=1e-12)
    assert rows[0]["site_links_loss"] == pytest.approx(1 - keep, rel=1e-12)
    for r in rows:
        h = healthy[r["policy"]]
        assert r["checkpoint_interval_s"] == h["checkpoint_interval_s"]
        assert r["goodput"] == pytest.approx(h["goodput"] * keep, rel=1e-12)


@settings(max_examples=12, deadline=None)
@given(st.floats(0.01, 1.0), st.floats(0.01, 0.99))
def test_thinner_links_never_cost_less(a: float, b: float) -> None:
    """The step factor falls as the bandwidth left grows (rings across the sites)."""
    study = load_study(STUDY)
    s = study.strategies[0]
    lo, hi = sorted((a, a * b))
    f_lo, f_hi = (S.step_factor(study.model, s, study.system, S.SiteLinkEpisodes(1.0, 60.0, x))
                  for x in (lo, hi))
    assert f_lo >= f_hi >= 1.0


@pytest.mark.parametrize(("table", "message"), [
    ("rate_per_hour = 0.01\nmean_duration_s = 60\nbandwidth_factor = 1.5\n", "from 0.001 to 1"),
    ("rate_per_hour = 0.01\nmean_duration_s = 60\nslowdown = 2.0\n",
     r"unknown keys slowdown\n  - missing bandwidth_factor"),
    ("rate_per_hour = 0\nmean_duration_s = 60\nbandwidth_factor = 0.5\n",
     "rate_per_hour must be a positive number"),
    ("rate_per_hour = 0.01\nmean_duration_s = 60\nbandwidth_factor = 0.5\nlatency_us = -1\n",
     "latency_us must be a positive number"),
])
def test_a_bad_site_links_table_is_named_when_the_study_is_read(tmp_path: Path, table: str,
                                                                message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_study(_study(tmp_path, "[site_links]\n" + table))


def test_site_links_need_sites_and_failures(tmp_path: Path) -> None:
    one_site = _study(tmp_path, TABLE).read_text().replace(
        f'system = "{DATA / "two-sites-h100.toml"}"', 'system = "dgx-h100"')
    (tmp_path / "one.toml").write_text(one_site)
    with pytest.raises(ConfigError, match="needs a system of several sites: dgx-h100 has none"):
        load_study(tmp_path / "one.toml")
    (tmp_path / "nofail.toml").write_text(
        _study(tmp_path, TABLE).read_text().replace('[failures]\npreset = "llama3-16k-h100"\n',
                                                    ""))
    with pytest.raises(ConfigError, match=r"\[site_links\] needs a \[failures\] table"):
        load_study(tmp_path / "nofail.toml")


@pytest.mark.parametrize("stage", [1, 2], ids=["a100-stage-across-the-sites", "a100-site"])
def test_on_a_mixed_cluster_an_episodes_step_is_replays(tmp_path: Path, stage: int) -> None:
    """A100 stages on the base's sites (``hardware.on_sites_of``): pp 3 of 16 GPUs, 24 a site,
    so stage 1 straddles the two and stage 2 is the second site. The episode's step factor
    on the mixed cluster (``where``) is replay's with a ``[[gpu]]`` scenario on that stage,
    degraded over healthy, without link contention: within 0.5%; more than 1 either way."""
    from replay import get_system
    from tracegen import ModelSpec, Strategy

    h100 = get_system("dgx-h100")
    sites = dataclasses.replace(h100, name="two-sites", scaleout=dataclasses.replace(
        h100.scaleout, site_gpus=24, site_Gbps_per_gpu=100.0, site_latency_us=250.0))
    model = ModelSpec(name="mx", num_layers=9, hidden_size=2048, num_attention_heads=16,
                      ffn_hidden_size=8192, vocab_size=32000, seq_len=2048, activation="swiglu")
    s = Strategy(tp=2, pp=3, dp=8, micro_batch_size=1, global_batch_size=48,
                 sequence_parallel=True)
    ep = S.SiteLinkEpisodes(0.01, 3600.0, 0.25, 600.0)
    generate(model, s, tmp_path / "t", mode="representative")
    reps = sorted(int(p.name.split(".")[1]) for p in (tmp_path / "t").glob("*.et"))
    sc = tmp_path / "gpu.toml"
    sc.write_text(f'[[gpu]]\nranks = [{reps[stage]}]\nsystem = "dgx-a100-80gb"\n')
    healthy, slowed = (replay(tmp_path / "t", spec, scenario=sc, contention=False).step_time_s
                       for spec in (sites, S.degraded(sites, ep)))
    got = S.step_factor(model, s, sites, ep, {stage: get_system("dgx-a100-80gb")})
    assert got == pytest.approx(slowed / healthy, rel=0.005) and got > 1.01


def test_a_mixed_study_with_site_links_costs_its_placed_step(tmp_path: Path) -> None:
    """[site_links] beside [mixed] (refused until the fifty-sixth session): the A100s take
    one site's stage of pp 2; the goodput carries the episodes of the mixed step —
    its factor the fast path's on the placed strategy and stages — and the CLI says so."""
    from analysis.evaluate import resilience_frame
    from analysis.mixed import study_placement

    text = _study(tmp_path, TABLE).read_text()
    one = text.split("[[strategies]]")
    text = one[0] + "[[strategies]]" + one[2] + '\n[mixed]\nsystem = "dgx-a100-80gb"\ngpus = 4096\n'
    f = tmp_path / "mixed.toml"
    f.write_text(text)
    study = load_study(f)
    placed = study_placement(study, study.strategies[0])
    assert placed is not None and placed.stages in ((0,), (1,))  # a whole site
    frame = resilience_frame(study, study.strategies[0])
    ep = S.site_links_from(study.site_links)
    factor = S.step_factor(study.model, placed.strategy, study.system, ep, placed.where)
    assert frame["site_links_step_factor"][0] == pytest.approx(factor, rel=1e-12)
    assert 1.0 < factor < 1.1
    r = subprocess.run([sys.executable, "-m", "analysis.cli", "resilience", str(f)],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLUMNS": "250"})
    assert r.returncode == 0, r.stderr
    assert f"stretch a step {factor:.2f}×" in " ".join(r.stdout.split())


def test_resilience_cli_says_what_the_site_links_cost(tmp_path: Path) -> None:
    summary = tmp_path / "s.json"
    r = subprocess.run([sys.executable, "-m", "analysis.cli", "resilience", str(STUDY),
                        "--summary", str(summary)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLUMNS": "250"})
    assert r.returncode == 0, r.stderr
    policy = json.loads(summary.read_text())["policies"]["global_restart"]
    assert policy["site_links_loss"] > 0 and policy["site_links_latency_us"] == 600
    text = " ".join(r.stdout.split())
    assert ("site links at 0.5 of their bandwidth, 600 µs stretch a step "
            f"{policy['site_links_step_factor']:.2f}×") in text
    assert "2 sites of 4,096 GPUs" in text


def test_compare_ranks_with_the_episodes_in_and_the_report_says_them(tmp_path: Path) -> None:
    """compare's goodputs carry the episodes (the healthy steps do not), and the report
    says what they cost the best strategy — pp 1, its rings across the sites, here (their
    few crossing flows ride an episode out at their NICs' rate; the split's every send
    slows)."""
    from typer.testing import CliRunner

    from analysis.cli import app

    got = CliRunner().invoke(app, ["compare", str(STUDY), "-o", str(tmp_path / "c")])
    assert got.exit_code == 0, got.output
    frame = pl.read_parquet(tmp_path / "c" / "results.parquet")
    assert frame.height == 2 and frame["strategy"][0].startswith("tp8-pp1")
    rep = CliRunner().invoke(app, ["report", str(tmp_path / "c"), "-o", str(tmp_path / "r")])
    assert rep.exit_code == 0, rep.output
    html = (tmp_path / "r" / "report.html").read_text()
    assert 'id="site-links"' in html and "site links at 0.5 of their bandwidth" in html
