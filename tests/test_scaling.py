"""Scaling studies: each GPU count's row is the best fitting strategy of its own sweep, the
derived columns are the closed forms they claim, the batch is kept or scaled as asked, and a
count where nothing runs is a row that says why, not an error."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from analysis import plots
from analysis.scaling import (
    deadline_verdict,
    fewest_meeting,
    parse_gpu_counts,
    scaling,
    study_at,
)
from analysis.study import load_study
from tests.studies import write_study
from tracegen import ConfigError

SMALL = ("[search]\ntp = [1, 2]\npp = [1, 2]\nvpp = [1]\nmicro_batch_size = [1, 2]\n"
         "recompute = [\"none\"]\nzero_stage = [1]\nsequence_parallel = [false]\n")


def _study(tmp_path: Path, *, failures: bool) -> Path:
    path = write_study(tmp_path / "study", strategies=False, failures=failures)
    path.write_text(path.read_text() + SMALL)
    return path


@pytest.mark.parametrize("text, counts", [
    ("1024..8192", (1024, 2048, 4096, 8192)), ("8..8", (8,)), ("16..40", (16, 32)),
    ("64, 8,16,8", (8, 16, 64))])
def test_gpu_counts_from_the_command_line(text: str, counts: tuple[int, ...]) -> None:
    assert parse_gpu_counts(text) == counts


@pytest.mark.parametrize("text", ["", "abc", "0", "8,-16", "64..8", "0..8", "8..x"])
def test_bad_gpu_counts_say_how_to_write_them(text: str) -> None:
    with pytest.raises(ConfigError, match=r"GPU counts|--gpus"):
        parse_gpu_counts(text)


def test_each_count_is_the_best_of_its_own_sweep(tmp_path: Path) -> None:
    study = load_study(_study(tmp_path, failures=True))
    got = scaling(study, [16, 8], tmp_path / "out", workers=1)
    assert got["gpus"].to_list() == [8, 16]
    assert (got["global_batch_size"] == study.global_batch_size).all()  # strong scaling
    for row in got.iter_rows(named=True):
        ranked = pl.read_parquet(tmp_path / "out" / f"gpus-{row['gpus']}" / "results.parquet")
        best = ranked.filter(pl.col("fits")).row(0, named=True)
        assert (row["id"], row["status"], row["step_time_s"]) == (
            best["id"], "replayed", best["step_time_s"])
        assert row["dp"] * row["tp"] * row["pp"] == row["gpus"]
        assert 0 < row["goodput"] < 1
    on_disk = pl.read_csv(tmp_path / "out" / "scaling.csv")
    assert on_disk["id"].to_list() == got["id"].to_list()


def test_derived_columns_are_their_closed_forms(tmp_path: Path) -> None:
    """Without failures: throughput is tokens/s; the run lasts tokens ÷ tokens/s; GPU-hours are
    that × GPUs; speed-up and efficiency are against the smallest count."""
    study = load_study(_study(tmp_path, failures=False))
    got = scaling(study, [8, 16, 32], tmp_path / "out", workers=1)
    eff = got["tokens_per_s"].to_numpy()
    assert got["effective_tokens_per_s"].to_numpy() == pytest.approx(eff)
    assert got["run_time_s"].to_numpy() == pytest.approx(study.tokens / eff)
    assert got["gpu_hours"].to_numpy() == pytest.approx(
        study.tokens / eff * got["gpus"].to_numpy() / 3600)
    assert got["gpu_hours_per_btok"].to_numpy() == pytest.approx(
        got["gpu_hours"].to_numpy() * 1e9 / study.tokens)
    assert got["speedup"].to_numpy() == pytest.approx(eff / eff[0])
    assert got["scaling_efficiency"].to_numpy() == pytest.approx(
        eff / eff[0] * 8 / got["gpus"].to_numpy())
    assert got["scaling_efficiency"][0] == 1.0


def test_batch_per_gpu_scales_the_global_batch(tmp_path: Path) -> None:
    study = load_study(_study(tmp_path, failures=False))  # 32 sequences on 8 GPUs
    assert study_at(study, 32, batch_per_gpu=True).global_batch_size == 128
    assert study_at(study, 32).global_batch_size == 32
    assert study_at(study, 32).strategies == ()
    odd = dataclasses.replace(study, global_batch_size=36)  # 4.5 sequences a GPU
    assert study_at(odd, 16, batch_per_gpu=True).global_batch_size == 72
    with pytest.raises(ConfigError, match=r"40\.5 sequences on 9, not a whole number"):
        study_at(odd, 9, batch_per_gpu=True)
    with pytest.raises(ConfigError, match="not a whole number"):  # before any sweep runs
        scaling(odd, [16, 9], tmp_path / "out", batch_per_gpu=True, workers=1)
    assert not (tmp_path / "out").exists()


def test_a_count_where_nothing_runs_is_a_row_that_says_why(tmp_path: Path) -> None:
    """256 GPUs cannot share a global batch of 32: the space's tp·pp is at most 4, so dp is at
    least 64, more replicas than sequences."""
    study = load_study(_study(tmp_path, failures=False))
    got = scaling(study, [8, 256], tmp_path / "out", workers=1)
    last = got.row(1, named=True)
    assert last["valid"] == 0 and last["effective_tokens_per_s"] is None
    assert "no valid strategy" in last["status"] and "global batch of 32" in last["status"]
    fig = plots.scaling(got)  # the count with no result is said, not drawn
    assert "1 count(s) with no strategy that fits" in fig.axes[1].get_title()
    fig.savefig(tmp_path / "s.png")
    none = scaling(study, [256], tmp_path / "out", workers=1, deadline_days=30.0)
    assert none["meets_deadline"].is_null().all()  # (no end date: not known, not late)
    assert "no count has a strategy that fits" in deadline_verdict(none, 30.0)


def test_scale_command_writes_the_table_and_figure(tmp_path: Path) -> None:
    path = _study(tmp_path, failures=True)
    out, png = tmp_path / "out", tmp_path / "scaling.png"
    run = subprocess.run([sys.executable, "-m", "analysis.cli", "scale", str(path), "--gpus",
                          "8..16", "-o", str(out), "--plot", str(png), "--workers", "1",
                          "--deadline", "1e6"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "days to train" in run.stdout and "16" in run.stdout
    assert "P90 days" in run.stdout  # (the study has failures)
    assert "Deadline 1e+06 days: 8 GPUs is the fewest" in " ".join(run.stdout.split())
    assert pl.read_csv(out / "scaling.csv").height == 2
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run([sys.executable, "-m", "analysis.cli", "scale", str(path), "--gpus",
                          "0", "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "GPU counts must be whole numbers" in bad.stdout + bad.stderr
    assert "Traceback" not in bad.stdout + bad.stderr


def test_a_scaling_folder_of_another_study_is_refused_then_rebuilt_fresh(
        tmp_path: Path) -> None:
    """Each count's sweep folder resumes only its own study: a scaling of another system
    into the same folder is refused, naming the way out, and ``fresh`` takes it (the
    rebuilt rows are the other system's, as into an empty folder)."""
    from replay import get_system

    study = load_study(_study(tmp_path, failures=False))
    out = tmp_path / "out"
    scaling(study, [8], out, workers=1)
    other = dataclasses.replace(study, system=get_system("dgx-a100-80gb"))
    with pytest.raises(ConfigError, match=r"holds results of another study.*--fresh"):
        scaling(other, [8], out, workers=1)
    got = scaling(other, [8], out, workers=1, fresh=True)
    want = scaling(other, [8], tmp_path / "clean", workers=1)
    assert got.drop("strategy").equals(want.drop("strategy"))
    assert got["strategy"].to_list() == want["strategy"].to_list()


def test_a_scaling_directory_gets_its_own_report(tmp_path: Path) -> None:
    """``trainsim report`` on what ``scale`` wrote: the scaling table (a count where nothing
    runs keeps its reason), the figures embedded and beside the pages, each count's best
    strategies from its own sweep (its first the table's), the study named from
    ``scaling.json``."""
    import base64
    import re

    from typer.testing import CliRunner

    from analysis.cli import app

    study = load_study(_study(tmp_path, failures=True))
    got = scaling(study, [8, 256], tmp_path / "out", workers=1)
    run = CliRunner().invoke(app, ["report", str(tmp_path / "out"), "-o", str(tmp_path / "rep")])
    assert run.exit_code == 0, run.output
    assert "scaling.csv" in run.output
    html = (tmp_path / "rep" / "report.html").read_text()
    md = (tmp_path / "rep" / "report.md").read_text()
    best = got.row(0, named=True)
    table = html[html.index('id="scaling-table"'):html.index("</table>")]
    assert table.count("<tr>") == 3  # header and the two counts
    assert best["strategy"] in table and f"{best['step_time_s']:.3f}" in table
    assert "no valid strategy" in table and "global batch of 32" in table
    assert study.model.name in html and "strong scaling" in html
    images = re.findall(r'src="data:image/png;base64,([^"]+)"', html)
    assert len(images) == 2 and all(base64.b64decode(i)[:4] == b"\x89PNG" for i in images)
    for name in ("scaling", "breakdown"):
        png = tmp_path / "rep" / "figures" / f"{name}.png"
        assert png.read_bytes()[:4] == b"\x89PNG" and f"(figures/{name}.png)" in md
    runners = html[html.index('id="gpus-8"'):]
    body = runners[runners.index("<tbody>"):]
    first_row = body[:body.index("</tr>")]
    assert best["strategy"] in first_row  # the count's sweep ranks the table's best first
    assert 'id="gpus-256"' not in html  # (a count with no valid strategy has no runners-up)
    assert f"| 8 | {best['global_batch_size']:,} | {best['strategy']} |" in md
    assert pl.read_csv(tmp_path / "rep" / "scaling.csv").height == 2


def test_a_deadline_picks_the_fewest_gpus_that_finish_in_nine_runs_of_ten(
        tmp_path: Path) -> None:
    """Each count's P90 end date is its replayed best's (the compare row's
    ``time_to_train_p90_s``); a deadline between two counts' P90s is met by the larger and
    every count whose P90 is within it, and the verdict names the fewest such GPUs. Without
    failures nothing varies the end date: its P90 is the run's time."""
    study = load_study(_study(tmp_path, failures=True))
    out = tmp_path / "out"
    free = scaling(study, [8, 16, 32], out, workers=1)
    assert free["meets_deadline"].is_null().all()
    p90 = free["run_time_p90_s"].to_numpy()
    assert free["run_time_p90_s"].to_list() == free["time_to_train_p90_s"].to_list()
    assert (p90 > 0).all()
    days = float(sorted(p90)[1]) / 86400 * (1 + 1e-9)  # the second-fastest count's P90
    got = scaling(study, [8, 16, 32], out, workers=1, deadline_days=days)  # (sweeps resumed)
    assert got["run_time_p90_s"].to_list() == free["run_time_p90_s"].to_list()
    assert got["meets_deadline"].to_list() == [bool(x <= days * 86400) for x in p90]
    assert sum(got["meets_deadline"].to_list()) == 2
    # the chance of ending in time, from the same distribution as the P90: at least nine in
    # ten where the P90 is within the deadline, fewer where it is not; none without a deadline
    for chance, meets in zip(got["deadline_probability"], got["meets_deadline"], strict=True):
        assert (chance >= 0.9 - 1e-9) if meets else (0 <= chance < 0.9)
    assert free["deadline_probability"].is_null().all()
    first = fewest_meeting(got)
    assert first is not None and first["gpus"] == min(
        g for g, ok in zip(got["gpus"], got["meets_deadline"], strict=True) if ok)
    text = deadline_verdict(got, days)
    assert f"{first['gpus']:,} GPUs is the fewest" in text and first["strategy"] in text
    from analysis.report import build_report

    html = build_report(out, tmp_path / "rep").read_text()
    md = (tmp_path / "rep" / "report.md").read_text()
    for page in (html, md):
        assert text in page and "P90 days" in page
        assert f"{first['run_time_p90_s'] / 86400:.1f}" in page
    tight = scaling(study, [8, 16, 32], out, workers=1, deadline_days=float(p90.min()) / 86400
                    / 2)
    assert fewest_meeting(tight) is None
    assert "no count finishes by it" in deadline_verdict(tight, float(p90.min()) / 86400 / 2)
    fig = plots.scaling(got, deadline_days=days)
    assert len(fig.axes) == 3 and fig.axes[2].get_ylabel() == "days to train"
    labels = fig.axes[2].get_legend_handles_labels()[1]
    assert f"deadline {days:g} days" in labels and "finishes in time (P90)" in labels
    healthy = scaling(load_study(_study(tmp_path / "h", failures=False)), [8], tmp_path / "o2",
                      workers=1, deadline_days=1e6)
    assert healthy["run_time_p90_s"].to_list() == healthy["run_time_s"].to_list()
    assert healthy["meets_deadline"].to_list() == [True]
    assert healthy["deadline_probability"].to_list() == [1.0]  # (nothing varies a healthy run)


@pytest.mark.parametrize("days", [0.0, -3.0, float("nan"), float("inf")])
def test_a_deadline_must_be_days_and_needs_a_token_budget(tmp_path: Path, days: float) -> None:
    study = load_study(_study(tmp_path, failures=True))
    with pytest.raises(ConfigError, match=r"a deadline is a number of days > 0"):
        scaling(study, [8], tmp_path / "out", workers=1, deadline_days=days)
    with pytest.raises(ConfigError, match="a deadline needs the run's token budget"):
        scaling(dataclasses.replace(study, tokens=0.0), [8], tmp_path / "out", workers=1,
                deadline_days=30.0)
    assert not (tmp_path / "out").exists()  # (said before any sweep runs)


def test_a_study_file_can_carry_the_deadline(tmp_path: Path) -> None:
    """``deadline_days`` in the study: what ``scaling`` (and ``scale``) use unless given one;
    refused where it is no positive number of days or the study has no token budget."""
    path = _study(tmp_path, failures=True)
    path.write_text(path.read_text().replace("tokens = 1e9\n", "tokens = 1e9\ndeadline_days = 1e6\n"))
    study = load_study(path)
    assert study.deadline_days == 1e6
    got = scaling(study, [8], tmp_path / "out", workers=1)
    assert got["meets_deadline"].to_list() == [True]
    assert scaling(study, [8], tmp_path / "out", workers=1,
                   deadline_days=1e-9)["meets_deadline"].to_list() == [False]
    for bad in ("0", "-2", "\"soon\"", "nan"):
        path.write_text(re.sub(r"deadline_days = \S+", f"deadline_days = {bad}",
                               path.read_text()))
        with pytest.raises(ConfigError, match="deadline_days must be a number of days > 0"):
            load_study(path)
    path.write_text(re.sub(r"deadline_days = \S+", "deadline_days = 30", path.read_text()))
    text = re.sub(r"(?m)^tokens = .*\n", "", path.read_text())
    path.write_text(text)
    with pytest.raises(ConfigError, match="deadline_days needs tokens"):
        load_study(path)
