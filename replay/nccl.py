"""NCCL's own cost model for ring and tree collectives, with our measured bus bandwidths.

NCCL picks, per call, the algorithm (ring; tree for all-reduce) and protocol (LL, LL128, Simple)
with the least predicted time ``latency + bytes / algorithm bandwidth``; its tuner's constants are
in NVIDIA/nccl ``src/graph/tuning.cc`` (v2.19-era values below). That choice is what makes a
collective's bus bandwidth grow with message size: LL (8-byte flag per 8 bytes) has the lowest
latency but a quarter of the bandwidth; Simple the highest latency and full bandwidth; LL128 sits
between. We keep NCCL's latencies and protocol bandwidth factors and put our calibrated plateau
bus bandwidth (ANCHORS nccl-tests, per system) where NCCL puts ``nChannels × per-channel speed``.

Ring over p ranks on n nodes (all-reduce: 2(p−1) steps, 2n of them across nodes; reduce-scatter
and all-gather: p−1 steps, n−1 across nodes):

    latency = base[proto] + (steps − inter)·max(hop_nvl[proto], net_overhead) + inter·hop_net[proto]
    time    = latency + bytes · steps / (p · busbw[proto])

Tree all-reduce: latency = base + 2·((ranks per node − 1)·hop_nvl + ⌈log₂ n⌉·hop_net), algorithm
bandwidth busbw/2. ``bytes`` is the whole buffer (all-gather: p × the per-rank shard), as in NCCL.

Checked against the DGX H100 nccl-tests sweep in ANCHORS (tests/test_network.py): the latency
floor (~13 µs measured, 15 µs here), the ramp at 1–16 MiB, and — on systems with NVLink SHARP —
NVLS all-reduce inside a node, which takes over above ~64 MiB (``nvls_time``).
"""

from __future__ import annotations

import dataclasses
import math

US = 1e-6


@dataclasses.dataclass(frozen=True, slots=True)
class Proto:
    """One protocol's constants from NCCL's tuner (µs and bandwidth factors)."""

    name: str
    ring_base_us: float
    ring_nvl_us: float
    ring_net_us: float
    tree_base_us: float
    tree_nvl_us: float
    tree_net_us: float
    ring_bw: float  # × busbw
    tree_bw: float  # × busbw (before the tree's factor ½ from bus to algorithm bandwidth)
    capped: bool  # LL: bandwidth also capped at NCCL's llMaxBw


# NVIDIA/nccl src/graph/tuning.cc: baseLat (Ring {6.6, 14.0, 8.4}, Tree {6.8, 14.0, 0}); hwLat
# NVLink (Ring {.6, 1.9, 3.4}, Tree {.6, 1.25, 28}) and NET (Ring {2.7, 4.0, 14.0}, Tree {5.0,
# 8.5, 28}); bandwidth refinements: ring LL ×1/4, ring LL128 ×0.92, tree ×0.92 then LL ×1/3.8,
# LL128 ×120/128 (7/9 inside a node).
LL = Proto("LL", 6.6, 0.6, 2.7, 6.8, 0.6, 5.0, 1 / 4, 0.92 / 3.8, True)
LL128 = Proto("LL128", 14.0, 1.9, 4.0, 14.0, 1.25, 8.5, 0.92, 0.92 * 120 / 128, False)
SIMPLE = Proto("Simple", 8.4, 3.4, 14.0, 0.0, 28.0, 28.0, 1.0, 0.92, False)
PROTOCOLS = (LL, LL128, SIMPLE)
NET_OVERHEAD_US = 1.0  # per step on multi-node rings (x86 Intel host; ×3 with Simple)
LL128_SINGLE_NODE_TREE = 7 / 9
# NVLS start-up: least squares over the DGX H100 sweep's NVLS region (64 MiB-16 GiB, ANCHORS)
# with the 480 GB/s plateau of the GTC slides; every point within 5%. NCCL's tuner charges
# 25 µs (hwLat NVLink NVLS), which would put NVLS ahead from 4 MiB where the sweep still shows
# ring bandwidth: NVLS's large chunks take longer to fill its pipeline.
NVLS_STARTUP_US = 90.0


def ll_max_Bps(n_nodes: int) -> float:
    """NCCL's llMaxBw (GB/s): 87.7 inside an Ampere/Hopper node, 39.0 on 2 nodes, 20.4 beyond
    (Intel hosts)."""
    return (87.7 if n_nodes == 1 else 39.0 if n_nodes == 2 else 20.4) * 1e9


def ring_steps(coll: str, p: int, n_nodes: int) -> tuple[int, int]:
    """(steps, steps that cross nodes) of NCCL's ring."""
    if coll == "ALL_REDUCE":  # NCCL counts 2·n crossings; never more than the steps there are
        steps = 2 * (p - 1)
        return steps, (min(2 * n_nodes, steps) if n_nodes > 1 else 0)
    return p - 1, n_nodes - 1


def ring_time(coll: str, nbytes: float, p: int, n_nodes: int, busbw_Bps: float, pr: Proto,
              sites: int = 1, site_s: float = 0.0) -> tuple[float, float]:
    """(latency_s, transfer_s) of a ring collective with protocol ``pr``; across ``sites``
    each crossing between them (counted as NCCL counts node crossings) also pays ``site_s``."""
    steps, inter = ring_steps(coll, p, n_nodes)
    intra_us = pr.ring_nvl_us
    if n_nodes > 1:
        intra_us = max(intra_us, NET_OVERHEAD_US * (3 if pr is SIMPLE else 1))
    lat_us = pr.ring_base_us + (steps - inter) * intra_us + inter * pr.ring_net_us
    bw = busbw_Bps * pr.ring_bw
    if pr.capped:
        bw = min(bw, ll_max_Bps(n_nodes))
    crossings = ring_steps(coll, p, sites)[1] if sites > 1 else 0
    return lat_us * US + crossings * site_s, nbytes * steps / (p * bw)


def tree_time(nbytes: float, p: int, n_nodes: int, busbw_Bps: float, pr: Proto,
              sites: int = 1, site_s: float = 0.0) -> tuple[float, float]:
    """(latency_s, transfer_s) of NCCL's double-binary-tree all-reduce with protocol ``pr``;
    across ``sites`` the tree's levels between them, up and down, also pay ``site_s``."""
    local = max(1, p // n_nodes)
    depth = math.ceil(math.log2(n_nodes)) if n_nodes > 1 else 0
    site_depth = math.ceil(math.log2(sites)) if sites > 1 else 0
    lat_us = pr.tree_base_us + 2 * ((local - 1) * pr.tree_nvl_us + depth * pr.tree_net_us)
    bw = busbw_Bps * pr.tree_bw
    if pr is LL128 and n_nodes == 1:
        bw = busbw_Bps * 0.92 * LL128_SINGLE_NODE_TREE
    if pr.capped:
        bw = min(bw, ll_max_Bps(n_nodes))
    return lat_us * US + 2 * site_depth * site_s, nbytes / (0.5 * bw)


def nvls_time(nbytes: float, p: int, nvls_busbw_Bps: float) -> tuple[float, float]:
    """(latency_s, transfer_s) of NVLS (NVLink SHARP) all-reduce inside one node: the switch
    reduces, so the time is a start-up plus the bytes at the NVLS bus bandwidth (bus convention:
    algorithm bandwidth = busbw · p / 2(p − 1))."""
    return NVLS_STARTUP_US * US, nbytes * 2 * (p - 1) / (p * nvls_busbw_Bps)


def collective_time(coll: str, nbytes: float, p: int, n_nodes: int, busbw_Bps: float,
                    nvls_busbw_Bps: float = 0.0, *, sites: int = 1, site_s: float = 0.0
                    ) -> tuple[float, float]:
    """(latency_s, transfer_s) of the fastest algorithm and protocol, as NCCL's tuner picks.
    ``coll``: ALL_REDUCE, REDUCE_SCATTER or ALL_GATHER; ``nbytes``: the whole buffer;
    ``nvls_busbw_Bps``: NVLS all-reduce bandwidth where the node has it (one node only);
    ``sites``, ``site_s``: the sites the group spans and the latency between them."""
    if p <= 1:
        return 0.0, 0.0
    options = [ring_time(coll, nbytes, p, n_nodes, busbw_Bps, pr, sites, site_s)
               for pr in PROTOCOLS]
    if coll == "ALL_REDUCE":
        options += [tree_time(nbytes, p, n_nodes, busbw_Bps, pr, sites, site_s)
                    for pr in PROTOCOLS]
        if n_nodes == 1 and nvls_busbw_Bps > 0:
            options.append(nvls_time(nbytes, p, nvls_busbw_Bps))
    return min(options, key=sum)
