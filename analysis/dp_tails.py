"""What follows a stage's last backward in the fast path (``analysis/fastpath.py``): the
data-parallel gradient buckets drained on their stream exactly as the trace issues them (runs of
equal buckets in closed form), the tied-embedding all-reduce, the optimizer step and the ZeRO
parameter all-gathers. The step ends when the last checked stage finishes."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from replay.network import Shape
from tracegen import ops as O
from tracegen.dp_comm import dp_group_size, instance_axis, shard_axis, sharded_params
from tracegen.program import ParamBlock

if TYPE_CHECKING:  # the fast path imports this module; its types are only annotations here
    from analysis.fastpath_costs import Costs
    from analysis.fastpath_stages import Stage
    from analysis.pipeline_walk import Tails


def tails_ns(costs: Costs, stages: list[Stage], reps: list[int], ends: list[int],
             chunk_ends: Sequence[Sequence[int]], check: Iterable[int], alike: bool = False,
             steps: Tails | None = None, sends: Sequence[int] = (), waits: bool = True) -> int:
    """When the last of the ``check`` stages finishes: gradient buckets drained after its last
    backward, embedding all-reduce, optimizer and ZeRO parameter all-gather. ``reps``: a rank
    whose data-parallel groups are shaped as the stage's; ``alike``: the middle stages are one
    stage (``fastpath._stages``). With interference a stage's buckets slow its last backward,
    and every earlier stage's last backward waits for it in the drain: stage st ends later by
    what the stages after it lost — or, given a walk's cooldowns (``steps``, with
    the ``sends`` between stages), exactly where each stage's inputs come late
    (``_cooldowns``). ``waits`` False: no stage waits for another's last pass (ZB-H1's
    last W), so none ends later for what a later one lost."""
    s = costs.s
    # ZeRO-2 communicates as ZeRO-1 (it shards the gradients too, which only the memory model
    # sees): the ZeRO stage as the timing sees it, so a sweep's ZeRO 1 and 2 twins share memos
    strategy_key = costs.ctx.intern((s.dp_bucket_params, s.overlap_grad_reduce,
                                     1 if s.zero_stage == 2 else s.zero_stage,
                                     s.dp, s.cp, s.ep, s.overlap_param_gather,
                                     s.grad_reduce_in_bf16, s.expert_tp,
                                     s.adam_moments_dtype, s.fp8_param_gather,
                                     s.dist_opt_instances, s.outer_dp_sharding_strategy,
                                     s.optimizer_offload_fraction))
    # (ZeRO-3 reduce-scatters as the backward runs whatever the flag says; HSDP's all-reduces
    # slow the last backwards, and the stages before wait for them)
    overlapped = s.overlap_grad_reduce or s.zero_stage == 3
    propagate = waits and s.pp > 1 and overlapped and costs.compute.gpu.comm_interference > 0
    shifted = propagate and bool(steps) and s.zero_stage < 3  # ends moved by their own delay
    if shifted:
        assert steps is not None
        tails = _cooldowns(costs, stages, reps, steps, sends, strategy_key)
        ends = [e + tails[st][2] for st, e in enumerate(ends)]
        chunk_ends = [[e + tails[st][2] for e in ce] for st, ce in enumerate(chunk_ends)]
    elif propagate and not alike and s.vpp > 1 and stages[0].outer_b:
        tails, ends, chunk_ends = _outer_propagate(costs, stages, reps, ends, chunk_ends,
                                                   strategy_key)
    elif propagate and alike:
        # stage 0 waits for what every later one lost; a middle stage loses what the first
        # does (the same layers' buckets; the embedding's comes after its last compute)
        tails = {st: _tail(stages[st].costs or costs, stages[st], reps[st], chunk_ends[st],
                           strategy_key)
                 for st in (0, s.pp - 1)}
        later = tails[0][2] * (s.pp - 2) + tails[s.pp - 1][2]
        ends, chunk_ends = list(ends), list(chunk_ends)  # (copies: memoized lists)
        ends[0] += later
        chunk_ends[0] = [e + later for e in chunk_ends[0]]
    elif propagate:  # (copies: the walk's lists are memoized)
        tails = {st: _tail(stages[st].costs or costs, stages[st], reps[st], chunk_ends[st],
                           strategy_key)
                 for st in range(s.pp)}
        walked, later = chunk_ends, 0
        ends, chunk_ends = list(ends), list(chunk_ends)
        for st in range(s.pp - 1, -1, -1):
            if later and st < s.pp - 1 and len(walked[st]) == 1:
                later = max(0, later - _slack(stages, walked, sends, st))
            if later:
                ends[st] += later
                chunk_ends[st] = [e + later for e in chunk_ends[st]]
            later += tails[st][2]
    else:
        tails = {st: _tail(stages[st].costs or costs, stages[st], reps[st], chunk_ends[st],
                           strategy_key)
                 for st in check}
    chain = list(ends)
    partner = costs.embd_partner  # stage 0's embedding all-reduce partner (or None)
    if partner is not None:
        first, last = ends[0], ends[partner]
        if not shifted:  # each ends later by what its own buckets slowed it (interference)
            first += tails[0][2]
            last += tails[partner][2]
        if s.zero_stage == 3 and stages[0].z3_b:
            # the all-reduce follows the last backward's compute (``RoleProgram._finish``); a
            # two-stream walk's stage ends with its streams drained, where an earlier block's
            # expert reduce-scatter may outlast the last block's (``pipeline_walk._Streams``)
            first += max(chunk_ends[0]) - ends[0]
            last += max(chunk_ends[partner]) - ends[partner]
        elif s.zero_stage == 3:
            # the all-reduce follows the last backward's compute (``RoleProgram._finish``), on
            # its own stream beside that pass's trailing reduce-scatters (``Stage.late_b``)
            first -= stages[0].late_b[0]
            last -= stages[partner].late_b[0]
        t = max(first, last) + embedding_all_reduce_ns(costs, stages, partner)
        chain[0], chain[partner] = max(t, ends[0]), max(t, ends[partner])
    finish = 0
    for st in check:
        done_rel, after, _ = tails[st]
        end = max(chunk_ends[st])
        # (without overlap the buckets follow the embedding all-reduce: ``RoleProgram._finish``)
        done = max(chain[st], end + done_rel) if overlapped else max(chain[st], end) + done_rel
        finish = max(finish, done + after)
    return finish


def embedding_all_reduce_ns(costs: Costs, stages: list[Stage], partner: int) -> int:
    """The tied embedding's gradient all-reduce between stage 0 and ``partner``, on the slower
    of the two ends' networks."""
    m, s = costs.m, costs.s
    size = m.vocab_size * m.hidden_size // s.tp * O.grad_reduce_bytes(s)
    return max(c.net.shape_ns("ALL_REDUCE", size, c.shape("embd", 0))
               for c in (x.costs or costs for x in (stages[0], stages[partner])))


def _slack(stages: list[Stage], chunk_ends: Sequence[Sequence[int]], sends: Sequence[int],
           st: int) -> int:
    """How long before stage ``st``'s last backward starts its compute the gradient it waits
    for has come (one chunk a stage): the part of a delay of stage st + 1's last backward that
    stage st absorbs, busy with its own earlier steps (a light last stage — the head alone —
    finishes well before the stage before it is ready for its gradient). A pass starts with
    its first gathers (``Stage.early_b``, ZeRO-3), which do not wait for the gradient; HSDP's
    chunk ends are drained passes (``fastpath._drained``), the gradient leaves the next stage
    at its compute end, ``Stage.late_b`` before."""
    x, nxt = stages[st], stages[st + 1]
    compute = chunk_ends[st][0] - x.bwd[0] + x.early_b[0]
    drained = nxt.late_b[0] if nxt.outer_b else 0
    return max(0, compute - (chunk_ends[st + 1][0] - drained + sends[st]))


def _tail(costs: Costs, x: Stage, rank: int, ce: Sequence[int], strategy_key: int
          ) -> tuple[int, int, int]:
    """``_tail_costs`` of one stage, memoized by the stage, its chunks' relative end times and
    everything in the strategy and layout the drain depends on."""
    rel: tuple[int, ...]
    if len(ce) == 1:
        rel = (0,)
    else:
        end = max(ce)
        rel = tuple(e - end for e in ce)
    key = (id(x), rel, strategy_key,
           costs.shape("dp", rank) if costs.s.dist_opt_instances == 1 else
           _dense_lane(costs, rank),
           _edp_key(costs, rank))
    got = costs.ctx.tails.get(key)
    if got is None:
        got = costs.ctx.tails[key] = _tail_costs(costs, x, rank, rel)
    return got


def _tail_costs(costs: Costs, x: Stage, rank: int, rel_ends: tuple[int, ...]
                ) -> tuple[int, int, int]:
    """(when the gradient buckets are done, relative to the stage's last backward; optimizer
    plus ZeRO parameter all-gathers after that; how much later the buckets make the last
    backward end, interference)."""
    if x.outer_b:  # HSDP: each chunk's last backward with its cross-instance all-reduces
        busy, extra, _ = _outer_tail(x.outer_b, rel_ends, costs.compute.gpu.comm_interference,
                                     x.busy_b)
        return max(busy, extra), _after_memo(costs, x, rank, []), extra
    done, gathers, extra = _buckets_done(costs, rank, x.runs_bwd, rel_ends, x.bwd, x.busy_b)
    return done, _after_memo(costs, x, rank, gathers), extra


def _outer_tail(outer: tuple[tuple[int, int, int], ...], rel_ends: tuple[int, ...],
                kappa: float, busy_b: tuple[float, ...]
                ) -> tuple[int, int, tuple[int, ...]]:
    """HSDP: (when the cross-instance all-reduces of every chunk's last backward are done,
    how much later the stage's last backward ends for them, how much later each chunk's last
    backward ends), relative to the stage's last backward's end without them. Each chunk's
    pass (``Stage.outer_b``: its own delay, its lane's end, the lane's work) in the order the
    chunks end; a chunk's all-reduces queue behind an earlier chunk's on the one stream. While
    that backlog runs, the compute up to the next chunk's end (its share ``busy_b`` of the
    time between the two ends) runs at 1/(1 + κ) (replay/sim.py: kernels beside a collective
    in flight, one stream so one at a time), and the next chunk's own delay is the larger of
    that and what its own all-reduces cost it."""
    busy, shift = float(_IDLE), 0.0
    order = sorted(range(len(rel_ends)), key=rel_ends.__getitem__)
    shifts = [0] * len(rel_ends)
    prev = -1
    for chunk in order:
        late, lane, work = outer[chunk]
        if prev < 0:
            shift += late
        else:
            dt = rel_ends[chunk] - rel_ends[prev]
            w = rel_ends[prev] + shift
            shift += max(late, _advance(w, dt, busy, kappa * busy_b[chunk]) - w - dt)
        start = rel_ends[chunk] + shift - late  # (the pass's end without its all-reduces)
        busy = max(start + lane, busy + work)
        shifts[chunk] = round(shift)
        prev = chunk
    return round(busy), round(shift), tuple(shifts)


def _outer_propagate(costs: Costs, stages: list[Stage], reps: list[int], ends: list[int],
                     chunk_ends: Sequence[Sequence[int]], strategy_key: int
                     ) -> tuple[dict[int, tuple[int, int, int]], list[int], list[list[int]]]:
    """HSDP with chunks under interference: ``tails_ns``'s tails, ends and chunk ends. Each
    chunk's last backward is a step of one chain, chunk by chunk in the order they end and in
    each from the last stage to the first (stage st's waits for stage st + 1's, the last
    stage's for stage 0's of the chunk after): it ends later by the larger of the delay of
    the step it waits for plus its own pass's (``Stage.outer_b``), and its stage's delay at
    its chunk before plus what the stage lost since (``_outer_tail``'s per-chunk delays: a
    slowdown early between two chunk ends is absorbed where the stage then waits for its
    input), a max-plus chain. Each stage's lanes then start from its chunk ends moved by what
    the chain added to its own delays. Until the thirty-sixth session every chunk end took
    the later stages' whole delay (summed, the chain's order ignored): up to 5% above replay
    on interleaved pipelines of four stages."""
    kappa, p = costs.compute.gpu.comm_interference, costs.s.pp
    own, order = [], []
    for x, ce in zip(stages, chunk_ends, strict=True):
        top = max(ce)
        own.append(_outer_tail(x.outer_b, tuple(e - top for e in ce), kappa, x.busy_b)[2])
        order.append(sorted(range(len(ce)), key=ce.__getitem__))
    delay = [[0] * len(ce) for ce in chunk_ends]
    waited = 0  # the delay of the step the next one waits for
    for k in range(costs.s.vpp):
        for st in range(p - 1, -1, -1):
            ch = order[st][k]
            before = delay[st][order[st][k - 1]] if k else 0
            gained = own[st][ch] - (own[st][order[st][k - 1]] if k else 0)
            waited = delay[st][ch] = max(waited + stages[st].outer_b[ch][0], before + gained)
    tails: dict[int, tuple[int, int, int]] = {}
    ends, shifted = list(ends), [list(ce) for ce in chunk_ends]
    for st, ce in enumerate(shifted):
        moved = [d - o for d, o in zip(delay[st], own[st], strict=True)]
        ends[st] += moved[order[st][-1]]
        ce[:] = [e + d for e, d in zip(ce, moved, strict=True)]
        tails[st] = _tail(stages[st].costs or costs, stages[st], reps[st], ce, strategy_key)
    return tails, ends, shifted


def _after(costs: Costs, x: Stage, rank: int, gathers: list[tuple[str, int, int]]) -> int:
    """The optimizer step and the ZeRO ≥ 1 parameter all-gathers after a stage's buckets."""
    s = costs.s
    after = costs.optimizer_ns(sharded_params(s, dict(x.params)), x.layers)
    if s.overlap_param_gather:  # the gathers open the next step (``_param_gather_delay``)
        gathers = []
    for axis, padded, count in gathers:
        if dp_group_size(s, axis) < 2:  # (an instance of one rank gathers nothing)
            continue
        shard = padded // dp_group_size(s, axis) * O.param_gather_bytes(s)
        after += count * costs.net.shape_ns("ALL_GATHER", shard, costs.shape(axis, rank))
    return after


def _cooldowns(costs: Costs, stages: list[Stage], reps: list[int], steps: Tails,
               sends: Sequence[int], strategy_key: int) -> dict[int, tuple[int, int, int]]:
    """``_tail`` of every stage of a walked pipeline under interference, from its walk's
    cooldowns (``pipeline_walk.Tails``; memoized). Per stage: (buckets done after its last
    backward as it ran, optimizer and gathers after that, how much later than walked that
    backward ends)."""
    key = (id(steps), strategy_key, tuple(map(id, stages)),
           tuple([costs.shape("dp", r) if costs.s.dist_opt_instances == 1 else
                  _dense_lane(costs, r) for r in reps]),
           tuple(_edp_key(costs, r) for r in reps))
    got = costs.ctx.cooldowns.get(key)
    if got is None:
        got = costs.ctx.cooldowns[key] = _cooldown_walk(costs, stages, reps, steps, sends)
    return got


def _cooldown_walk(costs: Costs, stages: list[Stage], reps: list[int], steps: Tails,
                   sends: Sequence[int]) -> dict[int, tuple[int, int, int]]:
    """The cooldowns walked again, every stage's steps in an order that respects each wait,
    with the gradient buckets (``_cooldowns``). A step starts when its stage's previous one
    ends and the gradient it waits for has come (that step's end as it ran, plus the send; a
    step whose wait is not in a cooldown, when the walk started it if it waited then; the
    first no earlier than walked: nothing before it is delayed). A chunk's last backward
    issues its buckets (``_drain``, slowed while they fly); every other step runs slowed while
    its stage's streams are busy (κ per busy stream, scaled to its chunk's compute share).
    This is the MoE form, with a dense and an expert stream a stage; a dense model's is
    ``_dense_cooldown_walk``."""
    if not costs.moe:
        return _dense_cooldown_walk(costs, stages, reps, steps, sends)
    own = [x.costs or costs for x in stages]  # (a stage on another system: its own)
    kappas = [c.compute.gpu.comm_interference for c in own]
    tails, order = steps
    p = len(stages)
    axes = [grad_lanes(own[st], r) for st, r in enumerate(reps)]
    stream = [{"dp": _IDLE, "edp": _IDLE} for _ in range(p)]
    w = [tail[0][0] - tail[0][1] for tail in tails]  # each stage's previous step, as it ran
    walked = [_IDLE] * p  # and as walked
    ran = [[0] * len(tail) for tail in tails]
    gathers: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]
    for st, q in order:
        end, d, ch, issues, dep = tails[st][q]
        x = stages[st]
        start = w[st]
        if dep >= 0:
            ready = ran[st + 1 if st < p - 1 else 0][dep] + sends[st]
            if ready > start:
                start = ready
        elif end - d > walked[st] and end - d > start:
            start = end - d
        walked[st] = end
        kappa = kappas[st]
        lane = stream[st]
        if issues and (_one_stream(own[st]) or all(map(_reduces, axes[st]))):
            # both lanes beside the same backward, or on one stream: one timeline
            end = start + d + _drain_lanes(own[st], x.runs_bwd[ch], axes[st], start,
                                           start + d, lane, gathers[st], kappa,
                                           _one_stream(own[st]))
        elif issues:  # one lane (or none) reduces
            late = 0
            for one in axes[st]:
                if _reduces(one):
                    axis, size, shape, inter = one
                    lane[axis], late = _drain(own[st], x.runs_bwd[ch], axis, size, shape,
                                              start, start + d, start + d, lane[axis], kappa,
                                              gathers[st], inter)
            end = start + d + late
        elif max(lane.values()) > start:  # kernel by kernel while the lanes fly
            end = _slowed_pass(own[st], x, ch, reps[st], start, list(lane.values()), kappa)
        else:
            end = start + d
        w[st] = ran[st][q] = end
    return {st: (max(*stream[st].values(), w[st]) - w[st],
                 _after_memo(own[st], x, reps[st], gathers[st]), w[st] - tails[st][-1][0])
            for st, x in enumerate(stages)}


def _slowed_pass(costs: Costs, x: Stage, ch: int, rank: int, start: int,
                 busy: list[int], kappa: float) -> int:
    """When chunk ``ch``'s backward, started at ``start`` beside gradient lanes busy until
    each of ``busy``, ends: its (kernel, overlapped collective) runs in backward order
    (``fastpath_stages._compute_runs`` over its blocks) slowed kernel by kernel
    (``slowed_runs``), as replay slows them — a backward's compute is not spread evenly over
    it, and its first GEMMs are what runs while the previous chunk's buckets fly."""
    from analysis.fastpath_stages import _compute_runs, slowed_runs

    sig = costs.signature(rank)
    runs: list[tuple[int, int]] = []
    for block, _, count, _ in x.runs_bwd[ch]:
        runs += _compute_runs(costs, block, rank, sig)[1] * count
    return round(slowed_runs(start, tuple(runs), busy, kappa))


def _dense_cooldown_walk(costs: Costs, stages: list[Stage], reps: list[int], steps: Tails,
                         sends: Sequence[int]) -> dict[int, tuple[int, int, int]]:
    """``_cooldown_walk`` of a dense model: one data-parallel stream a stage, held as a number,
    and ``_advance`` spelled out (the hot loop of interleaved screening; the same answers)."""
    own = [x.costs or costs for x in stages]  # (a stage on another system: its own)
    kappas = [c.compute.gpu.comm_interference for c in own]
    tails, order = steps
    p = len(stages)
    size = dp_group_size(costs.s, "dp")
    lanes = [_dense_lane(own[st], r) for st, r in enumerate(reps)]
    busy = [_IDLE] * p  # each stage's stream: free from then
    w = [tail[0][0] - tail[0][1] for tail in tails]  # each stage's previous step, as it ran
    walked = [_IDLE] * p  # and as walked
    ran = [[0] * len(tail) for tail in tails]
    after = [*range(1, p), 0]  # whose gradient a stage's backward waits for
    gathers: list[list[tuple[str, int, int]]] = [[] for _ in range(p)]
    for st, q in order:
        end, d, ch, issues, dep = tails[st][q]
        start = w[st]
        if dep >= 0:
            ready = ran[after[st]][dep] + sends[st]
            if ready > start:
                start = ready
        elif end - d > walked[st] and end - d > start:
            start = end - d
        walked[st] = end
        free = busy[st]
        if issues and size > 1:
            x = stages[st]
            shard, shape, inter = lanes[st]
            busy[st], late = _drain(own[st], x.runs_bwd[ch], "dp", shard, shape, start,
                                    start + d, start + d, free, kappas[st], gathers[st], inter)
            end = start + d + late
        elif free > start and not issues:  # slowed until the stream frees (``_advance``)
            k = kappas[st] * stages[st].busy_b[ch]
            slow = (free - start) / (1 + k)
            end = round(start + d * (1 + k) if slow >= d else free + d - slow)
        else:
            end = start + d
        w[st] = ran[st][q] = end
    return {st: (max(busy[st], w[st]) - w[st], _after_memo(own[st], x, reps[st], gathers[st]),
                 w[st] - tails[st][-1][0])
            for st, x in enumerate(stages)}


def _after_memo(costs: Costs, x: Stage, rank: int, gathers: list[tuple[str, int, int]]
                ) -> int:
    """``_after``, memoized by all it depends on: the stage's parameters, the gathers, the
    strategy's sharding and the groups' shapes (not the stage itself: strategies that differ
    only in recompute, micro-batch or sequence parallelism share it)."""
    s = costs.s
    key = (x.params, tuple(gathers), 1 if s.zero_stage == 2 else s.zero_stage,  # (tails_ns)
           s.dp, s.cp, s.ep, s.tp, s.expert_tp, s.outer_dp_sharding_strategy,
           s.overlap_param_gather, s.adam_moments_dtype, s.fp8_param_gather,
           (s.optimizer_offload_fraction, x.layers) if s.optimizer_offload_fraction else 0,
           costs.shape("dp", rank) if s.dist_opt_instances == 1 else _dense_lane(costs, rank),
           _edp_key(costs, rank))
    got = costs.ctx.afters.get(key)
    if got is None:
        got = costs.ctx.afters[key] = _after(costs, x, rank, gathers)
    return got


# (issue time of the first, interval between issues, how many, parameters each, the compute
# share of the blocks between issues: ``BlockRun``'s)
BucketRun = tuple[int, int, int, int, float]
# A run of equal blocks in a backward: (block, backward ns of one, how many in a row, the
# share of that backward that is compute on the critical path) (``Stage.runs_bwd``)
BlockRun = tuple[ParamBlock, int, int, float]


def _dense_lane(costs: Costs, rank: int) -> tuple[int, Shape, Shape | None]:
    """The dense gradient buckets' group on ``rank``: (the size ZeRO ≥ 1 shards over, its
    shape, the shape of the group across optimizer instances or None with one instance)."""
    return _lane(costs, "dp", rank)


def _lane(costs: Costs, axis: str, rank: int) -> tuple[int, Shape, Shape | None]:
    """``_dense_lane`` of the gradients reduced on ``axis`` ("dp" dense, "edp" experts)."""
    s = costs.s
    if s.dist_opt_instances == 1:
        return dp_group_size(s, axis), costs.shape(axis, rank), None
    group = shard_axis(s, axis)
    return (dp_group_size(s, group), costs.shape(group, rank),
            costs.shape(instance_axis(axis), rank))


def _edp_key(costs: Costs, rank: int) -> object:
    """The expert lane's groups, as memo keys hold them (None for a dense model)."""
    if not costs.moe:
        return None
    return costs.shape("edp", rank) if costs.s.dist_opt_instances == 1 else _lane(
        costs, "edp", rank)


def _buckets_done(costs: Costs, rank: int,
                  runs: tuple[tuple[BlockRun, ...], ...],
                  chunk_ends: tuple[int, ...], chunk_bwd: tuple[int, ...],
                  busy_b: tuple[float, ...] = ()
                  ) -> tuple[int, list[tuple[str, int, int]], int]:
    """When the data-parallel stream finishes the buckets of each chunk's last backward
    (serially, in the order the trace issues them), and the ZeRO ≥ 1 gathers that follow, as
    (axis, padded parameters, count). Buckets of equal layers come in runs issued at a fixed
    interval, and a run of n equal transfers D issued from t every Δ leaves a stream busy until
    max(max(s₀, t) + n·D, t + (n − 1)·Δ + D) (the busy time is linear in the run's index, so one
    of its ends decides). With interference (κ > 0) the backward runs slower while a bucket is in
    flight, which spaces the issues out (``_interfered_run``; κ scaled by ``busy_b``, the share
    of each chunk's backward that is compute on the critical path); the third value is how much
    later the last backward ends for it."""
    s = costs.s
    end = max(chunk_ends)
    if s.zero_stage == 3:
        return end, [], 0
    gathers: list[tuple[str, int, int]] = []
    kappa = costs.compute.gpu.comm_interference if s.overlap_grad_reduce and busy_b else 0.0
    if not costs.moe and len(chunk_ends) == 1:  # the common case: one chunk, one group
        size = dp_group_size(s, "dp")
        if size < 2:
            return end, gathers, 0
        shape, inter = costs.shape("dp", rank), None
        if s.dist_opt_instances > 1:
            size, shape, inter = _dense_lane(costs, rank)
        free, late = _drain(costs, runs[0], "dp", size, shape, end - chunk_bwd[0], end, end,
                            _IDLE, kappa, gathers, inter)
        return max(end + late, free), gathers, late
    stream = {"dp": _IDLE, "edp": _IDLE}
    lanes = grad_lanes(costs, rank)
    order = sorted(range(len(chunk_ends)), key=chunk_ends.__getitem__)
    extra = 0
    for chunk in order:
        extra += drain_chunk(costs, lanes, runs[chunk], chunk_ends[chunk] - chunk_bwd[chunk],
                             chunk_ends[chunk], end, stream, kappa,
                             busy_b[chunk] if kappa else 0.0, gathers)
    return max(end + extra, *stream.values()), gathers, extra


# A gradient lane: (the reduction axis, "dp" or "edp"; the size of the group it reduce-scatters
# over — its optimizer instance where there are several; that group's shape; the shape of the
# group across the instances, or None with one)
Lane = tuple[str, int, Shape, Shape | None]
Lanes = list[Lane]


def grad_lanes(costs: Costs, rank: int) -> Lanes:
    """The gradient buckets' lanes on ``rank``: dense, and expert on a MoE model."""
    return [(axis, *_lane(costs, axis, rank)) for axis in (("dp", "edp") if costs.moe
                                                           else ("dp",))]


def _reduces(lane: Lane) -> bool:
    """Whether a lane moves anything: a group of two or more, or instances to all-reduce."""
    return lane[1] > 1 or lane[3] is not None


def drain_chunk(costs: Costs, lanes: Lanes, blocks: tuple[BlockRun, ...], start: int,
                chunk_end: int, end: int, stream: dict[str, int], kappa: float, busy: float,
                gathers: list[tuple[str, int, int]]) -> int:
    """One chunk backward's buckets (its compute from ``start`` to ``chunk_end``; the stage's
    last backward ends at ``end``) onto each lane's stream, busy until ``stream[lane]`` before
    them (updated): how much later the backward ends for their interference (``kappa``, 0 for
    none; ``busy``: the backward's compute share). Appends the ZeRO ≥ 1 gathers."""
    one = _one_stream(costs)
    if one or (kappa and busy and costs.moe and all(map(_reduces, lanes))):
        # both lanes slow the same backward, or share one stream: one timeline
        return _drain_lanes(costs, blocks, lanes, start, chunk_end, stream, gathers,
                            kappa if busy else 0.0, one)
    late = 0
    for axis, size, shape, inter in lanes:
        if size < 2 and inter is None:
            continue
        lane = axis if costs.s.overlap_grad_reduce else "dp"  # without overlap: one queue
        stream[lane], extra = _drain(costs, blocks, axis, size, shape, start, chunk_end, end,
                                     stream[lane], kappa, gathers, inter)
        late += extra
    return late


def _one_stream(costs: Costs) -> bool:
    """Whether a MoE model's dense and expert buckets share one stream as they are issued:
    with several optimizer instances Megatron-Core puts every bucket group's reduce-scatter
    and cross-instance all-reduce on one communication stream (``start_grad_sync``; the
    trace chains them so), where with one instance each lane has its own."""
    s = costs.s
    return costs.moe and s.dist_opt_instances > 1 and s.overlap_grad_reduce


def _drain_lanes(costs: Costs, blocks: tuple[BlockRun, ...], lanes: Lanes, start: int,
                 chunk_end: int, stream: dict[str, int],
                 gathers: list[tuple[str, int, int]], kappa: float, one: bool = False) -> int:
    """``_drain`` for a MoE chunk's dense and expert buckets together, with interference: its
    backward issues both lanes' buckets, and runs at 1/(1 + k·n) while n lanes are busy
    (``slowed``), so the lanes are stepped bucket by bucket on one timeline instead of each in
    closed form beside its own slowdown. ``one``: both lanes' buckets queue on one stream
    (``_one_stream``; "dp"), in the order they are issued. Updates ``stream`` (each lane's
    end); returns how much later the chunk's last backward ends. Appends the ZeRO ≥ 1
    gathers."""
    s = costs.s
    coll: O.CollType = "REDUCE_SCATTER" if s.zero_stage >= 1 else "ALL_REDUCE"
    grad_bytes, shape_ns = O.grad_reduce_bytes(s), costs.net.shape_ns
    issues: list[tuple[int, str, int]] = []  # (backward time from the start, lane, duration)
    for axis, size, shape, inter in lanes:
        if size < 2 and inter is None:
            continue
        for t, step, n, params, _ in _bucket_runs_of(costs, blocks, axis):
            padded = -(-params // size) * size
            d = _bucket_ns(shape_ns, coll, padded * grad_bytes, size, shape, inter)
            if s.zero_stage >= 1:
                gathers.append((shard_axis(s, axis), padded, n))
            issues += [(t + j * step, axis, d) for j in range(n)]
    w, c = float(start), start  # wall time, backward time
    for t, lane, d in sorted(issues):
        w = _advance_runs(w, c, start + t - c, stream["dp"], stream["edp"], kappa, blocks, start)
        c = start + t
        lane = "dp" if one else lane
        stream[lane] = max(stream[lane], round(w)) + d
    w = _advance_runs(w, c, chunk_end - c, stream["dp"], stream["edp"], kappa, blocks, start)
    return round(w) - chunk_end


def _slowed2(w: float, dt: float, a: float, b: float, kappa: float) -> float:
    """``slowed`` with two streams, busy until ``a`` and ``b``, spelled out (the two-lane
    drain calls it once per bucket)."""
    lo, hi = (a, b) if a < b else (b, a)
    if lo > w:
        rate = 1 + 2 * kappa
        if (lo - w) / rate >= dt:
            return w + dt * rate
        dt -= (lo - w) / rate
        w = lo
    if hi > w:
        rate = 1 + kappa
        if (hi - w) / rate >= dt:
            return w + dt * rate
        dt -= (hi - w) / rate
        w = hi
    return w + dt


def _bucket_runs_of(costs: Costs, blocks: tuple[BlockRun, ...], axis: str
                    ) -> list[BucketRun]:
    """A stage chunk's bucket runs on ``axis``, issue times from its start (``_bucket_runs``),
    found once per stage chunk (keyed by identity; the stage memo keeps ``blocks`` alive)."""
    key = (id(blocks), axis, costs.s.dp_bucket_params)
    memo = costs.ctx.buckets
    got = memo.get(key)
    if got is None or got[0] is not blocks:
        got = memo[key] = (blocks, _bucket_runs(blocks, axis, costs.s.dp_bucket_params, 0))
    return got[1]


# times are relative to the stage's last backward: an idle stream has no zero to start from
_IDLE = -(1 << 62)


def _drain(costs: Costs, blocks: tuple[BlockRun, ...], axis: str,
           size: int, shape: Shape, start: int, chunk_end: int, end: int,
           busy: int, kappa: float, gathers: list[tuple[str, int, int]],
           inter: Shape | None = None) -> tuple[int, int]:
    """(when the stream is free, how much later the chunk's last backward ends) after one
    chunk's buckets on one group's stream, busy until ``busy`` before them; the chunk's
    backward runs from ``start`` to ``chunk_end``, the stage's last ends at ``end``; ``kappa``:
    κ, the interference of the buckets with overlapped compute (0: none, or no overlap).
    Appends the ZeRO ≥ 1 gathers. ``inter``: with several optimizer instances, the shape of
    the group across them — each bucket's reduce-scatter over the instance (``size``,
    ``shape``) is then followed on the stream by its shard's all-reduce across instances
    (``dp_comm.bucket_comms``). Each run of blocks is slowed at κ times its own compute share
    (``BlockRun``), not the chunk's: a wide head, all compute, issues the first bucket, and the
    layers it then slows have their TP collectives between kernels (at the chunk's share the
    fast path was up to 1.1% slower than replay, the agreement benchmark's seed 452)."""
    s = costs.s
    runs = _bucket_runs_of(costs, blocks, axis)  # issue times from the chunk's start
    coll: O.CollType = "REDUCE_SCATTER" if s.zero_stage >= 1 else "ALL_REDUCE"
    grad_bytes, gather, overlap = O.grad_reduce_bytes(s), s.zero_stage >= 1, s.overlap_grad_reduce
    shape_ns = costs.net.shape_ns
    gaxis = axis if inter is None else shard_axis(s, axis)
    w = c = float(start)  # with interference: wall time, backward time, stream free
    free = float(busy)
    for t, step, n, params, share in runs:
        padded = -(-params // size) * size
        d = _bucket_ns(shape_ns, coll, padded * grad_bytes, size, shape, inter)
        if gather:
            gathers.append((gaxis, padded, n))
        if kappa:
            t += start
            w = (w + t - c if free <= w else
                 _advance_runs(w, c, t - c, free, _IDLE, kappa, blocks, start))
            c = t + (n - 1) * step
            w, free = _interfered_run(w, max(w, free) + d - w, step, n, d, kappa * share)
            continue
        if overlap:
            t += start
        else:  # after the backward, in sequence
            t, step = end, 0
        a = (busy if busy > t else t) + n * d
        b = t + (n - 1) * step + d
        busy = a if a > b else b
    if kappa:
        w = (w + chunk_end - c if free <= w else
             _advance_runs(w, c, chunk_end - c, free, _IDLE, kappa, blocks, start))
        return round(free), round(w - chunk_end)
    return busy, 0


def _bucket_ns(shape_ns: Callable[[O.CollType, int, Shape], int], coll: O.CollType,
               nbytes: int, size: int, shape: Shape, inter: Shape | None) -> int:
    """One bucket of ``nbytes`` (padded) on its stream: its collective over the group and, with
    several optimizer instances (``inter``), its shard's all-reduce across them."""
    if inter is None:
        return shape_ns(coll, nbytes, shape)
    d = shape_ns(coll, nbytes, shape) if size > 1 else 0  # (an instance of one rank: none)
    return d + shape_ns("ALL_REDUCE", nbytes // size, inter)


def buckets_busy_ns(costs: Costs, lanes: Lanes, blocks: tuple[BlockRun, ...]) -> int:
    """How long one backward's buckets of a chunk hold the data-parallel streams: each lane's
    collectives end to end, the lanes side by side (one queue without overlap)."""
    s = costs.s
    coll: O.CollType = "REDUCE_SCATTER" if s.zero_stage >= 1 else "ALL_REDUCE"
    busy = []
    for axis, size, shape, inter in lanes:
        if size < 2 and inter is None:
            continue
        busy.append(sum(n * _bucket_ns(costs.net.shape_ns, coll,
                                       -(-params // size) * size * O.grad_reduce_bytes(s),
                                       size, shape, inter)
                        for _, _, n, params, _ in _bucket_runs_of(costs, blocks, axis)))
    return (max(busy, default=0) if s.overlap_grad_reduce and not _one_stream(costs)
            else sum(busy))


def _advance_runs(w: float, c: float, dt: float, a: float, b: float, kappa: float,
                  blocks: tuple[BlockRun, ...], start: float) -> float:
    """``_slowed2`` (``_advance`` where ``b`` is idle) over the backward's work from ``c`` (its
    clock, the chunk's backward starting at ``start``) for ``dt``, each run of blocks slowed
    at κ times its own compute share."""
    busy = a if a > b else b
    if busy <= w or dt <= 0:
        return w + dt
    end, t = c + dt, start
    for _, d, count, share in blocks:
        lo, t = (c if c > t else t), t + d * count
        hi = end if end < t else t
        if hi > lo:
            w, c = _slowed2(w, hi - lo, a, b, kappa * share), hi
            if w >= busy:
                break
        if t >= end:
            break
    return w + (end - c)


def _advance(w: float, dt: float, busy: float, kappa: float) -> float:
    """Wall time after ``dt`` of backward work from ``w``, slowed until the stream frees."""
    if busy > w:
        slow = (busy - w) / (1 + kappa)
        return w + dt * (1 + kappa) if slow >= dt else busy + dt - slow
    return w + dt


def slowed(w: float, dt: float, busy: Sequence[float], kappa: float) -> float:
    """Wall time after ``dt`` of compute from ``w`` while streams are busy until each of
    ``busy``: at 1/(1 + κ·n) of full speed with n of them busy (replay/sim.py)."""
    for end in sorted(busy):
        if end <= w:
            continue
        n = sum(1 for e in busy if e >= end)
        rate = 1 + kappa * n
        if (end - w) / rate >= dt:
            return w + dt * rate
        dt -= (end - w) / rate
        w = end
    return w + dt


def _interfered_run(w0: float, b0: float, step: int, n: int, d: int, kappa: float
                    ) -> tuple[float, float]:
    """(wall time of the last issue, stream free) for n buckets of d issued every ``step`` of
    backward work, the first at ``w0`` with the stream busy for ``b0`` from there. While the
    backlog b covers the next interval (b ≥ step·(1 + κ)) the backward runs slowed throughout
    and b shrinks by step·(1 + κ) − d per bucket (or never drains if that is ≤ 0); once it does
    not, each interval takes step + κ/(1 + κ)·b and the stream drains before the next issue."""
    if n == 1:
        return w0, w0 + b0
    full = step * (1 + kappa)
    if d >= full:  # the stream never drains
        return w0 + (n - 1) * full, w0 + b0 + (n - 1) * d
    k = 0 if b0 < full else min(n - 1, int((b0 - full) // (full - d)) + 1)
    w, b = w0 + k * full, b0 - k * (full - d)
    if k == n - 1:
        return w, w + b
    w += step + kappa / (1 + kappa) * (b + (n - 2 - k) * d) + (n - 2 - k) * step
    return w, w + d


def _bucket_runs(runs: tuple[BlockRun, ...], axis: str, bucket: int,
                 t: int) -> list[BucketRun]:
    """Megatron-style buckets over one chunk's backward blocks: parameters accumulate block by
    block and a bucket is issued when it holds ≥ ``bucket`` or at the chunk's last block."""
    out: list[BucketRun] = []
    acc = 0
    for i, (block, d, count, share) in enumerate(runs):
        q = block.dense if axis == "dp" else block.expert
        last_run = i == len(runs) - 1
        left = count
        while left and acc and q:  # finish the bucket left open by earlier blocks
            t, acc, left = t + d, acc + q, left - 1
            if acc >= bucket or (last_run and not left):
                out.append((t, 0, 1, acc, share))
                acc = 0
        if not q:
            t += left * d
            if last_run and acc:
                out.append((t, 0, 1, acc, share))
            continue
        k = max(1, -(-bucket // q))  # blocks per full bucket
        full, rest = divmod(left, k)
        if full:
            out.append((t + k * d, k * d, full, k * q, share))
        t += left * d
        if rest:
            if last_run:
                out.append((t, 0, 1, rest * q, share))
            else:
                acc = rest * q
    return out
