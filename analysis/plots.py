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
