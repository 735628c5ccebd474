"""The fast path's costs of one strategy (``analysis/fastpath.py``): op lists, blocks and group
shapes from its program, durations from replay's GPU and network models, and the memos a sweep
shares across strategies (``_Context``: every key holds all its value depends on, so sharing
is exact). The stage costs themselves are ``analysis/fastpath_stages.py``."""

from __future__ import annotations

from analysis import offload_walk
from analysis.dp_tails import BucketRun
from analysis.fastpath_stages import (
    Runs,
    Segments,
    Stage,
    block_ns,
    chain_and_stream_ns,
    compute_busy,
    extend_segments,
    stage_costs,
    zero3_axes,
)
from analysis.pipeline_walk import Opened, Tails
from replay.compute import RooflineCompute
from replay.hardware import SystemSpec
from replay.network import AlphaBetaNetwork, Shape, ranges_shape
from tracegen import ops as O
from tracegen.errors import ConfigError
from tracegen.memory import activation_bytes_per_layer
from tracegen.mesh import Mesh, embedding_partner
from tracegen.model import ModelSpec
from tracegen.program import ParamBlock, RoleProgram, layer_model
from tracegen.strategy import Strategy


def _group_shape(axis: str, rank: int, tp: int, cp: int, dp: int, pp: int, ep: int,
                 embedding_stage: int | None, moe: bool, gpus_per_node: int, expert_tp: int,
                 instances: int, site_gpus: int) -> Shape:
    """(ranks, nodes spanned, ranks per node, rail-aligned, sites spanned) of ``rank``'s group
    on ``axis`` (shared by every strategy with the same degrees: a sweep computes each once)."""
    degrees = Strategy(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, global_batch_size=dp,
                       expert_tp=expert_tp, sequence_parallel=tp > 1,
                       dist_opt_instances=instances, zero_stage=1 if instances > 1 else 0)
    mesh = Mesh(degrees, embedding_stage=embedding_stage, moe=moe)
    return ranges_shape(mesh.member_ranges(axis, mesh.coord(rank)), gpus_per_node, site_gpus)


class _Context:
    """The GPU and network models of one system and the memos a sweep shares across strategies.
    Every memo key holds all that its value depends on, so sharing is exact."""

    def __init__(self, system: SystemSpec) -> None:
        self.compute = RooflineCompute(system.gpu)
        self.net = AlphaBetaNetwork(system)
        self.blocks: dict[tuple[object, ...], tuple[int, int, int, int, float]] = {}
        self.lists: dict[tuple[object, ...], tuple[int, int]] = {}
        # the same key → the list as (kernel, overlapped collective) runs (``Costs.list_runs``)
        self.runs: dict[tuple[object, ...], Runs] = {}
        # (layers, pp, vpp, the uneven split's fields) → each global chunk's layer count
        self.splits: dict[tuple[object, ...], tuple[int, ...]] = {}
        self.optimizer: dict[int | tuple[object, ...], int] = {}
        # (stage id, the other context's id, strategy) → (that stage, it with its own costs to
        # splice into another system's pipeline), held by both contexts while their memos may
        # key it by identity (``fastpath._spliced``)
        self.spliced: dict[tuple[int, int, Strategy], tuple[Stage, Stage]] = {}
        # (op-list key, recompute, its selective modules) → stored activation bytes of one layer
        # and micro-batch
        self.activations: dict[tuple[int, str, tuple[str, ...]], int] = {}
        # (op-list key, chunk) → the chunk's parameter blocks (``Costs.chunk_runs``)
        self.chunks: dict[tuple[object, ...], list[tuple[ParamBlock, int]]] = {}
        self.p2p: dict[int, int] = {}  # op-list key → bytes of one pipeline send
        # op-list key → the first program built with it: its op lists (built lazily, all of a
        # kind at once) serve every later strategy with that key (``Costs._items``)
        self.programs: dict[int, RoleProgram] = {}
        # ZeRO-3: (costs key, layout, rank, block parameters, collective) → (dense, expert) ns
        self.zero3: dict[tuple[object, ...], tuple[int, int]] = {}
        # overlap_param_gather: a stage's gather timeline; a strategy's walk inputs (``_opened``)
        self.gathers: dict[tuple[object, ...],
                           tuple[list[list[ParamBlock]], list[list[int]], list[int]]] = {}
        self.opened: dict[tuple[object, ...], Opened] = {}
        # (same node?, same site?, bytes) → ns of one send: a point-to-point cost depends on
        # nothing else
        self.sends: dict[tuple[bool, bool, int, int], int] = {}
        self.calls = 0  # strategies estimated (the memo limit is checked now and then)
        # a stage chunk's gradient buckets from its start: id(runs) → (runs, bucket runs)
        self.buckets: dict[tuple[int, str, int], tuple[object, list[BucketRun]]] = {}
        self.stages: dict[tuple[object, ...], Stage] = {}
        # a strategy's stage list (``_stages``) by all it depends on: ZeRO 0 / 1 / 2 pairs and
        # strategies differing only in the batch, schedule or buckets share it
        self.layouts: dict[tuple[object, ...], tuple[list[Stage], list[int], bool]] = {}
        self.tails: dict[tuple[object, ...], tuple[int, int, int]] = {}
        # a walked pipeline's cooldowns under interference (``dp_tails._cooldowns``)
        self.cooldowns: dict[tuple[object, ...], dict[int, tuple[int, int, int]]] = {}
        self.afters: dict[tuple[object, ...], int] = {}  # ``dp_tails._after_memo``
        # id(stage list of ``layouts``) → whether its 1F1B sends pace the pipeline
        self.paced: dict[int, bool] = {}
        # layout (degrees) → (axis, rank) → group shape
        self.shapes: dict[tuple[object, ...],
                          dict[tuple[str, int], Shape]] = {}
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
                + len(self.runs) + len(self.splits) + len(self.spliced))

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


class Costs:
    """Costs of one strategy: op lists and blocks from its program, durations from the models."""

    def __init__(self, model: ModelSpec, strategy: Strategy, system: SystemSpec) -> None:
        self.m, self.s = model, strategy
        self.ctx = _context(system)
        self.compute, self.net = self.ctx.compute, self.ctx.net
        self.gpn = system.node.gpus_per_node
        self.site_gpus = system.scaleout.site_gpus  # (0: one site)
        self._prog: RoleProgram | None = None  # built on the first memo miss that needs it
        s = strategy
        # What a block's cost depends on besides its group shapes (not pp, vpp, schedule, batch;
        # dp only through ZeRO-3's gathers); its op lists' costs do not depend on recompute.
        self.lists_key = self.ctx.intern((self.ctx.model_id(model), O.op_key(s)))
        # the op list selective recompute runs again, by its modules (``list_ns``'s ``which``)
        self.recomputed = s.selective_modules if s.recompute == "selective" else ()
        # ZB-H1, ZB-V: a block's backward is its B pass (``fastpath_stages._compute_ns``)
        self.zb = s.split_w
        # (combined 1F1B merges passes, its weight gradients deferred or not: ``Stage.merged``)
        self.key = self.ctx.intern((self.lists_key, self.zb,
                                    (s.overlap_moe_ep_comm, s.delay_wgrad_compute),
                                    (s.recompute, s.recompute_num_layers)
                                    if s.recompute_num_layers else s.recompute
                                    if s.recompute_modules == "core_attn" else
                                    (s.recompute, s.recompute_modules),
                                    (s.dp, s.zero3_gather_bucket_params, s.grad_reduce_in_bf16,
                                     s.zero3_prefetch, s.fp8_param_gather, s.dist_opt_instances,
                                     s.outer_dp_sharding_strategy)
                                    if s.zero_stage == 3 else 0,
                                    s.cpu_offload_layers))
        self.moe = model.is_moe
        if s.cpu_offload_layers and not system.node.host_link_GBps:
            raise ConfigError(f"cpu_offload_layers needs the system's host link: {system.name} "
                              "gives no host_link_GBps (set it in the system file's [node] "
                              "table)", what="strategy")
        if s.optimizer_offload_fraction and not (system.node.host_link_GBps
                                                 and system.node.host_cpu_GBps):
            raise ConfigError(f"optimizer_offload_fraction needs the system's host link and host "
                              f"CPU rate: {system.name} gives host_link_GBps "
                              f"{system.node.host_link_GBps:g}, host_cpu_GBps "
                              f"{system.node.host_cpu_GBps:g} (set both in the system file's "
                              "[node] table)", what="strategy")
        # stages of unequal costs (read per stage: a property call each time costs more): an
        # uneven split, or a MoE model's dense first layers or a pattern of windowed and full
        # layers on a pipeline
        # (a pattern whose period divides an even split's chunks starts every chunk alike)
        period = len(model.window_pattern) if model.window else 0
        self.patterned = bool(period) and (
            s.uneven or model.num_layers // (s.pp * s.vpp) % period != 0)
        # a MoE model's dense layers (first ones, or in a pattern): read per chunk
        self.dense_layers = model.has_dense_layers
        self.uneven = s.uneven or bool((self.dense_layers or self.patterned) and s.pp > 1)
        # the stage sharing stage 0's embedding (a tied head's, the MTP modules'), or None
        self.embd_partner = embedding_partner(model, s) if s.pp > 1 else None
        # all a group's shape depends on besides its axis and rank
        self._degrees = (s.tp, s.cp, s.dp, s.pp, s.ep, self.embd_partner, self.moe,
                         self.gpn, s.expert_tp, s.dist_opt_instances, self.site_gpus)
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

    def shape(self, axis: str, rank: int) -> Shape:
        got = self._shapes.get((axis, rank))
        if got is None:
            got = self._shapes[axis, rank] = _group_shape(axis, rank, *self._degrees)
        return got

    def signature(self, rank: int) -> int:
        """The shapes of ``rank``'s groups on the axes a stage's blocks use (the data-parallel
        ones only where ZeRO-3 gathers inside the blocks): all their collectives depend on —
        interned, so the memo keys that hold it hash an int."""
        axes = (("tp", "cp", "ep", "dps", "dpr", "edp") if self.s.dist_opt_instances > 1
                else ("tp", "cp", "ep", "dp", "edp")) if self.s.zero_stage == 3 else (
                    "tp", "cp", "ep")
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
        return self.net.shape_ns(c.coll, c.size_bytes, self.shape(c.axis, rank), c.route)

    def stage(self, stage: int, rank: int, sig: int) -> Stage:
        s, n_chunks = self.s, self.s.pp * self.s.vpp
        layers = self.m.num_layers
        uneven = self.uneven
        comp: tuple[object, ...]
        if s.vpp == 1 and not uneven:
            # the common case, spelled out: one chunk of layers / pp (a flat key; the general
            # one is a tuple of such tuples, so the two never collide)
            gcis: tuple[int, ...] = (stage,)
            comp = (layers // n_chunks, stage == 0, stage == n_chunks - 1, n_chunks == 1)
            chunks: tuple[tuple[object, ...], ...] = (comp,)
        else:
            gcis = (stage,) if s.vpp == 1 else tuple(s.gci(stage, ch) for ch in range(s.vpp))
            sizes = self.chunk_sizes() if uneven else None
            comp = chunks = tuple([(sizes[g] if sizes else layers // n_chunks,
                                    g == 0, g == n_chunks - 1, n_chunks == 1,
                                    *self._dense_in(g), *self._mtp_in(g), *self._phase_in(g))
                                   for g in gcis])
        key = (self.key, comp, sig)
        got = self.ctx.stages.get(key)
        if got is None:
            got = self.ctx.stages[key] = stage_costs(self, gcis, chunks, rank, sig)
        return got

    def _dense_in(self, gci: int) -> tuple[int, ...]:
        """A chunk's dense layers, where the model has any (then part of a chunk's key), and
        where they fall in ``moe_layer_pattern`` where it has dense ones (which of the chunk's
        layers they are)."""
        if not self.dense_layers:
            return ()
        m = self.m
        layers = self.s.chunk_layers(m.num_layers, gci)
        if "D" not in m.moe_layer_pattern:
            return (m.dense_layers_in(layers),)
        return (m.dense_layers_in(layers), layers.start % len(m.moe_layer_pattern))

    def _phase_in(self, gci: int) -> tuple[int, ...]:
        """Where a chunk's first layer falls in the window pattern, where the model has one
        (then part of a chunk's key: it decides which of its layers are windowed)."""
        if not self.patterned:
            return ()
        start = self.s.chunk_layers(self.m.num_layers, gci).start
        return (start % len(self.m.window_pattern),)

    def _mtp_in(self, gci: int) -> tuple[bool, ...]:
        """Whether a chunk runs the MTP modules, where the model has any and a layout places
        them (then part of a chunk's key; elsewhere they run in the last chunk, keyed as such)."""
        if not (self.m.mtp_layers and self.s.pipeline_layout):
            return ()
        return (gci == self.s.mtp_chunk,)

    def chunk_sizes(self) -> tuple[int, ...]:
        """Each global model chunk's layer count (``Strategy.chunk_layers``), found once per
        split: every stage of an uneven pipeline reads it."""
        s, layers = self.s, self.m.num_layers
        key = (layers, s.pp, s.vpp, s.first_stage_layers, s.last_stage_layers,
               s.pipeline_layout, s.account_for_embedding_in_pipeline_split,
               s.account_for_loss_in_pipeline_split)
        got = self.ctx.splits.get(key)
        if got is None:
            got = self.ctx.splits[key] = tuple(len(s.chunk_layers(layers, g))
                                               for g in range(s.pp * s.vpp))
        return got

    def chunk_runs(self, gci: int, chunk: tuple[object, ...]) -> list[tuple[ParamBlock, int]]:
        """``RoleProgram.chunk_runs`` shared by every strategy with the same model, tp, ep,
        chunk (layer count, first, last, only) and layers recomputed of a chunk
        (``recompute_num_layers``): its blocks depend on nothing else."""
        key = (self.lists_key, chunk, self.s.recompute_num_layers, self.s.cpu_offload_layers)
        got = self.ctx.chunks.get(key)
        if got is None:
            got = self.ctx.chunks[key] = self.prog.chunk_runs(gci)
        return got

    def block(self, block: ParamBlock, rank: int, sig: int
              ) -> tuple[int, int, int, int, float]:
        """(forward, backward, and the compute on the critical path of each) of one block, and
        the share of its backward that is such compute."""
        key = (self.key, block.name, block.dense, block.expert, block.stored, block.offloaded,
               sig)
        got = self.ctx.blocks.get(key)
        if got is None:
            (bf, bb), (uf, ub) = (block_ns(self, block, rank, sig),
                                  compute_busy(self, block, rank, sig))
            got = self.ctx.blocks[key] = (bf, bb, uf, ub, ub / bb if bb else 0.0)
        return got

    def offload_ns(self, block: ParamBlock) -> int:
        """An offloaded layer's copy to host memory, or back: its stored activations over the
        host link."""
        size = activation_bytes_per_layer(layer_model(self.m, block.name), self.s)
        return round(size / (self.net.sys.node.host_link_GBps * 1e9) * 1e9)

    def offload_waits(self, chunk: list[tuple[ParamBlock, int]], rank: int, sig: int
                      ) -> tuple[int, int]:
        """(forward, backward) ns that one micro-batch's passes wait for activation offloading's
        copies (``offload_walk.waits``: the trace's rules walked over the chunk's blocks)."""
        kinds = {b: self._walk_block(b, rank, sig) for b, _ in chunk}  # each kind costed once
        return offload_walk.waits([kinds[b] for b, n in chunk for _ in range(n)],
                                  self.compute.gpu.comm_interference)

    def _walk_block(self, block: ParamBlock, rank: int, sig: int) -> offload_walk.Block:
        """A block as the offload walk steps it (``offload_walk.Block``)."""
        s = self.s
        lead = (sum(zero3_axes(self, block, rank, "ALL_GATHER"))
                if s.zero_stage == 3 and not s.zero3_prefetch else 0)
        return offload_walk.Block(block.offloaded, *chain_and_stream_ns(self, block, rank, sig),
                                  self.offload_ns(block) if block.offloaded else 0, lead)

    def offload_held(self, blocks: list[ParamBlock], ready: list[int], busy: list[int],
                     rank: int) -> int:
        """``overlap_param_gather`` beside activation offloading (pp 1): how much later the
        forward of ``blocks`` ends with each waiting for its bucket's gather (``ready``; the
        streams busy until each of ``busy``) than with the copies alone
        (``offload_walk.gathered_delay``)."""
        sig = self.signature(rank)
        kinds = {b: self._walk_block(b, rank, sig) for b in set(blocks)}  # each costed once
        return offload_walk.gathered_delay([kinds[b] for b in blocks], ready, busy,
                                           self.compute.gpu.comm_interference)

    def optimizer_ns(self, params: int, layers: int = 0) -> int:
        """The optimizer step over ``params`` local parameters (memo: it depends on nothing
        else but the bytes a parameter moves); with optimizer offloading, the GPU's share and
        the CPU's beside it (``offloaded_step_ns``) on a stage of ``layers`` layers."""
        s = self.s
        moments, f = s.adam_moments_dtype, s.optimizer_offload_fraction
        key: int | tuple[object, ...] = (
            (params, f, layers) if f else params if moments == "fp32" else (params, moments))
        got = self.ctx.optimizer.get(key)
        if got is None:
            if f:
                got = max(self.items_ns([O.gpu_optimizer_step(s, params)], 0),
                          self.offloaded_step_ns(O.offloaded_shares(s, params)[1], layers))
            else:
                got = self.items_ns([O.optimizer_step(params, O.adam_bytes_per_param(s))], 0)
            self.ctx.optimizer[key] = got
        return got

    def offloaded_step_ns(self, on_cpu: int, layers: int) -> int:
        """The CPU's share of an offloaded optimizer step as the trace runs it
        (``RoleProgram._offloaded_step``): its pieces flow through three stations in order —
        the copy to host memory, the CPU's AdamW, the copy back — each one piece at a time, so a
        piece starts at a station once the station's previous piece and its own previous station
        are done (a flow shop)."""
        node = self.net.sys.node
        link, cpu = node.host_link_GBps, node.host_cpu_GBps
        n = max(1, layers)
        piece, extra = divmod(on_cpu, n)
        d2h = cpu_end = h2d = 0
        for i in range(n):
            size = piece + (i < extra)
            copy = round(size * O.OFFLOAD_COPY_BYTES_PER_PARAM / link)  # (GB/s = bytes/ns)
            d2h += copy
            cpu_end = max(d2h, cpu_end) + round(size * O.CPU_ADAM_BYTES_PER_PARAM / cpu)
            h2d = max(cpu_end, h2d) + copy
        return h2d

    def list_ns(self, block: ParamBlock, which: str | tuple[str, ...], rank: int, sig: int
                ) -> int:
        """Duration of one of a block's op lists ("fwd", "bwd", or the modules selective
        recompute runs again: ``recomputed``), shared by strategies that differ only in
        recompute or data parallelism (the op lists are built only on a miss)."""
        key = (self.lists_key, block.name, which, sig)
        got = self.ctx.lists.get(key)
        if got is None:
            got = self.ctx.lists[key] = self.items_cost(self._items(block, which), rank)
        return got[0]

    def block_items(self, block: ParamBlock, which: str) -> list[O.Item]:
        """One of a block's op lists (``RoleProgram.block_items``), from the shared program."""
        return self._items(block, which)

    def _items(self, block: ParamBlock, which: str | tuple[str, ...]) -> list[O.Item]:
        """A block's op list, from the program of the first strategy with this op-list key (the
        lists depend on nothing else, and a program builds the non-layer ones together)."""
        prog = self.ctx.programs.get(self.lists_key)
        if prog is None:
            prog = self.ctx.programs[self.lists_key] = self.prog
        if isinstance(which, tuple):
            return prog.selective_items(which, block.name)
        return prog.block_items(block, which)

    def list_runs(self, block: ParamBlock, which: str | tuple[str, ...], rank: int, sig: int
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
                d = self.compute.op_time_ns(it)
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
            extend_segments(out, d >= c, max(d, c))
        return tuple(out)

    def list_busy(self, block: ParamBlock, which: str | tuple[str, ...], rank: int, sig: int
                  ) -> int:
        """The compute on the critical path of ``list_ns``'s list (``items_cost``)."""
        self.list_ns(block, which, rank, sig)
        return self.ctx.lists[self.lists_key, block.name, which, sig][1]
