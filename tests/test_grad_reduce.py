"""``Strategy.grad_reduce_in_bf16`` (Megatron --grad-reduce-in-bf16): the data-parallel gradient
buffer and its collectives in 16 bits instead of Megatron's fp32 default."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from typer.testing import CliRunner

from analysis.cli import app
from analysis.fastpath import estimate
from replay import get_system, replay
from tracegen import ModelSpec, Strategy, generate

MODEL = ModelSpec(name="gr", num_layers=8, hidden_size=1024, num_attention_heads=16,
                  ffn_hidden_size=4096, vocab_size=8192, seq_len=1024, tied_embeddings=True)
SYSTEM = get_system("dgx-a100-80gb")
BASE = Strategy(tp=2, pp=2, dp=8, micro_batch_size=1, global_batch_size=32,
                dp_bucket_params=5_000_000)


def _bf16(s: Strategy) -> Strategy:
    return dataclasses.replace(s, grad_reduce_in_bf16=True)


def _axis_bytes(s: Strategy, tmp: Path) -> dict[str, int]:
    summary = generate(MODEL, s, tmp, mode="representative")
    out: dict[str, int] = {}
    for stage in summary.stages:
        for axis, n in stage.comm_bytes_by_axis.items():
            out[axis] = out.get(axis, 0) + n
    return out


def test_gradient_traffic_halves_and_nothing_else_moves(tmp_path: Path) -> None:
    """ZeRO 0: every data-parallel byte is a gradient (the bucket all-reduces), as is the tied
    embedding's all-reduce, so both halve exactly; TP and pipeline traffic do not change."""
    fp32 = _axis_bytes(BASE, tmp_path / "fp32")
    bf16 = _axis_bytes(_bf16(BASE), tmp_path / "bf16")
    assert fp32["dp"] > 0 and fp32["embd"] > 0
    for axis in ("dp", "embd"):
        assert 2 * bf16[axis] == fp32[axis], axis
    for axis in set(fp32) - {"dp", "embd"}:
        assert bf16[axis] == fp32[axis], axis


def test_zero1_halves_the_reduce_scatter_not_the_parameter_gather(tmp_path: Path) -> None:
    """ZeRO 1: the reduce-scatters carry 4 bytes per (padded) parameter, 2 with the flag; the
    all-gathers of the updated bf16 parameters are recorded by their per-rank shard, 2 bytes
    per parameter over dp, with or without it."""
    z1 = dataclasses.replace(BASE, zero_stage=1)
    fp32 = _axis_bytes(z1, tmp_path / "fp32")["dp"]
    bf16 = _axis_bytes(_bf16(z1), tmp_path / "bf16")["dp"]
    gradients_fp32 = 2 * (fp32 - bf16)  # the 2-byte difference, counted at 4 bytes
    gathers = fp32 - gradients_fp32
    assert gathers > 0
    assert gathers == pytest.approx(gradients_fp32 / 2 / z1.dp, rel=1e-9)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_the_gradient_buffer_halves(zero: int, tmp_path: Path) -> None:
    s = dataclasses.replace(BASE, zero_stage=zero)
    fp32 = generate(MODEL, s, tmp_path / "fp32", mode="representative").stages
    bf16 = generate(MODEL, _bf16(s), tmp_path / "bf16", mode="representative").stages
    assert len(fp32) == len(bf16) == s.pp
    for a, b in zip(fp32, bf16, strict=True):
        full, half = a.memory, b.memory
        assert full.gradients_bytes == 2 * half.gradients_bytes
        assert (full.weights_bytes, full.optimizer_bytes, full.activations_bytes) == (
            half.weights_bytes, half.optimizer_bytes, half.activations_bytes)


@pytest.mark.parametrize("s", [
    BASE, dataclasses.replace(BASE, zero_stage=1), dataclasses.replace(BASE, zero_stage=3),
    dataclasses.replace(BASE, zero_stage=1, overlap_grad_reduce=False),
])
def test_fast_path_matches_replay_and_is_never_slower(s: Strategy, tmp_path: Path) -> None:
    generate(MODEL, _bf16(s), tmp_path, mode="representative")
    replayed = replay(tmp_path, SYSTEM, contention=False).step_time_s
    fast = estimate(MODEL, _bf16(s), SYSTEM).step_time_s
    assert fast == pytest.approx(replayed, rel=0.02)
    assert fast <= estimate(MODEL, s, SYSTEM).step_time_s


def test_without_data_parallelism_only_memory_changes() -> None:
    solo = dataclasses.replace(BASE, pp=1, dp=1, global_batch_size=4)
    assert estimate(MODEL, _bf16(solo), SYSTEM).step_time_s == pytest.approx(
        estimate(MODEL, solo, SYSTEM).step_time_s, rel=1e-12)
    assert estimate(MODEL, _bf16(solo), SYSTEM).peak_memory_GiB < estimate(
        MODEL, solo, SYSTEM).peak_memory_GiB


def test_cli_flag_is_stated_and_lowers_memory() -> None:
    args = ["estimate", "--model", "gpt3-175b", "--gpus", "1024", "--tp", "8", "--pp", "8",
            "--sp", "--mbs", "1", "--gbs", "1536", "--zero", "1", "--system", "dgx-a100-80gb"]
    plain = CliRunner().invoke(app, args)
    half = CliRunner().invoke(app, [*args, "--grad-reduce-bf16"])
    assert plain.exit_code == half.exit_code == 0, half.stdout
    assert "gradients reduced in bf16" in half.stdout
    assert "gradients reduced in bf16" not in plain.stdout

    def peak(out: str) -> float:
        return float(out.split("peak memory ")[1].split(" GiB")[0])

    assert peak(half.stdout) < peak(plain.stdout)
