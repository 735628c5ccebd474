"""``Strategy.adam_moments_dtype`` (Megatron-Core's precision-aware optimizer, Adam's m and v in
bf16, fp16 or FP8): the state memory, the step's bytes in the trace, the fast path against replay,
and the refusals."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from analysis.compare import strategy_label
from analysis.fastpath import estimate
from replay import get_system
from tests.conftest import attrs, read_et, replayed
from tests.studies import enumerated
from tests.test_cli import run
from tracegen import ConfigError, ModelSpec, Strategy, generate
from tracegen import memory as mem

MODEL = ModelSpec(name="am", num_layers=8, hidden_size=1024, num_attention_heads=16,
                  ffn_hidden_size=4096, vocab_size=8192, seq_len=1024)
MOE = ModelSpec(name="am-moe", num_layers=4, hidden_size=1024, num_attention_heads=8,
                num_kv_heads=4, ffn_hidden_size=2048, vocab_size=4096, seq_len=1024,
                activation="swiglu", num_experts=16, experts_per_token=2,
                moe_ffn_hidden_size=512)
SYSTEM = get_system("dgx-a100-80gb")
BASE = Strategy(tp=2, pp=2, dp=8, micro_batch_size=1, global_batch_size=32, zero_stage=1)


def _bf16(s: Strategy) -> Strategy:
    return dataclasses.replace(s, adam_moments_dtype="bf16")


@pytest.mark.parametrize(("zero", "moments", "per_param"), [
    (1, "bf16", (6, 12)), (2, "bf16", (6, 12)), (3, "bf16", (4, 8)),
    (1, "fp16", (6, 12)), (1, "fp8", (4, 12)), (2, "fp8", (4, 12)), (3, "fp8", (2, 8))])
def test_the_state_loses_what_the_moments_narrow(zero: int, moments: str,
                                                 per_param: tuple[int, int]) -> None:
    """Megatron's distributed optimizer keeps the fp32 master, m and v (12 bytes a parameter,
    Rajbhandari et al. 2020 §3); FSDP's optimizer m and v beside its fp32 shard (8). With the
    precision-aware optimizer the moments take 2 bytes each (1 in FP8) and, beside BF16
    parameters, the distributed optimizer's master weight only the 2-byte remainder the BF16
    parameter lacks: 6 (4 in FP8) and FSDP's 4 (2) — sharded as before. Nothing else in the
    breakdown moves but the allocator's 5% of it."""
    s = dataclasses.replace(BASE, zero_stage=zero)
    params = 123_456_789
    fp32 = mem.estimate(MODEL, s, 0, params)
    narrow = mem.estimate(MODEL, dataclasses.replace(s, adam_moments_dtype=moments), 0, params)
    shard = s.dp * s.cp
    assert fp32.optimizer_bytes == -(-params * per_param[1] // shard)
    assert narrow.optimizer_bytes == -(-params * per_param[0] // shard)
    for field in ("weights_bytes", "gradients_bytes", "activations_bytes", "logits_bytes",
                  "transient_bytes", "runtime_bytes"):
        assert getattr(fp32, field) == getattr(narrow, field), field


@pytest.mark.parametrize(("kw", "per_param"), [
    ({}, 6), ({"precision": "fp16"}, 8),
    ({"precision": "fp8", "fp8_param_gather": True}, 8), ({"precision": "fp8"}, 6)])
def test_the_master_weight_is_a_remainder_beside_bf16_parameters(kw: dict,
                                                                 per_param: int) -> None:
    """Megatron's ``store_param_remainders`` (on by default): the int16 remainder of each fp32
    master weight beside its BF16 parameter — not beside fp16 parameters, nor where the
    parameters are FP8 (there Megatron keeps the fp32 master)."""
    s = dataclasses.replace(BASE, adam_moments_dtype="bf16", **kw)
    got = mem.estimate(MODEL, s, 0, 80_000_000).optimizer_bytes
    assert got == 80_000_000 * per_param // (s.dp * s.cp)


def test_expert_state_shards_over_its_own_group() -> None:
    """A MoE stage: dense state over dp·cp, expert state over the expert-data-parallel group,
    each at 6 bytes a parameter with bf16 moments (and the master's remainder)."""
    s = Strategy(tp=1, pp=1, dp=16, ep=4, micro_batch_size=1, global_batch_size=32,
                 zero_stage=1, adam_moments_dtype="bf16")
    dense, expert = 10_000_000, 40_000_000
    got = mem.estimate(MOE, s, 0, dense + expert, expert_params=expert).optimizer_bytes
    assert got == -(-dense * 6 // 16) + -(-expert * 6 // (16 // 4))


def _step_bytes(s: Strategy, tmp: Path) -> int:
    generate(MODEL, s, tmp, mode="representative")
    total = 0
    for f in sorted(tmp.glob("*.et")):
        for node in read_et(f)[1]:
            if node.name.endswith("adam_step"):
                total += attrs(node)["tensor_size"][1]
    return total


@pytest.mark.parametrize(("moments", "per_param"), [("bf16", 30), ("fp16", 30), ("fp8", 26)])
def test_the_step_moves_fewer_bytes_a_parameter_in_the_trace(tmp_path: Path, moments: str,
                                                             per_param: int) -> None:
    """The optimizer node's bytes: 38 a parameter (ops.ADAM_BYTES_PER_PARAM); 30 with m and v
    each read and written in 2 bytes instead of 4, 26 in 1."""
    fp32 = _step_bytes(BASE, tmp_path / "fp32")
    narrow = _step_bytes(dataclasses.replace(BASE, adam_moments_dtype=moments),
                         tmp_path / moments)
    assert fp32 > 0
    assert narrow * 38 == fp32 * per_param


@pytest.mark.parametrize(("zero", "moments"), [(1, "bf16"), (3, "bf16"), (1, "fp8"),
                                               (3, "fp8")])
def test_fast_path_matches_replay(zero: int, moments: str) -> None:
    s = dataclasses.replace(BASE, zero_stage=zero, adam_moments_dtype=moments)
    fast = estimate(MODEL, s, SYSTEM).step_time_s
    assert fast == pytest.approx(replayed(MODEL, s, SYSTEM).step_time_s, rel=0.02)
    # a shorter optimizer step, by the bytes it no longer moves
    assert fast < estimate(MODEL, dataclasses.replace(s, adam_moments_dtype="fp32"),
                           SYSTEM).step_time_s


def test_a_sweep_memo_does_not_mix_the_two() -> None:
    """The fast path memoizes the optimizer step and the tails by what they read: the fp32
    answer after the bf16 one is the fp32 answer computed cold."""
    from analysis.fastpath import clear_cache

    clear_cache()
    cold = estimate(MODEL, BASE, SYSTEM)
    clear_cache()
    estimate(MODEL, _bf16(BASE), SYSTEM)
    assert estimate(MODEL, BASE, SYSTEM) == cold


def test_bad_input_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigError, match="set zero_stage ≥ 1"):
        dataclasses.replace(BASE, zero_stage=0, adam_moments_dtype="bf16")
    with pytest.raises(ConfigError, match="adam_moments_dtype must be one of fp32, bf16, fp16, "
                       "fp8"):
        dataclasses.replace(BASE, adam_moments_dtype="fp4")  # type: ignore[arg-type]
    r = run("estimate", "--model", "llama3-8b", "--gpus", "8", "--mbs", "1", "--gbs", "8",
            "--system", "dgx-h100", "--adam-moments", "bf16")
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "zero_stage ≥ 1" in out and "Traceback" not in out


@pytest.mark.parametrize("moments", ["bf16", "fp8"])
def test_estimate_reports_the_moments(moments: str) -> None:
    r = run("estimate", "--model", "llama3-8b", "--gpus", "8", "--mbs", "1", "--gbs", "8",
            "--system", "dgx-h100", "--zero", "1", "--adam-moments", moments)
    assert r.returncode == 0 and f"Adam moments in {moments}" in r.stdout


def test_a_sweep_searches_the_moments_and_a_report_tells_them_apart(tmp_path: Path) -> None:
    """A search dimension; narrow moments pair only with ZeRO ≥ 1, and the result row's
    strategy name says which."""
    valid, invalid = enumerated(
        tmp_path, 'model = "llama3-8b"\nsystem = "dgx-h100"\ngpus = 8\n'
        'global_batch_size = 64\n[search]\ntp = [2]\npp = [1]\nvpp = [1]\n'
        'micro_batch_size = [1]\nrecompute = ["full"]\nzero_stage = [0, 1]\n'
        'sequence_parallel = [true]\nadam_moments_dtype = ["fp32", "bf16", "fp8"]\n')
    assert sorted((s.zero_stage, s.adam_moments_dtype) for s in valid) == [
        (0, "fp32"), (1, "bf16"), (1, "fp32"), (1, "fp8")]
    assert invalid == 0  # narrow moments at ZeRO 0 do not apply: taken as fp32
    names = sorted(strategy_label(s) for s in valid if s.zero_stage == 1)
    assert names == ["tp2-pp1-dp4-mbs1-rcf-z1-sp", "tp2-pp1-dp4-mbs1-rcf-z1-sp-adambf16",
                     "tp2-pp1-dp4-mbs1-rcf-z1-sp-adamfp8"]
