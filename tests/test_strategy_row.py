"""A result row carries its whole strategy: ``strategy_from_row`` rebuilds it, ``cli_flags`` are
the flags that make ``trainsim estimate`` cost the same strategy, ``strategy_toml`` the study
table that does; a sweep's folder and report say them for #1, and whether #1 stands against
what the sweep only screened (``sweep_verdict``)."""

from __future__ import annotations

import dataclasses
import json
import shlex
import tomllib
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from analysis.cli import app
from analysis.compare import strategy_fields
from analysis.fastpath import estimate
from analysis.report import build_report
from analysis.runner import strategy_id
from analysis.strategy_row import (
    FIELD_COLUMNS,
    FLAGS,
    cli_flags,
    strategy_from_row,
    strategy_toml,
)
from analysis.study import load_study, study_from_dict
from analysis.sweep import PartStore, enumerate_space
from analysis.sweep_verdict import verdict
from replay import get_system
from tests.studies import write_study
from tracegen import ConfigError, Strategy, resolve_model

H100 = get_system("dgx-h100")
DEFAULTS = {f.name: f.default for f in dataclasses.fields(Strategy)}

# One strategy per feature the flags set; together every flag off its default (checked below)
CASES = [
    ("llama3-8b", Strategy(tp=2, pp=4, dp=2, vpp=2, sequence_parallel=True, micro_batch_size=1,
                           global_batch_size=32, schedule="zb_v")),
    ("llama3-8b", Strategy(tp=2, pp=4, dp=2, sequence_parallel=True, micro_batch_size=1,
                           global_batch_size=32, schedule="zb_h1", zb_w_regather=True,
                           first_stage_layers=7, last_stage_layers=9)),
    ("llama3-70b", Strategy(tp=8, pp=4, dp=32, sequence_parallel=True, tp_comm_overlap=True,
                            micro_batch_size=2, global_batch_size=512, zero_stage=1,
                            cross_entropy_fusion="native")),
    ("deepseek-v3", Strategy(tp=2, pp=8, dp=64, ep=64, expert_tp=1, vpp=4,
                             schedule="interleaved_1f1b", sequence_parallel=True,
                             micro_batch_size=1, global_batch_size=8192, zero_stage=1,
                             precision="fp8", moe_dispatcher="deepep", recompute="selective",
                             recompute_modules="mla_up_proj,mlp", fp8_param_gather=True,
                             pipeline_layout="Et|(tt|)*30mL", fp8_recipe="tensorwise")),
    ("llama3-70b", Strategy(tp=1, pp=1, dp=1024, micro_batch_size=1, global_batch_size=1024,
                            zero_stage=3, recompute="full", zero3_prefetch=True,
                            dist_opt_instances=128, outer_dp_sharding_strategy="optim")),
    ("gpt3-175b", Strategy(tp=8, pp=12, dp=16, vpp=2, schedule="interleaved_1f1b",
                           micro_batch_size=1, global_batch_size=1568, microbatch_group_size=14)),
    ("llama3-8b", Strategy(tp=2, dp=32, sequence_parallel=True, micro_batch_size=1,
                           global_batch_size=512, zero_stage=2, grad_reduce_per_microbatch=True)),
    ("llama3.1-405b", Strategy(tp=8, pp=16, dp=128, vpp=8, schedule="interleaved_1f1b",
                               sequence_parallel=True, micro_batch_size=1, global_batch_size=2048,
                               zero_stage=1, overlap_param_gather=True, recompute="full",
                               recompute_num_layers=2,
                               account_for_embedding_in_pipeline_split=True,
                               account_for_loss_in_pipeline_split=True)),
    ("llama3-8b@seq32768", Strategy(tp=2, cp=4, dp=8, sequence_parallel=True, micro_batch_size=1,
                                    global_batch_size=64, zero_stage=1, cp_comm_type="all_gather",
                                    grad_reduce_in_bf16=True, adam_moments_dtype="bf16")),
    ("llama3-8b@seq32768@doc4000~1", Strategy(tp=2, cp=4, dp=8, sequence_parallel=True,
                                              micro_batch_size=1, global_batch_size=64,
                                              cp_balance="sequence")),
    ("deepseek-v3", Strategy(tp=2, pp=8, dp=64, ep=64, expert_tp=1, sequence_parallel=True,
                             micro_batch_size=1, global_batch_size=8192, zero_stage=1,
                             first_stage_layers=4, last_stage_layers=3,
                             moe_shared_expert_overlap=True)),
    ("qwen3-30b-a3b", Strategy(dp=64, ep=8, micro_batch_size=1, global_batch_size=1024,
                               zero_stage=1, overlap_moe_ep_comm=True)),
    ("qwen3-30b-a3b", Strategy(tp=2, pp=2, dp=4, ep=4, sequence_parallel=True,
                               micro_batch_size=1, global_batch_size=8, zero_stage=1,
                               optimizer_offload_fraction=0.25)),
    ("llama3-70b", Strategy(dp=64, micro_batch_size=2, global_batch_size=256, zero_stage=3,
                            zero3_prefetch=True, precision="fp8", cpu_offload_layers=40)),
    ("qwen3-235b-a22b", Strategy(tp=2, pp=8, vpp=4, dp=16, ep=32, expert_tp=1,
                                 schedule="interleaved_1f1b", sequence_parallel=True,
                                 micro_batch_size=1, global_batch_size=2048, zero_stage=1,
                                 precision="fp8", overlap_moe_ep_comm=True,
                                 delay_wgrad_compute=True,
                                 account_for_embedding_in_pipeline_split=True,
                                 account_for_loss_in_pipeline_split=True)),
]


def test_every_flag_is_exercised_by_a_case() -> None:
    off = {k for _, s in CASES for k in FLAGS if getattr(s, k) != DEFAULTS[k]}
    assert off == set(FLAGS)
    assert set(FLAGS) | {"dp", "overlap_grad_reduce", "dp_bucket_params",
                         "zero3_gather_bucket_params"} == set(FIELD_COLUMNS)


@pytest.mark.parametrize(("model", "s"), CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CASES)])
def test_flags_rebuild_the_strategy_through_the_cli(model: str, s: Strategy, tmp_path: Path
                                                    ) -> None:
    """``trainsim estimate`` given the flags costs exactly ``s``: every field, and its step."""
    out = tmp_path / "e.json"
    r = CliRunner().invoke(app, ["estimate", "--model", model, "--system", "dgx-h100",
                                 *shlex.split(cli_flags(s)), "--json", str(out)])
    assert r.exit_code == 0, r.stdout
    got = json.loads(out.read_text())
    assert got["strategy_fields"] == s.to_dict()
    assert got["step_time_s"] == pytest.approx(estimate(resolve_model(model), s, H100).step_time_s,
                                               rel=1e-12)


@pytest.mark.parametrize(("model", "s"), CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CASES)])
def test_row_and_toml_rebuild_the_strategy(model: str, s: Strategy) -> None:
    assert strategy_from_row(strategy_fields(s)) == s
    data = tomllib.loads(strategy_toml(s))
    study = study_from_dict({"model": model, "system": "dgx-h100", "gpus": s.world_size,
                             "global_batch_size": s.global_batch_size, **data})
    assert study.strategies == (s,)


def test_fields_without_a_flag_are_named_not_dropped() -> None:
    s = dataclasses.replace(CASES[0][1], dp_bucket_params=20_000_000, overlap_grad_reduce=False)
    flags, _, comment = cli_flags(s).partition("  # ")
    assert "dp_bucket_params = 20000000" in comment and "overlap_grad_reduce = false" in comment
    assert "bucket" not in flags
    assert tomllib.loads(strategy_toml(s))["strategies"][0]["dp_bucket_params"] == 20_000_000


def test_a_row_without_the_fields_is_refused_by_name() -> None:
    row = {k: v for k, v in strategy_fields(CASES[0][1]).items() if k != "recompute_num_layers"}
    with pytest.raises(ConfigError, match="recompute_num_layers"):
        strategy_from_row(row)


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, pl.DataFrame]:
    """A sweep of the tiny study whose best 3 are replayed, and its report."""
    root = tmp_path_factory.mktemp("swept")
    path = write_study(root / "study", strategies=False, failures=False, search=True)
    out = root / "out"
    r = CliRunner().invoke(app, ["sweep", str(path), "-o", str(out), "--top-k", "3",
                                 "--workers", "1"])
    assert r.exit_code == 0, r.stdout
    build_report(out, root / "report")
    return root, pl.read_parquet(out / "results.parquet")


def test_a_sweeps_rows_rebuild_the_strategies_it_enumerated(swept: tuple[Path, pl.DataFrame]
                                                            ) -> None:
    root, results = swept
    study = load_study(root / "study" / "study.toml")
    valid, _ = enumerate_space(study)
    by_id = {strategy_id(s): s for s in valid}
    rows = results.filter(pl.col("status") != "invalid").to_dicts()
    rebuilt = {r["id"]: strategy_from_row(r) for r in rows}
    assert all(by_id.get(i, s) == s for i, s in rebuilt.items())  # (fitted variants: new ids)
    assert sum(i in by_id for i in rebuilt) >= len(valid)
    assert all(strategy_id(s) == i for i, s in rebuilt.items())


def test_the_report_gives_1_as_a_command_and_a_study_table(swept: tuple[Path, pl.DataFrame]
                                                           ) -> None:
    """The report's command costs #1 (its fast-path step to the nanosecond), and its TOML
    table, added to the study, is #1."""
    root, results = swept
    first = results.filter(pl.col("fits")).row(0, named=True)
    md = (root / "report" / "report.md").read_text()
    command = md.split("```sh\n")[1].split("\n```")[0]
    words = shlex.split(command)
    assert words[:2] == ["trainsim", "estimate"]
    out = root / "first.json"
    r = CliRunner().invoke(app, [*words[1:], "--json", str(out)])
    assert r.exit_code == 0, r.stdout
    assert json.loads(out.read_text())["step_time_s"] == pytest.approx(
        first["fast_step_time_s"], rel=1e-12)
    table = tomllib.loads(md.split("```toml\n")[1].split("\n```")[0])
    study = load_study(root / "study" / "study.toml")
    assert study_from_dict({"model": study.model_ref, "system": "dgx-h100", "gpus": 8,
                            "global_batch_size": 32, **table}).strategies == (
        strategy_from_row(first),)
    html = (root / "report" / "report.html").read_text()
    assert 'id="best-command"' in html and 'id="best-toml"' in html


def test_the_verdict_on_a_real_sweep_holds_its_definition(swept: tuple[Path, pl.DataFrame]
                                                          ) -> None:
    root, results = swept
    v = verdict(results, "step_time")
    assert v is not None
    rep = results.filter(pl.col("status") == "replayed")
    gaps = (rep["step_time_s"] / rep["fast_step_time_s"] - 1).to_list()
    assert (v.gap_lo, v.gap_hi) == (min(gaps), max(gaps)) and v.replayed == rep.height
    best = rep.sort("step_time_s").row(0, named=True)
    others = results.filter(pl.col("fits") & (pl.col("status") != "replayed"))
    for r in others.iter_rows(named=True):  # contenders exactly those that could outrank #1
        assert (r["strategy"] in v.contenders) == (r["step_time_s"] * (1 + v.gap_lo)
                                                   < best["step_time_s"])
    assert v.sentence().startswith(f"#1 ({best['strategy']})")
    assert v.sentence().split(": ")[0] in (root / "report" / "report.md").read_text()


def _frame(rows: list[tuple[str, str, float, float]]) -> pl.DataFrame:
    return pl.DataFrame(
        [{"strategy": n, "status": st, "step_time_s": step, "fast_step_time_s": fast,
          "fits": True, "time_to_train_s": step * 1e5} for n, st, step, fast in rows])


def test_a_screened_strategy_within_replays_gap_is_named_with_the_top_k_that_replays_it() -> None:
    # replay moved the replayed +2…+6%: c's estimate 1.00 moved +2% is 1.02 < a's 1.03; d's
    # 1.02 moved so is 1.0404, not
    f = _frame([("a", "replayed", 1.03, 1.0098), ("b", "replayed", 1.10, 1.0377),
                ("c", "screened", 1.00, 1.00), ("d", "screened", 1.02, 1.02),
                ("e", "screened", 1.05, 1.05)])
    v = verdict(f, "step_time")
    assert v is not None and v.contenders == ("c",)
    assert v.top_k == 1  # c is the fast path's best (a's estimate 1.0098): --top-k 1 replays it
    assert "--top-k 1" in v.sentence() and "not settled" in v.sentence()
    f = f.with_columns(pl.when(pl.col("strategy") == "d").then(1.005).otherwise(
        pl.col("step_time_s")).alias("step_time_s"), pl.when(pl.col("strategy") == "d").then(
        1.005).otherwise(pl.col("fast_step_time_s")).alias("fast_step_time_s"))
    v = verdict(f, "step_time")  # now d too, 3rd on the fast path (c 1.00, d 1.005, a 1.0098)
    assert v is not None and v.contenders == ("c", "d") and v.top_k == 2


def test_one_that_stands_says_by_how_much_and_none_without_both_kinds() -> None:
    f = _frame([("a", "replayed", 1.02, 1.0), ("c", "screened", 1.01, 1.01)])
    v = verdict(f, "time_to_train")
    assert v is not None and not v.contenders and v.margin == pytest.approx(1.01 / 1.02 - 1)
    assert "stands" in v.sentence()
    assert verdict(f.filter(pl.col("status") == "replayed"), "step_time") is None
    assert verdict(f.filter(pl.col("status") == "screened"), "step_time") is None


def test_parts_an_earlier_trainsim_wrote_read_with_the_new_columns_null(tmp_path: Path) -> None:
    store = PartStore(tmp_path, "screen")
    old = pl.DataFrame({"id": ["x"], "strategy": ["tp1-pp1-dp8"], "step_time_s": [1.0]})
    old.write_parquet(store.dir / "part-000001-1.parquet")
    frame = store.read()
    assert frame.columns[:2] == ["id", "strategy"] and "flags" in frame.columns
    assert frame["flags"].to_list() == [None]
    with pytest.raises(ConfigError, match="earlier trainsim"):
        strategy_from_row(frame.row(0, named=True))


@pytest.mark.parametrize(("model", "s"), CASES)
def test_a_result_rows_name_says_each_switch_once(model: str, s: Strategy) -> None:
    """``compare.strategy_label`` extends ``Strategy.label`` with the switches the layout name
    leaves out; none says twice what the other said (the loss's fusion and FP8's recipe had)."""
    from analysis.compare import strategy_label

    parts = strategy_label(s).split("-")
    assert len(parts) == len(set(parts)), strategy_label(s)
