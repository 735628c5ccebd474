"""A fleet's spread of per-GPU speed (analysis/gpu_spread.py): the one-stage closed form, the
walk against replay with the same slow GPUs, where it enters a study and the CLI."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from analysis import gpu_spread as GS
from analysis.data_stragglers import expected_max_normal
from analysis.evaluate import resilience_frame
from analysis.fastpath import chunk_times_s
from analysis.study import study_from_dict
from replay import get_system, replay
from replay.scenario import scenario_from_dict
from tests.test_cli import run
from tracegen import ConfigError, ModelSpec, Strategy, generate, get_model

SYSTEM = get_system("dgx-h100")


def test_one_stage_waits_for_the_slowest_of_all_its_gpus() -> None:
    """Without a pipeline a replica runs at its slowest TP GPU and the step at the slowest
    replica's: the slowest of all N GPUs, T·sd·e(N) (T the step's compute on the critical
    path, the passes less their TP collectives; e: the expected largest of N standard
    normals), within the draws' error."""
    m = get_model("llama3-70b")
    s = Strategy(tp=8, dp=16, sequence_parallel=True, global_batch_size=128, recompute="full")
    w = GS.spread_wait(m, s, SYSTEM, 0.02)
    times = chunk_times_s(m, s, SYSTEM)
    compute = s.num_microbatches * sum(
        f * uf + b * ub for f, b, uf, ub in zip(times.fwd, times.bwd, times.busy_f, times.busy_b,
                                                 strict=True)) + times.opt[0]
    assert compute < (sum(times.fwd) + sum(times.bwd)) * s.num_microbatches  # (collectives)
    assert w.wait_s == pytest.approx(compute * 0.02 * expected_max_normal(128), rel=0.03)
    assert 0 < w.replica_s < w.wait_s  # (a replica's own slowest of 8, then of 16 replicas)


def test_the_wait_grows_with_the_spread_and_the_replicas() -> None:
    m = get_model("llama3-8b")
    s = Strategy(tp=2, pp=4, dp=4, sequence_parallel=True, global_batch_size=64)
    waits = [GS.spread_wait(m, s, SYSTEM, sd).wait_s for sd in (0.0, 0.01, 0.02, 0.04)]
    assert waits[0] == 0 and all(a < b for a, b in itertools.pairwise(waits))
    wide = GS.spread_wait(m, dataclasses.replace(s, dp=32, global_batch_size=512), SYSTEM, 0.02)
    assert wide.wait_s > waits[2]


@pytest.mark.parametrize(("schedule", "pp", "vpp", "tp"), [
    ("1f1b", 4, 1, 1), ("interleaved_1f1b", 2, 2, 1), ("zb_h1", 4, 1, 1), ("zb_v", 2, 2, 1),
    ("1f1b", 2, 1, 2), ("interleaved_1f1b", 2, 2, 2), ("zb_h1", 2, 1, 2)])
def test_the_walk_follows_replay_of_the_same_slow_gpus(tmp_path: Path, schedule: str, pp: int,
                                                       vpp: int, tp: int) -> None:
    """A full-mode set whose stages' first GPUs are slowed 1.3 / 1.0 / 1.15 / 1.05× (replay's
    stragglers over the whole step): the walk with those stage factors — each stage's
    optimizer step slowed after its last pass, its TP collectives not — gives the step's
    growth to 1e-4 without tensor parallelism (1-2% short before the optimizer was walked)
    and within 3% above with it, where the partner waits at each collective (21% above when
    the collectives were slowed with the compute)."""
    m = ModelSpec(name="long", num_layers=8, hidden_size=1024, num_attention_heads=16,
                  num_kv_heads=8, ffn_hidden_size=2048, vocab_size=4096, seq_len=8192,
                  activation="swiglu", dropout=0.0)
    s = Strategy(tp=tp, pp=pp, vpp=vpp, schedule=schedule,  # type: ignore[arg-type]
                 sequence_parallel=tp > 1, global_batch_size=8)
    generate(m, s, tmp_path, mode="full")
    slow = [1.3, 1.0, 1.15, 1.05][:pp]
    scenario = scenario_from_dict(
        {"straggler": [{"ranks": [st * tp], "slowdown": f} for st, f in enumerate(slow) if f > 1]},
        name="slow", world_size=pp * tp, gpus_per_node=8, simulated=set(range(pp * tp)))
    healthy = replay(tmp_path, SYSTEM, contention=False).step_time_s
    slowed = replay(tmp_path, SYSTEM, contention=False, scenario=scenario).step_time_s
    steps, alike = GS.replica_steps_s(m, s, SYSTEM, np.array([slow]))
    walked = float(steps[0]) - alike
    assert walked > 0
    if tp == 1:
        assert walked == pytest.approx(slowed - healthy, rel=1e-4)
    else:
        assert slowed - healthy <= walked <= 1.03 * (slowed - healthy)


def _study(extra: str = "") -> dict[str, object]:
    return {"model": "llama3-8b", "system": "dgx-h100", "gpus": 64, "global_batch_size": 128,
            "tokens": 1e11, "strategies": [{"tp": 2, "pp": 2, "sequence_parallel": True}],
            "failures": {"preset": "llama3-16k-h100"}, **json.loads(extra or "{}")}


def test_a_study_pays_the_wait_in_every_policy_s_goodput() -> None:
    """Each policy's goodput with [gpu_spread] is the one without times step/(step + wait)."""
    plain = study_from_dict(_study())
    spread = study_from_dict(_study('{"gpu_spread": {"sd": 0.03}}'))
    a, b = resilience_frame(plain, plain.strategies[0]), resilience_frame(spread,
                                                                        spread.strategies[0])
    w = b["gpu_spread_wait_s"][0]
    step = a["step_time_s"][0]
    assert w > 0
    for g0, g1 in zip(a["goodput"], b["goodput"], strict=True):
        assert g1 == pytest.approx(g0 * step / (step + w), rel=1e-9)
    assert "apart in speed" in GS.describe(b.row(0, named=True))


@pytest.mark.parametrize(("table", "said"), [
    ('{"gpu_spread": {"sd": 0.9}}', "from 0 to 0.5"),
    ('{"gpu_spread": {"sd": "2%"}}', "from 0 to 0.5"),
    ('{"gpu_spread": {"sigma": 0.02}}', "takes sd"),
])
def test_bad_gpu_spread_tables_are_refused(table: str, said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        study_from_dict(_study(table))
    without = _study(table)
    del without["failures"]
    with pytest.raises(ConfigError):
        study_from_dict(without)


def test_estimate_prints_and_writes_the_wait(tmp_path: Path) -> None:
    out = tmp_path / "e.json"
    r = run("estimate", "--model", "llama3-8b", "--gpus", "64", "--tp", "2", "--pp", "2", "--sp",
            "--mbs", "1", "--gbs", "128", "--system", "dgx-h100", "--gpu-spread", "0.02",
            "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "2.0% apart in speed" in " ".join(r.stdout.split())
    got = json.loads(out.read_text())["gpu_spread"]
    assert got["sd"] == 0.02 and got["gpus"] == 64 and got["wait_s"] > 0
    bad = run("estimate", "--model", "llama3-8b", "--gpus", "8", "--mbs", "1", "--gbs", "8",
              "--system", "dgx-h100", "--gpu-spread", "-0.1")
    assert bad.returncode == 2 and "from 0 to 0.5" in bad.stderr and "Traceback" not in bad.stderr
