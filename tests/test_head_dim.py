"""Attention heads wider than hidden / heads (``ModelSpec.head_dim``; Qwen3, Gemma, Megatron's
--kv-channels): Q and the attention output are heads × head_dim wide everywhere they appear."""

from __future__ import annotations

import dataclasses

import pytest

from analysis.fastpath import estimate
from analysis.glance import strategy_rates
from replay import resolve_system
from tracegen import ConfigError, ModelSpec, Strategy, get_model
from tracegen import ops as O
from tracegen.flops import model_flop_per_step

WIDE = ModelSpec(name="wide", num_layers=4, hidden_size=512, num_attention_heads=8,
                 num_kv_heads=2, head_dim=128, ffn_hidden_size=1024, vocab_size=1000,
                 seq_len=256, activation="swiglu")
S = Strategy(micro_batch_size=2, global_batch_size=2)


def test_q_and_the_attention_output_are_heads_times_head_dim() -> None:
    ops = {it.name: it for it in O.layer_fwd(WIDE, S) if isinstance(it, O.Op)}
    q, kv, h = 8 * 128, 2 * 128, 512
    assert (ops["qkv"].n, ops["qkv"].k) == (q + 2 * kv, h)
    assert (ops["attn_out"].n, ops["attn_out"].k) == (h, q)
    narrow = dataclasses.replace(WIDE, head_dim=64)
    wide_attn = ops["flash_attn"].flop
    assert wide_attn == 2 * next(it.flop for it in O.layer_fwd(narrow, S)
                                 if isinstance(it, O.Op) and it.name == "flash_attn")


def test_model_flops_are_the_op_lists_matmuls() -> None:
    """Megatron's count with query_projection_to_hidden_size_ratio = the forward GEMMs plus full
    (non-causal) attention, times 3 for forward and backward."""
    b = S.global_batch_size
    layer = sum(it.flop for it in O.layer_fwd(WIDE, S) if isinstance(it, O.Op)
                and it.kind == "gemm")
    attn = sum(it.flop for it in O.layer_fwd(WIDE, S) if isinstance(it, O.Op)
               and it.kind == "attention")
    head = sum(it.flop for it in O.head_fwd(WIDE, S) if isinstance(it, O.Op)
               and it.kind == "gemm")
    fwd = WIDE.num_layers * (layer + 2 * attn) + head
    assert model_flop_per_step(WIDE, b) == pytest.approx(3 * fwd, rel=1e-9)


def test_qwen3_235b_has_its_published_size() -> None:
    """235B parameters, 22B active per token (the model's name)."""
    m = get_model("qwen3-235b-a22b")
    assert m.num_params() == pytest.approx(235e9, rel=0.005)
    dense_m = dataclasses.replace(m, num_experts=8, experts_per_token=8)
    assert dense_m.num_params() == pytest.approx(22e9, rel=0.02)


def test_a_given_head_dim_frees_the_divisibility_rule() -> None:
    with pytest.raises(ConfigError, match="not divisible by num_attention_heads"):
        ModelSpec(name="x", num_layers=1, hidden_size=100, num_attention_heads=3,
                  ffn_hidden_size=8, vocab_size=8, seq_len=8)
    assert ModelSpec(name="x", num_layers=1, hidden_size=100, num_attention_heads=3,
                     head_dim=64, ffn_hidden_size=8, vocab_size=8, seq_len=8).q_size == 192
    with pytest.raises(ConfigError, match="head_dim must be ≥ 0"):
        dataclasses.replace(WIDE, head_dim=-1)


# NVIDIA's Qwen3-235B-A22B runs on 256 DGX-H100 GPUs (Megatron-Bridge performance tables, NeMo
# 26.02 and 25.11 containers): FP8 current scaling, GBS 8192 / 2048, MBS 1, seq 4096, TP 2, PP 8,
# VP 4, EP 32 (folded over tp·dp), tokens/s/GPU 1633 / 1575, model TFLOP/s/GPU 242 / 233.
QWEN_RUNS = [(8192, 1633, 242), (2048, 1575, 233)]


@pytest.mark.parametrize(("gbs", "tokens_per_s", "tflops"), QWEN_RUNS)
def test_qwen3_235b_on_h100_is_predicted_within_the_error_reached(
        gbs: int, tokens_per_s: float, tflops: float) -> None:
    """The recipe's layout (94 layers over 32 chunks: the first and last hold 2) and stack
    (cuDNN 9.19 attention, TP overlap, overlapped gathers): predicted within 9% of both runs,
    too slow (8.4% before a group's expert GEMMs ran one after another as an H200 measured
    them, fifty-third session; 8.3% before each local expert's GEMM was its own, twenty-fifth
    session; within
    3.4% before the token dispatcher's permutations were charged, twenty-fourth
    session: the recipe hides all-to-all time in merged forward-backward steps, not modelled;
    within 1.6% before the device-measured Hopper clock ratios of the eleventh session; with
    head_dim = hidden / heads = 64, as the runs schema would have it, the model has 14% fewer
    FLOPs than the run). The published TFLOP/s are Megatron-Bridge's count, 1.13× below
    trainsim's as for its dense Llama rows, which pins the row's transcription."""
    m = get_model("qwen3-235b-a22b")
    s = Strategy(tp=2, pp=8, dp=16, ep=32, expert_tp=1, vpp=4, schedule="interleaved_1f1b",
                 sequence_parallel=True, micro_batch_size=1, global_batch_size=gbs,
                 zero_stage=1, precision="fp8", tp_comm_overlap=True,
                 overlap_param_gather=True, first_stage_layers=2, last_stage_layers=2)
    system = resolve_system("dgx-h100@cudnn-9.19")
    measured_s = gbs * m.seq_len / (tokens_per_s * 256)
    ours = strategy_rates(m, s, system, measured_s)["mfu"] * system.gpu.peak_flop_per_s("fp8")
    assert ours / 1e12 / tflops == pytest.approx(1.128, rel=0.005)
    est = estimate(m, s, system)
    assert est.fits
    assert 0 < est.step_time_s / measured_s - 1 <= 0.09
