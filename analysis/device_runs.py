"""trainsim's own device measurements (``bench/device/measure_hopper.py``'s and
``measure_moe_overlap.py``'s JSON, committed under ``bench/device/results/``) as frames, each
measurement beside what the compute model predicts for it on a given system: the evidence
behind the Hopper constants, the grouped expert GEMMs and the interference term, in a form a
notebook can look at and a test can check."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import polars as pl

from replay.attention_kernels import with_attention_kernel
from replay.compute import RooflineCompute, curve_call_flop
from replay.hardware import SystemSpec
from tracegen.errors import ConfigError
from tracegen.ops import gemm, grouped_gemm, grouped_gemm_bwd
from tracegen.units import DTYPE_CODE

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "device" / "results"


def load_run(path: str | Path) -> dict[str, Any]:
    """One results file of either device script; ConfigError naming the file when it is missing or
    not such a file."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read device results {p}: {e}", what="device results") from e
    if not isinstance(data, dict) or "env" not in data:
        raise ConfigError(f"{p} is not a bench/device results file of measure_hopper.py or "
                          "measure_moe_overlap.py (no 'env' section)",
                          what="device results")
    return data


def held_gemms(run: dict[str, Any], system: SystemSpec) -> pl.DataFrame:
    """Per held GEMM (BF16 and FP8): measured and modelled TFLOP/s on ``system`` at the
    sustained clock, and the model's signed error in %."""
    model, rows = RooflineCompute(system.gpu), []
    for dtype in ("bf16", "fp8"):
        for r in run.get(f"gemm_{dtype}_held", []):
            op = gemm("g", r["m"], r["n"], r["k"], dtype)
            ns = model.op_time_ns(op) - system.gpu.launch_overhead_ns
            rows.append({"dtype": dtype, "shape": r["shape"], "tflop": op.flop / 1e12,
                         "measured_tflops": r["tflops"], "model_tflops": op.flop / ns / 1e3,
                         "sm_mhz": r.get("sm_mhz")})
    frame = pl.DataFrame(rows)
    return frame.with_columns(
        ((pl.col("model_tflops") / pl.col("measured_tflops") - 1) * 100).alias("error_pct"))


def grouped_gemms(run: dict[str, Any], system: SystemSpec,
                  dtype: str = "bf16") -> pl.DataFrame:
    """Per measured group of expert GEMMs (``measure_moe_overlap.py``'s ``grouped_gemm``, or
    ``grouped_fp8`` with ``dtype`` "fp8": g experts of m tokens, one cuBLAS GEMM each on
    Transformer Engine's four streams): the measured milliseconds, the compute model's for the
    grouped op at the burst clock the calls ran at, and the one GEMM of all g·m rows —
    measured, and as the model times it."""
    burst = dataclasses.replace(system.gpu, sustained_clock_ratio=1.0,
                                sustained_clock_ratio_fp8=1.0)
    model, rows = RooflineCompute(burst), []

    def ms(op: Any) -> float:
        return model.op_time_ns(op) / 1e6

    section = "grouped_fp8" if dtype == "fp8" else "grouped_gemm"
    if not any("streams_ms" in r for r in run.get(section, [])):
        raise ConfigError(f"these device results hold no measured {section} groups: they come "
                          "from bench/device/measure_moe_overlap.py", what="device results")
    for r in run.get(section, []):
        if "streams_ms" not in r:
            continue
        m, n, k, g = r["m"], r["n"], r["k"], r["g"]
        fwd = grouped_gemm("e", m * g, n, k, dtype, g)
        wgrad = r.get("wgrad", False)
        op = grouped_gemm_bwd(fwd)[1] if wgrad else fwd
        one = gemm("o", n, k, m * g, dtype) if wgrad else gemm("o", m * g, n, k, dtype)
        rows.append({"model": r["model"], "gemm": r["gemm"], "m": m, "g": g,
                     "measured_ms": r["streams_ms"], "model_ms": ms(op),
                     "one_gemm_measured_ms": r.get("one_gemm_ms"), "one_gemm_model_ms": ms(one)})
    frame = pl.DataFrame(rows)
    return frame.with_columns(
        ((pl.col("model_ms") / pl.col("measured_ms") - 1) * 100).alias("error_pct"))


def held_slowdowns(*runs: dict[str, Any]) -> pl.DataFrame:
    """Per kernel beside a communication-like kernel that holds ``blocks`` SMs throughout
    (``measure_moe_overlap.py``'s ``held_comm`` GEMMs and ``held_kernels`` memory-bound kernels
    and attention, from any of ``runs``): the kernel, its kind ("gemm", "attention" or
    "memory"), its milliseconds alone, the blocks held, what the held kernel does ("holds SMs"
    or "copies HBM") and the slowdown."""
    rows = []
    for run in runs:
        for r in run.get("held_comm", []) + run.get("held_kernels", []):
            if not r.get("covered"):
                continue
            name = r.get("gemm") or r["kernel"]
            kind = ("gemm" if "gemm" in r else "attention" if name.startswith("attention")
                    else "memory")
            alone = r.get("gemm_ms", r.get("alone_ms"))
            for held, key in (("holds SMs", "slowdown_spin"), ("copies HBM", "slowdown_copy")):
                rows.append({"kernel": name, "kind": kind, "alone_ms": alone,
                             "blocks": r["blocks"], "held": held, "slowdown": r[key]})
    if not rows:
        raise ConfigError("these device results hold no kernels timed beside held SMs: they "
                          "come from bench/device/measure_moe_overlap.py (held_comm, "
                          "held_kernels)", what="device results")
    return pl.DataFrame(rows)


def attention_curves(run: dict[str, Any], system: SystemSpec,
                     kernels: tuple[str, ...] = ("preset", "flashattention-3", "cudnn",
                                                 "flashattention-2")) -> pl.DataFrame:
    """Causal forward attention at head dim 128: the measured TFLOP/s per backend and length
    (``kind`` "measured", ``source`` the SDPA backend) and each kernel curve's at the same
    lengths, at the burst clock the curves were measured at (``kind`` "curve", ``source`` the
    kernel name, "preset" for the system's own)."""
    rows = [{"kind": "measured", "source": r["backend"], "seq": r["seq"],
             "tflops": r["fwd_tflops"]}
            for r in run.get("attention", [])
            if r.get("causal") and r.get("d") == 128 and "fwd_tflops" in r]
    seqs = sorted({r["seq"] for r in rows})
    for kernel in kernels:
        s = system if kernel == "preset" else with_attention_kernel(system, kernel)
        burst = dataclasses.replace(s.gpu, sustained_clock_ratio=1.0)
        compute = RooflineCompute(burst)
        for seq in seqs:
            flop = curve_call_flop(seq)  # shaped as the measured calls (16K tokens per call)
            ns = compute.op_ns("attention", flop, 0, seq, seq, DTYPE_CODE["bf16"], False,
                               128) - burst.launch_overhead_ns
            rows.append({"kind": "curve", "source": kernel, "seq": seq,
                         "tflops": flop / ns / 1e3})
    return pl.DataFrame(rows)
