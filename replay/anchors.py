"""Published measurements the network model is checked against (see ../shared/validation/
ANCHORS.md for the full tables and their sources)."""

from __future__ import annotations

# DGX H100 (8 GPUs, one host), nccl-tests all_reduce, out-of-place bus bandwidth in GB/s by
# message size in MiB: the sample output in NVIDIA/dgxc-benchmarking nccl/README.md. Above
# ~64 MiB NCCL uses NVLS (NVLink SHARP): ``replay.nccl.nvls_time``.
DGX_H100_ALL_REDUCE_BUSBW_GBPS: dict[int, float] = {
    1: 67.0, 4: 135.4, 16: 237.2, 64: 361.7, 128: 400.5, 256: 422.3, 512: 436.8, 1024: 466.3,
    2048: 473.4, 4096: 477.2, 8192: 480.2, 16384: 479.9,
}
