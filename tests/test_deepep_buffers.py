"""DeepEP's communication buffers in the memory model (tracegen/deepep_buffers.py): DeepEP's
size hints worked by hand, where they apply (stages that run MoE layers through DeepEP) and
where not."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.fastpath import estimate
from replay import get_system
from tracegen import ModelSpec, Strategy, get_model
from tracegen import memory as mem
from tracegen.deepep_buffers import CONFIGS, _config, buffer_bytes, nvl_bytes, rdma_bytes

MIB = 2**20


def test_deepseek_v3_at_ep_64_worked_by_hand() -> None:
    """DeepSeek-V3 (hidden 7,168: 14,336 bytes a BF16 token) over 64 ranks, 20 SMs (10
    channels), DeepEP's configs for 64: NVLink 10 × 8 peers × 288 slots × (14,336 + 8 + 128·8
    + 128·4 + 128·4) bytes + 10·8·(2·8 + 3)·4 of counters = 377,677,760, aligned to 128:
    377,677,824. RDMA: the combine's 128 receive slots rounded to its 20-token sends (140),
    10 × 8 node peers × 140 × 2 copies × (14,336 + 8 + 1,536 + 512 + 16) + 10·8·18·2·4 + 1 MiB
    = 368,599,296 — one 512 MiB NVSHMEM piece."""
    assert nvl_bytes(14_336, 64, 288) == 377_677_824
    assert rdma_bytes(14_336, 64, 20, 128) == 368_599_296
    assert rdma_bytes(14_336, 64, 28, 128) == 368_599_296  # the dispatch's: align(128, 28) = 140
    assert buffer_bytes(7168, 64) == 377_677_824 + 512 * MIB


def test_inside_one_nvlink_domain_there_is_no_rdma_buffer() -> None:
    """Up to 8 ranks DeepEP runs its intranode kernels: the NVLink buffer alone
    (Qwen3's hidden 4,096: 10 channels × 8 × 256 slots × (8,192 + 8 + 2,048) bytes = 209,879,040,
    + 10·8·(2·1 + 3)·4 of counters = 209,880,640, aligned to 128)."""
    assert rdma_bytes(8192, 8, 6, 128) == 0
    assert buffer_bytes(4096, 8) == nvl_bytes(8192, 8, 256) == 209_880_704
    assert buffer_bytes(4096, 1) == 0  # no group to dispatch over


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 16).map(lambda k: k * 512), st.sampled_from(sorted(CONFIGS)),
       st.integers(1, 8).map(lambda k: k * 512))
def test_buffers_grow_with_the_token_and_are_at_least_a_slot_ring(h: int, ranks: int,
                                                                  more: int) -> None:
    """A wider token never needs less; each buffer holds at least its ring of hidden states."""
    assert buffer_bytes(h + more, ranks) >= buffer_bytes(h, ranks)
    recv = min(c[0] for c in CONFIGS[ranks])
    assert buffer_bytes(h, ranks) >= 10 * min(ranks, 8) * recv * 2 * h


def test_a_group_size_the_table_lacks_takes_the_next_listed() -> None:
    """48 ranks are sized with 64's configs, 256 with 160's (the largest); the peers are the
    group's own, so more ranks never hold less."""
    assert _config(48) == CONFIGS[64] and _config(256) == CONFIGS[160]
    assert _config(2) == CONFIGS[2] and _config(1) == CONFIGS[2]
    sizes = [buffer_bytes(7168, r) for r in (8, 16, 32, 48, 64, 128, 160, 256)]
    assert sizes == sorted(sizes)


MOE = ModelSpec(name="dep-buf", num_layers=4, hidden_size=1024, num_attention_heads=8,
                num_kv_heads=4, ffn_hidden_size=2048, vocab_size=4096, seq_len=1024,
                activation="swiglu", num_experts=64, experts_per_token=8,
                moe_ffn_hidden_size=512, first_dense_layers=2)


def _runtime(m: ModelSpec, s: Strategy) -> list[int]:
    return [mem.estimate(m, s, st_, 10**6).runtime_bytes for st_ in range(s.pp)]


def test_only_stages_running_moe_layers_through_deepep_hold_the_buffer() -> None:
    """Two dense first layers on stage 0, the MoE ones on stage 1: DeepEP's buffer (the group
    is expert-TP × EP: 2 × 8 = 16 ranks) lands on stage 1 only; the flat all-to-all holds none."""
    s = Strategy(tp=2, pp=2, dp=8, ep=8, micro_batch_size=1, global_batch_size=32,
                 sequence_parallel=True, moe_dispatcher="deepep")
    extra = buffer_bytes(1024, 16)
    assert extra > 0
    assert _runtime(MOE, s) == [mem.RUNTIME_BYTES, mem.RUNTIME_BYTES + extra]
    flat = dataclasses.replace(s, moe_dispatcher="alltoall")
    assert _runtime(MOE, flat) == [mem.RUNTIME_BYTES] * 2


def test_the_mtp_stage_holds_the_buffer_for_its_moe_layer() -> None:
    """The MTP module's layer is of the last layer's kind (MoE): a stage holding only it and
    the loss runs DeepEP too."""
    m = dataclasses.replace(MOE, mtp_layers=1)
    s = Strategy(tp=1, pp=2, dp=8, ep=8, micro_batch_size=1, global_batch_size=32,
                 moe_dispatcher="deepep", pipeline_layout="Ettt|tmL")
    assert _runtime(m, s)[1] == mem.RUNTIME_BYTES + buffer_bytes(1024, 8)
    dense_only = dataclasses.replace(s, pipeline_layout="Ett|ttmL")
    assert _runtime(m, dense_only)[0] == mem.RUNTIME_BYTES


def test_the_fast_path_counts_the_buffer_in_its_peak() -> None:
    """DeepSeek-V3 on 256 H100s (ep 64 across 8 nodes): the fast path's peak is the memory
    model's, DeepEP's 872 MiB included."""
    m = get_model("deepseek-v3")
    s = Strategy(tp=1, pp=4, dp=64, ep=64, micro_batch_size=1, global_batch_size=256,
                 recompute="full", zero_stage=1, last_stage_layers=16,
                 moe_dispatcher="deepep")
    got = estimate(m, s, get_system("dgx-h100"))
    flat = estimate(m, dataclasses.replace(s, moe_dispatcher="alltoall"), get_system("dgx-h100"))
    extra = (got.peak_memory_GiB - flat.peak_memory_GiB) * 2**30
    assert extra == pytest.approx(buffer_bytes(7168, 64), abs=1.0)
