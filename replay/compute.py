"""GPU compute model: the duration of a COMP node from its FLOPs, bytes, op type, GEMM shape and
dtype, or from the trace's ``duration_micros``.

* GEMM: roofline ``max(flop / (peak · e_gemm · e_wave), bytes / (hbm · e_mem))`` where
  ``e_gemm`` is the measured maximum achievable matmul efficiency (ANCHORS MAMF) and ``e_wave`` the
  wave quantization of 128×128 output tiles over the SMs (NVIDIA, "Matrix Multiplication
  Background User's Guide", §"Wave Quantization"): ``tiles / (ceil(tiles / SMs) · SMs)``.
* Attention (flash): ``flop / (peak · e_attn · s / (s + s_half))``, the FlashAttention efficiency
  curve in sequence length (systems/README.md); the backward runs at ``ATTN_BWD_RATIO`` of it.
* Memory-bound ops: ``bytes / (hbm · e_mem)`` (their few FLOPs per byte never bind).
* Every kernel pays the launch overhead.
"""

from __future__ import annotations

import math
from typing import Literal, Protocol

from replay.hardware import GPUSpec
from replay.reader import NodeRec
from tracegen.errors import ReplayError
from tracegen.units import DTYPE_FROM_CODE, NS_PER_S, NS_PER_US

TILE = 128  # output tile edge of the large-GEMM kernels of cuBLAS/CUTLASS on Ampere and Hopper
# FlashAttention-2 reports its backward at lower utilisation than its forward (Dao 2023, §4.1,
# Fig. 5-6: ~0.75-0.85×); an assumption until bench/device measures it.
ATTN_BWD_RATIO = 0.8
ComputeSource = Literal["model", "trace"]


class ComputeModel(Protocol):
    def duration_ns(self, node: NodeRec) -> int: ...


class ConstantCompute:
    """A fake for engine tests: every compute node takes ``ns``."""

    def __init__(self, ns: int) -> None:
        self.ns = ns

    def duration_ns(self, node: NodeRec) -> int:
        return self.ns


def wave_efficiency(m: int, n: int, sms: int) -> float:
    tiles = math.ceil(m / TILE) * math.ceil(n / TILE)
    return tiles / (math.ceil(tiles / sms) * sms)


class RooflineCompute:
    """The calibrated roofline model of one GPU type."""

    def __init__(self, gpu: GPUSpec, source: ComputeSource = "model") -> None:
        self.gpu, self.source = gpu, source
        self._cache: dict[tuple[object, ...], int] = {}

    def duration_ns(self, node: NodeRec) -> int:
        a = node.attrs
        if self.source == "trace" and node.duration_micros:
            return node.duration_micros * NS_PER_US
        flop, nbytes = a.get("num_ops", 0), a.get("tensor_size", 0)
        if not flop and not nbytes:
            if node.duration_micros or "num_ops" in a or "tensor_size" in a:
                return node.duration_micros * NS_PER_US
            raise ReplayError(f"node {node.id} ({node.name!r}) has neither num_ops/tensor_size "
                              "nor duration_micros: nothing to time it by")
        return self.op_ns(a.get("op_type", ""), flop, nbytes, a.get("gemm_m", 0),
                          a.get("gemm_n", 0), a.get("dtype", 1), node.name.endswith("_bwd"))

    def op_ns(self, op_type: str, flop: int, nbytes: int, m: int, n: int, dtype_code: int,
              backward: bool) -> int:
        """Duration of an op described by its attributes (cached)."""
        key = (op_type, flop, nbytes, m, n, dtype_code, backward)
        t = self._cache.get(key)
        if t is None:
            t = self._cache[key] = self._model(*key)
        return t

    def _model(self, op_type: object, flop: int, nbytes: int, m: int, n: int, dtype_code: int,
               backward: bool) -> int:
        g = self.gpu
        dtype = DTYPE_FROM_CODE.get(dtype_code, "bf16")
        mem_s = nbytes / (g.hbm_bytes_per_s * g.memory_efficiency)
        if op_type == "attention":
            seq = max(m, 1)
            eff = g.attention_efficiency * seq / (seq + g.attention_half_seq)
            if backward:
                eff *= ATTN_BWD_RATIO
            comp_s = flop / (g.peak_flop_per_s(dtype) * eff)
        elif op_type in ("gemm", "") and flop:
            eff = g.gemm_efficiency_fp8 if dtype == "fp8" else g.gemm_efficiency
            if m and n:
                eff *= wave_efficiency(m, n, g.sm_count)
            comp_s = flop / (g.peak_flop_per_s(dtype) * eff)
        else:  # memory-bound kernels: ~1-5 FLOP per 2-8 bytes, far below the ridge point
            comp_s = 0.0
        return round(max(comp_s, mem_s) * NS_PER_S) + g.launch_overhead_ns
