"""The sustained-clock ratio (replay/hardware.py ``GPUSpec.sustained_clock_ratio``): tensor-core
work runs at the clock a power-limited chip holds under load, memory-bound work does not care,
and utilisation is still reported against the datasheet peak."""

from __future__ import annotations

import dataclasses

import pytest

from replay import get_system
from replay.compute import RooflineCompute
from tracegen.errors import ConfigError
from tracegen.ops import gemm
from tracegen.units import DTYPE_CODE

BF16 = DTYPE_CODE["bf16"]
# The measurements each preset's ratio comes from (systems/README.md, "Sustained clock").
EVIDENCE = {
    "dgx-a100-40gb": 1305 / 1410,  # NVIDIA's HPL clock at the 400 W limit / boost (MHz)
    "dgx-a100-80gb": 1305 / 1410,
    "dgx-a800": 1305 / 1410,
    # GEMMs held at the power limit on an H200 over the MAMF model, the same GH100 die at 700 W
    # (trainsim's own measurement, bench/device; fitted in tests/test_device_evidence.py)
    "dgx-h100": 0.850,
    "dgx-h800": 0.850,
    "hgx-h200": 0.850,
    "dgx-b200": 1429 / 1745,  # B200 MSMF / MAMF (TFLOP/s)
    "dgx1-v100": 1.0,  # no measurement: the MAMF-level assumption stands
    "mi300x": 1.0,
}


@pytest.mark.parametrize(("name", "ratio"), sorted(EVIDENCE.items()))
def test_catalog_ratio_is_its_evidence(name: str, ratio: float) -> None:
    assert get_system(name).gpu.sustained_clock_ratio == pytest.approx(ratio, abs=6e-4)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_tensor_core_ops_slow_down_by_exactly_the_ratio(dtype: str) -> None:
    gpu = get_system("dgx-h100").gpu
    burst = dataclasses.replace(gpu, sustained_clock_ratio=1.0, sustained_clock_ratio_fp8=0)
    code, launch = DTYPE_CODE[dtype], gpu.launch_overhead_ns
    op = gemm("g", 8192, 8192, 8192, dtype)  # compute-bound
    args = ("gemm", op.flop, op.bytes, op.m, op.n, code, False, op.k)
    slow = RooflineCompute(gpu).op_ns(*args) - launch
    fast = RooflineCompute(burst).op_ns(*args) - launch
    ratio = gpu.sustained_clock_ratio_fp8 if dtype == "fp8" else gpu.sustained_clock_ratio
    assert slow * ratio == pytest.approx(fast, rel=1e-6)
    attn = ("attention", 4 * 10**12, 0, 4096, 4096, code, False, 128)
    slow = RooflineCompute(gpu).op_ns(*attn) - launch
    assert slow * ratio == pytest.approx(
        RooflineCompute(burst).op_ns(*attn) - launch, rel=1e-6)


def test_memory_bound_ops_keep_their_time() -> None:
    gpu = get_system("dgx-a100-80gb").gpu
    burst = dataclasses.replace(gpu, sustained_clock_ratio=1.0)
    args = ("elementwise", 10**6, 10**9, 0, 0, BF16, False, 0)
    assert RooflineCompute(gpu).op_ns(*args) == RooflineCompute(burst).op_ns(*args)


def test_utilisation_stays_against_the_datasheet_peak() -> None:
    gpu = get_system("dgx-h100").gpu
    assert gpu.peak_flop_per_s("bf16") == gpu.peak_bf16_TFLOPs * 1e12
    assert gpu.tensor_flop_per_s("bf16") == pytest.approx(
        gpu.peak_flop_per_s("bf16") * gpu.sustained_clock_ratio)


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.2])
def test_a_ratio_outside_zero_one_is_refused(bad: float) -> None:
    with pytest.raises(ConfigError, match="sustained_clock_ratio"):
        get_system("dgx-h100").with_overrides({"gpu.sustained_clock_ratio": bad})


@pytest.mark.parametrize(("key", "bad", "message"), [
    ("gpu.sustained_clock_ratio_fp8", 1.5, "sustained_clock_ratio_fp8 is a fraction"),
    ("gpu.sustained_clock_ratio_fp8", -0.1, "sustained_clock_ratio_fp8 must be ≥ 0"),
    ("gpu.attention_half_tiles", -5, "attention_half_tiles must be ≥ 0"),
])
def test_the_measured_fields_refuse_impossible_values(key: str, bad: float, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        get_system("dgx-h100").with_overrides({key: bad})


def test_fp8_ratio_zero_means_the_bf16_one() -> None:
    gpu = get_system("dgx-a100-80gb").gpu  # no FP8 measurement: the field is 0
    assert gpu.sustained_clock_ratio_fp8 == 0
    assert gpu.tensor_flop_per_s("fp8") == pytest.approx(
        gpu.peak_flop_per_s("fp8") * gpu.sustained_clock_ratio)
