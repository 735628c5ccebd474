"""FP8 training: GEMM operands are quantised by memory-bound cast-transpose kernels."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from analysis.fastpath import estimate
from replay import get_system
from tracegen import ConfigError, ModelSpec, Strategy
from tracegen import ops as O

MODEL = ModelSpec(name="f8", num_layers=4, hidden_size=1024, num_attention_heads=8,
                  num_kv_heads=8, ffn_hidden_size=4096, vocab_size=4096, seq_len=1024,
                  activation="gelu")
BF16 = Strategy(micro_batch_size=2, global_batch_size=2)
FP8 = dataclasses.replace(BF16, precision="fp8")


def _casts(items: list[O.Item]) -> list[O.Op]:
    return [it for it in items if isinstance(it, O.Op)
            and it.name.endswith(("_fp8_cast", "_mxfp8_cast"))]


def test_cast_bytes_per_layer() -> None:
    """Forward: the inputs of QKV, the output projection, FC1 (h wide) and FC2 (f wide);
    backward: the output gradients of FC2, FC1, the output projection and QKV (h, f, h, 3h
    wide), 4 bytes per element each (read 16-bit, write FP8 and its transpose)."""
    tokens, h, f = 2 * 1024, 1024, 4096
    fwd = sum(op.bytes for op in _casts(O.layer_fwd(MODEL, FP8)))
    bwd = sum(op.bytes for op in _casts(O.layer_bwd(MODEL, FP8)))
    assert fwd == 4 * tokens * (3 * h + f)
    assert bwd == 4 * tokens * (5 * h + f)
    assert not _casts(O.layer_fwd(MODEL, BF16)) and not _casts(O.layer_bwd(MODEL, BF16))


def test_fp8_is_faster_than_bf16_but_by_less_than_the_gemm_speedup() -> None:
    """FP8 GEMMs run at the FP8 rate, but the casts and the 16-bit rest do not speed up."""
    system = get_system("dgx-h100")
    bf16 = estimate(MODEL, BF16, system).step_time_s
    fp8 = estimate(MODEL, FP8, system).step_time_s
    gemm_speedup = (system.gpu.peak_fp8_TFLOPs * system.gpu.gemm_efficiency_fp8) / (
        system.gpu.peak_bf16_TFLOPs * system.gpu.gemm_efficiency)
    assert fp8 < bf16
    assert bf16 / fp8 < gemm_speedup


def test_attention_and_output_head_stay_16_bit() -> None:
    """An FP8 recipe casts the linear layers only: the core attention and the LM head keep the
    16-bit dtype (so the 16-bit rate) and get no casts; the layer's four GEMMs are FP8."""
    layer = O.layer_fwd(MODEL, FP8) + O.layer_bwd(MODEL, FP8)
    head = O.head_fwd(MODEL, FP8) + O.head_bwd(MODEL, FP8)
    ops = [it for it in layer + head if isinstance(it, O.Op)]
    attention = [op for op in ops if op.kind == "attention"]
    lm_head = [op for op in ops if op.name.startswith("lm_head")]
    assert len(attention) == 2 and len(lm_head) == 3
    assert {op.dtype for op in attention + lm_head} == {"bf16"}
    assert {op.dtype for op in ops if op.kind == "gemm" and op not in lm_head} == {"fp8"}
    assert not any(op.name.startswith("lm_head") for op in _casts(head))
    bf16 = [op for op in O.layer_fwd(MODEL, BF16) if isinstance(op, O.Op)
            and op.kind == "attention"]
    assert bf16 == attention[:1]


def test_fp8_keeps_one_byte_copies_of_gemm_inputs() -> None:
    """Per token per layer, FP8 stores the QKV, FC1 and FC2 inputs at 1 byte instead of 2 and
    adds the 1-byte copy of the output projection's input: 2h + f − h = h + f fewer bytes
    (Transformer Engine's saved tensors; tracegen/memory.py)."""
    from tracegen.memory import activation_bytes_per_layer

    tokens, h, f = 2 * 1024, 1024, 4096
    saved = activation_bytes_per_layer(MODEL, BF16) - activation_bytes_per_layer(MODEL, FP8)
    assert saved == tokens * (h + f)
    full = dataclasses.replace(FP8, recompute="full")  # only the 16-bit layer input is kept
    assert activation_bytes_per_layer(MODEL, full) == activation_bytes_per_layer(
        MODEL, dataclasses.replace(full, precision="bf16"))


def test_current_scaling_reads_each_cast_input_for_its_amax_unless_a_norm_did() -> None:
    """FP8 current scaling (``fp8_recipe = "tensorwise"``, Transformer Engine's
    Float8CurrentScaling): each cast first reads its 16-bit input for the amax (2 bytes an
    element), except the QKV and FC1 inputs, whose norm computed it while writing them. Forward:
    the output projection's h and FC2's f wide inputs pay it; backward: every output gradient.
    Delayed scaling (the default) and other precisions are unchanged, and the label says it."""
    tokens, h, f = 2 * 1024, 1024, 4096
    cs = dataclasses.replace(FP8, fp8_recipe="tensorwise")
    fwd = sum(op.bytes for op in _casts(O.layer_fwd(MODEL, cs)))
    bwd = sum(op.bytes for op in _casts(O.layer_bwd(MODEL, cs)))
    assert fwd == 4 * tokens * (3 * h + f) + 2 * tokens * (h + f)
    assert bwd == 6 * tokens * (5 * h + f)
    bf16_cs = dataclasses.replace(BF16, fp8_recipe="tensorwise")
    assert O.layer_bwd(MODEL, bf16_cs) == O.layer_bwd(MODEL, BF16)
    assert "tensorwise" in cs.label() and "tensorwise" not in FP8.label()
    assert bf16_cs.label() == BF16.label()
    system = get_system("dgx-h100")
    assert estimate(MODEL, cs, system).step_time_s > estimate(MODEL, FP8, system).step_time_s


def test_a_sweep_takes_the_fp8_recipe_only_where_it_applies() -> None:
    """``fp8_recipe`` as a search dimension: a BF16 strategy is one strategy whatever recipe
    is named (the switch does not apply to it, so it is taken as the default)."""
    from analysis.study import study_from_dict
    from analysis.sweep import enumerate_space

    study = study_from_dict({"model": "gpt-1.7b", "system": "dgx-h100", "gpus": 8,
                             "global_batch_size": 8,
                             "search": {"tp": [1], "pp": [1], "micro_batch_size": [1],
                                        "precision": ["bf16", "fp8"],
                                        "fp8_recipe": ["delayed", "tensorwise"]}})
    valid, _ = enumerate_space(study)
    kinds = [(s.precision, s.fp8_recipe) for s in valid]
    assert set(kinds) == {("bf16", "delayed"), ("fp8", "delayed"), ("fp8", "tensorwise")}
    assert kinds.count(("bf16", "delayed")) == kinds.count(("fp8", "tensorwise"))


SP = dataclasses.replace(BF16, tp=2, sequence_parallel=True)
MOE = dataclasses.replace(MODEL, name="f8moe", num_experts=4, experts_per_token=2,
                          moe_ffn_hidden_size=1024)


def _tp_comms(items: list[O.Item]) -> list[tuple[str, str, int]]:
    return [(it.name, it.coll, it.size_bytes) for it in items
            if isinstance(it, O.Comm) and it.axis == "tp"]


def test_per_tensor_fp8_gathers_each_gemm_input_in_one_byte() -> None:
    """Under sequence parallelism Transformer Engine quantizes a GEMM's input before gathering
    it: forward the QKV and FC1 inputs, backward the output gradients of the output projection
    and FC2 and the QKV and FC1 inputs gathered again — each tokens·h/t elements at 1 byte
    where BF16 moves 2. The reduce-scatters (GEMM outputs, summed) stay 16-bit."""
    tokens, h, t = 2 * 1024, 1024, 2
    for layer in (O.layer_fwd, O.layer_bwd):
        bf16 = _tp_comms(layer(MODEL, SP))
        fp8 = _tp_comms(layer(MODEL, dataclasses.replace(SP, precision="fp8")))
        assert [(n, c) for n, c, _ in fp8] == [(n, c) for n, c, _ in bf16]
        for (_, coll, b16), (_, _, b8) in zip(bf16, fp8, strict=True):
            assert b8 == (b16 // 2 if coll == "ALL_GATHER" else b16)
        assert {b for _, c, b in fp8 if c == "ALL_GATHER"} == {tokens * h // t}
    gathers = [n for n, c, _ in _tp_comms(O.layer_bwd(MODEL, dataclasses.replace(
        SP, precision="fp8"))) if c == "ALL_GATHER"]
    assert gathers == ["fc2_rs_bwd", "fc1_in_ag", "attn_out_rs_bwd", "qkv_in_ag"]


def test_current_scaling_reduces_each_quantized_gathers_amax_over_tp() -> None:
    """Current scaling casts every shard with one scale: before each quantization that feeds
    a gather (the QKV and FC1 inputs forward, the output gradients of the output projection
    and FC2 backward) one FP32 amax all-reduced over TP, blocking; the re-gathered saved inputs
    were quantized already and need none; delayed scaling has none."""
    cs = dataclasses.replace(SP, precision="fp8", fp8_recipe="tensorwise")
    for layer, want in ((O.layer_fwd, ["ln1_ag", "ln2_ag"]),
                        (O.layer_bwd, ["fc2_rs_bwd", "attn_out_rs_bwd"])):
        comms = _tp_comms(layer(MODEL, cs))
        amax = [(i, n) for i, (n, _, _) in enumerate(comms) if n.endswith("_amax_ar")]
        assert [n.removesuffix("_amax_ar") for _, n in amax] == want
        for i, name in amax:
            assert comms[i][1:] == ("ALL_REDUCE", O.AMAX_BYTES)
            assert comms[i + 1][0] == name.removesuffix("_amax_ar")  # just before its gather
        delayed = _tp_comms(layer(MODEL, dataclasses.replace(cs, fp8_recipe="delayed")))
        assert not [n for n, _, _ in delayed if n.endswith("_amax_ar")]


def test_mxfp8_gathers_in_16_bits_and_casts_with_its_block_scales() -> None:
    """MXFP8 (``fp8_recipe = "mxfp8"``): the gathers move BF16's bytes (its quantizer does not
    take a gathered norm output); each cast reads 16 bits and writes a row-wise and a
    column-wise copy of 1 byte and 1/32 byte of scale an element, 65/16 bytes, with no amax
    pass; the label says it."""
    tokens, h, f = 2 * 1024, 1024, 4096
    mx = dataclasses.replace(SP, precision="fp8", fp8_recipe="mxfp8")
    for layer in (O.layer_fwd, O.layer_bwd):
        assert _tp_comms(layer(MODEL, mx)) == _tp_comms(layer(MODEL, SP))
    one = dataclasses.replace(FP8, fp8_recipe="mxfp8")
    assert sum(op.bytes for op in _casts(O.layer_fwd(MODEL, one))) == (
        65 * tokens * (3 * h + f) // 16)
    assert sum(op.bytes for op in _casts(O.layer_bwd(MODEL, one))) == (
        65 * tokens * (5 * h + f) // 16)
    assert one.label().endswith("-mxfp8-mbs2")


def test_a_moe_layers_router_gather_stays_16_bit() -> None:
    """Megatron's MoE layer gathers the sequence-parallel hidden states for its router and
    dispatcher (no Transformer Engine GEMM's input): 16-bit under FP8, where the attention's
    QKV gather moves 1 byte."""
    bf16 = dict((n, b) for n, _, b in _tp_comms(O.layer_fwd(MOE, SP)))
    fp8 = dict((n, b) for n, _, b in _tp_comms(O.layer_fwd(MOE, dataclasses.replace(
        SP, precision="fp8", fp8_recipe="tensorwise"))))
    assert fp8["ln2_ag"] == bf16["ln2_ag"] and "ln2_ag_amax_ar" not in fp8
    assert fp8["ln1_ag"] == bf16["ln1_ag"] // 2 and "ln1_ag_amax_ar" in fp8


def test_mxfp8_before_blackwell_is_said_and_its_rows_skipped() -> None:
    """Transformer Engine refuses MXFP8 before Blackwell: ``estimate`` says so on an H100 (and
    not on a B200); ``validate`` skips such a row, naming the recipe and the GPU."""
    from analysis.validate import load_runs, row_inputs
    from tests.test_cli import run
    from tests.test_megatron_bridge_runs import RUNS

    base = ("estimate", "--model", "llama3-8b", "--gpus", "8", "--tp", "2", "--sp", "--mbs",
            "1", "--gbs", "8", "--precision", "fp8", "--fp8-recipe", "mxfp8", "--system")
    h100 = run(*base, "dgx-h100")
    assert h100.returncode == 0, h100.stderr
    assert "no block-scaled tensor cores" in " ".join(h100.stdout.split())
    b200 = run(*base, "dgx-b200")
    assert b200.returncode == 0 and "block-scaled" not in b200.stdout
    row = next(load_runs(RUNS).iter_rows(named=True))
    got = row_inputs(row, {"strategy.fp8_recipe": "mxfp8"})
    assert isinstance(got, str) and got.startswith(
        f"skipped: fp8_recipe mxfp8 on {row['gpu']}: it has no block-scaled tensor cores")


def test_mxfp8_keeps_its_block_scales_beside_each_fp8_copy() -> None:
    """MXFP8's kept tensors carry an E8M0 scale a block of 32: the inputs saved for the weight
    gradients (QKV, output projection and FC1 h wide, FC2 f wide, per token) and the cached
    weight copies cost 33/32 of FP8's bytes."""
    from tracegen.memory import activation_bytes_per_layer, fp8_weight_cache_bytes

    tokens, h, f = 2 * 1024, 1024, 4096
    mx = dataclasses.replace(FP8, fp8_recipe="mxfp8")
    extra = activation_bytes_per_layer(MODEL, mx) - activation_bytes_per_layer(MODEL, FP8)
    assert extra == tokens * (3 * h + f) // 32
    params = 10**8  # a stage's; less its embedding and head, 91,611,392 in GEMMs
    assert fp8_weight_cache_bytes(MODEL, FP8, 0, params) == 2 * 91_611_392
    assert fp8_weight_cache_bytes(MODEL, mx, 0, params) * 32 == (
        fp8_weight_cache_bytes(MODEL, FP8, 0, params) * 33)


def test_blackwell_casts_write_no_transposed_copy() -> None:
    """Blackwell runs FP8 GEMMs in any layout, so a per-tensor FP8 cast writes no transposed
    copy there: its memory term is 3 of Hopper's 4 bytes an element (the op's FLOPs count its
    elements), the amax read of current scaling kept; MXFP8's casts (both directions, their
    scales run one way) and every non-cast op are costed as before."""
    from replay.compute import RooflineCompute

    h100, b200 = get_system("dgx-h100").gpu, get_system("dgx-b200").gpu
    assert b200.fp8_any_layout and not h100.fp8_any_layout
    fast = RooflineCompute(b200)
    for recipe, per_elem in (("delayed", 3), ("tensorwise", 3 + 2)):
        s = dataclasses.replace(FP8, fp8_recipe=recipe)
        for op in _casts(O.layer_fwd(MODEL, s) + O.layer_bwd(MODEL, s)):
            assert op.dtype == "fp8"
            dropped = fast.explain_op(op).memory_ns
            whole = fast.explain_op(dataclasses.replace(op, dtype="bf16")).memory_ns
            assert dropped == pytest.approx(whole * (op.bytes - op.flop) / op.bytes, abs=1)
            assert op.bytes - op.flop in (per_elem * op.flop, 3 * op.flop)  # (norm-fed: no amax)
    mx = dataclasses.replace(FP8, fp8_recipe="mxfp8")
    for op in _casts(O.layer_fwd(MODEL, mx)):
        assert op.dtype == "mxfp8"
        assert fast.explain_op(op).memory_ns == fast.explain_op(
            dataclasses.replace(op, dtype="bf16")).memory_ns


def test_blackwell_caches_one_fp8_copy_of_each_weight() -> None:
    """The cached FP8 weights on Blackwell: the row-wise copy only (1 byte a GEMM parameter,
    Hopper's transposed one dropped), where FP8 parameters are not gathered; MXFP8 keeps both
    directions. The fast path's peak and the breakdown ``glance`` prints agree on it."""
    from analysis.glance import glance
    from tracegen.memory import fp8_weight_cache_bytes

    params = 10**8  # a stage's; 91,611,392 of it in GEMMs (test above)
    assert fp8_weight_cache_bytes(MODEL, FP8, 0, params, fp8_any_layout=True) == 91_611_392
    mx = dataclasses.replace(FP8, fp8_recipe="mxfp8")
    assert fp8_weight_cache_bytes(MODEL, mx, 0, params, fp8_any_layout=True) == (
        fp8_weight_cache_bytes(MODEL, mx, 0, params))
    b200 = get_system("dgx-b200")
    h100_twin = dataclasses.replace(b200, gpu=dataclasses.replace(b200.gpu, peak_fp4_TFLOPs=0,
                                                                  gemm_efficiency_fp4=0))
    assert not h100_twin.gpu.fp8_any_layout  # (B200 but for its Blackwell tensor cores)
    for s, saved in ((FP8, True), (dataclasses.replace(FP8, fp8_param_gather=True,
                                                        zero_stage=1), False)):
        new, old = glance(MODEL, s, b200), glance(MODEL, s, h100_twin)
        weights = new.stages[0].memory.weights_bytes - old.stages[0].memory.weights_bytes
        assert (weights < 0) is saved
        assert new.peak_memory_GiB == pytest.approx(
            max(st.memory.total_bytes for st in new.stages) / 2**30)


def test_a_replay_on_blackwell_drops_the_transposed_weights_the_manifest_names(
        tmp_path: Path) -> None:
    """A trace set does not know its GPU: its manifest keeps Hopper's two FP8 copies of each
    GEMM weight and names the transposed one (``fp8_transpose_GiB``); a replay on Blackwell
    takes it off, so that replay's peak is the fast path's on either GPU, and a mixed cluster
    checks each rank against what its own GPU needs."""
    import json

    from replay import replay
    from tracegen import generate

    s = dataclasses.replace(FP8, pp=2, micro_batch_size=1, global_batch_size=4)
    generate(MODEL, s, tmp_path / "t", mode="full")
    stages = json.loads((tmp_path / "t/manifest.json").read_text())["stages"]
    for st in stages:  # the 16-bit layers' parameters (embedding, head) are not cached
        assert 0 < st["fp8_transpose_GiB"] < st["memory"]["weights_GiB"] / 3
    for system in ("dgx-h100", "dgx-b200"):
        got = replay(tmp_path / "t", system).metrics["peak_memory_GiB"]
        assert got == pytest.approx(estimate(MODEL, s, get_system(system)).peak_memory_GiB,
                                    rel=1e-9)
    assert replay(tmp_path / "t", "dgx-h100").metrics["peak_memory_GiB"] == pytest.approx(
        max(st["memory"]["total_GiB"] for st in stages), rel=1e-12)
    bf16 = dataclasses.replace(s, precision="bf16")
    generate(MODEL, bf16, tmp_path / "b", mode="full")
    assert not any("fp8_transpose_GiB" in st for st in json.loads(
        (tmp_path / "b/manifest.json").read_text())["stages"])
    # a B200 whose memory lies between the stage's Blackwell and Hopper needs: a B200 rank
    # fits, an H100-like rank of the same memory does not
    cap = (max(st["memory"]["total_GiB"] for st in stages)
           + max(st["memory"]["total_GiB"] - st["fp8_transpose_GiB"] for st in stages)) / 2
    b200 = (tmp_path / "b200.toml")
    text = (Path(__file__).parents[1] / "replay/systems/dgx-b200.toml").read_text()
    assert "hbm_GiB = " in text
    b200.write_text(re.sub(r"hbm_GiB = [0-9.]+", f"hbm_GiB = {cap}", text))
    twin = tmp_path / "twin.toml"  # the same GPU without Blackwell's FP4 tensor cores
    twin.write_text(re.sub(r"(peak_fp4_TFLOPs|gemm_efficiency_fp4) = [0-9.]+", r"\1 = 0",
                           b200.read_text()))
    for gpu_file, fits in ((b200, True), (twin, False)):
        scen = tmp_path / "gpu.toml"
        scen.write_text(f'[[gpu]]\nranks = [0, 1]\nsystem = "{gpu_file}"\n')
        assert replay(tmp_path / "t", "dgx-b200", scenario=scen).metrics["fits"] is fits


def test_tracegen_with_a_blackwell_system_shows_what_a_rank_needs_there(tmp_path: Path) -> None:
    """``trainsim tracegen --system``: each stage's memory as a rank needs it on that GPU —
    on a B200 without the transposed FP8 weights, as ``estimate`` and ``replay`` say."""
    from tests.test_cli import run

    flags = ("--model", "llama3-8b", "--gpus", "8", "--tp", "2", "--mbs", "1", "--gbs", "8",
             "--precision", "fp8")
    cells = {}
    for system in ("dgx-h100", "dgx-b200"):
        r = run("tracegen", *flags, "-o", str(tmp_path / system), "--system", system)
        assert r.returncode == 0, r.stderr
        cells[system] = float(re.findall(r"│\s+([0-9.]+)(?: > \d+)?\s+│\s*$", r.stdout,
                                         re.M)[-1])  # (over the capacity: "99.7 > 80")
        est = run("estimate", *flags, "--system", system)
        said = re.search(r"peak memory ([0-9.]+) GiB per GPU", " ".join(est.stdout.split()))
        assert said is not None and float(said[1]) == cells[system], (system, est.stdout)
    assert cells["dgx-b200"] < cells["dgx-h100"]


def test_the_blockwise_recipe_is_refused_naming_the_nearest() -> None:
    """Megatron's ``--fp8-recipe blockwise`` (DeepSeek-V3's scaling), which trainsim does not
    model, is refused naming 'delayed' as the nearest and why — not a bare list."""
    with pytest.raises(ConfigError) as info:
        Strategy(dp=8, global_batch_size=8, precision="fp8",
                 fp8_recipe="blockwise")  # type: ignore[arg-type]
    text = str(info.value)
    assert "fp8_recipe must be one of delayed, tensorwise, mxfp8" in text
    assert "'delayed' is the nearest on Hopper" in text
