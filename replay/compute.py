"""GPU compute model: the duration of a COMP node from its FLOPs, bytes, op type, GEMM shape and
dtype, or from the trace's ``duration_micros``.

* GEMM: roofline ``max(flop / (peak · e_gemm · o(T) · f(K)), bytes / (hbm · e_mem))`` where
  ``e_gemm`` is the measured maximum achievable matmul efficiency (ANCHORS MAMF), o(T) the
  occupancy of its T 128×128 output tiles over the SMs (``GPUSpec.gemm_occupancy``: wave
  quantization — NVIDIA, "Matrix Multiplication Background User's Guide" — as cuBLAS's tile and
  split-K choices smooth it, ``1 − exp(−T/(w·SMs))``, where measured (Hopper); the textbook
  ``T / (⌈T/SMs⌉·SMs)`` elsewhere), and f(K) the reduction-length factor ``K/(K + k₀)``
  normalised to the MAMF's K (``GPUSpec.gemm_k_factor``); w and k₀ fitted together to OpenXLA's
  measured sm_90 matmul table (tests/test_gemm_k.py).
* Attention (flash): ``flop / (peak · e_attn · s / (s + s_half) · r(d) · o(T))``, the fused
  kernel's efficiency curve in sequence length (a sliding window's: at its key length, times
  ``band_edge``), measured at head dim 128, times the measured
  ratio r(d) at the op's head dim d and, where measured, the occupancy o(T) of a call with T
  query tiles (``attention_tiles``; ``GPUSpec.attention_occupancy``) (systems/README.md); the
  backward runs at ``ATTN_BWD_RATIO`` of it, times its measured head-dim ratio where there is one
  (``GPUSpec.attention_bwd_head_ratio``).
* Attention without FlashAttention (GPUs it does not run on): the score and value GEMMs over the
  whole s×s matrix (twice the causal FLOPs the op carries; four of them in backward) at GEMM
  efficiency (QKᵀ reduces over the head dim, P·V over the sequence: each at its K's factor),
  plus the score-matrix traffic of Megatron's unfused path — the tensors Korthikanti et al. 2022
  §4.1 list per score element: QKᵀ out (2 B), softmax in/out (2 + 2 B), dropout
  mask (1 B) and in/out (2 + 2 B), read again by the value GEMM (2 B): ``SCORE_BYTES`` = 13 B
  forward, twice that backward.
* Tensor-core work (GEMMs, attention) runs at the datasheet peak times the sustained-clock ratio
  (``GPUSpec.tensor_flop_per_s``): the efficiencies above were measured in short bursts at boost
  clock, training holds the chip at its power limit (systems/README.md, "Sustained clock").
* Memory-bound ops: ``bytes / (hbm · e_mem)`` (their few FLOPs per byte never bind).
* Every kernel pays the launch overhead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol

from replay.hardware import ATTN_TILE_ROWS, GPUSpec
from replay.reader import NodeRec
from tracegen.errors import ReplayError
from tracegen.units import DTYPE_CODE, DTYPE_FROM_CODE, NS_PER_S, NS_PER_US

if TYPE_CHECKING:
    from tracegen.ops import Op

# The backward's throughput over the forward's: FlashAttention-2 reports ~0.75-0.85× (Dao 2023,
# §4.1, Fig. 5-6); measured on an H200 (bench/device, 2026-11-30), cuDNN 9.19 causal at head
# dim 128 rises from 0.60 at 512 tokens to 0.89 at 16K, median 0.80 (FlashAttention-2: 0.84-0.97,
# median 0.88): tests/test_device_evidence.py.
ATTN_BWD_RATIO = 0.8
SCORE_BYTES = 13  # per score element, forward, without FlashAttention (see above)
ATTN_FLASH_BWD_FLOP = 2.5  # the op's backward FLOPs over its forward (tracegen/ops.py, Dao 2023)
# Transformer Engine issues a userbuffers-split GEMM's chunks round-robin on this many compute
# streams (``_NUM_MAX_UB_STREAMS = 3``, pytorch/module/base.py; ``NVTE_COMM_OVERLAP_MAX_STREAMS``,
# comm_gemm_overlap.h), a chunk's stream waiting only for its own input (a ring exchange's
# receive; a pipelined reduce-scatter's chunks wait for nothing), so as many chunks run at once.
UB_STREAMS = 3
ComputeSource = Literal["model", "trace"]


def curve_call_flop(seq: int) -> int:
    """Forward FLOPs of one call as the attention curves were measured (16K tokens per call,
    hidden 2048, causal; bench/device and the FlashAttention-3 paper): 2·16384·2048·s, whatever
    the head dim (heads = 2048/d)."""
    return 2 * 16384 * 2048 * seq


def attention_tiles(flop: int, seq: int, kv_len: int, head_dim: int, backward: bool,
                    causal: bool = True) -> float:
    """Query tiles of one causal attention call: b·heads = forward FLOPs / (2·s·s_kv·d)
    (tracegen's count, 4·b·s·s_kv·d·heads/2; without the mask every pair, 4·s·s_kv·d),
    times ⌈s/128⌉; 0 where the shape is unknown.
    A context-parallel ring's ops carry a step's K/V length (s/cp): its first step is exact,
    its cp − 1 later steps count as one call (exact at cp 2, more tiles than a step has
    beyond)."""
    if seq <= 0 or kv_len <= 0 or head_dim <= 0:
        return 0.0
    fwd = flop / ATTN_FLASH_BWD_FLOP if backward else flop
    per_call = (2 if causal else 4) * seq * kv_len * head_dim  # a full call: every pair
    return fwd / per_call * -(-seq // ATTN_TILE_ROWS)


def causal_attention_efficiency(g: GPUSpec, flop: int, seq: int, kv_len: int, head_dim: int,
                                backward: bool) -> float:
    """Forward efficiency of a causal call (or a window's band, key length below the queries'):
    the curve at min(queries, keys) × the head-dim ratio × the occupancy of its query tiles ×
    the band's edge (module docstring)."""
    n = max(min(seq, kv_len) if kv_len > 0 else seq, 1)
    return (g.attention_efficiency * n / (n + g.attention_half_seq)
            * g.attention_head_ratio(head_dim)
            * g.attention_occupancy(attention_tiles(flop, seq, kv_len, head_dim, backward))
            * band_edge(seq, kv_len))


def full_attention_efficiency(g: GPUSpec, flop: int, seq: int, kv_len: int, head_dim: int,
                              backward: bool) -> float:
    """Forward efficiency of an attention call without a causal mask, ``seq`` queries each
    attending all ``kv_len`` keys (a context-parallel ring's later steps: a chunk's queries
    against another rank's keys). The causal curves are read where a causal call's rows
    attend as many keys on average, length 2·kv_len (a sliding window's convention), without
    the half tile a causal row wastes at its diagonal (``band_edge``'s (n + 128)/n at that
    length), and its tiles, all of equal work, lose only whole waves
    (``GPUSpec.attention_full_occupancy``). Checked, not fitted: an H200's ring steps at
    cp 2 (bench/device run 4, tests/test_context_parallel.py)."""
    n = 2 * kv_len
    return (g.attention_efficiency * n / (n + g.attention_half_seq)
            * (n + ATTN_TILE_ROWS) / n * g.attention_head_ratio(head_dim)
            * g.attention_full_occupancy(
                attention_tiles(flop, seq, kv_len, head_dim, backward, causal=False)))


def band_edge(seq: int, kv_len: int) -> float:
    """A sliding window's share of the efficiency a causal call of its key length n has (an
    op whose key length is below its query length: ``tracegen.ops.attention_fwd``). Kernels
    compute whole tiles of 128 keys: a causal row of query tiles wastes half a tile at its
    diagonal, useful share n/(n + 128) at mean keys n/2; a window's row spans w + 128 keys for w
    useful ones, n/(n + 256) at w = n/2. The ratio (n + 128)/(n + 256). Measured with
    FlexAttention's block-sparse kernel on an H200 (bench/device, 2026-12-04, head dims 64, 128
    and 256): windows of 512 / 1,024 / 4,096 in 16 K tokens ran at 0.86-0.91 / 0.91-0.97 /
    0.98-1.02 of causal calls of their key length (this gives 0.90 / 0.94 / 0.98; with the
    calls' occupancy within 5.1% everywhere), a window of 128 at 0.76-0.84 (0.75;
    tests/test_window_evidence.py)."""
    if not 0 < kv_len < seq:
        return 1.0
    return (kv_len + ATTN_TILE_ROWS) / (kv_len + 2 * ATTN_TILE_ROWS)


class OpCost(NamedTuple):
    """One op's duration and the terms of the roofline it comes from (``RooflineCompute.explain``):
    the tensor-core time at ``efficiency`` of the sustained peak (0 for memory-bound kernels),
    the HBM time, the launch overheads, and their total — the larger of the first two plus the
    launches (unfused attention: their sum, its GEMMs and score traffic in turn)."""

    compute_ns: int
    memory_ns: int
    launch_ns: int
    efficiency: float
    total_ns: int

    @property
    def bound(self) -> str:
        """What sets the op's time: ``compute``, ``memory`` or, where both are below the
        launch overhead, ``launch``."""
        if self.launch_ns >= max(self.compute_ns, self.memory_ns):
            return "launch"
        return "compute" if self.compute_ns > self.memory_ns else "memory"


class ComputeModel(Protocol):
    def duration_ns(self, node: NodeRec) -> int: ...


class ConstantCompute:
    """A fake for engine tests: every compute node takes ``ns``."""

    def __init__(self, ns: int) -> None:
        self.ns = ns

    def duration_ns(self, node: NodeRec) -> int:
        return self.ns


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
                          a.get("gemm_n", 0), a.get("dtype", 1), node.name.endswith("_bwd"),
                          a.get("gemm_k", 0), a.get("gemm_splits", 1), a.get("gemm_groups", 1),
                          a.get("attn_causal", True))

    def op_ns(self, op_type: str, flop: int, nbytes: int, m: int, n: int, dtype_code: int,
              backward: bool, k: int = 0, splits: int = 1, groups: int = 1,
              causal: bool = True) -> int:
        """Duration of an op described by its attributes (cached). For attention, m and n are
        the query and key lengths and k the head dimension, and ``causal`` False a call
        without the mask (``Op.causal``); a GEMM of ``splits`` > 1 runs as that many kernels
        of m/splits rows (``Op.splits``), each launched; one of ``groups`` > 1 as that many
        m×n×k GEMMs one after another (``Op.groups``)."""
        key = (op_type, flop, nbytes, m, n, dtype_code, backward, k, splits, groups, causal)
        t = self._cache.get(key)
        if t is None:
            t = self._cache[key] = self.explain(*key).total_ns
        return t

    def op_time_ns(self, op: Op) -> int:
        """``op_ns`` of a tracegen op, read as the trace carries it (its backward flag from its
        name, as the writer sets it)."""
        return self.op_ns(*self._op_key(op))

    def explain_op(self, op: Op) -> OpCost:
        """``explain`` of a tracegen op, read as ``op_time_ns`` reads it."""
        return self.explain(*self._op_key(op))

    @staticmethod
    def _op_key(op: Op) -> tuple[str, int, int, int, int, int, bool, int, int, int, bool]:
        return (op.kind, op.flop, op.bytes, op.m, op.n, DTYPE_CODE[op.dtype],
                op.name.endswith("_bwd"), op.k, op.splits, op.groups, op.causal)

    def explain(self, op_type: object, flop: int, nbytes: int, m: int, n: int,
                dtype_code: int, backward: bool, k: int = 0, splits: int = 1, groups: int = 1,
                causal: bool = True) -> OpCost:
        """``op_ns``'s duration with the terms it is made of (``op_ns`` caches its total)."""
        g = self.gpu
        dtype = DTYPE_FROM_CODE.get(dtype_code, "bf16")
        if dtype == "fp8" and op_type not in ("gemm", "attention", "") and g.fp8_any_layout:
            # a per-tensor FP8 cast (tracegen.ops): no transposed copy, one byte an element
            # (its ``flop``) less, where FP8 GEMMs take any layout
            nbytes = max(0, nbytes - flop)
        mem_s = nbytes / (g.hbm_bytes_per_s * g.memory_efficiency)
        if op_type == "attention" and not g.flash_attention:
            # (a window's band: the unfused path computes the whole score matrix and masks it)
            return self._unfused_attention(flop * m // n if causal and 0 < n < m else flop,
                                           head_dim=k,
                                           kv_len=max(m, n), dtype=dtype, backward=backward)
        eff = 0.0
        if op_type == "attention":
            eff = (full_attention_efficiency(g, flop, m, n, k, backward)
                   if not causal and m > 0 and n > 0
                   else causal_attention_efficiency(g, flop, m, n, k, backward))
            if backward:
                eff *= ATTN_BWD_RATIO * g.attention_bwd_head_ratio(k)
            comp_s = flop / (g.tensor_flop_per_s(dtype) * eff)
        elif op_type in ("gemm", "") and flop:
            eff = g.gemm_efficiency_of(dtype)
            eff *= g.gemm_k_factor(k, dtype)
            # a group's GEMMs run one after another, each on its own m×n tiles (m: an expert's
            # tokens, or its weight gradient's rows): Transformer Engine puts them round-robin
            # on four streams (multi_streams.h), but measured on an H200 (bench/device,
            # 2026-12-04) 69 BF16 and 16 FP8 groups took 0.86-1.21× this sum of their GEMMs
            # (tests/test_device_moe_evidence.py), never the one GEMM of all their rows (a
            # group of small experts took up to 2.3× that)
            # a split GEMM's chunks go round-robin on UB_STREAMS streams, so up to that many
            # chunks' tiles share the SMs at once (Transformer Engine's userbuffers; DESIGN.md)
            eff *= g.gemm_occupancy(-(-m // max(splits, 1)), n,
                                    kernels=min(max(splits, 1), UB_STREAMS))
            comp_s = flop / (g.tensor_flop_per_s(dtype) * eff)
        else:  # memory-bound kernels: ~1-5 FLOP per 2-8 bytes, far below the ridge point
            comp_s = 0.0
        launches = max(splits, 1) * max(groups, 1)
        return OpCost(round(comp_s * NS_PER_S), round(mem_s * NS_PER_S),
                      launches * g.launch_overhead_ns, eff,
                      round(max(comp_s, mem_s) * NS_PER_S) + launches * g.launch_overhead_ns)

    def _unfused_attention(self, flop: int, *, head_dim: int, kv_len: int, dtype: str,
                           backward: bool) -> OpCost:
        """Standard attention from the op's causal flash FLOPs 2·b·heads·s_q·s_kv·d (forward;
        2.5× in backward): scores = b·heads·s_q·s_kv. Half the GEMM work reduces over the head
        dim (QKᵀ; dP = dO·Vᵀ), half over the sequence (P·V; dQ, dK, dV: s_kv taken for s_q),
        each at its reduction length's efficiency (``GPUSpec.gemm_k_factor``). Its GEMMs and
        its score traffic run one after the other: the time is their sum."""
        g = self.gpu
        fwd_flop = flop / ATTN_FLASH_BWD_FLOP if backward else flop
        scores = fwd_flop / (2 * max(head_dim, 1))
        passes = 2 if backward else 1
        per_flop = 1 / g.gemm_k_factor(head_dim, dtype) + 1 / g.gemm_k_factor(kv_len, dtype)
        gemm_s = passes * fwd_flop * per_flop / (g.tensor_flop_per_s(dtype) * g.gemm_efficiency)
        mem_s = passes * SCORE_BYTES * scores / (g.hbm_bytes_per_s * g.memory_efficiency)
        launch_ns = (4 if backward else 3) * g.launch_overhead_ns
        eff = flop / (gemm_s * g.tensor_flop_per_s(dtype)) if gemm_s else 0.0
        return OpCost(round(gemm_s * NS_PER_S), round(mem_s * NS_PER_S), launch_ns, eff,
                      round((gemm_s + mem_s) * NS_PER_S) + launch_ns)
