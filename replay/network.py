"""Network model: where a group's ranks sit decides its tier; collectives are costed with NCCL's
own ring/tree model on calibrated bus bandwidths, the rest with alpha-beta formulas.

Placement: rank r lives on node ``r // gpus_per_node`` (Megatron's rank order puts TP innermost, so
a TP group of ≤ 8 sits inside a node). A group inside one node uses NVLink; a group with one rank
per node uses the NICs; a group with several ranks on each of several nodes moves its data in two
levels (NVLink phases and a NIC phase in sequence, ``AlphaBetaNetwork._busbw``), as ANCHORS.md
recommends ("Inter-node speed depends on intra-node speed").

All-reduce, reduce-scatter and all-gather: ``replay/nccl.py`` — NCCL's tuner picks ring or tree
and the LL / LL128 / Simple protocol with the least ``latency + bytes / bandwidth``, which is what
makes bus bandwidth grow with message size (NVIDIA/nccl ``src/graph/tuning.cc``).

Other collectives, for p ranks, message S bytes, bandwidth B, per-step latency α (Thakur,
Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in MPICH"):

* all-to-all (S = per-rank buffer): (p−1)/p · S/B + (p−1)·α (direct); across nodes the NVLink and
  NIC shares move concurrently;
* a MoE dispatch or combine that carries its routing (``tracegen.routing.Route``: DeepEP, which
  sends a token once per destination node over the NICs and forwards it over NVLink to the
  destination GPUs, DeepSeek-V3 §3.2.2): the same form with each tier's bytes deduplicated,
  ``_deepep``;
* broadcast / reduce / gather / scatter: S/B + ⌈log₂p⌉·α (pipelined tree); barrier 2⌈log₂p⌉·α;
* point-to-point: S/B + α.

ASTRA-sim-compatible mode: every group is one flat ring on the given bandwidth with ``GB/s`` read as
2³⁰ bytes/s, the message is split into ``preferred_dataset_splits`` chunks that run one after
another, and each ring step also pays a local reduction of ``2 · msg / local_mem_bw`` (read and
write at the system layer's memory bandwidth). This reproduces ASTRA-sim's analytical backend:
8 NPUs, 1 MiB all-reduce, 50 GB/s, 500 ns → 64,317 ns vs its 64,440 (tests/test_replay_astra.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable
from typing import Any, Protocol

from replay import nccl
from replay.hardware import SystemSpec
from tracegen.routing import Route, expected_units
from tracegen.units import GB, NS_PER_S, GiB, MiB

US = 1e-6  # seconds per microsecond
# Collectives costed with NCCL's ring/tree model (replay/nccl.py), by NCCL function.
NCCL_RING = {"ALL_REDUCE": "ALL_REDUCE", "REDUCE_SCATTER": "REDUCE_SCATTER",
             "REDUCE_SCATTER_BLOCK": "REDUCE_SCATTER", "ALL_GATHER": "ALL_GATHER"}


@dataclasses.dataclass(frozen=True, slots=True)
class CommCost:
    """``latency_ns`` is fixed; ``transfer_ns`` is at full bandwidth and stretches when links are
    shared. ``links`` are the per-rank link resources the transfer occupies; ``shares``, one a
    link (none: every one 1), the part of that link's bandwidth the transfer uses when it runs
    alone at full speed — under 1 on a tier that does not bind it (a two-level all-reduce's
    NVLink, 11% of its time on DGX H100 when its NIC phase binds), so that a transfer sharing
    that link is slowed by what it takes, not as if it took half (``sim._water_level``)."""

    latency_ns: int
    transfer_ns: int
    links: tuple[tuple[str, int], ...] = ()
    shares: tuple[float, ...] = ()

    @property
    def total_ns(self) -> int:
        return self.latency_ns + self.transfer_ns


class NetworkModel(Protocol):
    def collective(self, coll: str, size_bytes: int, ranks: tuple[int, ...],
                   route: Route | None = None) -> CommCost: ...

    def p2p(self, src: int, dst: int, size_bytes: int) -> CommCost: ...


class ConstantNetwork:
    """A fake for engine tests: every transfer costs ``ns``."""

    def __init__(self, ns: int) -> None:
        self.ns = ns

    def collective(self, coll: str, size_bytes: int, ranks: tuple[int, ...],
                   route: Route | None = None) -> CommCost:
        return CommCost(0, self.ns)

    def p2p(self, src: int, dst: int, size_bytes: int) -> CommCost:
        return CommCost(0, self.ns)


@dataclasses.dataclass(frozen=True, slots=True)
class Tier:
    bytes_per_s: float
    alpha_s: float
    link: str  # "nvl" or "nic"


def _log2(p: int) -> int:
    return max(1, math.ceil(math.log2(p))) if p > 1 else 0


# (ranks, nodes spanned, ranks per node, rail-aligned, sites spanned)
Shape = tuple[int, int, int, bool, int]


def group_shape(ranks: tuple[int, ...], gpus_per_node: int, site_gpus: int = 0) -> Shape:
    """(ranks, nodes spanned, ranks per node, rail-aligned, sites spanned): all a collective's
    cost depends on besides its kind and size (``site_gpus``: GPUs a site holds, 0 for one)."""
    per_node: dict[int, int] = {}
    for r in ranks:
        per_node[r // gpus_per_node] = per_node.get(r // gpus_per_node, 0) + 1
    local = max(per_node.values())
    rail = len({r % gpus_per_node for r in ranks}) == local
    return len(ranks), len(per_node), local, rail, _sites(ranks, site_gpus)


def _sites(ranks: Iterable[int], site_gpus: int) -> int:
    return len({r // site_gpus for r in ranks}) if site_gpus else 1


def ranges_shape(ranges: list[range], gpus_per_node: int, site_gpus: int = 0) -> Shape:
    """``group_shape`` of the ranks in ``ranges`` (arithmetic runs, as ``Mesh.member_ranges``
    gives them) without visiting every rank where one run's step divides the node size: its
    middle nodes then all hold the same residues, so the first node, the second and the last
    decide the shape (the sites, where there are several, are counted over every rank)."""
    g = gpus_per_node
    if len(ranges) == 1 and len(ranges[0]) > 2 * g:
        rg = ranges[0]
        n, step = len(rg), rg.step
        if step >= g:  # one rank per node
            return n, n, 1, step % g == 0, _sites(rg, site_gpus)
        if g % step == 0:
            per = g // step
            nodes = rg[-1] // g - rg[0] // g + 1
            sample = group_shape(tuple({*rg[: 2 * per + 1], *rg[-per:]}), g)
            return n, nodes, sample[2], sample[3], _sites(rg, site_gpus)
    return group_shape(tuple(itertools.chain.from_iterable(ranges)), g, site_gpus)


def flat_cost(coll: str, size: float, p: int, tier: Tier) -> tuple[float, float]:
    """(latency_s, transfer_s) of a collective other than all-reduce, reduce-scatter and
    all-gather on a flat tier of p ranks (those three follow NCCL's model, replay/nccl.py)."""
    if p <= 1:
        return 0.0, 0.0
    b, a = tier.bytes_per_s, tier.alpha_s
    if coll == "ALL_TO_ALL":
        return (p - 1) * a, (p - 1) / p * size / b
    if coll == "BARRIER":
        return 2 * _log2(p) * a, 0.0
    return _log2(p) * a, size / b  # BROADCAST, REDUCE, GATHER, SCATTER


class AlphaBetaNetwork:
    """The hierarchical alpha-beta model of a system (or ASTRA-sim's analytical one)."""

    def __init__(self, system: SystemSpec, *, astra_compat: bool = False,
                 stage_gpus: int = 0) -> None:
        # ``stage_gpus``: the GPUs of a pipeline stage, which send across a site boundary at
        # once (``p2p``); 0 where unknown (a foreign trace set): a site's worth
        self.sys, self.astra, self.stage_gpus = system, astra_compat, stage_gpus
        node, out = system.node, system.scaleout
        unit = GiB if astra_compat else GB  # ASTRA-sim reads GB/s as 2^30 bytes/s
        self.nvl = Tier(node.nvlink_GBps * unit * (1.0 if astra_compat else node.nvlink_efficiency),
                        node.nvlink_latency_us * US, "nvl")
        nic_bytes = out.nic_Gbps_per_gpu / 8 * unit * (1.0 if astra_compat else out.nic_efficiency)
        self.nic = Tier(nic_bytes, out.latency_us * US, "nic")
        self.nvls_Bps = 0.0 if astra_compat else node.nvls_busbw_GBps * unit
        # NCCL's all-to-all inside a node, at its own measured bus bandwidth where the system
        # gives one (``NodeSpec.nvlink_a2a_busbw_GBps``), else at the NVLink tier's
        a2a_Bps = node.nvlink_a2a_busbw_GBps * unit
        self.a2a = self.nvl if astra_compat or not a2a_Bps else Tier(
            a2a_Bps, self.nvl.alpha_s, "nvl")
        self.nic_blocking = Tier(nic_bytes / out.oversubscription, out.latency_us * US, "nic")
        # between sites: a site's links over its GPUs, their latency on top of the NIC's
        self.site_Bps = out.site_Gbps_per_gpu / 8 * unit * (1.0 if astra_compat
                                                            else out.nic_efficiency)
        self.site_s = out.site_latency_us * US
        # a flow's ceiling across the sites: its window over the round trip, NIC to NIC
        # (``ScaleOutSpec.site_window_MiB``; inf where none is given)
        rtt_s = 2 * (out.latency_us + out.site_latency_us) * US
        self.site_window_Bps = (out.site_window_MiB * MiB / rtt_s
                                if out.site_window_MiB and rtt_s > 0 and not astra_compat
                                else math.inf)
        self._cache: dict[tuple[str, int, tuple[int, ...], Route | None], CommCost] = {}
        # (collective, bytes, ``Shape``) → total ns: the cost depends only on the group's shape;
        # the fast path screens strategies through it.
        self.shape_cache: dict[tuple[Any, ...], int] = {}

    def collective(self, coll: str, size_bytes: int, ranks: tuple[int, ...],
                   route: Route | None = None) -> CommCost:
        key = (coll, size_bytes, ranks, route)
        cost = self._cache.get(key)
        if cost is None:
            cost = self._cache[key] = self._collective(coll, size_bytes, ranks, route)
        return cost

    def _collective(self, coll: str, size: int, ranks: tuple[int, ...], route: Route | None
                    ) -> CommCost:
        shape = group_shape(ranks, self.sys.node.gpus_per_node, self.sys.scaleout.site_gpus)
        lat, xfer, uses = self.shape_cost(coll, size, shape, route)
        links = tuple((link, r) for link in uses for r in ranks)
        shares = self.tier_shares(coll, size, shape, route) if len(uses) > 1 else (1.0,)
        cost = _cost(lat, xfer, links)
        if min(shares) >= 1.0:
            return cost
        return dataclasses.replace(cost, shares=tuple(s for s in shares for _ in ranks))

    def _out(self, shape: Shape, coll: str = "") -> Tier:
        """The scale-out tier a group of ``shape`` moves over: the NICs (their share of an
        oversubscribed fabric where the group is not rail-aligned), and across sites no more
        than the links between them give each flow that crosses, with their latency added.

        Those links are one pool, a site's GPUs' shares together (``site_Gbps_per_gpu`` ×
        ``site_gpus`` each way), split among the flows that cross at once, every group of the
        axis running its collective together as a symmetric step does. An all-to-all (and
        anything else but NCCL's ring and tree) sends every GPU's data across, so each flow
        gets a GPU's share. A ring (or tree) crosses a site boundary only where it leaves the
        site: of a group with n nodes over s sites, its ``local`` NIC flows at that boundary,
        and the site holds site_gpus / (p / s) such groups, so each flow gets the shares of the
        group's n / s nodes' worth of GPUs — a GPU's share when the group has a node a site
        (optimizer instances' cross-site all-reduce), far more for a data-parallel ring over
        hundreds of nodes, which then crosses at its NICs' rate. (Until the fifty-sixth
        session every flow got a GPU's share: right for all-to-alls, but it slowed a ring's
        every hop as if every GPU's traffic crossed.) Exact where the crossing groups fill
        their sites; where fewer cross (a site boundary inside one stage) each could get more,
        so it is a bound on the time from above."""
        _, n_nodes, _, rail, sites = shape
        out = self.nic if (rail and self.sys.scaleout.topology == "rail-optimized") else (
            self.nic_blocking)
        if sites > 1:
            share = self.site_Bps * (n_nodes / sites if coll in NCCL_RING else 1.0)
            return Tier(min(out.bytes_per_s, share, self.site_window_Bps),
                        out.alpha_s + self.site_s, "nic")
        return out

    def crossing_Bps(self, shape: Shape, coll: str) -> float:
        """What each flow of a ``coll`` on a group of ``shape`` moves between sites, bytes/s
        (``_out``; its NICs' rate where the links' pool is not the limit)."""
        return self._out(shape, coll).bytes_per_s

    def send_crossing_Bps(self, stage_gpus: int) -> float:
        """What a send between sites moves, bytes/s, a stage of ``stage_gpus`` sending at once
        (``p2p``)."""
        site = self.sys.scaleout.site_gpus
        share = self.site_Bps * max(1.0, site / stage_gpus) if stage_gpus else self.site_Bps
        return min(self.nic.bytes_per_s, share, self.site_window_Bps)

    def tier_shares(self, coll: str, size: int, shape: Shape,
                    route: Route | None = None) -> tuple[float, float]:
        """(NVLink, NIC): the part of each tier's bandwidth a collective spanning nodes with
        several ranks a node uses, running alone. Phases in sequence (the two-level ring
        collectives, ``_busbw``): each tier's share of the transfer time, per byte (l−1)/l / B_nvl
        against (n−1)/n / (l·B_nic). Tiers used at once (all-to-all, DeepEP): each tier's time
        over the slower one's. Flat on the NICs (the rest): the NIC binds, NVLink carries the same
        bytes at its own rate."""
        p, n, local, _, _ = shape
        if self.astra:
            return (1.0, 1.0)
        out = self._out(shape, coll)
        if route is not None and coll == "ALL_TO_ALL":
            u = size / route.topk
            nic = u * expected_units(route, n) * (n - 1) / n / out.bytes_per_s
            nvl = u * expected_units(route, p) * (local - 1) / local / self.nvl.bytes_per_s
            return _over_slower(nvl, nic)
        if coll == "ALL_TO_ALL":
            nvl = size * local / p * (local - 1) / local / self.a2a.bytes_per_s
            return _over_slower(nvl, (p - local) / p * size / out.bytes_per_s)
        if coll in NCCL_RING:
            nvl = (local - 1) / local / self.nvl.bytes_per_s
            nic = (n - 1) / n / local / out.bytes_per_s
            return nvl / (nvl + nic), nic / (nvl + nic)
        return min(1.0, out.bytes_per_s / self.nvl.bytes_per_s), 1.0

    def shape_ns(self, coll: str, size: int, shape: Shape, route: Route | None = None) -> int:
        """Total ns of a collective on a group of this shape (cached; the fast path's entry)."""
        key = (coll, size, shape, route) if route else (coll, size, shape)
        got = self.shape_cache.get(key)
        if got is None:
            lat, xfer, _ = self.shape_cost(coll, size, shape, route)
            got = self.shape_cache[key] = _cost(lat, xfer, ()).total_ns
        return got

    def shape_cost(self, coll: str, size: int, shape: Shape, route: Route | None = None
                   ) -> tuple[float, float, tuple[str, ...]]:
        """(latency_s, transfer_s, link kinds used) of a collective on a group of ``shape``:
        (ranks, nodes spanned, ranks per node, rail-aligned, sites spanned) — and, for a MoE
        dispatch or combine that deduplicates its tokens, the layer's ``route``. Nothing else
        decides the cost. (ASTRA-sim's analytical mode has no such collective: a routed
        all-to-all is a flat one there.) Across sites the scale-out tier is what the links
        between them give each flow that crosses (``_out``), and NCCL's ring and tree pay their
        latency per crossing as they pay a network hop's (``nccl.collective_time``)."""
        p, n_nodes, local, _, sites = shape
        if self.astra:
            tier = self.nvl if n_nodes == 1 else self.nic
            return (*self._astra(coll, size, p, tier), (tier.link,))
        out = self._out(shape, coll)
        uses = ("nvl",) if n_nodes == 1 else ("nic",) if local == 1 else ("nvl", "nic")
        if route is not None and coll == "ALL_TO_ALL":
            return (*self._deepep(size, shape, route, out), uses)
        if coll in NCCL_RING:
            nbytes = size * p if coll == "ALL_GATHER" else size
            return (*nccl.collective_time(NCCL_RING[coll], nbytes, p, n_nodes,
                                          self._busbw(n_nodes, local, out), self.nvls_Bps,
                                          sites=sites, site_s=self.site_s),
                    uses)
        if n_nodes == 1:
            return (*flat_cost(coll, size, p, self.a2a if coll == "ALL_TO_ALL" else self.nvl),
                    uses)
        if local == 1:
            return (*flat_cost(coll, size, p, out), uses)
        return (*self._hierarchical(coll, size, n_nodes, local, out), uses)

    def _busbw(self, n_nodes: int, local: int, out: Tier) -> float:
        """Plateau bus bandwidth of a group (bytes/s, ring-equivalent). Across nodes with
        ``local`` > 1 ranks per node the transfer is two-level and its phases run in sequence:
        reduce-scatter on NVLink, all-reduce of 1/local of the data on the NICs, all-gather on
        NVLink, i.e. per byte 2(l−1)/l / B_nvl + 2(n−1)/n / (l · B_nic) against the ring's
        2(p−1)/p / busbw (the same ratio holds for reduce-scatter and all-gather alone).

        This is below the isolated nccl-tests plateaus across nodes (DGX A100 126 vs 192 GB/s,
        DGX H100 224 vs 370–380 GB/s, ANCHORS), where NCCL pipelines NVLink and NIC hops; the
        pipelined form (min(B_nvl, l · B_nic)) made every multi-node FSDP/ZeRO-3 run of the
        public set 2–9 points faster than measured, and still does with interference modelled
        (their gathers block the chain: nothing overlaps them), so the sequential form stays:
        a known conflict with the isolated anchors (DESIGN.md)."""
        if n_nodes == 1:
            return self.nvl.bytes_per_s
        if local == 1:
            return out.bytes_per_s
        p = n_nodes * local
        per_byte = (2 * (local - 1) / local / self.nvl.bytes_per_s
                    + 2 * (n_nodes - 1) / n_nodes / local / out.bytes_per_s)
        return 2 * (p - 1) / p / per_byte

    def _hierarchical(self, coll: str, size: float, n: int, local: int, out: Tier
                      ) -> tuple[float, float]:
        """Collectives other than all-reduce, reduce-scatter and all-gather across nodes with
        ``local`` ranks per node: all-to-all moves its NVLink and NIC shares concurrently (the
        slower binds); the rest run flat on the NICs."""
        if coll == "ALL_TO_ALL":
            p = n * local
            intra = flat_cost("ALL_TO_ALL", size * local / p, local, self.a2a)
            inter = (out.alpha_s * (n - 1), (p - local) / p * size / out.bytes_per_s)
            return intra[0] + inter[0], max(intra[1], inter[1])
        return flat_cost(coll, size, n * local, out)

    def _deepep(self, size: float, shape: Shape, route: Route, out: Tier
                ) -> tuple[float, float]:
        """A dispatch (or combine) by DeepEP's normal kernels (deepseek-ai/DeepEP; DeepSeek-V3
        §3.2.2). ``size`` is the per-rank buffer of the flat all-to-all, one copy per (token,
        expert): u = size / k bytes per token. Across nodes a token crosses the NICs once per
        destination node other than its own, to the GPU of its own index there, which forwards
        it over NVLink to each destination GPU of that node; the two tiers are pipelined, so the
        slower binds: max(u·D_n·(n−1)/n / B_nic, u·D_g·(l−1)/l / B_nvl), D_n and D_g the nodes
        and GPUs of the expert-parallel group one token's experts fall on
        (``tracegen.routing.expected_units``; the flat all-to-all moves k(p−l)/p copies across
        nodes instead). Inside a node a token goes once to each destination GPU. Latency as the
        flat all-to-all's. Group-limited routing sends fewer tokens across nodes: DeepSeek-V3's
        top-8 within 4 of 8 groups on 8 nodes of 8 GPUs reaches D_n = 3.63 nodes and D_g = 7.36
        GPUs, 3.2 NIC copies per token against the flat 7 (Liu et al. 2024 size it so: NVLink at
        3.2× the IB bandwidth forwards up to 3.2 experts per node without binding)."""
        p, n, local, _, _ = shape
        u = size / route.topk
        gpus = expected_units(route, p)
        if n == 1:
            lat, _ = flat_cost("ALL_TO_ALL", size, p, self.nvl)
            return lat, u * gpus * (p - 1) / p / self.nvl.bytes_per_s
        nodes = expected_units(route, n)
        nic = u * nodes * (n - 1) / n / out.bytes_per_s
        nvl = u * gpus * (local - 1) / local / self.nvl.bytes_per_s if local > 1 else 0.0
        lat = out.alpha_s * (n - 1) + (self.nvl.alpha_s * (local - 1) if local > 1 else 0.0)
        return lat, max(nic, nvl)

    def _astra(self, coll: str, size: int, p: int, tier: Tier) -> tuple[float, float]:
        a = self.sys.astra
        chunks = a.preferred_dataset_splits
        mem_bps = a.local_mem_bw_GBps * GiB
        if coll == "ALL_REDUCE":
            steps, msg = 2 * (p - 1), size / (chunks * p)
        elif coll in ("REDUCE_SCATTER", "REDUCE_SCATTER_BLOCK"):
            steps, msg = p - 1, size / (chunks * p)
        elif coll == "ALL_GATHER":
            steps, msg = p - 1, size / chunks
        elif coll == "ALL_TO_ALL":
            steps, msg = p - 1, size / (chunks * p)
        else:
            return flat_cost(coll, size, p, tier)
        lat = chunks * steps * tier.alpha_s
        xfer = chunks * steps * (msg / tier.bytes_per_s + 2 * msg / mem_bps)
        return lat, xfer

    def p2p(self, src: int, dst: int, size_bytes: int, stage_gpus: int | None = None
            ) -> CommCost:
        """A send. Between sites: their links' latency on top of the NIC's, and the links'
        pool (a site's GPUs' shares) split among the GPUs that send across at once — a
        pipeline stage's (``stage_gpus``, else the network's own; 0: a site's worth, a GPU's
        share), so where a site holds k stages each boundary send moves at k GPUs' shares."""
        g, site = self.sys.node.gpus_per_node, self.sys.scaleout.site_gpus
        tier = self.nvl if src // g == dst // g else self.nic
        if site and src // site != dst // site:
            rate = self.send_crossing_Bps(self.stage_gpus if stage_gpus is None else stage_gpus)
            tier = Tier(rate, self.nic.alpha_s + self.site_s, "nic")
        return _cost(tier.alpha_s, size_bytes / tier.bytes_per_s,
                     ((tier.link, src), (tier.link, dst)))


def _over_slower(nvl_s: float, nic_s: float) -> tuple[float, float]:
    """Two tiers moving at once: each one's time over the slower one's (both 1 if neither
    moves anything)."""
    slower = max(nvl_s, nic_s)
    return (nvl_s / slower, nic_s / slower) if slower > 0 else (1.0, 1.0)


def _cost(lat_s: float, xfer_s: float, links: tuple[tuple[str, int], ...]) -> CommCost:
    return CommCost(round(lat_s * NS_PER_S), round(xfer_s * NS_PER_S), links)
