"""Attention kernels of earlier software stacks, per GPU architecture: what a published run used is
a property of its stack, which the runs schema does not record. The system presets model the best
kernel available now (FlashAttention-2 on Ampere; on Hopper causal cuDNN 9.19, as trainsim measured
it on an H200 — at least as fast as FlashAttention-3's published causal line at every length
that line gives); a kernel named here
replaces the preset's attention curve with that kernel's published one, so ``trainsim validate
--attention flashattention-1`` describes a 2022-23 stack in one word instead of four constants.

Each curve cites its measurement. A kernel with no published curve on a GPU is refused, never
extrapolated. On Hopper every curve also takes the occupancy term trainsim measured there (a
call's query tiles; ``GPUSpec.attention_half_tiles``), the charts' head-dim ratios converted to
per-tile ones (``_hopper_chart``):

* ``unfused`` — the score and value GEMMs over the whole s×s matrix with Megatron's fused softmax
  (Megatron-LM 2021-22; Korthikanti et al. 2022 §4.1): ``flash_attention = false``, costed from
  first principles on every GPU (replay/compute.py).
* ``flashattention-1`` — Ampere only (FlashAttention runs on Turing/Ampere; its Hopper port came as
  FlashAttention-2). Dao 2023 (arXiv:2307.08691, abstract): FlashAttention reaches 25-40% of the
  A100's peak, FlashAttention-2 50-73% and "around 2× speedup compared to FlashAttention": the
  FlashAttention-2 curve at half its efficiency. Tri Dao's 2022 Triton kernel (MosaicML's
  ``attn_impl: triton``) is "slightly slower than CUDA" forward + backward: the same class.
* ``flashattention-2`` — Ampere: the preset's own curve. Hopper: the FlashAttention-2 line of the
  FlashAttention-3 paper's causal forward charts (Shah et al. 2024, H100 SXM5): 191 / 260 / 298 /
  319 / 333 / 335 TFLOP/s from 512 to 16K tokens at head dim 128, ≈ 0.345 · s/(s + 300) of the
  peak, and 299 / 298 TFLOP/s at head dim 64 / 256 (ratios 0.893, 0.890 to 128).
* ``flashattention-3`` — Hopper only: the FlashAttention-3 line of the same causal charts, 292 at
  512 tokens and 616 TFLOP/s at 16K (head dim 128), ≈ 0.646 · s/(s + 608) of the peak through
  those two points; 473 / 642 at head dim 64 / 256 (ratios 0.768, 1.042). (The presets carried
  pytorch/benchmark's FlashAttention-3 run, 430 → 621 TFLOP/s, until the eleventh session: that
  run's 430 at 512 tokens is no causal figure — the paper's own causal chart gives 292 there and
  its non-causal one 467 — so it had overstated causal attention at short lengths.)
* ``cudnn`` — Hopper: cuDNN's fused attention, what Transformer Engine (Megatron-Core, NeMo)
  runs there. The cuDNN line of the same charts: 315 / 410 / 484 / 518 / 529 / 539 TFLOP/s from
  512 to 16K tokens at head dim 128, ≈ 0.5576 · s/(s + 385) of the peak (through the 512 and
  16K points, within 4% between), and 388 at head dim 64 (ratio 0.720 to 128). No causal BF16
  chart gives head dim 256: the ratio is held at 128's (1), the rule for head dims beyond a
  curve's measurements. That is cuDNN as of mid-2024 (NeMo 24.07's stack).
* ``cudnn-9.19`` — Hopper: the presets' own curve, by name: cuDNN 9.19's fused attention
  (PyTorch 2.11's SDPA cuDNN backend) as
  ``bench/device/measure_hopper.py`` measured it on an H200 on 2026-11-30 (its results under
  ``bench/device/results/``), the newest stack's kernel (Megatron-Bridge 25.11 and later):
  causal forward at head dim 128, 16 K tokens per call, 353 / 458 / 537 / 590 / 621 / 631
  TFLOP/s from 512 to 16K tokens (run 4; runs 5, 6 within 1%), and over head dim × sequence
  × heads (run 6): 0.664 · s/(s + 461), head-dim ratios 0.699 / 1.128 and the occupancy term
  T/(T + 188) of a call's query tiles, fitted jointly to 114 calls (systems/README.md); the
  backward/forward ratio at head dim 64 and 256 is 1.093 / 0.761 of 128's (96 calls).
"""

from __future__ import annotations

from typing import Any

from replay.hardware import SystemSpec, tile_occupancy
from tracegen.errors import ConfigError

AMPERE = ("a100-40gb", "a100-80gb", "a800")
HOPPER = ("h100-sxm", "h800", "h200")
# A curve is the system values it sets, as (section.key, value) pairs; () keeps the preset's.
Curve = tuple[tuple[str, Any], ...]
PRESET: Curve = ()
# The Hopper charts were read at 16K tokens and hidden 2048 per call: 2,048 query tiles at head
# dim 128, 4,096 at 64 and 1,024 at 256. Their head-dim ratios are turned into per-tile ones by
# the occupancy term the presets measured (T₀ 188; FlashAttention-2's own five points give 169):
# ratio / o(4096) at 64, ratio / o(1024) at 256 (o = GPUSpec.attention_occupancy).
HOPPER_HALF_TILES = 188
_O64, _O256 = (tile_occupancy(tiles, HOPPER_HALF_TILES) for tiles in (4096, 1024))


def _hopper_chart(eff: float, half_seq: float, at64: float, at256: float) -> Curve:
    """A Hopper chart curve with the presets' occupancy term and per-tile head-dim ratios."""
    return (("gpu.attention_efficiency", eff), ("gpu.attention_half_seq", half_seq),
            ("gpu.attention_hdim64_ratio", round(at64 / _O64, 4)),
            ("gpu.attention_hdim256_ratio", round(at256 / _O256, 4) if at256 != 1.0 else 1.0),
            ("gpu.attention_bwd_hdim64_ratio", 1.0), ("gpu.attention_bwd_hdim256_ratio", 1.0),
            ("gpu.attention_half_tiles", HOPPER_HALF_TILES))


_FA2_HOPPER = _hopper_chart(0.345, 300, 0.893, 0.890)
_CUDNN_HOPPER = _hopper_chart(0.5576, 385, 0.720, 1.0)  # no chart at 256: held at 128's
_FA3_HOPPER = _hopper_chart(0.646, 608, 0.768, 1.042)
_CUDNN919_HOPPER: Curve = (("gpu.attention_efficiency", 0.664), ("gpu.attention_half_seq", 461),
                          ("gpu.attention_hdim64_ratio", 0.699),
                          ("gpu.attention_hdim256_ratio", 1.128),
                          ("gpu.attention_bwd_hdim64_ratio", 1.093),
                          ("gpu.attention_bwd_hdim256_ratio", 0.761),
                          ("gpu.attention_half_tiles", HOPPER_HALF_TILES))
# Half of the Ampere presets' FlashAttention-2 efficiency (0.65 in their system files).
_FA1_AMPERE: Curve = (("gpu.attention_efficiency", 0.325),)

KERNELS: dict[str, dict[str, Curve]] = {
    "unfused": {"*": (("gpu.flash_attention", False),)},
    "flashattention-1": dict.fromkeys(AMPERE, _FA1_AMPERE),
    "flashattention-2": {**dict.fromkeys(AMPERE, PRESET), **dict.fromkeys(HOPPER, _FA2_HOPPER)},
    "flashattention-3": dict.fromkeys(HOPPER, _FA3_HOPPER),
    "cudnn": dict.fromkeys(HOPPER, _CUDNN_HOPPER),
    "cudnn-9.19": dict.fromkeys(HOPPER, _CUDNN919_HOPPER),
}


def kernel_overrides(kernel: str, gpu: str) -> dict[str, Any]:
    """The system values that give ``gpu`` the attention of ``kernel``; ConfigError where the
    kernel is unknown or has no published curve on that GPU."""
    if kernel not in KERNELS:
        raise ConfigError(f"unknown attention kernel {kernel!r}; one of {', '.join(KERNELS)}",
                          what="attention kernel")
    curves = KERNELS[kernel]
    if "*" in curves:
        return dict(curves["*"])
    if gpu not in curves:
        raise ConfigError(f"{kernel} has no published curve on {gpu} (it has on "
                          f"{', '.join(curves)}); describe the kernel with --set gpu."
                          "attention_efficiency=… if you have a measurement",
                          what="attention kernel")
    return dict(curves[gpu])


def with_attention_kernel(system: SystemSpec, kernel: str) -> SystemSpec:
    """``system`` with the attention of ``kernel`` (``kernel_overrides``)."""
    over = kernel_overrides(kernel, system.gpu.name)
    return system.with_overrides(over) if over else system
