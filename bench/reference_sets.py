"""Every reference set the README's Fidelity section quotes, predicted in one command with the
stack each set's test describes (``analysis.stacks``, which the tests read too), and
its |error| summarised: rows, median, p90, max and the mean signed error. The tests hold each
row at the error reached; this prints them together, so that a change's effect on the whole
picture is one table (and the README's table can be checked against it).

    python bench/reference_sets.py [--rows] [--set NAME ...]

``--rows`` lists every row's error under its set. Fast path throughout (held within 2% of
replay); a few seconds on two cores.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import NamedTuple

import polars as pl

from analysis.stacks import with_stack
from analysis.validate import summarize, validate

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
PUBLIC = ROOT.parent / "shared" / "validation" / "public_runs.csv"


class RefSet(NamedTuple):
    name: str
    path: Path
    stack: str | None  # a name in ``analysis.stacks.STACKS`` (its overrides and kernel)


SETS = (
    RefSet("public (the schema's rows)", PUBLIC, None),
    RefSet("Megatron-LM 2022, A100", DATA / "megatron2022_runs.csv", "megatron-lm-2022"),
    RefSet("NeMo 24.07, H100 FP8", DATA / "nemo2407_runs.csv", "nemo-24.07"),
    RefSet("Megatron-Bridge, H100", DATA / "megatron_bridge_h100_runs.csv", "megatron-bridge"),
    RefSet("Megatron-Bridge, DGX B200", DATA / "megatron_bridge_b200_runs.csv",
           "megatron-bridge"),
    RefSet("Megatron-Bridge, GB200 NVL72", DATA / "megatron_bridge_gb200_runs.csv",
           "megatron-bridge"),
    RefSet("Megatron-Bridge, GB300 NVL72", DATA / "megatron_bridge_gb300_runs.csv",
           "megatron-bridge"),
    RefSet("Megatron-Bridge, NVFP4", DATA / "megatron_bridge_nvfp4_runs.csv", "megatron-bridge"),
    RefSet("Megatron-Bridge MoE (25.11, skills, PR)", DATA / "megatron_bridge_moe_runs.csv",
           "megatron-bridge"),
    RefSet("MoE on H100 (ModelZoo, DeepSeek-V3)", DATA / "megatron_moe_h100_runs.csv",
           "megatron-moe-modelzoo"),
    RefSet("MosaicML benchmark tables", DATA / "mpt_benchmarks_runs.csv", "llm-foundry"),
)


def summary(results: pl.DataFrame) -> str:
    """rows, median, p90 and max of |error|, and the mean signed error, as ``validate``
    summarises them (``analysis.validate.summarize``, its "all" group)."""
    r = summarize(results).row(0, named=True)
    return (f"{r['rows']:5d} {r['median_abs_error_pct']:7.1f} {r['p90_abs_error_pct']:6.1f} "
            f"{r['max_abs_error_pct']:6.1f} {r['mean_signed_error_pct']:+8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", action="store_true", help="every row's error under its set")
    ap.add_argument("--set", nargs="*", default=None,
                    help="only the sets whose name contains one of these words")
    args = ap.parse_args()
    chosen = [s for s in SETS if s.path.is_file()
              and (not args.set or any(w.lower() in s.name.lower() for w in args.set))]
    print(f"{'set':38s} {'rows':>5s} {'median':>7s} {'p90':>6s} {'max':>6s} {'signed':>8s}"
          "   (|error| %, fast path)")
    t0 = time.perf_counter()
    for ref in chosen:
        overrides, attention = with_stack(ref.stack, {}, None)
        got = validate(ref.path, fast=True, overrides=overrides, attention=attention)
        ok = got.filter(pl.col("status") == "ok")
        skipped = got.height - ok.height
        print(f"{ref.name:38s} {summary(got)}"
              + (f"   ({skipped} skipped)" if skipped else ""))
        if args.rows:
            for r in ok.sort("error_pct").iter_rows(named=True):
                print(f"    {r['id']:44s} {r['error_pct']:+7.1f}%")
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
