"""The replay simulator: ranks, streams, collectives, point-to-point and shared links, on top of
the domain-free kernel in ``engine.py``.

Per rank there is one compute stream and one communication stream per process group (an NCCL
communicator has its own stream); point-to-point transfers run concurrently. In ASTRA-sim-
compatible mode each rank has a single communication stream: one collective or send at a time,
receives posted beside it (ASTRA-sim's ``HardwareResource::occupy`` gives a COMM_RECV_NODE no
slot: serialized behind the stream, a posted receive would stall every pipeline).

* A node is ready when all its data and ctrl dependencies have finished; ready nodes queue on their
  stream in the order they became ready (ties by position in the file).
* A collective starts when every member present in the trace set has reached it on its stream
  (members are matched by the order in which each issues collectives on that group) and finishes
  together on all of them. Members absent from a representative-mode set are symmetric to the
  present ones; the cost is that of the full group and placement.
* Sends and receives match on (src, dst, tag); the transfer starts when both are posted.
* Transfers that share a link (per-rank NVLink port or NIC) share its bandwidth equally while they
  overlap (processor sharing); latency is not shared.
* Interference: while collectives of a rank are in flight, its compute kernels run at
  1 / (1 + κ·n) of their speed (n collectives, κ = ``GPUSpec.comm_interference``; Lee et al.
  2025): a kernel is re-rated when a collective of its rank starts or ends. With κ > 0 compute
  chains are not run back to back (a collective may start at any event), so every kernel on the
  compute stream is an event of its own.
* A trace set that cannot finish ends with ``ReplayError`` naming the stuck ranks and nodes.
"""

from __future__ import annotations

import dataclasses
import math
from array import array
from collections import deque
from collections.abc import Callable
from itertools import pairwise
from typing import Any

from chakra.schema.protobuf import et_def_pb2 as pb

from replay.compute import ComputeModel
from replay.engine import Engine, Event
from replay.network import CommCost, NetworkModel
from replay.reader import COLL_TYPE_NAMES, NODE_TYPE_NAMES, NodeRec
from replay.traceset import TraceSet
from tracegen.errors import ReplayError
from tracegen.routing import route_of
from tracegen.units import NS_PER_US

COMPUTE_STREAM = 0
P2P_STREAM = 1
# Priorities at equal time: finishing work first frees streams before new work is dispatched.
PRIO_FINISH, PRIO_FLOW, PRIO_READY = 0, 1, 2
# copies between a GPU and host memory (activation offloading): one copy stream each way
MEM_STREAMS = {pb.MEM_STORE_NODE: "d2h", pb.MEM_LOAD_NODE: "h2d"}
MEM_NAMES = {pb.MEM_STORE_NODE: "MEM_STORE_NODE", pb.MEM_LOAD_NODE: "MEM_LOAD_NODE"}


@dataclasses.dataclass(slots=True)
class _Rank:
    rank: int
    nodes: list[NodeRec]
    pending: array[int]  # unfinished dependency count per node
    dependents: list[list[int]]
    stream_of: list[int]  # stream id per node
    queues: dict[int, deque[int]]
    busy: dict[int, bool]
    coll_seq: dict[str, int]
    seg_next: list[int]  # next node of a compute chain run back to back (-1: none)
    done: int = 0
    # Interference (``GPUSpec.comm_interference``): κ, this rank's collectives in flight, and the
    # compute kernel running on its compute stream as [pos, stream, start, work ns left at full
    # rate, rate, since, duration at full rate] with its generation.
    kappa: float = 0.0
    inflight: int = 0
    kernel: list[Any] | None = None
    kgen: int = 0


@dataclasses.dataclass(slots=True)
class _Collective:
    key: tuple[str, int]
    members: tuple[int, ...]
    present: int
    arrived: dict[int, tuple[int, int]]  # rank → (node position, arrival t)
    signature: tuple[int, int] | None = None


@dataclasses.dataclass(slots=True)
class _Flow:
    """A transfer in its bandwidth phase: ``remaining_ns`` of work at full rate."""

    remaining_ns: float
    links: tuple[tuple[str, int], ...]
    shares: dict[tuple[str, int], float] | None  # of a link's bandwidth at full rate, where
    # under 1 (``CommCost.shares``); None: all of each link's
    rate: float
    since_ns: int
    gen: int
    on_done: Callable[[int], list[Event]]


def water_level(asks: list[float]) -> float:
    """Max-min fair sharing of one link (Bertsekas and Gallager, Data Networks, 2nd ed.,
    §6.5.2: water-filling): each flow asks for a share of the link's bandwidth; every flow
    asking less than the level gets what it asks, the others the level, and together they use
    the whole link. ∞ where the link holds all the asks."""
    left, n = 1.0, len(asks)
    for i, ask in enumerate(sorted(asks)):
        fair = left / (n - i)
        if ask > fair:
            return fair
        left -= ask
    return math.inf


@dataclasses.dataclass(slots=True)
class Records:
    """Columnar record of every node execution (times in ns)."""

    rank: array[int] = dataclasses.field(default_factory=lambda: array("q"))
    pos: array[int] = dataclasses.field(default_factory=lambda: array("q"))
    stream: array[int] = dataclasses.field(default_factory=lambda: array("q"))
    start: array[int] = dataclasses.field(default_factory=lambda: array("q"))
    end: array[int] = dataclasses.field(default_factory=lambda: array("q"))
    wait_start: array[int] = dataclasses.field(default_factory=lambda: array("q"))


def _compute_chains(nodes: list[NodeRec], deps: list[list[int]],
                    dependents: list[list[int]], stream_of: list[int]) -> list[int]:
    """``seg_next[i]``: the compute node that follows node i back to back, or -1.

    Exact only when no other compute node can become ready while a chain runs, so this is done
    for ranks whose compute-stream nodes are totally ordered by their dependencies (each one a
    descendant of the one before it in file order, as tracegen writes them — directly or through
    a blocking collective); links are those where the next node depends on nothing else and
    every other dependent is on another stream (released at the node's end by an event)."""
    seg_next = [-1] * len(nodes)
    comp = [i for i, n in enumerate(nodes)
            if n.type == pb.COMP_NODE and stream_of[i] == COMPUTE_STREAM]
    if not all(_descends(b, a, deps) for a, b in pairwise(comp)):
        return seg_next
    for a, b in pairwise(comp):
        # b waits for a alone; a's other dependents (collectives running alongside b, say)
        # are on other streams and are released by an event at a's end (``_release``).
        if deps[b] == [a] and b in dependents[a] and all(
                stream_of[d] != COMPUTE_STREAM for d in dependents[a] if d != b):
            seg_next[a] = b
    return seg_next


def _descends(b: int, a: int, deps: list[list[int]]) -> bool:
    """Whether node ``b`` depends on node ``a`` (searching only nodes after ``a`` in the file,
    since a file lists dependencies first; the window between two compute nodes is small)."""
    stack, seen = [b], {b}
    while stack:
        for d in deps[stack.pop()]:
            if d == a:
                return True
            if d > a and d not in seen:
                seen.add(d)
                stack.append(d)
    return False


class Simulator:
    def __init__(self, ts: TraceSet, compute: ComputeModel,
                 network: NetworkModel, *, astra_compat: bool = False, contention: bool = True,
                 slowdown: Callable[[int, int], float] | None = None,
                 compute_overrides: dict[int, ComputeModel] | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 interference: Callable[[int], float] | None = None,
                 host_Bps: Callable[[int], float] | None = None,
                 host_cpu_Bps: Callable[[int], float] | None = None) -> None:
        self.ts, self.net, self.astra = ts, network, astra_compat
        self._host_Bps = host_Bps  # a rank's host link, each way (bytes/s; 0: none given)
        # the host memory a rank's CPU ops move a second (bytes/s; 0: none given)
        self._host_cpu_Bps = host_cpu_Bps
        self.contention = contention
        self._slowdown = slowdown
        self._overrides = compute_overrides or {}
        # (group, index, node name, last rank to arrive, its lateness ns, first arrival ns)
        self.coll_waits: list[tuple[str, int, str, int, int, int]] = []
        # per rank: how much longer its compute kernels ran for collectives in flight (ns)
        self.interference_ns: dict[int, int] = {}
        self._compute = compute
        self.engine = Engine()
        self.records = Records()
        self.stream_names: dict[int, str] = {COMPUTE_STREAM: "compute", P2P_STREAM: "p2p"}
        self._stream_ids: dict[str, int] = {"compute": COMPUTE_STREAM, "p2p": P2P_STREAM}
        self.ranks: dict[int, _Rank] = {}
        self._colls: dict[tuple[str, int], _Collective] = {}
        self._sends: dict[tuple[int, int, int], deque[tuple[int, int, int]]] = {}
        self._recvs: dict[tuple[int, int, int], deque[tuple[int, int, int]]] = {}
        self._flows: dict[int, _Flow] = {}
        self._link_flows: dict[tuple[str, int], set[int]] = {}
        self._asking_part: dict[tuple[str, int], int] = {}  # flows on a link asking < all of it
        self._flow_id = 0
        self._progress = progress
        self._total = ts.num_nodes
        self._finished = 0
        self._world = tuple(range(ts.world_size))
        self._present = {r.rank for r in ts.ranks}
        for rt in ts.ranks:
            kappa = interference(rt.rank) if interference is not None and not astra_compat else 0
            self.ranks[rt.rank] = self._prepare(rt.rank, rt.nodes, kappa)

    # ---- set-up -----------------------------------------------------------------------------
    def _stream_id(self, name: str) -> int:
        sid = self._stream_ids.get(name)
        if sid is None:
            sid = self._stream_ids[name] = len(self._stream_ids)
            self.stream_names[sid] = name
        return sid

    def _prepare(self, rank: int, nodes: list[NodeRec], kappa: float = 0.0) -> _Rank:
        pos_of = {n.id: i for i, n in enumerate(nodes)}
        pending = array("q", [0]) * len(nodes)
        dependents: list[list[int]] = [[] for _ in nodes]
        dep_pos: list[list[int]] = []
        stream_of: list[int] = []
        for i, n in enumerate(nodes):
            if n.type in MEM_NAMES and not (self._host_Bps and self._host_Bps(rank) > 0):
                raise ReplayError(
                    f"rank {rank}: node {n.id} ({n.name!r}) is a {MEM_NAMES[n.type]}, a copy "
                    "between the GPU and host memory, and the system gives no host link to run "
                    "it over: set host_link_GBps in the system file's [node] table")
            if (n.type == pb.COMP_NODE and n.attrs.get("is_cpu_op") and n.attrs.get("tensor_size")
                    and not (self._host_cpu_Bps and self._host_cpu_Bps(rank) > 0)):
                raise ReplayError(
                    f"rank {rank}: node {n.id} ({n.name!r}) is a CPU op (is_cpu_op) that moves "
                    f"{n.attrs['tensor_size']} bytes of host memory, and the system gives no "
                    "host CPU rate to time it by: set host_cpu_GBps in the system file's [node] "
                    "table")
            raw = n.data_deps + n.ctrl_deps if n.ctrl_deps else n.data_deps
            deps = [pos_of[d] for d in (set(raw) if len(raw) > 1 else raw)]
            pending[i] = len(deps)
            for d in deps:
                dependents[d].append(i)
            dep_pos.append(deps)
            stream_of.append(self._stream_for(n))
        queues: dict[int, deque[int]] = {s: deque() for s in set(stream_of)}
        # with interference every kernel is an event of its own: no chains to find
        chains = ([-1] * len(nodes) if kappa > 0
                  else _compute_chains(nodes, dep_pos, dependents, stream_of))
        return _Rank(rank, nodes, pending, dependents, stream_of, queues,
                     dict.fromkeys(queues, False), {}, chains, kappa=kappa)

    def _stream_for(self, n: NodeRec) -> int:
        if n.type == pb.COMP_NODE:
            return self._stream_id("cpu") if n.attrs.get("is_cpu_op") else COMPUTE_STREAM
        if n.type == pb.COMM_COLL_NODE:
            return self._stream_id("comm" if self.astra else f"comm:{n.attrs.get('pg_name', '')}")
        if n.type == pb.COMM_SEND_NODE:
            return self._stream_id("comm") if self.astra else P2P_STREAM
        if n.type == pb.COMM_RECV_NODE:  # (ASTRA-sim too: a receive holds no stream)
            return P2P_STREAM
        if n.type in MEM_STREAMS:
            return self._stream_id(MEM_STREAMS[n.type])
        return COMPUTE_STREAM  # METADATA_NODE: zero time

    # ---- run --------------------------------------------------------------------------------
    def run(self) -> int:
        for r in self.ranks.values():
            for i in range(len(r.nodes)):
                if r.pending[i] == 0:
                    self.engine.schedule(0, PRIO_READY, self._ready, (r.rank, i))
        self.engine.run()
        if self._finished != self._total:
            raise ReplayError(self._stuck_report())
        # the last node's end, not the engine's last event: a superseded kernel or flow end
        # (re-rated to an earlier time) is still popped, later, and does nothing
        return max(self.records.end, default=0)

    def _ready(self, t: int, arg: tuple[int, int]) -> list[Event] | None:
        rank, pos = arg
        r = self.ranks[rank]
        sid = r.stream_of[pos]
        if sid == P2P_STREAM:  # point-to-point: posted at once (ASTRA mode: receives)
            return self._post_p2p(t, rank, pos)
        r.queues[sid].append(pos)
        if not r.busy[sid]:
            return self._start_next(t, r, sid)
        return None

    def _start_next(self, t: int, r: _Rank, sid: int) -> list[Event] | None:
        q = r.queues[sid]
        if not q:
            r.busy[sid] = False
            return None
        pos = q.popleft()
        r.busy[sid] = True
        node = r.nodes[pos]
        if node.type == pb.COMP_NODE:
            if sid != COMPUTE_STREAM:  # a CPU op (``_stream_for``)
                return [(t + self._host_op_ns(r.rank, node), PRIO_FINISH, self._finish,
                         (r.rank, pos, sid, t, t))]
            return self._run_compute(t, r, pos, sid)
        if node.type == pb.COMM_COLL_NODE:
            return self._arrive(t, r, pos, sid)
        if node.type == pb.COMM_SEND_NODE:  # ASTRA mode: a send on the comm stream
            return self._post_p2p(t, r.rank, pos)
        if node.type in MEM_STREAMS:
            return self._host_copy(t, r.rank, pos, sid)
        return [(t, PRIO_FINISH, self._finish, (r.rank, pos, sid, t, t))]

    def _host_op_ns(self, rank: int, node: NodeRec) -> int:
        """A CPU op's time: its ``tensor_size`` bytes at the rank's host CPU rate (the host's
        memory bound: optimizer offloading's AdamW), else the trace's ``duration_micros`` (a
        profiled host op; also where the compute model reads the trace's times)."""
        size = int(node.attrs.get("tensor_size", 0))
        if not size or (getattr(self._compute, "source", "model") == "trace"
                        and node.duration_micros):
            return node.duration_micros * NS_PER_US
        assert self._host_cpu_Bps is not None  # (``_prepare`` refused it without a rate)
        return round(size / self._host_cpu_Bps(rank) * 1e9)

    def _host_copy(self, t: int, rank: int, pos: int, sid: int) -> list[Event]:
        """A MEM_STORE / MEM_LOAD node: ``tensor_size`` bytes over the rank's host link, that
        direction's link shared by the copies in flight on it."""
        assert self._host_Bps is not None  # (``_prepare`` refused MEM nodes without one)
        node = self.ranks[rank].nodes[pos]
        size = int(node.attrs.get("tensor_size", 0))
        link = (MEM_STREAMS[node.type], rank)
        cost = CommCost(0, round(size / self._host_Bps(rank) * 1e9), (link,))

        def done(t_end: int) -> list[Event]:
            return [(t_end, PRIO_FINISH, self._finish, (rank, pos, sid, t, t))]

        return self._transfer(t, cost, done)

    def _run_compute(self, t: int, r: _Rank, pos: int, sid: int) -> list[Event]:
        """Start a compute node; a chain of compute nodes that nothing else can interleave with
        (see ``_compute_chains``) runs back to back here, and only its last node gets an event;
        on a rank with interference every kernel is an event of its own (``_start_kernel``)."""
        model = self._overrides.get(r.rank) or self._compute
        slowdown, seg_next, rec = self._slowdown, r.seg_next, self.records
        interfered = r.kappa > 0 and sid == COMPUTE_STREAM
        releases: list[Event] = []
        while True:
            dur = model.duration_ns(r.nodes[pos])
            if slowdown is not None:
                dur = round(dur * slowdown(r.rank, t))
            nxt = seg_next[pos]
            if interfered:
                return [*releases, self._start_kernel(t, r, pos, sid, dur)]
            if nxt < 0:
                return [*releases, (t + dur, PRIO_FINISH, self._finish, (r.rank, pos, sid, t, t))]
            if len(r.dependents[pos]) > 1:  # its other dependents become ready at its end
                releases.append((t + dur, PRIO_FINISH, self._release, (r.rank, pos, nxt)))
            rec.rank.append(r.rank)
            rec.pos.append(pos)
            rec.stream.append(sid)
            rec.start.append(t)
            rec.end.append(t + dur)
            rec.wait_start.append(t)
            r.done += 1
            self._finished += 1
            t += dur
            pos = nxt

    def _start_kernel(self, t: int, r: _Rank, pos: int, sid: int, dur: int) -> Event:
        """Run one compute kernel as an event of its own, at the rate its rank's collectives in
        flight leave it (re-rated by ``_rerate_kernel``)."""
        rate = 1.0 / (1.0 + r.kappa * r.inflight)
        r.kernel = [pos, sid, t, float(dur), rate, t, dur]
        r.kgen += 1
        return (t + round(dur / rate), PRIO_FINISH, self._kernel_end, (r.rank, r.kgen))

    def _kernel_end(self, t: int, arg: tuple[int, int]) -> list[Event]:
        rank, gen = arg
        r = self.ranks[rank]
        if gen != r.kgen or r.kernel is None:
            return []  # superseded by a re-rate
        pos, sid, start, dur = r.kernel[0], r.kernel[1], r.kernel[2], r.kernel[6]
        r.kernel = None
        if t - start != dur:
            self.interference_ns[rank] = self.interference_ns.get(rank, 0) + t - start - dur
        return self._finish(t, (rank, pos, sid, start, start))

    def _rerate_kernel(self, t: int, r: _Rank) -> list[Event]:
        """A collective of rank ``r`` started or ended: its running kernel changes speed."""
        k = r.kernel
        if k is None:
            return []
        k[3] -= (t - k[5]) * k[4]
        k[4] = 1.0 / (1.0 + r.kappa * r.inflight)
        k[5] = t
        r.kgen += 1
        return [(t + max(0, round(k[3] / k[4])), PRIO_FINISH, self._kernel_end, (r.rank, r.kgen))]

    def _release(self, t: int, arg: tuple[int, int, int]) -> list[Event]:
        """A chained compute node ended: dispatch its dependents other than the chain's next."""
        rank, pos, skip = arg
        return self._unblock(t, rank, pos, skip, [])

    def _unblock(self, t: int, rank: int, pos: int, skip: int, out: list[Event]
                 ) -> list[Event]:
        """Count node ``pos`` done for its dependents (but ``skip``); dispatch those it frees."""
        pending = self.ranks[rank].pending
        for d in self.ranks[rank].dependents[pos]:
            if d == skip:
                continue
            pending[d] -= 1
            if pending[d] == 0:
                ev = self._ready(t, (rank, d))
                if ev:
                    out += ev
        return out

    def _finish(self, t: int, arg: tuple[int, int, int, int, int]) -> list[Event]:
        """A node ends: record it, free its stream, and dispatch the dependents it unblocks (in
        the same event: they are ready at t, after the stream's next queued node)."""
        rank, pos, sid, start, wait = arg
        r = self.ranks[rank]
        rec = self.records
        rec.rank.append(rank)
        rec.pos.append(pos)
        rec.stream.append(sid)
        rec.start.append(start)
        rec.end.append(t)
        rec.wait_start.append(wait)
        r.done += 1
        self._finished += 1
        if self._progress and not self._finished & 0xFFFF:
            self._progress(self._finished, self._total)
        out: list[Event] = []
        if r.kappa and r.nodes[pos].type == pb.COMM_COLL_NODE:
            r.inflight -= 1
            out += self._rerate_kernel(t, r)
        if sid != P2P_STREAM and r.busy.get(sid):
            nxt = self._start_next(t, r, sid)
            if nxt:
                out += nxt
        return self._unblock(t, rank, pos, -1, out)

    # ---- collectives ------------------------------------------------------------------------
    def _members(self, rank: int, node: NodeRec) -> tuple[str, tuple[int, ...]]:
        pg = node.attrs.get("pg_name")
        if pg is None or (pg not in self.ts.groups and not self.ts.groups):
            return pg or "world", self._world
        members = self.ts.groups.get(pg)
        if members is None:
            raise ReplayError(f"rank {rank}: node {node.id} ({node.name!r}) uses pg_name {pg!r}, "
                              f"which no comm group defines (known: "
                              f"{', '.join(sorted(self.ts.groups)[:20])}); pass --comm-groups")
        if rank not in members:
            raise ReplayError(f"rank {rank}: node {node.id} ({node.name!r}) issues a collective on "
                              f"group {pg} = {list(members)[:16]}, which does not contain it")
        return pg, members

    def _arrive(self, t: int, r: _Rank, pos: int, sid: int) -> list[Event] | None:
        node = r.nodes[pos]
        pg, members = self._members(r.rank, node)
        k = r.coll_seq.get(pg, 0)
        r.coll_seq[pg] = k + 1
        key = (pg, k)
        c = self._colls.get(key)
        if c is None:
            present = sum(1 for m in members if m in self._present)
            c = self._colls[key] = _Collective(key, members, present, {})
        sig = (node.attrs["comm_type"], node.attrs["comm_size"])
        if c.signature is None:
            c.signature = sig
        elif c.signature != sig:
            other = next(iter(c.arrived))
            raise ReplayError(
                f"collective #{k} on group {pg}: rank {r.rank} issues "
                f"{COLL_TYPE_NAMES[sig[0]]} of {sig[1]} bytes ({node.name!r}) but rank {other} "
                f"issued {COLL_TYPE_NAMES[c.signature[0]]} of {c.signature[1]} bytes; every member "
                "must issue a group's collectives in the same order")
        c.arrived[r.rank] = (pos, t)
        if len(c.arrived) < c.present:
            return None
        del self._colls[key]
        if len(c.arrived) > 1:
            last = max(c.arrived, key=lambda m: (c.arrived[m][1], m))
            first = min(a[1] for a in c.arrived.values())
            self.coll_waits.append((pg, k, node.name, last, t - first, first))
        cost = self.net.collective(COLL_TYPE_NAMES[sig[0]], sig[1], members,
                                   route_of(node.attrs) if "moe_topk" in node.attrs else None)
        kept = [i for i, ln in enumerate(cost.links) if ln[1] in self._present]
        if len(kept) < len(cost.links):
            cost = dataclasses.replace(
                cost, links=tuple(cost.links[i] for i in kept),
                shares=tuple(cost.shares[i] for i in kept) if cost.shares else ())
        arrived = dict(c.arrived)

        def done(t_end: int) -> list[Event]:
            return [(t_end, PRIO_FINISH, self._finish,
                     (m, p, self.ranks[m].stream_of[p], t, wait)) for m, (p, wait) in
                    arrived.items()]

        started: list[Event] = []
        for m in arrived:
            rm = self.ranks[m]
            if rm.kappa:
                rm.inflight += 1
                started += self._rerate_kernel(t, rm)
        return started + self._transfer(t, cost, done)

    # ---- point-to-point ---------------------------------------------------------------------
    def _post_p2p(self, t: int, rank: int, pos: int) -> list[Event] | None:
        node = self.ranks[rank].nodes[pos]
        a = node.attrs
        is_send = node.type == pb.COMM_SEND_NODE
        src = rank if is_send else a["comm_src"]
        dst = a["comm_dst"] if is_send else rank
        key = (src, dst, a.get("comm_tag", 0))
        mine, theirs = (self._sends, self._recvs) if is_send else (self._recvs, self._sends)
        other_q = theirs.get(key)
        if not other_q:
            mine.setdefault(key, deque()).append((rank, pos, t))
            return None
        o_rank, o_pos, o_t = other_q.popleft()
        if not other_q:
            del theirs[key]
        size = a["comm_size"]
        cost = self.net.p2p(src, dst, size)
        sid = self.ranks[rank].stream_of[pos]
        o_sid = self.ranks[o_rank].stream_of[o_pos]

        def done(t_end: int) -> list[Event]:
            return [(t_end, PRIO_FINISH, self._finish, (rank, pos, sid, t, t)),
                    (t_end, PRIO_FINISH, self._finish, (o_rank, o_pos, o_sid, t, o_t))]

        return self._transfer(t, cost, done)

    # ---- shared links (max-min fair on each link) -------------------------------------------
    def _transfer(self, t: int, cost: CommCost, on_done: Callable[[int], list[Event]]
                  ) -> list[Event]:
        if not cost.links or cost.transfer_ns == 0 or not self.contention:
            return on_done(t + cost.total_ns)
        return [(t + cost.latency_ns, PRIO_FLOW, self._flow_begin, (cost, on_done))]

    def _flow_begin(self, t: int, arg: tuple[CommCost, Any]) -> list[Event]:
        cost, on_done = arg
        self._flow_id += 1
        fid = self._flow_id
        shares = dict(zip(cost.links, cost.shares, strict=True)) if cost.shares else None
        self._flows[fid] = _Flow(float(cost.transfer_ns), cost.links, shares, 1.0, t, 0, on_done)
        for ln in cost.links:
            self._link_flows.setdefault(ln, set()).add(fid)
            if shares is not None:
                self._asking_part[ln] = self._asking_part.get(ln, 0) + 1
        return self._rerate(t, cost.links)

    def _rerate(self, t: int, links: tuple[tuple[str, int], ...]) -> list[Event]:
        """Recompute the rate of every flow sharing a link with ``links``; reschedule its end.
        A flow runs at the least, over its links, of the rate each link's max-min fair share
        gives it (``_water_level``): n flows that each need a whole link get 1/n of it, and
        one that needs a tenth of a link beside one that needs all of it keeps its tenth."""
        affected: set[int] = set()
        for ln in links:
            affected |= self._link_flows.get(ln, set())
        levels: dict[tuple[str, int], float] = {}
        out: list[Event] = []
        for fid in sorted(affected):
            f = self._flows[fid]
            f.remaining_ns -= (t - f.since_ns) * f.rate
            f.since_ns = t
            rate = 1.0
            for ln in f.links:
                level = levels.get(ln)
                if level is None:
                    level = levels[ln] = self._water_level(ln)
                rate = min(rate, level / (f.shares[ln] if f.shares else 1.0))
            f.rate = rate
            f.gen += 1
            end = t + max(0, round(f.remaining_ns / f.rate))
            out.append((end, PRIO_FLOW, self._flow_end, (fid, f.gen)))
        return out

    def _water_level(self, ln: tuple[str, int]) -> float:
        """The max-min fair share of link ``ln`` among the flows on it (``water_level``)."""
        ids = self._link_flows[ln]
        if ln not in self._asking_part:  # (the common case: n alike, 1/n each)
            return 1.0 / len(ids) if len(ids) > 1 else math.inf
        flows = [self._flows[fid] for fid in ids]
        return water_level([f.shares[ln] if f.shares else 1.0 for f in flows])

    def _flow_end(self, t: int, arg: tuple[int, int]) -> list[Event]:
        fid, gen = arg
        f = self._flows.get(fid)
        if f is None or f.gen != gen:
            return []  # superseded by a re-rate
        del self._flows[fid]
        for ln in f.links:
            s = self._link_flows[ln]
            s.discard(fid)
            if not s:
                del self._link_flows[ln]
            if f.shares is not None:
                self._asking_part[ln] -= 1
                if not self._asking_part[ln]:
                    del self._asking_part[ln]
        return f.on_done(t) + self._rerate(t, f.links)

    # ---- diagnostics ------------------------------------------------------------------------
    def _stuck_report(self) -> str:
        lines = [f"the trace set cannot finish: {self._total - self._finished} of {self._total} "
                 "nodes never ran"]
        for c in list(self._colls.values())[:6]:
            missing = [m for m in c.members if m in self._present and m not in c.arrived]
            lines.append(f"  collective #{c.key[1]} on group {c.key[0]}: ranks "
                         f"{sorted(c.arrived)[:8]} wait for ranks {missing[:8]} that never "
                         "issue it")
        for (src, dst, tag), q in list(self._recvs.items())[:6]:
            lines.append(f"  rank {dst} waits to receive from rank {src} (tag {tag}, "
                         f"{len(q)} posted) but no matching send was issued")
        for (src, dst, tag) in list(self._sends)[:6]:
            lines.append(f"  rank {src} sends to rank {dst} (tag {tag}) but no matching receive "
                         "was posted")
        for r in list(self.ranks.values()):
            if r.done == len(r.nodes):
                continue
            waiting = [i for i in range(len(r.nodes)) if r.pending[i] > 0][:3]
            names = ", ".join(f"{r.nodes[i].id} ({r.nodes[i].name!r}, "
                              f"{NODE_TYPE_NAMES[r.nodes[i].type]})" for i in waiting)
            lines.append(f"  rank {r.rank}: {len(r.nodes) - r.done} nodes unfinished; blocked "
                         f"on dependencies: {names or 'none'}")
            if len(lines) > 20:
                lines.append("  ...")
                break
        lines.append("a dependency cycle, a collective some member never issues, or a receive "
                     "with no send causes this; check the named nodes")
        uses_pg = any("pg_name" in n.attrs for r in self.ranks.values() for n in r.nodes[:200])
        if uses_pg and not self.ts.groups:
            lines.append("note: the traces name process groups (pg_name) but no comm groups were "
                         "given, so every collective was taken as world-wide; pass --comm-groups "
                         "FILE (ASTRA-sim format) or a trace set with manifest.json")
        return "\n".join(lines)
