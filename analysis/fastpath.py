"""The fast path: a closed-form step-time estimate built from the same operator and collective
costs as replay (no traces, no event loop), for screening large strategy spaces.

Per pipeline stage s and micro-batch: forward F_s and backward B_s are sums of op durations
(replay's GPU model) and blocking collective costs (replay's network model); c is one pipeline
send. The pipeline part (Narayanan et al. 2021 §2.2; Huang et al. 2019):

* 1F1B:  T = Σ_s F_s + Σ_s B_s + (m − 1)·max_s (F_s + B_s) + 2(p − 1)·c
* GPipe: T = Σ_s F_s + (m − 1)·max_s F_s + Σ_s B_s + (m − 1)·max_s B_s + 2(p − 1)·c
* interleaved (v chunks): the per-chunk times replace F_s, B_s and m·v micro-batch chunks run,
  so the bubble shrinks v-fold (Narayanan et al. 2021 Eq. 2).

Stage s ends its last backward Σ_{j<s} (B_j + c) before stage 0 does; its gradient buckets then
drain on the data-parallel stream exactly as the trace issues them, and the optimizer and the
ZeRO parameter all-gather follow. The step ends when the last stage finishes. Where replay and the
fast path legitimately differ (link contention, stragglers), replay is the reference.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from replay.compute import RooflineCompute
from replay.hardware import SystemSpec
from replay.network import AlphaBetaNetwork
from tracegen import ops as O
from tracegen.memory import estimate as memory_estimate
from tracegen.mesh import Mesh
from tracegen.model import ModelSpec
from tracegen.program import ParamBlock, RoleProgram, dp_group_size, sharded_params
from tracegen.schedule import stage_order
from tracegen.strategy import Strategy, check_fits_model
from tracegen.units import DTYPE_CODE, NS_PER_S, GiB


@dataclasses.dataclass(frozen=True, slots=True)
class FastEstimate:
    step_time_s: float
    pipeline_s: float
    peak_memory_GiB: float
    fits: bool
    stage_fwd_s: tuple[float, ...]
    stage_bwd_s: tuple[float, ...]


@functools.lru_cache(maxsize=65536)
def _group_shape(axis: str, rank: int, tp: int, cp: int, dp: int, pp: int, ep: int, tied: bool,
                 moe: bool, gpus_per_node: int) -> tuple[int, ...]:
    """(ranks, nodes spanned, ranks per node, rail-aligned) of ``rank``'s group on ``axis``
    (shared by every strategy with the same degrees: a sweep computes each once)."""
    degrees = Strategy(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, global_batch_size=dp)
    mesh = Mesh(degrees, tied_embeddings=tied, moe=moe)
    members = mesh._members(axis, mesh.coord(rank))
    per_node: dict[int, int] = {}
    for r in members:
        per_node[r // gpus_per_node] = per_node.get(r // gpus_per_node, 0) + 1
    local = max(per_node.values())
    rail = len({r % gpus_per_node for r in members}) == local
    return (len(members), len(per_node), local, rail)


class _Costs:
    def __init__(self, model: ModelSpec, strategy: Strategy, system: SystemSpec,
                 compute: RooflineCompute | None = None, net: AlphaBetaNetwork | None = None
                 ) -> None:
        self.m, self.s = model, strategy
        self.compute = compute or RooflineCompute(system.gpu)
        self.net = net or AlphaBetaNetwork(system)
        self.mesh = Mesh(strategy, tied_embeddings=model.tied_embeddings, moe=model.is_moe)
        self._members: dict[tuple[str, int], tuple[int, ...]] = {}
        self._items: dict[tuple[int, int], int] = {}
        self._shapes: dict[tuple[str, int], tuple[int, ...]] = {}
        self._keep: list[list[O.Item]] = []

    def members(self, axis: str, rank: int) -> tuple[int, ...]:
        key = (axis, rank)
        got = self._members.get(key)
        if got is None:
            got = self._members[key] = self.mesh._members(axis, self.mesh.coord(rank))
        return got

    def items_ns(self, items: list[O.Item], rank: int) -> int:
        """Duration of a list of ops and blocking collectives on ``rank`` (cached: the op lists
        of a strategy are shared objects, one per kind of block)."""
        key = (id(items), rank)
        got = self._items.get(key)
        if got is None:
            got = self._items[key] = self._items_ns(items, rank)
            self._keep.append(items)  # keep the list alive while its id is a key
        return got

    def _items_ns(self, items: list[O.Item], rank: int) -> int:
        total = 0
        for it in items:
            if isinstance(it, O.Comm):
                total += self.coll_ns(it, rank)
            else:
                total += self.compute.op_ns(it.kind, it.flop, it.bytes, it.m, it.n,
                                            DTYPE_CODE[it.dtype], it.name.endswith("_bwd"))
        return total

    def coll_ns(self, c: O.Comm, rank: int) -> int:
        """Collective cost, cached by the group's shape (size, nodes, ranks per node, rails)
        rather than its rank list: the cost depends on nothing else."""
        shape = self._shapes.get((c.axis, rank))
        if shape is None:
            s, m = self.s, self.m
            shape = self._shapes[(c.axis, rank)] = _group_shape(
                c.axis, rank, s.tp, s.cp, s.dp, s.pp, s.ep, m.tied_embeddings, m.is_moe,
                self.net.sys.node.gpus_per_node)
        key = (c.coll, c.size_bytes, shape)
        got = self.net.shape_cache.get(key)
        if got is None:
            got = self.net.collective(c.coll, c.size_bytes, self.members(c.axis, rank)).total_ns
            self.net.shape_cache[key] = got
        return got


def _stage_times(costs: _Costs, prog: RoleProgram, rank: int, stage: int
                 ) -> tuple[list[int], list[int], list[list[tuple[ParamBlock, int]]]]:
    """Per chunk: forward and backward ns of one micro-batch, and the backward blocks with their
    durations (in backward order) for the gradient buckets."""
    s = costs.s
    fwd, bwd, blocks_bwd = [], [], []
    for chunk in range(s.vpp):
        gci = chunk * s.pp + stage
        f = b = 0
        per_block = []
        seen: dict[int, tuple[int, int]] = {}  # the layers of a chunk share one block object
        for block in prog.blocks_of_chunk(gci, labels=False):
            got = seen.get(id(block))
            if got is None:
                got = seen[id(block)] = _block_ns(costs, prog, block, rank)
            f += got[0]
            b += got[1]
            per_block.append((block, got[1]))
        fwd.append(f)
        bwd.append(b)
        blocks_bwd.append(per_block[::-1])
    return fwd, bwd, blocks_bwd


def _block_ns(costs: _Costs, prog: RoleProgram, block: ParamBlock, rank: int) -> tuple[int, int]:
    """(forward, backward) ns of one block for one micro-batch."""
    s = costs.s
    gather = _zero3_gather_ns(costs, block, rank) if s.zero_stage == 3 else 0
    f = gather + costs.items_ns(prog._fwd_items(block), rank)
    b = gather + costs.items_ns(prog._recompute_items(block), rank) + costs.items_ns(
        prog._bwd_items(block), rank)
    if s.zero_stage == 3:  # the next gather waits for this reduce-scatter (same group)
        b += _zero3_scatter_ns(costs, block, rank)
    return f, b


def _zero3_gather_ns(costs: _Costs, block: ParamBlock, rank: int) -> int:
    """ZeRO-3: the 16-bit parameter all-gather of a block (per-rank shard)."""
    return _zero3_ns(costs, block, rank, "ALL_GATHER")


def _zero3_scatter_ns(costs: _Costs, block: ParamBlock, rank: int) -> int:
    """ZeRO-3: the fp32 gradient reduce-scatter of a block (full buffer)."""
    return _zero3_ns(costs, block, rank, "REDUCE_SCATTER")


def _zero3_ns(costs: _Costs, block: ParamBlock, rank: int, coll: O.CollType) -> int:
    total = 0
    for axis, n in (("dp", block.dense), ("edp", block.expert)):
        size = dp_group_size(costs.s, axis)
        if n and size > 1:
            shard = -(-n // size)
            nbytes = (shard * O.PARAM_BYTES if coll == "ALL_GATHER"
                      else shard * size * O.GRAD_REDUCE_BYTES)
            total += costs.coll_ns(O.Comm(coll.lower(), axis, coll, nbytes), rank)
    return total


def _pipeline_ns(s: Strategy, fwd: list[list[int]], bwd: list[list[int]], c: list[int],
                 hidden: int = 0, early: dict[tuple[str, int, int], int] | None = None) -> int:
    """``hidden``: ZeRO-3 gathers that run while a stage waits for its input during the fill and
    the drain (the first gather of a pass does not depend on the received tensor)."""
    p, m = s.pp, s.num_microbatches
    if s.schedule == "interleaved_1f1b":
        return max(_interleaved_ends(s, fwd, bwd, c, early))
    f_s = [sum(f) for f in fwd]
    b_s = [sum(b) for b in bwd]
    comm = 2 * sum(c[: p - 1]) - hidden
    if s.schedule == "gpipe":
        return sum(f_s) + (m - 1) * max(f_s) + sum(b_s) + (m - 1) * max(b_s) + comm
    return sum(f_s) + sum(b_s) + (m - 1) * max(f + b for f, b in zip(f_s, b_s, strict=True)) + comm


def _interleaved_ends(s: Strategy, fwd: list[list[int]], bwd: list[list[int]], c: list[int],
                      early: dict[tuple[str, int, int], int] | None = None) -> list[int]:
    return _interleaved(s, fwd, bwd, c, early)[0]


def _interleaved(s: Strategy, fwd: list[list[int]], bwd: list[list[int]], c: list[int],
                 early: dict[tuple[str, int, int], int] | None = None
                 ) -> tuple[list[int], dict[tuple[str, int, int], int]]:
    """End of each stage's last backward under Megatron's interleaved order: each step waits for
    its stage's previous step and for the neighbouring chunk's same micro-batch (+ one send).
    Exact for the pipeline part; O(p·m·v)."""
    p, m, v = s.pp, s.num_microbatches, s.vpp
    orders = [stage_order(s.schedule, m=m, p=p, v=v, stage=st) for st in range(p)]
    done: dict[tuple[str, int, int], int] = {}  # (phase, mb, global chunk) → end ns
    pos, clock = [0] * p, [0] * p
    n_chunks = p * v
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for st in range(p):
            while pos[st] < len(orders[st]):
                phase, mb, chunk = orders[st][pos[st]]
                gci = chunk * p + st
                dep = (phase, mb, gci - 1) if phase == "F" else (phase, mb, gci + 1)
                needs = (phase == "F" and gci > 0) or (phase == "B" and gci < n_chunks - 1)
                if needs and dep not in done:
                    break
                # the link crossed: into stage st (forward) or out of it (backward)
                hop = c[(st - 1) % p] if phase == "F" else c[st]
                dur = fwd[st][chunk] if phase == "F" else bwd[st][chunk]
                g = early.get((phase, st, chunk), 0) if early else 0  # runs before the input
                start = max(clock[st] + g, done[dep] + hop if needs else 0)
                clock[st] = start + dur - g
                done[(phase, mb, gci)] = clock[st]
                pos[st] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - the schedules are deadlock-free
            raise RuntimeError("interleaved schedule did not progress")
    return clock, done


def estimate(model: ModelSpec, strategy: Strategy, system: SystemSpec, **kw: Any) -> FastEstimate:
    """Step time and memory of one strategy without generating a trace."""
    check_fits_model(strategy, model)
    s = strategy
    costs = _Costs(model, s, system, **kw)
    reps = [costs.mesh.rank_of(pp=st, dp=0, cp=0, tp=0) for st in range(s.pp)]
    prog = RoleProgram(model, s, 0)  # blocks and op lists do not depend on the stage
    progs = [prog] * s.pp
    times = [_stage_times(costs, progs[st], reps[st], st) for st in range(s.pp)]
    p2p_bytes = progs[0]._p2p_bytes()
    # c[s]: one send between stage s and stage s + 1 (wrapping, for interleaved chunks)
    c = [costs.net.p2p(reps[st], reps[(st + 1) % s.pp], p2p_bytes).total_ns if s.pp > 1 else 0
         for st in range(s.pp)]
    hidden = 0
    early: dict[tuple[str, int, int], int] = {}  # ZeRO-3 gathers that need no received input
    if s.zero_stage == 3 and s.pp > 1:
        for st in range(s.pp):
            for ch in range(s.vpp):
                blocks = progs[st].blocks_of_chunk(ch * s.pp + st, labels=False)
                early[("F", st, ch)] = _zero3_gather_ns(costs, blocks[0], reps[st])
                early[("B", st, ch)] = _zero3_gather_ns(costs, blocks[-1], reps[st])
        hidden = sum(early[("F", st, 0)] for st in range(1, s.pp)) + sum(
            early[("B", st, 0)] for st in range(s.pp - 1))
    pipe = _pipeline_ns(s, [t[0] for t in times], [t[1] for t in times], c, hidden, early)
    b_s = [sum(t[1]) for t in times]
    # When each chunk's last backward ends, per stage (its gradient buckets are issued then).
    chunk_ends: list[list[int]] = []
    if s.schedule == "interleaved_1f1b":
        ends, done = _interleaved(s, [t[0] for t in times], [t[1] for t in times], c, early)
        last_mb = s.num_microbatches - 1
        chunk_ends = [[done[("B", last_mb, ch * s.pp + st)] for ch in range(s.vpp)]
                      for st in range(s.pp)]
    else:
        ends = [pipe - sum(b_s[:st]) - sum(c[:st]) for st in range(s.pp)]
        chunk_ends = [[e] for e in ends]
    params = [prog.params_of_stage(st) for st in range(s.pp)]
    finish = _tails(costs, [sharded_params(s, p) for p in params], reps, times, ends, chunk_ends)
    peak = max(memory_estimate(model, s, st, sum(params[st].values())).total_bytes
               for st in range(s.pp))
    return FastEstimate(max(finish) / NS_PER_S, pipe / NS_PER_S, peak / GiB,
                        peak <= system.gpu.hbm_bytes,
                        tuple(sum(t[0]) / NS_PER_S for t in times),
                        tuple(b / NS_PER_S for b in b_s))


def _tails(costs: _Costs, local_params: list[int], reps: list[int],
           times: list[tuple[list[int], list[int], list[list[tuple[ParamBlock, int]]]]],
           ends: list[int], chunk_ends: list[list[int]]) -> list[int]:
    """Per stage: gradient buckets drained after the last backward, embedding all-reduce,
    optimizer and ZeRO parameter all-gather."""
    s, m = costs.s, costs.m
    dp_done = [_buckets_done(costs, reps[st], times[st][2], chunk_ends[st], times[st][1])
               for st in range(s.pp)]
    chain = list(ends)
    if m.tied_embeddings and s.pp > 1:
        size = m.vocab_size * m.hidden_size // s.tp * O.GRAD_REDUCE_BYTES
        t = max(ends[0], ends[-1]) + costs.coll_ns(
            O.Comm("e", "embd", "ALL_REDUCE", size), reps[0])
        chain[0] = chain[-1] = t
    out = []
    for st in range(s.pp):
        done, gathers = dp_done[st]
        opt = costs.items_ns([O.optimizer_step(local_params[st])], reps[st])
        t = max(chain[st], done) + opt
        for axis, padded in gathers:
            shard = padded // dp_group_size(s, axis) * O.PARAM_BYTES
            t += costs.coll_ns(O.Comm("ag", axis, "ALL_GATHER", shard), reps[st])
        out.append(t)
    return out


def _buckets_done(costs: _Costs, rank: int, blocks: list[list[tuple[ParamBlock, int]]],
                  chunk_ends: list[int], chunk_bwd: list[int]) -> tuple[int, list[tuple[str, int]]]:
    """When the data-parallel stream finishes the buckets of each chunk's last backward
    (serially, in the order the trace issues them), and the ZeRO ≥ 1 gathers that follow."""
    s = costs.s
    end = max(chunk_ends)
    if s.zero_stage == 3:
        return end, []
    stream = {"dp": 0, "edp": 0}
    gathers: list[tuple[str, int]] = []
    bucket_cost: dict[tuple[str, int], int] = {}
    for chunk in sorted(range(len(chunk_ends)), key=lambda ch: chunk_ends[ch]):
        t = chunk_ends[chunk] - chunk_bwd[chunk]
        acc = {"dp": 0, "edp": 0}
        for i, (block, dur) in enumerate(blocks[chunk]):
            t += dur
            acc["dp"] += block.dense
            acc["edp"] += block.expert
            last = i == len(blocks[chunk]) - 1
            for axis in ("dp", "edp"):
                if not acc[axis] or not (last or acc[axis] >= s.dp_bucket_params):
                    continue
                size = dp_group_size(s, axis)
                n, acc[axis] = acc[axis], 0
                if size < 2:
                    continue
                padded = -(-n // size) * size
                d = bucket_cost.get((axis, padded))
                if d is None:
                    coll: O.CollType = "REDUCE_SCATTER" if s.zero_stage >= 1 else "ALL_REDUCE"
                    d = bucket_cost[(axis, padded)] = costs.coll_ns(
                        O.Comm("g", axis, coll, padded * O.GRAD_REDUCE_BYTES), rank)
                issue = t if s.overlap_grad_reduce else end
                stream[axis] = max(stream[axis], issue) + d
                if s.zero_stage >= 1:
                    gathers.append((axis, padded))
    return max(end, *stream.values()), gathers
