"""Scaling reports: ``trainsim report`` on a directory ``trainsim scale`` wrote (``scaling.parquet``
and one sweep per GPU count under ``gpus-<N>/``) — the scaling table, the throughput and cost
figure, where each count's best step goes, and each count's runners-up, as a self-contained
HTML page and a Markdown file beside the figures and the table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl

from analysis import plots as P
from analysis.report import (
    COLUMNS,
    RESULT_COLUMNS_READ,
    _fmt,
    _png,
    read_meta,
    read_table,
    write_pages,
)
from analysis.scaling import SCALING_META, chance_text, deadline_verdict
from tracegen import __version__

SCALING_COLUMNS_READ = ("gpus", "global_batch_size", "status", "strategy", "step_time_s", "mfu",
                        "goodput", "scaling_efficiency", "gpu_hours_per_btok", "run_time_s",
                        "effective_tokens_per_s", "peak_memory_GiB", "valid", "fit")
RUNNERS_UP = 5  # of each count's sweep, listed after its best


def is_scaling_dir(directory: Path) -> bool:
    """A directory ``trainsim scale`` wrote (and no single comparison's results)."""
    return (directory / "scaling.parquet").is_file() and not (
        directory / "results.parquet").is_file()


def build_scaling_report(src: Path, out: Path) -> Path:
    """Write report.html, report.md, figures/ and the scaling table; returns the HTML path."""
    frame = read_table(src / "scaling.parquet", SCALING_COLUMNS_READ)
    for col, dtype in (("run_time_p90_s", pl.Float64), ("meets_deadline", pl.Boolean),
                       ("deadline_probability", pl.Float64)):
        if col not in frame.columns:  # (written before the sixty-fifth session: not known)
            frame = frame.with_columns(pl.lit(None, dtype).alias(col))
    meta = read_meta(src / SCALING_META, "`trainsim scale`")  # ({} before session 42)
    deadline = meta.get("deadline_days")
    html = write_pages(out, "scaling", {
        "title": f"trainsim scaling: {meta.get('name', src.name)}",
        "subtitle": _subtitle(meta), "version": __version__,
        "verdict": deadline_verdict(frame, deadline) if deadline else "",
        "rows": [_row(r) for r in frame.iter_rows(named=True)],
        "counts": [_count(src, g) for g in frame["gpus"].to_list()],
        "columns": [{"key": k, "label": label, "left": left}
                    for k, label, left in COLUMNS if k != "rank"],
        "figures": _figures(frame, meta)})
    frame.write_csv(out / "scaling.csv")
    frame.write_parquet(out / "scaling.parquet")
    return html


def _subtitle(meta: dict[str, Any]) -> str:
    parts = [f"{meta[k]}" for k in ("model", "system") if k in meta]
    if meta.get("batch_per_gpu"):
        parts.append("global batch scaled with the GPU count (weak scaling)")
    elif "global_batch_size" in meta:
        parts.append(f"global batch {meta['global_batch_size']:,} at every count "
                     "(strong scaling)")
    if meta.get("tokens"):
        parts.append(f"{meta['tokens']:.3g} tokens")
    return ", ".join(parts)


def _row(r: dict[str, Any]) -> dict[str, str]:
    """One count's row, formatted (a count where nothing fits keeps its status)."""
    ok = r["effective_tokens_per_s"] is not None

    def num(key: str, fmt: str) -> str:
        return "–" if not ok or r[key] is None else format(r[key], fmt)

    return {"gpus": f"{r['gpus']:,}", "batch": f"{r['global_batch_size']:,}",
            "strategy": r["strategy"] if ok else str(r["status"]),
            "step": num("step_time_s", ".3f"), "tokens": num("effective_tokens_per_s", ",.0f"),
            "mfu": num("mfu", ".1%"), "goodput": num("goodput", ".1%"),
            "efficiency": num("scaling_efficiency", ".0%"),
            "cost": num("gpu_hours_per_btok", ",.0f"),
            "days": _fmt("time_to_train_s", r["run_time_s"] if ok else None),
            "p90": _fmt("time_to_train_p90_s", r["run_time_p90_s"] if ok else None),
            "chance": chance_text(r["deadline_probability"] if ok else None),
            "memory": num("peak_memory_GiB", ".1f"),
            "valid": f"{r['valid']:,}", "fit": f"{r['fit']:,}"}


def _count(src: Path, gpus: int) -> dict[str, Any]:
    """A count's sweep: its best strategies, the table's first (none where its directory is
    gone)."""
    path = src / f"gpus-{gpus}" / "results.parquet"
    if not path.is_file():
        return {"gpus": f"{gpus:,}", "rows": []}
    ranked = read_table(path, RESULT_COLUMNS_READ).head(RUNNERS_UP + 1)
    keys = [k for k, _, _ in COLUMNS if k != "rank"]
    return {"gpus": f"{gpus:,}",
            "rows": [{k: _fmt(k, r.get(k)) for k in keys} for r in ranked.iter_rows(named=True)]}


def _figures(frame: pl.DataFrame, meta: dict[str, Any]) -> list[dict[str, Any]]:
    title = " on ".join(str(meta[k]) for k in ("model", "system") if k in meta)
    figs = [("scaling", "Throughput and cost over the GPU count",
             P.scaling(frame, title=title, deadline_days=meta.get("deadline_days")),
             "Left: tokens/s × goodput of each count's best strategy that fits, against "
             "perfect scaling from the smallest count. Then GPU-hours per billion tokens, "
             "labelled with the scaling efficiency" + (
                 "; right, the days to train, expected and what nine runs in ten end by "
                 "(P90), under the deadline where one was given." if meta.get("tokens")
                 else "."))]
    best = frame.filter(pl.col("effective_tokens_per_s").is_not_null())
    if "compute_s" in best.columns and best["compute_s"].is_not_null().any():
        # (labelled by the count alone: the strategies are in the table above it)
        labelled = best.with_columns(pl.Series(
            "strategy", [f"{g:,} GPUs" for g in best["gpus"].to_list()], dtype=pl.String))
        figs.append(("breakdown", "Where each count's best step goes",
                     P.stacked_breakdown(labelled),
                     "Compute, communication not hidden under compute (per axis), pipeline "
                     "bubble and optimizer of each count's best strategy (the table's), on the "
                     "rank that finishes last: what stops shrinking as GPUs are added."))
    return [{"id": fid, "title": t, "caption": c, "bytes": _png(fig), "file": f"figures/{fid}.png"}
            for fid, t, fig, c in figs]
