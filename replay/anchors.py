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

# 8 H100s in one host, all-gather and reduce-scatter of the largest messages (MiB: the gathered
# output, and the reduce-scatter's full input) as OpenXLA measured them for its collective cost
# model: xla/service/gpu/model/collective_interpolator_data.h (kDefaultCollectivePTable, "sm_90",
# one replica group of 8; 2025), network_throughput_bytes_per_sec / 1e9 = those bytes / time.
# The same table's all-reduce is 18% below the nccl-tests sweep above (393 vs 473 GB/s bus
# bandwidth at 2 GiB: no NVLS), so it documents a slower NCCL setting than NVIDIA's own runs.
# nccl-tests all-to-all bus bandwidth (algbw · (n−1)/n) inside one NVLink domain, GB/s: the
# NVIDIA GTC24 S62129 / GTC25 S72583 summary slides as ANCHORS.md reproduces them (8 GPUs; GB200
# NVL72 at 32), and the same slides' all-reduce busbw for the NVLink tier they are set beside.
NODE_ALL_TO_ALL_BUSBW_GBPS: dict[str, float] = {
    "dgx-a100-80gb": 210.0, "dgx-h100": 320.0, "dgx-b200": 640.0, "gb200-nvl72": 640.0}
NODE_ALL_REDUCE_BUSBW_GBPS: dict[str, float] = {
    "dgx-a100-80gb": 232.0, "dgx-h100": 370.0, "dgx-b200": 700.0, "gb200-nvl72": 680.0}

XLA_H100_ALL_GATHER_GBPS: dict[int, float] = {512: 384.03, 1024: 391.04, 2048: 400.12}
XLA_H100_REDUCE_SCATTER_GBPS: dict[int, float] = {256: 347.90, 512: 359.21, 1024: 364.92,
                                                  2048: 373.84}
