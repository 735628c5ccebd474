"""Figures from result frames. Analysis functions return frames; only this module draws."""

from __future__ import annotations

from typing import Literal

import numpy as np
import polars as pl
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from replay.hardware import GPUSpec, SystemSpec
from replay.results import union_intervals


def _figure(width: float, height: float) -> tuple[Figure, Axes]:
    """A Figure outside pyplot's global state: nothing to close, no window, any backend."""
    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.add_subplot()


LegendLoc = Literal["best", "upper left", "upper right", "lower left", "lower right"]


def _finish(ax: Axes, *, xlabel: str, ylabel: str, title: str, legend: LegendLoc = "best",
            grid: Literal["major", "minor", "both"] = "both") -> None:
    """Labels, title, a small legend at ``legend`` and a light grid (``grid`` ticks)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if ax.get_legend_handles_labels()[0]:  # nothing labelled (nothing fits): no empty legend
        ax.legend(loc=legend, fontsize="small")
    ax.grid(True, which=grid, alpha=0.3)


def predicted_vs_measured(results: pl.DataFrame, *, band: float = 0.10, by: str = "gpu",
                          title: str = "trainsim vs published runs", name_beyond: float = 0.20
                          ) -> Figure:
    """Log-log scatter of predicted vs measured step time with the ±band region shaded, one
    colour per value of column ``by``; the rows off by more than ``name_beyond`` carry their
    ``id`` (the ones a reader looks up first)."""
    ok = results.filter(pl.col("status") == "ok")
    fig, ax = _figure(6.4, 6.0)
    if ok.height:
        meas = ok["measured_iter_time_s"].to_numpy()
        pred = ok["predicted_iter_time_s"].to_numpy()
        lo, hi = min(meas.min(), pred.min()) / 1.5, max(meas.max(), pred.max()) * 1.5
        _identity_band(ax, lo, hi, band)
        for key, g in ok.group_by(by, maintain_order=True):
            ax.scatter(g["measured_iter_time_s"], g["predicted_iter_time_s"], label=str(key[0]),
                       s=28, alpha=0.85)
        if "id" in ok.columns:
            _name_outliers(ax, ok, name_beyond)
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
    ax.set_xscale("log")
    ax.set_yscale("log")
    _finish(ax, xlabel="measured step time (s)", ylabel="predicted step time (s)",
            title=f"{title} ({ok.height} rows)", legend="upper left")
    return fig


def _identity_band(ax: Axes, lo: float, hi: float, band: float) -> None:
    """The y = x diagonal from ``lo`` to ``hi`` and the ±``band`` region around it, in grey, so
    that no series colour reads as the reference."""
    x = np.geomspace(lo, hi, 50)
    ax.fill_between(x, x * (1 - band), x * (1 + band), color="0.5", alpha=0.15,
                    label=f"±{band:.0%}")
    ax.plot(x, x, color="0.3", lw=1)


def _name_outliers(ax: Axes, ok: pl.DataFrame, beyond: float) -> None:
    """Each row whose prediction is off by more than ``beyond`` labelled with its id, beside
    its point (small, so that a crowd of them stays readable)."""
    off = ok.filter((pl.col("predicted_iter_time_s") / pl.col("measured_iter_time_s") - 1).abs()
                    > beyond)
    for r in off.iter_rows(named=True):
        ax.annotate(str(r["id"]), (r["measured_iter_time_s"], r["predicted_iter_time_s"]),
                    xytext=(4, -3), textcoords="offset points", fontsize="x-small", alpha=0.8)


def error_trend(frame: pl.DataFrame, x: str, *, by: str = "gpu", band: float = 0.10,
                title: str = "Prediction error against one input") -> Figure:
    """Signed error (%) of the ``ok`` rows against column ``x`` (log₂ axis: sequence length,
    GPU count, batch), one colour per value of ``by``, each group's median joined by a line,
    the ±band region shaded: a trend the summary's percentiles hide."""
    ok = frame.filter(pl.col("status") == "ok").sort(x)
    fig, ax = _figure(7.0, 4.4)
    ax.axhspan(-100 * band, 100 * band, color="0.5", alpha=0.15, label=f"±{band:.0%}")
    ax.axhline(0, color="0.3", lw=1)  # grey: the third group's colour is green
    for i, (key, g) in enumerate(ok.group_by(by, maintain_order=True)):
        colour = f"C{i}"
        ax.scatter(g[x], g["error_pct"], s=16, alpha=0.6, color=colour, label=str(key[0]))
        med = g.group_by(x).agg(pl.col("error_pct").median()).sort(x)
        ax.plot(med[x], med["error_pct"], color=colour, lw=1.5)
    ax.set_xscale("log", base=2)
    _finish(ax, xlabel=x, ylabel="predicted vs measured step time (%)",
            title=f"{title} ({ok.height} rows)", legend="lower left", grid="major")
    return fig


def goodput_vs_interval(curve: pl.DataFrame, *, young_s: float, daly_s: float,
                        title: str = "", persist_s: float = 0.0) -> Figure:
    """ETTR against the checkpoint interval, with Young's and Daly's optima marked, and the
    intervals shorter than a checkpoint takes to persist shaded (none is taken that often)."""
    fig, ax = _figure(6.4, 4.2)
    x = curve["checkpoint_interval_s"].to_numpy() / 60
    ax.plot(x, curve["goodput"].to_numpy() * 100, color="tab:blue")
    for t, label, style in ((young_s, "Young", ":"), (daly_s, "Daly", "--")):
        ax.axvline(t / 60, color="tab:red", ls=style, label=f"{label} optimum ({t / 60:.1f} min)")
    if persist_s > 0:
        ax.axvspan(min(young_s, daly_s, persist_s) / 120, persist_s / 60, color="0.85",
                   label=f"shorter than a checkpoint persists ({persist_s / 60:.1f} min)")
    ax.set_xscale("log")
    _finish(ax, xlabel="checkpoint interval (min)", ylabel="effective training time ratio (%)",
            title=title or "Goodput vs checkpoint interval (global restart)")
    return fig


def time_to_train_by_policy(frame: pl.DataFrame, *, title: str = "") -> Figure:
    """Expected wall-clock days to train the token budget, one bar per recovery policy, with
    the P10–P90 days as whiskers where the frame has them (``analysis.wall_spread``)."""
    fig, ax = _figure(6.4, 3.8)
    days = frame["expected_wall_clock_s"].to_numpy() / 86_400
    bars = ax.barh(frame["policy"].to_list(), days, color="tab:blue")
    ends = days.copy()  # (where each bar's label starts: past its whisker)
    if {"wall_clock_p10_s", "wall_clock_p90_s"} <= set(frame.columns):
        lo = frame["wall_clock_p10_s"].cast(pl.Float64).to_numpy() / 86_400
        hi = frame["wall_clock_p90_s"].cast(pl.Float64).to_numpy() / 86_400
        ok = np.isfinite(lo) & np.isfinite(hi)
        if ok.any():
            y = np.arange(len(days))[ok]
            ax.errorbar(days[ok], y, xerr=[np.maximum(0, days[ok] - lo[ok]),
                                           np.maximum(0, hi[ok] - days[ok])],
                        fmt="none", ecolor="black", capsize=3, label="P10–P90")
            ax.legend(loc="lower right", fontsize="small")
            ends[ok] = np.maximum(days[ok], hi[ok])
    for bar, end, g in zip(bars, ends, frame["goodput"].to_list(), strict=True):
        ax.text(end, bar.get_y() + bar.get_height() / 2, f"  goodput {g:.1%}",
                va="center", fontsize="small")
    ax.set_xlabel("expected time to train (days)")
    ax.set_title(title or "Time to train by recovery policy")
    ax.invert_yaxis()
    ax.margins(x=0.25)
    return fig


BREAKDOWN = (("compute_s", "compute", "tab:blue"),
             ("interference_s", "compute slowed by comm", "tab:cyan"),
             ("exposed_tp_s", "exposed TP comm", "tab:orange"),
             ("exposed_pp_s", "exposed PP comm", "tab:green"),
             ("exposed_dp_s", "exposed DP comm", "tab:red"),
             ("exposed_other_comm_s", "other comm", "tab:pink"),
             ("bubble_s", "bubble / wait", "tab:gray"), ("optimizer_s", "optimizer", "tab:purple"))


def stacked_breakdown(results: pl.DataFrame, *, top: int = 12) -> Figure:
    """Where each step goes, per replayed strategy (stacked horizontal bars, seconds)."""
    rows = results.filter(pl.col("compute_s").is_not_null()).head(top)
    fig, ax = _figure(10, 0.45 * max(rows.height, 3) + 1.5)
    left = np.zeros(rows.height)
    labels = rows["strategy"].to_list()
    for col, name, color in BREAKDOWN:
        vals = rows[col].fill_null(0.0).to_numpy()
        ax.barh(labels, vals, left=left, label=name, color=color)
        left += vals
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step")
    ax.set_title("Step time breakdown (rank that finishes last)")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def step_parts(parts: dict[str, float], *, title: str = "Where the step goes") -> Figure:
    """A step's parts (``analysis.step_split``: label → seconds, adding up to the step) as
    one stacked bar in their order; a negative part (what merged passes hide) is drawn hatched
    back over the parts before it, and the next part starts where it ends, so the bar ends at
    the step."""
    fig, ax = _figure(10, 2.2)
    left = 0.0
    for (label, sec), color in zip(parts.items(), _colors(len(parts)), strict=True):
        if sec >= 0:
            ax.barh([0], [sec], left=left, color=color, label=f"{label} ({sec:.3g} s)")
        else:
            ax.barh([0], [-sec], left=left + sec, color="white", edgecolor="black", hatch="//",
                    alpha=0.8, label=f"{label} ({sec:.3g} s)")
        left += sec
    ax.axvline(left, color="black", linewidth=1)
    ax.set_yticks([])
    ax.set_xlabel("seconds per step")
    ax.set_title(title)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def _colors(n: int) -> list[tuple[float, float, float, float]]:
    """``n`` distinct colours from matplotlib's tab10 (tab20 past ten)."""
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


# Beyond this many strategies a scatter is one solid blot (a sweep screens hundreds of
# thousands): their density is drawn instead, on a log scale, with the front over it.
DENSE_POINTS = 2000


def pareto(results: pl.DataFrame) -> Figure:
    """Throughput against peak memory per GPU; the Pareto front of strategies that fit (a
    strategy on it is the fastest at its memory or less). Many strategies are drawn as their
    density."""
    ok = results.filter(pl.col("tokens_per_s").is_not_null() & pl.col("fits").fill_null(False))
    fig, ax = _figure(6.4, 4.4)
    if ok.height:
        mem = ok["peak_memory_GiB"].to_numpy()
        tps = ok["tokens_per_s"].to_numpy()
        if ok.height > DENSE_POINTS:
            cells = ax.hexbin(mem, tps, gridsize=60, bins="log", cmap="Blues", mincnt=1)
            fig.colorbar(cells, ax=ax, label=f"strategies ({ok.height:,}; log scale)")
        else:
            ax.scatter(mem, tps, s=18, alpha=0.6, label="strategies")
        front_x, front_y = pareto_front(mem, tps)
        ax.step(front_x, front_y, where="post", color="tab:red",
                label=f"Pareto front ({len(front_x)})")
        ax.scatter(front_x, front_y, s=14, color="tab:red", zorder=3)
    _finish(ax, xlabel="peak memory per GPU (GiB)", ylabel="tokens / s",
            title="Throughput vs memory", grid="major")
    return fig


def pareto_front(memory: np.ndarray, throughput: np.ndarray) -> tuple[list[float], list[float]]:
    """The points no other point beats on both counts (less or equal memory, more throughput),
    by memory."""
    front_x: list[float] = []
    front_y: list[float] = []
    best = -np.inf
    for i in np.lexsort((-throughput, memory)):  # by memory; at equal memory, fastest first
        if throughput[i] > best:
            best = throughput[i]
            front_x.append(float(memory[i]))
            front_y.append(float(throughput[i]))
    return front_x, front_y


def tp_pp_heatmap(results: pl.DataFrame) -> Figure:
    """Best step time for each (tp, pp) among strategies that fit; a cell the results hold
    but where none fits says so, and one they do not hold says it was not run."""
    ok = results.filter(pl.col("fits").fill_null(False) & pl.col("step_time_s").is_not_null())
    fig, ax = _figure(5.6, 4.4)
    if ok.height:
        best = ok.group_by(["tp", "pp"]).agg(pl.col("step_time_s").min())
        tried = results.drop_nulls(["tp", "pp"])
        tps = sorted(tried["tp"].unique().to_list())
        pps = sorted(tried["pp"].unique().to_list())
        grid = np.full((len(pps), len(tps)), np.nan)
        for tp, pp, t in best.iter_rows():
            grid[pps.index(pp), tps.index(tp)] = t
        im = ax.imshow(grid, cmap="viridis_r", aspect="auto")
        ax.set_xticks(range(len(tps)), [str(t) for t in tps])
        ax.set_yticks(range(len(pps)), [str(p) for p in pps])
        mid = np.nanmean(grid)
        timed = tried.filter(pl.col("step_time_s").is_not_null())
        ran = set(zip(timed["tp"].to_list(), timed["pp"].to_list(), strict=True))
        for (i, j), v in np.ndenumerate(grid):
            if np.isfinite(v):  # dark text on the light (fast) cells, light on the dark ones
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8,
                        color="black" if v <= mid else "white")
            else:
                ax.text(j, i, "none fits" if (tps[j], pps[i]) in ran else "not run",
                        ha="center", va="center", fontsize=8, color="gray")
        fig.colorbar(im, ax=ax, label="best step time (s)")
    ax.set_xlabel("tensor parallel (tp)")
    ax.set_ylabel("pipeline parallel (pp)")
    ax.set_title("Best step time by tp × pp")
    return fig


def _spans(frame: pl.DataFrame) -> list[tuple[float, float]]:
    """Merged (start, width) spans of a frame's intervals (touching ones join)."""
    if frame.is_empty():
        return []
    return [(a, b - a) for a, b in union_intervals(frame["start_s"].to_numpy(),
                                                   frame["end_s"].to_numpy())]


def pipeline_timeline(timeline: pl.DataFrame, *, ranks: int = 4, title: str = "") -> Figure:
    """Gantt chart of the first ``ranks`` simulated ranks: forward, backward (ZB-H1: its B and
    W passes) and optimizer on the compute stream; collectives and sends below."""
    chosen = timeline["rank"].unique().sort().head(ranks).to_list()
    fig, ax = _figure(10, 0.9 * len(chosen) + 1.4)
    colors = {"F": "tab:blue", "B": "tab:orange", "W": "tab:red", "s": "tab:purple"}
    split = timeline.filter(pl.col("name").str.starts_with("W")).height > 0
    for row, rank in enumerate(chosen):
        t = timeline.filter(pl.col("rank") == rank)
        comp = t.filter(pl.col("stream") == "compute")
        for phase, color in colors.items():
            seg = comp.filter(pl.col("name").str.starts_with(phase))
            ax.broken_barh(_spans(seg), (row - 0.35, 0.45), facecolors=color, linewidth=0)
        comm = t.filter(pl.col("kind").is_in(["COMM_COLL_NODE", "COMM_SEND_NODE"]))
        ax.broken_barh(_spans(comm), (row + 0.14, 0.2), facecolors="tab:green", linewidth=0)
    ax.set_yticks(range(len(chosen)), [f"rank {r}" for r in chosen])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_title(title or "Pipeline timeline: forward (blue), " + (
        "backward B (orange), W (red)" if split else "backward (orange)")
                 + ", optimizer (purple), communication (green)")
    return fig


def collective_ramp(system: SystemSpec, *, ranks: int = 8,
                    measured: dict[int, float] | None = None) -> Figure:
    """All-reduce bus bandwidth against message size on ``ranks`` GPUs of ``system`` (trainsim's
    network model), with measured points (MiB → GB/s) where given."""
    from replay.network import AlphaBetaNetwork

    net = AlphaBetaNetwork(system)
    group = tuple(range(ranks))
    sizes = np.geomspace(2**10, 2**34, 97)
    bus = [2 * (ranks - 1) / ranks * s / (net.collective("ALL_REDUCE", int(s), group).total_ns
                                          * 1e-9) / 1e9 for s in sizes]
    fig, ax = _figure(6.4, 4.2)
    ax.plot(sizes / 2**20, bus, label=f"trainsim ({system.name}, {ranks} GPUs)")
    if measured:
        ax.scatter(list(measured), list(measured.values()), color="tab:red", s=24, zorder=3,
                   label="measured (nccl-tests)")
    ax.set_xscale("log")
    _finish(ax, xlabel="message size (MiB)", ylabel="all-reduce bus bandwidth (GB/s)",
            title="Collective model: bandwidth grows with message size (NCCL protocols)",
            legend="upper left")
    return fig


def _gemm_tflops(gpu: GPUSpec, m: int, n: int, k: int) -> float:
    """TFLOP/s of one BF16 m×n×k GEMM under the compute model (``RooflineCompute.op_ns``)."""
    from replay.compute import RooflineCompute
    from tracegen.ops import gemm
    from tracegen.units import DTYPE_CODE

    op = gemm("g", m, n, k, "bf16")
    ns = RooflineCompute(gpu).op_ns("gemm", op.flop, op.bytes, op.m, op.n, DTYPE_CODE["bf16"],
                                    False, op.k)
    return op.flop / ns / 1e3


def gemm_by_k(system: SystemSpec, measured: pl.DataFrame | None = None, *, m: int = 16384,
              n: int = 8192) -> Figure:
    """BF16 GEMM throughput against the reduction length K: trainsim's compute model for an
    ``m``×``n`` output (wave quantization negligible) with and without its per-tile K term at
    the burst clock microbenchmarks run at, the same in a training step (sustained clock), and
    measured points (columns ``b, m, n, k, bf16_tflops``) where given."""
    import dataclasses

    def tflops(gpu: GPUSpec, k: int) -> float:
        return _gemm_tflops(gpu, m, n, k)

    ks = [int(k) for k in np.geomspace(128, 32768, 33)]
    burst = dataclasses.replace(system.gpu, sustained_clock_ratio=1.0)
    flat = dataclasses.replace(burst, gemm_k_overhead=0.0)
    fig, ax = _figure(6.4, 4.2)
    ax.plot(ks, [tflops(burst, k) for k in ks],
            label=f"trainsim ({system.gpu.name}, burst clock)")
    ax.plot(ks, [tflops(flat, k) for k in ks], linestyle="--", color="tab:gray",
            label="without the per-tile K term")
    if system.gpu.sustained_clock_ratio < 1:
        ax.plot(ks, [tflops(system.gpu, k) for k in ks], linestyle=":", color="tab:blue",
                label="in a training step (sustained clock)")
    if measured is not None and measured.height:
        ax.scatter(measured["k"], measured["bf16_tflops"], color="tab:red", s=18, zorder=3,
                   alpha=0.7, label="measured (OpenXLA sm_90 table, largest shapes)")
    ax.set_xscale("log", base=2)
    _finish(ax, xlabel="reduction length K", ylabel="BF16 GEMM throughput (TFLOP/s)",
            title=f"Short-K GEMMs pay a per-tile cost ({m}×{n} output)",
            legend="lower right")
    return fig


def gemm_occupancy(system: SystemSpec, measured: pl.DataFrame, *, k: int = 4096) -> Figure:
    """BF16 GEMM throughput against the number of 128×128 output tiles, at reduction length
    ``k``: measured points (columns ``b, m, n, k, bf16_tflops``; a batch of b counts b times
    the tiles), trainsim's model at the burst clock (its occupancy term), and the same model
    with textbook wave quantization (tiles over whole waves of SMs) in its place."""
    import dataclasses

    burst = dataclasses.replace(system.gpu, sustained_clock_ratio=1.0)
    sawtooth = dataclasses.replace(burst, gemm_occupancy_waves=0.0)

    def tflops(gpu: GPUSpec, rows: int, cols: int) -> float:
        return _gemm_tflops(gpu, 128 * rows, 128 * cols, k)

    rows = measured.filter(pl.col("k") == k)
    tiles = rows["b"] * ((rows["m"] + 127) // 128) * ((rows["n"] + 127) // 128)
    # near-square outputs of r × r and r × (r + 1) tiles: as compute-bound as T tiles can be
    shapes = sorted((r * c, r, c) for r in range(3, 33) for c in (r, r + 1))
    grid = [t for t, _, _ in shapes]
    fig, ax = _figure(6.4, 4.2)
    ax.plot(grid, [tflops(burst, r, c) for _, r, c in shapes],
            label=f"trainsim ({system.gpu.name}: occupancy, burst clock)")
    ax.plot(grid, [tflops(sawtooth, r, c) for _, r, c in shapes], linestyle="--",
            color="tab:gray", label="textbook wave quantization (whole waves)")
    ax.scatter(tiles, rows["bf16_tflops"], color="tab:red", s=18, zorder=3, alpha=0.7,
               label="measured (OpenXLA sm_90 table)")
    ax.axvline(system.gpu.sm_count, color="tab:gray", linewidth=0.8, linestyle=":")
    ax.set_xscale("log", base=2)
    _finish(ax, xlabel=f"128×128 output tiles (one wave = {system.gpu.sm_count} SMs, dotted)",
            ylabel="BF16 GEMM throughput (TFLOP/s)",
            title=f"GEMMs below a few waves: occupancy, not whole waves (K = {k})",
            legend="lower right")
    return fig


def gemm_ceilings(systems: list[SystemSpec]) -> Figure:
    """Per GPU, three BF16 matmul ceilings: the datasheet peak, the best measured burst (MAMF:
    ``gemm_efficiency``) and what a training step sustains at the power limit
    (``sustained_clock_ratio``) — the rate trainsim costs large GEMMs at."""
    gpus = {s.gpu.name: s.gpu for s in systems}  # presets that share a GPU draw it once
    names = list(gpus)
    peak = np.array([g.peak_bf16_TFLOPs for g in gpus.values()])
    mamf = peak * np.array([g.gemm_efficiency for g in gpus.values()])
    held = mamf * np.array([g.sustained_clock_ratio for g in gpus.values()])
    x, w = np.arange(len(names)), 0.27
    fig, ax = _figure(max(6.4, 0.9 * len(names) + 1.5), 4.2)
    for i, (vals, label, color) in enumerate((
            (peak, "datasheet peak", "tab:gray"), (mamf, "best measured burst (MAMF)", "tab:blue"),
            (held, "sustained in training (trainsim)", "tab:orange"))):
        ax.bar(x + (i - 1) * w, vals, w, label=label, color=color)
    ax.set_xticks(x, names, rotation=30, ha="right")
    _finish(ax, xlabel="GPU", ylabel="BF16 matmul (TFLOP/s)",
            title="GEMM ceilings: spec, burst and sustained at the power limit",
            legend="upper left", grid="major")
    return fig


def memory_mix(families: dict[str, float], steps: dict[str, float], preset: float, *,
               title: str = "H200") -> Figure:
    """Two panels from ``analysis.memory_mix``: each measured kernel family's efficiency
    (fraction of HBM bandwidth) and each reference step's mix of them, as bars, with the
    preset's ``memory_efficiency`` as a line across both."""
    fig = Figure(figsize=(11.0, 4.0), layout="constrained")
    left, right = fig.subplots(1, 2, sharex=True)
    for ax, data, what in ((left, families, "kernel family"), (right, steps, "step mix")):
        names = list(data)
        ax.barh(names, [data[n] for n in names], color="tab:blue", alpha=0.8)
        ax.axvline(preset, color="black", lw=1.2, label=f"preset {preset:.2f}")
        ax.invert_yaxis()
        ax.set_xlim(0.0, 1.0)
        _finish(ax, xlabel="fraction of HBM bandwidth", ylabel="",
                title=f"Memory-bound {what}, {title}", legend="lower right", grid="major")
    return fig


def device_evidence(gemms: pl.DataFrame, attention: pl.DataFrame, *, band: float = 0.05,
                    title: str = "H200") -> Figure:
    """Two panels from ``analysis.device_runs``: held GEMMs, modelled against measured TFLOP/s
    (±``band`` shaded, one colour per dtype); and causal attention TFLOP/s against sequence
    length, measured backends as points and the kernel curves as lines."""
    fig = Figure(figsize=(11.0, 4.4), layout="constrained")
    left, right = fig.subplots(1, 2)
    if gemms.height:
        both = pl.concat([gemms["measured_tflops"], gemms["model_tflops"]])
        lo, hi = float(both.min()) / 1.2, float(both.max()) * 1.2  # type: ignore[arg-type]
        _identity_band(left, lo, hi, band)
        for (dtype,), g in gemms.group_by("dtype", maintain_order=True):
            left.scatter(g["measured_tflops"], g["model_tflops"], s=24, alpha=0.85,
                         label=f"{dtype} ({g.height} shapes)")
        left.set_xscale("log")
        left.set_yscale("log")
    _finish(left, xlabel="measured, held at the power limit (TFLOP/s)",
            ylabel="trainsim (TFLOP/s)", title=f"GEMMs on {title}", legend="upper left")
    for (kind, source), g in attention.group_by("kind", "source", maintain_order=True):
        g = g.sort("seq")
        if kind == "measured":
            right.scatter(g["seq"], g["tflops"], s=34, zorder=3, color="black",
                          marker="o" if source == "cudnn" else "s", label=f"measured: {source}")
        else:
            right.plot(g["seq"], g["tflops"], lw=1.2, label=f"curve: {source}")
    right.set_xscale("log", base=2)
    _finish(right, xlabel="sequence length (tokens)", ylabel="causal forward (TFLOP/s)",
            title=f"Attention, head dim 128, on {title}", legend="lower right")
    return fig


def grouped_gemm_evidence(groups: pl.DataFrame, *, band: float = 0.1,
                          title: str = "H200") -> Figure:
    """Groups of expert GEMMs from ``analysis.device_runs.grouped_gemms`` (one or both dtypes,
    a ``dtype`` column where several): trainsim's milliseconds against the measured ones,
    log-log with ±``band`` shaded — filled, the model (each expert's GEMM in turn); hollow, one
    GEMM of all the group's rows, the model it replaced."""
    fig, ax = _figure(6.4, 5.2)
    if groups.height:
        both = pl.concat([groups["measured_ms"], groups["model_ms"],
                          groups["one_gemm_model_ms"]])
        lo, hi = float(both.min()) / 1.3, float(both.max()) * 1.3  # type: ignore[arg-type]
        _identity_band(ax, lo, hi, band)
        by = "dtype" if "dtype" in groups.columns else None
        parts = groups.group_by(by, maintain_order=True) if by else [(("bf16",), groups)]
        for i, ((dtype,), g) in enumerate(parts):
            ax.scatter(g["measured_ms"], g["model_ms"], s=26, alpha=0.85, color=f"C{i}",
                       label=f"{dtype}: experts in turn ({g.height} groups)")
            ax.scatter(g["measured_ms"], g["one_gemm_model_ms"], s=26, facecolors="none",
                       edgecolors=f"C{i}", alpha=0.85, label=f"{dtype}: one GEMM of all rows")
        ax.set_xscale("log")
        ax.set_yscale("log")
    _finish(ax, xlabel="measured: one cuBLAS GEMM per expert on 4 streams (ms)",
            ylabel="trainsim (ms)", title=f"Expert GEMM groups on {title}",
            legend="upper left")
    return fig


def layout_mfu(frame: pl.DataFrame, *, title: str = "") -> Figure:
    """``analysis.layout_mfu.layout_mfu``: per published run, its measured MFU beside trainsim's
    with the gradients reduced once a step and in every micro-batch (grouped bars)."""
    fig, ax = _figure(7.0, 4.2)
    x = np.arange(frame.height)
    bars = (("measured_mfu_pct", "published", "0.35"),
            ("once_mfu_pct", "trainsim, reduced once a step", "C0"),
            ("per_microbatch_mfu_pct", "trainsim, reduced every micro-batch", "C1"))
    for i, (col, name, color) in enumerate(bars):
        ax.bar(x + (i - 1) * 0.27, frame[col], width=0.27, color=color, label=name)
    ax.set_xticks(x, frame["run"].to_list())
    _finish(ax, xlabel="", ylabel="MFU (%)", title=title or "Published MFU against trainsim",
            legend="lower right")
    return fig


def interference_evidence(frame: pl.DataFrame, kappa: float, *, title: str = "H200"
                          ) -> Figure:
    """``analysis.device_runs.held_slowdowns``: each kernel's slowdown beside SMs held by a
    communication-like kernel against its time alone (log x), GEMMs as lines per number of
    blocks held (filled: the held kernel only holds SMs; hollow: it also copies HBM), attention
    and memory-bound kernels as their own markers; the catalog's 1 + κ as a dashed line."""
    fig, ax = _figure(7.2, 5.0)
    gemms = frame.filter(pl.col("kind") == "gemm")
    for i, ((blocks,), g) in enumerate(gemms.group_by("blocks", maintain_order=True)):
        for held, fill in (("holds SMs", True), ("copies HBM", False)):
            h = g.filter(pl.col("held") == held).sort("alone_ms")
            ax.plot(h["alone_ms"], h["slowdown"], marker="o", color=f"C{i}", lw=1,
                    ls="-" if fill else ":", mfc=f"C{i}" if fill else "none",
                    label=f"GEMMs, {blocks} SMs held" + ("" if fill else " (copying)"))
    for kind, marker in (("attention", "^"), ("memory", "s")):
        for held, fill in (("holds SMs", True), ("copies HBM", False)):
            k = frame.filter((pl.col("kind") == kind) & (pl.col("held") == held))
            if k.height:
                ax.scatter(k["alone_ms"], k["slowdown"], marker=marker, s=30, zorder=3,
                           facecolors="black" if fill else "none", edgecolors="black",
                           label=f"{kind} kernels" + ("" if fill else " (copying)"))
    ax.axhline(1 + kappa, color="grey", ls="--", lw=1, label=f"trainsim: 1 + κ = {1 + kappa:.3f}")
    ax.set_xscale("log")
    _finish(ax, xlabel="kernel alone (ms)", ylabel="slowdown beside the held SMs",
            title=f"Compute beside a communication-like kernel on {title}", legend="upper right")
    return fig


def roofline(table: pl.DataFrame, gpu: GPUSpec, *, dtype: str = "bf16", title: str = ""
             ) -> Figure:
    """The ops of ``analysis.op_table.op_table`` on the GPU's roofline (Williams et al. 2009,
    "Roofline: an insightful visual performance model", CACM 52(4)): achieved TFLOP/s against
    arithmetic intensity (FLOP per byte of HBM traffic), log-log, one colour per kind of op, each
    point's area its share of the stage's time. The roof: the sustained ``dtype`` peak and,
    under it, a large GEMM's efficiency in that dtype (``GPUSpec.gemm_efficiency_of``); the
    slope, HBM bandwidth at its modelled efficiency. Collectives and ops without FLOPs
    (embedding lookups) have no point."""
    ops = table.filter((pl.col("flop") > 0) & (pl.col("bytes") > 0))
    fig, ax = _figure(7.0, 5.2)
    peak = gpu.tensor_flop_per_s(dtype) / 1e12
    hbm = gpu.hbm_bytes_per_s * gpu.memory_efficiency / 1e12  # TB/s: TFLOP/s per FLOP/byte
    intensity = ops["flop_per_byte"].to_numpy()
    lo = min(0.1, intensity.min() / 2) if ops.height else 0.1
    hi = max(1e4, intensity.max() * 2) if ops.height else 1e4
    x = np.geomspace(lo, hi, 200)
    ax.plot(x, np.minimum(peak, hbm * x), color="black", lw=1.2,
            label=f"roofline ({peak:,.0f} TFLOP/s sustained, {hbm:.2f} TB/s HBM)")
    eff = gpu.gemm_efficiency_of(dtype)  # (FP8's and FP4's own, where the GEMMs run in them)
    ax.axhline(peak * eff, color="grey", ls="--", lw=0.8,
               label=f"a large {dtype} GEMM ({eff:.0%} of the peak)")
    if ops.height:
        time = ops["time_us"] * ops["count"]
        total = float(time.sum())
        for key, g in ops.with_columns(time.alias("_t")).group_by("kind", maintain_order=True):
            ax.scatter(g["flop_per_byte"], g["achieved_tflops"], s=10 + 600 * g["_t"] / total,
                       alpha=0.7, label=str(key[0]))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    _finish(ax, xlabel="arithmetic intensity (FLOP per byte)", ylabel="achieved TFLOP/s",
            title=title or f"{gpu.name}: where the ops sit", legend="lower right")
    return fig


def scaling(frame: pl.DataFrame, *, title: str = "", deadline_days: float | None = None
            ) -> Figure:
    """A scaling table (``analysis.scaling``) as panels over the GPU count (log 2): the
    effective throughput (tokens/s × goodput) against perfect scaling from the smallest count,
    and the GPU-hours a billion tokens cost, each point labelled with its scaling efficiency
    — what each doubling buys and what it costs; with a token budget, a third: the days to
    train, expected and what nine runs in ten end by (P90), under ``deadline_days`` where
    given."""
    ok = frame.filter(pl.col("effective_tokens_per_s").is_not_null())
    timed = "run_time_s" in ok.columns and ok["run_time_s"].is_not_null().any()
    fig = Figure(figsize=(16.0 if timed else 11.0, 4.2), layout="constrained")
    axes = fig.subplots(1, 3 if timed else 2)
    left, right = axes[0], axes[1]
    if timed:
        _days_panel(axes[2], ok, deadline_days)
    if ok.height:
        gpus = ok["gpus"].to_numpy()
        eff = ok["effective_tokens_per_s"].to_numpy()
        left.plot(gpus, eff, "o-", color="tab:blue", label="best strategy that fits")
        left.plot(gpus, eff[0] * gpus / gpus[0], "--", color="grey", label="perfect scaling")
        right.plot(gpus, ok["gpu_hours_per_btok"].to_numpy(), "o-", color="tab:red")
        for x, y, e in zip(gpus, ok["gpu_hours_per_btok"].to_numpy(),
                           ok["scaling_efficiency"].to_numpy(), strict=True):
            right.annotate(f"{e:.0%}", (x, y), textcoords="offset points", xytext=(0, 6),
                           ha="center", fontsize="small")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(frame["gpus"].to_list(), [f"{g:,}" for g in frame["gpus"].to_list()])
        ax.minorticks_off()
    left.set_yscale("log")
    _finish(left, xlabel="GPUs", ylabel="tokens/s × goodput",
            title=title or "throughput", legend="upper left")
    missing = frame.height - ok.height
    _finish(right, xlabel="GPUs", ylabel="GPU-hours per 10⁹ tokens",
            title="cost (labels: scaling efficiency)"
            + (f"; {missing} count(s) with no strategy that fits" if missing else ""))
    return fig


def _days_panel(ax: Axes, ok: pl.DataFrame, deadline_days: float | None) -> None:
    """Days to train of each count's best: expected, and the P90 end date where known; the
    deadline as a line, the counts that meet it (P90 within it) filled."""
    gpus = ok["gpus"].to_numpy()
    ax.plot(gpus, ok["run_time_s"].to_numpy() / 86400, "o-", color="tab:green",
            label="expected")
    if "run_time_p90_s" not in ok.columns:  # (a table from before the P90 column)
        ok = ok.with_columns(pl.lit(None, pl.Float64).alias("run_time_p90_s"),
                             pl.lit(None, pl.Boolean).alias("meets_deadline"))
    p90 = ok.filter(pl.col("run_time_p90_s").is_not_null())
    if p90.height and not p90["run_time_p90_s"].equals(p90["run_time_s"]):
        ax.plot(p90["gpus"].to_numpy(), p90["run_time_p90_s"].to_numpy() / 86400, "v--",
                color="tab:olive", label="P90 (nine runs in ten end by)")
    if deadline_days:
        ax.axhline(deadline_days, color="tab:red", linestyle=":",
                   label=f"deadline {deadline_days:g} days")
        meets = ok.filter(pl.col("meets_deadline").fill_null(False))
        if meets.height:
            ax.scatter(meets["gpus"].to_numpy(), meets["run_time_p90_s"].to_numpy() / 86400,
                       s=90, facecolors="none", edgecolors="tab:red", zorder=3,
                       label="finishes in time (P90)")
    ax.set_ylim(bottom=0)
    _finish(ax, xlabel="GPUs", ylabel="days to train", title="time to train",
            legend="upper right")


def goodput_of_global_restart(row: dict[str, float]) -> Figure:
    """``goodput_vs_interval`` of a resilience row of the global-restart policy (``trainsim
    resilience --plots`` and the report draw the same)."""
    from analysis import resilience as R  # (it imports nothing of analysis; kept local)

    mttf, delta = row["job_mttf_s"], max(row["checkpoint_s"], 1e-3)
    persist = float(row.get("persist_s") or 0.0)  # (results written before it: none)
    costs = R.RecoveryCosts(checkpoint_s=delta, restart_s=row["restart_s"], persist_s=persist)
    curve = R.goodput_vs_interval(c=costs, mttf_s=mttf, intervals_s=np.geomspace(
        max(delta, persist, 1.0), 20 * mttf, 120))
    return goodput_vs_interval(curve, young_s=R.young_interval_s(delta, mttf),
                               daly_s=R.daly_interval_s(delta, mttf), persist_s=persist)
