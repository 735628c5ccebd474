"""Slow links over a run (``analysis.slow_links``): the step with one slow NIC against replay
with a ``[[link]]`` scenario on that stage, replay's degraded network (a two-level collective
slows only in its NIC phase), how the episodes enter each recovery policy's goodput beside
slow GPUs', and the study table's errors."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from analysis import fail_slow as F
from analysis import slow_links as L
from analysis.evaluate import resilience_rows
from analysis.fastpath import estimate
from analysis.study import load_study
from replay import get_system, replay
from replay.network import AlphaBetaNetwork
from replay.scenario import DegradedNetwork, LinkFault, tiers_slowed
from tracegen import ConfigError, ModelSpec, Strategy, generate

H100 = get_system("dgx-h100")
DENSE = ModelSpec(name="sl", num_layers=8, hidden_size=2048, num_attention_heads=16,
                  ffn_hidden_size=8192, vocab_size=32000, seq_len=2048, activation="swiglu")
MOE = ModelSpec(name="slm", num_layers=4, hidden_size=1024, num_attention_heads=8,
                ffn_hidden_size=4096, vocab_size=32000, seq_len=2048, activation="swiglu",
                num_experts=16, experts_per_token=2, moe_ffn_hidden_size=1024)
STUDY = Path(__file__).resolve().parents[1] / "analysis" / "studies" / "llama3-405b-failures.toml"
FACTOR = 0.25


@pytest.mark.parametrize(("model", "kw"), [
    (DENSE, dict(tp=8, pp=1, dp=4)), (DENSE, dict(tp=8, pp=2, dp=2)),
    (DENSE, dict(tp=4, pp=4, dp=2)),  # only the sends leave the node
    (DENSE, dict(tp=8, pp=4, dp=4, zero_stage=1)),
    (DENSE, dict(tp=8, pp=4, dp=2, vpp=2, schedule="interleaved_1f1b")),
    (DENSE, dict(tp=8, pp=4, dp=2, schedule="zb_h1")),
    (DENSE, dict(tp=2, cp=8, pp=2, dp=1)),  # the context ring crosses nodes
    (DENSE, dict(tp=8, pp=2, dp=4, zero_stage=3)),
    (MOE, dict(tp=1, pp=2, dp=16, ep=16))])  # all-to-all and expert gradients across nodes
def test_one_slow_nics_step_is_replays_with_a_link_scenario_on_its_stage(
        tmp_path: Path, model: ModelSpec, kw: dict) -> None:
    """Replay slows the NIC of the rank a representative stands for. Without link contention
    (the fast path's own reference, as in its 2% test) each stage within 1% (found within
    0.1%). With it, replay is higher where a slow NIC's longer transfers overlap and share
    it: each stage at most 5% below replay (found: interleaved 4.0%, the rest within 0.8%;
    the MoE model 6.8% on stage 0, whose dense and expert reductions share the NIC: 8%
    there; the same since replay shares links max-min fair: these transfers all bind on the
    slow NIC)."""
    s = Strategy(micro_batch_size=1, global_batch_size=8 * kw["dp"],
                 sequence_parallel=kw["tp"] > 1, **kw)
    generate(model, s, tmp_path, mode="representative")
    predicted = L.stage_factors(model, s, H100, FACTOR)
    reps = sorted(int(p.name.split(".")[1]) for p in tmp_path.glob("*.et"))
    assert len(reps) == s.pp == len(predicted)
    shared = 0.08 if model.is_moe else 0.05
    for contention in (False, True):
        healthy = replay(tmp_path, H100, contention=contention).step_time_s
        got = []
        for rep in reps:
            sc = tmp_path / "slow.toml"
            sc.write_text(f'[[link]]\nranks = [{rep}]\ntier = "nic"\n'
                          f"bandwidth_factor = {FACTOR}\n")
            got.append(replay(tmp_path, H100, scenario=sc, contention=contention
                              ).step_time_s / healthy)
        if contention:
            assert all(r * (1 - shared) <= p <= r * 1.01 for p, r in zip(predicted, got,
                                                                        strict=True)), got
        else:
            assert predicted == pytest.approx(got, rel=0.01)
    mean, worst = L.step_factors(model, s, H100, FACTOR)
    assert mean == pytest.approx(sum(predicted) / len(predicted))
    assert worst == max(predicted) and min(predicted) > 1.005


def test_a_slow_nic_slows_a_two_level_collective_in_its_nic_phase_only() -> None:
    """Replay's degraded network costs a collective that touches a slow link again on the
    system with that tier slowed: a send across nodes takes 1/factor as long, a two-level
    all-reduce (NVLink reduce-scatter, NIC all-reduce, NVLink all-gather) less than that,
    exactly what the model gives with every NIC at the factor (a ring moves at its slowest
    hop); collectives inside a node are untouched, and an NVLink fault slows them alike."""
    base = AlphaBetaNetwork(H100)
    slow_nic = AlphaBetaNetwork(tiers_slowed(H100, FACTOR, 1.0))
    deg = DegradedNetwork(base, (LinkFault(9, "nic", FACTOR, 0), LinkFault(19, "nvl", 0.5, 0)))
    ranks = tuple(range(16))  # two nodes of eight
    size = 1 << 28
    healthy, got = base.collective("ALL_REDUCE", size, ranks), deg.collective(
        "ALL_REDUCE", size, ranks)
    assert got.transfer_ns == slow_nic.collective("ALL_REDUCE", size, ranks).transfer_ns
    assert healthy.transfer_ns < got.transfer_ns < healthy.transfer_ns / FACTOR
    p2p, p2p_slow = base.p2p(1, 9, size), deg.p2p(1, 9, size)
    assert p2p_slow.transfer_ns == pytest.approx(p2p.transfer_ns / FACTOR, abs=2)
    inside = tuple(range(8, 16))  # node 1: NVLink only, its NIC idle
    assert deg.collective("ALL_GATHER", size, inside) == base.collective("ALL_GATHER", size,
                                                                         inside)
    node2 = tuple(range(16, 24))  # rank 19's NVLink at half: the whole ring at half
    assert deg.collective("ALL_GATHER", size, node2).transfer_ns == AlphaBetaNetwork(
        tiers_slowed(H100, 1.0, 0.5)).collective("ALL_GATHER", size, node2).transfer_ns


def _study(tmp_path: Path, tables: str) -> Path:
    f = tmp_path / "sl.toml"
    f.write_text(STUDY.read_text() + "\n" + tables)
    return f


SLOW = "[slow_links]\nrate_per_gpu_hour = 2e-5\nmean_duration_s = 1800\nbandwidth_factor = 0.25\n"
GPU = "[fail_slow]\nrate_per_gpu_hour = 2e-5\nmean_duration_s = 3600\nslowdown = 2.0\n"


def test_slow_nics_scale_every_policys_goodput_and_multiply_with_slow_gpus(
        tmp_path: Path) -> None:
    base = load_study(STUDY)
    (s,) = base.strategies
    fast = estimate(base.model, s, base.system)
    healthy = {r["policy"]: r for r in resilience_rows(base, s, fast)}
    rows = resilience_rows(load_study(_study(tmp_path, SLOW)), s, fast)
    mean, worst = L.step_factors(base.model, s, base.system, 0.25)
    keep = F.progress(F.FailSlow(2e-5, 1800, 4.0), s.world_size, mean)
    assert 1 - rows[0]["slow_links_loss"] == pytest.approx(keep)
    assert 1 < mean <= worst and keep < 1
    for r in rows:  # the failure process is untouched: the same interval, goodput × keep
        h = healthy[r["policy"]]
        assert r["checkpoint_interval_s"] == h["checkpoint_interval_s"]
        assert r["goodput"] == pytest.approx(h["goodput"] * keep, rel=1e-12)
    both = resilience_rows(load_study(_study(tmp_path, SLOW + GPU)), s, fast)
    gpu_keep = 1 - both[0]["fail_slow_loss"]
    assert both[0]["slow_links_loss"] == pytest.approx(rows[0]["slow_links_loss"])
    for r in both:
        assert r["goodput"] == pytest.approx(healthy[r["policy"]]["goodput"] * keep * gpu_keep,
                                             rel=1e-12)
    evicted = resilience_rows(load_study(_study(tmp_path, SLOW + "detect_s = 300\n")), s, fast)
    share = math.exp(-300 / 1800)
    assert evicted[0]["slow_links_evicted_share"] == pytest.approx(share)
    for r in evicted:  # evicted nodes are failures: a shorter MTTF, less slowed time
        assert r["job_mttf_s"] < healthy[r["policy"]]["job_mttf_s"]
        assert r["slow_links_loss"] < rows[0]["slow_links_loss"]


@pytest.mark.parametrize(("table", "message"), [
    ("rate_per_gpu_hour = 2e-5\nmean_duration_s = 60\nbandwidth_factor = 1.5\n",
     "above 1 it would be faster"),
    ("rate_per_gpu_hour = 2e-5\nmean_duration_s = 60\nbandwidth_factor = 1e-5\n",
     "from 0.001 to 1"),
    ("rate_per_gpu_hour = 2e-5\nmean_duration_s = 60\nslowdown = 2.0\n",
     r"unknown keys slowdown\n  - missing bandwidth_factor"),
    ("rate_per_gpu_hour = 2e-5\nmean_duration_s = -5\nbandwidth_factor = 0.5\n",
     "mean_duration_s must be a positive number"),
])
def test_a_bad_slow_links_table_is_named_when_the_study_is_read(tmp_path: Path, table: str,
                                                                message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_study(_study(tmp_path, "[slow_links]\n" + table))


def test_slow_links_need_the_failure_tables_their_evictions_are_costed_with(
        tmp_path: Path) -> None:
    f = tmp_path / "nofail.toml"
    f.write_text(STUDY.read_text().replace('[failures]\npreset = "llama3-16k-h100"\n', "")
                 + "\n" + SLOW)
    with pytest.raises(ConfigError, match=r"\[slow_links\] needs a \[failures\] table"):
        load_study(f)


def test_resilience_cli_and_report_say_what_the_slow_nics_cost(tmp_path: Path) -> None:
    f = _study(tmp_path, SLOW + "detect_s = 300\n" + GPU)
    summary = tmp_path / "s.json"
    r = subprocess.run([sys.executable, "-m", "analysis.cli", "resilience", str(f),
                        "--summary", str(summary)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLUMNS": "250"})
    assert r.returncode == 0, r.stderr
    policy = json.loads(summary.read_text())["policies"]["global_restart"]
    assert ("slow links: one NIC at 25% of its bandwidth stretches a step "
            f"{policy['slow_links_step_factor']:.2f}×") in r.stdout
    assert f"{math.exp(-300 / 1800):.0%} of episodes outlast 300 s" in r.stdout
    assert "fail-slow: one GPU 2× slower" in r.stdout  # both kinds, a line each
    assert policy["fail_slow_loss"] > 0 and policy["slow_links_loss"] > 0


def test_at_llama3_405b_scale_each_stage_is_replays(tmp_path: Path) -> None:
    """Meta's 405B strategy on 16,384 H100s (interleaved, vpp 8, dp 128, ZeRO-2 reducing each
    micro-batch's gradients, overlapped), replayed in representative mode: a quarter-bandwidth
    NIC slows the step 2.7–2.9× by stage (every reduce-scatter's ring runs at its pace, and the
    step is bound by them); within 1% a stage of contention-free replay (found within 0.01%;
    with link contention 1.1–1.3% above, the healthy step itself 2.5% longer for it; reducing
    once a step the NIC cost 3–9%, within 0.7% with contention)."""
    study = load_study(STUDY)
    (s,) = study.strategies
    generate(study.model, s, tmp_path, mode="representative")
    healthy = replay(tmp_path, study.system, contention=False).step_time_s
    predicted = L.stage_factors(study.model, s, study.system, FACTOR)
    reps = sorted(int(p.name.split(".")[1]) for p in tmp_path.glob("*.et"))
    for j in (0, s.pp // 2, s.pp - 1):
        sc = tmp_path / "slow.toml"
        sc.write_text(f'[[link]]\nranks = [{reps[j]}]\ntier = "nic"\n'
                      f"bandwidth_factor = {FACTOR}\n")
        got = replay(tmp_path, study.system, scenario=sc,
                     contention=False).step_time_s / healthy
        assert got > 1.02 and predicted[j] == pytest.approx(got, rel=0.01), (j, got)


def test_a_strategy_on_one_node_is_told_a_slow_nic_costs_it_nothing(tmp_path: Path) -> None:
    from tests.studies import write_study

    f = write_study(tmp_path)
    f.write_text(f.read_text() + "\n" + SLOW + "detect_s = 60\n")
    study = load_study(f)
    s = study.strategies[0]  # 8 GPUs: one node
    row = resilience_rows(study, s, estimate(study.model, s, study.system))[0]
    assert row["slow_links_step_factor"] == row["slow_links_worst_step_factor"] == 1.0
    assert row["slow_links_loss"] == 0
    assert L.describe(row) == ("slow links: none of this strategy's traffic crosses a NIC: a "
                               "slow one costs nothing, but "
                               f"{math.exp(-60 / 1800):.0%} of episodes outlast 60 s and are "
                               "evicted (counted among the failures)")
