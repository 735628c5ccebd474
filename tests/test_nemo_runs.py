"""NVIDIA's own FP8 runs on DGX H100 (NeMo 24.07 performance table, tests/data/nemo2407_runs.csv):
a diagnostic set on the stack the Hopper constants describe. The transcription is checked by the
published model TFLOP/s, and the prediction held where it is (DESIGN.md, "NeMo's FP8 runs")."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from analysis.glance import strategy_rates
from analysis.stacks import STACKS
from analysis.validate import RunInputs, load_runs, row_inputs, validate

NEMO = Path(__file__).parent / "data" / "nemo2407_runs.csv"
# What the NeMo performance recipes run (the CSV's notes): cuDNN attention through Transformer
# Engine, TP communication overlap where tp > 1, the distributed optimizer's overlapped gathers,
# FP8 parameters (NeMo's FP8 precision recipe, ``bf16_with_fp8_mixed``, sets ``fp8_params``:
# FP8 weights gathered in 1 byte, no 16-bit copy beside them).
STACK = dict(STACKS["nemo-24.07"].overrides)


def test_the_published_model_tflops_follow_from_the_rows() -> None:
    """trainsim's model FLOPs of each row at its measured step time give the Model TFLOP/s/GPU
    NVIDIA publishes for it within 0.5%: architecture, batch, throughput and FLOP convention
    agree (a mistyped cell fails here)."""
    runs = load_runs(NEMO)
    assert runs.height == 7
    for r in runs.iter_rows(named=True):
        inputs = row_inputs(r)
        assert isinstance(inputs, RunInputs), inputs
        rates = strategy_rates(inputs.model, inputs.strategy, inputs.system,
                               r["measured_iter_time_s"])
        tflops = rates["mfu"] * inputs.system.gpu.peak_flop_per_s("fp8") / 1e12
        assert tflops == pytest.approx(float(r["measured_tflops_per_gpu"]), rel=0.005), r["id"]


@pytest.fixture(scope="module")
def results() -> pl.DataFrame:
    return validate(NEMO, fast=True, overrides=STACK, attention="cudnn")


def test_nemo_stack_is_predicted_within_the_error_reached(results: pl.DataFrame) -> None:
    """All seven come out 4.1-9.0% too fast (3.4-8.3% before the sixty-ninth session gathered
    the sequence-parallel GEMM inputs of these FP8 runs in 1 byte, as Transformer Engine 1.x
    does — it casts before it gathers, tracegen/ops.py — which moved the five TP rows 0.7-0.9
    point; a correction of what the runs moved, read in the framework's code, not a fit, so
    the bound moved with it; 1-8.3% before the context-parallel rows' later ring
    steps were costed as calls without the causal mask, as an H200 measured them, sixty-sixth
    session: Llama 3 8B / 70B at cp 2 −5.5 / −0.9 → −7.3 / −3.4%; 3-10% before their
    TP-overlapped GEMMs ran in
    Transformer Engine's chunks at the GEMM occupancy fitted to OpenXLA's sm_90 table and the
    context-parallel rows' ring merged each step's output; 6-11%
    before the occupancy term measured on an H200 applied to the 2024 cuDNN line; 11-17% with ml-engineering's H200 clock ratio before
    trainsim measured its own; 12-20% before compute/communication interference; DESIGN.md
    says where the rest may come from); the bound is the error reached, never to be loosened
    to make room for a change that is not such a correction."""
    assert (results["status"] == "ok").all()
    assert results["error_pct"].abs().max() <= 9.1  # type: ignore[operator]


def test_tp_overlap_is_not_applied_where_there_is_no_tp(results: pl.DataFrame) -> None:
    """One ``--set strategy.tp_comm_overlap=true`` describes the stack across the set: rows at
    tp 1 run without it (nothing to overlap) and say so, instead of being skipped."""
    runs = load_runs(NEMO).select("id", "tp")
    got = results.join(runs, on="id")
    tp1 = got.filter(pl.col("tp") == 1)
    assert tp1.height == 3
    assert tp1["assumptions"].str.contains("tp_comm_overlap not applied at tp 1").all()
    assert not got.filter(pl.col("tp") > 1)["assumptions"].str.contains("not applied").any()


def test_every_run_fits(results: pl.DataFrame) -> None:
    """They ran, so they fit — with the FP8 copies Transformer Engine keeps for the weight
    gradients counted at 1 byte (tracegen/memory.py) and FP8 parameters as the recipe has them
    (with 16-bit weights and Transformer Engine's cached FP8 copies beside them, four of the
    seven would not: 80.1–92.6 GiB). Counted at 16 bits, Llama 3 8B with cp 2 and GPT-3 175B
    with micro-batch 2 came out at 81 and 84 GiB."""
    assert results["fits"].all()
