"""NVIDIA's MoE runs on DGX H100 beyond the public set (``tests/data/megatron_moe_h100_runs.csv``:
Megatron-MoE-ModelZoo's Qwen3-235B table, BF16 on 256 GPUs; Megatron-Bridge's DeepSeek-V3 row,
FP8 on 1,024), read with the runs file's text columns ``moe_dispatcher``, ``recompute_modules``
and ``pipeline_layout``. Diagnostic, not part of the validation summary: the rows say where the
MoE model stands (DESIGN.md, "DeepEP's dispatch")."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from analysis.stacks import STACKS
from analysis.validate import load_runs, row_inputs, validate

RUNS = Path(__file__).resolve().parent / "data" / "megatron_moe_h100_runs.csv"
# overlapped parameter gathers; in FP8 for the FP8 current-scaling row (Megatron-Bridge's
# ``bf16_with_fp8_current_scaling_mixed`` sets fp8_param_gather; not applied to the BF16 rows);
# prefetched for the Megatron-FSDP row (applied to ZeRO-3 rows only); the FP8 row's current scaling
# (its amax read before each cast not fed by a norm: tracegen/ops.py)
STACK = dict(STACKS["megatron-moe-modelzoo"].overrides)


@pytest.fixture(scope="module")
def results() -> pl.DataFrame:
    return validate(RUNS, fast=True, overrides=STACK, attention="cudnn-9.19")


def test_the_text_columns_name_the_dispatcher_and_modules() -> None:
    """Megatron's command line lists modules with spaces; the row's strategy holds them in
    trainsim's canonical order, and the dispatcher in its label."""
    rows = load_runs(RUNS).iter_rows(named=True)
    got = {r["id"]: row_inputs(r) for r in rows}
    ep32 = got["modelzoo-qwen3-235b-deepep-ep32"].strategy  # type: ignore[union-attr]
    assert ep32.moe_dispatcher == "deepep" and ep32.recompute_modules == "layernorm,moe_act"
    a2a = got["modelzoo-qwen3-235b-a2a-ep8"].strategy  # type: ignore[union-attr]
    assert a2a.moe_dispatcher == "alltoall" and "deepep" not in a2a.label()
    tp4 = got["modelzoo-qwen3-235b-deepep-tp4"].strategy  # type: ignore[union-attr]
    assert tp4.recompute == "none" and tp4.recompute_modules == "core_attn"
    merged = got["modelzoo-qwen3-235b-deepep-ep32-1f1b"].strategy  # type: ignore[union-attr]
    assert merged.overlap_moe_ep_comm and merged.delay_wgrad_compute  # (true/false columns)
    assert not ep32.overlap_moe_ep_comm and merged.label() == ep32.label().replace(
        "-deepep", "-deepep-a2ao-dw")
    dsv3 = got["mbridge2509-deepseek-v3"]
    assert dsv3.strategy.pipeline_layout == "Et|(tt|)*30mL"  # type: ignore[union-attr]
    assert dsv3.strategy.mtp_chunk == 31 and dsv3.model.mtp_layers == 1  # type: ignore[union-attr]


def test_the_moe_rows_are_predicted_within_the_error_reached(results: pl.DataFrame) -> None:
    """All three too fast: DeepEP at ep 32 −13.9%, the flat all-to-all at ep 8 −25.6% (−26.5%
    before NCCL's all-to-all inside a node ran at its own measured bus bandwidth, 320 GB/s on
    H100 where the all-reduce's 370 had stood in, sixty-fifth session), DeepEP
    at tp 4 without recompute −49.7% (−49.6% before its split GEMMs' chunks shared the SMs on
    Transformer Engine's three streams, sixty-fifth session; fifty-third session, a group's expert GEMMs one after
    another as an H200 ran them; −14.2 / −27.5 / −53.1% before, fifty-second session, with
    the script's TP overlap;
    −13.2 / −26.9 / −51.3% without it, twenty-fifth session, the experts a grouped GEMM;
    −16.4 / −30.6 / −54.3% without the dispatcher's permutations). The table's own ranking of its first two
    layouts holds (DeepEP across nodes beats the flat all-to-all inside them); its third, the
    slowest measured, trainsim puts fastest — nothing modelled explains it. Bounds are the
    errors reached."""
    assert (results["status"] == "ok").all() and results["fits"].all()
    err = dict(zip(results["id"], results["error_pct"], strict=True))
    assert -14.0 <= err["modelzoo-qwen3-235b-deepep-ep32"] < 0
    assert -25.9 <= err["modelzoo-qwen3-235b-a2a-ep8"] < 0
    assert -50.0 <= err["modelzoo-qwen3-235b-deepep-tp4"] < 0
    step = dict(zip(results["id"], results["predicted_iter_time_s"], strict=True))
    assert step["modelzoo-qwen3-235b-deepep-ep32"] < step["modelzoo-qwen3-235b-a2a-ep8"]


def test_combined_1f1b_saves_more_than_the_cluster_measured(results: pl.DataFrame) -> None:
    """The table's '+1f1b overlap' row: the ep 32 layout with merged passes and deferred
    weight gradients (the repository's A2A_OVERLAP=1), measured 19.7 → 17.6 s (−10.7%); both
    with the script's TP overlap (fifty-second session; 17.09 → 12.80 s without it).
    trainsim predicts 16.96 → 12.68 s (−25.2%): 28.0% too fast, and a saving about 2.4 times
    the measured one (16.91 → 12.63 s before a group's expert GEMMs ran one after another) — kept as the error reached, not tuned (DESIGN.md, "Combined 1F1B": the
    merged pass hides more of the all-to-alls than the cluster did)."""
    err = dict(zip(results["id"], results["error_pct"], strict=True))
    assert -28.1 <= err["modelzoo-qwen3-235b-deepep-ep32-1f1b"] < -26.0
    step = dict(zip(results["id"], results["predicted_iter_time_s"], strict=True))
    ours = step["modelzoo-qwen3-235b-deepep-ep32-1f1b"] / step["modelzoo-qwen3-235b-deepep-ep32"]
    measured = 17.6 / 19.7
    assert 0.73 < ours < 0.77 and 2.2 < (1 - ours) / (1 - measured) < 2.6


def test_the_megatron_fsdp_row_is_predicted_within_the_error_reached(
        results: pl.DataFrame) -> None:
    """The table's Megatron-FSDP row (tp 2, no pipeline, ep 8 inside a node, expert data
    parallelism 32 across nodes, micro-batch 4, full recompute: 17.6 s) with its gathers
    prefetched, as Megatron-FSDP overlaps them: +9.4% too slow with the script's TP overlap
    (fifty-second session; +14.0% without it, twenty-seventh session), where the table's other
    rows come out too fast. Its gathers and reduce-scatters are large: each
    rank's 302 M expert parameters a layer, gathered before each forward and backward and
    reduced after it over 32 nodes, every micro-batch. Blocking gathers would make it +96%.
    Bound: the error reached."""
    row = results.filter(pl.col("id") == "modelzoo-qwen3-235b-deepep-fsdp")
    assert row["status"].item() == "ok" and row["fits"].item()
    assert 0 < row["error_pct"].item() <= 10.0
    assert "override zero3_prefetch = True" in row["assumptions"].item()


def test_deepseek_v3_in_nvidias_own_layout(results: pl.DataFrame) -> None:
    """Megatron-Bridge's DeepSeek-V3 row (NeMo 25.09, 1,024 H100s, FP8) as its recipe runs it:
    the layout 'Et|(tt|)*30mL' (the MTP module and the loss alone in the last chunk), DeepEP,
    recompute of mla_up_proj and mlp, Megatron-Core's fused loss (Megatron-Bridge's default:
    the file's cross_entropy_fusion column), FP8 current scaling's amax reads (sixty-seventh
    session) and its sequence-parallel gathers of the dense layers' GEMM inputs in 1 byte, each
    after an amax all-reduce over TP (sixty-ninth session): 1.8% too fast (1.3% before
    them: 24.94 s against 25.27 s measured; 24.53 s, 2.9%, before the amax
    reads; 24.82 s, 1.8%, with the unfused loss then — its last chunk holds the loss and the MTP module's
    second pass of it; 24.79 s before a group's expert GEMMs ran one after another,
    fifty-third session; with the MTP module stood in for by a 62nd layer and an even split it
    had been 14.5% too fast). With its recipe's 16-bit gradient reduction (the file's
    grad_reduce_in_bf16, seventieth session): 1.9% too fast, 57.3 GiB (62.0 with fp32
    gradients). Bound: the error reached."""
    row = results.filter(pl.col("id") == "mbridge2509-deepseek-v3")
    assert row["status"].item() == "ok" and row["fits"].item()
    assert -2.2 <= row["error_pct"].item() < -1.6


def test_a_bad_text_cell_skips_its_row_by_name(tmp_path: Path) -> None:
    rows = pl.read_csv(RUNS, infer_schema_length=0).with_columns(
        pl.when(pl.col("id").str.ends_with("ep32")).then(pl.lit("nccl"))
        .otherwise(pl.col("moe_dispatcher")).alias("moe_dispatcher"),
        pl.when(pl.col("id").str.ends_with("a2a-ep8")).then(pl.lit("layernorm attention"))
        .otherwise(pl.col("recompute_modules")).alias("recompute_modules"),
        pl.when(pl.col("id").str.contains("deepseek")).then(pl.lit("Et|(tt|)*30m"))
        .otherwise(pl.col("pipeline_layout")).alias("pipeline_layout"))
    bad = tmp_path / "bad.csv"
    rows.write_csv(bad)
    got = validate(bad, fast=True)
    status = dict(zip(got["id"], got["status"], strict=True))
    first = status["modelzoo-qwen3-235b-deepep-ep32"]
    assert first.startswith("skipped:") and "moe_dispatcher must be one of alltoall, deepep" in first
    assert "unknown: 'attention'" in status["modelzoo-qwen3-235b-a2a-ep8"]
    assert "the loss (L) comes once, last in the last chunk" in status["mbridge2509-deepseek-v3"]


def test_a_dispatcher_set_for_a_mixed_file_leaves_dense_rows_alone() -> None:
    """``--set strategy.moe_dispatcher=deepep`` over the Megatron-Bridge file: the dense rows
    are predicted as before, saying the override had nothing to apply to."""
    mixed = RUNS.parent / "megatron_bridge_h100_runs.csv"
    got = validate(mixed, fast=True, overrides={"strategy.moe_dispatcher": "deepep"})
    assert (got["status"] == "ok").all()
    dense = got.filter(~pl.col("id").str.contains("qwen3"))
    assert dense["assumptions"].str.contains("moe_dispatcher not applied").all()
