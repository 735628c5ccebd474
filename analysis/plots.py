"""Figures from result frames. Analysis functions return frames; only this module draws."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files and notebooks; never a window

import matplotlib.pyplot as plt
import numpy as np
import polars as pl
from matplotlib.figure import Figure


def predicted_vs_measured(results: pl.DataFrame, *, band: float = 0.10) -> Figure:
    """Log-log scatter of predicted vs measured step time with the ±band region shaded."""
    ok = results.filter(pl.col("status") == "ok")
    fig, ax = plt.subplots(figsize=(6.4, 6.0), layout="constrained")
    if ok.height:
        meas = ok["measured_iter_time_s"].to_numpy()
        pred = ok["predicted_iter_time_s"].to_numpy()
        lo, hi = min(meas.min(), pred.min()) / 1.5, max(meas.max(), pred.max()) * 1.5
        x = np.geomspace(lo, hi, 50)
        ax.fill_between(x, x * (1 - band), x * (1 + band), color="tab:green", alpha=0.15,
                        label=f"±{band:.0%}")
        ax.plot(x, x, color="tab:green", lw=1)
        for gpu, g in ok.group_by("gpu", maintain_order=True):
            ax.scatter(g["measured_iter_time_s"], g["predicted_iter_time_s"], label=str(gpu[0]),
                       s=28, alpha=0.85)
        ax.set_xlim(lo, hi)
        ax.set_ylim(lo, hi)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(f"trainsim vs published runs ({ok.height} rows)")
    ax.legend(loc="upper left", fontsize="small")
    ax.grid(True, which="both", alpha=0.3)
    return fig


def goodput_vs_interval(curve: pl.DataFrame, *, young_s: float, daly_s: float,
                        title: str = "") -> Figure:
    """ETTR against the checkpoint interval, with Young's and Daly's optima marked."""
    fig, ax = plt.subplots(figsize=(6.4, 4.2), layout="constrained")
    x = curve["checkpoint_interval_s"].to_numpy() / 60
    ax.plot(x, curve["goodput"].to_numpy() * 100, color="tab:blue")
    for t, label, style in ((young_s, "Young", ":"), (daly_s, "Daly", "--")):
        ax.axvline(t / 60, color="tab:red", ls=style, label=f"{label} optimum ({t / 60:.1f} min)")
    ax.set_xscale("log")
    ax.set_xlabel("checkpoint interval (min)")
    ax.set_ylabel("effective training time ratio (%)")
    ax.set_title(title or "Goodput vs checkpoint interval (global restart)")
    ax.legend(fontsize="small")
    ax.grid(True, which="both", alpha=0.3)
    return fig


def time_to_train_by_policy(frame: pl.DataFrame, *, title: str = "") -> Figure:
    """Expected wall-clock days to train the token budget, one bar per recovery policy."""
    fig, ax = plt.subplots(figsize=(6.4, 3.8), layout="constrained")
    days = frame["expected_wall_clock_s"].to_numpy() / 86_400
    bars = ax.barh(frame["policy"].to_list(), days, color="tab:blue")
    for bar, g in zip(bars, frame["goodput"].to_list(), strict=True):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f"  goodput {g:.0%}",
                va="center", fontsize="small")
    ax.set_xlabel("expected time to train (days)")
    ax.set_title(title or "Time to train by recovery policy")
    ax.invert_yaxis()
    ax.margins(x=0.25)
    return fig
