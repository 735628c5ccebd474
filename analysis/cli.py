"""The ``trainsim`` command line. Catches only trainsim's own errors and prints them plainly."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import polars as pl
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from tracegen import ConfigError, Strategy, TrainsimError, generate, model_names, resolve_model
from tracegen.catalog import get_model, model_source
from tracegen.traceset import TraceSetSummary
from tracegen.units import GiB

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="trainsim: trace-driven performance modeling of distributed training.")
# Wide enough for the result tables when output goes to a file or a CI log (not a terminal).
console = Console(width=None if sys.stdout.isatty() else 150)


@app.command("catalog")
def catalog_cmd() -> None:
    """List the preset models."""
    table = Table(title="Preset models")
    for col in ("name", "params (B)", "layers", "hidden", "heads/kv", "ffn", "vocab", "seq",
                "source"):
        table.add_column(col)
    for name in model_names():
        m = get_model(name)
        table.add_row(name, f"{m.num_params() / 1e9:.1f}", str(m.num_layers), str(m.hidden_size),
                      f"{m.num_attention_heads}/{m.num_kv_heads}", str(m.ffn_hidden_size),
                      str(m.vocab_size), str(m.seq_len), model_source(name))
    console.print(table)


@app.command("tracegen")
def tracegen_cmd(
    model: Annotated[str, typer.Option(help="Preset name (see `trainsim catalog`) or a "
                                            "TOML/JSON model file.")],
    gpus: Annotated[int, typer.Option(help="GPU count; dp = gpus / (tp·pp·cp).")],
    mbs: Annotated[int, typer.Option(help="Micro-batch size (sequences).")],
    gbs: Annotated[int, typer.Option(help="Global batch size (sequences per step).")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Output directory.")],
    tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
    vpp: Annotated[int, typer.Option(help="Virtual stages per rank (interleaved 1F1B).")] = 1,
    sp: Annotated[bool, typer.Option("--sp", help="Sequence parallelism.")] = False,
    schedule: Annotated[str, typer.Option(help="gpipe | 1f1b | interleaved_1f1b")] = "1f1b",
    recompute: Annotated[str, typer.Option(help="none | selective | full")] = "none",
    zero: Annotated[int, typer.Option(help="ZeRO stage 0-3 (1 = distributed optimizer).")] = 0,
    precision: Annotated[str, typer.Option(help="bf16 | fp16 | fp8")] = "bf16",
    first_stage_layers: int = 0, last_stage_layers: int = 0,
    mode: Annotated[str, typer.Option(help="full | representative")] = "representative",
    system: Annotated[str | None, typer.Option(help="Flag ranks whose estimated memory exceeds "
                                                    "this system's GPU memory.")] = None,
    name: Annotated[str, typer.Option(help="Workload name: files are NAME.RANK.et")] = "trainsim",
) -> None:
    """Generate the per-rank Chakra execution traces of one training step."""
    spec = resolve_model(model)
    denom = tp * pp * cp
    if gpus < 1 or denom < 1 or gpus % denom:
        raise ConfigError(f"--gpus {gpus} is not divisible by tp·pp·cp = {tp}·{pp}·{cp} = {denom}; "
                          "choose a GPU count that is a multiple of it", what="strategy")
    strategy = Strategy(tp=tp, pp=pp, cp=cp, ep=ep, dp=gpus // denom, vpp=vpp,
                        sequence_parallel=sp, micro_batch_size=mbs, global_batch_size=gbs,
                        schedule=schedule, recompute=recompute, zero_stage=zero,  # type: ignore[arg-type]
                        precision=precision,  # type: ignore[arg-type]
                        first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers)
    with _progress() as bar:
        task = bar.add_task("writing ranks", total=None)
        summary = generate(spec, strategy, out, mode=mode, name=name, gpus=gpus,  # type: ignore[arg-type]
                           progress=lambda i, n: bar.update(task, completed=i, total=n))
    capacity = None
    if system is not None:
        from replay import resolve_system

        capacity = resolve_system(system).gpu.hbm_GiB
    print_summary(summary, strategy, capacity_GiB=capacity)


@app.command("replay")
def replay_cmd(
    trace: Annotated[Path, typer.Argument(help="Trace-set directory, or a workload prefix "
                                               "path/name for path/name.<rank>.et")],
    system: Annotated[str, typer.Option(help="Preset system (see `trainsim systems`) or a TOML "
                                             "system file.")],
    comm_groups: Annotated[Path | None, typer.Option(help="ASTRA-sim comm-group JSON.")] = None,
    timeline: Annotated[Path | None, typer.Option(help="Write the Perfetto/Chrome trace JSON "
                                                       "of the simulated timeline.")] = None,
    summary: Annotated[Path | None, typer.Option(help="Write the step metrics as JSON.")] = None,
    compute: Annotated[str, typer.Option(help="model | trace: time compute nodes with the GPU "
                                              "model or by their duration_micros")] = "model",
    astra_compat: Annotated[bool, typer.Option("--astra-compat", help="ASTRA-sim-compatible "
                                               "network: one flat ring per group, GB = 2^30.")]
    = False,
    no_fold: Annotated[bool, typer.Option("--no-fold", help="Simulate every rank of a full-mode "
                                          "set even when it is provably symmetric.")] = False,
    scenario: Annotated[Path | None, typer.Option(help="Scenario TOML: stragglers, degraded "
                                                       "links, heterogeneous GPUs.")] = None,
) -> None:
    """Simulate one training step of a Chakra trace set on a system."""
    import json

    from replay import load_trace_set, replay

    if compute not in ("model", "trace"):
        raise ConfigError(f"--compute must be 'model' or 'trace', got {compute!r}")
    with _progress() as bar:
        task = bar.add_task("reading traces", total=None)
        fold = not (no_fold or astra_compat or scenario is not None)
        ts = load_trace_set(trace, comm_groups=comm_groups, fold=fold,
                            progress=lambda i, n: bar.update(task, completed=i, total=n))
        bar.update(task, description="simulating", completed=0, total=ts.num_nodes)
        result = replay(ts, system, compute=compute, astra_compat=astra_compat,  # type: ignore[arg-type]
                        scenario=scenario,
                        progress=lambda i, n: bar.update(task, completed=i, total=n))
    if timeline is not None:
        result.to_perfetto(timeline)
    if summary is not None:
        summary.write_text(json.dumps(result.metrics, indent=1) + "\n")
    _print_replay(result)


def _print_replay(result: Any) -> None:
    m = result.metrics
    line = (f"step time [bold]{m['step_time_s']:.4f} s[/] on {m['system']}: {m['ranks']} ranks "
            f"({m['ranks_simulated']} simulated), {m['nodes']:,} nodes")
    if "tokens_per_s" in m:
        line += (f"; {m['tokens_per_s']:,.0f} tokens/s, MFU {m['mfu']:.1%}, "
                 f"HFU {m['hfu']:.1%}")
    console.print(line)
    if "fits" in m:
        verdict = "fits" if m["fits"] else "[bold red]DOES NOT FIT[/]"
        console.print(f"peak memory {m['peak_memory_GiB']:.1f} GiB per GPU: {verdict} in "
                      f"{m['system']}'s GPU memory")
    if m.get("folded"):
        console.print(f"[dim]folded: every rank provably runs its pipeline stage's program, so "
                      f"{m['ranks_simulated']} stage representatives were simulated (exact); "
                      "--no-fold simulates every rank[/]")
    table = Table(title="Per-rank breakdown (s)")
    cols = ["rank", "compute_s", "exposed_comm_s", "overlapped_comm_s", "idle_s"]
    for c in cols:
        table.add_column(c, justify="right")
    frame = result.breakdown
    if frame.height > 16:
        frame = frame.sort("end_s", descending=True).head(16).sort("rank")
        table.caption = "the 16 ranks that finish last"
    for row in frame.iter_rows(named=True):
        table.add_row(str(row["rank"]), *[f"{row[c]:.4f}" for c in cols[1:]])
    console.print(table)
    if m.get("comm_time_by_axis_s"):
        console.print("communication time by axis (busiest rank): " + ", ".join(
            f"{a} {t:.4f} s" for a, t in m["comm_time_by_axis_s"].items()))
    waits = result.waits
    if m.get("scenario") and waits.height:
        late = (waits.group_by("last_rank").agg(pl.len().alias("collectives"),
                                                pl.col("wait_s").sum().alias("others_wait_s"))
                .sort("others_wait_s", descending=True).head(5))
        console.print(f"scenario {m['scenario']}: who the collectives wait for — " + "; ".join(
            f"rank {r['last_rank']} last in {r['collectives']} collectives "
            f"(others waited {r['others_wait_s']:.4f} s)" for r in late.iter_rows(named=True)))


@app.command("validate")
def validate_cmd(
    runs: Annotated[Path, typer.Argument(help="CSV in the public-runs schema "
                                              "(shared/validation/README.md).")],
    out: Annotated[Path | None, typer.Option("--out", help="Write per-row results as CSV.")]
    = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write the predicted-vs-measured "
                                              "scatter (PNG).")] = None,
) -> None:
    """Predict every published run and compare with its measured step time."""
    from analysis.plots import predicted_vs_measured
    from analysis.validate import summarize, validate

    with _progress() as bar:
        task = bar.add_task("predicting runs", total=None)
        results = validate(runs, progress=lambda i, n: bar.update(task, completed=i, total=n))
    table = Table(title=f"Validation: {runs.name}")
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
    summary = summarize(results)
    st = Table(title="|error| summary (%)")
    for col in summary.columns:
        st.add_column(col, justify="right")
    for row in summary.iter_rows():
        st.add_row(*[f"{v:.1f}" if isinstance(v, float) else str(v) for v in row])
    console.print(st)
    if out is not None:
        results.write_csv(out)
    if plot is not None:
        predicted_vs_measured(results).savefig(plot, dpi=120)


@app.command("resilience")
def resilience_cmd(
    study_file: Annotated[Path, typer.Argument(help="Study TOML with [failures] (see "
                                                    "analysis/study.py).")],
    summary: Annotated[Path | None, typer.Option(help="Write per-policy results as JSON.")]
    = None,
    plots: Annotated[Path | None, typer.Option(help="Folder for the goodput and "
                                                    "time-to-train plots (PNG).")] = None,
) -> None:
    """Goodput and expected time-to-train under failures, per recovery policy."""
    import json

    import numpy as np

    from analysis import plots as P
    from analysis import resilience as R
    from analysis.evaluate import resilience_frame, summary_dict
    from analysis.study import load_study

    study = load_study(study_file)
    if not study.strategies:
        raise ConfigError("the study lists no [[strategies]] to evaluate", what="study")
    out: dict[str, Any] = {}
    for s in study.strategies:
        frame = resilience_frame(study, s)
        out[s.label()] = summary_dict(frame)
        table = Table(title=f"{study.name}: {s.label()} on {s.world_size} GPUs "
                            f"(job MTTF {frame['job_mttf_s'][0] / 3600:.2f} h)")
        for col in ("policy", "goodput", "days to train", "GPU-hours", "failures",
                    "ckpt interval min", "ckpt s", "restart s"):
            table.add_column(col, justify="right")
        for r in frame.iter_rows(named=True):
            table.add_row(r["policy"], f"{r['goodput']:.1%}",
                          f"{r['expected_wall_clock_s'] / 86400:.1f}",
                          f"{r['expected_gpu_hours']:,.0f}", f"{r['expected_failures']:,.0f}",
                          f"{r['checkpoint_interval_s'] / 60:.1f}", f"{r['checkpoint_s']:.1f}",
                          f"{r['restart_s']:.0f}")
        console.print(table)
        if plots is not None:
            plots.mkdir(parents=True, exist_ok=True)
            g = frame.filter(frame["policy"] == "global_restart").row(0, named=True)
            mttf, delta = g["job_mttf_s"], g["checkpoint_s"]
            costs = R.RecoveryCosts(checkpoint_s=delta, restart_s=g["restart_s"])
            curve = R.goodput_vs_interval(c=costs, mttf_s=mttf, intervals_s=np.geomspace(
                max(delta, 1.0), 20 * mttf, 120))
            P.goodput_vs_interval(curve, young_s=R.young_interval_s(delta, mttf),
                                  daly_s=R.daly_interval_s(delta, mttf)).savefig(
                plots / f"goodput_{s.label()}.png", dpi=110)
            P.time_to_train_by_policy(frame).savefig(plots / f"time_to_train_{s.label()}.png",
                                                     dpi=110)
    if summary is not None:
        first = next(iter(out.values()))
        summary.write_text(json.dumps({"policies": first, "strategies": out}, indent=1) + "\n")


def _study_meta(study: Any, counts: dict[str, int] | None = None) -> dict[str, Any]:
    return {"name": study.name, "model": study.model.name, "system": study.system.name,
            "gpus": study.gpus, "global_batch_size": study.global_batch_size,
            "tokens": study.tokens, "rank_by": study.rank_by, "counts": counts or {}}


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
        src.replace(out / "timeline.parquet")
    if study.has_failures:
        by_id = {strategy_id(s): s for s in study.strategies}
        if bid in by_id:
            resilience_frame(study, by_id[bid]).write_parquet(out / "resilience.parquet")


@app.command("compare")
def compare_cmd(
    study: Annotated[str, typer.Argument(help="Study TOML, or a packaged study name.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Output directory.")],
    workers: Annotated[int, typer.Option(help="Local worker processes.")] = 2,
    scheduler: Annotated[str | None, typer.Option(help="Dask scheduler address.")] = None,
) -> None:
    """Generate, replay and rank every strategy a study lists."""
    import json
    import tempfile

    from analysis.compare import compare

    st = _resolve_study(study)
    if not st.strategies:
        raise ConfigError("the study lists no [[strategies]]; use `trainsim sweep` for a search "
                          "space", what="study")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="trainsim-timelines-") as tl, _progress() as bar:
        task = bar.add_task("replaying strategies", total=len(st.strategies))
        results = compare(st, timeline_dir=tl, workers=workers, scheduler=scheduler,
                          progress=lambda i, n: bar.update(task, completed=i))
        _save_best(results, st, out, Path(tl))
    results.write_parquet(out / "results.parquet")
    results.write_csv(out / "results.csv")
    (out / "study.json").write_text(json.dumps(_study_meta(st), indent=1) + "\n")
    _print_ranking(results, f"{st.name}: {st.model.name} on {st.gpus} GPUs ({st.system.name})")


def _print_ranking(results: Any, title: str) -> None:
    from analysis.report import COLUMNS, _fmt

    table = Table(title=title)
    cols = [(k, label) for k, label, _ in COLUMNS if k in results.columns]
    for _, label in cols:
        table.add_column(label, justify="right")
    for r in results.head(15).iter_rows(named=True):
        table.add_row(*[_fmt(k, r.get(k)) for k, _ in cols])
    console.print(table)


@app.command("sweep")
def sweep_cmd(
    study: Annotated[str, typer.Argument(help="Study TOML with a [search] space.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Output directory (resumable).")],
    top_k: Annotated[int, typer.Option("--top-k", help="Replay the best K.")] = 10,
    workers: Annotated[int, typer.Option(help="Local worker processes.")] = 2,
    scheduler: Annotated[str | None, typer.Option(help="Dask scheduler address, e.g. "
                                                       "tcp://host:8786.")] = None,
    chunk: Annotated[int, typer.Option(help="Strategies per task.")] = 64,
) -> None:
    """Enumerate a strategy space, screen it with the fast path, replay the best K, rank."""
    import json

    from analysis.sweep import sweep

    st = _resolve_study(study)
    out.mkdir(parents=True, exist_ok=True)
    import time

    with _progress() as bar:
        tasks: dict[str, Any] = {}
        started: dict[str, float] = {}

        def report(phase: str, done: int, total: int) -> None:
            if phase not in tasks:
                tasks[phase] = bar.add_task(phase, total=total)
                started[phase] = time.perf_counter()
            rate = done / max(time.perf_counter() - started[phase], 1e-9)
            bar.update(tasks[phase], completed=done, total=total,
                       description=f"{phase} ({rate:,.0f} strategies/s)")

        results, counts = sweep(st, out, top_k=top_k, scheduler=scheduler, workers=workers,
                                chunk=chunk, progress=report)
    (out / "study.json").write_text(json.dumps(_study_meta(st, counts), indent=1) + "\n")
    console.print(" · ".join(f"{k.replace('_', ' ')}: {v:,}" for k, v in counts.items()))
    _print_ranking(results, f"{st.name}: best of {counts['valid']:,} strategies")


@app.command("report")
def report_cmd(
    results: Annotated[Path, typer.Argument(help="Directory written by compare or sweep.")],
    out: Annotated[Path, typer.Option("-o", "--out", help="Report directory.")],
) -> None:
    """Write report.html (self-contained), report.md, figures and tables."""
    from analysis.report import build_report

    html = build_report(results, out)
    console.print(f"report: {html} (and {out / 'report.md'}, {out / 'results.csv'})")


@app.command("systems")
def systems_cmd() -> None:
    """List the preset systems."""
    from replay import get_system, system_names

    table = Table(title="Preset systems")
    for col in ("name", "gpu", "bf16 TFLOP/s", "HBM GiB", "HBM GB/s", "GPUs/node",
                "NVLink GB/s", "NIC Gb/s/GPU", "description"):
        table.add_column(col)
    for name in system_names():
        s = get_system(name)
        table.add_row(name, s.gpu.name, f"{s.gpu.peak_bf16_TFLOPs:g}", f"{s.gpu.hbm_GiB:g}",
                      f"{s.gpu.hbm_GBps:g}", str(s.node.gpus_per_node), f"{s.node.nvlink_GBps:g}",
                      f"{s.scaleout.nic_Gbps_per_gpu:g}", s.description)
    console.print(table)


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=True)


def print_summary(s: TraceSetSummary, strategy: Strategy, *, capacity_GiB: float | None = None
                  ) -> None:
    console.print(f"[bold]{s.path}[/]: {s.mode} trace set, world size {s.world_size}, "
                  f"{s.ranks_written} rank file(s), {s.nodes_written:,} nodes "
                  f"({strategy.label()}, {strategy.num_microbatches} micro-batches, "
                  f"{strategy.schedule}, recompute {strategy.recompute}, "
                  f"ZeRO {strategy.zero_stage})")
    table = Table(title="Per rank of each pipeline stage")
    axes = sorted({a for st in s.stages for a in st.comm_bytes_by_axis})
    for col in ("stage", "nodes", "TFLOP fwd", "TFLOP bwd", "TFLOP recomp",
                *[f"{a} GB" for a in axes], "memory GiB"):
        table.add_column(col, justify="right")
    for st in s.stages:
        f = st.flop_by_phase
        table.add_row(str(st.stage), f"{st.nodes:,}", f"{f.get('fwd', 0) / 1e12:.1f}",
                      f"{f.get('bwd', 0) / 1e12:.1f}", f"{f.get('recompute', 0) / 1e12:.1f}",
                      *[f"{st.comm_bytes_by_axis.get(a, 0) / 1e9:.2f}" for a in axes],
                      _memory_cell(st.memory.total_bytes / GiB, capacity_GiB))
    console.print(table)
    if capacity_GiB is not None:
        over = [st.stage for st in s.stages if st.memory.total_bytes / GiB > capacity_GiB]
        if over:
            console.print(f"[bold red]does not fit:[/] stage(s) {over} need more than "
                          f"{capacity_GiB:g} GiB per GPU")


def _memory_cell(gib: float, capacity: float | None) -> str:
    if capacity is not None and gib > capacity:
        return f"[bold red]{gib:.1f} > {capacity:g}[/]"
    return f"{gib:.1f}"


def main() -> None:
    """Entry point: usage errors are typer's; trainsim's own errors print as ``Name: message``."""
    try:
        app()
    except TrainsimError as exc:  # raised inside a command
        err = Console(stderr=True, soft_wrap=True, highlight=False)
        err.print(f"[bold red]{type(exc).__name__}[/]: ", end="")
        err.print(str(exc), markup=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
