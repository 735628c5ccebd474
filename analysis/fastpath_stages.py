"""The fast path's stage costs (``analysis/fastpath.py``): what one pipeline stage costs per
micro-batch and chunk — forward and backward ns from its blocks' op lists (replay's GPU and
network models, through ``analysis/fastpath_costs.py``), the backward runs its gradient buckets
follow, and ZeRO-3's gathers and reduce-scatters: blocking the chain, carried on the dense and
expert streams for the schedule walk, or prefetched a block ahead."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from analysis.dp_tails import BlockRun, slowed
from analysis.pipeline_walk import Z3Runs
from tracegen import ops as O
from tracegen.dp_comm import (
    dp_group_size,
    gather_pieces,
    outer_gather_comm,
    outer_grad_comm,
    shard_axis,
    zero3_gather_bytes,
)
from tracegen.program import ParamBlock
from tracegen.units import NS_PER_S

if TYPE_CHECKING:  # the costs module imports this one; its class is only an annotation here
    from analysis.fastpath_costs import Costs
    from analysis.merged_pass import MergedPieces


# A list of ops as it runs: (compute on the critical path?, ns) in order
Segments = tuple[tuple[bool, int], ...]
# The same list for slowing by streams outside it (``slowed_runs``): (kernel ns, ns of the
# overlapped collectives issued with it) in order; a blocking collective is (0, ns)
Runs = tuple[tuple[int, int], ...]


def extend_segments(out: list[tuple[bool, int]], comp: bool, ns: int) -> None:
    """Append a segment, merged into the last one when of the same kind."""
    if out and out[-1][0] == comp:
        out[-1] = (comp, out[-1][1] + ns)
    elif ns:
        out.append((comp, ns))


class Stage(NamedTuple):
    """What one pipeline stage costs per micro-batch, per chunk (shared by every stage, and every
    strategy, with the same blocks, layer shapes and group shapes)."""

    fwd: tuple[int, ...]
    bwd: tuple[int, ...]
    # Per chunk, in backward order: (block, backward ns of one, how many in a row, the share
    # of its backward that is compute on the critical path — the gradient buckets' drain
    # slows each run of blocks by its own, ``dp_tails._drain``).
    runs_bwd: tuple[tuple[BlockRun, ...], ...]
    early_f: tuple[int, ...]  # ZeRO-3: the gathers before the chunk's first compute (need no input)
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
    # ZeRO-3 with several instances (HSDP), per chunk: its last backward with the cross-instance
    # all-reduces on their own stream, (how much later its compute ends for their interference,
    # when the last of them ends from the backward's end without them, their sum)
    # (``_outer_pass``)
    outer_b: tuple[tuple[int, int, int], ...] = ()
    # HFSDP, per chunk: its first forward of the step, each block gathered across the
    # instances before its inner gathers: (``early_f``, ``fwd``) of that forward (blocking
    # the chain, or prefetched: ``_prefetched_chunk``)
    first_f: tuple[tuple[int, int], ...] = ()
    # ZB-H1 (``fwd``/``bwd`` are then F and B): the stage's W pass as the gradient tails read
    # a last backward — ``bwd`` its W ns per chunk, ``runs_bwd`` its blocks' W GEMMs, the
    # rest this stage's (``_w_view``); kept here so that its identity, which the tails' memo
    # keys, lives as long as the stage's
    w_view: Stage | None = None
    # ZB-H1, ZB-V: what one micro-batch's deferred W pass keeps, per chunk
    # (``memory.w_hold_bytes``)
    w_hold_bytes: tuple[int, ...] = ()
    # a stage costed on another system than the pipeline's (``fastpath.estimate_stages``): that
    # system's costs, which its gradient reduction, optimizer step and gathers are drained on
    # (``dp_tails``); None: the pipeline's own
    costs: Costs | None = None
    # combined 1F1B (``overlap_moe_ep_comm``), per pair of the stage's chunks (forward chunk
    # · vpp + backward chunk): a forward merged with a backward as one pass, (when its sends
    # go, when it ends) (``merged_pass.run_pieces``)
    merged: tuple[tuple[int, int], ...] = ()
    # and their pieces, for a merged pass whose inputs come late (``merged_walk``)
    merged_pieces: tuple[MergedPieces, ...] = ()


def stage_costs(costs: Costs, gcis: tuple[int, ...], chunks: tuple[tuple[object, ...], ...],
                 rank: int, sig: int) -> Stage:
    """Per chunk: forward and backward ns of one micro-batch, and the backward runs of blocks
    with their durations for the gradient buckets."""
    stage = (_zero3_stage(costs, gcis, chunks, rank, sig) if costs.s.zero_stage == 3 else
             _plain_stage(costs, gcis, chunks, rank, sig))
    if costs.s.overlap_moe_ep_comm:
        from analysis.merged_pass import merged_pieces, run_pieces

        runs = [costs.chunk_runs(gci, key) for gci, key in zip(gcis, chunks, strict=True)]
        pieces = tuple(merged_pieces(costs, f, b, rank) for f in runs for b in runs)
        kappa = costs.compute.gpu.comm_interference
        stage = stage._replace(merged=tuple(run_pieces(x, kappa) for x in pieces),
                               merged_pieces=pieces)
    if costs.s.cpu_offload_layers:
        stage = _offload_waits(costs, stage, costs.chunk_runs(gcis[0], chunks[0]), rank, sig)
    if costs.zb:
        blocks = [costs.chunk_runs(gci, key) for gci, key in zip(gcis, chunks, strict=True)]
        stage = stage._replace(w_view=_w_view(costs, stage, blocks, rank, sig),
                               w_hold_bytes=tuple(sum(count * O.weight_grad_operand_bytes(
                                   costs.block_items(block, "w")) for block, count in chunk)
                                   for chunk in blocks))
    return stage


def _offload_waits(costs: Costs, stage: Stage, chunk: list[tuple[ParamBlock, int]], rank: int,
                   sig: int) -> Stage:
    """A stage (pp 1: one chunk) whose passes wait for activation offloading's copies
    (``Costs.offload_waits``): the forward's and backward's waits added to their times, and
    the backward's to the offloaded layers' runs, whose reloads it waits for — so the gradient
    buckets those layers fill are ready as late as the trace makes them."""
    fx, bx = costs.offload_waits(chunk, rank, sig)
    runs = stage.runs_bwd[0]
    k = sum(count for block, _, count, _ in runs if block.offloaded)
    extra = bx // k if k else 0
    kappa = costs.compute.gpu.comm_interference

    def slowed_share(bb: int, share: float) -> float:
        """The share of a block lengthened by ``extra`` of waiting that the gradient buckets'
        interference still slows: its compute, slowed by κ, runs inside the wait for its
        reload first (replay: the block starts when the reload ends either way), so of κ ·
        share · bb only what exceeds the wait lengthens it (the buckets' slowing charged on
        top of a reload-paced backward had made it 3.3% slow, agreement bench seed 611)."""
        if not bb + extra:
            return 0.0
        if not kappa:
            return share * bb / (bb + extra)
        return max(0.0, kappa * share * bb - extra) / (kappa * (bb + extra))

    runs = tuple((block, bb + extra, count, slowed_share(bb, share))
                 if block.offloaded else (block, bb, count, share)
                 for block, bb, count, share in runs)
    stage = stage._replace(fwd=(stage.fwd[0] + fx,), bwd=(stage.bwd[0] + bx,),
                           fwd_s=stage.fwd_s + fx / NS_PER_S, bwd_s=stage.bwd_s + bx / NS_PER_S,
                           runs_bwd=(runs,))
    if stage.z3_f and k:  # ZeRO-3 on a MoE model without prefetch: the walk's passes wait as
        # well, each offloaded layer for its share before its compute (the backward's before
        # those layers' reduce-scatters, as the trace's reloads hold them: at the pass's end,
        # the waits hid behind the streams' draining — 2.2% fast on a draw of the agreement
        # bench, seed 606), the collectives in flight running on beside the wait
        stage = stage._replace(
            z3_f=(_zero3_runs(costs, chunk, rank, sig, backward=False, wait=fx // k),),
            z3_b=(_zero3_runs(costs, chunk[::-1], rank, sig, backward=True, wait=extra),))
    return stage


def _plain_stage(costs: Costs, gcis: tuple[int, ...], chunks: tuple[tuple[object, ...], ...],
                 rank: int, sig: int) -> Stage:
    """``stage_costs`` without ZeRO-3: no gathers or scatters in the passes (the screening
    common case, spelled out: it has none of ``_zero3_stage``'s per-chunk terms to find)."""
    fwd, bwd, runs_bwd, phi, phi_f = [], [], [], [], []
    dense = expert = layers = 0
    for gci, key in zip(gcis, chunks, strict=True):
        f, b, busy_f, busy_b, runs, d, e, n = _chunk_sums(costs, costs.chunk_runs(gci, key),
                                                          rank, sig)
        dense, expert, layers = dense + d, expert + e, layers + n
        fwd.append(f)
        bwd.append(b)
        runs_bwd.append(runs)
        phi.append(busy_b)
        phi_f.append(busy_f)
    zeros = (0,) * len(gcis)
    return Stage(tuple(fwd), tuple(bwd), tuple(runs_bwd), zeros, zeros, zeros,
                 (("dp", dense), ("edp", expert)), sum(fwd) / NS_PER_S, sum(bwd) / NS_PER_S,
                 dense + expert, layers, tuple(phi), zeros, tuple(phi_f))


def _chunk_sums(costs: Costs, chunk: list[tuple[ParamBlock, int]], rank: int, sig: int
                ) -> tuple[int, int, float, float, tuple[BlockRun, ...], int, int, int]:
    """One chunk's blocks summed: (forward ns, backward ns, the share of each that is compute
    on the critical path — forward, backward —, the backward's runs of blocks in backward
    order, dense and expert parameters, transformer layers)."""
    f = b = u = uf = dense = expert = layers = 0
    runs = []
    for block, count in chunk:
        bf, bb, uff, ub, share = costs.block(block, rank, sig)
        f += count * bf
        b += count * bb
        u += count * ub
        uf += count * uff
        runs.append((block, bb, count, share))
        dense += count * block.dense
        expert += count * block.expert
        if block.is_layer:
            layers += count
    return (f, b, uf / f if f else 0.0, u / b if b else 0.0, tuple(runs[::-1]), dense, expert,
            layers)


def _zero3_stage(costs: Costs, gcis: tuple[int, ...], chunks: tuple[tuple[object, ...], ...],
                 rank: int, sig: int) -> Stage:
    """``stage_costs`` under ZeRO-3: the gathers and scatters each chunk's passes run, blocking
    or prefetched, and with several instances (HSDP) the cross-instance terms."""
    prefetch = costs.s.zero3_prefetch
    fwd, bwd, runs_bwd, early_f, early_b, late_b = [], [], [], [], [], []
    overlap_b: list[int] = []
    hsdp = costs.s.dist_opt_instances > 1
    outer: list[tuple[int, int, int]] = []
    first: list[tuple[int, int]] = []  # HFSDP's first forwards
    hfsdp = hsdp and costs.s.hfsdp
    after_tail: list[tuple[int, int]] = []
    phi: list[float] = []  # the share of compute in a backward: it slows buckets (``dp_tails``)
    phi_f: list[float] = []  # and in a forward
    dense = expert = layers = 0
    for gci, key in zip(gcis, chunks, strict=True):
        chunk = costs.chunk_runs(gci, key)
        f, b, busy_f, busy_b, runs, d, e, n = _chunk_sums(costs, chunk, rank, sig)
        dense, expert, layers = dense + d, expert + e, layers + n
        runs_bwd.append(runs)
        phi.append(busy_b)
        phi_f.append(busy_f)
        if hsdp:
            outer.append(_outer_pass(costs, chunk, rank, sig))
        lead = _leading(costs, chunk, rank, sig) if not prefetch else ()
        if hfsdp and not prefetch:  # each block's outer gather blocks the chain too
            gathers = [count * _outer_gather_ns(costs, block, rank) for block, count in chunk]
            first.append((sum(_outer_gather_ns(costs, block, rank)
                              + _zero3_ns(costs, block, rank, "ALL_GATHER") for block in lead),
                          f + sum(gathers)))
        if prefetch:
            chunk_f, chunk_b, first_f, first_b, tail_b, hidden_b, last_b = _prefetched_chunk(
                costs, chunk, rank, sig, first if hfsdp else None)
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
        early_f.append(sum(_zero3_ns(costs, block, rank, "ALL_GATHER") for block in lead))
        early_b.append(_zero3_ns(costs, chunk[-1][0], rank, "ALL_GATHER"))
        # the dense and expert reduce-scatters run on their own groups' streams, side by side
        late_b.append(max(zero3_axes(costs, chunk[0][0], rank, "REDUCE_SCATTER")))
        overlap_b.append(_trailing_overlap(costs, chunk, rank, sig))
    stage = Stage(tuple(fwd), tuple(bwd), tuple(runs_bwd), tuple(early_f), tuple(early_b),
                   tuple(late_b),
                   (("dp", dense), ("edp", expert)), sum(fwd) / NS_PER_S, sum(bwd) / NS_PER_S,
                   dense + expert, layers, tuple(phi), tuple(overlap_b),
                   tuple(phi_f))
    if prefetch:
        stage = stage._replace(after_tail_b=tuple(after_tail))
    if hsdp:
        stage = stage._replace(outer_b=tuple(outer), first_f=tuple(first))
    if costs.moe and not prefetch:  # the passes the two-stream walk steps through
        blocks = [costs.chunk_runs(gci, key) for gci, key in zip(gcis, chunks, strict=True)]
        stage = stage._replace(
            z3_f=tuple(_zero3_runs(costs, b, rank, sig, backward=False) for b in blocks),
            z3_b=tuple(_zero3_runs(costs, b[::-1], rank, sig, backward=True) for b in blocks),
            z3_lead_f=tuple(_z3_lead(costs, b, rank, sig, backward=False) for b in blocks),
            z3_lead_b=tuple(_z3_lead(costs, b[::-1], rank, sig, backward=True) for b in blocks))
    return stage


def _w_view(costs: Costs, stage: Stage, chunks: list[list[tuple[ParamBlock, int]]],
            rank: int, sig: int) -> Stage:
    """ZB-H1: ``stage`` with its W pass in place of its backward (``Stage.w_view``): per chunk
    the weight-gradient GEMMs of its blocks (``ops.split_weight_grads``), in backward order
    with their compute shares (all compute: W issues no collective before the buckets)."""
    wgt, runs, busy = [], [], []
    for chunk in chunks:
        w = u = 0
        out = []
        for block, count in reversed(chunk):
            d = costs.list_ns(block, "w", rank, sig)
            c = costs.list_busy(block, "w", rank, sig)
            w += count * d
            u += count * c
            out.append((block, d, count, c / d if d else 0.0))
        wgt.append(w)
        runs.append(tuple(out))
        busy.append(u / w if w else 0.0)
    return stage._replace(bwd=tuple(wgt), runs_bwd=tuple(runs), busy_b=tuple(busy),
                          bwd_s=sum(wgt) / NS_PER_S)


def _leading(costs: Costs, chunk: list[tuple[ParamBlock, int]], rank: int, sig: int
             ) -> list[ParamBlock]:
    """ZeRO-3 without prefetch: a chunk's blocks whose gathers the forward runs before it
    needs its input — the first block, and before it any that compute nothing in the forward
    (an MTP stage's embedding copy: a block without ops passes the input's wait on to the
    next, ``RoleProgram.forward``, while the gathers are in the chain)."""
    out = []
    for block, _ in chunk:
        out.append(block)
        if _compute_ns(costs, block, rank, sig)[0]:
            break
    return out


def _trailing_overlap(costs: Costs, chunk: list[tuple[ParamBlock, int]], rank: int,
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
    scatter = zero3_axes(costs, chunk[0][0], rank, "REDUCE_SCATTER")
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
            if zero3_axes(costs, block, rank, "ALL_GATHER")[a]:
                slow = min(kappa * lead, kappa / (1 + kappa) * late)
                exposed = max(exposed, scatter[a] - lead, slow)
                break
            lead += count * _compute_ns(costs, block, rank, sig)[1]
    return late - round(exposed)


def _zero3_runs(costs: Costs, runs: list[tuple[ParamBlock, int]], rank: int,
                sig: int, backward: bool, wait: int = 0) -> Z3Runs:
    """ZeRO-3 without prefetch on a MoE model: one chunk's pass in the order it runs, each run
    of equal blocks as (dense gather, expert gather, compute, dense reduce-scatter, expert
    reduce-scatter) ns and its count, for the schedule walk's two-stream state
    (``pipeline_walk.z3_map``). The per-block charge of ``block_ns`` pairs a block's
    reduce-scatters with its own gathers: exact for a chunk of equal blocks, not where a block
    gathers on one stream only (the embedding, the head) and a layer's expert reduce-scatter
    runs on beside it; nor can one number after the send carry two streams into the next step.
    In backward a block that gathers no experts computes beside the expert reduce-scatter of
    the MoE layer before it, still in flight: replay slows its kernels for that
    (``_beside_experts``), which the walk's max-plus pass cannot — its compute carries it.
    ``wait``: what each offloaded layer waits for its copy before its compute (activation
    offloading, ``_offload_waits``), in its compute too."""
    out: list[tuple[tuple[int, int, int, int, int], int]] = []
    kappa = costs.compute.gpu.comm_interference if backward and costs.moe else 0.0
    clock = [0, 0, 0]  # the pass walked alone: chain, dense stream, expert stream
    for block, count in runs:
        g = zero3_axes(costs, block, rank, "ALL_GATHER")
        r = zero3_axes(costs, block, rank, "REDUCE_SCATTER") if backward else (0, 0)
        comp = _compute_ns(costs, block, rank, sig)[1 if backward else 0]
        held = wait if block.offloaded else 0
        if not kappa:
            out.append(((g[0], g[1], held + comp, r[0], r[1]), count))
            continue
        share = _compute_ns(costs, block, rank, sig, busy=True)[1] / comp if comp else 0.0
        for _ in range(count):
            run = (g[0], g[1], comp + _beside_experts(clock, g, held, comp, r, kappa * share),
                   r[0], r[1])
            if out and out[-1][0] == run:
                out[-1] = (run, out[-1][1] + 1)
            else:
                out.append((run, 1))
    return tuple(out)


def _beside_experts(clock: list[int], g: tuple[int, int], held: int, comp: int,
                    r: tuple[int, int], kappa: float) -> int:
    """One backward block walked on ``clock`` (chain, dense and expert stream ends; updated):
    how much longer than ``comp`` it takes — ``held`` waiting (for its reload, offloading)
    before its compute, and its compute slowed for collectives still in flight on the streams
    it did not wait for — a dense layer's beside the expert reduce-scatter of the MoE layer
    before it (Llama 4 Maverick's pattern puts one before every dense layer: without it the
    fast path was 2.3% below replay, agreement bench seed 613). A block that waits for both
    streams' gathers adds only ``held``; the wait runs down the collectives beside it first
    (charged on top of it, +3.0% on seed 607 with offloading)."""
    t, fd, fe = clock
    if g[0]:
        t = fd = max(fd, t) + g[0]
    if g[1]:
        t = fe = max(fe, t) + g[1]
    start = t
    t += held
    end = round(slowed(t, comp, [x for x in (fd, fe) if x > t], kappa))
    extra = end - start - comp
    if r[0]:
        fd = max(fd, end) + r[0]
    if r[1]:
        fe = max(fe, end) + r[1]
    clock[:] = [end, fd, fe]
    return extra


def _z3_lead(costs: Costs, runs: list[tuple[ParamBlock, int]], rank: int,
             sig: int, backward: bool) -> tuple[int, int]:
    """A pass's leading blocks that neither gather nor reduce-scatter (a tied head's backward:
    its weight is the embedding's): (their ns, the compute on the critical path in it). They
    start as the pass does, beside whatever the streams still carry from the pass before, and
    replay slows their kernels for it (``_Streams``)."""
    ns = busy = 0
    side = 1 if backward else 0
    for block, count in runs:
        if any(zero3_axes(costs, block, rank, "ALL_GATHER")) or (
                backward and any(zero3_axes(costs, block, rank, "REDUCE_SCATTER"))):
            break
        ns += count * _compute_ns(costs, block, rank, sig)[side]
        busy += count * compute_busy(costs, block, rank, sig)[side]
    return ns, busy


def _compute_ns(costs: Costs, block: ParamBlock, rank: int, sig: int,
                busy: bool = False) -> tuple[int, int]:
    """(forward, backward) ns of one block's own op lists for one micro-batch. The backward
    recomputes what ``RoleProgram._recompute_items`` lists: a layer's forward (full) or the
    modules selective recompute names (``Strategy.recompute_modules``). ``busy``: their
    compute on the critical path instead (``Costs.items_cost``)."""
    s = costs.s
    get = costs.list_busy if busy else costs.list_ns
    fwd = get(block, "fwd", rank, sig)
    again = 0
    if block.recomputes and s.recompute != "none":
        again = fwd if s.recompute == "full" else get(block, costs.recomputed, rank, sig)
    return fwd, again + get(block, "b" if costs.zb else "bwd", rank, sig)  # (ZB-H1: B alone)


def compute_busy(costs: Costs, block: ParamBlock, rank: int, sig: int
                  ) -> tuple[int, int]:
    return _compute_ns(costs, block, rank, sig, busy=True)


def _prefetched_chunk(costs: Costs, chunk: list[tuple[ParamBlock, int]], rank: int,
                      sig: int, first: list[tuple[int, int]] | None = None
                      ) -> tuple[int, int, int, int, int, int, int]:
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
    too fast). ``first`` (HFSDP): appended with the chunk's first forward, each block's
    gather across the instances issued where its inner gathers are, on its own stream, before
    them (``RoleProgram._zero3_gather``): its (first gathers, forward)."""
    blocks = [block for block, count in chunk for _ in range(count)]
    comp = [_compute_ns(costs, b, rank, sig) for b in blocks]
    gather = [zero3_axes(costs, b, rank, "ALL_GATHER") for b in blocks]
    scatter = [zero3_axes(costs, b, rank, "REDUCE_SCATTER") for b in blocks]
    kappa = costs.compute.gpu.comm_interference
    # with interference, each block as it runs: its kernels slow while the streams are busy
    segs = [_compute_runs(costs, b, rank, sig) for b in blocks] if kappa else None
    comp_f, segs_f = [c[0] for c in comp], [s[0] for s in segs] if segs else None
    fwd, first_f, _, _ = prefetch_pass(range(len(blocks)), comp_f, gather, None, segs_f, kappa)
    if first is not None:
        pre = [_outer_gather_ns(costs, b, rank) for b in blocks]
        once, once_first, _, _ = prefetch_pass(range(len(blocks)), comp_f, gather, None, segs_f,
                                               kappa, pre=pre)
        first.append((once_first, once))
    order = range(len(blocks) - 1, -1, -1)
    comp_b, segs_b = [c[1] for c in comp], [s[1] for s in segs] if segs else None
    bwd, first_b, last, tails = prefetch_pass(order, comp_b, gather, scatter, segs_b, kappa)
    again, _, again_last, _ = prefetch_pass(order, comp_b, gather, scatter, segs_b, kappa,
                                             tails)
    return fwd, bwd, first_f, first_b, bwd - last, 2 * bwd - last - again, again_last - bwd + last


def _outer_pass(costs: Costs, chunk: list[tuple[ParamBlock, int]], rank: int, sig: int
                ) -> tuple[int, int, int]:
    """HSDP (ZeRO-3 with several instances): a chunk's last backward, each block's dense (and
    expert) reduce-scatter followed by its shard's all-reduce (HFSDP: reduce-scatter) across
    the instances on their own stream (``RoleProgram._grad_reduce``), walked block by block as the
    pass runs without them (``prefetch_pass``, or the chain of gathers, backward and
    reduce-scatter of each block without prefetch: ``block_ns``): (how much later its compute
    ends — kernels slowed while the cross-instance collectives run, interference — and when
    the last of them ends, both from the pass's end without them; what they take together)."""
    s = costs.s
    blocks = [block for block, count in chunk for _ in range(count)][::-1]
    # each block's dense and expert shards, one after the other on the one stream
    outer = [sum(costs.net.shape_ns(c.coll, c.size_bytes, costs.shape(c.axis, rank))
                 for axis, n in (("dp", b.dense), ("edp", b.expert)) if n
                 and dp_group_size(s, axis) > 1 for c in (outer_grad_comm(s, b.name, n, axis),))
             for b in blocks]
    comp = [_compute_ns(costs, b, rank, sig)[1] for b in blocks]
    gather = [zero3_axes(costs, b, rank, "ALL_GATHER") for b in blocks]
    scatter = [zero3_axes(costs, b, rank, "REDUCE_SCATTER") for b in blocks]
    kappa = costs.compute.gpu.comm_interference
    segs = [_compute_runs(costs, b, rank, sig)[1] for b in blocks] if kappa else None
    if s.zero3_prefetch:
        order = range(len(blocks))
        base = prefetch_pass(order, comp, gather, scatter, segs, kappa)[0]
        lane = [0, 0]  # (busy until, since)
        end = prefetch_pass(order, comp, gather, scatter, segs, kappa, lane=lane, outer=outer)[0]
        return end - base, lane[0] - base, sum(outer)
    w = base = lane_end = 0
    for i in range(len(blocks)):  # each block's gathers, backward and scatter in the chain
        g, r = sum(gather[i]), max(scatter[i])
        base += g + comp[i] + r
        w += g
        w = (w + comp[i] if segs is None
             else round(slowed_runs(w, segs[i], [lane_end], kappa))) + r
        if outer[i]:
            lane_end = max(lane_end, w) + outer[i]
    return w - base, lane_end - base, sum(outer)


def slowed_runs(w: float, runs: Runs, busy: Sequence[float], kappa: float,
                spans: list[tuple[float, float]] | None = None) -> float:
    """Wall time after running ``runs`` (``Costs.items_runs``) from ``w`` while streams are
    busy until each of ``busy``: each kernel slowed by those and by the list's own overlapped
    collectives in flight beside it, together (``slowed``); the collectives not (replay/sim.py
    slows kernels, not transfers). Slowing a TP-overlapped block's merged segments by the
    streams alone lost the kernels under a longer collective and charged the rest the two
    slowdowns one on the other: −1.8% / +0.8% against replay with prefetched ZeRO-3 gathers.
    ``spans``: streams busy from one time to another (``slowed_spans``) besides."""
    for d, c in runs:
        if not c:
            w = _slowed_by(w, d, busy, spans, kappa)
        elif d:
            w = max(_slowed_by(w, d, [*busy, w + c], spans, kappa), w + c)
        else:
            w += c
    return w


def _slowed_by(w: float, dt: float, busy: Sequence[float], spans: list[tuple[float, float]] | None,
               kappa: float) -> float:
    if not spans:
        return slowed(w, dt, busy, kappa)
    return slowed_spans(w, dt, [*((w, e) for e in busy), *spans], kappa)


def slowed_spans(w: float, dt: float, spans: list[tuple[float, float]], kappa: float) -> float:
    """``slowed`` with each stream busy over a span (from, until) instead of from now: a
    stream whose collective is queued behind another stream's (HFSDP's inner gather behind
    its outer one) slows nothing until it starts."""
    for point in sorted({x for span in spans for x in span if x > w}):
        n = sum(1 for lo, hi in spans if lo <= w < hi)
        rate = 1 + kappa * n
        if (point - w) / rate >= dt:
            return w + dt * rate
        dt -= (point - w) / rate
        w = point
    return w + dt


def _compute_runs(costs: Costs, block: ParamBlock, rank: int, sig: int
                  ) -> tuple[Runs, Runs]:
    """``_compute_ns`` as runs (``Costs.list_runs``): the forward, and the backward after
    what it recomputes."""
    fwd = costs.list_runs(block, "fwd", rank, sig)
    again: Runs = ()
    if block.recomputes and costs.s.recompute != "none":
        again = fwd if costs.s.recompute == "full" else costs.list_runs(
            block, costs.recomputed, rank, sig)
    return fwd, again + costs.list_runs(block, "bwd", rank, sig)


def prefetch_pass(order: range, comp: list[int], gather: list[tuple[int, int]],
                   scatter: list[tuple[int, int]] | None, segs: list[Runs] | None,
                   kappa: float, busy: tuple[int, int] = (0, 0),
                   lane: list[int] | None = None, outer: list[int] | None = None,
                   pre: list[int] | None = None
                   ) -> tuple[int, int, int, tuple[int, int]]:
    """(end with its streams drained, end of its first block's gathers, end of its last
    compute, how long each stream runs on after that) of one pass over blocks in ``order``;
    dense and expert groups, a stream each, busy until ``busy`` when the pass starts (its first
    gathers after all of them); with ``segs``, a block's kernels slowed while the streams are
    busy (interference, ``slowed``), its own collectives not. HSDP's all-reduces (``outer``,
    per block) follow each dense reduce-scatter on a third stream, busy from ``lane[1]`` until
    ``lane[0]``. HFSDP's gathers across the instances (``pre``, per block; a forward's) run
    on a stream of their own, each before its block's dense gather, which waits for it."""
    stream = list(busy)
    # the pass's first gathers wait for every group's last reduce-scatter, not only their own
    # group's (``RoleProgram._zero3_gathers``); a first block that gathers nothing (a tied head)
    # waits for none
    head = pre[order[0]] if pre else 0
    chain = max(busy) if any(gather[order[0]]) or head else 0
    chain = outer_end = chain + head
    for a in (0, 1):  # the first block's gathers block the chain, dense then expert
        if gather[order[0]][a]:
            chain = stream[a] = max(chain, stream[a]) + gather[order[0]][a]
    first_done = ready = chain
    # HFSDP's first forward (``pre``): each stream busy over a span
    spans: list[tuple[float, float]] = [(0, e) for e in stream if e > chain] if pre else []
    for j, i in enumerate(order):
        # a pass's last block that computes nothing (the MTP stage's embedding copy, whose
        # lookup's gradient the MTP module computes) has its gathers issued but waited for by
        # nothing: the chain runs on to the send (``RoleProgram.backward``)
        start = chain if j and j + 1 == len(order) and not comp[i] else max(chain, ready)
        if j + 1 < len(order):  # the next block's gathers start as this block does
            ready = after = start
            if pre and pre[order[j + 1]]:
                lo = max(start, outer_end)
                ready = after = outer_end = lo + pre[order[j + 1]]
                spans.append((lo, outer_end))
            for a, g in enumerate(gather[order[j + 1]]):
                if g:
                    lo = max(after, stream[a])
                    stream[a] = lo + g  # (HFSDP: dense models only)
                    ready = max(ready, stream[a])
                    if pre:
                        spans.append((lo, stream[a]))
        if segs is None:
            chain = start + comp[i]
        elif pre:  # the inner gathers wait for the outer: each stream busy over its span
            spans = [span for span in spans if span[1] > start]
            chain = round(slowed_runs(start, segs[i], [], kappa, spans))
        else:
            busy_now = stream if lane is None else stream + _lane_busy(lane, start)
            chain = round(slowed_runs(start, segs[i], busy_now, kappa))
        if scatter is not None:
            for a, r in enumerate(scatter[i]):
                if r:
                    stream[a] = max(chain, stream[a]) + r
            if lane is not None and outer is not None and outer[i]:
                # (after the block's reduce-scatter; an instance of one rank has none)
                after = stream[0] if scatter[i][0] else chain
                if lane[0] < after:  # an idle lane: a new run of all-reduces begins
                    lane[1] = after
                lane[0] = max(lane[0], after) + outer[i]
    tails = (max(stream[0] - chain, 0), max(stream[1] - chain, 0))
    return max(chain, *stream), first_done, chain, tails


def _lane_busy(lane: list[int], w: int) -> list[int]:
    """HSDP's all-reduce stream as ``slowed`` sees streams, busy from ``w``: its run of
    all-reduces that may begin after ``w`` (at a reduce-scatter's end) counted from ``w`` for
    as long as it lasts — the same overlap with a kernel that the dense stream, busy
    throughout, slows anyway."""
    if lane[0] <= w:
        return []
    return [w + lane[0] - max(lane[1], w)]


def _outer_gather_ns(costs: Costs, block: ParamBlock, rank: int) -> int:
    """HFSDP: a block's all-gather across the instances (``outer_gather_comm``), 0 for a block
    of no dense parameters."""
    if not block.dense:
        return 0
    c = outer_gather_comm(costs.s, block.name, block.dense)
    return costs.net.shape_ns("ALL_GATHER", c.size_bytes, costs.shape("dpr", rank))


def block_ns(costs: Costs, block: ParamBlock, rank: int, sig: int
              ) -> tuple[int, int]:
    """(forward, backward) ns of one block for one micro-batch (``_compute_ns``), with ZeRO-3's
    gathers and reduce-scatters where they block the chain."""
    s = costs.s
    fwd, bwd = _compute_ns(costs, block, rank, sig)
    if s.zero_stage != 3:
        return fwd, bwd
    g_dp, g_edp = zero3_axes(costs, block, rank, "ALL_GATHER")
    r_dp, r_edp = zero3_axes(costs, block, rank, "REDUCE_SCATTER")
    # The chain gathers the dense then the expert parameters. In backward the next block's
    # dense gather waits for this one's dense reduce-scatter and its expert gather for the
    # expert one (each group's collectives in order on its own stream), the two reduce-scatters
    # running side by side: per block of a run, max(r_dp + g_dp, r_edp) + g_edp.
    return g_dp + g_edp + fwd, bwd + max(r_dp + g_dp, r_edp) + g_edp


def chain_and_stream_ns(costs: Costs, block: ParamBlock, rank: int, sig: int
                        ) -> tuple[int, int, tuple[int, int], tuple[int, int]]:
    """(forward, backward ns on the chain, gathers, reduce-scatters beside it — each (dense,
    expert), on their groups' streams) of one block: with ZeRO-3's gathers prefetched, its
    compute on the chain and its collectives on the data-parallel streams; otherwise
    ``block_ns`` on the chain and nothing beside it."""
    if not (costs.s.zero_stage == 3 and costs.s.zero3_prefetch):
        return (*block_ns(costs, block, rank, sig), (0, 0), (0, 0))
    fwd, bwd = _compute_ns(costs, block, rank, sig)
    return (fwd, bwd, zero3_axes(costs, block, rank, "ALL_GATHER"),
            zero3_axes(costs, block, rank, "REDUCE_SCATTER"))


def _zero3_ns(costs: Costs, block: ParamBlock, rank: int, coll: O.CollType) -> int:
    """ZeRO-3: the parameter all-gathers (per-rank shard; 16-bit, or FP8 with
    ``fp8_param_gather``) or the gradient reduce-scatters
    (full buffer) of a block, dense and expert one after the other."""
    return sum(zero3_axes(costs, block, rank, coll))


def zero3_axes(costs: Costs, block: ParamBlock, rank: int, coll: O.CollType
                ) -> tuple[int, int]:
    """``_zero3_ns`` per group: (dense, expert), memoized: it reads the strategy only through
    the costs key (dp, the gather pieces and dtype, the reduce dtype) and the layout of
    ``rank``'s groups; the block by its sizes and its name (a 16-bit embedding or head beside
    FP8 layers: ``zero3_gather_bytes``)."""
    key = (costs.key, costs._degrees, rank, block.dense, block.expert, block.name, coll)
    got = costs.ctx.zero3.get(key)
    if got is None:
        got = costs.ctx.zero3[key] = _zero3_axes_ns(costs, block, rank, coll)
    return got


def _zero3_axes_ns(costs: Costs, block: ParamBlock, rank: int, coll: O.CollType
                   ) -> tuple[int, int]:
    out = [0, 0]
    for i, (axis, n) in enumerate((("dp", block.dense), ("edp", block.expert))):
        axis = shard_axis(costs.s, axis)  # (HSDP: inside the instance)
        size = dp_group_size(costs.s, axis)
        if not n or size < 2:
            continue
        if coll == "REDUCE_SCATTER":
            nbytes = -(-n // size) * size * O.grad_reduce_bytes(costs.s)
            out[i] = costs.coll_ns(O.Comm(coll.lower(), axis, coll, nbytes), rank)
            continue
        for piece in gather_pieces(n, costs.s.zero3_gather_bucket_params):
            shard = -(-piece // size) * zero3_gather_bytes(costs.s, block.name)
            out[i] += costs.coll_ns(O.Comm(coll.lower(), axis, coll, shard), rank)
    return out[0], out[1]
