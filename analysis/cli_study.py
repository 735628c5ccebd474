"""The study commands of ``trainsim``: validate, resilience, compare, sweep, scale, report."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from analysis.cli_common import (
    app,
    console,
    data_to_stdout,
    note_combined_1f1b,
    note_moe,
    note_precision,
    note_zero2_study,
    output_dir,
    output_file,
    progress_bar,
    sites_words,
    table_file,
    write_json,
    write_table,
)
from tracegen import ConfigError

if TYPE_CHECKING:  # polars is imported where a command needs it (fast CLI start-up)
    import polars as pl

    from analysis.study import Study
    from tracegen.strategy import Strategy


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``section.key=value`` pairs; the value is read as a TOML value (true, 0.5, "text"), or as
    text when it is not one."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: write section.key=value, e.g. "
                              "gpu.flash_attention=false", what="override")
        try:
            value = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw.strip()
        out[key.strip()] = value
    return out


@app.command("validate")
def validate_cmd(
    runs: Annotated[Path, typer.Argument(help="CSV in the public-runs schema "
                                              "(shared/validation/README.md).")],
    out: Annotated[Path | None, typer.Option(
        "--out", help="Write per-row results as CSV (or .parquet).")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write the predicted-vs-measured "
                                              "scatter (PNG).")] = None,
    jobs: Annotated[int, typer.Option(
        min=0, help="Processes predicting rows in parallel (0: one per CPU, at most 4: a deep "
                    "pipeline's row can take ~2 GB; one with --fast).")] = 0,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="Replace a system value for every row, e.g. gpu.flash_attention=false "
                      "for a stack that predates FlashAttention, or set a strategy or model "
                      "field the schema has no column for, e.g. "
                      "strategy.zero3_gather_bucket_params=50000000 or model.dropout=0 "
                      "(repeatable).")] = None,
    fast: Annotated[bool, typer.Option(
        "--fast", help="Predict with the closed-form fast path instead of replay: seconds for "
                       "a large set, within 2% of replay on healthy symmetric runs, no "
                       "compute/communication split.")] = False,
    assume: Annotated[list[str] | None, typer.Option(
        "--assume", help="Fill a schema cell where a row leaves it empty, e.g. "
                         "micro_batch_size=1 (repeatable). Your assumption, not the source's: "
                         "stated per row, and the rows it completes are counted apart.")] = None,
    attention: Annotated[str | None, typer.Option(
        "--attention", help="The attention kernel the runs used, where the presets' (today's: "
                            "FlashAttention-2 on Ampere, cuDNN 9.19 on Hopper) is not it: unfused "
                            "(Megatron 2021-22), flashattention-1 (Ampere, 2022-23), "
                            "flashattention-2, flashattention-3, cudnn (Hopper, 2024), "
                            "cudnn-9.19 (Hopper, measured 2026; Megatron-Bridge 2025-26). "
                            "Rows on a GPU without a published curve for it are skipped, "
                            "saying so.")] = None,
    stack: Annotated[str | None, typer.Option(
        "--stack", help="The framework the runs came from, as trainsim's reference sets are "
                        "validated with it: megatron-bridge, nemo-24.07, "
                        "megatron-moe-modelzoo, megatron-lm-2022, llm-foundry (its overlaps, "
                        "FP8 gathers, fused loss, gradient dtype and attention kernel; "
                        "--set and --attention win over it).")] = None,
) -> None:
    """Predict every published run and compare with its measured step time."""
    from analysis.plots import predicted_vs_measured
    from analysis.stacks import with_stack
    from analysis.validate import validate

    out = table_file(out, "--out", what="the per-row results")
    plot = output_file(plot, "--plot", plot=True)
    overrides, attention = with_stack(stack, parse_overrides(set_ or []), attention)
    with progress_bar() as bar:
        task = bar.add_task("predicting runs", total=None)
        results = validate(runs, progress=lambda i, n: bar.update(task, completed=i, total=n),
                           jobs=jobs if jobs > 0 else 1 if fast else min(os.cpu_count() or 1, 4),
                           overrides=overrides, fast=fast,
                           assume=_parse_assume(assume or []), attention=attention)
    _print_validation(results, runs.name)
    if out is not None:
        write_table(results, out)
    if plot is not None:
        predicted_vs_measured(results).savefig(plot, dpi=120)


def _print_validation(results: pl.DataFrame, name: str) -> None:
    """The per-row table, the |error| summary and the relative accuracy of pairs."""
    import polars as pl

    from analysis.validate import pairs, summarize, summarize_pairs

    table = Table(title=f"Validation: {name}")
    for col in ("id", "status", "predicted s", "measured s", "error %", "memory GiB", "fits"):
        table.add_column(col, justify="right" if col != "status" else "left")
    for r in results.iter_rows(named=True):
        ok = r["status"] == "ok"
        table.add_row(r["id"], r["status"], f"{r['predicted_iter_time_s']:.3f}" if ok else "",
                      f"{r['measured_iter_time_s']:.3f}" if r["measured_iter_time_s"] else "",
                      f"{r['error_pct']:+.1f}" if ok else "",
                      f"{r['predicted_peak_memory_GiB']:.1f}" if ok else "",
                      str(r["fits"]) if ok else "")
    console.print(table)
    n_ok = results.filter(pl.col("status") == "ok").height
    if not n_ok:
        console.print(f"none of the {results.height} rows could be predicted: each status says "
                      "why (a missing input can be given with --assume COLUMN=VALUE, stated per "
                      "row and counted apart)")
        return
    console.print(_frame_table(summarize(results), "|error| summary (%)"))
    n_assumed = results.filter((pl.col("status") == "ok")
                               & pl.col("assumptions").str.contains("--assume")).height
    if n_assumed:
        console.print(f"{n_assumed} of the predicted rows rest on --assume values (their "
                      "assumptions column says which): 'all' and the GPU and source groups count "
                      "them, 'inputs=source' is the verdict on the rows as published")
    pair_frame = pairs(results)
    if pair_frame.height:
        console.print(_frame_table(summarize_pairs(pair_frame), "relative accuracy: pairs of "
                                   "runs of one model from one source (ratio of step times)"))


def _parse_assume(items: list[str]) -> dict[str, Any]:
    """``column=value`` pairs (values read as --set reads them)."""
    bad = [i for i in items if "=" not in i or "." in i.partition("=")[0]]
    if bad:
        raise ConfigError([f"--assume {i!r}: write column=value, e.g. micro_batch_size=1"
                           for i in bad], what="--assume")
    return parse_overrides(items)


def _frame_table(frame: pl.DataFrame, title: str) -> Table:
    """A small summary frame as a table, floats to one decimal."""
    table = Table(title=title)
    for col in frame.columns:
        table.add_column(col, justify="right")
    for row in frame.iter_rows():
        table.add_row(*[f"{v:.1f}" if isinstance(v, float) else str(v) for v in row])
    return table


@app.command("resilience")
def resilience_cmd(
    ctx: typer.Context,
    study_file: Annotated[str, typer.Argument(
        help="Study TOML with a \\[failures] table (see analysis/study.py), or a packaged "
             "study name.")],
    summary: Annotated[Path | None, typer.Option(
        help="Write per-policy results as JSON ('-': to stdout, the printed tables going to "
             "stderr).")] = None,
    plots: Annotated[Path | None, typer.Option(help="Folder for the goodput and "
                                                    "time-to-train plots (PNG).")] = None,
) -> None:
    """Goodput and time-to-train under failures (expected, and P10–P90), per recovery policy."""

    from analysis import plots as P
    from analysis.evaluate import resilience_frame, strategy_dict, summary_dict
    from analysis.mixed import study_fit_hints

    to_stdout = data_to_stdout(ctx, summary)
    summary = None if to_stdout else output_file(summary, "--summary")
    plots = output_dir(plots, "--plots")
    study = _resolve_study(study_file)
    _print_cluster(study)
    if not study.strategies:
        raise ConfigError(
            "the study lists no [[strategies]] for resilience to cost"
            + ("; for its [search] space, `trainsim sweep` ranks every strategy by its time "
               "to train under these failures, and `trainsim report` on its folder writes the "
               "best as a [[strategies]] table to add here" if study.search else ""),
            what="study")
    if not study.tokens:  # (days, GPU-hours and failures of a run of no tokens: all zero)
        raise ConfigError("resilience prices a training run: set tokens (the token budget, "
                          "e.g. tokens = 1.5e12) in the study; without it the days, GPU-hours "
                          "and failures would be those of a run of no tokens", what="study")
    note_zero2_study(x.zero_stage for x in study.strategies if not x.grad_reduce_per_microbatch)
    out: dict[str, Any] = {}
    shapes: dict[str, Any] = {}
    for s, name in zip(study.strategies, _strategy_names(study.strategies), strict=True):
        frame = resilience_frame(study, s)
        out[name] = summary_dict(frame)
        shapes[name] = strategy_dict(frame)
        if not shapes[name]["fits"]:
            shapes[name]["fit_hint"], shapes[name]["shard_hint"] = study_fit_hints(study, s)
        _print_resilience(study, s, name, frame, shapes[name])
        if plots is not None:
            g = frame.filter(frame["policy"] == "global_restart").row(0, named=True)
            P.goodput_of_global_restart(g).savefig(plots / f"goodput_{_file_safe(name)}.png",
                                                   dpi=110)
            P.time_to_train_by_policy(frame).savefig(
                plots / f"time_to_train_{_file_safe(name)}.png", dpi=110)
    write_json({"policies": next(iter(out.values())), "strategies": out,
                "strategy_shapes": shapes}, summary, to_stdout)


def _print_resilience(study: Study, s: Strategy, name: str, frame: Any,
                      shape: dict[str, Any]) -> None:
    """One strategy's policies as a table, then its step, the spread of its end date, its
    failure episodes, snapshots and spares, and why a policy makes no progress."""
    from analysis.evaluate import days_range, episode_lines, snapshot_line, spare_line, spread_line

    mttf_s = frame["job_mttf_s"][0]
    table = Table(title=f"{study.name}: {name} on {s.world_size} GPUs "
                        f"(job MTTF {_duration(mttf_s)})")
    for col in ("policy", "goodput", "days to train", "P10–P90", "GPU-hours", "failures",
                "ckpt interval min", "ckpt s", "persist s", "restart s"):
        table.add_column(col, justify="right")
    for r in frame.iter_rows(named=True):
        table.add_row(r["policy"], f"{r['goodput']:.1%}",
                      f"{r['expected_wall_clock_s'] / 86400:.1f}", days_range(r),
                      f"{r['expected_gpu_hours']:,.0f}", f"{r['expected_failures']:,.0f}",
                      f"{r['checkpoint_interval_s'] / 60:.1f}", f"{r['checkpoint_s']:.3g}",
                      f"{r['persist_s']:.0f}", f"{r['restart_s']:.0f}")
    console.print(table)
    console.print(_resilience_step_line(shape, _capacity_text(study), s))
    first = frame.row(0, named=True)
    console.print(spread_line(first))
    for line in episode_lines(first):
        console.print(line)
    if (snap := snapshot_line(first)) is not None:
        console.print(snap)
    for line in filter(None, map(spare_line, frame.to_dicts())):
        console.print(line)
    if any(r["goodput"] <= 0 for r in frame.iter_rows(named=True)):
        console.print(_no_progress_line(mttf_s, frame.to_dicts(), s.world_size))


def _strategy_names(strategies: Sequence[Strategy]) -> list[str]:
    """Each strategy's full name (schedule, recompute, ZeRO, … — the short label leaves them
    out, and two of the default study's layouts share one), made unique where two coincide."""
    from analysis.compare import strategy_label

    names: list[str] = []
    seen: dict[str, int] = {}
    for s in strategies:
        name = strategy_label(s)
        seen[name] = seen.get(name, 0) + 1
        names.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return names


def _file_safe(name: str) -> str:
    """A strategy name as a file name (a pipeline layout brings '|' and '*')."""
    return re.sub(r"[^A-Za-z0-9._+#-]", "_", name)


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.3g} s"


def _no_progress_line(mttf_s: float, rows: list[dict[str, Any]], gpus: int) -> str:
    """Why a policy's goodput is 0: the job fails before it recovers — the restart and the
    work a failure rolls back past a checkpoint still persisting. A rate per GPU-hour in the
    thousands of times published ones is usually one in another unit (per job, per day); a
    recovery longer than the MTTF by itself points at the storage or the restart tables."""
    from analysis.resilience import FAILURE_PRESETS, HOUR_S

    stuck = [r for r in rows if r["goodput"] <= 0]
    recover = min(float(r["restart_s"]) + float(r.get("persist_s") or 0.0) for r in stuck)
    rate = HOUR_S / (mttf_s * gpus)
    known = ", ".join(f"{f.name} {f.rate_per_gpu_hour:.2g}" for f in FAILURE_PRESETS.values())
    why = (" — more than the MTTF by itself: a restart's checkpoint load and a checkpoint's "
           "persist time run at \\[checkpoint] storage_GBps, the rest is \\[restart]'s"
           if recover > mttf_s and rate <= 100 * max(
               f.rate_per_gpu_hour for f in FAILURE_PRESETS.values())
           else f". rate_per_gpu_hour is per GPU and hour; the presets' rates: {known}")
    return (f"[bold red]no progress[/] under {', '.join(r['policy'] for r in stuck)} "
            f"(goodput 0%): the job fails every {_duration(mttf_s)} on average ({rate:.3g} "
            f"failures per GPU-hour × {gpus:,} GPUs), against {_duration(recover)} or more "
            f"to recover and redo what a failure rolls back{why}")


def _capacity_text(study: Any) -> str:
    """The GPU memory a study's strategies must fit: on a ``[mixed]`` cluster of two
    capacities, each (every stage is checked against its own GPU's)."""
    base = study.system.gpu.hbm_bytes / 2**30
    other = None if study.mixed is None else study.mixed.system.gpu.hbm_bytes / 2**30
    if other is None or round(other) == round(base):
        return f"{base:.0f} GiB"
    return (f"{base:.0f} GiB on {study.system.name}, {other:.0f} GiB on "
            f"{study.mixed.system.name} (each stage against its own)")


def _resilience_step_line(shape: dict[str, Any], capacity: str, s: Strategy) -> str:
    """The failure-free step the policies rest on, and whether the strategy fits: a strategy
    that does not is flagged here as everywhere (its goodput is that of a run that cannot
    start), with the recomputation and the sharding that would make it fit."""
    line = (f"failure-free step {shape['step_time_s']:.3f} s (fast path), "
            f"{shape['failure_free_s'] / 86400:.1f} days; peak memory "
            f"{shape['peak_memory_GiB']:.1f} GiB per GPU")
    if shape["fits"]:
        return f"{line}: fits in {capacity}"
    from analysis.glance import fit_advice

    advice = [f"it fits with {what} ({fields}): {hint['peak_memory_GiB']:.1f} GiB, "
              f"{hint['step_time_s']:.3f} s a step"
              for hint, what, _, fields in fit_advice(shape.get("fit_hint"),
                                                      shape.get("shard_hint"), s)]
    return (f"{line}: [bold red]DOES NOT FIT[/] in {capacity} — these figures are for "
            f"a run that cannot start ("
            + ("; ".join(advice) or "try more pipeline stages or a smaller micro-batch") + ")")


def _study_meta(study: Any, counts: dict[str, int] | None = None) -> dict[str, Any]:
    meta = {"name": study.name, "model": study.model.name, "system": study.system.name,
            "model_ref": study.model_ref, "system_ref": study.system_ref, "gpus": study.gpus,
            "global_batch_size": study.global_batch_size,
            "tokens": study.tokens, "rank_by": study.rank_by, "counts": counts or {},
            "stack": study.stack}
    if counts:  # a sweep's: the space it searched, for the report
        meta["space"] = space_words(study)
    if study.mixed is not None:
        meta["mixed"] = mixed_words(study)
    return meta


def mixed_words(study: Study) -> str:
    """A [mixed] study's cluster in words (None-safe callers check ``study.mixed``)."""
    m = study.mixed
    assert m is not None
    return (f"{study.gpus - m.gpus:,} GPUs on {study.system.name} and {m.gpus:,} on "
            f"{m.system.name} as whole pipeline stages (the first or the last, whichever "
            "steps faster), each strategy's layers "
            + ("split by its stages' speeds" if m.balance else "split evenly")
            + "".join(f"; {text.format(m.rate_factor(table))} as often as [{table}] says"
                      for table, text in _RATE_WORDS.items() if m.rate_factor(table) != 1.0))


_RATE_WORDS = {"failures": "its GPUs fail {:g}×", "fail_slow": "they run slow {:g}×",
               "slow_links": "their NICs slow down {:g}×"}


def _sweep_study(study: str | None, *, model: str | None, system: str | None,
                 gpus: int | None, gbs: int | None, seq_len: int, tokens: float = 0.0,
                 stack: str | None = None) -> Any:
    """The study a sweep searches: a file (or packaged study), or the default space of the job
    the options give — one or the other, every missing option named."""
    from analysis.study import study_from_dict

    job = {"model": model, "system": system, "gpus": gpus, "global_batch_size": gbs}
    extra = {k: v for k, v in (("seq_len", seq_len), ("tokens", tokens), ("stack", stack))
             if v}
    given = [k for k, v in job.items() if v is not None] + list(extra)
    if study is not None:
        if given:
            raise ConfigError(f"give a study file or the job's options, not both (got {study!r} "
                              f"and {', '.join(given)})", what="sweep")
        return _resolve_study(study)
    missing = [f"--{'gbs' if k == 'global_batch_size' else k}" for k, v in job.items()
               if v is None]
    if missing:
        raise ConfigError(f"without a study file a sweep needs {', '.join(missing)} (or give a "
                          "study TOML with a [search] space)", what="sweep")
    data: dict[str, Any] = {**job, **extra}
    st = study_from_dict(data, name="job", base=Path.cwd())
    return dataclasses.replace(st, name=f"{st.model.name} on {gpus:,} GPUs")


def _resolve_study(name_or_file: str) -> Any:
    from importlib import resources

    from analysis.study import load_study

    p = Path(name_or_file)
    if not p.exists():
        packaged = resources.files("analysis.studies").joinpath(f"{name_or_file}.toml")
        if packaged.is_file():
            p = Path(str(packaged))
        else:
            raise ConfigError(f"study {name_or_file!r} is neither a file nor a packaged study "
                              "(analysis/studies/*.toml)", what="study")
    return load_study(p)


def _save_best(results: Any, study: Any, out: Path, timelines: Path) -> None:
    """The best replayed strategy's timeline and, with failures, its recovery policies."""
    from analysis.evaluate import resilience_frame
    from analysis.runner import strategy_id

    best = results.filter(results["status"] == "replayed").head(1)
    if best.is_empty():
        return
    bid = best["id"][0]
    src = timelines / f"{bid}.parquet"
    if src.is_file():
        shutil.copyfile(src, out / "timeline.parquet")
    if study.has_failures:
        by_id = {strategy_id(s): s for s in study.strategies}
        if bid in by_id:
            resilience_frame(study, by_id[bid]).write_parquet(out / "resilience.parquet")


FreshOpt = Annotated[bool, typer.Option(
    "--fresh", help="Start afresh: delete what an earlier run kept in --out/parts (by "
                    "default a re-run of the same study resumes it).")]


@app.command("compare")
def compare_cmd(
    study: Annotated[str, typer.Argument(help="Study TOML, or a packaged study name.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Output directory.")],
    workers: Annotated[int, typer.Option(min=1, help="Local worker processes.")] = 2,
    scheduler: Annotated[str | None, typer.Option(help="Dask scheduler address.")] = None,
    fresh: FreshOpt = False,
) -> None:
    """Generate, replay and rank every strategy a study lists."""
    import json

    from analysis.compare import compare

    st = _resolve_study(study)
    note_precision({x.precision for x in st.strategies} or {"bf16"}, st.system,
                   {x.fp8_recipe for x in st.strategies})
    note_combined_1f1b(x.overlap_moe_ep_comm for x in st.strategies)
    note_moe(st.model)
    note_zero2_study(x.zero_stage for x in st.strategies if not x.grad_reduce_per_microbatch)
    if not st.strategies:
        raise ConfigError("the study lists no [[strategies]]; use `trainsim sweep` for a search "
                          "space", what="study")
    _print_cluster(st)
    output_dir(out, "--out")
    timelines = out / "parts" / "timelines"  # kept with the rows, for a resumed comparison
    kept = 0 if fresh else _kept_rows(out, st)
    _say_fresh(out, fresh)
    with progress_bar() as bar:
        task = bar.add_task("replaying strategies", total=len(st.strategies))
        results = compare(st, timeline_dir=str(timelines), workers=workers,
                          scheduler=scheduler, out_dir=out, fresh=fresh,
                          progress=lambda i, n: bar.update(task, completed=i))
        _save_best(results, st, out, timelines)
    results.write_parquet(out / "results.parquet")
    results.write_csv(out / "results.csv")
    (out / "study.json").write_text(json.dumps(_study_meta(st), indent=1) + "\n")
    _print_ranking(results, f"{st.name}: {st.model.name} on {st.gpus} GPUs ({st.system.name})",
                   st.system.gpu.hbm_GiB)
    _print_best_command(results, st)
    if kept:
        console.print(f"{kept} of {len(st.strategies)} strategies were kept from an earlier run "
                      f"into {out}, not replayed again (--fresh replays all)")


def _say_fresh(out: Path, fresh: bool) -> None:
    """With --fresh, say what an earlier run left that is about to be deleted (nothing is
    dropped unsaid): its part files under OUT/parts, every phase's and count's."""
    if fresh:
        n = sum(1 for _ in out.rglob("parts/**/part-*.parquet")) if out.is_dir() else 0
        if n:
            console.print(f"--fresh: deleting {n} part file{'s' * (n != 1)} an earlier run "
                          f"left under {out}")


def _kept_rows(out: Path, st: Study) -> int:
    """How many of the study's strategies a folder already holds rows of."""
    from analysis.runner import strategy_id
    from analysis.sweep import PartStore

    if not (out / "parts" / "compare").is_dir():
        return 0
    have = set(PartStore(out, "compare").read()["id"].to_list())
    return sum(strategy_id(s) in have for s in st.strategies)


def _print_ranking(results: Any, title: str, capacity_GiB: float) -> None:
    from analysis.report import _fmt, shown_columns

    table = Table(title=title)
    cols = [(k, label) for k, label, _ in shown_columns(results)]
    for k, label in cols:  # a strategy's name is what the row is: folded, never cut short
        table.add_column(label, justify="right", overflow="fold" if k == "strategy" else "ellipsis")
    for r in results.head(15).iter_rows(named=True):
        table.add_row(*[_fmt(k, r.get(k)) for k, _ in cols])
    console.print(table)
    _say_if_nothing_fits(results, capacity_GiB)


def _say_if_nothing_fits(results: Any, capacity_GiB: float) -> None:
    """Where no strategy fits, say so and name the one closest to fitting (a table of rows
    that all say False is easy to misread as a ranking)."""
    import polars as pl

    sized = results.filter(pl.col("peak_memory_GiB").is_not_null())
    if sized.is_empty() or sized["fits"].fill_null(False).any():
        return
    least = sized.sort("peak_memory_GiB").row(0, named=True)
    console.print(f"[bold red]nothing fits[/]: the least memory any strategy needs is "
                  f"{least['peak_memory_GiB']:.1f} GiB a GPU of {capacity_GiB:g} "
                  f"({least['strategy']}); more GPUs, "
                  "a deeper pipeline, a higher ZeRO stage or more recompute may fit — "
                  "`trainsim estimate` on a strategy names the recompute or sharding that "
                  "fits it, where one does")


# A job given by its options instead of a study file (``sweep``, ``scale``)
JobModelOpt = Annotated[str | None, typer.Option(
    help="Without a study: the model (a preset, a model file or a Hugging Face config.json "
         "with --seq-len).")]
JobSystemOpt = Annotated[str | None, typer.Option(help="Without a study: the system.")]
JobGbsOpt = Annotated[int | None, typer.Option(
    help="Without a study: the global batch size (sequences).")]
JobSeqLenOpt = Annotated[int, typer.Option(
    "--seq-len", help="Without a study: tokens a sequence (0: the model's own).")]
JobTokensOpt = Annotated[float, typer.Option(
    help="Without a study: the token budget (days to train, GPU-hours), e.g. 1.5e12.")]
JobStackOpt = Annotated[str | None, typer.Option(
    "--stack", help="Without a study: every strategy as a framework's recipes run it "
                    "(megatron-bridge, nemo-24.07, …; a study file says stack = NAME): its "
                    "values where the space leaves a field and the layout can use it.")]


@app.command("sweep")
def sweep_cmd(
    out: Annotated[Path, typer.Option("-o", "--out", help="Output directory (resumable).")],
    study: Annotated[str | None, typer.Argument(
        help="Study TOML with a \\[search] space; or, instead, --model, --system, --gpus and "
             "--gbs: the default space of that job.")] = None,
    model: JobModelOpt = None,
    system: JobSystemOpt = None,
    gpus: Annotated[int | None, typer.Option(help="Without a study: the GPU count.")] = None,
    gbs: JobGbsOpt = None,
    seq_len: JobSeqLenOpt = 0,
    tokens: JobTokensOpt = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", min=0, help="Replay the best K.")] = 10,
    workers: Annotated[int, typer.Option(min=1, help="Local worker processes.")] = 2,
    scheduler: Annotated[str | None, typer.Option(help="Dask scheduler address, e.g. "
                                                       "tcp://host:8786.")] = None,
    chunk: Annotated[int | None, typer.Option(
        help="Strategies per screening task (default: about an eighth of each worker's "
             "share, 64–4,096; on a Dask cluster, each worker thread's).")] = None,
    fresh: FreshOpt = False,
    stack: JobStackOpt = None,
) -> None:
    """Enumerate a strategy space, screen it with the fast path, replay the best K, rank."""
    import json

    from analysis.sweep import sweep
    from analysis.sweep_verdict import verdict

    st = _sweep_study(study, model=model, system=system, gpus=gpus, gbs=gbs, seq_len=seq_len,
                      tokens=tokens, stack=stack)
    note_precision({x.precision for x in st.strategies} or {"bf16"}, st.system,
                   {x.fp8_recipe for x in st.strategies})
    output_dir(out, "--out")
    _say_fresh(out, fresh)
    _print_space(st)
    _note_space(st)
    with progress_bar() as bar:
        results, counts = sweep(st, out, top_k=top_k, scheduler=scheduler, workers=workers,
                                chunk=chunk, progress=_phase_reporter(bar), fresh=fresh)
    (out / "study.json").write_text(json.dumps(_study_meta(st, counts), indent=1) + "\n")
    console.print(" · ".join(f"{k.replace('_', ' ')}: {v:,}" for k, v in counts.items()))
    if counts["invalid"]:
        _print_invalid_reasons(st, counts["invalid"])
    if not counts["valid"]:  # (an empty table says less than this)
        console.print("nothing to rank: every strategy of the space is invalid (why, above); "
                      "give --gpus a count the layouts' tp·pp·cp divide and --gbs a multiple "
                      "of mbs·dp, or widen the study's \\[search]")
        return
    fitted = counts.get("recomputed_to_fit", 0)
    _print_ranking(results, f"{st.name}: best of {counts['valid']:,} strategies"
                   + (f" and {fitted:,} recomputed to fit" if fitted else ""),
                   st.system.gpu.hbm_GiB)
    said = verdict(results, st.rank_by)
    if said is not None:
        console.print(escape(said.sentence()), soft_wrap=True)
    _print_best_command(results, st)


def _print_best_command(results: Any, st: Study) -> None:
    """#1 as the command that costs it alone (``--ops`` for where its step goes; ``tracegen``
    takes the same flags): what a plan does next with a ranking."""
    from analysis.strategy_row import estimate_command

    fits = results.filter(results["fits"].fill_null(False))
    if fits.height and st.model_ref:
        command = estimate_command(st.model_ref, st.system_ref, fits["flags"][0], st.stack)
        console.print(escape(f"#1 alone: {command}"), soft_wrap=True)
    if fits.height and st.model.document_mask is not None and not st.has_failures:
        _note_data_wait(fits, st)


def _note_data_wait(fits: Any, st: Study) -> None:
    """Under a document mask a study without failures ranks by the mean step; what the
    slowest replica's sequences add to the first three (``analysis.data_stragglers``; a study
    with [failures] has it in its goodput) is said, with what makes it smaller."""
    from analysis.data_stragglers import data_straggler
    from analysis.strategy_row import strategy_from_row

    parts = []
    for i, row in enumerate(fits.head(3).iter_rows(named=True)):
        d = data_straggler(st.model, strategy_from_row(row), st.system)
        assert d is not None  # (a document mask)
        parts.append(f"#{i + 1} +{d.wait_s / row['step_time_s']:.1%} (dp {d.replicas:,})")
    console.print(escape(
        "under the document mask every step also waits for the replica whose sequences "
        f"attended most, not in the ranking: {', '.join(parts)}; fewer replicas with more "
        "sequences each wait less (add [failures] to rank by time to train with it)"),
        soft_wrap=True)


def _print_space(st: Study) -> None:
    """The space searched, each dimension the study leaves out marked as the default's (a
    space of tp and pp alone also searches vpp, micro-batch sizes, recompute, ZeRO and SP)."""
    console.print(escape("search space: " + space_words(st)), soft_wrap=True)
    _print_cluster(st)


def _note_space(st: Study) -> None:
    """What a combined-1F1B estimate, and a ZeRO-2 one, is worth, where the space searched
    runs it (its values checked first: a malformed dimension is refused with its message)."""
    from analysis.sweep import search_space

    space = search_space(st)
    note_combined_1f1b(bool(x) for x in space.get("overlap_moe_ep_comm", []))
    note_moe(st.model)
    if False in space.get("grad_reduce_per_microbatch", [False]):  # (else each reduces so)
        note_zero2_study(int(x) for x in space.get("zero_stage", []))


def _print_cluster(st: Study) -> None:
    if st.stack:  # (a framework's settings on every strategy that can use them)
        from analysis.stacks import get_stack

        chosen = get_stack(st.stack)
        console.print(escape(f"stack {chosen.name} ({chosen.describes}): "
                             + ", ".join(f"{k} = {v!r}" for k, v in chosen.overrides.items())
                             + (f"{', ' if chosen.overrides else ''}attention {chosen.attention}"
                                if chosen.attention else "")
                             + " — on each strategy that leaves the field and can use it"),
                      soft_wrap=True)
    if st.mixed is not None:
        console.print(escape("mixed cluster: " + mixed_words(st)), soft_wrap=True)
    site = st.system.scaleout.site_gpus
    if site and st.gpus > site:  # what the ranking weighs across sites
        console.print(f"{sites_words(st.system.scaleout, st.gpus)}: a group that spans sites "
                      "runs at their links' pace (`trainsim estimate` names which of a "
                      "strategy's do)", soft_wrap=True)
    if st.failures and "weibull_shape" in st.failures and float(
            st.failures["weibull_shape"]) != 1.0:
        console.print(WEIBULL_NOTE, soft_wrap=True)


# A per-GPU Weibull shape does not reach the goodputs: a job's failures are its GPUs' together
WEIBULL_NOTE = (
    "note: weibull_shape shapes each GPU's time to failure; a job's failures are the "
    "superposition of its GPUs' processes, which tends to a Poisson process as they grow in "
    "number (the Palm–Khintchine theorem; Khintchine 1960, Mathematical Methods in the Theory "
    "of Queueing), so the goodputs take the job's MTTF alone and the shape changes "
    "none of them; `analysis.resilience.monte_carlo_wall_s` draws a Weibull job-level process "
    "for a job of a few GPUs")


def space_words(st: Study) -> str:
    """The space a sweep searched, in TOML's words, the dimensions the study left out marked."""
    import json

    from analysis.sweep import search_space

    return " · ".join(f"{k} = {json.dumps(v)}" + ("" if k in st.search else " (default)")
                      for k, v in search_space(st).items())


def _print_invalid_reasons(st: Study, invalid: int) -> None:
    """The commonest reasons the space's combinations were invalid (``sweep.invalid_reasons``):
    a space with none valid otherwise ends in an empty table that says nothing."""
    from analysis.sweep import invalid_reasons

    reasons, seen = invalid_reasons(st)
    of = "" if seen >= invalid else f" (of the first {seen:,})"
    console.print(f"why invalid{of}:")
    for reason, n in reasons:
        console.print(f"  {n:>7,} × {escape(reason)}", soft_wrap=True)


def _phase_reporter(bar: Any) -> Any:
    """A sweep's ``progress`` callback: one bar per phase, with its rate."""
    import time

    tasks: dict[str, Any] = {}
    started: dict[str, float] = {}

    def report(phase: str, done: int, total: int) -> None:
        if phase not in tasks:
            tasks[phase] = bar.add_task(phase, total=total)
            started[phase] = time.perf_counter()
        rate = done / max(time.perf_counter() - started[phase], 1e-9)
        bar.update(tasks[phase], completed=done, total=total,
                   description=f"{phase} ({rate:,.0f} strategies/s)")
    return report


@app.command("scale")
def scale_cmd(
    gpus: Annotated[str, typer.Option(help="GPU counts: 1024,2048,4096 or a doubling range "
                                           "1024..16384.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Output directory (resumable).")],
    study: Annotated[str | None, typer.Argument(
        help="Study TOML (its \\[search] space, failures and token budget), or a packaged "
             "study name; or, instead, --model, --system and --gbs: the default space of that "
             "job.")] = None,
    model: JobModelOpt = None,
    system: JobSystemOpt = None,
    gbs: JobGbsOpt = None,
    seq_len: JobSeqLenOpt = 0,
    tokens: JobTokensOpt = 0.0,
    batch_per_gpu: Annotated[bool, typer.Option(
        "--batch-per-gpu", help="Scale the global batch with the GPU count (the study's batch "
                                "per GPU kept); default: the study's global batch at every "
                                "count.")] = False,
    plot: Annotated[Path | None, typer.Option(help="Write the scaling figure (PNG).")] = None,
    deadline: Annotated[float | None, typer.Option(
        "--deadline", help="Days the run must end within: the fewest GPUs that finish by it in "
                           "nine runs of ten (P90 end date under the study's failures); "
                           "default: the study's deadline_days.")] = None,
    workers: Annotated[int, typer.Option(min=1, help="Local worker processes.")] = 2,
    scheduler: Annotated[str | None, typer.Option(help="Dask scheduler address.")] = None,
    fresh: FreshOpt = False,
    stack: JobStackOpt = None,
) -> None:
    """The study on each GPU count: the best strategy that fits (a sweep, its best replayed),
    throughput, goodput, scaling efficiency, GPU-hours; with --deadline, the fewest GPUs that
    finish in time."""
    from analysis.scaling import check_deadline, deadline_verdict, parse_gpu_counts, scaling

    counts = parse_gpu_counts(gpus)
    st = _sweep_study(study, model=model, system=system,
                      gpus=counts[0] if study is None else None, gbs=gbs, seq_len=seq_len,
                      tokens=tokens, stack=stack)
    if study is None:  # (named by its model: every count is this study's)
        st = dataclasses.replace(st, name=st.model.name)
    if deadline is None:
        deadline = st.deadline_days
    check_deadline(deadline, st.tokens)  # (before any sweep runs)
    output_dir(out, "--out")
    _say_fresh(out, fresh)
    plot = output_file(plot, "--plot", plot=True)
    _print_cluster(st)  # (its stack, mixed cluster, sites: what every count's ranking weighs)
    _note_space(st)
    with progress_bar() as bar:
        frame = scaling(st, counts, out, batch_per_gpu=batch_per_gpu, workers=workers,
                        scheduler=scheduler, progress=_phase_reporter(bar),
                        deadline_days=deadline, fresh=fresh)
    _print_scaling(frame, f"{st.name}: {st.model.name} on {st.system.name}, "
                   + ("global batch per GPU kept" if batch_per_gpu
                      else f"global batch {st.global_batch_size:,}"), p90=st.has_failures,
                   chance=deadline is not None)
    if deadline is not None:
        console.print(deadline_verdict(frame, deadline))
    if plot is not None:
        from analysis import plots

        plots.scaling(frame, title=f"{st.model.name} on {st.system.name}",
                      deadline_days=deadline).savefig(plot, dpi=110)
        console.print(f"figure: {plot}")


def _print_scaling(frame: Any, title: str, *, p90: bool = False, chance: bool = False) -> None:
    """The scaling table; ``p90``: with the P90 end date's column (a study with failures);
    ``chance``: with the chance of ending by the deadline."""
    from analysis.scaling import chance_text

    table = Table(title=title)
    cols = ["GPUs", "batch", "best strategy that fits", "step s", "MFU", "goodput",
            "efficiency", "GPU-h / 10⁹ tok", "days to train"]
    cols += (["P90 days"] if p90 else []) + (["in time"] if chance else [])
    for col in cols:
        table.add_column(col, justify="left" if col.startswith("best") else "right")

    def days(v: float | None) -> str:
        return "–" if v is None else f"{v / 86400:.1f}"

    for r in frame.iter_rows(named=True):
        if r["effective_tokens_per_s"] is None:
            table.add_row(f"{r['gpus']:,}", f"{r['global_batch_size']:,}", str(r["status"]),
                          *["–"] * (len(cols) - 3))
            continue
        table.add_row(f"{r['gpus']:,}", f"{r['global_batch_size']:,}", r["strategy"],
                      f"{r['step_time_s']:.3f}", f"{r['mfu']:.1%}",
                      "–" if r.get("goodput") is None else f"{r['goodput']:.1%}",
                      f"{r['scaling_efficiency']:.0%}", f"{r['gpu_hours_per_btok']:,.0f}",
                      days(r["run_time_s"]), *([days(r["run_time_p90_s"])] if p90 else []),
                      *([chance_text(r["deadline_probability"])] if chance else []))
    console.print(table)


@app.command("report")
def report_cmd(
    results: Annotated[Path, typer.Argument(
        help="Directory written by compare, sweep or scale.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Report directory.")],
) -> None:
    """Write report.html (self-contained), report.md, figures and tables (of a comparison or
    sweep, or of a scaling study)."""
    from analysis.report import build_report
    from analysis.report_scaling import is_scaling_dir

    output_dir(out, "--out")
    html = build_report(results, out)
    table = "scaling.csv" if is_scaling_dir(results) else "results.csv"
    console.print(f"report: {html} (and {out / 'report.md'}, {out / table})")
