"""Scaling: one study on several GPU counts — the planner's question of how many GPUs to use.

At each count a sweep (``analysis.sweep``) finds the fastest strategy that fits; the row keeps
it with what the whole run costs there: step time, MFU, goodput under the study's failures
(more GPUs fail more often: ``FailureModel.job_mttf_s``), time to train and GPU-hours. Time to
train falls as GPUs are added while GPU-hours grow — pipeline bubbles, exposed communication
and failures do not shrink with the work per GPU — and the table says where.

The global batch is the study's at every count (strong scaling), or grows with the count
(``batch_per_gpu``: the study's batch per GPU kept, weak scaling). Each count's sweep is written
to ``gpus-<N>/`` under the output directory, resumable as any sweep is; the scaling table to
``scaling.parquet`` and ``scaling.csv``.

A deadline (``deadline_days``) turns the table into the planner's answer: the fewest GPUs whose
run ends by it in nine runs of ten — the P90 of the end date (``analysis.wall_spread``, of each
count's best, the row chosen for replay) where the study has failures, the run's time where it
has none (``fewest_meeting``) — and each count's chance of ending in time
(``deadline_chance``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import polars as pl

from analysis import jsonout
from analysis.resilience import DAY_S
from analysis.study import Study
from analysis.sweep import SCHEMA, Progress, sweep
from tracegen import ConfigError
from tracegen._config import is_finite_number

SECONDS_PER_HOUR = 3600.0
SCALING_META = "scaling.json"  # what the study was: the report's title and subtitle
# the scaling table's columns besides the best strategy's result row (``compare.RESULT_COLUMNS``)
SCALING_COLUMNS: dict[str, Any] = {
    "gpus": pl.Int64, "global_batch_size": pl.Int64, "valid": pl.Int64, "fit": pl.Int64,
    "effective_tokens_per_s": pl.Float64, "speedup": pl.Float64,
    "scaling_efficiency": pl.Float64, "gpu_hours_per_btok": pl.Float64,
    "run_time_s": pl.Float64, "gpu_hours": pl.Float64, "run_time_p90_s": pl.Float64,
    "meets_deadline": pl.Boolean, "deadline_probability": pl.Float64,
}
# a row: the count's columns, then its best strategy's result row (as a sweep writes it)
_SCHEMA = {**SCALING_COLUMNS, **{k: v for k, v in SCHEMA.items() if k not in SCALING_COLUMNS}}


def parse_gpu_counts(text: str) -> tuple[int, ...]:
    """GPU counts from the CLI: a comma list (``1024,2048,4096``) or a doubling range
    (``1024..16384``: 1,024, 2,048, …, 16,384), in increasing order."""
    text = text.strip()
    try:
        if ".." in text:
            lo_s, hi_s = text.split("..", 1)
            lo, hi = int(lo_s), int(hi_s)
            if lo < 1 or hi < lo:
                raise ValueError
            counts = [lo]
            while counts[-1] * 2 <= hi:
                counts.append(counts[-1] * 2)
        else:
            counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--gpus {text!r}: give whole GPU counts as a comma list "
                          "(1024,2048,4096) or a doubling range (1024..16384)",
                          what="scaling") from None
    return check_gpu_counts(counts)


def check_gpu_counts(counts: Sequence[int]) -> tuple[int, ...]:
    """The counts, sorted, once each; a clear error for none or a count below 1."""
    bad = [n for n in counts if isinstance(n, bool) or not isinstance(n, int) or n < 1]
    if bad or not counts:
        raise ConfigError(f"GPU counts must be whole numbers ≥ 1, at least one; got "
                          f"{list(counts)}", what="scaling")
    return tuple(sorted(set(counts)))


def study_at(study: Study, gpus: int, *, batch_per_gpu: bool = False) -> Study:
    """The study on ``gpus`` GPUs: its search space (listed strategies, which fix dp for the
    study's own count, are left out), its failures and checkpoints; the global batch the
    study's, or with ``batch_per_gpu`` scaled with the count."""
    gbs = study.global_batch_size
    if batch_per_gpu:
        scaled = gbs * gpus
        if scaled % study.gpus:
            raise ConfigError(f"a global batch of {gbs} on {study.gpus} GPUs scales to "
                              f"{scaled / study.gpus:g} sequences on {gpus}, not a whole "
                              "number; choose GPU counts that keep the batch per GPU whole",
                              what=f"study {study.name!r}")
        gbs = scaled // study.gpus
    return dataclasses.replace(study, name=f"{study.name}-{gpus}gpus", gpus=gpus,
                               global_batch_size=gbs, strategies=())


def scaling(study: Study, gpu_counts: Sequence[int], out_dir: str | Path, *,
            batch_per_gpu: bool = False, top_k: int = 1, workers: int | None = None,
            scheduler: str | None = None, progress: Progress | None = None,
            deadline_days: float | None = None, fresh: bool = False) -> pl.DataFrame:
    """One row per GPU count: the best strategy of its sweep (replayed: ``top_k`` ≥ 1), or
    where none fits, the count with its status; ``fresh``: each count's sweep folder is
    started afresh (``sweep``'s). ``progress`` is called as the sweeps' is,
    with the count in the phase's name. With ``deadline_days`` (default: the study's), each
    row says whether its run ends by then in nine runs of ten (``meets_deadline``; null where
    that is not known)."""
    if deadline_days is None:
        deadline_days = study.deadline_days
    check_deadline(deadline_days, study.tokens)
    if top_k < 1:
        raise ConfigError(f"top_k must be at least 1 (the best is replayed), got {top_k}",
                          what="scaling")
    if study.mixed is not None:
        raise ConfigError("a study with a [mixed] table fixes how many of its GPUs are the "
                          "other system's, which a scaling study varies: sweep it at each "
                          "count (`trainsim sweep`), or scale the study without [mixed]",
                          what=f"study {study.name!r}")
    counts = check_gpu_counts(gpu_counts)
    studies = [study_at(study, n, batch_per_gpu=batch_per_gpu) for n in counts]  # fail early
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n, sub in zip(counts, studies, strict=True):
        phase_progress = None if progress is None else _prefixed(progress, f"{n:,} GPUs: ")
        ranked, tally = sweep(sub, out / f"gpus-{n}", top_k=top_k, workers=workers,
                              scheduler=scheduler, progress=phase_progress, fresh=fresh)
        rows.append(_row(sub, ranked, tally, deadline_days))
    frame = _derived(pl.DataFrame(rows, schema=_SCHEMA), study.tokens,
                     failures=study.has_failures, deadline_days=deadline_days)
    for name, write in (("scaling.parquet", frame.write_parquet), ("scaling.csv",
                                                                   frame.write_csv)):
        write(out / name)
    meta = {"name": study.name, "model": study.model.name, "system": study.system.name,
            "global_batch_size": study.global_batch_size, "batch_per_gpu": batch_per_gpu,
            "tokens": study.tokens, "failures": study.has_failures, "gpus": list(counts),
            "deadline_days": deadline_days}
    (out / SCALING_META).write_text(jsonout.dumps(meta, indent=1))  # (``report_scaling``)
    return frame


def _prefixed(progress: Progress, prefix: str) -> Progress:
    return lambda phase, done, total: progress(prefix + phase, done, total)


def _row(study: Study, ranked: pl.DataFrame, tally: dict[str, int],
         deadline_days: float | None = None) -> dict[str, Any]:
    """The best fitting strategy of one count's ranked sweep, with the count, or (none fits)
    the count and a status that says why; under failures and a deadline, with the chance its
    run ends by then (``deadline_chance``)."""
    fits = ranked.filter(pl.col("fits").fill_null(False))
    base = {"gpus": study.gpus, "global_batch_size": study.global_batch_size,
            "valid": tally["valid"], "fit": fits.height}
    if fits.is_empty():
        why = ("no valid strategy (the search space has no layout of this many GPUs for a "
               f"global batch of {study.global_batch_size})" if not tally["valid"] else
               f"none of {tally['valid']:,} valid strategies fits in memory")
        return {**base, "status": why}
    best = {k: v for k, v in fits.row(0, named=True).items() if k != "rank"}
    if deadline_days and study.has_failures:
        best["deadline_probability"] = deadline_chance(study, best, deadline_days * DAY_S)
    return {**best, **base}


def deadline_chance(study: Study, row: dict[str, Any], deadline_s: float) -> float | None:
    """The chance that a result row's run ends by ``deadline_s`` under the study's failures:
    the global restart's end-date distribution (``analysis.wall_spread``) at the row's step —
    the same whose P90 the row carries (``time_to_train_p90_s``)."""
    from analysis.compare import failure_columns
    from analysis.mixed import placed_fast
    from analysis.strategy_row import strategy_from_row

    s, fast, placed = placed_fast(study, strategy_from_row(row))
    got = failure_columns(study, s, row["step_time_s"], fast, placed, spread=True,
                          by_s=deadline_s)["deadline_probability"]
    return None if got is None else float(got)


def check_deadline(deadline_days: float | None, tokens: float) -> None:
    """A deadline is a positive number of days, and needs the token budget it is about."""
    if deadline_days is None:
        return
    if not is_finite_number(deadline_days) or deadline_days <= 0:
        raise ConfigError(f"a deadline is a number of days > 0, got {deadline_days!r}",
                          what="scaling")
    if tokens <= 0:
        raise ConfigError("a deadline needs the run's token budget (the study's tokens, or "
                          "--tokens): without it no count has a time to train", what="scaling")


def _derived(frame: pl.DataFrame, tokens: float, *, failures: bool = False,
             deadline_days: float | None = None) -> pl.DataFrame:
    """What the counts are compared by. Throughput is tokens per second times goodput (1
    without failures): it compares strong and weak scaling alike. Against the smallest count
    with a result: the speed-up and the scaling efficiency, speed-up × smallest count / count
    (1 = throughput grows as the GPUs). GPU-hours per billion tokens; with a token budget, the
    run's time (the resilience model's expected time to train where the study has failures)
    and its GPU-hours, and what nine runs in ten end by: the P90 of the end date with
    failures (the best's, chosen for replay, on its replayed or fast-path step), the run's
    time without (nothing varies it). With a deadline, whether that is within it."""
    eff = pl.col("tokens_per_s") * pl.col("goodput").fill_null(1.0)
    healthy = pl.lit(tokens) / pl.col("tokens_per_s") if tokens > 0 else pl.lit(None, pl.Float64)
    run = pl.coalesce(pl.col("time_to_train_s"), healthy)
    p90 = pl.col("time_to_train_p90_s") if failures else run
    frame = frame.with_columns(
        eff.alias("effective_tokens_per_s"), run.alias("run_time_s"),
        p90.alias("run_time_p90_s")).with_columns(
        (pl.col("run_time_p90_s") <= deadline_days * DAY_S if deadline_days
         else pl.lit(None, pl.Boolean)).alias("meets_deadline"),
        # (without failures nothing varies the end: in time or not)
        (pl.col("deadline_probability") if failures or not deadline_days else
         (pl.col("run_time_s") <= deadline_days * DAY_S).cast(pl.Float64)
         ).alias("deadline_probability"),
        (pl.col("run_time_s") * pl.col("gpus") / SECONDS_PER_HOUR).alias("gpu_hours"),
        (pl.col("gpus") * 1e9 / (pl.col("effective_tokens_per_s") * SECONDS_PER_HOUR)
         ).alias("gpu_hours_per_btok"))
    ok = frame.filter(pl.col("effective_tokens_per_s").is_not_null())
    if ok.is_empty():
        return frame
    base_eff, base_gpus = ok["effective_tokens_per_s"][0], ok["gpus"][0]
    speedup = pl.col("effective_tokens_per_s") / base_eff
    return frame.with_columns(speedup.alias("speedup"),
                              (speedup * base_gpus / pl.col("gpus")).alias("scaling_efficiency"))


def fewest_meeting(frame: pl.DataFrame) -> dict[str, Any] | None:
    """The row of the fewest GPUs whose run ends by the deadline in nine runs of ten (the
    table's ``meets_deadline``), or None where no count does."""
    ok = frame.filter(pl.col("meets_deadline").fill_null(False)).sort("gpus")
    return ok.row(0, named=True) if ok.height else None


def chance_text(p: float | None) -> str:
    """A probability as a planner reads it: near-certain ends said so, not rounded to 100%."""
    if p is None:
        return "–"
    if p > 0.999:
        return ">99.9%"
    if p < 0.001:
        return "<0.1%"
    return f"{p:.1%}"


def deadline_verdict(frame: pl.DataFrame, deadline_days: float) -> str:
    """One sentence: the fewest GPUs that finish by the deadline in nine runs of ten, or why
    none does (each count's P90 over it, or not known)."""
    best = fewest_meeting(frame)
    if best is not None:
        chance = best.get("deadline_probability")
        return (f"Deadline {deadline_days:g} days: {best['gpus']:,} GPUs is the fewest that "
                f"finishes by it in nine runs of ten ({best['strategy']}: P90 "
                f"{best['run_time_p90_s'] / DAY_S:.1f} days, expected "
                f"{best['run_time_s'] / DAY_S:.1f}"
                + ("" if chance is None else f", in time with probability {chance_text(chance)}")
                + f"; {best['gpu_hours']:,.0f} GPU-hours)")
    known = frame.filter(pl.col("run_time_p90_s").is_not_null()).sort("gpus")
    if not known.height:
        return (f"Deadline {deadline_days:g} days: no count has a strategy that fits, so none "
                "has an end date")
    last = known.row(known.height - 1, named=True)
    return (f"Deadline {deadline_days:g} days: no count finishes by it in nine runs of ten; "
            f"the largest with a result, {last['gpus']:,} GPUs, ends by "
            f"{last['run_time_p90_s'] / DAY_S:.1f} days (P90): add GPUs, or a "
            "faster strategy space")


__all__ = ["chance_text", "deadline_chance", "deadline_verdict", "fewest_meeting",
           "parse_gpu_counts", "scaling", "study_at"]
