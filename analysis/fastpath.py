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

This module costs the stages (memoized across a sweep); ``analysis/pipeline_walk.py`` holds the
schedule closed forms and the interleaved walk, ``analysis/dp_tails.py`` what follows each
stage's last backward (gradient buckets, optimizer, parameter gathers).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from analysis.dp_tails import BucketRun, slowed, tails_ns
from analysis.pipeline_walk import (
    Opened,
    Tails,
    Z3Runs,
    first_forwards,
    interleaved,
    pipeline_ns,
    plain_tails,
    span_ns,
)
from replay.compute import RooflineCompute
from replay.hardware import SystemSpec
from replay.network import AlphaBetaNetwork, ranges_shape
from tracegen import ops as O
from tracegen.memory import activation_bytes_per_layer
from tracegen.memory import total_bytes as memory_total_bytes
from tracegen.mesh import Mesh
from tracegen.model import ModelSpec
from tracegen.program import (
    ParamBlock,
    RoleProgram,
    bucket_plan,
    dp_group_size,
    gather_pieces,
)
from tracegen.strategy import Strategy, check_fits_model
from tracegen.units import DTYPE_CODE, NS_PER_S, GiB


class FastEstimate(NamedTuple):
    """One strategy's estimate (a named tuple: a sweep builds one per strategy, and a tuple is
    the cheapest immutable record Python builds)."""

    step_time_s: float
    pipeline_s: float
    peak_memory_GiB: float
    fits: bool
    stage_fwd_s: tuple[float, ...]
    stage_bwd_s: tuple[float, ...]


def _group_shape(axis: str, rank: int, tp: int, cp: int, dp: int, pp: int, ep: int, tied: bool,
                 moe: bool, gpus_per_node: int, expert_tp: int
                 ) -> tuple[int, int, int, bool]:
    """(ranks, nodes spanned, ranks per node, rail-aligned) of ``rank``'s group on ``axis``
    (shared by every strategy with the same degrees: a sweep computes each once)."""
    degrees = Strategy(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, global_batch_size=dp,
                       expert_tp=expert_tp, sequence_parallel=tp > 1)
    mesh = Mesh(degrees, tied_embeddings=tied, moe=moe)
    return ranges_shape(mesh.member_ranges(axis, mesh.coord(rank)), gpus_per_node)


# A list of ops as it runs: (compute on the critical path?, ns) in order
Segments = tuple[tuple[bool, int], ...]
# The same list for slowing by streams outside it (``_slowed_runs``): (kernel ns, ns of the
# overlapped collectives issued with it) in order; a blocking collective is (0, ns)
Runs = tuple[tuple[int, int], ...]


def _extend(out: list[tuple[bool, int]], comp: bool, ns: int) -> None:
    """Append a segment, merged into the last one when of the same kind."""
    if out and out[-1][0] == comp:
        out[-1] = (comp, out[-1][1] + ns)
    elif ns:
        out.append((comp, ns))


class _Stage(NamedTuple):
    """What one pipeline stage costs per micro-batch, per chunk (shared by every stage, and every
    strategy, with the same blocks, layer shapes and group shapes)."""

    fwd: tuple[int, ...]
    bwd: tuple[int, ...]
    # Per chunk, in backward order: (block, backward ns of one, how many in a row).
    runs_bwd: tuple[tuple[tuple[ParamBlock, int, int], ...], ...]
    early_f: tuple[int, ...]  # ZeRO-3: the gather of the chunk's first block (needs no input)
    early_b: tuple[int, ...]  # ZeRO-3: the gather of the chunk's last block
    late_b: tuple[int, ...]  # ZeRO-3: the last reduce-scatter of a backward (after the send)
    params: tuple[tuple[str, int], ...]  # ("dp", n), ("edp", n) before sharding
    fwd_s: float = 0.0  # all chunks, one micro-batch
    bwd_s: float = 0.0
    total_params: int = 0  # Σ params (the memory model's params_local)
    layers: int = 0  # transformer layers over all chunks (the memory model's)
    # per chunk: the share of a backward that is compute on the critical path (interference)
    busy_b: tuple[float, ...] = ()
    # ZeRO-3, per chunk: how much of ``late_b`` the next backward hides when backwards run back
    # to back (GPipe; ``_trailing_overlap``)
    overlap_b: tuple[int, ...] = ()
    # per chunk: the share of a forward that is compute on the critical path (the parameter
    # gathers of ``overlap_param_gather`` slow it)
    busy_f: tuple[float, ...] = ()
    # ZeRO-3 without prefetch on a MoE model, per chunk, for the schedule walk: the forward's
    # and the backward's blocks as the dense and expert streams see them (``_zero3_runs``)
    z3_f: tuple[Z3Runs, ...] = ()
    z3_b: tuple[Z3Runs, ...] = ()
    # and per chunk, each pass's leading blocks that gather and scatter nothing (a tied head's
    # backward): (their ns, the compute on the critical path in it), or (0, 0) (``_z3_lead``)
    z3_lead_f: tuple[tuple[int, int], ...] = ()
    z3_lead_b: tuple[tuple[int, int], ...] = ()
    # ZeRO-3 with prefetch, per chunk: a backward started with the streams still busy from the
    # pass before ends, and ends its compute, these ns after the streams free at the latest
    # (``_prefetched_chunk``; the schedule walk's ``hide``)
    after_tail_b: tuple[tuple[int, int], ...] = ()


class _Context:
    """The GPU and network models of one system and the memos a sweep shares across strategies.
    Every memo key holds all that its value depends on, so sharing is exact."""

    def __init__(self, system: SystemSpec) -> None:
        self.compute = RooflineCompute(system.gpu)
        self.net = AlphaBetaNetwork(system)
        self.blocks: dict[tuple[object, ...], tuple[int, int, int, int]] = {}
        self.lists: dict[tuple[object, ...], tuple[int, int]] = {}
        # the same key → the list as (kernel, overlapped collective) runs (``_Costs.list_runs``)
        self.runs: dict[tuple[object, ...], Runs] = {}
        self.optimizer: dict[int, int] = {}
        # (op-list key, recompute) → stored activation bytes of one layer and micro-batch
        self.activations: dict[tuple[int, str], int] = {}
        # (op-list key, chunk) → the chunk's parameter blocks (``_Costs.chunk_runs``)
        self.chunks: dict[tuple[object, ...], list[tuple[ParamBlock, int]]] = {}
        self.p2p: dict[int, int] = {}  # op-list key → bytes of one pipeline send
        # op-list key → the first program built with it: its op lists (built lazily, all of a
        # kind at once) serve every later strategy with that key (``_Costs._items``)
        self.programs: dict[int, RoleProgram] = {}
        # ZeRO-3: (costs key, layout, rank, block parameters, collective) → (dense, expert) ns
        self.zero3: dict[tuple[object, ...], tuple[int, int]] = {}
        # overlap_param_gather: a stage's gather timeline; a strategy's walk inputs (``_opened``)
        self.gathers: dict[tuple[object, ...],
                           tuple[list[list[ParamBlock]], list[list[int]], list[int]]] = {}
        self.opened: dict[tuple[object, ...], Opened] = {}
        # (same node?, bytes) → ns of one send: a point-to-point cost depends on nothing else
        self.sends: dict[tuple[bool, int], int] = {}
        self.calls = 0  # strategies estimated (the memo limit is checked now and then)
        # a stage chunk's gradient buckets from its start: id(runs) → (runs, bucket runs)
        self.buckets: dict[tuple[int, str, int], tuple[object, list[BucketRun]]] = {}
        self.stages: dict[tuple[object, ...], _Stage] = {}
        # a strategy's stage list (``_stages``) by all it depends on: ZeRO 0 / 1 / 2 pairs and
        # strategies differing only in the batch, schedule or buckets share it
        self.layouts: dict[tuple[object, ...], tuple[list[_Stage], list[int], bool]] = {}
        self.tails: dict[tuple[object, ...], tuple[int, int, int]] = {}
        # a walked pipeline's cooldowns under interference (``dp_tails._cooldowns``)
        self.cooldowns: dict[tuple[object, ...], dict[int, tuple[int, int, int]]] = {}
        self.afters: dict[tuple[object, ...], int] = {}  # ``dp_tails._after_memo``
        # id(stage list of ``layouts``) → whether its 1F1B sends pace the pipeline
        self.paced: dict[int, bool] = {}
        # layout (degrees) → (axis, rank) → group shape
        self.shapes: dict[tuple[object, ...],
                          dict[tuple[str, int], tuple[int, int, int, bool]]] = {}
        self.walks: dict[tuple[object, ...],
                         tuple[list[int], list[list[int]], Tails | None]] = {}
        self._models: dict[int, tuple[ModelSpec, int]] = {}
        self._interned: dict[tuple[object, ...], int] = {}

    def entries(self) -> int:
        return (len(self.blocks) + len(self.stages) + len(self.tails) + len(self.lists)
                + len(self.layouts) + len(self.paced) + len(self.programs) + len(self.zero3)
                + len(self.cooldowns) + len(self.afters)
                + len(self.gathers) + len(self.opened)
                + len(self.optimizer) + len(self.buckets) + len(self.shapes) + len(self.walks)
                + len(self.activations) + len(self.chunks) + len(self.p2p) + len(self.sends)
                + len(self.runs))

    def model_id(self, model: ModelSpec) -> int:
        """A small integer per model (by identity first: hashing a spec per strategy is slow)."""
        got = self._models.get(id(model))
        if got is None or got[0] is not model:
            got = self._models[id(model)] = (model, self.intern((model,)))
        return got[1]

    def intern(self, key: tuple[object, ...]) -> int:
        """A small integer for a long key (hashed once per strategy, not in every lookup)."""
        return self._interned.setdefault(key, len(self._interned))


_CONTEXTS: dict[int, tuple[SystemSpec, _Context]] = {}


MEMO_LIMIT = 500_000  # entries per context before it starts afresh (bounds a long session)
# how often the limit is checked (counting every memo on every call was 1.5% of the work; one
# strategy adds a few dozen entries at most, so the overshoot is a few percent of the limit)
MEMO_CHECK_EVERY = 256


def _context(system: SystemSpec) -> _Context:
    """The context of a system object (by identity first: hashing a system per call is slow)."""
    got = _CONTEXTS.get(id(system))
    if got is not None and got[0] is system:
        ctx = got[1]
        ctx.calls += 1
        if ctx.calls % MEMO_CHECK_EVERY or ctx.entries() <= MEMO_LIMIT:
            return ctx
        _CONTEXTS.clear()
    same = next((ctx for sys, ctx in _CONTEXTS.values() if sys == system), None)
    if len(_CONTEXTS) > 16:
        _CONTEXTS.clear()
    ctx = same or _Context(system)
    _CONTEXTS[id(system)] = (system, ctx)  # holding the system keeps its id from being reused
    return ctx


def clear_cache() -> None:
    """Forget every memo (benchmarks call this to time a cold sweep)."""
    _CONTEXTS.clear()


class _Costs:
    """Costs of one strategy: op lists and blocks from its program, durations from the models."""

    def __init__(self, model: ModelSpec, strategy: Strategy, system: SystemSpec) -> None:
        self.m, self.s = model, strategy
        self.ctx = _context(system)
        self.compute, self.net = self.ctx.compute, self.ctx.net
        self.gpn = system.node.gpus_per_node
        self._prog: RoleProgram | None = None  # built on the first memo miss that needs it
        s = strategy
        # What a block's cost depends on besides its group shapes (not pp, vpp, schedule, batch;
        # dp only through ZeRO-3's gathers); its op lists' costs do not depend on recompute.
        self.lists_key = self.ctx.intern((self.ctx.model_id(model), O.op_key(s)))
        self.key = self.ctx.intern((self.lists_key, s.recompute,
                                    (s.dp, s.zero3_gather_bucket_params, s.grad_reduce_in_bf16,
                                     s.zero3_prefetch)
                                    if s.zero_stage == 3 else 0))
        self.moe = model.is_moe
        # all a group's shape depends on besides its axis and rank
        self._degrees = (s.tp, s.cp, s.dp, s.pp, s.ep, model.tied_embeddings, self.moe,
                         self.gpn, s.expert_tp)
        # the shapes of this layout's groups (the layout is hashed once per strategy, not per
        # lookup)
        self._shapes = self.ctx.shapes.setdefault(self._degrees, {})

    @property
    def prog(self) -> RoleProgram:
        """Blocks and op lists (the same on every stage), built only when a memo misses: a
        strategy whose costs are all shared with earlier ones of the sweep never needs it."""
        if self._prog is None:
            self._prog = RoleProgram(self.m, self.s, 0)
        return self._prog

    def p2p_bytes(self) -> int:
        """One pipeline send (it reads the model, micro-batch, cp, tp and sp: the op-list key)."""
        got = self.ctx.p2p.get(self.lists_key)
        if got is None:
            got = self.ctx.p2p[self.lists_key] = self.prog._p2p_bytes()
        return got

    def shape(self, axis: str, rank: int) -> tuple[int, int, int, bool]:
        got = self._shapes.get((axis, rank))
        if got is None:
            got = self._shapes[axis, rank] = _group_shape(axis, rank, *self._degrees)
        return got

    def signature(self, rank: int) -> int:
        """The shapes of ``rank``'s groups on the axes a stage's blocks use (the data-parallel
        ones only where ZeRO-3 gathers inside the blocks): all their collectives depend on —
        interned, so the memo keys that hold it hash an int."""
        axes = ("tp", "cp", "ep", "dp", "edp") if self.s.zero_stage == 3 else ("tp", "cp", "ep")
        return self.ctx.intern(tuple([self.shape(axis, rank) for axis in axes]))

    def items_ns(self, items: list[O.Item], rank: int) -> int:
        return self.items_cost(items, rank)[0]

    def items_cost(self, items: list[O.Item], rank: int) -> tuple[int, int]:
        """(duration, compute on the critical path) of a list of ops and collectives on
        ``rank``: the sums of its segments (``items_segments``), all of them and the compute
        ones — the compute time that another collective in flight would slow (``slowed``)."""
        total = busy = 0
        for comp, d in self.items_segments(items, rank):
            total += d
            if comp:
                busy += d
        return total, busy

    def coll_ns(self, c: O.Comm, rank: int) -> int:
        """Collective cost by the group's shape (size, nodes, ranks per node, rails) rather than
        its rank list: the cost depends on nothing else."""
        return self.net.shape_ns(c.coll, c.size_bytes, self.shape(c.axis, rank))

    def stage(self, stage: int, rank: int, sig: int) -> _Stage:
        s, n_chunks = self.s, self.s.pp * self.s.vpp
        layers = self.m.num_layers
        uneven = s.first_stage_layers or s.last_stage_layers
        comp: tuple[object, ...]
        if s.vpp == 1 and not uneven:
            # the common case, spelled out: one chunk of layers / pp (a flat key; the general
            # one is a tuple of such tuples, so the two never collide)
            gcis: tuple[int, ...] = (stage,)
            comp = (layers // n_chunks, stage == 0, stage == n_chunks - 1, n_chunks == 1)
            chunks: tuple[tuple[object, ...], ...] = (comp,)
        else:
            gcis = (stage,) if s.vpp == 1 else tuple(ch * s.pp + stage for ch in range(s.vpp))
            comp = chunks = tuple([(len(s.chunk_layers(layers, g)) if uneven
                                    else layers // n_chunks,
                                    g == 0, g == n_chunks - 1, n_chunks == 1) for g in gcis])
        key = (self.key, comp, sig)
        got = self.ctx.stages.get(key)
        if got is None:
            got = self.ctx.stages[key] = _stage_costs(self, gcis, chunks, rank, sig)
        return got

    def chunk_runs(self, gci: int, chunk: tuple[object, ...]) -> list[tuple[ParamBlock, int]]:
        """``RoleProgram.chunk_runs`` shared by every strategy with the same model, tp, ep and
        chunk (layer count, first, last, only): its blocks depend on nothing else."""
        key = (self.lists_key, chunk)
        got = self.ctx.chunks.get(key)
        if got is None:
            got = self.ctx.chunks[key] = self.prog.chunk_runs(gci)
        return got

    def block(self, block: ParamBlock, rank: int, sig: int
              ) -> tuple[int, int, int, int]:
        """(forward, backward, and the compute on the critical path of each) of one block."""
        key = (self.key, block.name, block.dense, block.expert, sig)
        got = self.ctx.blocks.get(key)
        if got is None:
            got = self.ctx.blocks[key] = (*_block_ns(self, block, rank, sig),
                                          *_compute_busy(self, block, rank, sig))
        return got

    def optimizer_ns(self, params: int) -> int:
        """The optimizer step over ``params`` local parameters (memo: it depends on nothing
        else)."""
        got = self.ctx.optimizer.get(params)
        if got is None:
            got = self.ctx.optimizer[params] = self.items_ns([O.optimizer_step(params)], 0)
        return got

    def list_ns(self, block: ParamBlock, which: str, rank: int, sig: int) -> int:
        """Duration of one of a block's op lists ("fwd", "bwd", "selective": the recomputed
        core attention), shared by strategies that differ only in recompute or data parallelism
        (the op lists are built only on a miss)."""
        key = (self.lists_key, block.name, which, sig)
        got = self.ctx.lists.get(key)
        if got is None:
            got = self.ctx.lists[key] = self.items_cost(self._items(block, which), rank)
        return got[0]

    def _items(self, block: ParamBlock, which: str) -> list[O.Item]:
        """A block's op list, from the program of the first strategy with this op-list key (the
        lists depend on nothing else, and a program builds the non-layer ones together)."""
        prog = self.ctx.programs.get(self.lists_key)
        if prog is None:
            prog = self.ctx.programs[self.lists_key] = self.prog
        return (prog._fwd_items(block) if which == "fwd" else prog._bwd_items(block)
                if which == "bwd" else prog._lists["selective"])

    def list_runs(self, block: ParamBlock, which: str, rank: int, sig: int
                  ) -> Runs:
        """``list_ns``'s list as it runs, for slowing by other streams (``items_runs``)."""
        key = (self.lists_key, block.name, which, sig)
        got = self.ctx.runs.get(key)
        if got is None:
            got = self.ctx.runs[key] = self.items_runs(self._items(block, which), rank)
        return got

    def items_runs(self, items: list[O.Item], rank: int) -> Runs:
        """A list of ops and collectives on ``rank`` as (kernel ns, overlapped collective ns)
        runs: each kernel unslowed, beside the overlapped collectives issued just before it —
        so that streams outside the list slow it together with them (replay/sim.py counts
        every collective in flight: 1/(1 + κ·n)). Neighbouring kernels alone merge, and so do
        neighbouring collectives alone; alone, a run costs what ``items_segments`` charges."""
        out: list[tuple[int, int]] = []
        alongside = 0
        for it in items:
            if isinstance(it, O.Comm):
                if it.overlapped:
                    alongside += self.coll_ns(it, rank)
                    continue
                d, c = 0, max(self.coll_ns(it, rank), alongside)
            else:
                d = self.compute.op_ns(it.kind, it.flop, it.bytes, it.m, it.n,
                                       DTYPE_CODE[it.dtype], it.name.endswith("_bwd"), it.k,
                                       it.splits)
                c = alongside
            alongside = 0
            if out and not c and not out[-1][1]:
                out[-1] = (out[-1][0] + d, 0)
            elif out and not d and not out[-1][0]:
                out[-1] = (0, out[-1][1] + c)
            elif d or c:
                out.append((d, c))
        if alongside:
            if out and not out[-1][0]:
                out[-1] = (0, out[-1][1] + alongside)
            else:
                out.append((0, alongside))
        return tuple(out)

    def items_segments(self, items: list[O.Item], rank: int) -> Segments:
        """A list of ops and collectives on ``rank`` as it runs: (compute?, ns) segments in
        order, neighbours of one kind merged. Blocking items follow one another; an overlapped
        collective and the item after it take the longer of the two, the kernel slowed by
        interference while the collective runs (replay/sim.py: at 1/(1 + κ) of its speed, so a
        kernel d beside a collective c takes d + min(κ·d, κ/(1 + κ)·c)) — a compute segment
        where the kernel is the longer, communication where the collective is. A collective
        outside the list slows only the compute (replay slows kernels, not transfers)."""
        kappa = self.compute.gpu.comm_interference
        out: list[tuple[bool, int]] = []
        for d, c in self.items_runs(items, rank):
            if d and c and kappa:
                d += round(min(kappa * d, kappa / (1 + kappa) * c))
            _extend(out, d >= c, max(d, c))
        return tuple(out)

    def list_busy(self, block: ParamBlock, which: str, rank: int, sig: int
                  ) -> int:
        """The compute on the critical path of ``list_ns``'s list (``items_cost``)."""
        self.list_ns(block, which, rank, sig)
        return self.ctx.lists[self.lists_key, block.name, which, sig][1]


def _stage_costs(costs: _Costs, gcis: tuple[int, ...], chunks: tuple[tuple[object, ...], ...],
                 rank: int, sig: int) -> _Stage:
    """Per chunk: forward and backward ns of one micro-batch, and the backward runs of blocks
    with their durations for the gradient buckets."""
    zero3 = costs.s.zero_stage == 3
    prefetch = zero3 and costs.s.zero3_prefetch
    fwd, bwd, runs_bwd, early_f, early_b, late_b = [], [], [], [], [], []
    overlap_b: list[int] = []
    after_tail: list[tuple[int, int]] = []
    phi: list[float] = []  # the share of compute in a backward: it slows buckets (``dp_tails``)
    phi_f: list[float] = []  # and in a forward
    params = {"dp": 0, "edp": 0}
    layers = 0
    for gci, key in zip(gcis, chunks, strict=True):
        f = b = u = uf = 0
        runs = []
        chunk = costs.chunk_runs(gci, key)
        for block, count in chunk:
            bf, bb, uff, ub = costs.block(block, rank, sig)
            f += count * bf
            b += count * bb
            u += count * ub
            uf += count * uff
            runs.append((block, bb, count))
            params["dp"] += count * block.dense
            params["edp"] += count * block.expert
            if block.name == "layer":
                layers += count
        runs_bwd.append(tuple(runs[::-1]))
        phi.append(u / b if b else 0.0)
        phi_f.append(uf / f if f else 0.0)
        if prefetch:
            chunk_f, chunk_b, first_f, first_b, tail_b, hidden_b, last_b = _prefetched_chunk(
                costs, chunk, rank, sig)
            fwd.append(chunk_f)
            bwd.append(chunk_b)
            early_f.append(first_f)
            early_b.append(first_b)
            late_b.append(tail_b)
            overlap_b.append(hidden_b)  # one stage's closed form (GPipe back to back)
            after_tail.append((chunk_b - hidden_b, last_b))  # a pipeline's walk
            continue
        fwd.append(f)
        bwd.append(b)
        early_f.append(_zero3_ns(costs, chunk[0][0], rank, "ALL_GATHER") if zero3 else 0)
        early_b.append(_zero3_ns(costs, chunk[-1][0], rank, "ALL_GATHER") if zero3 else 0)
        # the dense and expert reduce-scatters run on their own groups' streams, side by side
        late_b.append(max(_zero3_axes(costs, chunk[0][0], rank, "REDUCE_SCATTER")) if zero3
                      else 0)
        overlap_b.append(_trailing_overlap(costs, chunk, rank, sig) if zero3 else 0)
    stage = _Stage(tuple(fwd), tuple(bwd), tuple(runs_bwd), tuple(early_f), tuple(early_b),
                   tuple(late_b),
                   tuple(params.items()), sum(fwd) / NS_PER_S, sum(bwd) / NS_PER_S,
                   params["dp"] + params["edp"], layers, tuple(phi), tuple(overlap_b),
                   tuple(phi_f))
    if prefetch:
        stage = stage._replace(after_tail_b=tuple(after_tail))
    if zero3 and costs.moe and not prefetch:  # the passes the two-stream walk steps through
        blocks = [costs.chunk_runs(gci, key) for gci, key in zip(gcis, chunks, strict=True)]
        stage = stage._replace(
            z3_f=tuple(_zero3_runs(costs, b, rank, sig, backward=False) for b in blocks),
            z3_b=tuple(_zero3_runs(costs, b[::-1], rank, sig, backward=True) for b in blocks),
            z3_lead_f=tuple(_z3_lead(costs, b, rank, sig, backward=False) for b in blocks),
            z3_lead_b=tuple(_z3_lead(costs, b[::-1], rank, sig, backward=True) for b in blocks))
    return stage


def _trailing_overlap(costs: _Costs, chunk: list[tuple[ParamBlock, int]], rank: int,
                      sig: int) -> int:
    """ZeRO-3 without prefetch, backward passes back to back (GPipe): how much of a pass's
    trailing reduce-scatters (its last block's, ``late_b``) the next pass hides — its leading
    blocks compute until one gathers on a stream still busy with them (each group's
    collectives in order on its own stream). 0 where the next pass gathers at once. With
    interference those leading kernels run slowed beside the scatters (replay/sim.py: a kernel
    d beside a collective c takes d + min(κ·d, κ/(1 + κ)·c)), so the first gather on a stream
    starts at max(lead + slow, scatter): the pass loses max(slow, scatter − lead) of the
    scatter it hides. (Without the slowdown a tied-embedding model's GPipe run on one stage was
    0.6–0.8% too fast: its head, which gathers nothing, hides the embedding's scatter.)"""
    scatter = _zero3_axes(costs, chunk[0][0], rank, "REDUCE_SCATTER")
    late = max(scatter)
    if not late:
        return 0
    kappa = costs.compute.gpu.comm_interference
    exposed = 0.0  # how much later the next pass's first gather on a stream can start
    for a in (0, 1):
        if not scatter[a]:
            continue
        lead = 0
        for block, count in reversed(chunk):  # backward order
            if _zero3_axes(costs, block, rank, "ALL_GATHER")[a]:
                slow = min(kappa * lead, kappa / (1 + kappa) * late)
                exposed = max(exposed, scatter[a] - lead, slow)
                break
            lead += count * _compute_ns(costs, block, rank, sig)[1]
    return late - round(exposed)


def _zero3_runs(costs: _Costs, runs: list[tuple[ParamBlock, int]], rank: int,
                sig: int, backward: bool) -> Z3Runs:
    """ZeRO-3 without prefetch on a MoE model: one chunk's pass in the order it runs, each run
    of equal blocks as (dense gather, expert gather, compute, dense reduce-scatter, expert
    reduce-scatter) ns and its count, for the schedule walk's two-stream state
    (``pipeline_walk.z3_map``). The per-block charge of ``_block_ns`` pairs a block's
    reduce-scatters with its own gathers: exact for a chunk of equal blocks, not where a block
    gathers on one stream only (the embedding, the head) and a layer's expert reduce-scatter
    runs on beside it; nor can one number after the send carry two streams into the next step."""
    out = []
    for block, count in runs:
        g = _zero3_axes(costs, block, rank, "ALL_GATHER")
        r = _zero3_axes(costs, block, rank, "REDUCE_SCATTER") if backward else (0, 0)
        comp = _compute_ns(costs, block, rank, sig)[1 if backward else 0]
        out.append(((g[0], g[1], comp, r[0], r[1]), count))
    return tuple(out)


def _z3_lead(costs: _Costs, runs: list[tuple[ParamBlock, int]], rank: int,
             sig: int, backward: bool) -> tuple[int, int]:
    """A pass's leading blocks that neither gather nor reduce-scatter (a tied head's backward:
    its weight is the embedding's): (their ns, the compute on the critical path in it). They
    start as the pass does, beside whatever the streams still carry from the pass before, and
    replay slows their kernels for it (``_Streams``)."""
    ns = busy = 0
    side = 1 if backward else 0
    for block, count in runs:
        if any(_zero3_axes(costs, block, rank, "ALL_GATHER")) or (
                backward and any(_zero3_axes(costs, block, rank, "REDUCE_SCATTER"))):
            break
        ns += count * _compute_ns(costs, block, rank, sig)[side]
        busy += count * _compute_busy(costs, block, rank, sig)[side]
    return ns, busy


def _compute_ns(costs: _Costs, block: ParamBlock, rank: int, sig: int,
                busy: bool = False) -> tuple[int, int]:
    """(forward, backward) ns of one block's own op lists for one micro-batch. The backward
    recomputes what ``RoleProgram._recompute_items`` lists: a layer's forward (full) or its
    core attention (selective). ``busy``: their compute on the critical path instead
    (``_Costs.items_cost``)."""
    s = costs.s
    get = costs.list_busy if busy else costs.list_ns
    fwd = get(block, "fwd", rank, sig)
    again = 0
    if block.name == "layer" and s.recompute != "none":
        again = fwd if s.recompute == "full" else get(block, "selective", rank, sig)
    return fwd, again + get(block, "bwd", rank, sig)


def _compute_busy(costs: _Costs, block: ParamBlock, rank: int, sig: int
                  ) -> tuple[int, int]:
    return _compute_ns(costs, block, rank, sig, busy=True)


def _prefetched_chunk(costs: _Costs, chunk: list[tuple[ParamBlock, int]], rank: int,
                      sig: int) -> tuple[int, int, int, int, int, int, int]:
    """ZeRO-3 with prefetch (``Strategy.zero3_prefetch``), one chunk and micro-batch: (forward,
    backward, the first gathers of each pass, the backward's tail after its last compute, how
    much of that tail a backward started right after it hides — GPipe's back to back — and
    when that backward's last compute ends, after the tail it started beside),
    timed as ``RoleProgram`` issues them — a pass's first block's gathers in the chain (queued
    behind what its streams still carry), each next block's issued as the current one starts,
    each block's gradient reduce-scatters after its backward, every group on its own stream in
    issue order. Walked block by block: the streams couple neighbours. A backward started with
    the tail still in flight ends ``again`` after it starts instead of a whole ``bwd`` after
    the tail: it hides bwd + tail − again (a tied-embedding head gathers nothing and computes
    beside the embedding's scatter; any other first block waits for every stream: a MoE
    model's last expert reduce-scatter too, which GPipe on one stage had left out, 1.2–1.5%
    too fast)."""
    blocks = [block for block, count in chunk for _ in range(count)]
    comp = [_compute_ns(costs, b, rank, sig) for b in blocks]
    gather = [_zero3_axes(costs, b, rank, "ALL_GATHER") for b in blocks]
    scatter = [_zero3_axes(costs, b, rank, "REDUCE_SCATTER") for b in blocks]
    kappa = costs.compute.gpu.comm_interference
    # with interference, each block as it runs: its kernels slow while the streams are busy
    segs = [_compute_runs(costs, b, rank, sig) for b in blocks] if kappa else None
    fwd, first_f, _, _ = _prefetch_pass(range(len(blocks)), [c[0] for c in comp], gather,
                                        None, [s[0] for s in segs] if segs else None, kappa)
    order = range(len(blocks) - 1, -1, -1)
    comp_b, segs_b = [c[1] for c in comp], [s[1] for s in segs] if segs else None
    bwd, first_b, last, tails = _prefetch_pass(order, comp_b, gather, scatter, segs_b, kappa)
    again, _, again_last, _ = _prefetch_pass(order, comp_b, gather, scatter, segs_b, kappa,
                                             tails)
    return fwd, bwd, first_f, first_b, bwd - last, 2 * bwd - last - again, again_last - bwd + last


def _slowed_runs(w: float, runs: Runs, busy: list[int], kappa: float) -> float:
    """Wall time after running ``runs`` (``_Costs.items_runs``) from ``w`` while streams are
    busy until each of ``busy``: each kernel slowed by those and by the list's own overlapped
    collectives in flight beside it, together (``slowed``); the collectives not (replay/sim.py
    slows kernels, not transfers). Slowing a TP-overlapped block's merged segments by the
    streams alone lost the kernels under a longer collective and charged the rest the two
    slowdowns one on the other: −1.8% / +0.8% against replay with prefetched ZeRO-3 gathers."""
    for d, c in runs:
        if not c:
            w = slowed(w, d, busy, kappa)
        elif d:
            w = max(slowed(w, d, [*busy, w + c], kappa), w + c)
        else:
            w += c
    return w


def _compute_runs(costs: _Costs, block: ParamBlock, rank: int, sig: int
                  ) -> tuple[Runs, Runs]:
    """``_compute_ns`` as runs (``_Costs.list_runs``): the forward, and the backward after
    what it recomputes."""
    fwd = costs.list_runs(block, "fwd", rank, sig)
    again: Runs = ()
    if block.name == "layer" and costs.s.recompute != "none":
        again = fwd if costs.s.recompute == "full" else costs.list_runs(
            block, "selective", rank, sig)
    return fwd, again + costs.list_runs(block, "bwd", rank, sig)


def _prefetch_pass(order: range, comp: list[int], gather: list[tuple[int, int]],
                   scatter: list[tuple[int, int]] | None, segs: list[Runs] | None,
                   kappa: float, busy: tuple[int, int] = (0, 0)
                   ) -> tuple[int, int, int, tuple[int, int]]:
    """(end with its streams drained, end of its first block's gathers, end of its last
    compute, how long each stream runs on after that) of one pass over blocks in ``order``;
    dense and expert groups, a stream each, busy until ``busy`` when the pass starts (its first
    gathers after all of them); with ``segs``, a block's kernels slowed while the streams are
    busy (interference, ``slowed``), its own collectives not."""
    stream = list(busy)
    # the pass's first gathers wait for every group's last reduce-scatter, not only their own
    # group's (``RoleProgram._zero3_gathers``); a first block that gathers nothing (a tied head)
    # waits for none
    chain = max(busy) if any(gather[order[0]]) else 0
    for a in (0, 1):  # the first block's gathers block the chain, dense then expert
        if gather[order[0]][a]:
            chain = stream[a] = max(chain, stream[a]) + gather[order[0]][a]
    first_done = ready = chain
    for j, i in enumerate(order):
        start = max(chain, ready)
        if j + 1 < len(order):  # the next block's gathers start as this block does
            ready = start
            for a, g in enumerate(gather[order[j + 1]]):
                if g:
                    stream[a] = max(start, stream[a]) + g
                    ready = max(ready, stream[a])
        chain = (start + comp[i] if segs is None
                 else round(_slowed_runs(start, segs[i], stream, kappa)))
        if scatter is not None:
            for a, r in enumerate(scatter[i]):
                if r:
                    stream[a] = max(chain, stream[a]) + r
    tails = (max(stream[0] - chain, 0), max(stream[1] - chain, 0))
    return max(chain, *stream), first_done, chain, tails


def _block_ns(costs: _Costs, block: ParamBlock, rank: int, sig: int
              ) -> tuple[int, int]:
    """(forward, backward) ns of one block for one micro-batch (``_compute_ns``), with ZeRO-3's
    gathers and reduce-scatters where they block the chain."""
    s = costs.s
    fwd, bwd = _compute_ns(costs, block, rank, sig)
    if s.zero_stage != 3:
        return fwd, bwd
    g_dp, g_edp = _zero3_axes(costs, block, rank, "ALL_GATHER")
    r_dp, r_edp = _zero3_axes(costs, block, rank, "REDUCE_SCATTER")
    # The chain gathers the dense then the expert parameters. In backward the next block's
    # dense gather waits for this one's dense reduce-scatter and its expert gather for the
    # expert one (each group's collectives in order on its own stream), the two reduce-scatters
    # running side by side: per block of a run, max(r_dp + g_dp, r_edp) + g_edp.
    return g_dp + g_edp + fwd, bwd + max(r_dp + g_dp, r_edp) + g_edp


def _zero3_ns(costs: _Costs, block: ParamBlock, rank: int, coll: O.CollType) -> int:
    """ZeRO-3: the 16-bit parameter all-gathers (per-rank shard) or the gradient reduce-scatters
    (full buffer) of a block, dense and expert one after the other."""
    return sum(_zero3_axes(costs, block, rank, coll))


def _zero3_axes(costs: _Costs, block: ParamBlock, rank: int, coll: O.CollType
                ) -> tuple[int, int]:
    """``_zero3_ns`` per group: (dense, expert), memoized: it reads the strategy only through
    the costs key (dp, the gather pieces, the reduce dtype) and the layout of ``rank``'s groups."""
    key = (costs.key, costs._degrees, rank, block.dense, block.expert, coll)
    got = costs.ctx.zero3.get(key)
    if got is None:
        got = costs.ctx.zero3[key] = _zero3_axes_ns(costs, block, rank, coll)
    return got


def _zero3_axes_ns(costs: _Costs, block: ParamBlock, rank: int, coll: O.CollType
                   ) -> tuple[int, int]:
    out = [0, 0]
    for i, (axis, n) in enumerate((("dp", block.dense), ("edp", block.expert))):
        size = dp_group_size(costs.s, axis)
        if not n or size < 2:
            continue
        if coll == "REDUCE_SCATTER":
            nbytes = -(-n // size) * size * O.grad_reduce_bytes(costs.s)
            out[i] = costs.coll_ns(O.Comm(coll.lower(), axis, coll, nbytes), rank)
            continue
        for piece in gather_pieces(n, costs.s.zero3_gather_bucket_params):
            shard = -(-piece // size) * O.PARAM_BYTES
            out[i] += costs.coll_ns(O.Comm(coll.lower(), axis, coll, shard), rank)
    return out[0], out[1]


def estimate(model: ModelSpec, strategy: Strategy, system: SystemSpec) -> FastEstimate:
    """Step time and memory of one strategy without generating a trace."""
    check_fits_model(strategy, model)
    s = strategy
    costs = _Costs(model, s, system)
    stages, reps, alike = _stages(costs)
    c = _sends(costs, reps, alike)
    # Interleaved schedules, and pipelines whose stages hold different layer counts, are walked
    # step by step: the closed forms charge every micro-batch at the slowest stage, which is
    # exact for alike stages but not when a few short stages let the others run ahead. So are
    # prefetched ZeRO-3 passes on a pipeline, whose gathers and scatter tails hide behind every
    # wait (one stage has no waits: the closed form, with GPipe's back-to-back overlap), ZeRO-3
    # on a MoE model without prefetch, whose dense and expert streams the walk carries from step
    # to step, and 1F1B pipelines whose sends pace the steady state (``_sends_bind``).
    check: Iterable[int]
    chunk_ends: Sequence[Sequence[int]]
    walked = (s.schedule == "interleaved_1f1b" or bool(s.first_stage_layers)
              or bool(s.last_stage_layers)
              or (s.zero_stage == 3 and ((s.zero3_prefetch and s.pp > 1)
                                         or (costs.moe and not s.zero3_prefetch)))
              or (s.schedule == "1f1b" and s.pp > 1 and _paced(costs, stages, c, alike)))
    gathers_open = s.overlap_param_gather and s.zero_stage in (1, 2)
    # with chunks, each chunk's first forward waits for its gathers inside the walk
    opened = _opened(costs, stages, reps, c) if gathers_open and s.vpp > 1 else None
    steps = None  # a walk's cooldowns, step by step (``pipeline_walk.Tails``)
    if walked:  # every stage its own end: the tails check each, even of alike stages
        pipe, ends, chunk_ends, steps = _walked_ends(costs, stages, c, opened)
        check = range(s.pp)
    elif alike:
        # Alike stages: the first finishes no earlier than any middle one. Its layers are the
        # same blocks, issued later (by c₀ + B₁) into the same buckets, and its embedding only
        # adds to the last bucket, the optimizer and the gathers.
        pipe, ends = _alike_ends(s, stages, c[0])
        chunk_ends = list(zip(ends))  # one chunk a stage
        check = sorted({0, s.pp - 1})
    else:
        pipe, ends = _closed_form_ends(s, stages, c)
        chunk_ends = list(zip(ends))
        check = range(s.pp)
    if gathers_open and opened is None:
        held = _param_gather_delay(costs, stages, reps, c, alike)
        pipe += held
        ends = [e + held for e in ends]
        chunk_ends = [[e + held for e in ce] for ce in chunk_ends]
    two = alike and not walked  # the first and last stage decide (``tails_ns``)
    finish = tails_ns(costs, stages, [0] * s.pp if two else reps, ends, chunk_ends, check, two,
                      steps, c)
    peak = _peak_memory_bytes(costs, stages, alike)
    return FastEstimate(finish / NS_PER_S, pipe / NS_PER_S, peak / GiB,
                        peak <= system.gpu.hbm_bytes,
                        tuple(map(_FWD_S, stages)), tuple(map(_BWD_S, stages)))


# C-level field getters: per-stage lists built without a Python loop (fewer machine
# instructions than the comprehensions, measured with bench/bench_fastpath_work.py)
_FWD_S, _BWD_S = operator.attrgetter("fwd_s"), operator.attrgetter("bwd_s")


def _walked_ends(costs: _Costs, stages: list[_Stage], c: list[int],
                 opened: Opened | None = None
                 ) -> tuple[int, list[int], list[list[int]], Tails | None]:
    """(pipeline ns, end of each stage's last backward, end of each chunk's last backward —
    its gradient buckets go then — and, for walks without ZeRO-3 terms, each
    stage's steps from its first bucket-issuing backward on: ``pipeline_walk.Tail``) from a
    walk of the schedule's order. The walk depends on nothing else, so strategies differing
    only in what follows the pipeline (ZeRO 0 vs 1, bucket size) share it."""
    s = costs.s
    fwd, bwd = [x.fwd for x in stages], [x.bwd for x in stages]
    zero3 = s.zero_stage == 3 and s.pp > 1
    early = {(ph, st, ch): g for st, x in enumerate(stages) for ch in range(s.vpp)
             for ph, g in (("F", x.early_f[ch]), ("B", x.early_b[ch]))} if zero3 else None
    late = {(st, ch): x.late_b[ch] for st, x in enumerate(stages)
            for ch in range(s.vpp)} if zero3 else None
    # prefetched backwards may start beside the streams the step before left busy
    hide = {(st, ch): x.after_tail_b[ch] for st, x in enumerate(stages)
            for ch in range(s.vpp)} if zero3 and s.zero3_prefetch else None
    streams = ([x.z3_f for x in stages], [x.z3_b for x in stages]) if (
        stages[0].z3_b) else None
    leads = _leads(costs, stages) if streams else None
    key = (s.schedule, s.pp, s.num_microbatches, s.vpp, tuple(fwd), tuple(bwd), tuple(c),
           tuple(sorted(early.items())) if early else None,
           tuple(sorted(late.items())) if late else None,
           (tuple(streams[0]), tuple(streams[1])) if streams else None,
           opened, tuple(leads) if leads else None,
           tuple(sorted(hide.items())) if hide else None)
    walked = costs.ctx.walks.get(key)
    if walked is None:
        if not (early or late or streams):
            (ends, chunk_ends), cooldown = plain_tails(s, fwd, bwd, c, opened)
            walked = costs.ctx.walks[key] = (ends, chunk_ends, cooldown)
        else:
            walked = costs.ctx.walks[key] = (*interleaved(s, fwd, bwd, c, early, late, streams,
                                                          opened, leads, hide), None)
    return max(walked[0]), *walked


def _leads(costs: _Costs, stages: list[_Stage]) -> list[tuple[int, float] | None] | None:
    """For the two-stream walk under interference, per pass in its maps' order (forwards, then
    backwards; stage by stage, chunk by chunk): the pass's leading blocks that gather nothing
    (``_Stage.z3_lead_f``/``_b``) as (ns, κ scaled to their compute share), or None; None
    where no pass has any (or κ is 0)."""
    kappa = costs.compute.gpu.comm_interference
    if not kappa:
        return None
    out = [(ns, kappa * busy / ns) if ns else None
           for per_pass in ([x.z3_lead_f for x in stages], [x.z3_lead_b for x in stages])
           for per_stage in per_pass for ns, busy in per_stage]
    return out if any(out) else None


def _paced(costs: _Costs, stages: list[_Stage], c: list[int], alike: bool) -> bool:
    """Whether a 1F1B pipeline lies outside the closed form's domain (``_off_closed_form``),
    once per stage list: the layout memo (``_stages``) keeps each list alive for the context's
    life, and its sends follow from the same key."""
    got = costs.ctx.paced.get(id(stages))
    if got is None:
        got = costs.ctx.paced[id(stages)] = _off_closed_form(stages, c, alike)
    return got


def _off_closed_form(stages: list[_Stage], c: list[int], alike: bool) -> bool:
    """Whether the 1F1B closed form may miss the walk. It is exact where the last stage is the
    slowest (f + b: F) and no round trip outlasts it (``_sends_bind``). Elsewhere it charges
    every micro-batch the slowest stage as if nothing waited for the stages after it: on
    random stage costs up to 10% off either way, and GPT-3 on 72-GPU nodes, whose stages
    straddle nodes and cost what their groups' shapes make them (the second stage slowest),
    +2.4%. What suffices for no: every earlier stage's f + b + 2c is ≤ F (each round trip term
    Σ(f_i + b_i + 2·c_i − F) is ≤ 0; the usual case, the head outweighing two sends). Beyond
    that ``_sends_bind``'s cycles decide only for alike stages: on random costs of stages not
    alike that it passed, 3 in 8,357 were up to 0.7% too fast with equal sends, and up to 6.7%
    with sends that differ (stages sharing a node, then leaving it), so those are walked.
    Alike stages need only the first, a middle and the last looked at."""
    ends = (stages[0], stages[1], stages[-1]) if alike else stages
    fb = [x.fwd[0] + x.bwd[0] for x in ends]
    top = fb[-1]
    if max(fb) > top:  # a stage before the last is the slowest
        return True
    hops = c[:1] * 2 if alike else c[:-1]  # the sends of every stage before the last
    if all(f + 2 * h <= top for f, h in zip(fb[:-1], hops, strict=True)):
        return False
    return not alike or _sends_bind(stages, c)


def _sends_bind(stages: list[_Stage], c: list[int]) -> bool:
    """Whether a 1F1B pipeline's sends pace its steady state, where the closed form has the
    slowest stage's forward + backward F do it. Stage s holds p − s micro-batches in flight, so
    p − s of them take at least one round trip from s down to a stage t and back: F_j(s) …
    B_j(s) is the forwards and backwards of stages s … t − 1, the sends both ways between them,
    and stage t's own (p − t)·(f_t + b_t) before it returns B_j (Little's law on the 1F1B order;
    the walk finds it step by step). The closed form holds while every such cycle fits in
    (p − s)·F: Σ_{i=s}^{t−1}(f_i + b_i + 2·c_i) + (p − t)·(f_t + b_t) ≤ (p − s)·F, checked for
    every s < t in one pass with P(t) = Σ_{i<t}(f_i + b_i + 2·c_i) and the running max over s of
    s·F − P(s). True where a send outweighs half what the slowest stage adds over its
    neighbour: small models, activations not split by sequence parallelism, slow links."""
    p = len(stages)
    fb = [x.fwd[0] + x.bwd[0] for x in stages]
    top = max(fb)
    prefix, best = 0, -(1 << 62)
    for t in range(1, p):
        best = max(best, (t - 1) * top - prefix)
        prefix += fb[t - 1] + 2 * c[t - 1]
        if prefix + best + (p - t) * fb[t] > p * top:
            return True
    return False


def _closed_form_ends(s: Strategy, stages: list[_Stage], c: list[int]) -> tuple[int, list[int]]:
    """(pipeline ns, end of each stage's last backward) from the GPipe / 1F1B closed forms."""
    f_s = [x.fwd[0] for x in stages]
    b_s = [x.bwd[0] for x in stages]
    # GPipe runs a stage's backwards back to back: each hides part of the one before's tail
    b_rep = ([b - x.overlap_b[0] for b, x in zip(b_s, stages, strict=True)]
             if s.schedule == "gpipe" and s.zero_stage == 3 else None)
    hidden, late_s = 0, [0] * s.pp
    if s.zero_stage == 3 and s.pp > 1:
        # the first gather of a pass runs while the input is awaited; the last reduce-scatter
        # of a stage's final backward runs after its gradient is sent
        late_s = [0] + [x.late_b[0] for x in stages[1:]]
        hidden = sum(x.early_f[0] for x in stages[1:]) + sum(
            x.early_b[0] for x in stages[:-1]) + sum(late_s)
    pipe = pipeline_ns(s, f_s, b_s, c, hidden, b_rep)
    # Stage st sends its last gradient Σ_{j<st} (B_j − late_j + c_j) before stage 0 ends, and
    # ends late_st after that. (Spelled with map and itertools.accumulate this takes fewer
    # bytecodes but more machine instructions on CPython 3.11: kept as a loop.)
    ends, sent = [], pipe
    for b, hop, lt in zip(b_s, c, late_s, strict=True):
        ends.append(sent + lt)
        sent -= b - lt + hop
    if s.schedule == "gpipe" and s.num_microbatches > 1:
        _gpipe_drain(ends, b_rep or b_s, s.num_microbatches)
    return pipe, ends


def _gpipe_drain(ends: list[int], b_s: list[int], m: int) -> None:
    """GPipe's backwards drain as a flow shop (stage p − 1 first): the last micro-batch leaves
    stage st after Σ_{i≥st} b_i + (m − 1)·max_{k≥st} b_k (and the sends), so a stage after the
    slowest backward ends (m − 1)·(max_k b_k − max_{k≥st} b_k) before the chain from stage 0's
    end says (which holds only where each stage's last backward waits for the one after it)."""
    top, later = max(b_s), 0
    for st in range(len(b_s) - 1, 0, -1):
        later = max(later, b_s[st])
        ends[st] -= (m - 1) * (top - later)


def _alike_ends(s: Strategy, stages: list[_Stage], hop: int) -> tuple[int, list[int]]:
    """``_closed_form_ends`` where the stages are alike (``_stages``): the middle stages are one
    stage and every hop costs ``hop``, so the sums over stages are products, and only the ends
    of the first and last stage, the ones ``tails_ns`` checks, are found (the list holds 0 for
    the others: nothing reads them)."""
    p = s.pp
    first, last = stages[0], stages[-1]
    f0, b0, fl, bl = first.fwd[0], first.bwd[0], last.fwd[0], last.bwd[0]
    ends = [0] * p
    gpipe3 = s.schedule == "gpipe" and s.zero_stage == 3
    if p == 1:  # GPipe's backwards back to back hide each other's tails (_closed_form_ends)
        ends[0] = span_ns(s, f0, b0, f0, b0 - first.overlap_b[0] if gpipe3 else b0, f0 + b0, 0)
        return ends[0], ends
    mid = stages[1]  # the last stage when p = 2, counted 0 times below
    f1, b1, n_mid = mid.fwd[0], mid.bwd[0], p - 2
    hidden = lt1 = lt_last = 0
    if s.zero_stage == 3:  # first gathers hidden behind the fill / drain waits, as there
        lt1, lt_last = mid.late_b[0], last.late_b[0]
        hidden = (n_mid * (mid.early_f[0] + mid.early_b[0] + lt1) + last.early_f[0]
                  + first.early_b[0] + lt_last)
    b_max = max(b0, b1, bl)
    if gpipe3:  # backwards back to back (_closed_form_ends)
        b_max = max(b0 - first.overlap_b[0], b1 - mid.overlap_b[0], bl - last.overlap_b[0])
    pipe = span_ns(s, f0 + n_mid * f1 + fl, b0 + n_mid * b1 + bl, max(f0, f1, fl), b_max,
                   max(f0 + b0, f1 + b1, fl + bl), 2 * (p - 1) * hop - hidden)
    # stage p−1 ends when stage 0 does, less each earlier stage's last gradient and its send
    ends[0] = pipe
    ends[-1] = pipe - (b0 + hop) - n_mid * (b1 - lt1 + hop) + lt_last
    if s.schedule == "gpipe":  # unless an earlier backward is the slower (``_gpipe_drain``)
        ends[-1] -= (s.num_microbatches - 1) * (
            b_max - (bl - last.overlap_b[0] if gpipe3 else bl))
    return pipe, ends


def _stages(costs: _Costs) -> tuple[list[_Stage], list[int], bool]:
    """``_layout_stages``, shared by every strategy with the same costs key (model, op lists,
    recompute, ZeRO-3's fields), group layout, chunks and uneven end stages (a sweep's ZeRO 0 and
    1 twins, its batch sizes and schedules; the stage list is never mutated)."""
    s = costs.s
    key = (costs.key, costs._degrees, s.vpp, s.first_stage_layers, s.last_stage_layers)
    got = costs.ctx.layouts.get(key)
    if got is None:
        got = costs.ctx.layouts[key] = _layout_stages(costs)
    return got


def _layout_stages(costs: _Costs) -> tuple[list[_Stage], list[int], bool]:
    """Each stage's costs, its representative rank (pp = st, dp = cp = tp = 0 in Megatron
    order), and whether the stages are alike: each on whole nodes of its own (shifting a stage
    by whole nodes changes none of its group shapes), so the middle stages of an evenly split
    pipeline cost the same — with interleaving too: only stage 0's first chunk (embedding) and
    stage p−1's last (head) differ, and the walk still walks every stage."""
    s = costs.s
    per_stage = s.world_size // s.pp
    reps = list(range(0, s.world_size, per_stage))
    uniform = per_stage % costs.gpn == 0
    sig0 = costs.signature(0)
    alike = uniform and not (s.first_stage_layers or s.last_stage_layers)
    if alike:
        edge = [costs.stage(st, reps[st], sig0) for st in range(min(2, s.pp))]
        middle = [edge[-1]] * max(0, s.pp - 3)
        last = [costs.stage(s.pp - 1, reps[-1], sig0)] if s.pp > 2 else []
        return edge + middle + last, reps, True
    return [costs.stage(st, r, sig0 if uniform else costs.signature(r))
            for st, r in enumerate(reps)], reps, False


def _peak_memory_bytes(costs: _Costs, stages: list[_Stage], alike: bool) -> int:
    """The largest per-rank memory of any stage. In-flight micro-batches never grow with the
    stage index, so the peak is on the first stage (embedding, most in flight), the last (head,
    logits) or — when the first holds fewer layers than the rest — the second."""
    m, s = costs.m, costs.s
    flash = costs.compute.gpu.flash_attention
    # it reads the model, tp, sp, cp, micro-batch and recompute (and the system's attention)
    act_key = (costs.lists_key, s.recompute)
    act = costs.ctx.activations.get(act_key)
    if act is None:
        act = costs.ctx.activations[act_key] = activation_bytes_per_layer(
            m, s, flash_attention=flash)
    candidates = {0, s.pp - 1} if alike else {0, min(1, s.pp - 1), s.pp - 1}
    # params: (("dp", dense), ("edp", expert)) — experts shard over their own group
    return max(memory_total_bytes(m, s, st, stages[st].total_params, act_per_layer=act,
                                  flash_attention=flash, layers=stages[st].layers,
                                  expert_params=stages[st].params[1][1])
               for st in candidates)


def _param_gather_delay(costs: _Costs, stages: list[_Stage], reps: list[int], c: list[int],
                        alike: bool) -> int:
    """``overlap_param_gather`` on a pipeline of one chunk per stage (with chunks, ``_opened``
    puts the gathers in the walk): how much the step's parameter all-gathers (serial on each
    data-parallel stream from the start, bucket by bucket in forward order) delay the pipeline:
    how much later than without them the fill's first forwards end, each starting when the
    one before it has ended and sent (Σ_{j<s} F_j + c_j without gathers). The delays add up
    stage by stage: a stage whose input comes late by D is held up by its own gathers from
    there. (The most any stage was held up from the unheld fill, the max-plus answer, is the
    same without interference; with it a forward started later is slowed for less of its
    gathers but still starts D late, and that form was up to 2.5% too fast with a short first
    stage.) A stage held up by nothing from its arrival is held up by nothing from a later one
    (every step of it ends no more than the start's shift later), so of ``alike`` middle
    stages the walk stops at the first one that is not held up."""
    delay, arrival, last, skip = 0, 0, len(stages) - 1, False
    for st, x in enumerate(stages):
        middle = alike and 0 < st < last
        if not (middle and skip):
            held = _held_forward(costs, st, reps[st], x.fwd[0], arrival + delay)
            delay += held
            skip = middle and held == 0  # (only a middle stage speaks for the next ones)
        arrival += x.fwd[0] + c[st]
    return delay


def _opened(costs: _Costs, stages: list[_Stage], reps: list[int], c: list[int]) -> Opened:
    """``overlap_param_gather`` with chunks, for the walk (``pipeline_walk.Opened``). The
    gathers run chunk after chunk on the stream; with few micro-batches per round and many
    chunks they can outlast the fill, so later chunks' first forwards wait too, and every
    kernel of the stage runs slowed until they are done — delays the walk passes on as far as
    they reach. (``_param_gather_delay``'s worst first-chunk delay, added to the whole
    pipeline, left such runs up to 14.7% too fast.) Each first forward is held from its start
    in the fill without gathers (``first_forwards``); one starting later ends no earlier than
    that (the buckets it waits for are the same). Shared by strategies that differ only in the
    batch, ZeRO 1 or 2 and the gradients' dtype (the fill does not depend on them)."""
    s = costs.s
    key = (costs.key, costs._degrees, s.vpp, s.first_stage_layers, s.last_stage_layers,
           s.dp_bucket_params, tuple(c))
    got = costs.ctx.opened.get(key)
    if got is not None:
        return got
    starts = first_forwards(s.pp, s.vpp, [x.fwd for x in stages], c)
    floors, busy = [], []
    for st, x in enumerate(stages):
        busy.append(tuple(_gather_timeline(costs, st, reps[st])[2]))
        for ch in range(s.vpp):
            held = _held_forward(costs, st, reps[st], x.fwd[ch], starts[st][ch], ch)
            if held:
                floors.append(((st, ch), starts[st][ch] + x.fwd[ch] + held))
    share = tuple(phi for per_pass in ([x.busy_f for x in stages], [x.busy_b for x in stages])
                  for per_stage in per_pass for phi in per_stage)
    got = costs.ctx.opened[key] = Opened(tuple(floors), tuple(busy),
                                         costs.compute.gpu.comm_interference, share)
    return got


def _gather_timeline(costs: _Costs, st: int, rank: int
                     ) -> tuple[list[list[ParamBlock]], list[list[int]], list[int]]:
    """Stage ``st``'s parameter gathers (``overlap_param_gather``), each data-parallel stream's
    serial from the step's start, chunk after chunk: per chunk its blocks and when each block's
    bucket is in (0 for the blocks that open none), and when each stream's gathers end.
    Memoized by all it reads: the op lists' key, layout, chunks, bucket size and rank."""
    s = costs.s
    key = (costs.lists_key, costs._degrees, s.vpp, s.first_stage_layers, s.last_stage_layers,
           s.dp_bucket_params, st, rank)
    got = costs.ctx.gathers.get(key)
    if got is not None:
        return got
    blocks = [costs.prog.blocks_of_chunk(ch * s.pp + st, labels=False) for ch in range(s.vpp)]
    need = [[0] * len(own) for own in blocks]
    busy = []
    for axis in ("dp", "edp") if costs.moe else ("dp",):
        size = dp_group_size(s, axis)
        if size < 2:
            continue
        shape, t = costs.shape(axis, rank), 0
        for own, ready in zip(blocks, need, strict=True):
            for first, n in reversed(bucket_plan(own, axis, s.dp_bucket_params)):
                t += costs.net.shape_ns("ALL_GATHER", -(-n // size) * O.PARAM_BYTES, shape)
                ready[first] = max(ready[first], t)
        busy.append(t)
    got = costs.ctx.gathers[key] = (blocks, need, busy)
    return got


def _held_forward(costs: _Costs, st: int, rank: int, fwd: int, arrival: int, chunk: int = 0
                  ) -> int:
    """How much later than ``fwd`` after ``arrival`` stage ``st``'s first forward of ``chunk``
    ends: each block waits for its bucket's gather (after every earlier chunk's on the stream)
    and, with interference, runs slowed while a stream is busy — until the last chunk's gathers
    are done; then the rest runs at full speed."""
    kappa = costs.compute.gpu.comm_interference
    per_chunk, needs, busy = _gather_timeline(costs, st, rank)
    blocks, need = per_chunk[chunk], needs[chunk]
    free = max(busy, default=0)
    if arrival >= free:
        return 0
    sig, t, plain = costs.signature(rank), arrival, 0
    for block, ready in zip(blocks, need, strict=True):
        if t >= free:  # every gather done: the rest at full speed
            return t - plain - arrival
        t, d = max(t, ready), costs.block(block, rank, sig)[0]
        if kappa:
            segs = costs.list_runs(block, "fwd", rank, sig)
            t = round(_slowed_runs(t, segs, busy, kappa))
        else:
            t += d
        plain += d
    return t - arrival - fwd


def _sends(costs: _Costs, reps: list[int], alike: bool) -> list[int]:
    """c[s]: one send between stage s and stage s + 1 (wrapping, for interleaved chunks)."""
    p = len(reps)
    if p == 1:
        return [0]
    nbytes = costs.p2p_bytes()
    if alike:  # every hop leaves the node and costs the same
        return [_send_ns(costs, reps[0], reps[1], nbytes)] * p
    return [_send_ns(costs, reps[st], reps[(st + 1) % p], nbytes) for st in range(p)]


def _send_ns(costs: _Costs, src: int, dst: int, nbytes: int) -> int:
    """One pipeline send (replay's ``p2p``), memoized by whether it stays in the node."""
    key = (src // costs.gpn == dst // costs.gpn, nbytes)
    got = costs.ctx.sends.get(key)
    if got is None:
        got = costs.ctx.sends[key] = costs.net.p2p(src, dst, nbytes).total_ns
    return got
