"""compare → report: the frame, and an HTML page whose every figure and table is present."""

from __future__ import annotations

import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.compare import RESULT_COLUMNS, compare
from analysis.study import load_study
from tests.studies import write_study
from tracegen import ConfigError

FIGURES = {"breakdown", "pareto", "heatmap", "timeline", "goodput", "policies"}


def test_compare_frame(tmp_path: Path) -> None:
    study = load_study(write_study(tmp_path))
    frame = compare(study)
    assert frame.height == 3 and set(RESULT_COLUMNS) <= set(frame.columns)
    assert frame["rank"].to_list() == [1, 2, 3]
    ok = frame.filter(pl.col("status") == "replayed")
    assert ok.height == 3
    for r in ok.iter_rows(named=True):
        parts = sum(r[k] for k in ("compute_s", "interference_s", "exposed_tp_s",
                                   "exposed_pp_s", "exposed_dp_s", "exposed_other_comm_s",
                                   "bubble_s", "optimizer_s"))
        assert 0 <= r["interference_s"] < r["compute_s"]
        assert parts == pytest.approx(r["step_time_s"], rel=1e-6)  # the breakdown adds up
        assert 0 < r["goodput"] <= 1 and r["time_to_train_s"] > 0
        assert 0 < r["mfu"] <= r["hfu"] < 1
    ranked = frame["time_to_train_s"].to_list()
    assert ranked == sorted(ranked)


def test_without_failures_the_time_to_train_is_the_healthy_run(tmp_path: Path) -> None:
    """A study with a token budget and no [failures]: the days to train are the budget at the
    step's throughput (nothing fails, nothing is checkpointed for it); goodput is not modelled,
    so it stays empty rather than 100%."""
    study = load_study(write_study(tmp_path, failures=False))
    frame = compare(study)
    assert frame["goodput"].null_count() == frame.height
    for r in frame.iter_rows(named=True):
        assert r["time_to_train_s"] == pytest.approx(1e9 / r["tokens_per_s"], rel=1e-12)
    # the ranking (screen and report) drops the columns nothing fills: no column of dashes
    from analysis.report import COLUMNS, shown_columns

    shown = {k for k, _, _ in shown_columns(frame)}
    assert {"goodput", "time_to_train_p90_s"}.isdisjoint(shown)
    assert {"strategy", "step_time_s", "time_to_train_s"} <= shown
    assert shown == {k for k, _, _ in COLUMNS if k in frame.columns
                     and frame[k].null_count() < frame.height}


def test_compare_on_a_dask_cluster_matches_the_local_run(tmp_path: Path) -> None:
    """``compare(..., scheduler=...)`` replays each strategy as a task on a real Dask
    LocalCluster (two worker processes): the same ranked frame as in this process, and every
    strategy's timeline written where asked — by the caller, into a directory it makes, from
    the bytes each task returns (a worker once wrote it on its own disk, into a directory that
    had to exist there)."""
    from distributed import LocalCluster

    study = load_study(write_study(tmp_path))
    local = compare(study)
    seen: list[tuple[int, int]] = []
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster:  # (None still serves HTTP on
        # 8787 and warns — an error in this suite — wherever another Dask holds that port)
        remote = compare(study, scheduler=cluster.scheduler_address,
                         timeline_dir=str(tmp_path / "tl"),
                         progress=lambda done, total: seen.append((done, total)))
    assert remote.equals(local)
    assert "_timeline_parquet" not in remote.columns
    assert seen[-1] == (3, 3) and [d for d, _ in seen] == [1, 2, 3]
    assert len(list((tmp_path / "tl").glob("*.parquet"))) == 3


class _Collect(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.images: list[str] = []
        self.rows = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(str(a["id"]))
        if tag == "img":
            self.images.append(str(a.get("src", "")))
        if tag == "tr":
            self.rows += 1


def test_cli_compare_then_report(tmp_path: Path) -> None:
    study = write_study(tmp_path)
    out = tmp_path / "out"
    cli = [sys.executable, "-m", "analysis.cli"]
    r = subprocess.run([*cli, "compare", str(study), "-o", str(out), "--workers", "2"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    for name in ("results.parquet", "results.csv", "timeline.parquet", "resilience.parquet"):
        assert (out / name).is_file(), name
    r = subprocess.run([*cli, "report", str(out), "-o", str(out)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    page = _Collect()
    page.feed((out / "report.html").read_text())
    assert {f"fig-{f}" for f in FIGURES} <= page.ids
    assert {"ranking-table", "resilience-table"} <= page.ids
    assert len(page.images) == len(FIGURES)
    assert all(src.startswith("data:image/png;base64,") and len(src) > 1000
               for src in page.images)  # self-contained
    md = (out / "report.md").read_text()
    assert md.count("![") == len(FIGURES) and "| policy |" in md and "| persist (s) |" in md
    assert "| checkpoint (s) |" in md and "| restart (s) |" in md  # (the CLI table's columns)
    assert "| P10–P90 days |" in md
    row = next(line for line in md.splitlines() if line.startswith("| global_restart |"))
    spread = row.split("|")[4].strip()  # (policy, goodput, days, then the P10–P90 days)
    assert re.fullmatch(r"\d+\.\d+(–\d+\.\d+)?", spread), row
    # a folder written before checkpoints persisted (no persist_s) still reports: "–" there
    res = pl.read_parquet(out / "resilience.parquet")
    res.drop("persist_s", "wall_clock_p10_s", "wall_clock_p90_s").write_parquet(
        out / "resilience.parquet")
    r = subprocess.run([*cli, "report", str(out), "-o", str(out)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert " | – |" in (out / "report.md").read_text()
    res.write_parquet(out / "resilience.parquet")
    assert all((out / "figures" / f"{f}.png").is_file() for f in FIGURES)
    results = pl.read_csv(out / "results.csv")
    assert results.height == 3
    # the replayed rows' end date nine runs in ten (wall_spread): a run this short likely
    # meets no failure, so nine in ten end at the failure-free time, a little before the mean
    # (which the rare failure's long restart pulls later)
    p90, mean = results["time_to_train_p90_s"], results["time_to_train_s"]
    assert p90.null_count() == 0 and ((p90 <= mean) & (p90 >= 0.95 * mean)).all()
    assert "| P90 days |" in (out / "report.md").read_text()
    r = subprocess.run([*cli, "compare", str(study), "-o", str(out), "--workers", "2"],
                       capture_output=True, text=True, timeout=600, env={"COLUMNS": "300"})
    assert r.returncode == 0, r.stderr
    assert "3 of 3 strategies were kept from an earlier run" in r.stdout
    assert (out / "timeline.parquet").is_file() and pl.read_csv(out / "results.csv").height == 3


def test_a_comparison_keeps_each_row_and_resumes(tmp_path: Path) -> None:
    """Each replayed strategy's row is kept as it finishes; a re-run of the same study replays
    only what is missing (here: the strategy whose part was lost) and ranks the same frame;
    a strategy struck off the list stays out; another study's folder is refused."""
    import dataclasses

    from analysis.runner import strategy_id
    from analysis.sweep import PartStore
    from replay import get_system

    study = load_study(write_study(tmp_path))
    out = tmp_path / "out"
    first = compare(study, out_dir=out, timeline_dir=str(out / "tl"))
    parts = sorted((out / "parts" / "compare").glob("part-*.parquet"))
    assert len(parts) == 3 and PartStore(out, "compare").read().height == 3
    lost = pl.read_parquet(parts[1])["id"][0]
    parts[1].unlink()
    seen: list[tuple[int, int]] = []
    again = compare(study, out_dir=out, progress=lambda i, n: seen.append((i, n)))
    assert seen == [(3, 3)]  # one replay: the lost strategy
    assert again.equals(first)
    kept = sorted(p.name for p in (out / "parts" / "compare").glob("part-*.parquet"))
    assert len(kept) == 3 and lost in PartStore(out, "compare").read()["id"].to_list()
    fewer = dataclasses.replace(study, strategies=study.strategies[:2])
    assert sorted(compare(fewer, out_dir=out)["id"]) == sorted(
        strategy_id(s) for s in study.strategies[:2])
    with pytest.raises(ConfigError, match=r"system dgx-h100 → dgx-a100-80gb"):
        compare(dataclasses.replace(study, system=get_system("dgx-a100-80gb")), out_dir=out)


def test_report_without_results_is_a_clear_error(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "analysis.cli", "report", str(tmp_path), "-o",
                        str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "run `trainsim compare`, `trainsim sweep` or `trainsim scale`" in r.stderr
    stopped = tmp_path / "stopped" / "parts" / "screen"  # a sweep killed before its ranking
    stopped.mkdir(parents=True)
    pl.DataFrame({"id": ["x"]}).write_parquet(stopped / "part-000001-1.parquet")
    from analysis.report import build_report
    from tracegen.errors import TrainsimError

    with pytest.raises(TrainsimError, match=r"stopped before it ranked them: run it again with "
                                            r"-o .*stopped, which resumes"):
        build_report(tmp_path / "stopped", tmp_path / "o2")


def test_a_damaged_results_directory_is_a_clear_error(tmp_path: Path) -> None:
    """A truncated Parquet file, a results table missing a column the report reads, or a
    broken study.json is named with what to do — polars' and json's own errors had escaped."""
    from analysis.report import build_report
    from tracegen.errors import TrainsimError

    results = pl.DataFrame({"strategy": ["a"], "status": ["screened"], "tp": [1], "pp": [1],
                            "step_time_s": [1.0], "tokens_per_s": [1.0],
                            "peak_memory_GiB": [1.0], "fits": [True]})  # no compute_s
    results.write_parquet(tmp_path / "results.parquet")
    with pytest.raises(TrainsimError, match="lacks the column"):
        build_report(tmp_path, tmp_path / "o")
    (tmp_path / "results.parquet").write_bytes(b"PAR1 truncated")
    with pytest.raises(TrainsimError, match="cannot be read as Parquet"):
        build_report(tmp_path, tmp_path / "o")
    results.with_columns(pl.lit(0.5).alias("compute_s")).write_parquet(
        tmp_path / "results.parquet")
    (tmp_path / "study.json").write_text("{not json")
    with pytest.raises(TrainsimError, match=r"study\.json is not valid JSON"):
        build_report(tmp_path, tmp_path / "o")


def test_a_strategy_too_large_to_replay_keeps_the_fast_paths_answer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """compare (and sweep's replay of its best) does not build a trace past the node limit:
    the row keeps the fast path's step time and says why it was not replayed."""
    from analysis import replay_size
    from analysis.compare import evaluate_strategy
    from analysis.study import study_from_dict

    study = study_from_dict({"model": "gpt-1.7b", "system": "dgx-h100", "gpus": 8,
                             "global_batch_size": 16, "strategies": [{"tp": 2, "pp": 2}]})
    s = study.strategies[0]
    monkeypatch.setattr(replay_size, "MAX_REPLAY_NODES", 1)
    row = evaluate_strategy(study, s, replay_it=True)
    assert row["status"].startswith("screened: not replayed, the replay trace would hold")
    assert row["step_time_s"] == row["fast_step_time_s"] and row["tokens_per_s"] > 0
    monkeypatch.setattr(replay_size, "MAX_REPLAY_NODES", 10**12)
    assert evaluate_strategy(study, s, replay_it=True)["status"] == "replayed"
    # under failures a row chosen for replay carries its end date's P90 even when too large
    # to replay (a scale study's best may be one), a row only screened does not
    failing = study_from_dict({"model": "gpt-1.7b", "system": "dgx-h100", "gpus": 8,
                               "global_batch_size": 16, "strategies": [{"tp": 2, "pp": 2}],
                               "tokens": 1e9,
                               "failures": {"preset": "llama3-16k-h100"}})
    monkeypatch.setattr(replay_size, "MAX_REPLAY_NODES", 1)
    big = evaluate_strategy(failing, s, replay_it=True)
    assert big["status"].startswith("screened: not replayed")
    assert big["time_to_train_p90_s"] >= big["step_time_s"] > 0
    assert evaluate_strategy(failing, s, replay_it=False)["time_to_train_p90_s"] is None


def test_bad_study(tmp_path: Path) -> None:
    f = tmp_path / "s.toml"
    f.write_text('model = "gpt-1.7b"\nsystem = "dgx-h100"\ngpus = 8\nbatch = 8\n')
    with pytest.raises(ConfigError) as info:
        load_study(f)
    assert "unknown key 'batch'" in str(info.value)
    assert "missing required key 'global_batch_size'" in str(info.value)


def test_a_strategys_degrees_are_checked_before_dp_is_derived(tmp_path: Path) -> None:
    """dp follows from gpus / (tp·pp·cp): a zero or text degree had raised ZeroDivisionError
    or ValueError there (found by fuzzing studies)."""
    f = tmp_path / "s.toml"
    f.write_text('model = "gpt-1.7b"\nsystem = "dgx-h100"\ngpus = 8\nglobal_batch_size = 8\n'
                 '[[strategies]]\ntp = 0\npp = "two"\n')
    with pytest.raises(ConfigError) as info:
        load_study(f)
    assert "strategy #1: tp must be a whole number ≥ 1, got 0" in str(info.value)
    assert "strategy #1: pp must be a whole number ≥ 1, got 'two'" in str(info.value)


def test_every_listed_strategys_problems_are_named_at_once(tmp_path: Path) -> None:
    """A study's strategies are checked together, against the model too, as it is read: a
    layout the GPU count does not divide, a misspelt recompute and 16-way TP of 8 KV heads in
    one error (the first alone had been named, and the model's check came only at its replay,
    after the strategies before it had run)."""
    f = tmp_path / "s.toml"
    f.write_text('model = "llama3-70b"\nsystem = "dgx-h100"\ngpus = 1024\n'
                 'global_batch_size = 512\n[[strategies]]\ntp = 8\npp = 3\n'
                 '[[strategies]]\ntp = 8\npp = 4\nrecompute = "fulll"\n'
                 '[[strategies]]\ntp = 16\npp = 4\n[[strategies]]\ntp = 8\npp = 4\n')
    with pytest.raises(ConfigError) as info:
        load_study(f)
    text = str(info.value)
    assert "(3 problems)" in text
    assert "strategy #1: gpus 1024 is not divisible by tp·pp·cp = 24" in text
    assert "strategy #2: recompute must be one of none, selective, full; got 'fulll'" in text
    assert "strategy #3: num_kv_heads 8 is not divisible by tp 16" in text


def test_ranking_by_the_day_nine_runs_in_ten_end_by(tmp_path: Path) -> None:
    """``rank_by = "time_to_train_p90"``: the strategies in the order of the P90 of their end
    date under the study's failures (a risk-averse plan's criterion); refused without
    [failures] (the spread is the failure process's) and for a name it does not know, with
    the three it does."""
    path = write_study(tmp_path)
    path.write_text(path.read_text().replace(
        "tokens = 1e9\n", 'tokens = 1e9\nrank_by = "time_to_train_p90"\n'))
    study = load_study(path)
    assert study.rank_by == "time_to_train_p90"
    frame = compare(study).filter(pl.col("fits"))
    p90 = frame["time_to_train_p90_s"].to_list()
    assert frame.height == 3 and None not in p90 and p90 == sorted(p90)
    assert frame["rank"].to_list() == [1, 2, 3]
    healthy = write_study(tmp_path / "h", failures=False)
    healthy.write_text(healthy.read_text().replace(
        "tokens = 1e9\n", 'tokens = 1e9\nrank_by = "time_to_train_p90"\n'))
    with pytest.raises(ConfigError, match=r"needs \[failures\]: the spread of the end date"):
        load_study(healthy)
    from analysis.report import RANK_WORDS
    from analysis.study import RANK_BY

    assert set(RANK_WORDS) == set(RANK_BY)  # (the report names each ranking)
    healthy.write_text(healthy.read_text().replace('"time_to_train_p90"', '"p90"'))
    with pytest.raises(ConfigError, match="one of 'step_time', 'time_to_train', "
                                          "'time_to_train_p90', got 'p90'"):
        load_study(healthy)


def test_a_sweep_ranked_by_the_p90_screens_by_the_expected_time() -> None:
    """A sweep's screened rows carry no spread (it is worked out for the strategies it
    replays): ranked by the P90 they sort on their expected time, after the replayed ones,
    which sort on their P90 — not in the arbitrary order of an empty key."""
    from analysis.compare import rank

    frame = pl.DataFrame({
        "strategy": ["a", "b", "c", "d", "e"], "fits": [True] * 5,
        "status": ["replayed", "replayed", "screened", "screened", "screened"],
        "step_time_s": [1.0, 1.1, 0.9, 1.2, 1.0],
        "time_to_train_s": [10.0, 9.0, 8.0, 12.0, 7.0],
        "time_to_train_p90_s": [10.5, 11.0, None, None, None]})
    got = rank(frame, "time_to_train_p90", verified_first=True)
    assert got["strategy"].to_list() == ["a", "b", "e", "c", "d"]
    assert rank(frame, "time_to_train", verified_first=True)["strategy"].to_list() == [
        "b", "a", "e", "c", "d"]
    # a frame written before the P90 was a column (a resumed sweep's parts): the expected time
    older = rank(frame.drop("time_to_train_p90_s"), "time_to_train_p90", verified_first=True)
    assert older["strategy"].to_list() == ["b", "a", "e", "c", "d"]


def test_ranking_by_time_to_train_needs_a_token_budget(tmp_path: Path) -> None:
    """Without tokens every time to train is empty and the ranking had been arbitrary."""
    f = tmp_path / "s.toml"
    f.write_text('model = "llama3-8b"\nsystem = "dgx-h100"\ngpus = 16\n'
                 'global_batch_size = 32\nrank_by = "time_to_train"\n')
    with pytest.raises(ConfigError, match="rank_by = 'time_to_train' needs tokens"):
        load_study(f)
    f.write_text(f.read_text() + "tokens = 1e9\n")
    assert load_study(f).rank_by == "time_to_train"


def test_study_values_of_the_wrong_type_are_named_together(tmp_path: Path) -> None:
    """A negative GPU count (which had run as an empty sweep), a quoted number, text for the
    token count, a scalar for a table: each named, in one error, before anything runs."""
    f = tmp_path / "s.toml"
    f.write_text('model = "gpt-1.7b"\nsystem = "dgx-h100"\ngpus = -8\n'
                 'global_batch_size = "64"\ntokens = "lots"\nsearch = 5\nstrategies = [1]\n')
    with pytest.raises(ConfigError) as info:
        load_study(f)
    text = str(info.value)
    for part in ("gpus must be a whole number ≥ 1, got -8",
                 "global_batch_size must be a whole number ≥ 1, got '64'",
                 "tokens must be a number ≥ 0 (tokens to train on), got 'lots'",
                 "search must be a table ([search] in TOML), got 5",
                 "strategies must be a list of tables ([[strategies]] in TOML)"):
        assert part in text


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1.0, 2.5, 40.0, 80.0]) | st.floats(1, 80),
                          st.sampled_from([1e3, 5e5]) | st.floats(1e3, 1e6)),
                min_size=1, max_size=60))  # ties in memory and in throughput drawn often
def test_the_pareto_front_is_what_no_strategy_beats(points: list[tuple[float, float]]) -> None:
    """Every strategy off the front is beaten (as fast or faster at no more memory) by one on
    it, and none on it is beaten by any: the front the report draws."""
    from analysis.plots import pareto_front

    mem, tps = np.array([p[0] for p in points]), np.array([p[1] for p in points])
    front = set(zip(*pareto_front(mem, tps), strict=True))
    for m, t in points:
        beaten_by_front = any(fm <= m and ft >= t for fm, ft in front)
        assert beaten_by_front
        if (m, t) in front:
            assert not any(om <= m and ot > t for om, ot in points)


def test_a_large_sweep_is_drawn_as_a_density() -> None:
    """Past ``DENSE_POINTS`` strategies the scatter (one solid blot at 500 k) becomes a log
    density with the front over it; below, each strategy is a point."""
    from matplotlib.collections import PathCollection, PolyCollection

    from analysis.plots import DENSE_POINTS, pareto

    rng = np.random.default_rng(0)
    for n, kind in ((DENSE_POINTS + 1, PolyCollection), (50, PathCollection)):
        frame = pl.DataFrame({"peak_memory_GiB": rng.uniform(5, 80, n),
                              "tokens_per_s": rng.uniform(1e5, 1e6, n), "fits": [True] * n})
        ax = pareto(frame).axes[0]
        assert isinstance(ax.collections[0], kind)
        assert ax.get_legend_handles_labels()[1][-1].startswith("Pareto front (")


def test_the_heatmap_says_why_a_cell_is_empty() -> None:
    """Each (tp, pp) cell holds its best fitting step time; one where strategies ran but none
    fits says so, and one the results do not hold at all says it was not run — a blank cell
    would read as either."""
    from analysis.plots import tp_pp_heatmap

    frame = pl.DataFrame({"tp": [8, 8, 4, 4], "pp": [8, 16, 16, 16],
                          "step_time_s": [17.34, 18.59, 24.52, 23.0],
                          "fits": [True, True, True, False]})
    assert {t.get_text() for t in tp_pp_heatmap(frame).axes[0].texts} == {
        "17.34", "18.59", "24.52", "not run"}  # (tp 4 pp 16's 23.00 does not fit)
    frame = frame.with_columns(fits=pl.Series([True, True, False, False]))
    assert {t.get_text() for t in tp_pp_heatmap(frame).axes[0].texts} == {
        "17.34", "18.59", "none fits", "not run"}
