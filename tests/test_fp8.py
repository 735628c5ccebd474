"""FP8 training: GEMM operands are quantised by memory-bound cast-transpose kernels."""

from __future__ import annotations

import dataclasses

from analysis.fastpath import estimate
from replay import get_system
from tracegen import ModelSpec, Strategy
from tracegen import ops as O

MODEL = ModelSpec(name="f8", num_layers=4, hidden_size=1024, num_attention_heads=8,
                  num_kv_heads=8, ffn_hidden_size=4096, vocab_size=4096, seq_len=1024,
                  activation="gelu")
BF16 = Strategy(micro_batch_size=2, global_batch_size=2)
FP8 = dataclasses.replace(BF16, precision="fp8")


def _casts(items: list[O.Item]) -> list[O.Op]:
    return [it for it in items if isinstance(it, O.Op) and it.name.endswith("_fp8_cast")]


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
