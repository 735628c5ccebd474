"""Hardware: GPU, node (scale-up) and scale-out specs, loaded from TOML with units in key names and
converted once here to SI (FLOP/s, bytes/s, bytes, ns)."""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from tracegen._config import build, load_mapping
from tracegen.errors import ConfigError, did_you_mean
from tracegen.units import GB, LOW_PRECISION_GEMMS, NS_PER_US, TERA, GiB

Topology = Literal["fat-tree", "rail-optimized"]
HEAD_DIM_REF = 128  # head dim of the attention efficiency curves in the catalog
# Query tiles of one call where the curves were measured: 16K tokens × 16 heads (hidden 2048,
# the FlashAttention-3 paper's setup, kept by bench/device) in 128-row tiles.
ATTN_REF_TILES = 2048
ATTN_TILE_ROWS = 128
GEMM_TILE = 128  # output tile edge of the large-GEMM kernels of cuBLAS/CUTLASS (Ampere, Hopper)
ATTN_MAX_TILES = 4096  # the largest call measured (bench/device): larger ones are held there


def tile_occupancy(tiles: float, half_tiles: float) -> float:
    """T/(T + T₀) over the same at ``ATTN_REF_TILES``, T held at ``ATTN_MAX_TILES`` (1 where
    T₀ or T is 0: unmeasured or unknown)."""
    if half_tiles <= 0 or tiles <= 0:
        return 1.0
    tiles = min(tiles, ATTN_MAX_TILES)
    return tiles / (tiles + half_tiles) * (ATTN_REF_TILES + half_tiles) / ATTN_REF_TILES


def _by_head_dim(head_dim: int, at64: float, at256: float) -> float:
    """A ratio to head dim 128 measured at 64 and 256: log-linear between, held beyond (0:
    unknown head dim, taken as 128)."""
    if head_dim <= 0 or head_dim == HEAD_DIM_REF:
        return 1.0
    x = max(-1.0, min(1.0, math.log2(head_dim / HEAD_DIM_REF)))
    return 1.0 + abs(x) * ((at256 if x > 0 else at64) - 1.0)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GPUSpec:
    name: str
    peak_bf16_TFLOPs: float
    peak_fp16_TFLOPs: float
    peak_fp8_TFLOPs: float
    peak_fp32_TFLOPs: float
    hbm_GiB: float
    hbm_GBps: float
    sm_count: int
    gemm_efficiency: float
    gemm_efficiency_fp8: float
    attention_efficiency: float
    attention_half_seq: float
    memory_efficiency: float
    launch_overhead_us: float
    # Attention efficiency at head dim 64 and 256 relative to 128 (where the curve above was
    # measured); log-linear between, held beyond (systems/README.md, "Attention head size").
    attention_hdim64_ratio: float = 1.0
    attention_hdim256_ratio: float = 1.0
    # The backward/forward throughput ratio at head dim 64 and 256 relative to 128's (the
    # backward is relatively faster at 64 and far slower at 256 on cuDNN 9.19; measured on H200).
    attention_bwd_hdim64_ratio: float = 1.0
    attention_bwd_hdim256_ratio: float = 1.0
    # Occupancy: a call with T query tiles (b · heads · s/128) runs at T/(T + this), relative to
    # the curves' ``ATTN_REF_TILES`` — few heads per call leave SMs idle in the last wave and
    # causal tiles unbalanced (measured on H200, systems/README.md). 0: not measured, no term.
    attention_half_tiles: float = 0.0
    # False where FlashAttention does not run (Volta): attention is then two batched GEMMs over
    # the full score matrix plus memory-bound softmax and dropout (replay/compute.py).
    flash_attention: bool = True
    # False where the tensor cores have no bf16 (Volta): the preset then runs bf16 at the fp16
    # rate, and validation refuses a bf16 row on it as a data error.
    bf16: bool = True
    # A GEMM's K-independent cost per output tile (pipeline fill, epilogue), in K elements of a
    # 16-bit GEMM, and the K of the MAMF's best shape, where ``gemm_efficiency`` was measured:
    # efficiency falls as K/(K + overhead) below it (replay/compute.py). 0: not measured.
    gemm_k_overhead: float = 0.0
    gemm_mamf_k: int = 0
    # GEMM occupancy: a GEMM of T 128×128 output tiles runs at 1 − exp(−T / (this · SMs)) of
    # a large one's rate. Below a few waves the SMs are not all busy; cuBLAS's smaller tiles and
    # split-K soften the whole-wave sawtooth of textbook wave quantization into this curve
    # (fitted with ``gemm_k_overhead`` to OpenXLA's measured sm_90 table, systems/README.md,
    # "GEMM occupancy"). 0: not measured on this GPU — textbook wave quantization, T over whole
    # waves of SMs, which its other constants were validated with.
    gemm_occupancy_waves: float = 0.0
    # Tensor-core throughput held under sustained load over the short burst in which the MAMF
    # (``gemm_efficiency``) and the attention curves were measured: a saturated matmul drives the
    # chip to its power limit and the clock settles below boost (systems/README.md, "Sustained
    # clock"). Applies to GEMMs and attention, not to memory-bound kernels. 1: no measurement.
    sustained_clock_ratio: float = 1.0
    # The same for FP8 GEMMs, whose denser arithmetic holds a lower clock at the same power
    # limit (measured on H200: ~1400 against ~1500 MHz). 0: as ``sustained_clock_ratio``.
    sustained_clock_ratio_fp8: float = 0.0
    # NVFP4 (Blackwell's block-scaled 4-bit GEMMs): the dense peak and a large GEMM's efficiency
    # against it. 0: no FP4 tensor cores — an nvfp4 GEMM is then costed at the FP8 rate it would
    # fall back to at best, and ``estimate`` and ``validate`` say so.
    peak_fp4_TFLOPs: float = 0.0
    gemm_efficiency_fp4: float = 0.0
    # MXFP8 GEMMs (FP8's MXFP8 recipe: block-scaled, Blackwell) against the FP8 peak. 0: as
    # ``gemm_efficiency_fp8``.
    gemm_efficiency_mxfp8: float = 0.0
    # Interference of communication with compute: a compute kernel runs (1 + this) times longer
    # while a collective of its rank is in flight (NCCL's kernels take SMs and HBM bandwidth
    # from it). Lee et al. 2025 (arXiv:2507.03114) measured 18.9% on average (at most 40%) with
    # GPT and Llama layers on 4 A100s and 4 H100s (systems/README.md, "Interference"). 0: not
    # measured on this GPU, not modelled.
    comm_interference: float = 0.0

    def lacks(self, precision: str, fp8_recipe: str = "delayed") -> str:
        """The tensor cores this GPU lacks to run ``precision`` (and FP8's ``fp8_recipe``) as
        its training recipes do, in words ("no FP8 tensor cores (…)"), or "": what the CLI's
        notes, ``validate``'s skips and ``--precisions``'s refusals say."""
        if precision == "fp8" and self.peak_fp8_TFLOPs <= self.peak_bf16_TFLOPs:
            return "no FP8 tensor cores (FP8 training needs Hopper or later)"
        if precision == "fp8" and fp8_recipe == "mxfp8" and not self.block_scaled:
            return ("no block-scaled tensor cores (MXFP8 training needs Blackwell; Transformer "
                    "Engine refuses the recipe before it)")
        if precision == "nvfp4" and not self.peak_fp4_TFLOPs:
            return "no FP4 tensor cores (NVFP4 training needs Blackwell)"
        if precision == "bf16" and not self.bf16:
            return "no bf16 tensor cores (Volta: fp16 runs there)"
        return ""

    @property
    def fp8_any_layout(self) -> bool:
        """FP8 GEMMs in any operand layout (cuBLAS on Blackwell, compute capability 10.x and
        13+: Transformer Engine's ``is_non_tn_fp8_gemm_supported``), so a per-tensor FP8 cast
        writes no transposed copy. The catalog's Blackwell GPUs are its block-scaled ones."""
        return self.block_scaled

    @property
    def block_scaled(self) -> bool:
        """Block-scaled tensor cores (Blackwell's: MXFP8 and NVFP4 GEMMs; Transformer Engine
        refuses its MXFP8 recipe on Hopper). A catalog GPU has them where it has an FP4 peak:
        the two came together."""
        return self.peak_fp4_TFLOPs > 0

    def gemm_k_factor(self, k: int, dtype: str) -> float:
        """GEMM efficiency at reduction length ``k`` relative to the MAMF's best shape: every
        output tile pays a fixed cost worth ``gemm_k_overhead`` K elements besides its K-loop, so
        efficiency ∝ K/(K + k₀), normalised to 1 at the MAMF's K and capped there (0: unknown k,
        no penalty). FP8 runs the K-loop faster by its peak ratio, so the same cost spans more K."""
        k0 = self.gemm_k_overhead
        if k <= 0 or k0 <= 0:
            return 1.0
        if dtype in LOW_PRECISION_GEMMS:
            k0 *= self.peak_flop_per_s(dtype) / self.peak_flop_per_s("bf16")
        ref = self.gemm_mamf_k
        return min(1.0, k * (ref + k0) / ((k + k0) * ref))

    def gemm_occupancy(self, m: int, n: int, kernels: int = 1) -> float:
        """1 − exp(−T / (``gemm_occupancy_waves`` · SMs)) for the T = ⌈m/128⌉·⌈n/128⌉ output
        tiles of an m×n GEMM (times ``kernels`` of that shape running at once) where
        measured; elsewhere wave quantization, T / (⌈T/SMs⌉ · SMs) (NVIDIA, "Matrix
        Multiplication Background User's Guide"); 1 for an unknown shape."""
        if m <= 0 or n <= 0:
            return 1.0
        tiles = -(-m // GEMM_TILE) * -(-n // GEMM_TILE) * max(kernels, 1)
        if self.gemm_occupancy_waves <= 0:
            return self.wave_fill(tiles)
        return -math.expm1(-tiles / (self.gemm_occupancy_waves * self.sm_count))

    def tensor_flop_per_s(self, dtype: str) -> float:
        """The datasheet peak at the sustained clock: what the efficiencies above multiply. MFU
        and HFU stay against ``peak_flop_per_s``, the datasheet figure, as published."""
        ratio = self.sustained_clock_ratio
        if dtype in LOW_PRECISION_GEMMS and self.sustained_clock_ratio_fp8:
            ratio = self.sustained_clock_ratio_fp8
        return self.peak_flop_per_s(dtype) * ratio

    def peak_flop_per_s(self, dtype: str) -> float:
        tflops = {"bf16": self.peak_bf16_TFLOPs, "fp16": self.peak_fp16_TFLOPs,
                  "fp8": self.peak_fp8_TFLOPs, "fp32": self.peak_fp32_TFLOPs,
                  "nvfp4": self.peak_fp4_TFLOPs or self.peak_fp8_TFLOPs,
                  "mxfp8": self.peak_fp8_TFLOPs}[dtype]
        return tflops * TERA

    def gemm_efficiency_of(self, dtype: str) -> float:
        """A large GEMM's efficiency in ``dtype`` against its peak (``gemm_efficiency_fp4``
        where the GPU has FP4 tensor cores, else FP8's, the rate an nvfp4 GEMM is costed at)."""
        if dtype == "nvfp4" and self.peak_fp4_TFLOPs and self.gemm_efficiency_fp4:
            return self.gemm_efficiency_fp4
        if dtype == "mxfp8" and self.gemm_efficiency_mxfp8:
            return self.gemm_efficiency_mxfp8
        return self.gemm_efficiency_fp8 if dtype in LOW_PRECISION_GEMMS else self.gemm_efficiency

    def attention_occupancy(self, tiles: float) -> float:
        """Attention efficiency of a call with ``tiles`` query tiles relative to the curves'
        calls: T/(T + T₀) over the same at ``ATTN_REF_TILES`` (1 where T₀ is 0 or T unknown),
        T held at ``ATTN_MAX_TILES``, the largest call measured."""
        return tile_occupancy(tiles, self.attention_half_tiles)

    def attention_full_occupancy(self, tiles: float) -> float:
        """The same for a call without a causal mask (a context-parallel ring's later steps):
        its tiles all do equal work, so only whole waves over the SMs are lost — T over
        ⌈T/SMs⌉·SMs, relative to the same at ``ATTN_REF_TILES`` and at most 1 (1 where the
        causal occupancy is unmeasured, T₀ 0, or T unknown). Checked against an H200's ring
        steps (tests/test_context_parallel.py)."""
        if self.attention_half_tiles <= 0 or tiles <= 0:
            return 1.0
        return min(1.0, self.wave_fill(tiles) / self.wave_fill(ATTN_REF_TILES))

    def wave_fill(self, tiles: float) -> float:
        """Textbook wave quantization: ``tiles`` CTAs of equal work over ⌈T/SMs⌉ full waves
        of the SMs (NVIDIA, "Matrix Multiplication Background User's Guide")."""
        return tiles / (math.ceil(tiles / self.sm_count) * self.sm_count)

    def attention_head_ratio(self, head_dim: int) -> float:
        """Attention efficiency at ``head_dim`` over that at 128: log-linear in the head dim
        between the measured 64, 128 and 256, constant outside (0: unknown, taken as 128)."""
        return _by_head_dim(head_dim, self.attention_hdim64_ratio, self.attention_hdim256_ratio)

    def attention_bwd_head_ratio(self, head_dim: int) -> float:
        """The backward's throughput over the forward's at ``head_dim``, relative to that ratio
        at 128 (``compute.ATTN_BWD_RATIO``); interpolated as ``attention_head_ratio``."""
        return _by_head_dim(head_dim, self.attention_bwd_hdim64_ratio,
                            self.attention_bwd_hdim256_ratio)

    @property
    def hbm_bytes(self) -> int:
        return int(self.hbm_GiB * GiB)

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_GBps * GB

    @property
    def launch_overhead_ns(self) -> int:
        return round(self.launch_overhead_us * NS_PER_US)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class NodeSpec:
    gpus_per_node: int
    nvlink_GBps: float  # unidirectional per GPU
    nvlink_efficiency: float
    nvlink_latency_us: float
    # All-reduce bus bandwidth with NVLink SHARP (NVLS) inside a node; 0 where the NVSwitch has
    # none (before Hopper) or no measurement exists.
    nvls_busbw_GBps: float = 0.0
    # All-to-all bus bandwidth inside a node as nccl-tests measures it (algbw · (n−1)/n): NCCL's
    # all-to-all reaches less of NVLink than its all-reduce ring (DGX H100 320 against 370 GB/s,
    # ANCHORS). 0: not measured — the all-reduce plateau's rate (``nvlink_efficiency``) stands in.
    nvlink_a2a_busbw_GBps: float = 0.0
    # Host link a GPU copies to and from host memory over, each way, as achieved (PCIe, or
    # NVLink-C2C to a Grace CPU): activation offloading's copies (``Strategy.cpu_offload_layers``)
    # and Chakra MEM_STORE / MEM_LOAD nodes run at it. 0: not given (offloading refused).
    host_link_GBps: float = 0.0
    # Host memory one GPU's rank moves a second in a CPU op (Chakra COMP nodes marked is_cpu_op:
    # optimizer offloading's PyTorch CPU AdamW, ``Strategy.optimizer_offload_fraction``), each
    # rank with its own cores, as achieved. 0: not given (optimizer offloading refused).
    host_cpu_GBps: float = 0.0
    # GPUs of one host (a server, one operating system) where the NVLink domain spans several:
    # GB200 NVL72's 4-GPU compute trays in a 72-GPU domain. A host fails as a whole (a study's
    # ``rate_per_node_hour``). 0: the node is the host (an 8-GPU DGX/HGX).
    gpus_per_host: int = 0
    # Host memory of one host (``host_gpus`` GPUs), binary GiB as DRAM is built: what
    # offloading places there (``tracegen.memory.host_bytes``: the CPU optimizer's pinned copies
    # and moments, offloaded activations) must fit beside the GPU's own memory. 0: not given
    # (nothing checked).
    host_memory_GiB: float = 0.0

    @property
    def host_gpus(self) -> int:
        """The GPUs a host holds (``gpus_per_host``, else the node's)."""
        return self.gpus_per_host or self.gpus_per_node


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ScaleOutSpec:
    nic_Gbps_per_gpu: float
    nic_efficiency: float
    latency_us: float
    topology: Topology = "rail-optimized"
    oversubscription: float = 1.0
    # Several sites (data centres, or buildings on one campus): ranks [k·site_gpus,
    # (k+1)·site_gpus) on site k (whole nodes). A collective or send between sites moves at
    # most ``site_Gbps_per_gpu`` a GPU — the links between the sites over a site's GPUs — and
    # pays ``site_latency_us`` (one way) where it crosses, as NCCL charges a network hop
    # (replay/network.py). 0: one site. What a site's links hold is the user's to give: no
    # preset has sites.
    site_gpus: int = 0
    site_Gbps_per_gpu: float = 0.0
    site_latency_us: float = 0.0
    # What one flow keeps in flight across the sites' links, MiB: a sender waits for credit
    # from its receiver a round trip away, so a flow moves at most this over the round trip
    # (NCCL: NCCL_BUFFSIZE, 4 MiB by default, per channel, times the channels the flow's
    # traffic takes; the count is NCCL's choice). 0: no such limit (not modelled).
    site_window_MiB: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class AstraSpec:
    """ASTRA-sim system-layer knobs for the compatible mode (its system JSON's names)."""

    preferred_dataset_splits: int = 4
    local_mem_bw_GBps: float = 1600


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SystemSpec:
    name: str
    gpu: GPUSpec
    node: NodeSpec
    scaleout: ScaleOutSpec
    astra: AstraSpec = AstraSpec()
    description: str = ""

    def __post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise ConfigError(problems, what=f"system {self.name!r}")

    def node_of(self, rank: int) -> int:
        return rank // self.node.gpus_per_node

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, name: str = "custom",
                  source: str | None = None) -> SystemSpec:
        """``source``: the file it was read from, named in errors (its ``name`` key may be a
        preset's, as in a copy of a preset's file being edited)."""
        data = dict(data)
        data.setdefault("name", name)
        what = f"system {data['name']!r}" + (f" (from {source})" if source else "")
        for key, sub in (("gpu", GPUSpec), ("node", NodeSpec), ("scaleout", ScaleOutSpec),
                         ("astra", AstraSpec)):
            if key in data:
                if not isinstance(data[key], dict):
                    raise ConfigError(f"[{key}] must be a table", what=what)
                data[key] = build(sub, data[key], what=f"{what} [{key}]")
        try:
            return build(cls, data, what=what)
        except ConfigError as exc:  # (the checks of __post_init__ know the name, not the file)
            if source is None or exc.what == what:
                raise
            raise ConfigError(exc.problems, what=what) from None

    def with_overrides(self, overrides: dict[str, Any]) -> SystemSpec:
        """A copy with ``section.key`` values replaced (``{"gpu.flash_attention": False}``),
        checked like a system file: unknown keys, wrong types and out-of-range values say so."""
        data = dataclasses.asdict(self)
        for dotted, value in overrides.items():
            section, _, key = dotted.partition(".")
            if section not in SECTIONS or not key:
                raise ConfigError(f"override {dotted!r}: use section.key with a section among "
                                  f"{', '.join(SECTIONS)} (e.g. gpu.flash_attention)",
                                  what=f"system {self.name!r}")
            data[section][key] = value
        return SystemSpec.from_dict(data, name=self.name)


SECTIONS = ("gpu", "node", "scaleout", "astra")


def system_toml(spec: SystemSpec) -> str:
    """``spec`` as a system file (``resolve_system`` reads it back equal): what a process on
    another machine needs of a system given here as a file it cannot see."""
    data = dataclasses.asdict(spec)
    lines = [f"{k} = {json.dumps(data[k], ensure_ascii=False)}" for k in ("name", "description")]
    for section in SECTIONS:
        lines += ["", f"[{section}]"] + [f"{k} = {json.dumps(v, ensure_ascii=False)}"
                                         for k, v in data[section].items()]
    return "\n".join(lines) + "\n"
# Every number of a system lies far inside this range in its own units (TFLOP/s, GB/s, Gb/s, µs,
# GiB, fractions, counts): outside it, a value is a typo (or TOML's nan / inf), and it would turn
# into an infinite or NaN duration deep inside a model.
MIN_VALUE, MAX_VALUE = 1e-6, 1e7
# 0: absent / unmeasured
OPTIONAL_ZERO = ("nvls_busbw_GBps", "nvlink_a2a_busbw_GBps", "gemm_k_overhead", "gemm_mamf_k",
                 "comm_interference",
                 "sustained_clock_ratio_fp8", "attention_half_tiles", "gemm_occupancy_waves",
                 "peak_fp4_TFLOPs", "gemm_efficiency_fp4", "gemm_efficiency_mxfp8",
                 "site_gpus", "site_Gbps_per_gpu", "site_latency_us", "site_window_MiB",
                 "host_link_GBps",
                 "host_cpu_GBps", "gpus_per_host", "host_memory_GiB")


def _problems(s: SystemSpec) -> list[str]:
    out: list[str] = []
    sections: tuple[Any, ...] = (s.gpu, s.node, s.scaleout)
    for section in sections:
        for field in dataclasses.fields(section):
            v = getattr(section, field.name)
            if not isinstance(v, int | float) or isinstance(v, bool):
                continue
            if not math.isfinite(v) or abs(v) > MAX_VALUE or 0 < abs(v) < MIN_VALUE:
                out.append(f"{field.name} = {v} is no hardware figure (a finite number between "
                           f"{MIN_VALUE:g} and {MAX_VALUE:g} in the units its name gives)")
            elif v <= 0 and not (field.name in OPTIONAL_ZERO and v == 0):
                out.append(f"{field.name} must be ≥ 0 (0: absent or not modelled), got {v}"
                           if field.name in OPTIONAL_ZERO else
                           f"{field.name} must be positive, got {v}")
    fractions: tuple[tuple[Any, str], ...] = (
        (s.gpu, "gemm_efficiency"), (s.gpu, "gemm_efficiency_fp8"), (s.gpu, "gemm_efficiency_fp4"),
        (s.gpu, "gemm_efficiency_mxfp8"),
        (s.gpu, "attention_efficiency"), (s.gpu, "memory_efficiency"),
        (s.gpu, "sustained_clock_ratio"), (s.gpu, "sustained_clock_ratio_fp8"),
        (s.node, "nvlink_efficiency"),
        (s.scaleout, "nic_efficiency"))
    for section, name in fractions:
        if getattr(section, name) > 1:
            out.append(f"{name} is a fraction in (0, 1], got {getattr(section, name)}")
    if bool(s.gpu.peak_fp4_TFLOPs) != bool(s.gpu.gemm_efficiency_fp4):
        out.append("peak_fp4_TFLOPs and gemm_efficiency_fp4 go together (an FP4 peak needs the "
                   "efficiency its GEMMs reach, and the efficiency a peak): give both or neither")
    if s.gpu.gemm_k_overhead > 0 and s.gpu.gemm_mamf_k <= 0:
        out.append("gemm_k_overhead needs gemm_mamf_k, the K of the MAMF's best shape (where "
                   "gemm_efficiency was measured)")
    if s.node.gpus_per_host and (not isinstance(s.node.gpus_per_host, int)
                                 or s.node.gpus_per_node % s.node.gpus_per_host):
        out.append(f"gpus_per_host = {s.node.gpus_per_host} must divide gpus_per_node = "
                   f"{s.node.gpus_per_node} (hosts hold whole parts of an NVLink domain)")
    if s.scaleout.topology not in ("fat-tree", "rail-optimized"):
        out.append(f"topology must be 'fat-tree' or 'rail-optimized', got {s.scaleout.topology!r}")
    if s.scaleout.oversubscription < 1:
        out.append(f"oversubscription is ≥ 1 (1 = non-blocking), got {s.scaleout.oversubscription}")
    return out + _site_problems(s.scaleout, s.node.gpus_per_node)


def _site_problems(out: ScaleOutSpec, gpus_per_node: int) -> list[str]:
    """Sites hold whole nodes, and their links need a bandwidth; without sites, no site links."""
    if not out.site_gpus:
        return [f"{k} needs site_gpus (the GPUs a site holds); set it, or {k} = 0 for one site"
                for k in ("site_Gbps_per_gpu", "site_latency_us", "site_window_MiB")
                if getattr(out, k)]
    problems = []
    if out.site_window_MiB and not out.site_latency_us:
        problems.append("site_window_MiB needs site_latency_us: a window limits a flow over "
                        "the round trip between the sites")
    if not isinstance(out.site_gpus, int) or out.site_gpus % gpus_per_node:
        problems.append(f"site_gpus = {out.site_gpus} must be a whole number of nodes "
                        f"({gpus_per_node} GPUs each)")
    if not out.site_Gbps_per_gpu:
        problems.append("site_gpus needs site_Gbps_per_gpu, the bandwidth between the sites a "
                        "GPU gets (their links' total over a site's GPUs), in Gb/s")
    return problems


def on_sites_of(other: SystemSpec, base: SystemSpec) -> SystemSpec:
    """``other`` (a mixed cluster's other generation) on ``base``'s sites: sites are where the
    cluster's GPUs stand, by rank, whichever generation they are, so a system without site keys
    of its own takes ``base``'s (its groups and sends that cross a site boundary then pay the
    links between the sites, as the base system's do). A system with its own sites, or a base
    of one site, leaves ``other`` as it is."""
    if not base.scaleout.site_gpus or other.scaleout.site_gpus:
        return other
    b = base.scaleout
    return dataclasses.replace(other, scaleout=dataclasses.replace(
        other.scaleout, site_gpus=b.site_gpus, site_Gbps_per_gpu=b.site_Gbps_per_gpu,
        site_latency_us=b.site_latency_us, site_window_MiB=b.site_window_MiB))


def system_names() -> list[str]:
    return sorted(p.name.removesuffix(".toml") for p in resources.files("replay.systems").iterdir()
                  if p.name.endswith(".toml"))


def get_system(name: str) -> SystemSpec:
    return SystemSpec.from_dict(tomllib.loads(preset_system_text(name)), name=name)


def preset_system_text(name: str) -> str:
    """A preset system's TOML file as shipped, its constants' evidence in its comments: the
    start of a file for another cluster (``trainsim systems NAME``)."""
    f = resources.files("replay.systems").joinpath(f"{name}.toml")
    if not f.is_file():
        names = system_names()
        raise ConfigError(f"no preset system named {name!r}; {did_you_mean(name, names)}presets: "
                          f"{', '.join(names)} (or pass a TOML system file)", what="system")
    return f.read_text("utf-8")


def resolve_system(name_or_file: str | Path) -> SystemSpec:
    """A preset name, a TOML system file, or either with ``@KERNEL`` appended: the system with
    an earlier attention kernel (``dgx-h100@flashattention-2``; replay/attention_kernels.py)."""
    s = str(name_or_file)
    if s in system_names():
        return get_system(s)
    if s.endswith(".toml") or Path(s).exists():
        p = Path(s)
        return SystemSpec.from_dict(load_mapping(p, what="system file"), name=p.stem,
                                    source=str(p))
    if "@" in s:
        from replay.attention_kernels import with_attention_kernel  # it imports this module

        base, _, kernel = s.rpartition("@")
        return dataclasses.replace(with_attention_kernel(resolve_system(base), kernel), name=s)
    return get_system(s)


GPU_ALIASES = {"h100-sxm": "dgx-h100", "h800": "dgx-h800", "h200": "hgx-h200",
               "a100-80gb": "dgx-a100-80gb", "a100-40gb": "dgx-a100-40gb", "b200": "dgx-b200",
               "mi300x": "mi300x", "v100-32gb": "dgx1-v100", "a800": "dgx-a800",
               "gb200": "gb200-nvl72", "gb300": "gb300-nvl72"}
