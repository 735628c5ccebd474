"""GEMM efficiency against the reduction length K: replay's model of an H100 against OpenXLA's
measured sm_90 matmul table (tests/data/xla_h100_matmul.csv, provenance in its header), and the
properties of the per-tile overhead term (replay/hardware.py, ``GPUSpec.gemm_k_factor``)."""

from __future__ import annotations

import csv
import dataclasses
import math
from pathlib import Path

import pytest

from replay import get_system
from replay.compute import RooflineCompute
from replay.hardware import GPUSpec, SystemSpec
from tracegen.errors import ConfigError
from tracegen.ops import gemm
from tracegen.units import DTYPE_CODE

TABLE = Path(__file__).parent / "data" / "xla_h100_matmul.csv"
# the same table's K = 4096 rows of 16-128 output tiles (less than one wave of 132 SMs)
SMALL = Path(__file__).parent / "data" / "xla_h100_matmul_small.csv"


def _rows(path: Path = TABLE) -> list[dict[str, str]]:
    with path.open(encoding="utf-8") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def _log_errors(gpu: GPUSpec, path: Path = TABLE) -> list[float]:
    """ln(modelled / measured TFLOP/s) per table row; a batch of b GEMMs is one m·b-row GEMM
    (same tiles: every m in the table is a multiple of the 128-row tile). The table is a
    microbenchmark like the MAMF (its largest shapes reach it: 783 vs 794.5 TFLOP/s), so the
    model runs at the burst clock here, not at the sustained clock of a training step."""
    model, out = RooflineCompute(dataclasses.replace(gpu, sustained_clock_ratio=1.0)), []
    for r in _rows(path):
        b, m, n, k = (int(r[c]) for c in "bmnk")
        op = gemm("g", b * m, n, k, "bf16")
        ns = model.op_ns("gemm", op.flop, op.bytes, op.m, op.n, DTYPE_CODE["bf16"], False, op.k)
        out.append(math.log(op.flop / ns * 1e9 / 1e12 / float(r["bf16_tflops"])))
    return out


def _rms(xs: list[float]) -> float:
    return math.sqrt(sum(x * x for x in xs) / len(xs))


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def test_h100_gemm_model_reproduces_the_measured_table() -> None:
    """The 65 shapes of >= 34 GFLOP within 2.3% rms, unbiased; the worst is a batch of four
    256-row GEMMs modelled as one 1,024-row GEMM (11% fast: short batched GEMMs tile worse)."""
    gpu = get_system("dgx-h100").gpu
    errs = _log_errors(gpu)
    assert len(errs) == 65
    assert _rms(errs) < 0.023, f"rms {_rms(errs):.3f}"
    assert abs(_mean(errs)) < 0.01
    assert max(abs(e) for e in errs) < 0.12
    # Without the per-tile term the same model is further off and too fast on average:
    # the MAMF's best shape (K = 13312) overstates every shorter K.
    flat = _log_errors(dataclasses.replace(gpu, gemm_k_overhead=0.0))
    assert _rms(flat) > 1.8 * _rms(errs)
    assert _mean(flat) > 0.02


def test_h100_gemm_model_reproduces_shapes_below_one_wave() -> None:
    """The 40 shapes of 16-128 output tiles (K = 4096) within 8% rms, unbiased. Textbook wave
    quantization (tiles over whole waves of SMs: 64 tiles run at 64/132 of the rate) is what
    the occupancy term replaced: on these shapes it is 5.7× further off and 26% too slow on
    average — cuBLAS fills the SMs with smaller tiles and split-K."""
    gpu = get_system("dgx-h100").gpu
    errs = _log_errors(gpu, SMALL)
    assert len(errs) == 40
    assert _rms(errs) < 0.08, f"rms {_rms(errs):.3f}"
    assert abs(_mean(errs)) < 0.02
    # an unset occupancy is textbook wave quantization (``GPUSpec.gemm_occupancy``)
    sawtooth = _log_errors(dataclasses.replace(gpu, gemm_occupancy_waves=0.0), SMALL)
    assert _rms(sawtooth) > 4 * _rms(errs)
    assert _mean(sawtooth) < -0.2


def test_catalog_occupancy_and_k_overhead_are_the_least_squares_fit() -> None:
    """The Hopper presets' occupancy w and k₀ are reproducible: over both tables (105 shapes)
    the rms log error is smallest there (w in steps of 0.01, k₀ in steps of 4), so the constants
    are the fit, not a choice."""
    gpu = get_system("dgx-h100").gpu

    def rms(w: float, k0: float) -> float:
        g = dataclasses.replace(gpu, gemm_occupancy_waves=w, gemm_k_overhead=k0)
        return _rms(_log_errors(g) + _log_errors(g, SMALL))

    scan = {(w / 100, k0): rms(w / 100, k0) for w in range(36, 46) for k0 in range(112, 180, 4)}
    assert min(scan, key=scan.__getitem__) == (gpu.gemm_occupancy_waves, gpu.gemm_k_overhead)
    assert (gpu.gemm_occupancy_waves, gpu.gemm_k_overhead) == (0.40, 144)
    for name in ("dgx-h800", "hgx-h200"):  # the same sm_90 silicon
        other = get_system(name).gpu
        assert (other.gemm_occupancy_waves, other.gemm_k_overhead) == (0.40, 144)


def test_k_factor_properties() -> None:
    gpu = get_system("dgx-h100").gpu
    ks = [64, 128, 256, 512, 1024, 2048, 4096, 8192, 13312, 49152]
    bf16 = [gpu.gemm_k_factor(k, "bf16") for k in ks]
    assert all(0 < f <= 1 for f in bf16)
    assert bf16 == sorted(bf16)  # longer K amortises the per-tile cost
    assert gpu.gemm_k_factor(gpu.gemm_mamf_k, "bf16") == pytest.approx(1.0)
    assert gpu.gemm_k_factor(4 * gpu.gemm_mamf_k, "bf16") == 1.0  # never above the MAMF
    assert gpu.gemm_k_factor(0, "bf16") == 1.0  # K unknown (a foreign trace): no penalty
    # FP8 runs the K-loop at twice the rate, so the same per-tile time costs more K.
    assert gpu.gemm_k_factor(1024, "fp8") < gpu.gemm_k_factor(1024, "bf16")
    # GPUs without a measurement keep the MAMF for every K.
    a100 = get_system("dgx-a100-80gb").gpu
    assert a100.gemm_k_overhead == 0 and a100.gemm_k_factor(256, "bf16") == 1.0


def test_k_overhead_needs_the_mamf_shape_and_is_not_negative() -> None:
    data = dataclasses.asdict(get_system("dgx-h100"))
    data["gpu"]["gemm_mamf_k"] = 0
    with pytest.raises(ConfigError, match="gemm_mamf_k"):
        SystemSpec.from_dict(data, name="bad")
    data["gpu"].update(gemm_mamf_k=13312, gemm_k_overhead=-1)
    with pytest.raises(ConfigError, match=r"gemm_k_overhead must be ≥ 0 \(0: absent"):
        SystemSpec.from_dict(data, name="bad")


def test_gemm_by_k_plot_has_both_model_lines_and_the_measured_points(tmp_path: Path) -> None:
    import polars as pl

    from analysis.plots import gemm_by_k

    measured = pl.DataFrame([{c: float(v) for c, v in r.items()} for r in _rows()])
    system = get_system("dgx-h100")
    fig = gemm_by_k(system, measured)
    ax = fig.axes[0]
    line, flat, held = ax.get_lines()
    with_term, without = line.get_ydata(), flat.get_ydata()
    # the table is a burst measurement; a training step runs at the sustained clock (compute-
    # bound from K ≈ 1024 on; below it HBM binds and the clock does not matter)
    long_k = [(a, b) for k, a, b in zip(line.get_xdata(), with_term, held.get_ydata(),
                                        strict=True) if k >= 2048]
    assert all(b == pytest.approx(a * system.gpu.sustained_clock_ratio, rel=2e-3)
               for a, b in long_k)
    assert all(a <= b for a, b in zip(with_term, without, strict=True))  # the term only slows
    at = dict(zip(line.get_xdata(), zip(with_term, without, strict=True), strict=True))
    assert at[512][0] < 0.9 * at[512][1]  # it matters at short K (where HBM does not bind)
    assert at[max(at)][0] > 0.99 * at[max(at)][1]  # and fades at long K
    assert len(ax.collections[0].get_offsets()) == 65
    fig.savefig(tmp_path / "k.png")
    assert (tmp_path / "k.png").read_bytes()[:4] == b"\x89PNG"


def test_gemm_occupancy_plot_has_both_models_and_the_measured_points(tmp_path: Path) -> None:
    import polars as pl

    from analysis.plots import gemm_occupancy

    measured = pl.concat([pl.DataFrame([{c: float(v) for c, v in r.items()} for r in _rows(p)])
                          for p in (TABLE, SMALL)])
    system = get_system("dgx-h100")
    fig = gemm_occupancy(system, measured.with_columns(pl.col("b", "m", "n", "k").cast(int)))
    ax = fig.axes[0]
    model, sawtooth = ax.get_lines()[:2]
    tiles, ours, waves = model.get_xdata(), model.get_ydata(), sawtooth.get_ydata()
    at = {t: (a, b) for t, a, b in zip(tiles, ours, waves, strict=True)}
    assert at[64][1] < 0.75 * at[64][0]  # whole waves charge half a wave's GEMM far more
    assert at[144][1] < 0.6 * at[132][1]  # ... and a cliff just past one wave
    assert list(ours) == sorted(ours)  # the occupancy curve rises with the tiles ...
    assert list(waves) != sorted(waves)  # ... whole waves fall at every wave's edge
    k4096 = measured.filter(pl.col("k") == 4096).height
    assert len(ax.collections[0].get_offsets()) == k4096 == 71  # 40 small, 31 large
    fig.savefig(tmp_path / "o.png")
    assert (tmp_path / "o.png").read_bytes()[:4] == b"\x89PNG"


def test_gemm_ceilings_plot_draws_the_catalog(tmp_path: Path) -> None:
    from analysis.plots import gemm_ceilings

    systems = [get_system(n) for n in ("dgx-a100-80gb", "dgx-h100", "hgx-h200", "dgx-b200")]
    fig = gemm_ceilings(systems)
    ax = fig.axes[0]
    heights = [p.get_height() for p in ax.patches]
    gpus = list({s.gpu.name: s.gpu for s in systems}.values())  # H100 and H200 differ by name
    assert len(heights) == 3 * len(gpus)
    n = len(gpus)
    for i, g in enumerate(gpus):
        peak, mamf, held = heights[i], heights[n + i], heights[2 * n + i]
        assert peak == g.peak_bf16_TFLOPs
        assert mamf == pytest.approx(peak * g.gemm_efficiency)
        assert held == pytest.approx(mamf * g.sustained_clock_ratio)
        assert held < mamf < peak
    fig.savefig(tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
