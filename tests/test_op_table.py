"""The op table (``analysis/op_table.py``): every op of a stage priced by the compute model's
own terms, adding up to what the fast path charges the stage, on the GPU's roofline."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import polars as pl
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from analysis.fastpath import estimate
from analysis.op_table import by_kind, op_table
from analysis.plots import roofline
from replay import get_system
from replay.compute import RooflineCompute
from tests.test_cli import run
from tests.test_fastpath import MODEL, MOE
from tracegen import ConfigError, ModelSpec, Strategy, get_model
from tracegen.units import DTYPE_CODE


def _stage_sums(table: pl.DataFrame) -> tuple[float, float]:
    """(forward, recompute + backward) seconds of one micro-batch on the table's stage: the
    rows in series (not the overlapped collectives, which run beside) times their counts."""
    serial = table.filter(~pl.col("overlapped"))
    t = serial["time_us"] * serial["count"]
    fwd = float(t.filter(serial["pass"] == "forward").sum())
    return fwd / 1e6, float(t.sum()) / 1e6 - fwd / 1e6


@given(tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2, 4]), dp=st.sampled_from([1, 2]),
       cp=st.sampled_from([1, 1, 2]), sp=st.booleans(), overlap=st.booleans(),
       zero=st.sampled_from([0, 1, 3]), recompute=st.sampled_from(["none", "selective", "full"]),
       interleaved=st.booleans(), ep=st.sampled_from([0, 0, 2, 4]), fp8=st.booleans(),
       uneven=st.booleans(), rc_layers=st.sampled_from([0, 0, 1]),
       modules=st.sampled_from(["core_attn", "layernorm,mlp", "core_attn,moe_act"]),
       mtp=st.sampled_from([0, 0, 1]), tied=st.booleans(),
       system=st.sampled_from(["dgx-h100", "dgx-a100-80gb", "dgx1-v100", "mi300x"]),
       zb=st.booleans())
def test_rows_add_up_to_the_fast_paths_stage_times(tp, pp, dp, cp, sp, overlap, zero,
                                                   recompute, interleaved, ep, fp8, uneven,
                                                   rc_layers, modules, mtp, tied,
                                                   system, zb) -> None:
    """Conservation: on every stage, the forward rows (× count) add up to the fast path's
    forward of one micro-batch and the recompute and backward rows to its backward — to the
    nanosecond, the ``overlap`` rows carrying what overlapped collectives add — for dense and
    MoE models, every recompute, TP overlap, FP8, context parallelism, interleaving, uneven
    stages, MTP modules and ZeRO-3's gathers in the chain (not prefetched: those are timed by
    chunk, not block), on GPUs whose models take other branches (V100: unfused attention);
    under ZB-H1 and ZB-V (``zb``, with ``interleaved`` the V's two chunks a stage) the B and W
    rows add up to the stage's B + W."""
    moe = ep > 0
    model = dataclasses.replace(MOE if moe else MODEL, tied_embeddings=tied, mtp_layers=mtp)
    if moe:
        modules = modules.replace("layernorm,mlp", "layernorm,moe")
    else:
        modules = modules.replace("moe_act", "mlp")
    try:
        s = Strategy(tp=tp, pp=pp, dp=dp, cp=cp, ep=max(ep, 1), sequence_parallel=sp and tp > 1,
                     tp_comm_overlap=overlap and sp and tp > 1, zero_stage=zero,
                     recompute=recompute, recompute_modules=modules if recompute == "selective"
                     else "core_attn", recompute_num_layers=rc_layers if recompute == "full"
                     else 0, vpp=2 if interleaved and pp > 1 else 1,
                     schedule=("zb_v" if zb else "interleaved_1f1b") if interleaved and pp > 1
                     else "zb_h1" if zb else "1f1b",
                     first_stage_layers=int(uneven and pp > 1),
                     last_stage_layers=int(uneven and pp > 1),
                     precision="fp8" if fp8 else "bf16", micro_batch_size=1,
                     global_batch_size=dp * 2 * pp)
        fast = estimate(model, s, system)
    except ConfigError:
        assume(False)
        raise
    for stage in range(pp):
        fwd_s, bwd_s = _stage_sums(op_table(model, s, system, stage=stage))
        assert fwd_s == pytest.approx(fast.stage_fwd_s[stage], rel=1e-9, abs=1e-12)
        assert bwd_s == pytest.approx(fast.stage_bwd_s[stage], rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("name,kw", [
    ("gpt3-175b", dict(tp=8, pp=8, dp=1, sequence_parallel=True)),
    ("llama3-70b", dict(tp=4, pp=4, cp=2, dp=1, sequence_parallel=True)),
    ("llama3-8b", dict(tp=1, pp=1, dp=1)),
])
def test_forward_gemm_flops_are_two_per_weight_per_token(name: str, kw: dict) -> None:
    """The forward GEMMs of every stage, times the ranks that split them (tp · cp), are
    2 FLOPs per weight per token (Kaplan et al. 2020, §2.1: C_forward ≈ 2N per token): the
    layers' projections and MLP and the output head, nothing twice, nothing left out."""
    m = get_model(name)
    s = Strategy(micro_batch_size=1, global_batch_size=kw["pp"] * 2, **kw)
    total = 0
    for stage in range(s.pp):
        t = op_table(m, s, "dgx-h100", stage=stage)
        g = t.filter((pl.col("pass") == "forward") & (pl.col("kind") == "gemm"))
        total += int((g["flop"] * g["count"]).sum())
    h, gated = m.hidden_size, m.gated
    per_layer = h * (m.q_size + 2 * m.kv_size) + m.q_size * h + (3 if gated else 2) * h * \
        m.ffn_hidden_size
    weights = m.num_layers * per_layer + h * m.vocab_size
    assert total * s.tp * s.cp == 2 * m.seq_len * weights


@given(kind=st.sampled_from(["gemm", "attention", "elementwise", "norm"]),
       rows=st.integers(1, 65536), n=st.integers(1, 32768), k=st.integers(1, 32768),
       nbytes=st.integers(0, 10**10), backward=st.booleans(), splits=st.sampled_from([1, 4]),
       groups=st.sampled_from([1, 8]), dtype=st.sampled_from(["bf16", "fp8", "fp16"]),
       system=st.sampled_from(["dgx-h100", "dgx-a100-80gb", "dgx1-v100", "dgx-b200"]))
def test_explained_terms_make_the_duration(kind, rows, n, k, nbytes, backward, splits, groups,
                                           dtype, system) -> None:
    """``explain`` is ``op_ns`` with its terms: the time is the larger of the tensor-core and
    HBM times plus the launches (on V100's unfused attention, their sum), and ``bound`` names
    the term that sets it."""
    gpu = get_system(system).gpu
    model = RooflineCompute(gpu)
    if kind == "attention":
        n, k = rows, min(k, 256)
    flop = 2 * rows * n * k if kind in ("gemm", "attention") else rows
    args = (kind, flop, nbytes, rows, n, DTYPE_CODE[dtype], backward, k, splits, groups)
    cost = model.explain(*args)
    assert cost.total_ns == model.op_ns(*args)
    if kind == "attention" and not gpu.flash_attention:
        assert abs(cost.total_ns - (cost.compute_ns + cost.memory_ns + cost.launch_ns)) <= 1
    else:
        assert cost.total_ns == max(cost.compute_ns, cost.memory_ns) + cost.launch_ns
    top = max(cost.compute_ns, cost.memory_ns)
    assert cost.bound == ("launch" if cost.launch_ns >= top else
                          "compute" if cost.compute_ns > cost.memory_ns else "memory")
    if kind in ("elementwise", "norm"):
        assert cost.compute_ns == 0 and cost.efficiency == 0


def test_no_op_beats_the_datasheet_and_memory_ops_sit_on_the_slope() -> None:
    """Physical bounds: no op's achieved FLOP/s above the GPU's datasheet peak for its dtype;
    the norms and element-wise ops take their HBM time (plus the launch), never less."""
    system = get_system("dgx-h100")
    s = Strategy(tp=8, pp=4, dp=1, sequence_parallel=True, recompute="selective",
                 micro_batch_size=1, global_batch_size=8)
    t = op_table("llama3-70b", s, system, stage=3)
    compute = t.filter(pl.col("achieved_tflops").is_not_null())
    peak = system.gpu.peak_flop_per_s("bf16") / 1e12
    assert (compute["achieved_tflops"] <= peak).all()
    mem = t.filter(pl.col("kind").is_in(["norm", "elementwise"]))
    assert mem.height and (mem["bound"] == "memory").all()
    assert (mem["time_us"] - mem["memory_us"] - mem["launch_us"]).abs().max() < 1e-3


def test_by_kind_shares_add_to_the_whole_and_overlapped_collectives_stand_apart() -> None:
    s = Strategy(tp=8, pp=1, dp=1, sequence_parallel=True, tp_comm_overlap=True,
                 micro_batch_size=1, global_batch_size=1)
    t = op_table("llama3-8b", s, "dgx-h100")
    kinds = by_kind(t)
    assert kinds["share_pct"].sum() == pytest.approx(100)
    beside = kinds.filter(pl.col("overlapped"))
    assert beside.height and beside["share_pct"].is_null().all()
    assert set(t.filter(pl.col("overlapped"))["axis"]) == {"tp"}


def test_a_stage_outside_the_pipeline_is_refused() -> None:
    s = Strategy(tp=1, pp=2, dp=1, micro_batch_size=1, global_batch_size=2)
    with pytest.raises(ConfigError, match="stage 2 is not in a pipeline of 2: choose 0 … 1"):
        op_table(MODEL, s, "dgx-h100", stage=2)


def test_roofline_plots_every_op_with_flops_under_the_roof() -> None:
    system = get_system("dgx-a100-80gb")
    model = ModelSpec(name="r", num_layers=2, hidden_size=1024, num_attention_heads=8,
                      ffn_hidden_size=4096, vocab_size=8192, seq_len=2048)
    t = op_table(model, Strategy(micro_batch_size=2, global_batch_size=2), system)
    fig = roofline(t, system.gpu)
    ax = fig.axes[0]
    assert ax.get_xscale() == ax.get_yscale() == "log"
    plotted = sum(len(c.get_offsets()) for c in ax.collections)
    assert plotted == t.filter((pl.col("flop") > 0) & (pl.col("bytes") > 0)).height > 0
    roof = max(ax.lines[0].get_ydata())
    assert roof == pytest.approx(system.gpu.tensor_flop_per_s("bf16") / 1e12)


def test_estimate_prints_writes_and_plots_the_op_table(tmp_path: Path) -> None:
    out, png, js = tmp_path / "t" / "ops.csv", tmp_path / "r.png", tmp_path / "e.json"
    r = run("estimate", "--model", "llama3-8b", "--gpus", "16", "--tp", "4", "--pp", "2",
            "--sp", "--mbs", "1", "--gbs", "16", "--system", "dgx-h100", "--ops", "1",
            "--ops-out", str(out), "--roofline", str(png), "--json", str(js))
    assert r.returncode == 0, r.stderr
    assert "Stage 1, one micro-batch, op by op" in r.stdout and "by kind" in r.stdout
    assert "lm_head" in r.stdout and "fc1" in r.stdout
    written = pl.read_csv(out)
    s = Strategy(tp=4, pp=2, dp=2, sequence_parallel=True, micro_batch_size=1,
                 global_batch_size=16)
    assert written.height == op_table("llama3-8b", s, "dgx-h100", stage=1).height
    assert set(written["stage"]) == {1}
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert len(json.loads(js.read_text())["ops"]) == written.height


@pytest.mark.parametrize("args,message", [
    (("--ops", "2"), "stage 2 is not in a pipeline of 2"),
    (("--ops-out", "ops.txt"), "the op table is written as .csv or .parquet"),
])
def test_estimate_refuses_a_bad_op_table_request_in_one_line(tmp_path: Path, args: tuple,
                                                             message: str) -> None:
    r = run("estimate", "--model", "llama3-8b", "--gpus", "16", "--tp", "4", "--pp", "2",
            "--mbs", "1", "--gbs", "16", "--system", "dgx-h100",
            *[str(tmp_path / a) if a.endswith(".txt") else a for a in args])
    assert r.returncode != 0
    assert message in r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert "step time" not in r.stdout  # refused before the estimate is printed


def test_a_group_of_experts_is_one_row_with_its_count_and_each_experts_shape() -> None:
    """Qwen3-30B-A3B at ep 2: a rank's 64 experts are one row per GEMM, ``groups`` 64 and the
    shape one expert's (512 tokens); the CLI prints it as "64 × 512×1536×2048"; dense GEMMs
    carry groups 1 and collectives none."""
    m = get_model("qwen3-30b-a3b")
    s = Strategy(dp=64, ep=2, micro_batch_size=1, global_batch_size=512, zero_stage=1)
    t = op_table(m, s, "dgx-h100")
    fc1 = t.filter((pl.col("op") == "expert_fc1") & (pl.col("pass") == "forward")).row(0, named=True)
    assert (fc1["groups"], fc1["m"], fc1["n"], fc1["k"]) == (64, 512, 2 * m.moe_ffn_hidden_size,
                                                               m.hidden_size)
    assert set(t.filter(pl.col("kind") == "gemm")["groups"].unique()) == {1, 64}
    assert t.filter(pl.col("axis") != "")["groups"].null_count() == t.filter(
        pl.col("axis") != "").height
    r = run("estimate", "--model", "qwen3-30b-a3b", "--gpus", "64", "--ep", "2", "--mbs", "1",
            "--gbs", "512", "--zero", "1", "--system", "dgx-h100", "--ops", "0")
    assert r.returncode == 0, r.stderr
    assert "64 × 512×1536×2048" in r.stdout
