"""Scenarios: what goes wrong inside a step — stragglers (static, fail-slow episodes, or drawn at
random with a seed), degraded or failed links, and heterogeneous GPU types.

::

    [[straggler]]              # ranks = [...] or nodes = [...]
    ranks = [3]
    slowdown = 2.0             # ≥ 1: compute takes 2× as long
    start_s = 0.5              # optional fail-slow episode window, in simulated seconds
    end_s = 1.0

    [[random_stragglers]]
    fraction = 0.01            # of the simulated ranks
    slowdown_min = 1.1
    slowdown_max = 2.0
    seed = 7

    [[link]]                   # ranks = [...] or nodes = [...]
    nodes = [2]
    tier = "nic"               # nic | nvlink | switch (the NICs of the nodes under a switch)
    bandwidth_factor = 0.5     # (0, 1] of the healthy bandwidth
    extra_latency_us = 5.0
    failed = false             # true: traffic re-routed; the surviving path gives
    surviving_fraction = 0.5   #   this fraction (two GPUs sharing the neighbouring rail's NIC)

    [[gpu]]                    # heterogeneous cluster: these ranks have another GPU type
    nodes = [0, 1]
    system = "dgx-a100-80gb"   # the GPU of this preset (its compute and its memory: each
                               # rank's stage must fit its own GPU; MFU is against the
                               # cluster's mean peak) on that preset's nodes (its NVLink and
                               # NICs; a transfer to the rest at the slower end's cost)

A node is a host: a server, or on a GB200 NVL72 rack a 4-GPU compute tray
(``NodeSpec.host_gpus``), not the 72-GPU NVLink domain.

In a representative-mode set (one rank per pipeline stage), ranks must be simulated ones and
nodes must hold whole stages, and random stragglers are refused (each would be a whole stage);
a full-mode set takes any ranks and nodes.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from replay.compute import ComputeModel, RooflineCompute
from replay.hardware import SystemSpec, resolve_system
from replay.network import AlphaBetaNetwork, CommCost, NetworkModel
from tracegen._config import load_mapping
from tracegen.errors import ConfigError, unknown_key
from tracegen.routing import Route
from tracegen.units import NS_PER_S, NS_PER_US

SECTIONS = {"straggler", "random_stragglers", "link", "gpu", "name", "description"}
# No time (s), slowdown (×), fraction or latency (µs) of one step comes near this: beyond it, a
# value is a typo, and it would overflow the simulator's integer nanoseconds.
MAX_NUMBER = 1e6
# A degraded leaf switch slows every NIC below it: give the nodes under it with tier "switch".
TIERS = {"nic": "nic", "nvlink": "nvl", "switch": "nic"}


@dataclasses.dataclass(frozen=True, slots=True)
class Episode:
    rank: int
    slowdown: float
    start_ns: int = 0
    end_ns: int | None = None  # None: the whole step


@dataclasses.dataclass(frozen=True, slots=True)
class LinkFault:
    rank: int
    tier: str  # "nic" | "nvl"
    factor: float
    extra_latency_ns: int


@dataclasses.dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    episodes: tuple[Episode, ...] = ()
    links: tuple[LinkFault, ...] = ()
    gpus: tuple[tuple[int, str], ...] = ()  # (rank, system preset or file)

    @property
    def ranks_touched(self) -> set[int]:
        return ({e.rank for e in self.episodes} | {lf.rank for lf in self.links}
                | {r for r, _ in self.gpus})

    def slowdown(self, rank: int, t_ns: int) -> float:
        f = 1.0
        for e in self.episodes:
            if e.rank == rank and e.start_ns <= t_ns and (e.end_ns is None or t_ns < e.end_ns):
                f *= e.slowdown
        return f

    def perfetto_events(self, end_ns: int) -> list[dict[str, Any]]:
        """Fault events on their own track (process "faults")."""
        pid = -1
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": "faults"}}]
        for i, e in enumerate(self.episodes):
            stop = e.end_ns if e.end_ns is not None else end_ns
            events.append({"ph": "X", "name": f"straggler rank {e.rank} ×{e.slowdown:g}",
                           "cat": "fault", "pid": pid, "tid": 1 + i, "ts": e.start_ns / 1e3,
                           "dur": max(stop - e.start_ns, 0) / 1e3,
                           "args": {"rank": e.rank, "slowdown": e.slowdown}})
        for j, lf in enumerate(self.links):
            events.append({"ph": "X", "name": f"{lf.tier} of rank {lf.rank} at {lf.factor:.0%}",
                           "cat": "fault", "pid": pid, "tid": 1000 + j, "ts": 0,
                           "dur": end_ns / 1e3, "args": dataclasses.asdict(lf)})
        for k, (rank, system) in enumerate(self.gpus):
            events.append({"ph": "X", "name": f"rank {rank} on {system}", "cat": "gpu",
                           "pid": pid, "tid": 2000 + k, "ts": 0, "dur": end_ns / 1e3,
                           "args": {"rank": rank, "system": system}})
        return events


def load_scenario(path: str | Path, *, world_size: int, gpus_per_node: int,
                  simulated: set[int], stands_for: dict[int, tuple[int, ...]] | None = None
                  ) -> Scenario:
    p = Path(path)
    return scenario_from_dict(load_mapping(p, what="scenario file"), name=p.stem,
                              world_size=world_size, gpus_per_node=gpus_per_node,
                              simulated=simulated, stands_for=stands_for)


def scenario_from_dict(data: dict[str, Any], *, name: str, world_size: int, gpus_per_node: int,
                       simulated: set[int], stands_for: dict[int, tuple[int, ...]] | None = None
                       ) -> Scenario:
    """``stands_for``: in a representative-mode set, each simulated rank → every rank it
    stands for (its pipeline stage); a perturbation by nodes must then cover whole stages."""
    unknown = set(data) - SECTIONS
    if unknown:
        raise ConfigError(f"unknown section(s) {sorted(unknown)}; known: straggler, "
                          "random_stragglers, link, gpu", what=f"scenario {name!r}")
    ctx = _Ctx(name, world_size, gpus_per_node, simulated, stands_for)
    episodes = [e for d in data.get("straggler", []) for e in ctx.straggler(d)]
    episodes += [e for d in data.get("random_stragglers", []) for e in ctx.random(d)]
    links = [lf for d in data.get("link", []) for lf in ctx.link(d)]
    gpus = [g for d in data.get("gpu", []) for g in ctx.gpu(d)]
    return Scenario(str(data.get("name", name)), tuple(episodes), tuple(links), tuple(gpus))


@dataclasses.dataclass
class _Ctx:
    name: str
    world: int
    per_node: int
    simulated: set[int]
    stands_for: dict[int, tuple[int, ...]] | None = None

    def fail(self, msg: str | list[str]) -> ConfigError:
        return ConfigError(msg, what=f"scenario {self.name!r}")

    def _keys(self, d: dict[str, Any], section: str, allowed: set[str]) -> None:
        extra = set(d) - allowed
        if extra:
            raise self.fail([unknown_key(k, allowed, label=f"[[{section}]]: unknown key")
                             for k in sorted(extra)])

    def ranks(self, d: dict[str, Any], section: str) -> list[int]:
        if ("ranks" in d) == ("nodes" in d):
            raise self.fail(f"[[{section}]] needs exactly one of ranks = [...] or nodes = [...]")
        key = "ranks" if "ranks" in d else "nodes"
        if not isinstance(d[key], list):
            raise self.fail(f"[[{section}]]: {key} must be a list of whole numbers, e.g. "
                            f"{key} = [0, 1]; got {d[key]!r}")
        if "ranks" in d:
            ranks = list(d["ranks"])
        else:
            nodes = list(d["nodes"])
            n_nodes = -(-self.world // self.per_node)
            bad = [n for n in nodes if not (isinstance(n, int) and 0 <= n < n_nodes)]
            if bad:
                raise self.fail(f"[[{section}]]: node(s) {bad} not in 0..{n_nodes - 1} "
                                f"({self.world} ranks, {self.per_node} per node)")
            ranks = [n * self.per_node + i for n in nodes for i in range(self.per_node)]
            ranks = [r for r in ranks if r < self.world]
        bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < self.world)]
        if bad:
            raise self.fail(f"[[{section}]]: rank(s) {bad} not in the world of {self.world} "
                            f"ranks (0..{self.world - 1})")
        missing = [r for r in ranks if r not in self.simulated]
        if missing and "ranks" in d:
            raise self.fail(
                f"[[{section}]]: rank(s) {missing[:8]} are not simulated in this "
                "representative-mode set; generate a full-mode set to perturb individual ranks")
        if self.stands_for is not None and "nodes" in d:
            return self._whole_stages(set(ranks), section)
        return [r for r in ranks if r in self.simulated]

    def _whole_stages(self, listed: set[int], section: str) -> list[int]:
        """The representatives of the stages the nodes hold whole. A representative stands for
        every rank of its stage: a node holding part of a stage would perturb all of it, and a
        node holding no representative none of it (a slow node had cost nothing)."""
        assert self.stands_for is not None
        chosen = []
        for rep, group in sorted(self.stands_for.items()):
            hit = listed.intersection(group)
            if hit and len(hit) < len(group):
                lo, hi = min(group), max(group)
                raise self.fail(
                    f"[[{section}]]: the nodes listed hold {len(hit)} of the {len(group)} ranks "
                    f"({lo}–{hi}, nodes {lo // self.per_node}–{hi // self.per_node}) that this "
                    f"representative-mode set simulates as one rank ({rep}); list every node "
                    "of that pipeline stage, or generate a full-mode set to perturb part of it")
            if hit:
                chosen.append(rep)
        return chosen

    def _number(self, d: dict[str, Any], key: str, section: str, default: float | None = None
                ) -> float:
        v = d.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise self.fail(f"[[{section}]]: {key} must be a number, got {v!r}")
        if not abs(v) <= MAX_NUMBER:  # also NaN: a step is seconds long, a slowdown a few ×
            raise self.fail(f"[[{section}]]: {key} = {v} is beyond any step's scale (a finite "
                            f"number within ±{MAX_NUMBER:g})")
        return float(v)

    def straggler(self, d: dict[str, Any]) -> list[Episode]:
        self._keys(d, "straggler", {"ranks", "nodes", "slowdown", "start_s", "end_s"})
        slow = self._number(d, "slowdown", "straggler")
        if slow < 1:
            raise self.fail(f"[[straggler]]: slowdown {slow} < 1 would make the rank faster; "
                            "slowdowns are ≥ 1 (2 = twice as slow). For a faster GPU type use "
                            "[[gpu]]")
        start = self._number(d, "start_s", "straggler", 0.0)
        end = d.get("end_s")
        if end is not None and self._number(d, "end_s", "straggler") <= start:
            raise self.fail(f"[[straggler]]: end_s {end} must be after start_s {start}")
        start_ns = round(start * NS_PER_S)
        end_ns = None if end is None else round(float(end) * NS_PER_S)
        return [Episode(r, slow, start_ns, end_ns) for r in self.ranks(d, "straggler")]

    def random(self, d: dict[str, Any]) -> list[Episode]:
        self._keys(d, "random_stragglers", {"fraction", "slowdown_min", "slowdown_max", "seed"})
        frac = self._number(d, "fraction", "random_stragglers")
        lo = self._number(d, "slowdown_min", "random_stragglers", 1.0)
        hi = self._number(d, "slowdown_max", "random_stragglers", 2.0)
        if not 0 < frac <= 1 or not 1 <= lo <= hi:
            raise self.fail("[[random_stragglers]]: need 0 < fraction ≤ 1 and 1 ≤ slowdown_min ≤ "
                            f"slowdown_max, got fraction {frac}, {lo}..{hi}")
        if self.stands_for is not None:  # a drawn rank would be a whole stage of them
            raise self.fail("[[random_stragglers]] draws individual ranks, and this "
                            "representative-mode set simulates one rank per pipeline stage: "
                            "generate a full-mode set (`trainsim tracegen --mode full`)")
        rng = random.Random(int(d.get("seed", 0)))
        pool = sorted(self.simulated)
        chosen = rng.sample(pool, max(1, round(frac * len(pool))))
        return [Episode(r, rng.uniform(lo, hi)) for r in sorted(chosen)]

    def link(self, d: dict[str, Any]) -> list[LinkFault]:
        self._keys(d, "link", {"ranks", "nodes", "tier", "bandwidth_factor", "extra_latency_us",
                               "failed", "surviving_fraction"})
        tier = d.get("tier", "nic")
        if not isinstance(tier, str) or tier not in TIERS:
            raise self.fail(f"[[link]]: tier must be 'nic', 'nvlink' or 'switch', got {tier!r}")
        key = "surviving_fraction" if d.get("failed") else "bandwidth_factor"
        factor = self._number(d, key, "link", 0.5 if d.get("failed") else None)
        if not 0 < factor <= 1:
            raise self.fail(f"[[link]]: {key} is a fraction of the healthy bandwidth in (0, 1], "
                            f"got {factor}")
        extra = self._number(d, "extra_latency_us", "link", 0.0)
        if extra < 0:
            raise self.fail(f"[[link]]: extra_latency_us must be ≥ 0, got {extra}")
        return [LinkFault(r, TIERS[tier], factor, round(extra * NS_PER_US))
                for r in self.ranks(d, "link")]

    def gpu(self, d: dict[str, Any]) -> list[tuple[int, str]]:
        self._keys(d, "gpu", {"ranks", "nodes", "system"})
        system = d.get("system")
        if not isinstance(system, str):
            raise self.fail("[[gpu]] needs system = a preset name or system file")
        resolve_system(system)  # a clear error now, not mid-replay
        return [(r, system) for r in self.ranks(d, "gpu")]


class DegradedNetwork:
    """A network model whose transfers slow down on degraded links. A collective or send that
    touches one is costed again on the system with that tier (NIC or NVLink) at the slowest
    hit link's share of its bandwidth: a ring moves at its slowest hop, and a two-level
    collective slows only in the phase on the degraded tier (its NVLink reduce-scatter and
    all-gather stay fast when a NIC is slow). On a mixed cluster (``MixedNetwork``) the system
    slowed is the hit rank's own, the others as they are, and the transfer at the slower of
    them (an H100 NIC at a quarter, 100 Gb/s, sending to a healthy 200 Gb/s A100 one moves at
    100). The links' extra latency is added. A base model without a system (``.sys``) has its
    whole transfer stretched instead."""

    def __init__(self, base: NetworkModel, faults: tuple[LinkFault, ...]) -> None:
        self.base = base
        self.faults: dict[tuple[str, int], LinkFault] = {(f.tier, f.rank): f for f in faults}
        self._slowed: dict[tuple[Any, ...], NetworkModel] = {}

    def _degraded(self, cost: CommCost, again: Callable[[NetworkModel], CommCost]) -> CommCost:
        hit = [self.faults[ln] for ln in cost.links if ln in self.faults]
        if not hit:
            return cost
        extra = max(f.extra_latency_ns for f in hit)
        net = self._slowed_net(hit)
        if net is None:
            factor = min(f.factor for f in hit)
            return CommCost(cost.latency_ns + extra, round(cost.transfer_ns / factor), cost.links,
                            cost.shares)
        slow = again(net)
        return CommCost(slow.latency_ns + extra, slow.transfer_ns, cost.links, slow.shares)

    def _slowed_net(self, hit: list[LinkFault]) -> NetworkModel | None:
        """The network to cost a transfer on again: each hit rank's system with its tiers at
        the slowest hit link's share (None: a model with no system to slow)."""
        mixed = self.base if isinstance(self.base, MixedNetwork) else None
        own: Callable[[int], NetworkModel] = (
            (lambda r: mixed.own.get(r, mixed.base)) if mixed else (lambda r: self.base))
        nets = {id(own(f.rank)): own(f.rank) for f in hit}
        if not all(isinstance(getattr(n, "sys", None), SystemSpec) for n in nets.values()):
            return None
        factors = dict.fromkeys(nets, (1.0, 1.0))  # per system hit: (NIC, NVLink) factors
        for f in hit:
            k = id(own(f.rank))
            nic, nvl = factors[k]
            factors[k] = (min(nic, f.factor), nvl) if f.tier == "nic" else (nic, min(nvl, f.factor))
        key = tuple(sorted(factors.items()))
        got = self._slowed.get(key)
        if got is None:
            slowed = {k: AlphaBetaNetwork(tiers_slowed(nets[k].sys, *fs),  # type: ignore[attr-defined]
                                          astra_compat=getattr(nets[k], "astra", False),
                                          stage_gpus=getattr(nets[k], "stage_gpus", 0))
                      for k, fs in factors.items()}
            if mixed is None:
                got = next(iter(slowed.values()))
            else:
                got = MixedNetwork(slowed.get(id(mixed.base), mixed.base),
                                   {r: slowed.get(id(n), n) for r, n in mixed.own.items()})
            self._slowed[key] = got
        return got

    def collective(self, coll: str, size_bytes: int, ranks: tuple[int, ...],
                   route: Route | None = None) -> CommCost:
        return self._degraded(self.base.collective(coll, size_bytes, ranks, route),
                              lambda net: net.collective(coll, size_bytes, ranks, route))

    def p2p(self, src: int, dst: int, size_bytes: int) -> CommCost:
        return self._degraded(self.base.p2p(src, dst, size_bytes),
                              lambda net: net.p2p(src, dst, size_bytes))


class MixedNetwork:
    """A cluster of two (or more) generations: ranks on another system's nodes (``[[gpu]]``)
    move their data over that system's links — its NVLink and NICs — not the base system's.
    A collective whose group lies on one system is costed on it; one spanning systems, and a
    send between them, at the slower of the systems' costs (a ring moves at its slowest hop;
    the fast path's ``estimate_stages`` takes each send at its slower end alike). Degraded
    links on such a cluster slow their own rank's system (``DegradedNetwork``)."""

    def __init__(self, base: NetworkModel, own: dict[int, NetworkModel]) -> None:
        self.base, self.own = base, own
        self._cache: dict[tuple[Any, ...], CommCost] = {}

    def _slower(self, nets: list[NetworkModel], cost: Callable[[NetworkModel], CommCost]
                ) -> CommCost:
        distinct = list({id(n): n for n in nets}.values())
        return max((cost(n) for n in distinct), key=lambda c: c.total_ns)

    def collective(self, coll: str, size_bytes: int, ranks: tuple[int, ...],
                   route: Route | None = None) -> CommCost:
        key = (coll, size_bytes, ranks, route)
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = self._slower(
                [self.own.get(r, self.base) for r in ranks],
                lambda n: n.collective(coll, size_bytes, ranks, route))
        return got

    def p2p(self, src: int, dst: int, size_bytes: int) -> CommCost:
        return self._slower([self.own.get(src, self.base), self.own.get(dst, self.base)],
                            lambda n: n.p2p(src, dst, size_bytes))


def tiers_slowed(system: SystemSpec, nic: float, nvlink: float) -> SystemSpec:
    """``system`` with its NICs at ``nic`` and its NVLink (NVLS and all-to-all too) at
    ``nvlink`` of their bandwidth."""
    node, out = system.node, system.scaleout
    return dataclasses.replace(
        system, node=dataclasses.replace(
            node, nvlink_GBps=node.nvlink_GBps * nvlink,
            nvls_busbw_GBps=node.nvls_busbw_GBps * nvlink,
            nvlink_a2a_busbw_GBps=node.nvlink_a2a_busbw_GBps * nvlink),
        scaleout=dataclasses.replace(out, nic_Gbps_per_gpu=out.nic_Gbps_per_gpu * nic))


def compute_for(scenario: Scenario, source: str) -> dict[int, ComputeModel]:
    """Per-rank compute models for ranks on another GPU type."""
    models: dict[str, ComputeModel] = {}
    out: dict[int, ComputeModel] = {}
    for rank, system in scenario.gpus:
        if system not in models:
            models[system] = RooflineCompute(resolve_system(system).gpu, source)  # type: ignore[arg-type]
        out[rank] = models[system]
    return out
