"""Traces written by others: mlc-chakra's chakra_generator microbenchmarks, and ASTRA-sim's
analytical result for the 8-NPU 1 MiB ring all-reduce."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from chakra.src.generator import generator as gen

from replay import SystemSpec, get_system, replay
from replay.network import AlphaBetaNetwork
from replay.traceset import load_trace_set
from tracegen.errors import ReplayError, TraceFormatError

# ASTRA-sim's examples/network_analytical run (astra-sim-docs, getting-started): AllReduce_1MB on
# 8 NPUs, Ring topology, 50 GB/s, 500 ns links, preferred-dataset-splits 4, local-mem-bw 1600:
# "sys[0] finished, 64440 cycles" (1 cycle = 1 ns).
ASTRA_AR_1MB_8NPU_NS = 64_440

ASTRA_SYSTEM = {
    "name": "astra-ring-8",
    "gpu": {"name": "npu", "peak_bf16_TFLOPs": 1, "peak_fp16_TFLOPs": 1, "peak_fp8_TFLOPs": 1,
            "peak_fp32_TFLOPs": 1, "hbm_GiB": 1, "hbm_GBps": 1, "sm_count": 1,
            "gemm_efficiency": 1, "gemm_efficiency_fp8": 1, "attention_efficiency": 1,
            "attention_half_seq": 1, "memory_efficiency": 1, "launch_overhead_us": 0.001},
    "node": {"gpus_per_node": 8, "nvlink_GBps": 50, "nvlink_efficiency": 1.0,
             "nvlink_latency_us": 0.5},
    "scaleout": {"nic_Gbps_per_gpu": 400, "nic_efficiency": 1.0, "latency_us": 0.5},
    "astra": {"preferred_dataset_splits": 4, "local_mem_bw_GBps": 1600},
}


@pytest.fixture
def in_tmp(tmp_path: Path):  # type: ignore[no-untyped-def]
    old = Path.cwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(old)


def test_astra_compat_ring_all_reduce_matches_astra_sim(in_tmp: Path) -> None:
    gen.one_comm_coll_node_allreduce(8, 1 << 20)
    res = replay(in_tmp / "ALL_REDUCE", SystemSpec.from_dict(ASTRA_SYSTEM), astra_compat=True)
    step_ns = res.step_time_s * 1e9
    assert step_ns == pytest.approx(ASTRA_AR_1MB_8NPU_NS, rel=0.05)
    assert step_ns == pytest.approx(ASTRA_AR_1MB_8NPU_NS, rel=0.005)  # 64,317 ns: 0.19% below


SUPPORTED = {
    "one_metadata_node_all_types": lambda n: gen.one_metadata_node_all_types(n),
    "one_comp_node": lambda n: gen.one_comp_node(n, 5),
    "two_comp_nodes_independent": lambda n: gen.two_comp_nodes_independent(n, 5),
    "two_comp_nodes_dependent": lambda n: gen.two_comp_nodes_dependent(n, 5),
    "ALL_REDUCE": lambda n: gen.one_comm_coll_node_allreduce(n, 65536),
    "ALL_TO_ALL": lambda n: gen.one_comm_coll_node_alltoall(n, 65536),
    "ALL_GATHER": lambda n: gen.one_comm_coll_node_allgather(n, 65536),
    "REDUCE_SCATTER": lambda n: gen.one_comm_coll_node_reducescatter(n, 65536),
    "BROADCAST": lambda n: gen.one_comm_coll_node_broadcast(n, 65536),
    "BARRIER": lambda n: gen.one_comm_coll_node_barrier(n),
}


@pytest.mark.parametrize("name", list(SUPPORTED))
@pytest.mark.parametrize("compute", ["trace", "model"])
def test_chakra_generator_microbenchmarks_replay(in_tmp: Path, name: str, compute: str) -> None:
    SUPPORTED[name](8)
    res = replay(in_tmp / name, "dgx-h100", compute=compute)  # type: ignore[arg-type]
    assert res.metrics["ranks"] == 8 and res.step_time_s >= 0
    if name == "two_comp_nodes_dependent" and compute == "trace":
        assert res.step_time_s == pytest.approx(10e-6)  # two dependent 5 µs nodes
    if name == "two_comp_nodes_independent" and compute == "trace":
        assert res.step_time_s == pytest.approx(10e-6)  # one compute stream
    if name in ("ALL_REDUCE", "ALL_GATHER", "REDUCE_SCATTER", "ALL_TO_ALL", "BROADCAST"):
        # one collective of the whole world and nothing else: the step is its cost under the
        # network model (65,536 bytes, ASTRA-sim's meaning of the size), to the nanosecond
        cost = AlphaBetaNetwork(get_system("dgx-h100")).collective(name, 65536, tuple(range(8)))
        assert res.step_time_s * 1e9 == pytest.approx(cost.total_ns, abs=1)
        assert cost.total_ns > 1000  # a real transfer: latency and bytes, not a zero


@pytest.mark.parametrize("astra", [False, True])
def test_default_group_is_the_world(in_tmp: Path, astra: bool) -> None:
    gen.one_comm_coll_node_allreduce(4, 1 << 20)
    ts = load_trace_set(in_tmp / "ALL_REDUCE")
    assert ts.groups == {}
    res = replay(ts, "dgx-h100", astra_compat=astra)
    assert res.timeline["start_s"].max() == 0.0  # all four started together


def test_mem_nodes_are_copies_over_the_host_link(in_tmp: Path) -> None:
    """Chakra's remote memory load generator: each rank's MEM_LOAD_NODE of ``tensor_size``
    bytes replays as a copy over its host link (DGX H100: PCIe Gen5, 55 GB/s each way); a
    system that gives no host link says so instead."""
    import dataclasses

    from replay import get_system

    gen.one_remote_mem_load_node(2, 1 << 20)
    ts = load_trace_set(in_tmp / "one_remote_mem_load_node")
    assert ts.num_nodes == 2
    res = replay(ts, "dgx-h100")
    assert res.step_time_s == pytest.approx((1 << 20) / 55e9, rel=1e-6)
    assert set(res.timeline["stream"]) == {"h2d"}
    assert (res.breakdown["exposed_comm_s"] == 0).all()  # a host copy is no communication
    base = get_system("dgx-h100")
    bare = dataclasses.replace(base, node=dataclasses.replace(base.node, host_link_GBps=0.0))
    with pytest.raises(ReplayError, match=r"MEM_LOAD_NODE.*set host_link_GBps"):
        replay(ts, bare)


def test_generator_send_without_destination_is_a_format_error(in_tmp: Path) -> None:
    gen.one_comm_send_node(2, 1024)
    with pytest.raises(TraceFormatError, match="COMM_SEND_NODE needs attribute 'comm_dst'"):
        load_trace_set(in_tmp / "one_comm_send_node")


@pytest.mark.parametrize(("tp", "pp", "zero"), [(1, 2, 0), (2, 2, 1)])
def test_astra_compat_pipelines_finish_with_sends_in_the_comm_slot(tmp_path: Path, tp: int,
                                                                   pp: int, zero: int) -> None:
    """ASTRA-sim gives a rank one communication slot for collectives and sends, but a receive
    takes none (``HardwareResource::occupy`` returns for COMM_RECV_NODE): posted at once, it
    cannot hold the slot against the send it waits for. Queued behind the slot instead, every
    pipeline's first backward receive stalled the stage's forward send (a deadlock before the
    thirty-first session). On each rank no two slot holders overlap; receives do."""
    from tracegen import ModelSpec, Strategy, generate

    model = ModelSpec(name="ac", num_layers=4, hidden_size=128, num_attention_heads=4,
                      ffn_hidden_size=512, vocab_size=256, seq_len=64)
    s = Strategy(tp=tp, pp=pp, dp=2, micro_batch_size=1, global_batch_size=8, zero_stage=zero,
                 sequence_parallel=tp > 1)
    generate(model, s, tmp_path, mode="full")
    res = replay(tmp_path, "dgx-h100", astra_compat=True)
    tl = res.timeline
    assert tl.height == load_trace_set(tmp_path, fold=False).num_nodes and res.step_time_s > 0
    recv = tl.filter(tl["kind"] == "COMM_RECV_NODE")
    assert recv.height and set(recv["stream"].to_list()) == {"p2p"}
    for rank in range(s.world_size):
        slot = tl.filter((tl["rank"] == rank) & (tl["stream"] == "comm")).sort("start_s")
        assert "COMM_SEND_NODE" in slot["kind"].to_list()
        starts, ends = slot["start_s"].to_list(), slot["end_s"].to_list()
        assert all(b >= a - 1e-12 for a, b in zip(ends, starts[1:], strict=False))
