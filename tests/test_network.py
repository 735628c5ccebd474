"""The collective model against published measurements and its own closed forms."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay import get_system, nccl
from replay.anchors import (
    DGX_H100_ALL_REDUCE_BUSBW_GBPS,
    NODE_ALL_REDUCE_BUSBW_GBPS,
    NODE_ALL_TO_ALL_BUSBW_GBPS,
    XLA_H100_ALL_GATHER_GBPS,
    XLA_H100_REDUCE_SCATTER_GBPS,
)
from replay.hardware import SystemSpec
from replay.network import AlphaBetaNetwork

H100 = AlphaBetaNetwork(get_system("dgx-h100"))
NODE = tuple(range(8))
MiB = 2**20


def _busbw_GBps(net: AlphaBetaNetwork, coll: str, size: int, ranks: tuple[int, ...]) -> float:
    """nccl-tests' bus bandwidth: all-reduce algbw × 2(p−1)/p."""
    p = len(ranks)
    t = net.collective(coll, size, ranks).total_ns * 1e-9
    return 2 * (p - 1) / p * size / t / 1e9


DGXC_H100 = DGX_H100_ALL_REDUCE_BUSBW_GBPS


@pytest.mark.parametrize("mib", [1, 4, 16])
def test_all_reduce_ramp_matches_the_dgx_h100_sweep(mib: int) -> None:
    """Below the sizes where NVLS takes over, NCCL's protocol choice reproduces the measured
    growth of bus bandwidth with message size (within 25%; the old fixed-latency model gave
    319 GB/s at 16 MiB against 237 measured)."""
    got = _busbw_GBps(H100, "ALL_REDUCE", mib * MiB, NODE)
    assert got == pytest.approx(DGXC_H100[mib], rel=0.25)


@pytest.mark.parametrize("mib", [64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384])
def test_nvls_all_reduce_matches_the_sweep_above_64_mib(mib: int) -> None:
    """Above ~64 MiB NCCL switches to NVLS (NVLink SHARP) on H100: a 90 µs start-up (fitted to
    this region of the sweep) and the 480 GB/s plateau of the GTC slides, an independent
    source, reproduce every point within 6%."""
    got = _busbw_GBps(H100, "ALL_REDUCE", mib * MiB, NODE)
    assert got == pytest.approx(DGXC_H100[mib], rel=0.06)


def test_ring_plateau_where_there_is_no_nvls() -> None:
    """An A100 node has no NVLink SHARP: large all-reduces reach the ring anchor (232 GB/s),
    and reduce-scatter on H100 (NVLS modelled for all-reduce only) its ring plateau (370)."""
    a100 = AlphaBetaNetwork(get_system("dgx-a100-80gb"))
    assert _busbw_GBps(a100, "ALL_REDUCE", 16384 * MiB, NODE) == pytest.approx(232, rel=0.01)
    t = H100.collective("REDUCE_SCATTER", 16384 * MiB, NODE).total_ns * 1e-9
    assert 7 / 8 * 16384 * MiB / t / 1e9 == pytest.approx(370, rel=0.01)


@pytest.mark.parametrize(("coll", "mib"), [("ALL_GATHER", m) for m in XLA_H100_ALL_GATHER_GBPS]
                         + [("REDUCE_SCATTER", m) for m in XLA_H100_REDUCE_SCATTER_GBPS])
def test_gather_and_scatter_against_xla_measurements(coll: str, mib: int) -> None:
    """All-gather (trace size: one rank's shard) and reduce-scatter (the full input) on 8 H100s
    against OpenXLA's measured table: the model runs them at the ring plateau of NVIDIA's
    all-reduce slides (370 GB/s bus bandwidth), 4–6% (all-gather) and 12–16% (reduce-scatter)
    faster than XLA measured. Kept, not refitted: the same table's all-reduce is 18% below
    NVIDIA's nccl-tests run of the same node (replay/anchors.py), i.e. a slower NCCL setting."""
    measured = (XLA_H100_ALL_GATHER_GBPS if coll == "ALL_GATHER" else
                XLA_H100_REDUCE_SCATTER_GBPS)[mib]
    size = mib * MiB // 8 if coll == "ALL_GATHER" else mib * MiB
    t = H100.collective(coll, size, NODE).total_ns * 1e-9
    ratio = mib * MiB / t / 1e9 / measured
    assert 1.0 < ratio < 1.2


def test_nvls_stays_inside_a_node() -> None:
    """NVLS is a property of one NVSwitch domain: a 2-node all-reduce costs the same with or
    without it."""
    import dataclasses

    base = get_system("dgx-h100")
    plain = dataclasses.replace(base, node=dataclasses.replace(base.node, nvls_busbw_GBps=0.0))
    ranks = tuple(range(16))
    with_nvls = H100.collective("ALL_REDUCE", 1024 * MiB, ranks).total_ns
    assert with_nvls == AlphaBetaNetwork(plain).collective("ALL_REDUCE", 1024 * MiB,
                                                          ranks).total_ns


def test_latency_floor() -> None:
    """An 8-byte all-reduce on 8 GPUs: ~13 µs measured (ANCHORS); NCCL's LL ring gives
    6.6 + 14 × 0.6 = 15 µs."""
    t_us = H100.collective("ALL_REDUCE", 8, NODE).total_ns / 1e3
    assert 10 <= t_us <= 20


def test_protocols_by_size() -> None:
    """LL wins tiny messages, LL128 the middle, Simple the largest (NCCL's tuner)."""
    bus = 370e9

    def best(nbytes: float) -> str:
        times = {pr.name: sum(nccl.ring_time("ALL_REDUCE", nbytes, 8, 1, bus, pr))
                 for pr in nccl.PROTOCOLS}
        return min(times, key=lambda k: times[k])

    assert best(1024) == "LL"
    assert best(16 * MiB) == "LL128"
    assert best(4096 * MiB) == "Simple"


def test_two_level_closed_form() -> None:
    """Two nodes of 8: reduce-scatter and all-gather on NVLink, all-reduce of S/8 on the NICs,
    in sequence (large message: Simple ring bandwidth terms only)."""
    sys = get_system("dgx-a100-80gb")
    net = AlphaBetaNetwork(sys)
    size = 8 * 2**30
    ranks = tuple(range(16))
    b_nvl = sys.node.nvlink_GBps * 1e9 * sys.node.nvlink_efficiency
    b_nic = sys.scaleout.nic_Gbps_per_gpu / 8 * 1e9 * sys.scaleout.nic_efficiency
    xfer = 2 * 7 / 8 * size / b_nvl + 2 * 1 / 2 * size / 8 / b_nic
    got = net.collective("ALL_REDUCE", size, ranks)
    assert got.transfer_ns * 1e-9 == pytest.approx(xfer, rel=1e-6)


@settings(max_examples=60, deadline=None)
@given(a=st.integers(1, 2**34), b=st.integers(1, 2**34),
       coll=st.sampled_from(["ALL_REDUCE", "REDUCE_SCATTER", "ALL_GATHER"]),
       nodes=st.sampled_from([1, 2, 4, 16]))
def test_bigger_messages_never_finish_sooner(a: int, b: int, coll: str, nodes: int) -> None:
    """Time grows with size, and bus bandwidth never falls as messages grow."""
    lo, hi = sorted((a, b))
    ranks = tuple(range(8 * nodes))
    t_lo = H100.collective(coll, lo, ranks).total_ns
    t_hi = H100.collective(coll, hi, ranks).total_ns
    assert t_lo <= t_hi
    assert lo / max(t_lo, 1) <= hi / max(t_hi, 1) * (1 + 1e-6) + 1e-9


def test_ramp_plot_has_model_line_and_measured_points() -> None:
    from analysis.plots import collective_ramp

    fig = collective_ramp(get_system("dgx-h100"), measured=DGX_H100_ALL_REDUCE_BUSBW_GBPS)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and len(ax.lines) == 1
    assert len(ax.collections[0].get_offsets()) == len(DGX_H100_ALL_REDUCE_BUSBW_GBPS)
    ys = ax.lines[0].get_ydata()
    assert all(b >= a - 1e-9 for a, b in itertools.pairwise(ys))  # never falls with size


def test_one_rank_per_node_ring_crosses_nodes_at_every_step() -> None:
    """p ranks on p nodes: every step of the ring is a network hop (Simple: 8.4 + 2(p−1)·14 µs)."""
    lat, _ = nccl.ring_time("ALL_REDUCE", 2**30, 16, 16, 50e9, nccl.SIMPLE)
    assert lat == pytest.approx((8.4 + 2 * 15 * 14.0) * 1e-6)
    lat, _ = nccl.ring_time("ALL_GATHER", 2**30, 16, 16, 50e9, nccl.SIMPLE)
    assert lat == pytest.approx((8.4 + 15 * 14.0) * 1e-6)


@settings(max_examples=300, deadline=None)
@given(start=st.integers(0, 64), step=st.integers(1, 40), count=st.integers(1, 300),
       gpn=st.sampled_from([1, 2, 4, 8, 16]), split=st.integers(1, 4))
def test_shape_of_arithmetic_runs_equals_the_rank_by_rank_shape(
        start: int, step: int, count: int, gpn: int, split: int) -> None:
    """``ranges_shape`` (the fast path's: first, second and last node of a run) gives what
    ``group_shape`` gives visiting every rank, for one run and for a group cut into runs."""
    from replay.network import group_shape, ranges_shape

    rg = range(start, start + step * count, step)
    ranks = tuple(rg)
    assert ranges_shape([rg], gpn) == group_shape(ranks, gpn)
    cut = max(1, count // split)
    runs = [rg[i:i + cut] for i in range(0, count, cut)]
    assert ranges_shape(runs, gpn) == group_shape(ranks, gpn)


@pytest.mark.parametrize("system", sorted(NODE_ALL_TO_ALL_BUSBW_GBPS))
def test_all_to_all_inside_a_node_at_its_measured_bus_bandwidth(system: str) -> None:
    """NCCL's all-to-all reaches less of NVLink than its all-reduce ring (nccl-tests summary
    slides, ANCHORS): a large all-to-all over 8 GPUs of one domain runs at the slides'
    all-to-all busbw (algbw · (n−1)/n) within 1% (its latency the rest), where the all-reduce
    tier would give the all-reduce's; without the figure (0) the all-to-all falls back to that
    tier, as before; a link scenario at half speed halves it."""
    import dataclasses

    from replay.scenario import tiers_slowed

    spec = get_system(system)
    ranks, size = NODE, 1 << 30

    def a2a_busbw(s: SystemSpec) -> float:
        t = AlphaBetaNetwork(s).collective("ALL_TO_ALL", size, ranks).total_ns * 1e-9
        return (len(ranks) - 1) / len(ranks) * size / t / 1e9

    assert a2a_busbw(spec) == pytest.approx(NODE_ALL_TO_ALL_BUSBW_GBPS[system], rel=0.01)
    tier = spec.node.nvlink_GBps * spec.node.nvlink_efficiency
    assert tier == pytest.approx(NODE_ALL_REDUCE_BUSBW_GBPS[system], rel=0.01)
    unmeasured = dataclasses.replace(spec, node=dataclasses.replace(
        spec.node, nvlink_a2a_busbw_GBps=0.0))
    assert a2a_busbw(unmeasured) == pytest.approx(tier, rel=0.01)
    assert a2a_busbw(tiers_slowed(spec, 1.0, 0.5)) == pytest.approx(
        a2a_busbw(spec) / 2, rel=0.01)
