"""Unit constants. Names carry units (``_ns``, ``_s``, ``_bytes``, ``_flop``); convert at edges."""

from __future__ import annotations

KB = 10**3
MB = 10**6
GB = 10**9
TB = 10**12
KiB = 2**10
MiB = 2**20
GiB = 2**30

NS_PER_S = 10**9
NS_PER_US = 10**3
TERA = 10**12

# Bytes per element of each training dtype. NVFP4 (NVIDIA, Blackwell): a 4-bit E2M1 value and
# an E4M3 scale shared by each 16 elements, 0.5 + 1/16 bytes (its tensor's FP32 scale aside).
# (an MXFP8 operand: its FP8 byte and an E8M0 scale byte a block of 32)
DTYPE_BYTES: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "nvfp4": 0.5625,
                                 "mxfp8": 1 + 1 / 32}
# Integer codes stored in trace attributes (``dtype`` attr); keep stable, replay reads them.
DTYPE_CODE: dict[str, int] = {"fp32": 0, "bf16": 1, "fp16": 2, "fp8": 3, "nvfp4": 4, "mxfp8": 5}
DTYPE_FROM_CODE: dict[int, str] = {v: k for k, v in DTYPE_CODE.items()}
# The precisions whose recipes run the linear layers' GEMMs narrower than 16 bits (the rest of
# the step in 16), and the dtypes those GEMMs carry.
LOW_PRECISION_GEMMS: tuple[str, ...] = ("fp8", "nvfp4", "mxfp8")
