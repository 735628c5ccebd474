"""Replay benchmark: nodes/s for a full-mode set (folded and rank by rank), the representative
Llama-3.1 405B step on 16,384 GPUs, and peak memory. Prints medians.

Run: ``python bench/bench_replay.py`` (part of ``make bench``).
"""

from __future__ import annotations

import resource
import shutil
import tempfile
from pathlib import Path

from _timing import median_time

from replay import replay
from tracegen import Strategy, generate, get_model


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def bench_full_mode(tmp: Path) -> None:
    m = get_model("gpt-7.5b")
    s = Strategy(tp=4, pp=4, dp=8, micro_batch_size=1, global_batch_size=1152,
                 sequence_parallel=True, zero_stage=1)
    generate(m, s, tmp / "full", mode="full")
    t, res = median_time(lambda: replay(tmp / "full", "dgx-h100"), 3)
    nodes = res.metrics["nodes"]  # type: ignore[attr-defined]
    print(f"full mode gpt-7.5b tp4·pp4·dp8 (128 ranks): {nodes:,} nodes replayed in {t:.2f} s "
          f"(median of 3, folded to {res.metrics['ranks_simulated']} stage representatives) = "  # type: ignore[attr-defined]
          f"{nodes / t:,.0f} nodes/s; step {res.step_time_s:.3f} s")  # type: ignore[attr-defined]
    small = Strategy(tp=2, pp=2, dp=4, micro_batch_size=1, global_batch_size=128,
                     sequence_parallel=True, zero_stage=1)
    generate(m, small, tmp / "small", mode="full")
    t, res = median_time(lambda: replay(tmp / "small", "dgx-h100", fold=False), 1)
    nodes = res.metrics["nodes"]  # type: ignore[attr-defined]
    print(f"full mode gpt-7.5b tp2·pp2·dp4 rank by rank (--no-fold): {nodes:,} nodes in {t:.2f} s"
          f" = {nodes / t:,.0f} nodes/s")


def bench_405b(tmp: Path) -> None:
    m = get_model("llama3.1-405b")
    s = Strategy(tp=8, pp=16, dp=128, micro_batch_size=1, global_batch_size=2048,
                 sequence_parallel=True, zero_stage=1, first_stage_layers=7, last_stage_layers=7)
    generate(m, s, tmp / "405b", mode="representative")
    t, res = median_time(lambda: replay(tmp / "405b", "dgx-h100"), 3)
    r = res.metrics  # type: ignore[attr-defined]
    print(f"representative llama3.1-405b on 16,384 H100s: {r['nodes']:,} nodes, step "
          f"{r['step_time_s']:.2f} s, MFU {r['mfu']:.1%}; replay {t:.2f} s (median of 3; target "
          "< 10 s)")


if __name__ == "__main__":
    tmp = Path(tempfile.mkdtemp(prefix="trainsim-bench-"))
    try:
        bench_full_mode(tmp)
        bench_405b(tmp)
    finally:
        shutil.rmtree(tmp)
    print(f"peak memory (max RSS of this process): {_peak_rss_mib():,.0f} MiB; ASTRA-sim's "
          "analytical backend needs ~60-74 s for 64 ranks × 2,000 nodes here (issue #3)")
