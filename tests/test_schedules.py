"""``trainsim estimate --schedules`` (``analysis.schedules``): one layout under every pipeline
schedule trainsim models, each the fast path's estimate of that strategy, fastest first, the
ones it cannot run named with the reason ``Strategy`` gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from analysis.fastpath import estimate
from analysis.schedules import schedule_alternatives
from replay import get_system
from tests.test_cli import run
from tracegen import ConfigError, Strategy, get_model


def test_each_row_is_the_fast_paths_estimate_of_its_strategy() -> None:
    """Llama 3 70B at tp 8, pp 4 on 256 H100s: every schedule that runs is listed once,
    fastest first, its numbers the fast path's for its strategy (the layout kept, the
    schedule's own fields changed); the strategy as given is marked; interleaving by 3 is
    refused with the layer count's reason (80 layers over 12 chunks)."""
    model, h100 = get_model("llama3-70b"), get_system("dgx-h100")
    s = Strategy(tp=8, pp=4, dp=8, sequence_parallel=True, micro_batch_size=1,
                 global_batch_size=64, zero_stage=1)
    alts = schedule_alternatives(model, s, h100)
    ran = [a for a in alts if not a.refused]
    assert [a.step_time_s for a in ran] == sorted(a.step_time_s for a in ran)
    assert {a.name for a in ran} == {"1f1b", "gpipe", "interleaved_1f1b vpp 2",
                                     "interleaved_1f1b vpp 4", "interleaved_zb vpp 2",
                                     "interleaved_zb vpp 4", "zb_h1", "zb_v", "dualpipe_v"}
    for a in ran:
        assert a.strategy is not None
        got = estimate(model, a.strategy, h100)
        assert (a.step_time_s, a.peak_memory_GiB, a.fits) == (
            got.step_time_s, got.peak_memory_GiB, got.fits)
        assert (a.strategy.tp, a.strategy.pp, a.strategy.dp) == (8, 4, 8)
    assert [a.name for a in ran if a.current] == ["1f1b"]
    refused = {a.name: a.refused for a in alts if a.refused}
    assert "not divisible by pp · vpp = 4 · 3 = 12" in refused["interleaved_1f1b vpp 3"]
    assert not any(a.refused for a in alts[:len(ran)])


def test_a_moe_layout_adds_the_merged_passes_and_a_dense_one_does_not() -> None:
    """Qwen3-30B-A3B with ep 8: each interleaved count and DualPipe-V also merged (combined
    1F1B, torchtitan's pairs); a dense model gets no merged row."""
    s = Strategy(pp=4, vpp=2, dp=16, ep=8, micro_batch_size=1, global_batch_size=512,
                 zero_stage=1, recompute="selective", schedule="dualpipe_v")
    names = {a.name for a in schedule_alternatives(get_model("qwen3-30b-a3b"), s,
                                                   get_system("dgx-h100")) if not a.refused}
    assert {"dualpipe_v merged", "interleaved_1f1b vpp 2 merged", "dualpipe_v"} <= names
    dense = Strategy(tp=8, pp=4, dp=8, sequence_parallel=True, micro_batch_size=1,
                     global_batch_size=64)
    assert not any("merged" in a.name for a in schedule_alternatives(
        get_model("llama3-70b"), dense, get_system("dgx-h100")))


def test_what_the_strategy_keeps_decides_what_is_refused() -> None:
    """TP overlap is kept: the zero-bubble schedules, which are not modelled with it, are
    refused with that reason rather than estimated without it."""
    s = Strategy(tp=8, pp=4, dp=8, sequence_parallel=True, tp_comm_overlap=True,
                 micro_batch_size=1, global_batch_size=64, zero_stage=1)
    refused = {a.name: a.refused for a in schedule_alternatives(
        get_model("llama3-70b"), s, get_system("dgx-h100")) if a.refused}
    assert {"zb_h1", "zb_v", "dualpipe_v"} <= set(refused)
    assert all("without tp_comm_overlap" in refused[x] for x in ("zb_h1", "zb_v", "dualpipe_v"))


def test_one_stage_has_no_schedule_to_choose() -> None:
    with pytest.raises(ConfigError, match="needs pp ≥ 2"):
        schedule_alternatives(get_model("llama3-8b"), Strategy(tp=8, micro_batch_size=1,
                                                               global_batch_size=8),
                              get_system("dgx-h100"))


def test_the_cli_prints_the_table_and_writes_it_to_json(tmp_path: Path) -> None:
    args = ("estimate", "--model", "llama3-70b", "--gpus", "256", "--tp", "8", "--sp",
            "--mbs", "1", "--gbs", "64", "--zero", "1", "--system", "dgx-h100", "--schedules")
    out = run(*args, "--pp", "4", "--json", str(tmp_path / "e.json"))
    assert out.returncode == 0, out.stderr
    assert "This layout under each pipeline schedule" in out.stdout and "1f1b ←" in out.stdout
    rows = json.loads((tmp_path / "e.json").read_text())["schedules"]
    assert [r["schedule"] for r in rows if r["current"]] == ["1f1b"]
    assert any(r["strategy"] and "-interleaved_zb-" in r["strategy"] for r in rows)
    assert any(r["refused"] for r in rows)
    bad = run(*args, "--pp", "1")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "needs --pp 2 or more" in bad.stderr and "step time" not in bad.stdout
    mixed = run(*args, "--pp", "4", "--stage-system", "0-1=dgx-a100-80gb")
    assert mixed.returncode != 0 and "drop --stage-system" in mixed.stderr
