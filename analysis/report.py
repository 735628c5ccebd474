"""Batch comparison reports: a self-contained HTML page and a Markdown file (templates rendered
with jinja2), the figures as PNG, and the tables as CSV and Parquet."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import jinja2
import polars as pl
from matplotlib.figure import Figure

from analysis import plots as P
from tracegen import TrainsimError, __version__

COLUMNS = [("rank", "#", False), ("strategy", "strategy", True), ("status", "status", True),
           ("step_time_s", "step s", False), ("tokens_per_s", "tokens/s", False),
           ("mfu", "MFU", False), ("hfu", "HFU", False), ("peak_memory_GiB", "memory GiB", False),
           ("fits", "fits", False), ("goodput", "goodput", False),
           ("time_to_train_s", "days to train", False),
           ("time_to_train_p90_s", "P90 days", False)]


def _fmt(key: str, v: Any) -> str:
    if v is None:
        return "–"
    if key in ("mfu", "hfu", "goodput"):
        return f"{v:.1%}"
    if key in ("time_to_train_s", "time_to_train_p90_s"):
        return f"{v / 86400:.1f}"
    if key == "tokens_per_s":
        return f"{v:,.0f}"
    if key == "peak_memory_GiB":
        return f"{v:.1f}"
    if isinstance(v, float):
        return f"{v:.3f}" if v < 100 else f"{v:,.1f}"
    return str(v)


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


# What the report's tables and figures read of a results file (``compare`` / ``sweep`` write it)
RESULT_COLUMNS_READ = ("strategy", "status", "tp", "pp", "step_time_s", "tokens_per_s",
                       "peak_memory_GiB", "fits", "compute_s")
TIMELINE_COLUMNS_READ = ("rank", "name", "kind", "stream", "start_s", "end_s")
RESILIENCE_COLUMNS_READ = ("policy", "goodput", "expected_wall_clock_s", "expected_failures",
                           "checkpoint_interval_s", "job_mttf_s", "checkpoint_s", "restart_s")


def load_results(directory: str | Path) -> tuple[pl.DataFrame, dict[str, Any]]:
    d = Path(directory)
    path = d / "results.parquet"
    if not path.is_file():
        if any((d / "parts").glob("*/part-*.parquet")):  # a run stopped before its ranking
            raise TrainsimError(f"{d} holds the parts of a comparison or sweep that stopped "
                                f"before it ranked them: run it again with -o {d}, which "
                                "resumes where it stopped, then the report")
        raise TrainsimError(f"{path} not found: run `trainsim compare`, `trainsim sweep` or "
                            f"`trainsim scale` with -o {d} first")
    return read_table(path, RESULT_COLUMNS_READ), read_meta(d / "study.json", "the study")


def read_meta(path: Path, what: str) -> dict[str, Any]:
    """A results directory's JSON description of what it holds ({} where it has none), or a
    TrainsimError that names the file and what to do (``what``: what to run again)."""
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TrainsimError(f"{path} is not valid JSON ({exc}): run {what} again or delete "
                            "the file") from None
    if not isinstance(meta, dict):
        raise TrainsimError(f"{path} is not a JSON object: run {what} again or delete the "
                            "file")
    return meta


def read_table(path: Path, columns: tuple[str, ...]) -> pl.DataFrame:
    """A Parquet file of a results directory with the columns the report reads, or a
    TrainsimError that names the file and what to do (never polars' own from inside)."""
    try:
        frame = pl.read_parquet(path)
    except (OSError, pl.exceptions.PolarsError) as exc:
        raise TrainsimError(f"{path} cannot be read as Parquet ({str(exc).splitlines()[0]}): "
                            "run `trainsim compare` or `trainsim sweep` again") from None
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise TrainsimError(f"{path} lacks the column(s) {', '.join(missing)}: not written by "
                            "this trainsim's compare / sweep; run it again")
    return frame


def build_report(results_dir: str | Path, out_dir: str | Path) -> Path:
    """Write report.html, report.md, figures and tables; returns the HTML path. A directory
    ``trainsim scale`` wrote gets the scaling report (``report_scaling``)."""
    from analysis.report_scaling import build_scaling_report, is_scaling_dir

    src, out = Path(results_dir), Path(out_dir)
    if is_scaling_dir(src):  # (``trainsim scale``'s directory: its own report)
        return build_scaling_report(src, out)
    results, meta = load_results(src)
    html = write_pages(out, "report", _context(results, meta, _figures(results, src), src))
    results.write_csv(out / "results.csv")
    results.write_parquet(out / "results.parquet")
    return html


def write_pages(out: Path, template: str, context: dict[str, Any]) -> Path:
    """``out``/report.html (figures embedded) and report.md (figures linked) from the
    templates ``template``.html.j2 and .md.j2; each of ``context["figures"]`` (its PNG as
    ``bytes``) written to ``out``/figures. Returns the HTML path."""
    (out / "figures").mkdir(parents=True, exist_ok=True)
    figures = context["figures"]
    for f in figures:
        (out / f["file"]).write_bytes(f["bytes"])
        f["png"] = base64.b64encode(f.pop("bytes")).decode()
    loader = jinja2.PackageLoader("analysis", "templates")
    html = jinja2.Environment(loader=loader, autoescape=jinja2.select_autoescape(["html", "j2"]))
    (out / "report.html").write_text(html.get_template(f"{template}.html.j2").render(**context))
    md = jinja2.Environment(loader=loader, autoescape=False)
    linked = [{k: v for k, v in f.items() if k != "png"} for f in figures]
    (out / "report.md").write_text(md.get_template(f"{template}.md.j2").render(
        **{**context, "figures": linked}))
    return out / "report.html"


def shown_columns(results: pl.DataFrame) -> list[tuple[str, str, bool]]:
    """``COLUMNS`` the results hold a value in: a study without failures has no goodput or
    P90 column, rather than one of dashes."""
    return [(k, label, left) for k, label, left in COLUMNS
            if k in results.columns and not (results.height and results[k].is_null().all())]


def _context(results: pl.DataFrame, meta: dict[str, Any], figures: list[dict[str, Any]],
             src: Path) -> dict[str, Any]:
    cols: list[dict[str, Any]] = [{"key": k, "label": label, "left": left}
                                  for k, label, left in shown_columns(results)]
    rows = [{str(c["key"]): _fmt(str(c["key"]), r.get(str(c["key"]))) for c in cols}
            for r in results.head(40).iter_rows(named=True)]
    res_rows = []
    episodes: list[tuple[str, str]] = []
    rpath = src / "resilience.parquet"
    if rpath.is_file():
        from analysis.evaluate import days_range

        policies = read_table(rpath, RESILIENCE_COLUMNS_READ).to_dicts()
        for r in policies:
            res_rows.append({"policy": r["policy"], "goodput": f"{r['goodput']:.1%}",
                             "days": f"{r['expected_wall_clock_s'] / 86400:.1f}",
                             "spread": days_range(r),  # (results before it: "–")
                             "failures": f"{r['expected_failures']:,.0f}",
                             "interval": f"{r['checkpoint_interval_s'] / 60:.1f}",
                             # what a checkpoint blocks (3 figures: a staged copy can take ms)
                             "ckpt": f"{r['checkpoint_s']:.3g}",
                             "restart": f"{r['restart_s']:,.0f}",
                             # (results written before it: not given)
                             "persist": (f"{r['persist_s']:,.0f}" if r.get("persist_s")
                                         is not None else "–")})
        if res_rows:  # the study's [fail_slow] and [slow_links] episodes, in those goodputs,
            # and checkpoint snapshots that overfill a host
            from analysis.evaluate import episode_sentences, snapshot_line, spare_line

            episodes = episode_sentences(r)
            if (snap := snapshot_line(r)) is not None:
                episodes.append(("snapshots", snap))
            episodes += [("spares", line) for line in map(spare_line, policies) if line]
    title = meta.get("title") or f"trainsim: {meta.get('name', 'strategy comparison')}"
    subtitle = ", ".join(f"{k} {meta[k]}" for k in ("model", "system", "gpus",
                                                     "global_batch_size") if k in meta)
    if meta.get("mixed"):
        subtitle += f"; mixed cluster: {meta['mixed']}"
    return {"title": title, "subtitle": subtitle, "version": __version__, "columns": cols,
            "rows": rows, "figures": figures, "resilience_rows": res_rows,
            "episodes": [{"id": eid, "text": text} for eid, text in episodes],
            "rank_by": RANK_WORDS.get(str(meta.get("rank_by", "step_time")), "step time"),
            "counts": meta.get("counts", {}), "space": meta.get("space", ""),
            "verdict": _verdict(results, meta), "best": _best(results, meta),
            "nothing": NOTHING_RANKED}


# What a report says where its results hold no strategy (a sweep whose space is all invalid)
NOTHING_RANKED = ("Nothing to rank: no strategy of the space was valid (trainsim sweep printed "
                  "why, rule by rule, and what to change).")


# How the report names a study's ranking (``analysis.study.RANK_BY``).
RANK_WORDS = {"step_time": "step time", "time_to_train": "time to train",
              "time_to_train_p90": "P90 time to train, the day nine runs in ten end by"}


def _verdict(results: pl.DataFrame, meta: dict[str, Any]) -> str:
    """A sweep's (``sweep_verdict``): whether #1 stands against what it only screened."""
    from analysis.sweep_verdict import verdict

    needed = {"status", "fits", "step_time_s", "fast_step_time_s", "time_to_train_s"}
    if not meta.get("counts") or not needed <= set(results.columns):
        return ""
    said = verdict(results, str(meta.get("rank_by", "step_time")))
    return said.sentence() if said else ""


def _best(results: pl.DataFrame, meta: dict[str, Any]) -> dict[str, str]:
    """#1 that fits as the ``trainsim estimate`` command of it and as a study's
    ``[[strategies]]`` table ({} for rows of an earlier trainsim, which lack the fields)."""
    from analysis.strategy_row import (
        FIELD_COLUMNS,
        estimate_command,
        strategy_from_row,
        strategy_toml,
    )

    if not {"flags", *FIELD_COLUMNS} <= set(results.columns) or not meta.get("model_ref"):
        return {}
    fits = results.filter(pl.col("fits").fill_null(False) & pl.col("flags").is_not_null())
    if not fits.height:
        return {}
    row = fits.row(0, named=True)
    return {"command": estimate_command(meta["model_ref"], meta["system_ref"], row["flags"],
                                        meta.get("stack") or ""),
            "toml": strategy_toml(strategy_from_row(row))}


def _figures(results: pl.DataFrame, src: Path) -> list[dict[str, Any]]:
    if not results.height:  # (nothing ranked: no figure of nothing)
        return []
    figs: list[tuple[str, str, Figure, str]] = [
        ("breakdown", "Time breakdown per strategy", P.stacked_breakdown(results),
         "Compute, communication not hidden under compute (per axis), pipeline bubble and "
         "optimizer, on the rank that finishes last."),
        ("pareto", "Throughput vs memory", P.pareto(results),
         "Each point a strategy that fits; the red line is the Pareto front."),
        ("heatmap", "tp × pp", P.tp_pp_heatmap(results),
         "Best step time for each tensor- and pipeline-parallel degree."),
    ]
    tl = src / "timeline.parquet"
    if tl.is_file():
        figs.append(("timeline", "Pipeline timeline of the best strategy",
                     P.pipeline_timeline(read_table(tl, TIMELINE_COLUMNS_READ)),
                     "The first simulated ranks (one per pipeline stage in representative "
                     "mode): forward, backward and communication."))
    rpath = src / "resilience.parquet"
    if rpath.is_file():
        frame = read_table(rpath, RESILIENCE_COLUMNS_READ)
        g = frame.filter(pl.col("policy") == "global_restart").row(0, named=True)
        figs.append(("goodput", "Goodput vs checkpoint interval",
                     P.goodput_of_global_restart(g),
                     "Global restart from storage; Young's and Daly's optima marked."))
        figs.append(("policies", "Time to train by recovery policy",
                     P.time_to_train_by_policy(frame),
                     "Expected wall-clock days for the token budget under the failure "
                     "scenario."))
    out = []
    for fid, title, fig, caption in figs:
        out.append({"id": fid, "title": title, "caption": caption, "bytes": _png(fig),
                    "file": f"figures/{fid}.png"})
    return out
