"""Sweep benchmark: the whole default strategy space of GPT-3 175B on 1,024 A100s (global batch
1,536) screened with the fast path and its top 10 replayed, on this machine's cores."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from analysis.study import study_from_dict
from analysis.sweep import sweep


def main() -> None:
    study = study_from_dict({"model": "gpt3-175b", "system": "dgx-a100-80gb", "gpus": 1024,
                             "global_batch_size": 1536}, name="gpt3-175b-1024")
    tmp = Path(tempfile.mkdtemp(prefix="trainsim-bench-sweep-"))
    phases: dict[str, float] = {}
    t0 = time.perf_counter()

    def progress(phase: str, done: int, total: int) -> None:
        if done == total:
            phases[phase] = time.perf_counter() - t0

    try:
        _, counts = sweep(study, tmp, top_k=10, workers=2, progress=progress)
    finally:
        shutil.rmtree(tmp)
    total = time.perf_counter() - t0
    screen_s = max(phases.get("screening", 0.0), 1e-9)
    print(f"sweep gpt3-175b on 1,024 A100s: {counts['enumerated']:,} combinations, "
          f"{counts['valid']:,} valid, {counts['do_not_fit']:,} do not fit; screened in "
          f"{screen_s:.1f} s ({counts['screened'] / screen_s:,.0f} strategies/s incl. worker "
          f"start-up), top {counts['replayed']} replayed; total {total:.1f} s (target < 60 s)")


if __name__ == "__main__":
    main()
