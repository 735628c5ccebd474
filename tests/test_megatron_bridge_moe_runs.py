"""NVIDIA's MoE runs of Megatron-Bridge's 25.11 tables, beyond the public set
(``tests/data/megatron_bridge_moe_runs.csv``: the Qwen3-30B-A3B, Qwen3-235B-A22B and GPT-OSS
120B rows of its DGX-GB300, DGX-GB200 and DGX-B200 tables, the two DeepSeek-V3 rows whose layout
the recipe names, and the DGX-H100 table's Qwen3-30B and GPT-OSS rows — its Qwen3-235B row is in
``megatron_bridge_h100_runs.csv`` — three Qwen3-30B H100 runs its skills' notes report, and
the two B200 Qwen3-30B runs of the pull request that fixed that table's B200 recipe, and
Megatron-LM's recipe index's two figures for each of its Qwen3-235B and Qwen3-30B H100 BF16
recipes),
read with the recipe files' settings the rows' notes name.
Diagnostic, not part of the validation summary and not used to set anything: where the MoE
model stands. Each bound is the error reached (seventieth session), so it cannot drift
unseen."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from analysis.validate import RunInputs, load_runs, row_inputs, validate
from tests.test_megatron_bridge_runs import STACK

RUNS = Path(__file__).resolve().parent / "data" / "megatron_bridge_moe_runs.csv"


@pytest.fixture(scope="module")
def results() -> pl.DataFrame:
    return validate(RUNS, fast=True, overrides=STACK)


def _err(results: pl.DataFrame) -> dict[str, float]:
    return dict(zip(results["id"], results["error_pct"], strict=True))


def test_the_rows_read_as_their_recipes_say() -> None:
    """MXFP8 where the table says FP8-MX (the row's recipe wins over the file-wide current
    scaling of the Megatron-Bridge stack), 16-bit gradient reduction (the recipes'
    ``grad_reduce_in_fp32 = False``), GPT-OSS's window on every other layer and, on GB200 and
    B200, its selective recompute of the norms and the MoE activation."""
    rows = {r["id"]: r for r in load_runs(RUNS).iter_rows(named=True)}
    got = {rid: row_inputs(r, overrides=STACK) for rid, r in rows.items()}
    assert all(isinstance(g, RunInputs) for g in got.values()), got
    mx = got["mbridge2511-gb300-qwen3-30b-a3b"]
    assert isinstance(mx, RunInputs)
    assert mx.strategy.precision == "fp8" and mx.strategy.fp8_recipe == "mxfp8"
    assert "fp8_recipe not applied (the row says mxfp8)" in mx.assumptions
    assert all(g.strategy.grad_reduce_in_bf16 for g in got.values()  # type: ignore[union-attr]
               )
    oss = got["mbridge2511-b200-gpt-oss-120b"]
    assert isinstance(oss, RunInputs)
    assert oss.model.sliding_window == 128 and oss.model.window_pattern == "SF"
    assert oss.strategy.recompute == "selective"
    assert oss.strategy.recompute_modules == "layernorm,moe_act"
    dsv3 = got["mbridge2511-b200-deepseek-v3"]
    assert isinstance(dsv3, RunInputs)
    assert dsv3.strategy.pipeline_layout == "Et*4|(t*4|)*14tmL" and dsv3.model.mtp_layers == 1
    assert dsv3.strategy.adam_moments_dtype == "bf16"
    assert dsv3.strategy.recompute_modules == "mla_up_proj"
    bf16 = got["mbridge2511-gb200-qwen3-235b-a22b"]
    assert isinstance(bf16, RunInputs) and bf16.strategy.precision == "bf16"
    assert bf16.strategy.first_stage_layers or bf16.strategy.last_stage_layers  # 94 on 24


def test_the_rack_scale_rows_are_predicted_within_the_error_reached(
        results: pl.DataFrame) -> None:
    """The rack-scale rows of 256 GPUs (all expert traffic inside a rack's 64): Qwen3-235B
    (BF16, pp 4 × vp 12 at ep 16 and pp 8 × vp 3 at ep 32) −0.2% and −3.8%, DeepSeek-V3 on
    GB200 (BF16, pp 4 × vp 4 at ep 64) −9.6%."""
    assert (results["status"] == "ok").all()
    err = _err(results)
    assert -0.7 <= err["mbridge2511-gb300-qwen3-235b-a22b"] <= 0.3
    assert -4.3 <= err["mbridge2511-gb200-qwen3-235b-a22b"] <= -3.3
    assert -10.1 <= err["mbridge2511-gb200-deepseek-v3"] <= -9.1


def test_the_other_rows_are_too_fast_by_the_error_reached(results: pl.DataFrame) -> None:
    """Too fast elsewhere, nothing fitted: Qwen3-30B on one GB300 / GB200 tray set −13.0 /
    −21.9%, GPT-OSS 120B on 64 GB300 / GB200 −38.4 / −36.5% (its attention sinks and the
    recipes' CUDA graphs and HybridEP not modelled), and every DGX-B200 row by 33–65%: the
    B200 table's MoE rows run 1.5–2.6 times slower a GPU than GB200's, where trainsim's GPUs
    differ by their clocks (the 8-GPU Qwen3-30B at mbs 1: 9,299 tokens/s a GPU against
    GB200's 23,766 at mbs 4 — a recipe Megatron-Bridge later fixed, after which the B200s ran
    as GB200's and trainsim is 18.9% short of them: the last test). The DGX-H100 table's rows say it is not Blackwell's: Qwen3-30B
    on 16 H100s (pp 2 × vp 24, mbs 2) −58.8%, GPT-OSS on 64 (pp 4) −26.0% — the small MoE
    at few tokens a micro-batch is the one far off, on either GPU (nothing modelled explains
    it: a host that issues kernels slower than the GPU runs them would, unmeasured). The BF16
    Qwen3-30B run on 16 H100s that Megatron-Bridge's CUDA-graphs skill reports (EP 16 over both
    nodes, mbs 1, the recipe file's preset) −20.1%: not 59% at every layout."""
    err = _err(results)
    reached = {"mbridge2511-gb300-qwen3-30b-a3b": -13.0, "mbridge2511-gb200-qwen3-30b-a3b": -21.9,
               "mbridge2511-b200-qwen3-30b-a3b": -65.3, "mbridge2511-b200-qwen3-235b-a22b": -41.8,
               "mbridge2511-gb300-gpt-oss-120b": -38.4, "mbridge2511-gb200-gpt-oss-120b": -36.5,
               "mbridge2511-b200-gpt-oss-120b": -48.0, "mbridge2511-b200-deepseek-v3": -33.5,
               "mbridge2511-h100-qwen3-30b-a3b": -58.8, "mbridge2511-h100-gpt-oss-120b": -26.0,
               "mbridge-skill-h100-qwen3-30b-a3b-bf16": -20.1,
               "mbridge-skill-h100-qwen3-30b-a3b-bf16-epov": -32.0,
               "mbridge-skill-h100-qwen3-30b-a3b-bf16-epov-dwg": -35.6,
               "mbridge-pr2499-b200-qwen3-30b-a3b-fp8mx": -18.9,
               "mbridge-pr2499-b200-qwen3-30b-a3b-bf16": -12.3,
               "mlm5728-h100-qwen3-235b-a22b-bf16": -8.6,
               "mlm5728-h100-qwen3-235b-a22b-bf16-previous": -35.1,
               "mlm5728-h100-qwen3-30b-a3b-bf16": -25.6,
               "mlm5728-h100-qwen3-30b-a3b-bf16-previous": -27.6}
    for rid, e in reached.items():
        assert e - 0.5 <= err[rid] <= e + 0.5, (rid, err[rid])


def test_memory_fits_where_the_runs_did_but_one(results: pl.DataFrame) -> None:
    """Every row fits its GPU but the H100 GPT-OSS one: 101 GiB predicted where it ran in 80,
    at pp 4 with the norms and the MoE activation recomputed as the recipe file's V1 preset
    says — the 25.11 run must have held less (its layout is the table's; what else it
    recomputed or offloaded is not stated)."""
    fits = dict(zip(results["id"], results["fits"], strict=True))
    assert [rid for rid, ok in fits.items() if not ok] == ["mbridge2511-h100-gpt-oss-120b"]
    mem = dict(zip(results["id"], results["predicted_peak_memory_GiB"], strict=True))
    assert 100 < mem["mbridge2511-h100-gpt-oss-120b"] < 103


def test_each_models_gpus_are_ordered_as_measured_but_one(results: pl.DataFrame) -> None:
    """Tokens a GPU: GB300 ahead of GB200 ahead of B200 for Qwen3-30B and GPT-OSS, GB200 ahead
    of B200 for DeepSeek-V3, as the tables measured (their ratios are not: GB200 / GB300 for the same Qwen3-30B recipe 1.09
    predicted against 1.22 measured). Qwen3-235B's B200 row (FP8-MX on 64 GPUs) comes out
    ahead of GB200's (BF16 on 256), where it measured 34% behind: the B200 rows' gap above."""
    rate = dict(zip(results["id"], results["predicted_tokens_per_s"], strict=True))
    rows = {r["id"]: r for r in load_runs(RUNS).iter_rows(named=True)}

    def per_gpu(model: str) -> tuple[dict[str, float], dict[str, float]]:
        ids = {g: f"mbridge2511-{g}-{model}" for g in ("gb300", "gb200", "b200")}
        return ({g: rate[i] / rows[i]["num_gpus"] for g, i in ids.items()},
                {g: float(rows[i]["measured_tokens_per_s_per_gpu"]) for g, i in ids.items()})

    for model in ("qwen3-30b-a3b", "gpt-oss-120b"):
        ours, measured = per_gpu(model)
        assert ours["gb300"] > ours["gb200"] > ours["b200"], (model, ours)
        assert measured["gb300"] > measured["gb200"] > measured["b200"], model
    ds = {g: rate[f"mbridge2511-{g}-deepseek-v3"] / 256 for g in ("gb200", "b200")}
    assert ds["gb200"] > ds["b200"]  # (3,139 and 2,139 tokens/s a GPU measured)
    ours, measured = per_gpu("qwen3-235b-a22b")
    assert ours["gb300"] > ours["b200"] > ours["gb200"]
    assert measured["gb200"] > measured["b200"]
    step = dict(zip(results["id"], results["predicted_iter_time_s"], strict=True))
    ratio = step["mbridge2511-gb200-qwen3-30b-a3b"] / step["mbridge2511-gb300-qwen3-30b-a3b"]
    assert ratio == pytest.approx(1.09, abs=0.01)


def test_the_h100_qwen3_30b_run_holds_about_its_reported_memory() -> None:
    """The same recipe's smoke run a day earlier (the dispatcher-selection skill's notes,
    2026-05-17: 16 H100s, EP 16, BF16, the all-to-all dispatcher, the router's CUDA graphs,
    unfused permutations) reports 61.351 GB peak allocated (``mem-max-allocated-gigabytes``,
    decimal GB as the bridge logs them) and 45.65 s a step. The tensors trainsim holds at the
    peak — the breakdown less its runtime and fragmentation allowances, which the allocator's
    count does not see — come to 60.1 GB, 2.0% under: the graphs' static buffers and the
    unfused permutations' copies, neither modelled, hold more, not less. Its step, 33.0 s,
    is 28% short of that run and 20% short of the eager one the row holds."""
    from analysis.glance import glance

    row = next(r for r in load_runs(RUNS).iter_rows(named=True)
               if r["id"] == "mbridge-skill-h100-qwen3-30b-a3b-bf16")
    inputs = row_inputs(row, overrides=STACK)
    assert isinstance(inputs, RunInputs)
    assert (inputs.strategy.ep, inputs.strategy.dp, inputs.strategy.zero_stage) == (16, 16, 1)
    g = glance(inputs.model, inputs.strategy, inputs.system)
    held = max(st.memory.total_bytes - st.memory.runtime_bytes - st.memory.fragmentation_bytes
               for st in g.stages) / 1e9
    assert held / 61.351 - 1 == pytest.approx(-0.020, abs=0.005)
    assert g.fits and g.step_time_s / 45.65 - 1 == pytest.approx(-0.276, abs=0.005)


def test_the_ep_overlap_pair_saves_less_than_trainsim_says(results: pl.DataFrame) -> None:
    """Megatron-Bridge's expert-parallel-overlap skill measured the overlap on one stack
    (2026-05-18, Qwen3-30B-A3B on 16 H100s, EP 16 over both nodes, the all-to-all dispatcher,
    no CUDA graphs): 41.25 s without it, 31.31 s with merged passes (−24.1%), 31.20 s with the
    weight gradients deferred too. trainsim: 33.03 → 21.28 → 20.09 s, a saving of 35.6%, 1.5
    times the measured one — less over than the ModelZoo pair's 2.4 (Qwen3-235B, DeepEP, pp 8 ×
    vp 4), in the same direction — and 5.6% more from the deferral where it measured 0.4%.
    Kept as reached, nothing tuned (DESIGN.md, "Combined 1F1B")."""
    step = dict(zip(results["id"], results["predicted_iter_time_s"], strict=True))
    base = step["mbridge-skill-h100-qwen3-30b-a3b-bf16"]
    merged = step["mbridge-skill-h100-qwen3-30b-a3b-bf16-epov"]
    deferred = step["mbridge-skill-h100-qwen3-30b-a3b-bf16-epov-dwg"]
    ours, measured = 1 - merged / base, 1 - 31.31 / 41.25
    assert ours == pytest.approx(0.356, abs=0.005) and measured == pytest.approx(0.241, abs=0.001)
    assert ours / measured == pytest.approx(1.48, abs=0.03)
    assert merged / deferred - 1 == pytest.approx(0.059, abs=0.005)
    assert 31.31 / 31.20 - 1 < 0.004  # what the deferral bought, measured


def test_the_b200_qwen3_30b_row_ran_a_recipe_later_fixed(results: pl.DataFrame) -> None:
    """The 25.11 DGX-B200 Qwen3-30B row (9,299 tokens/s a GPU, 2.6 times under GB200's) ran a
    recipe Megatron-Bridge's pull request 2499 found wrong: the all-to-all dispatcher hard-coded
    where every other GPU's recipe used the flex one (HybridEP), the micro-batch left at 1 where
    the others run 4, and no CUDA graph of the attention. Fixed, the same 8 B200s measured
    555 TFLOP/s (MXFP8) and 546 (BF16) against the row's 214: 10.87 and 11.05 s a step, and
    trainsim is 18.9% and 12.3% short — beside GB200's 21.9%, not 65%. What the fix bought,
    measured, 2.59 times; trainsim, which sees only the micro-batch (the dispatcher's backend
    and the graphs are not modelled), 1.11: the time a micro-batch costs whatever its size (its
    host-side work, the all-to-all dispatcher's wait for the token counts) is what trainsim
    lacks at one micro-batch of 4,096 tokens. MXFP8 over BF16: 1.6% faster measured (a user's
    run in the 26.04.01 container, Megatron-Bridge issue 4439: 562 against 552 TFLOP/s, 1.8%),
    9.9% in trainsim, whose FP8 GEMMs save 1.40 s a step and casts cost 0.52 s back: small
    experts' FP8 GEMMs on Blackwell are not measured (DESIGN.md)."""
    step = dict(zip(results["id"], results["predicted_iter_time_s"], strict=True))
    measured = dict(zip(results["id"], results["measured_iter_time_s"], strict=True))
    old, fixed = "mbridge2511-b200-qwen3-30b-a3b", "mbridge-pr2499-b200-qwen3-30b-a3b-fp8mx"
    bf16 = "mbridge-pr2499-b200-qwen3-30b-a3b-bf16"
    assert measured[old] / measured[fixed] == pytest.approx(2.59, abs=0.01)
    assert step[old] / step[fixed] == pytest.approx(1.11, abs=0.01)
    assert measured[bf16] / measured[fixed] - 1 == pytest.approx(0.016, abs=0.002)
    assert step[bf16] / step[fixed] - 1 == pytest.approx(0.099, abs=0.005)
    gb200 = step["mbridge2511-gb200-qwen3-30b-a3b"] / measured["mbridge2511-gb200-qwen3-30b-a3b"]
    assert abs(step[fixed] / measured[fixed] - gb200) < 0.04  # the same recipe on both, near


def test_one_recipes_figure_moved_41_percent_between_releases(results: pl.DataFrame) -> None:
    """Megatron-LM's Qwen3 MoE recipe index (its pull request 5728, 2026-07-09) refreshed the
    Qwen3-235B H100 BF16 recipe (256 GPUs, tp 2 × pp 8 × vp 4, EP 32, GBS 8,192, merged passes)
    from 214.3 to 302.0 TFLOP/s a GPU: the same recipe, 41% faster on a later stack. trainsim,
    given the same inputs for both, is 35.1% short of the earlier figure and 8.6% of the later
    — the MoE rows' shortfall is partly the software of their day, which a model of the
    kernels and collectives at their measured rates does not carry."""
    step = dict(zip(results["id"], results["predicted_iter_time_s"], strict=True))
    measured = dict(zip(results["id"], results["measured_iter_time_s"], strict=True))
    new, old = "mlm5728-h100-qwen3-235b-a22b-bf16", "mlm5728-h100-qwen3-235b-a22b-bf16-previous"
    assert step[new] == step[old]
    assert measured[old] / measured[new] == pytest.approx(302.0 / 214.3, rel=1e-3)
    assert step[new] / measured[new] - 1 == pytest.approx(-0.086, abs=0.005)


def test_the_30b_recipe_runs_hybridep_read_as_deepep() -> None:
    """The index's Qwen3-30B H100 BF16 recipe (16 GPUs, EP 16 over both nodes, GBS 1,024) runs
    the flex dispatcher with HybridEP and TE's fused loss: read as DeepEP (the nearest trainsim
    models), its row's fused loss winning over the stack's native one as a row's cells do —
    240.5 TFLOP/s (25.08 s) against 18.66 s, 25.6% short, as the rest of the small MoE."""
    row = next(r for r in load_runs(RUNS).iter_rows(named=True)
               if r["id"] == "mlm5728-h100-qwen3-30b-a3b-bf16")
    got = row_inputs(row, overrides=STACK)
    assert isinstance(got, RunInputs)
    assert got.strategy.moe_dispatcher == "deepep" and got.strategy.cross_entropy_fusion == "te"
    assert "cross_entropy_fusion not applied (the row says te)" in got.assumptions
