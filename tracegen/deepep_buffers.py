"""The memory DeepEP's normal (high-throughput) kernels hold on every rank of a MoE stage.

Megatron-Core's flex dispatcher (``megatron/core/transformer/moe/fused_a2a.py``, ``get_buffer``)
allocates one ``deep_ep.Buffer`` for its expert-tensor-and-expert-parallel group, sized by the
larger of the dispatch and combine configs' size hints for that group size, with
``hidden_bytes = hidden × max(element size, 2)`` (2: BF16, and FP8 inputs count as 2). The
hints are DeepEP's ``Config::get_nvl_buffer_size_hint`` and ``get_rdma_buffer_size_hint``
(deepseek-ai/DeepEP ``csrc/config.hpp``): per channel (``num_sms / 2``) and per peer, a ring of
``num_max_*_chunked_recv_tokens`` slots, each a token's hidden bytes, an 8-byte source record
(``internode::SourceMeta``, two ints), 128 top-k indices (int64 in the NVLink buffer) and 128
weights and 128 scales (float); the RDMA buffer holds a send and a receive copy, a 16-byte
control word per slot, and 1 MiB more. The configs per group size are ``Buffer.get_dispatch_config``
and ``get_combine_config`` (``deep_ep/buffer.py``, the table of 2 to 160 ranks); Megatron-Core
gives DeepEP 20 SMs (``--moe-deepep-num-sms``, default 20). The NVLink buffer is ``cudaMalloc``ed
for IPC and the RDMA one comes from NVSHMEM's symmetric heap, which ``Buffer`` makes map
physical memory in 2^29-byte pieces (``NVSHMEM_CUMEM_GRANULARITY``): neither goes through
PyTorch's caching allocator, so they add to the runtime allowance, not to its fragmentation.
"""

from __future__ import annotations

import bisect

NUM_MAX_NVL_PEERS = 8  # DeepEP: ranks one NVLink domain holds (kernels/configs.cuh)
NUM_SMS = 20  # Megatron-Core --moe-deepep-num-sms default
MAX_TOPK, MAX_SCALES = 128, 128  # config.hpp kNumMaxTopK, kNumMaxScales
SOURCE_META_BYTES = 8  # internode::SourceMeta: two ints
NVSHMEM_GRANULARITY_BYTES = 2**29  # deep_ep/buffer.py sets NVSHMEM_CUMEM_GRANULARITY

# group size: ((nvl recv tokens, rdma send tokens, rdma recv tokens) of the dispatch config,
# the same of the combine config); DeepEP deep_ep/buffer.py get_dispatch_config /
# get_combine_config (the NVLink send-chunk sizes do not size a buffer)
CONFIGS: dict[int, tuple[tuple[int, int, int], tuple[int, int, int]]] = {
    2: ((256, 6, 128), (256, 6, 128)),
    4: ((256, 6, 128), (256, 6, 128)),
    8: ((256, 6, 128), (256, 6, 128)),
    16: ((288, 20, 128), (288, 28, 128)),
    24: ((288, 32, 128), (288, 20, 128)),
    32: ((288, 32, 128), (288, 20, 128)),
    64: ((288, 28, 128), (288, 20, 128)),
    128: ((560, 32, 128), (560, 12, 128)),
    144: ((720, 12, 128), (720, 8, 128)),
    160: ((720, 12, 128), (720, 8, 128)),
}
_SIZES = sorted(CONFIGS)


def _config(ranks: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The table's configs for a group of ``ranks``; a size the table lacks (which DeepEP
    itself refuses) takes the next listed size's, and beyond the table its largest: the
    buffers a supported neighbour would hold, not DeepEP's own answer."""
    i = bisect.bisect_left(_SIZES, ranks)
    return CONFIGS[_SIZES[min(i, len(_SIZES) - 1)]]


def _align128(n: int) -> int:
    return -(-n // 128) * 128


def _slot_bytes(hidden_bytes: int) -> int:
    """One token slot of either buffer: hidden bytes, the source record, the top-k indices
    (int64) and weights (float), the scales (float)."""
    return hidden_bytes + SOURCE_META_BYTES + MAX_TOPK * (8 + 4) + MAX_SCALES * 4


def nvl_bytes(hidden_bytes: int, ranks: int, recv_tokens: int) -> int:
    """``Config::get_nvl_buffer_size_hint``."""
    rdma_ranks = max(ranks // NUM_MAX_NVL_PEERS, 1)
    nvl_ranks = min(ranks, NUM_MAX_NVL_PEERS)
    lanes = NUM_SMS // 2 * nvl_ranks
    return _align128(lanes * (2 * rdma_ranks + 3) * 4
                     + lanes * recv_tokens * _slot_bytes(hidden_bytes))


def rdma_bytes(hidden_bytes: int, ranks: int, send_tokens: int, recv_tokens: int) -> int:
    """``Config::get_rdma_buffer_size_hint``: 0 inside one NVLink domain. The receive slots
    are first rounded up to a multiple of the send chunk (the ``Config`` constructor)."""
    if ranks <= NUM_MAX_NVL_PEERS:
        return 0
    recv = -(-recv_tokens // send_tokens) * send_tokens
    lanes = NUM_SMS // 2 * (ranks // NUM_MAX_NVL_PEERS)
    slot = _slot_bytes(hidden_bytes) + 16  # and an int4 control word
    return _align128(lanes * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4 + lanes * recv * slot * 2
                     + 2**20)


def buffer_bytes(hidden_size: int, ranks: int) -> int:
    """Device bytes of the ``deep_ep.Buffer`` Megatron-Core allocates for a group of ``ranks``
    (expert tensor × expert parallel) and a model of ``hidden_size``: the NVLink buffer, and the
    RDMA one rounded up to NVSHMEM's mapping granularity. 0 for a group of one."""
    if ranks < 2:
        return 0
    hidden_bytes = hidden_size * 2
    nvl = rdma = 0
    for nvl_recv, rdma_send, rdma_recv in _config(ranks):
        nvl = max(nvl, nvl_bytes(hidden_bytes, ranks, nvl_recv))
        rdma = max(rdma, rdma_bytes(hidden_bytes, ranks, rdma_send, rdma_recv))
    return nvl + -(-rdma // NVSHMEM_GRANULARITY_BYTES) * NVSHMEM_GRANULARITY_BYTES
