"""Validation against the public set: every row accounted for, and fidelity held to what this
version achieves (so it cannot silently regress)."""

from __future__ import annotations

import csv
import dataclasses
import io
import math
import re
from pathlib import Path

import polars as pl
import pytest

from analysis import replay_size
from analysis import validate as V
from analysis.plots import predicted_vs_measured
from analysis.validate import (
    BAD,
    REQUIRED_COLUMNS,
    load_runs,
    pairs,
    summarize,
    summarize_pairs,
    validate,
)
from replay.traceset import load_trace_set
from tracegen import ConfigError, Strategy, generate, get_model
from tracegen.program import RoleProgram
from tracegen.units import GiB

PUBLIC = Path(__file__).resolve().parents[2] / "shared" / "validation" / "public_runs.csv"
# Fidelity reached by this version on the rows with complete inputs (closing note of issue #4).
# Tighten as the models improve; never loosen to make a change pass.
ACHIEVED = {"rows": 14, "median": 10.8, "p90": 53.8, "max": 60.3}
# ... and of the ratio of step times between runs of one model from one source (11 pairs)
ACHIEVED_PAIRS = {"pairs": 11, "median": 15.0, "ordered_right_pct": 81.0}


@pytest.fixture(scope="module")
def results() -> pl.DataFrame:
    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    return validate(PUBLIC)


def test_every_row_is_reported_once(results: pl.DataFrame) -> None:
    runs = pl.read_csv(PUBLIC)
    assert results["id"].to_list() == runs["id"].to_list()
    statuses = results["status"].to_list()
    assert all(s == "ok" or s.startswith("skipped: ") for s in statuses)
    skipped = results.filter(pl.col("status") != "ok")
    assert all("missing" in s or "no system preset" in s for s in skipped["status"])


def test_rows_with_inputs_have_finite_predictions(results: pl.DataFrame) -> None:
    ok = results.filter(pl.col("status") == "ok")
    for r in ok.iter_rows(named=True):
        assert math.isfinite(r["predicted_iter_time_s"]) and r["predicted_iter_time_s"] > 0
        assert r["error_pct"] == pytest.approx(
            100 * (r["predicted_iter_time_s"] / r["measured_iter_time_s"] - 1))
        assert r["predicted_peak_memory_GiB"] > 0 and r["fits"] is not None


def test_fidelity_does_not_regress(results: pl.DataFrame) -> None:
    s = summarize(results).filter(pl.col("group") == "all").row(0, named=True)
    assert s["rows"] == ACHIEVED["rows"]
    assert s["median_abs_error_pct"] <= ACHIEVED["median"]
    assert s["p90_abs_error_pct"] <= ACHIEVED["p90"]
    assert s["max_abs_error_pct"] <= ACHIEVED["max"]


def test_pair_ratios_do_not_regress(results: pl.DataFrame) -> None:
    """Relative accuracy on the public set: MosaicML's pairs (one model on other GPUs or
    counts) within 10.6% and all ordered right; DeepSpeed ZeRO-3's flat scaling is not (the
    median pair is one of its: 13.5% before the sustained clock, 14.7% with it)."""
    got = pairs(results)
    assert got.height == ACHIEVED_PAIRS["pairs"]
    summary = {r["group"]: r for r in summarize_pairs(got).iter_rows(named=True)}
    assert summary["all"]["median_abs_ratio_error_pct"] <= ACHIEVED_PAIRS["median"]
    assert summary["all"]["ordered_right_pct"] >= ACHIEVED_PAIRS["ordered_right_pct"]
    assert summary["source=mpt"]["ordered_right_pct"] == 100.0
    assert summary["source=mpt"]["max_abs_ratio_error_pct"] <= 10.6


def test_a_pair_ratio_error_follows_from_its_two_errors(results: pl.DataFrame) -> None:
    """(1 + e_a) / (1 + e_b) − 1: the pair table and the row table agree."""
    err = dict(zip(results["id"], results["error_pct"], strict=True))
    for r in pairs(results).iter_rows(named=True):
        expected = 100 * ((1 + err[r["a"]] / 100) / (1 + err[r["b"]] / 100) - 1)
        assert r["ratio_error_pct"] == pytest.approx(expected, rel=1e-9, abs=1e-9)
        assert r["a"] < r["b"]


def test_plot_has_points_and_band(results: pl.DataFrame, tmp_path: Path) -> None:
    fig = predicted_vs_measured(results)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert sum(len(c.get_offsets()) for c in ax.collections[1:]) == ACHIEVED["rows"]
    # the rows off by more than 20% (the target's maximum) carry their ids, and only they
    ok = results.filter(pl.col("status") == "ok")
    far = set(ok.filter(pl.col("error_pct").abs() > 20)["id"])
    assert far and {text.get_text() for text in ax.texts} == far
    fig.savefig(tmp_path / "v.png")
    assert (tmp_path / "v.png").read_bytes()[:4] == b"\x89PNG"


def test_missing_columns_are_named(tmp_path: Path) -> None:
    f = tmp_path / "r.csv"
    f.write_text("id,gpu\nx,h100-sxm\n")
    with pytest.raises(ConfigError) as info:
        validate(f)
    assert "lacks the columns" in str(info.value) and "num_layers" in str(info.value)
    assert len(REQUIRED_COLUMNS) > 20


def test_a_few_absent_columns_skip_only_the_rows_that_need_them(tmp_path: Path) -> None:
    """A file without the MoE columns (all its rows dense) and without micro_batch_size loads:
    rows are skipped naming the absent input, none is dropped, and the MoE columns are not
    needed by dense rows."""
    runs = load_runs(PUBLIC)
    f = tmp_path / "r.csv"
    runs.drop("num_experts", "experts_per_token", "moe_ffn_hidden_size", "micro_batch_size",
              BAD).write_csv(f)
    out = validate(f, fast=True)
    assert out.height == runs.height
    ok = out.filter(pl.col("status") == "ok")
    assert ok.height == 0
    usable = out.filter(pl.col("status").str.contains("micro_batch_size missing"))
    assert usable.height >= ACHIEVED["rows"]
    assert not out["status"].str.contains("num_experts").any()


def test_validate_cli_writes_csv_and_plot(tmp_path: Path) -> None:
    import subprocess
    import sys

    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    out, plot = tmp_path / "v.csv", tmp_path / "v.png"
    r = subprocess.run([sys.executable, "-m", "analysis.cli", "validate", str(PUBLIC), "--out",
                        str(out), "--plot", str(plot)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    frame = pl.read_csv(out)
    for col in ("id", "status", "predicted_iter_time_s", "measured_iter_time_s", "error_pct",
                "predicted_peak_memory_GiB", "fits"):
        assert col in frame.columns
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert "|error| summary" in r.stdout and "relative accuracy" in r.stdout
    r = subprocess.run([sys.executable, "-m", "analysis.cli", "validate", str(PUBLIC), "--fast",
                        "--out", str(tmp_path / "f.csv")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert pl.read_csv(tmp_path / "f.csv")["status"].to_list() == frame["status"].to_list()
    r = subprocess.run([sys.executable, "-m", "analysis.cli", "validate", str(PUBLIC), "--fast",
                        "--out", str(tmp_path / "f.parquet")], capture_output=True, text=True,
                       timeout=300)  # a Parquet file where the name says so (it had been CSV)
    assert r.returncode == 0, r.stderr
    assert pl.read_parquet(tmp_path / "f.parquet")["status"].to_list() == frame["status"].to_list()
    skipped = tmp_path / "skipped.csv"  # rows that all lack an input: said in one line
    pl.read_csv(PUBLIC, infer_schema_length=0).filter(
        pl.col("id").str.starts_with("nar21-t1")).write_csv(skipped)
    r = subprocess.run([sys.executable, "-m", "analysis.cli", "validate", str(skipped), "--fast"],
                       capture_output=True, text=True, timeout=300, env={"COLUMNS": "300"})
    assert r.returncode == 0, r.stderr
    assert "none of the 10 rows could be predicted" in r.stdout and "|error|" not in r.stdout


def _two_rows(tmp_path: Path) -> Path:
    """A copy of two public rows: one with an impossible tp, one fine."""
    runs = pl.read_csv(PUBLIC, infer_schema_length=0).filter(pl.col("id") == "mpt-07")
    bad = runs.with_columns(pl.lit("bad-tp").alias("id"), pl.lit("3").alias("tp"),
                            pl.lit("24").alias("num_gpus"))
    f = tmp_path / "two.csv"
    pl.concat([bad, runs]).write_csv(f)
    return f


def test_a_bad_row_is_skipped_on_one_line_and_the_rest_run(tmp_path: Path) -> None:
    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    out = validate(_two_rows(tmp_path))
    status = dict(zip(out["id"], out["status"], strict=True))
    assert status["bad-tp"].startswith("skipped:") and "\n" not in status["bad-tp"]
    assert "not divisible by tp 3" in status["bad-tp"]
    assert status["mpt-07"] == "ok"


def test_an_unexpected_failure_skips_only_its_row(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug met on one row is reported on that row; the batch still finishes."""
    import analysis.validate as V

    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    real = V.predict

    def flaky(inputs: V.RunInputs) -> dict:
        if inputs.model.name == "mpt-07":
            raise ZeroDivisionError("boom")
        return real(inputs)

    monkeypatch.setattr(V, "predict", flaky)
    runs = pl.read_csv(PUBLIC, infer_schema_length=0).filter(
        pl.col("id").is_in(["mpt-07", "mpt-08"]))
    f = tmp_path / "r.csv"
    runs.write_csv(f)
    out = validate(f)
    status = dict(zip(out["id"], out["status"], strict=True))
    assert status["mpt-07"].startswith("skipped: unexpected ZeroDivisionError: boom")
    assert status["mpt-08"] == "ok"


def test_breakdown_adds_up_to_the_prediction(results: pl.DataFrame) -> None:
    """compute + exposed communication + idle of the last rank = the predicted step."""
    ok = results.filter(pl.col("status") == "ok")
    total = ok["predicted_compute_s"] + ok["predicted_exposed_comm_s"] + ok["predicted_idle_s"]
    assert ((total - ok["predicted_iter_time_s"]).abs() <= 1e-6 * ok["predicted_iter_time_s"]
            ).all()
    assert (ok["predicted_compute_s"] > 0).all()


def _row_file(tmp_path: Path, run_id: str, **cells: str) -> Path:
    """A runs file of one public row with some cells replaced."""
    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    runs = pl.read_csv(PUBLIC, infer_schema_length=0).filter(pl.col("id") == run_id)
    f = tmp_path / f"{run_id}.csv"
    runs.with_columns(*(pl.lit(v).alias(k) for k, v in cells.items())).write_csv(f)
    return f


def test_inconsistent_gpu_count_is_skipped(tmp_path: Path) -> None:
    status = validate(_row_file(tmp_path, "mpt-07", num_gpus="16"))["status"].item()
    assert status == "skipped: num_gpus 16 ≠ tp·pp·dp·cp = 1·1·8·1 = 8"


def test_a_count_below_one_is_named_as_such(tmp_path: Path) -> None:
    """-8 GPUs is not a product mismatch to reconcile but a count that cannot be."""
    status = validate(_row_file(tmp_path, "mpt-07", num_gpus="-8", tp="0"))["status"].item()
    assert status == "skipped: num_gpus -8, tp 0: GPU counts and parallel degrees must be ≥ 1"


def test_every_reason_a_rows_cells_show_is_named_at_once(tmp_path: Path) -> None:
    """A row with four problems says all four: fixing one per run of validate was the cost."""
    f = _row_file(tmp_path, "mpt-07", num_gpus="16", gpu="H100", measured_iter_time_s="",
                  measured_tokens_per_s_per_gpu="", vocab_size="")
    status = validate(f, fast=True)["status"].item()
    assert status.startswith("skipped: measured_iter_time_s missing (and no measured_tokens_"
                             "per_s_per_gpu to derive it from); vocab_size missing; "
                             "gpu 'h100' has no system preset; "), status
    assert status.endswith("; num_gpus 16 ≠ tp·pp·dp·cp = 1·1·8·1 = 8"), status


def test_every_published_run_fits_its_gpu(results: pl.DataFrame) -> None:
    """The published runs ran, so the memory model must not call any of them infeasible."""
    ok = results.filter(pl.col("status") == "ok")
    assert ok["fits"].all(), ok.filter(~pl.col("fits"))["id"].to_list()


def test_malformed_cells_skip_their_row_only(tmp_path: Path) -> None:
    """A cell that does not parse (text for a number, a fractional GPU count, a zero time) skips
    its row with the cell named; the other rows still run."""
    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    base = pl.read_csv(PUBLIC, infer_schema_length=0).filter(pl.col("id") == "mpt-07")
    rows = [base.with_columns(pl.lit(i).alias("id"), *(pl.lit(v).alias(c) for c, v in kw.items()))
            for i, kw in [("na", {"tp": "N/A"}), ("half", {"num_gpus": "8.5"}),
                          ("zero", {"measured_iter_time_s": "0"}), ("huge", {"tp": "1e30"}),
                          ("inf", {"micro_batch_size": "inf"}),
                          ("infnet", {"scaleout_gbps_per_gpu": "inf"}),
                          ("nantime", {"measured_iter_time_s": "nan"}),
                          ("slow", {"scaleout_gbps_per_gpu": "1e-300"}), ("ok", {})]]
    f = tmp_path / "r.csv"
    pl.concat(rows).write_csv(f)
    status = dict(zip(*validate(f).select("id", "status").to_dict().values(), strict=True))
    assert status["na"] == "skipped: unreadable tp 'N/A'"
    assert status["half"] == "skipped: unreadable num_gpus '8.5'"
    # whole numbers no count comes near (a 64-bit overflow inside polars, before)
    assert status["huge"] == "skipped: unreadable tp '1e30'"
    assert status["inf"] == "skipped: unreadable micro_batch_size 'inf'"
    assert status["infnet"] == "skipped: unreadable scaleout_gbps_per_gpu 'inf'"
    assert status["nantime"] == "skipped: unreadable measured_iter_time_s 'nan'"
    assert status["slow"].startswith("skipped: scaleout_gbps_per_gpu 1e-300 is slower than")
    assert status["zero"] == "skipped: measured_iter_time_s must be > 0, got 0.0"
    assert status["ok"] == "ok"


def test_a_row_with_an_unquoted_comma_skips_only_its_row(tmp_path: Path) -> None:
    """A row with more cells than the header (a note with an unquoted comma: every cell after
    it shifted) is skipped with its line and cell count; its id still names it, and the rows
    around it, one with a quoted comma, run. (Before, polars refused the whole file.)"""
    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    header, *rows = list(csv.reader(io.StringIO(PUBLIC.read_text())))
    row = next(r for r in rows if r[0] == "mpt-07")
    name = header.index("model_name")

    def line(cells: list[str]) -> str:
        out = io.StringIO()
        csv.writer(out).writerow(cells)
        return out.getvalue()

    quoted = line(["quoted", *row[1:name], "MPT, 7B", *row[name + 1:]])  # the writer quotes it
    unquoted = line(["comma", *row[1:name], "@", *row[name + 1:]]).replace("@", "MPT, 7B")
    f = tmp_path / "r.csv"
    f.write_text(line(header) + line(row) + unquoted + quoted)
    out = validate(f, fast=True)
    status = dict(zip(out["id"], out["status"], strict=True))
    width = len(header)
    assert status["comma"] == (f"skipped: unreadable row (line 3: {width + 1} cells where the "
                               f"header has {width}; quote a cell that holds a comma)")
    assert status["mpt-07"] == status["quoted"] == "ok"
    assert out.height == 3


@pytest.mark.parametrize("ragged", [False, True])
def test_a_header_naming_a_column_twice_is_refused(tmp_path: Path, ragged: bool) -> None:
    """A column named twice (an extension column appended to a file that had it already) is
    refused with its name and positions, whether or not a row is ragged too: the reader had
    kept the first and renamed the second, which was then ignored whatever it said."""
    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    header, *rows = list(csv.reader(io.StringIO(PUBLIC.read_text())))
    row = next(r for r in rows if r[0] == "mpt-07")
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow([*header, "precision"])
    w.writerow([*row, "fp8"])
    if ragged:
        w.writerow([*row, "fp8", "one cell too many"])
    f = tmp_path / "r.csv"
    f.write_text(out.getvalue())
    where = f"columns {header.index('precision') + 1}, {len(header) + 1}"
    with pytest.raises(ConfigError, match=rf"names a column more than once in its header: "
                                          rf"'precision' \({where}\); keep one"):
        validate(f, fast=True)

def test_a_row_too_large_to_replay_is_predicted_by_the_fast_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A row whose replay trace would pass the node limit (a typo'd batch: minutes to hours of
    trace building) gets the fast path's prediction, and its assumptions say so and why."""
    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    rows = pl.read_csv(PUBLIC, infer_schema_length=0).filter(pl.col("id").is_in(["mpt-07",
                                                                                "mpt-08"]))
    f = tmp_path / "r.csv"
    rows.write_csv(f)
    size = {}
    for r in load_runs(f).iter_rows(named=True):
        inputs = V.row_inputs(r)
        assert isinstance(inputs, V.RunInputs)
        size[r["id"]] = RoleProgram(inputs.model, inputs.strategy, 0).step_op_count()
    small, big = sorted(size, key=size.__getitem__)
    assert size[small] < size[big]
    monkeypatch.setattr(replay_size, "MAX_REPLAY_NODES", (size[small] + size[big]) // 2)
    got = {r["id"]: r for r in validate(f).iter_rows(named=True)}
    fast = {r["id"]: r for r in validate(f, fast=True).iter_rows(named=True)}
    assert "replay trace would hold" in got[big]["assumptions"]
    assert got[big]["predicted_iter_time_s"] == fast[big]["predicted_iter_time_s"]
    assert "fast path" not in (got[small]["assumptions"] or "")


@pytest.mark.parametrize("kw", [
    dict(tp=2, pp=4, dp=2, global_batch_size=32, recompute="full"),
    dict(pp=2, dp=4, vpp=2, schedule="interleaved_1f1b", global_batch_size=32, zero_stage=1),
    dict(tp=2, dp=8, global_batch_size=64, zero_stage=3),
    dict(tp=2, dp=8, global_batch_size=64, zero_stage=2, grad_reduce_per_microbatch=True),
    dict(tp=8, pp=8, global_batch_size=64, sequence_parallel=True, recompute="selective")])
def test_step_op_count_sizes_a_trace_set_before_it_is_built(tmp_path: Path, kw: dict) -> None:
    """``RoleProgram.step_op_count`` (what the replay size limit reads) is within 15% of the
    nodes the representative trace set holds (sends, buckets and gathers are the rest)."""
    model, s = get_model("llama3-8b"), Strategy(micro_batch_size=1, **kw)
    generate(model, s, tmp_path, mode="representative")
    held = load_trace_set(tmp_path, fold=False).num_nodes
    assert RoleProgram(model, s, 0).step_op_count() == pytest.approx(held, rel=0.15)


def test_a_byte_order_mark_does_not_hide_the_id_column(tmp_path: Path) -> None:
    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    f = tmp_path / "bom.csv"
    text = "\n".join(PUBLIC.read_text(encoding="utf-8").splitlines()[:2])
    f.write_bytes("\ufeff".encode() + text.encode())
    assert validate(f)["id"].to_list() == [text.splitlines()[1].split(",")[0]]


def test_runs_written_back_from_load_runs_read_again(tmp_path: Path) -> None:
    """A file saved from ``load_runs``'s frame (it has the ``_unreadable`` column) is a runs
    file like any other: that column is recomputed, not a clash deep inside polars."""
    from analysis.validate import BAD, load_runs

    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    first = load_runs(PUBLIC)
    f = tmp_path / "again.csv"
    first.with_columns(pl.when(pl.col("id") == first["id"][0]).then(pl.lit("stale"))
                       .otherwise(pl.col(BAD)).alias(BAD)).write_csv(f)
    again = load_runs(f)
    assert again["id"].to_list() == first["id"].to_list()
    assert again[BAD].to_list() == first[BAD].to_list()  # "stale" recomputed away


def _row(tmp_path: Path, run_id: str, **cells: str) -> dict:
    """One public row with some cells replaced, read back as validate reads it."""
    from analysis.validate import load_runs

    return load_runs(_row_file(tmp_path, run_id, **cells)).row(0, named=True)


def test_vocabulary_is_padded_as_megatron_pads_it(tmp_path: Path) -> None:
    """GPT-2's 50,257 tokens on tp 2: Megatron pads to a multiple of 128·tp = 256 → 50,432."""
    from analysis.validate import RunInputs, row_inputs

    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    inputs = row_inputs(_row(tmp_path, "mpt-07", vocab_size="50257", tp="2", dp="4"))
    assert isinstance(inputs, RunInputs), inputs
    assert inputs.model.vocab_size == 50432 and inputs.strategy.tp == 2
    assert "padded to 50432" in inputs.assumptions
    same = row_inputs(_row(tmp_path, "mpt-07"))  # 50,368 splits over tp 1: left as published
    assert isinstance(same, RunInputs) and same.model.vocab_size == 50368


@pytest.mark.parametrize(("layers", "pp", "vpp", "dp", "sizes"), [
    ("126", "16", "1", "4", [7] + [8] * 14 + [7]),  # Llama 3 405B (Dubey et al. 2024, §3.3.2)
    ("80", "3", "1", "21", [27, 27, 26]),
    ("126", "8", "8", "8", [1] + [2] * 62 + [1]),  # interleaved, embedding and loss as layers
    ("126", "16", "8", "8", [0] + [1] * 126 + [0]),  # Llama 3's own: embedding, loss alone
])
def test_layers_pp_does_not_divide_go_to_shorter_end_chunks(
        tmp_path: Path, layers: str, pp: str, vpp: str, dp: str, sizes: list[int]) -> None:
    from analysis.validate import RunInputs, row_inputs

    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    row = _row(tmp_path, "mpt-05", num_layers=layers, pp=pp, virtual_pp=vpp, dp=dp,
               num_gpus=str(int(pp) * int(dp)), global_batch_size=str(int(dp) * 8 * int(pp)))
    inputs = row_inputs(row)
    assert isinstance(inputs, RunInputs), inputs
    s = inputs.strategy
    assert [len(s.chunk_layers(int(layers), g)) for g in range(s.pp * s.vpp)] == sizes
    assert f"{layers} layers on pp {pp}" in inputs.assumptions


@pytest.mark.parametrize(("cells", "note"), [
    ({"virtual_pp": ""}, "virtual_pp = 1 implied (pp = 1)"),
    ({"sequence_parallel": ""}, "sequence_parallel = False implied (tp = 1)"),
    ({"sequence_parallel": "true"},
     "sequence_parallel = False implied (Megatron disables it at tp = 1)"),
    ({"ep": ""}, "ep = 1 implied (dense model)"),
    ({"cp": ""}, "cp = 1 implied (tp·pp·dp·cp = num_gpus = 8)"),
    ({"dp": ""}, "dp = 8 implied (tp·pp·dp·cp = num_gpus = 8)"),
])
def test_a_cell_the_row_determines_is_filled_and_stated(tmp_path: Path, cells: dict[str, str],
                                                        note: str) -> None:
    """The schema's identities decide these cells, so leaving one empty loses nothing: the row
    is predicted exactly as the complete one, and says what was filled."""
    from analysis.validate import RunInputs, row_inputs

    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    full = row_inputs(_row(tmp_path, "mpt-07"))
    got = row_inputs(_row(tmp_path, "mpt-07", **cells))
    assert isinstance(full, RunInputs) and isinstance(got, RunInputs), got
    assert got.strategy == full.strategy and got.model == full.model
    assert note in got.assumptions and note not in full.assumptions


@pytest.mark.parametrize(("cells", "missing"), [
    ({"virtual_pp": "", "pp": "2", "dp": "4"}, "virtual_pp"),  # interleaving is a choice at pp 2
    ({"sequence_parallel": "", "tp": "2", "dp": "4"}, "sequence_parallel"),
    ({"dp": "", "cp": ""}, "dp, cp"),  # two unknowns, one identity
    ({"dp": "", "tp": "3"}, "dp"),  # 8 GPUs are no multiple of tp 3
    ({"ep": "", "arch": "moe", "num_experts": "8", "experts_per_token": "2",
      "moe_ffn_hidden_size": "1024"}, "ep"),
])
def test_a_cell_the_row_does_not_determine_stays_missing(tmp_path: Path, cells: dict[str, str],
                                                         missing: str) -> None:
    from analysis.validate import row_inputs

    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    got = row_inputs(_row(tmp_path, "mpt-07", **cells))
    assert isinstance(got, str) and f"{missing} missing" in got, got


def test_assume_fills_only_the_empty_cells_and_is_counted_apart(tmp_path: Path) -> None:
    """``assume`` is the caller's statement, not the source's: it completes a row that lacks
    the cell (predicted exactly as if the source gave it), leaves rows that give it alone, and
    the summary shows the rows as published apart from those it completed."""
    from analysis.validate import summarize

    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    runs = pl.read_csv(PUBLIC, infer_schema_length=0).filter(pl.col("id").is_in(["mpt-07",
                                                                                 "mpt-08"]))
    mbs = dict(zip(runs["id"], runs["micro_batch_size"], strict=True))
    f = tmp_path / "r.csv"
    runs.with_columns(pl.when(pl.col("id") == "mpt-07").then(pl.lit(None))
                      .otherwise(pl.col("micro_batch_size")).alias("micro_batch_size")).write_csv(f)
    plain = validate(f, fast=True)
    assert plain["status"].to_list() == ["skipped: micro_batch_size missing", "ok"]
    got = validate(f, fast=True, assume={"micro_batch_size": int(mbs["mpt-07"])})
    complete = validate(PUBLIC, fast=True).filter(pl.col("id").is_in(["mpt-07", "mpt-08"]))
    assert got["status"].to_list() == ["ok", "ok"]
    assert got["predicted_iter_time_s"].to_list() == pytest.approx(
        complete["predicted_iter_time_s"].to_list(), rel=1e-12)
    notes = got["assumptions"].to_list()
    assert f"micro_batch_size = {mbs['mpt-07']} assumed (--assume" in notes[0]
    assert "--assume" not in (notes[1] or "")
    groups = dict(zip(summarize(got)["group"], summarize(got)["rows"], strict=True))
    assert groups["inputs=source"] == 1 and groups["inputs=--assume"] == 1
    assert "inputs=source" not in set(summarize(plain)["group"])


@pytest.mark.parametrize(("assume", "message"), [
    ({"foo": 1}, "'foo' is not an input column"),
    ({"id": "x"}, "'id' is not an input column"),
    ({"measured_iter_time_s": 1.0}, "'measured_iter_time_s' is not an input column"),
    ({"tp": True}, "tp takes a whole number"),
    ({"micro_batch_size": 1.5}, "micro_batch_size takes a whole number"),
    ({"sequence_parallel": "yes"}, "sequence_parallel takes true or false"),
    ({"recompute": 3}, "recompute takes text"),
])
def test_a_bad_assumption_is_refused_before_any_row(tmp_path: Path, assume: dict[str, object],
                                                    message: str) -> None:
    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(PUBLIC, fast=True, assume=assume)


def test_validate_cli_assume(tmp_path: Path) -> None:
    import subprocess
    import sys

    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "analysis.cli", "validate", str(PUBLIC),
                               "--fast", *extra], capture_output=True, text=True, timeout=300)

    r = run("--assume", "micro_batch_size=1", "--assume", "recompute=none",
            "--assume", "zero_stage=1")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())  # rich wraps long lines
    assert "rest on --assume values" in text and "inputs=source" in text
    bad = run("--assume", "micro_batch_size")
    assert bad.returncode != 0 and "write column=value" in bad.stdout + bad.stderr
    assert "Traceback" not in bad.stdout + bad.stderr


def test_a_node_total_in_the_per_gpu_network_column_is_refused(tmp_path: Path) -> None:
    """8 × 400 Gb/s written as the per-GPU figure would make every DP collective 8× too fast."""
    from analysis.validate import RunInputs, row_inputs

    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    got = row_inputs(_row(tmp_path, "mpt-07", scaleout_gbps_per_gpu="3200"))
    assert isinstance(got, str) and "a node's total divided by gpus_per_node" in got, got
    fine = row_inputs(_row(tmp_path, "mpt-07", scaleout_gbps_per_gpu="400"))
    assert isinstance(fine, RunInputs), fine


def test_a_step_faster_than_the_peak_is_a_data_error(tmp_path: Path) -> None:
    """mpt-07 took 5.4 s; written as 0.0054 (ms → s twice) it would need ~58,000% MFU."""
    f = _row_file(tmp_path, "mpt-07", measured_iter_time_s="0.0054")
    got = validate(f, fast=True)["status"][0]
    assert got.startswith("skipped: measured_iter_time_s 0.0054 s would be"), got
    assert "of the GPUs' bf16 peak" in got


@pytest.mark.parametrize(("cells", "factor"), [
    ({"measured_iter_time_s": "5432"}, "1e+03×"),  # milliseconds in the seconds column
    ({"measured_tokens_per_s_per_gpu": "18096"}, "8×"),  # the node's 8 GPUs' tokens/s
])
def test_a_step_time_its_own_throughput_contradicts_is_a_data_error(
        tmp_path: Path, cells: dict[str, str], factor: str) -> None:
    """mpt-07: 5.432 s and 2,262 tokens/s per GPU describe one step (48 × 2048 tokens on 8
    GPUs); a step time 1,000× too slow, or a per-node throughput, skips the row and says why."""
    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    got = validate(_row_file(tmp_path, "mpt-07", **cells), fast=True)["status"][0]
    assert got.startswith("skipped: measured_iter_time_s"), got
    assert "disagrees with the row's measured_tokens_per_s_per_gpu" in got and factor in got, got
    fine = validate(_row_file(tmp_path, "mpt-07", measured_tokens_per_s_per_gpu="N/A"),
                    fast=True)["status"][0]
    assert fine == "ok", fine


def test_a_step_time_left_out_is_derived_from_the_rows_throughput(tmp_path: Path) -> None:
    """mpt-07 without its step time: its 2,262 tokens/s per GPU give 48 × 2,048 ÷ (2,262 × 8)
    = 5.432 s (the schema's from_tokens_per_s), judged as the published cell would be and
    said in its assumptions (not an --assume: counted with the source's rows). Without the
    throughput too, the row is skipped, saying there was nothing to derive it from."""
    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    given = validate(_row_file(tmp_path, "mpt-07"), fast=True).row(0, named=True)
    got = validate(_row_file(tmp_path, "mpt-07", measured_iter_time_s=""), fast=True)
    row = got.row(0, named=True)
    assert row["status"] == "ok"
    assert row["measured_iter_time_s"] == pytest.approx(48 * 2048 / (2262 * 8))
    assert row["measured_iter_time_s"] == pytest.approx(given["measured_iter_time_s"], rel=1e-3)
    assert row["error_pct"] == pytest.approx(given["error_pct"], abs=0.1)
    assert "from measured_tokens_per_s_per_gpu 2262" in row["assumptions"]
    assert summarize(got)["group"].to_list() == ["all", "gpu=a100-80gb", "source=mpt"]
    none = validate(_row_file(tmp_path, "mpt-07", measured_iter_time_s="",
                              measured_tokens_per_s_per_gpu=""), fast=True)["status"].item()
    assert none == ("skipped: measured_iter_time_s missing (and no measured_tokens_per_s_per_gpu "
                    "to derive it from)")
    # a throughput without the batch to read it by says what it waits for
    short = validate(_row_file(tmp_path, "mpt-07", measured_iter_time_s="",
                               global_batch_size=""), fast=True)["status"].item()
    assert short.startswith("skipped: measured_iter_time_s missing (measured_tokens_per_s_per_"
                            "gpu gives it once global_batch_size, seq_len and num_gpus are "
                            "given); global_batch_size missing"), short


def test_enum_cells_are_read_case_insensitively(tmp_path: Path) -> None:
    from analysis.validate import RunInputs, row_inputs

    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    row = _row(tmp_path, "mpt-07", gpu=" A100-80GB", precision="BF16", recompute="None",
               activation="GELU", arch="Dense")
    inputs = row_inputs(row)
    assert isinstance(inputs, RunInputs), inputs
    assert inputs.system.gpu.name == "a100-80gb" and inputs.strategy.precision == "bf16"
    assert inputs.strategy.recompute == "none" and inputs.model.activation == "gelu"


@pytest.mark.parametrize(("gpu", "precision", "reason"), [
    ("a100-80gb", "fp8", "precision fp8 on a100-80gb: it has no FP8 tensor cores"),
    ("a800", "fp8", "precision fp8 on a800: it has no FP8 tensor cores"),
    ("v100-32gb", "bf16", "precision bf16 on v100-32gb: it has no bf16 tensor cores (Volta"),
])
def test_a_precision_the_gpu_lacks_is_a_data_error(tmp_path: Path, gpu: str, precision: str,
                                                   reason: str) -> None:
    from analysis.validate import row_inputs

    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    got = row_inputs(_row(tmp_path, "mpt-07", gpu=gpu, precision=precision))
    assert isinstance(got, str) and got.startswith(f"skipped: {reason}"), got


def test_unstated_precision_is_the_16_bit_type_the_gpu_has(tmp_path: Path) -> None:
    from analysis.validate import RunInputs, row_inputs

    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    for gpu, expected in (("v100-32gb", "fp16"), ("a100-80gb", "bf16"), ("h100-sxm", "bf16")):
        got = row_inputs(_row(tmp_path, "mpt-07", gpu=gpu, precision=""))
        assert isinstance(got, RunInputs), got
        assert got.strategy.precision == expected
        assert f"precision unstated 16-bit: {expected}" in got.assumptions
    fp8 = row_inputs(_row(tmp_path, "mpt-07", gpu="h100-sxm", precision="fp8"))
    assert isinstance(fp8, RunInputs) and fp8.strategy.precision == "fp8"
    # the schema has no recipe column: the one assumed is said, unless --set names one
    assert "FP8 recipe: delayed scaling assumed" in fp8.assumptions
    cs = row_inputs(_row(tmp_path, "mpt-07", gpu="h100-sxm", precision="fp8"),
                    {"strategy.fp8_recipe": "tensorwise"})
    assert isinstance(cs, RunInputs) and cs.strategy.fp8_recipe == "tensorwise"
    assert "FP8 recipe" not in cs.assumptions
    mx = row_inputs(_row(tmp_path, "mpt-07", gpu="h100-sxm", precision="fp8"),
                    {"strategy.fp8_recipe": "mxfp8"})
    assert isinstance(mx, str) and "no block-scaled tensor cores" in mx


def test_rows_predicted_in_parallel_equal_the_serial_run(tmp_path: Path) -> None:
    """``jobs`` > 1 spreads rows over processes; every row and the order stay the same."""
    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    runs = pl.read_csv(PUBLIC, infer_schema_length=0).filter(
        pl.col("id").is_in(["mpt-07", "nar21-t2-07", "mpt-08"]))
    f = tmp_path / "r.csv"
    runs.write_csv(f)
    serial, parallel = validate(f), validate(f, jobs=2)
    assert parallel["id"].to_list() == runs["id"].to_list()
    assert parallel.equals(serial)


def test_system_overrides_apply_to_every_row_and_are_stated(tmp_path: Path) -> None:
    """``--set gpu.flash_attention=false`` models a stack without FlashAttention: the row's
    system carries it, its assumptions say so, and it runs slower."""
    from analysis.validate import RunInputs, row_inputs

    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    row = _row(tmp_path, "mpt-09")
    plain = row_inputs(row)
    unfused = row_inputs(row, {"gpu.flash_attention": False})
    assert isinstance(plain, RunInputs) and isinstance(unfused, RunInputs)
    assert plain.system.gpu.flash_attention and not unfused.system.gpu.flash_attention
    assert "system override gpu.flash_attention = False" in unfused.assumptions
    runs = pl.read_csv(PUBLIC, infer_schema_length=0).filter(pl.col("id") == "mpt-09")
    f = tmp_path / "one.csv"
    runs.write_csv(f)
    slow = validate(f, overrides={"gpu.flash_attention": False})["predicted_iter_time_s"].item()
    assert slow > validate(f)["predicted_iter_time_s"].item()
    with pytest.raises(ConfigError, match="unknown key 'flash'"):
        validate(f, overrides={"gpu.flash": True})


def test_strategy_overrides_apply_to_every_row_and_are_stated(tmp_path: Path) -> None:
    """``--set strategy.field=value`` sets a strategy field the schema has no column for (here
    the ZeRO-3 gather size): the row's strategy carries it, its assumptions say so, and a bad
    field fails the batch once with the known keys."""
    from analysis.validate import RunInputs, row_inputs

    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    got = row_inputs(_row(tmp_path, "nar21-t2-03"),
                     {"strategy.zero3_gather_bucket_params": 50_000_000})
    assert isinstance(got, RunInputs)
    assert got.strategy.zero3_gather_bucket_params == 50_000_000
    assert got.strategy.zero_stage == 3 and got.strategy.dp == 1536  # the row's own cells stay
    assert "strategy override zero3_gather_bucket_params = 50000000" in got.assumptions
    with pytest.raises(ConfigError, match="unknown key 'bucket'"):
        validate(PUBLIC, overrides={"strategy.bucket": 1})
    # a value of the wrong kind suits no row: refused once (it had skipped all 49, each saying
    # the same), an integral float told the whole number to write
    for key, value, said in (("zero3_prefetch", "maybe", "must be true or false, got 'maybe'"),
                             ("zero3_gather_bucket_params", 5e7,
                              "must be a whole number, got 50000000.0 (write 50000000)"),
                             ("moe_dispatcher", 1, "must be text, got 1")):
        with pytest.raises(ConfigError, match=re.escape(f"strategy.{key} {said}")):
            validate(PUBLIC, overrides={f"strategy.{key}": value})
    # a value that suits some rows and not others skips only those, with the reason
    mixed = validate(PUBLIC, overrides={"strategy.vpp": 2}, fast=True)
    assert mixed.filter(pl.col("id") == "nar21-t2-03")["status"].item().startswith("skipped:")


def test_model_overrides_state_what_the_schema_cannot(tmp_path: Path) -> None:
    """``--set model.dropout=0`` describes a stack that trains without dropout (MPT): the
    row's model carries it and its assumptions say so, the peak memory drops by exactly the
    two 1-byte masks per token of each layer in flight, and the step time does not move. A
    field the row's columns give, or a bad value, fails the batch once."""
    from analysis.validate import RunInputs, row_inputs

    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    row = _row(tmp_path, "mpt-04")
    plain, bare = row_inputs(row), row_inputs(row, {"model.dropout": 0})
    assert isinstance(plain, RunInputs) and isinstance(bare, RunInputs)
    assert plain.model.dropout == 0.1 and bare.model.dropout == 0.0
    assert "model override dropout = 0" in bare.assumptions
    s = bare.strategy
    assert s.pp == 1 and s.recompute == "none"  # every layer, one micro-batch in flight
    masks_GiB = (2 * s.micro_batch_size * bare.model.seq_len * bare.model.hidden_size
                 * bare.model.num_layers / GiB)
    f = tmp_path / "one.csv"
    pl.read_csv(PUBLIC, infer_schema_length=0).filter(pl.col("id") == "mpt-04").write_csv(f)
    with_masks, without = validate(f, fast=True), validate(f, fast=True,
                                                            overrides={"model.dropout": 0})
    assert (with_masks["predicted_peak_memory_GiB"].item()
            - without["predicted_peak_memory_GiB"].item()) == pytest.approx(masks_GiB * 1.05)
    assert (with_masks["predicted_iter_time_s"].item()
            == without["predicted_iter_time_s"].item())
    with pytest.raises(ConfigError, match=r"model\.num_layers: not a model field a row leaves"):
        validate(f, overrides={"model.num_layers": 3})
    with pytest.raises(ConfigError, match=r"dropout is a probability in \[0, 1\)"):
        validate(f, overrides={"model.dropout": 1.5})


def test_smaller_zero3_gathers_cost_ring_latency_that_grows_with_ranks(tmp_path: Path) -> None:
    """Splitting each ZeRO-3 gather into more collectives adds their ring latency, more of it
    the more ranks the ring spans: on Narayanan et al.'s 175B ZeRO-3 rows the extra time at
    1,536 ranks exceeds that at 768 (same parameters per step)."""
    from analysis.fastpath import estimate
    from analysis.validate import RunInputs, row_inputs

    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    extra = []
    for run_id in ("nar21-t2-02", "nar21-t2-03"):
        row = _row(tmp_path, run_id)
        whole = row_inputs(row)
        split = row_inputs(row, {"strategy.zero3_gather_bucket_params": 50_000_000})
        assert isinstance(whole, RunInputs) and isinstance(split, RunInputs)
        extra.append(estimate(split.model, split.strategy, split.system).step_time_s
                     - estimate(whole.model, whole.strategy, whole.system).step_time_s)
    assert 0 < extra[0] < extra[1]


def test_set_values_are_read_as_toml_values() -> None:
    from analysis.cli_study import parse_overrides

    got = parse_overrides(["gpu.flash_attention=false", "gpu.gemm_efficiency = 0.7",
                           "scaleout.topology=fat-tree", 'scaleout.topology2="x"'])
    assert got == {"gpu.flash_attention": False, "gpu.gemm_efficiency": 0.7,
                   "scaleout.topology": "fat-tree", "scaleout.topology2": "x"}
    with pytest.raises(ConfigError, match=r"section\.key=value"):
        parse_overrides(["nonsense"])


MEGATRON_2022 = Path(__file__).parent / "data" / "megatron2022_runs.csv"


def test_megatron_2022_rows_reproduce_the_published_mfu() -> None:
    """The transcription check of tests/data/megatron2022_runs.csv: each 'present work' iteration
    time (Korthikanti et al. 2022, Table 5) with its Table 3 configuration gives the MFU that the
    Megatron-LM README publishes for it (public_runs.csv kor22-*), by Megatron's FLOP formula
    72·B·s·l·h²·(1 + s/6h + V/12lh) (Narayanan et al. 2021, without the recompute pass)."""
    from analysis.validate import load_runs

    rows = load_runs(MEGATRON_2022).filter(pl.col("recompute") == "selective")
    assert rows.height == 4
    for r in rows.iter_rows(named=True):
        b, s, n_layers = r["global_batch_size"], r["seq_len"], r["num_layers"]
        h, v = r["hidden_size"], r["vocab_size"]
        flop = 72 * b * s * n_layers * h * h * (1 + s / (6 * h) + v / (12 * n_layers * h))
        mfu_pct = 100 * flop / (r["measured_iter_time_s"] * r["num_gpus"] * 312e12)
        assert mfu_pct == pytest.approx(float(r["measured_mfu_pct"]), rel=0.005), r["id"]


def test_megatron_2022_stack_is_predicted_within_the_error_reached() -> None:
    """Megatron-LM in 2022 on A100-80GB (tp 8, pp 1-64, full or selective recompute) — the stack
    the A100 constants describe, with the unfused attention it had. Fast path per row (held
    within 2% of replay elsewhere; replay of the 64-stage rows takes minutes). All eight come
    out within 3.6% (−3.5 … +0.3%; 5-10% too fast before the sustained clock, 0.3-4.0% before
    compute/communication interference; DESIGN.md); the bound is the error reached, never to be
    loosened."""
    got = validate(MEGATRON_2022, overrides={"gpu.flash_attention": False}, fast=True)
    assert got.height == 8 and (got["status"] == "ok").all()
    for r in got.iter_rows(named=True):
        assert abs(r["error_pct"]) <= 3.6, (r["id"], r["error_pct"])
        assert r["fits"], r["id"]


def test_megatron_2022_recompute_choice_is_predicted_closer_than_the_step_time() -> None:
    """What a planner decides with: full recompute against sequence parallelism + selective
    recompute on the same model and layout. Measured (Korthikanti et al. Table 5) full costs
    1.29-1.32× selective; predicted 1.31-1.35× — the ratio within 3% on all four models (as
    close as the step times themselves, 0-3.5% off), and the order always right."""
    got = pairs(validate(MEGATRON_2022, overrides={"gpu.flash_attention": False}, fast=True))
    assert got.height == 4  # one pair per model: a = full, b = selective (ids in order)
    for r in got.iter_rows(named=True):
        assert r["a"].endswith("-full") and r["b"].endswith("-selective")
        assert r["measured_ratio"] > 1 and r["order_right"]
        assert abs(r["ratio_error_pct"]) < 3.0, r


def test_fast_validation_agrees_with_replay(results: pl.DataFrame) -> None:
    """``validate(fast=True)`` (the closed-form fast path) skips the same rows and predicts the
    same step times, memory and MFU as replay within the fast path's 2% on the public set."""
    fast = validate(PUBLIC, fast=True)
    assert fast["status"].to_list() == results["status"].to_list()
    both = results.join(fast, on="id", suffix="_fast").filter(pl.col("status") == "ok")
    for col, rel in (("predicted_iter_time_s", 0.02), ("predicted_mfu", 0.02),
                     ("predicted_peak_memory_GiB", 1e-9)):
        assert both[col].to_numpy() == pytest.approx(both[f"{col}_fast"].to_numpy(), rel=rel)
    assert both["fits"].to_list() == both["fits_fast"].to_list()
    assert fast.filter(pl.col("status") == "ok")["predicted_compute_s"].is_null().all()


def test_a_gpu_outside_the_schema_is_skipped_naming_the_schemas_names(tmp_path: Path) -> None:
    """'H100' is not a schema name (read case-insensitively: 'h100'); the status lists the
    names a row can use, so the fix is in the message."""
    if not PUBLIC.is_file():
        pytest.skip(f"{PUBLIC} not present")
    got = validate(_row_file(tmp_path, "mpt-07", gpu="H100"), fast=True)["status"][0]
    assert got.startswith("skipped: gpu 'h100' has no system preset; the schema's names: ")
    assert "a100-80gb" in got and "an H100 of unstated form factor is h100-sxm" in got


def test_a_zero2_row_reduces_every_micro_batch_unless_its_column_says_not(
        tmp_path: Path) -> None:
    """A ZeRO-2 row shards its gradients (DeepSpeed's stage 2, FSDP's SHARD_GRAD_OP), so each
    micro-batch's are reduced in its backward — said per row; a row's
    ``grad_reduce_per_microbatch`` column wins. More reductions, a longer step."""
    steps = {}
    for said in (None, "false", "true"):
        cells = {"zero_stage": "2"} | ({} if said is None else
                                      {"grad_reduce_per_microbatch": said})
        row = load_runs(_row_file(tmp_path, "mpt-07", **cells)).row(0, named=True)
        inputs = V.row_inputs(row)
        assert not isinstance(inputs, str), inputs
        assert inputs.strategy.num_microbatches > 1
        assert inputs.strategy.grad_reduce_per_microbatch is (said != "false")
        assert ("each micro-batch's gradients reduce-scattered" in inputs.assumptions) is (
            said is None)
        steps[said] = V.predict(inputs)["predicted_iter_time_s"]
    assert steps[None] == steps["true"] > steps["false"]
    # a file-wide --set says otherwise where the row is silent: its word, and no such note
    row = load_runs(_row_file(tmp_path, "mpt-07", zero_stage="2")).row(0, named=True)
    inputs = V.row_inputs(row, {"strategy.grad_reduce_per_microbatch": False})
    assert not isinstance(inputs, str), inputs
    assert not inputs.strategy.grad_reduce_per_microbatch
    assert "each micro-batch's gradients" not in inputs.assumptions


def test_a_rows_window_columns_give_its_model_sliding_windows(tmp_path: Path) -> None:
    """``sliding_window`` / ``window_pattern`` (and ``attention_chunk``) beyond the schema: the
    row's model attends within them on the layers the pattern marks, as the same ModelSpec
    does; a shorter step than the row without them; a bad pattern skips the row, named."""
    plain = load_runs(_row_file(tmp_path, "mpt-07")).row(0, named=True)
    base = V.row_inputs(plain)
    assert not isinstance(base, str), base
    steps = {}
    for cells in ({}, {"sliding_window": "512", "window_pattern": "SF"},
                  {"attention_chunk": "512", "window_pattern": "SF"}):
        row = load_runs(_row_file(tmp_path, "mpt-07", **cells)).row(0, named=True)
        inputs = V.row_inputs(row)
        assert not isinstance(inputs, str), inputs
        assert inputs.model == dataclasses.replace(base.model, **{
            k: (v if k == "window_pattern" else int(v)) for k, v in cells.items()})
        steps[tuple(cells)] = V.predict(inputs)["predicted_iter_time_s"]
    assert steps[("sliding_window", "window_pattern")] < steps[()]
    assert steps[("attention_chunk", "window_pattern")] < steps[()]
    bad = validate(_row_file(tmp_path, "mpt-07", sliding_window="512", window_pattern="SX"))
    assert bad["status"].item().startswith("skipped:") and "window_pattern" in bad[
        "status"].item()


def test_a_rows_document_columns_give_its_model_a_document_mask(tmp_path: Path) -> None:
    """``document_mean_tokens`` / ``document_length_sigma`` beyond the schema: the row's model
    attends within documents of that length, as the same ModelSpec does, and steps faster
    than the row without them; a σ out of range skips the row, named."""
    base = V.row_inputs(load_runs(_row_file(tmp_path, "mpt-07")).row(0, named=True))
    assert not isinstance(base, str), base
    row = load_runs(_row_file(tmp_path, "mpt-07", document_mean_tokens="300",
                              document_length_sigma="1.5")).row(0, named=True)
    inputs = V.row_inputs(row)
    assert not isinstance(inputs, str), inputs
    assert inputs.model == dataclasses.replace(base.model, document_mean_tokens=300,
                                               document_length_sigma=1.5)
    assert (V.predict(inputs)["predicted_iter_time_s"]
            < V.predict(base)["predicted_iter_time_s"])
    bad = validate(_row_file(tmp_path, "mpt-07", document_mean_tokens="300",
                             document_length_sigma="9"))
    assert bad["status"].item().startswith("skipped:") and "document_length_sigma" in bad[
        "status"].item()


def test_a_rows_moe_layer_pattern_gives_its_model_moe_in_those_layers(tmp_path: Path) -> None:
    """``moe_layer_pattern`` beyond the schema (Llama 4 Maverick's "DM"): a MoE row's model has
    its experts in the layers the pattern marks, as the same ModelSpec does, and costs more
    than with experts in every layer (half its layers run MPT-7B's 16,384-wide MLP instead of
    two experts of 2,048); a bad pattern skips the row, named."""
    moe = {"arch": "moe", "num_experts": "8", "experts_per_token": "2",
           "moe_ffn_hidden_size": "2048", "ep": "1"}
    plain = V.row_inputs(load_runs(_row_file(tmp_path, "mpt-07", **moe)).row(0, named=True))
    assert not isinstance(plain, str), plain
    row = load_runs(_row_file(tmp_path, "mpt-07", **moe, moe_layer_pattern="DM")).row(
        0, named=True)
    got = V.row_inputs(row)
    assert not isinstance(got, str), got
    assert got.model == dataclasses.replace(plain.model, moe_layer_pattern="DM")
    assert V.predict(got)["predicted_iter_time_s"] > V.predict(plain)["predicted_iter_time_s"]
    bad = validate(_row_file(tmp_path, "mpt-07", **moe, moe_layer_pattern="DX"))
    assert bad["status"].item().startswith("skipped:") and "moe_layer_pattern" in bad[
        "status"].item()
