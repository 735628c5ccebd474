"""What ``estimate``, ``compare`` and ``sweep`` say a MoE step is worth (``cli_common.MOE_NOTE``):
its figures are NVIDIA's published MoE runs in the reference sets, predicted with each set's
stack, so the note cannot drift from them."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from analysis.cli_common import MOE_NOTE, MOE_REFERENCE
from analysis.validate import load_runs, validate
from tests import test_megatron_bridge_runs as mb
from tests import test_megatron_moe_runs as moe
from tests.test_cli import run
from tests.test_megatron_bridge_moe_runs import RUNS as MB_MOE

SETS = ((mb.RUNS, mb.STACK, "cudnn-9.19"), (MB_MOE, mb.STACK, None),
        (moe.RUNS, moe.STACK, "cudnn-9.19"))


def test_the_note_gives_the_reference_sets_moe_runs() -> None:
    """Every MoE row of the three sets that hold NVIDIA's MoE runs, each with its set's stack:
    how many, the median error, how many too fast and how many within 10%."""
    errors = []
    for path, stack, attention in SETS:
        arch = dict(load_runs(path).select("id", "arch").iter_rows())
        got = validate(path, fast=True, overrides=stack, attention=attention)
        errors += [r["error_pct"] for r in got.iter_rows(named=True)
                   if r["status"] == "ok" and arch[r["id"]] == "moe"]
    reached = {"runs": len(errors), "median": round(-statistics.median(errors)),
               "slower": sum(e < 0 for e in errors),
               "close": sum(abs(e) <= 10 for e in errors)}
    assert reached == MOE_REFERENCE


def test_estimate_says_it_for_a_moe_model_only(tmp_path: Path) -> None:
    """Printed, and in ``--json`` as ``moe_reference`` (runs, median, slower, close)."""
    base = ("estimate", "--gpus", "8", "--mbs", "1", "--gbs", "8", "--system", "dgx-h100")
    moe_run = run(*base, "--model", "qwen3-30b-a3b", "--ep", "8", "--json",
                  str(tmp_path / "moe.json"))
    assert MOE_NOTE.format(**MOE_REFERENCE) in " ".join(moe_run.stdout.split())
    assert json.loads((tmp_path / "moe.json").read_text())["moe_reference"] == MOE_REFERENCE
    dense = run(*base, "--model", "llama3-8b", "--json", str(tmp_path / "dense.json"))
    assert dense.returncode == 0 and "published MoE runs" not in dense.stdout
    assert "moe_reference" not in json.loads((tmp_path / "dense.json").read_text())
