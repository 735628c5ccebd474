"""Sweep benchmark on this machine's cores (GPT-3 175B on 1,024 A100s, global batch 1,536):
the default strategy space screened with the fast path and its top 10 replayed; and a larger
space (micro-batches to 8, ZeRO 0–3, up to 4 chunks per stage, TP-communication overlap and
overlapped parameter gathers) screened only, end to end — enumeration, worker start-up and the
part files included — to give the screening rate a user of ``trainsim sweep`` sees."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from analysis.fastpath import clear_cache
from analysis.study import study_from_dict
from analysis.sweep import sweep

LARGE_SPACE = {"micro_batch_size": [1, 2, 4, 8], "zero_stage": [0, 1, 2, 3],
               "vpp": [1, 2, 3, 4], "tp_comm_overlap": [False, True],
               "overlap_param_gather": [False, True]}


def timed_sweep(search: dict[str, Any], top_k: int, workers: int
                ) -> tuple[dict[str, int], dict[str, float], float]:
    """(counts, when each phase began and ended, total seconds) of one sweep from scratch."""
    study = study_from_dict({"model": "gpt3-175b", "system": "dgx-a100-80gb", "gpus": 1024,
                             "global_batch_size": 1536, "search": search},
                            name="gpt3-175b-1024")
    tmp = Path(tempfile.mkdtemp(prefix="trainsim-bench-sweep-"))
    clear_cache()  # one worker screens in this process: no memo from an earlier run
    marks: dict[str, float] = {}
    t0 = time.perf_counter()

    def progress(phase: str, done: int, total: int) -> None:
        if done == 0:
            marks[f"{phase} start"] = time.perf_counter() - t0
        if done == total:
            marks[phase] = time.perf_counter() - t0

    try:
        _, counts = sweep(study, tmp, top_k=top_k, workers=workers, progress=progress)
    finally:
        shutil.rmtree(tmp)
    return counts, marks, time.perf_counter() - t0


def main() -> None:
    counts, marks, total = timed_sweep({}, top_k=10, workers=2)
    screen_s = max(marks.get("screening", 0.0), 1e-9)
    print(f"sweep gpt3-175b on 1,024 A100s: {counts['enumerated']:,} combinations, "
          f"{counts['valid']:,} valid, {counts['do_not_fit']:,} do not fit; screened in "
          f"{screen_s:.1f} s ({counts['screened'] / screen_s:,.0f} strategies/s incl. worker "
          f"start-up), top {counts['replayed']} replayed; total {total:.1f} s (target < 60 s)")
    for workers in (1, 2):
        runs = [timed_sweep(LARGE_SPACE, top_k=0, workers=workers) for _ in range(3)]
        counts, marks, total = sorted(runs, key=lambda r: r[2])[1]  # the median run
        phase = marks["screening"] - marks["screening start"]
        print(f"  larger space, screened only, {workers} worker(s): {counts['valid']:,} "
              f"strategies of {counts['enumerated']:,} combinations in {total:.2f} s end to end "
              f"({counts['valid'] / total:,.0f} strategies/s; the screening phase "
              f"{counts['valid'] / phase:,.0f}/s), median of 3")


if __name__ == "__main__":
    main()
