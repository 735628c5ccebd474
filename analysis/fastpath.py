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

This module puts a strategy's stages together into a step: its closed forms, or a walk of the
schedule where they do not hold, the tails and the peak memory. ``analysis/fastpath_costs.py``
holds one strategy's costs and the memos a sweep shares, ``analysis/fastpath_stages.py`` what a
stage costs per micro-batch, ``analysis/pipeline_walk.py`` the schedule closed forms and the
walk, ``analysis/dp_tails.py`` what follows each stage's last backward (gradient buckets,
optimizer, parameter gathers).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from analysis.dp_tails import tails_ns
from analysis.dualpipe_walk import dualpipe_merged_walk
from analysis.fastpath_costs import Costs, clear_cache
from analysis.fastpath_stages import Stage, slowed_runs
from analysis.grad_stream import per_microbatch_ns
from analysis.merged_walk import merged_walk
from analysis.pipeline_walk import (
    Opened,
    Tails,
    first_forwards,
    interleaved,
    pipeline_ns,
    plain_tails,
    span_ns,
)
from analysis.zb_walk import zero_bubble
from analysis.zbv_walk import zbv_first_forwards, zero_bubble_v
from replay.hardware import SystemSpec, on_sites_of, resolve_system
from tracegen import ops as O
from tracegen.catalog import resolve_model
from tracegen.dp_comm import bucket_plan, dp_group_size, shard_axis, sharded_params
from tracegen.fit import check_fits_model
from tracegen.memory import activation_bytes_per_layer, host_peak_bytes
from tracegen.memory import host_bytes as memory_host_bytes
from tracegen.memory import total_bytes as memory_total_bytes
from tracegen.model import ModelSpec
from tracegen.program import ParamBlock
from tracegen.strategy import Strategy
from tracegen.units import NS_PER_S, GiB

__all__ = ["FastEstimate", "clear_cache", "estimate", "estimate_stages", "resolve_specs"]


class FastEstimate(NamedTuple):
    """One strategy's estimate (a named tuple: a sweep builds one per strategy, and a tuple is
    the cheapest immutable record Python builds)."""

    step_time_s: float
    pipeline_s: float
    peak_memory_GiB: float
    fits: bool
    stage_fwd_s: tuple[float, ...]
    stage_bwd_s: tuple[float, ...]
    # the GPU's memory holds it but a host's does not hold what offloading puts there
    # (``fits`` is then False; the fit hints' searches read it: more offloading frees the
    # GPU and fills the host)
    host_short: bool = False


def resolve_specs(model: ModelSpec | str, system: SystemSpec | str
                  ) -> tuple[ModelSpec, SystemSpec]:
    """The model and system as specs: given, or resolved from preset names or files as the CLI
    takes them."""
    return (model if isinstance(model, ModelSpec) else resolve_model(model),
            system if isinstance(system, SystemSpec) else resolve_system(system))


def estimate(model: ModelSpec | str, strategy: Strategy, system: SystemSpec | str
             ) -> FastEstimate:
    """Step time and memory of one strategy without generating a trace. ``model`` and
    ``system``: specs, or preset names / files as the CLI takes them."""
    model, system = resolve_specs(model, system)
    check_fits_model(strategy, model)
    costs = Costs(model, strategy, system)
    stages, reps, alike = _stages(costs)
    est = _estimate(costs, stages, reps, alike, system.gpu.hbm_bytes)
    if strategy.cpu_offload_layers or strategy.optimizer_offload_fraction:
        return _host_checked(costs, stages, est)
    return est


def estimate_stages(model: ModelSpec | str, strategy: Strategy, system: SystemSpec | str,
                    stage_systems: Mapping[int, SystemSpec]) -> FastEstimate:
    """``estimate`` with the pipeline stages of ``stage_systems`` costed on those systems
    (their GPUs; the links of their own tensor-, context- and expert-parallel groups; their
    gradient reduction, optimizer step and gathers, ``Stage.costs``; each send at its slower
    end's cost; on ``system``'s sites where theirs has none, ``hardware.on_sites_of``) and
    the schedule walked with the stages so unequal (a slow stage's wait hidden where the
    schedule leaves slack). The memory figures stay ``system``'s."""
    model, system = resolve_specs(model, system)
    check_fits_model(strategy, model)
    costs = Costs(model, strategy, system)
    stages, reps, alike = _stages(costs)
    if not stage_systems:
        return _host_checked(costs, stages, _estimate(costs, stages, reps, alike,
                                                      system.gpu.hbm_bytes))
    spliced = list(stages)
    c = list(_sends(costs, reps, False))
    p = strategy.pp
    for st, other in stage_systems.items():
        theirs = Costs(model, strategy, on_sites_of(other, system))
        spliced[st] = _spliced(costs, theirs, _stages(theirs)[0][st])
        for hop in {(st - 1) % p, st} if p > 1 else ():  # its sends: the slower end's
            c[hop] = max(c[hop], _send_ns(theirs, reps[hop], reps[(hop + 1) % p],
                                          costs.p2p_bytes()))
    return _host_checked(costs, stages, _estimate(costs, spliced, reps, False,
                                                  system.gpu.hbm_bytes, walk=True, c=c),
                         stage_systems)


class ChunkTimes(NamedTuple):
    """What the walk of a schedule reads, in seconds: each global model chunk's forward and
    backward of one micro-batch (chunk c of stage s is global chunk ``Strategy.gci``: c·p + s
    interleaved, 2p − 1 − s for a V's second; one chunk a stage without either;
    ``Stage.fwd``, ``Stage.bwd``: a stage's embedding and head in the chunks that hold them),
    one send between stage s and s + 1 (wrapping), under a zero-bubble schedule each
    chunk's W pass (``Stage.w_view``; ``bwd`` is then the B pass; empty otherwise), each
    stage's optimizer step (after its gradients are reduced; ``dp_tails._after``), and each
    chunk's forward and backward share that is compute (``Stage.busy_f``, ``busy_b``; the
    rest is communication on the critical path)."""

    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    sends: tuple[float, ...]
    wgt: tuple[float, ...] = ()
    opt: tuple[float, ...] = ()
    busy_f: tuple[float, ...] = ()
    busy_b: tuple[float, ...] = ()


def chunk_times_s(model: ModelSpec | str, strategy: Strategy, system: SystemSpec | str
                  ) -> ChunkTimes:
    """The ``ChunkTimes`` of ``strategy`` (the fast path's own stage costs and sends)."""
    model, system = resolve_specs(model, system)
    check_fits_model(strategy, model)
    costs = Costs(model, strategy, system)
    stages, reps, alike = _stages(costs)
    order = sorted((strategy.gci(st, c), f, b, w, uf, ub) for st, stage in enumerate(stages)
                   for c, (f, b, w, uf, ub) in enumerate(zip(
                       stage.fwd, stage.bwd,
                       stage.w_view.bwd if stage.w_view else (0,) * len(stage.fwd),
                       stage.busy_f or (1.0,) * len(stage.fwd),
                       stage.busy_b or (1.0,) * len(stage.fwd), strict=True)))
    return ChunkTimes(tuple(x[1] / NS_PER_S for x in order),
                      tuple(x[2] / NS_PER_S for x in order),
                      tuple(c / NS_PER_S for c in _sends(costs, reps, alike)),
                      tuple(x[3] / NS_PER_S for x in order) if stages[0].w_view else (),
                      tuple(costs.optimizer_ns(sharded_params(strategy, dict(x.params)),
                                               x.layers) / NS_PER_S for x in stages),
                      tuple(x[4] for x in order), tuple(x[5] for x in order))


def _host_checked(costs: Costs, stages: list[Stage], est: FastEstimate,
                  stage_systems: Mapping[int, SystemSpec] | None = None) -> FastEstimate:
    """``est``, not fitting where offloading puts more in a host's memory than it has: each
    system's hosts hold its own stages' ranks (``stage_systems``'s stages on theirs, the rest
    on ``costs``'s system's; ``memory.host_peak_bytes``), checked against its
    ``host_memory_GiB`` where it gives one."""
    s, base = costs.s, costs.net.sys
    if not (est.fits and (s.cpu_offload_layers or s.optimizer_offload_fraction)):
        return est
    where = stage_systems or {}
    per_stage = _host_bytes(costs, stages)
    for system in {id(x): x for x in (base, *where.values())}.values():
        if not system.node.host_memory_GiB:
            continue
        mine = [b if where.get(st, base) is system else 0 for st, b in enumerate(per_stage)]
        if host_peak_bytes(mine, s, system.node.host_gpus) / GiB > system.node.host_memory_GiB:
            return est._replace(fits=False, host_short=True)
    return est


def _host_bytes(costs: Costs, stages: list[Stage]) -> list[int]:
    """What a rank of each stage keeps in host memory (``memory.host_bytes``)."""
    m, s = costs.m, costs.s
    act = _act_bytes(costs)
    flash = costs.compute.gpu.flash_attention
    return [memory_host_bytes(m, s, x.total_params, act, expert_params=x.params[1][1],
                              flash_attention=flash) for x in stages]


def _spliced(costs: Costs, theirs: Costs, x: Stage) -> Stage:
    """Stage ``x`` of ``theirs`` (another system's costs of the same strategy) to be drained
    on them in ``costs``'s pipeline; one object per stage, strategy and pair of systems, held
    by both contexts (their memos key a stage by its identity)."""
    key = (id(x), id(theirs.ctx), costs.s)
    got = costs.ctx.spliced.get(key)
    if got is None or got[0] is not x:
        own = x._replace(costs=theirs, w_view=None if x.w_view is None else  # (ZB's W view)
                         x.w_view._replace(costs=theirs))
        got = costs.ctx.spliced[key] = theirs.ctx.spliced[key] = (x, own)
    return got[1]


def _estimate(costs: Costs, stages: list[Stage], reps: list[int], alike: bool, hbm_bytes: int,
              walk: bool = False, c: list[int] | None = None) -> FastEstimate:
    """``estimate`` from the stages' costs (``walk``: walk the schedule whatever its kind;
    ``c``: the sends, if not the pipeline's own)."""
    s = costs.s
    if c is None:
        c = _sends(costs, reps, alike)
    if costs.zb:
        return _zero_bubble(costs, stages, reps, c, alike, hbm_bytes)
    if s.grad_reduce_per_microbatch:  # every backward's buckets: the streams walked along
        finish, pipe = per_microbatch_ns(costs, stages, reps, c)
        peak = _peak_memory_bytes(costs, stages, alike)
        return FastEstimate(finish / NS_PER_S, pipe / NS_PER_S, peak / GiB, peak <= hbm_bytes,
                            tuple(map(_FWD_S, stages)), tuple(map(_BWD_S, stages)))
    first_f = stages[0].first_f  # HFSDP: each chunk's first forward is longer
    # Interleaved schedules, and pipelines whose stages hold different layer counts, are walked
    # step by step: the closed forms charge every micro-batch at the slowest stage, which is
    # exact for alike stages but not when a few short stages let the others run ahead. So are
    # prefetched ZeRO-3 passes on a pipeline, whose gathers and scatter tails hide behind every
    # wait (one stage has no waits: the closed form, with GPipe's back-to-back overlap), ZeRO-3
    # on a MoE model without prefetch, whose dense and expert streams the walk carries from step
    # to step, and 1F1B pipelines whose sends pace the steady state (``_sends_bind``).
    check: Iterable[int]
    chunk_ends: Sequence[Sequence[int]]
    walked = (walk or s.schedule == "interleaved_1f1b" or costs.uneven
              or (s.zero_stage == 3 and ((s.zero3_prefetch and s.pp > 1)
                                         or (costs.moe and not s.zero3_prefetch)))
              or (first_f and s.pp > 1)
              or (s.schedule == "1f1b" and s.pp > 1 and _paced(costs, stages, c, alike)))
    gathers_open = s.overlap_param_gather and s.zero_stage in (1, 2)
    # with chunks, each chunk's first forward waits for its gathers inside the walk
    opened = _opened(costs, stages, reps, c) if gathers_open and s.vpp > 1 else None
    steps = None  # a walk's cooldowns, step by step (``pipeline_walk.Tails``)
    if walked:  # every stage its own end: the tails check each, even of alike stages
        pipe, ends, chunk_ends, steps = _walked_ends(costs, stages, c, opened)
        if stages[0].outer_b:  # HSDP: from the walk's compute ends to the drained passes
            chunk_ends = _drained(stages, chunk_ends)
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
    if first_f and not walked:  # one stage: its first forward's outer gathers delay it all
        held = first_f[0][1] - stages[0].fwd[0]
        pipe += held
        ends = [e + held for e in ends]
        chunk_ends = [[e + held for e in ce] for ce in chunk_ends]
    if gathers_open and opened is None:
        held = _param_gather_delay(costs, stages, reps, c, alike)
        pipe += held
        ends = [e + held for e in ends]
        chunk_ends = [[e + held for e in ce] for ce in chunk_ends]
    two = alike and not walked  # the first and last stage decide (``tails_ns``)
    finish = tails_ns(costs, stages, [0] * s.pp if two else reps, ends, chunk_ends, check, two,
                      steps, c)
    peak = _peak_memory_bytes(costs, stages, alike)
    return FastEstimate(finish / NS_PER_S, pipe / NS_PER_S, peak / GiB, peak <= hbm_bytes,
                        tuple(map(_FWD_S, stages)), tuple(map(_BWD_S, stages)))


def _zero_bubble(costs: Costs, stages: list[Stage], reps: list[int], c: list[int],
                 alike: bool, hbm_bytes: int) -> FastEstimate:
    """ZB-H1 and ZB-V: their passes walked (``zb_walk.zero_bubble``,
    ``zbv_walk.zero_bubble_v``; ``Stage.bwd`` is then the B pass); each stage's gradient
    buckets drain beside each chunk's last W pass (``Stage.w_view``), which no other stage
    waits for, so no stage's tail moves another's end."""
    s = costs.s
    views = [x.w_view for x in stages if x.w_view is not None]
    assert len(views) == s.pp  # (``stage_costs`` sets each under ZB-H1 and ZB-V)
    chunk_ends: Sequence[Sequence[int]]
    if s.vpp > 1:  # ZB-V, DualPipe-V, interleaved ZB: chunks a stage (``zero_bubble_v``)
        passes: Passes = ([x.fwd for x in stages], [x.bwd for x in stages],
                          [v.bwd for v in views])
        opened = (_opened_v(costs, stages, views, reps, c, passes)
                  if s.overlap_param_gather and s.zero_stage in (1, 2) else None)
        if s.overlap_moe_ep_comm:  # DualPipe-V's pairs merged (``dualpipe_merged_walk``)
            ends, chunk_ends = dualpipe_merged_walk(
                s.num_microbatches, *passes, [x.merged_pieces for x in stages],
                costs.compute.gpu.comm_interference, c, opened)
        else:
            ends, chunk_ends = zero_bubble_v(s.num_microbatches, *passes, c, opened,
                                             s.schedule)
    else:
        ends = zero_bubble(s.num_microbatches, [x.fwd[0] for x in stages],
                           [x.bwd[0] for x in stages], [v.bwd[0] for v in views], c)
        if s.overlap_param_gather and s.zero_stage in (1, 2):
            held = _param_gather_delay(costs, stages, reps, c, alike)
            ends = [e + held for e in ends]
        chunk_ends = [[e] for e in ends]
    finish = tails_ns(costs, views, reps, ends, chunk_ends, range(s.pp), waits=False)
    # (a chunked schedule's stages hold different counts of their chunks in flight: each is
    # looked at)
    peak = _peak_memory_bytes(costs, stages, alike and s.vpp == 1)
    return FastEstimate(finish / NS_PER_S, max(ends) / NS_PER_S, peak / GiB, peak <= hbm_bytes,
                        tuple(map(_FWD_S, stages)),
                        tuple(x.bwd_s + v.bwd_s for x, v in zip(stages, views, strict=True)))


# C-level field getters: per-stage lists built without a Python loop (fewer machine
# instructions than the comprehensions, measured with bench/bench_fastpath_work.py)
_FWD_S, _BWD_S = operator.attrgetter("fwd_s"), operator.attrgetter("bwd_s")


def _walked_ends(costs: Costs, stages: list[Stage], c: list[int],
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
    first = [x.first_f for x in stages] if stages[0].first_f else None  # HFSDP
    streams = ([x.z3_f for x in stages], [x.z3_b for x in stages]) if (
        stages[0].z3_b) else None
    leads = _leads(costs, stages) if streams else None
    key: tuple[object, ...] = (
        s.order_id, s.pp, s.num_microbatches, s.vpp, tuple(fwd), tuple(bwd), tuple(c),
        tuple(sorted(early.items())) if early else None,
        tuple(sorted(late.items())) if late else None,
        (tuple(streams[0]), tuple(streams[1])) if streams else None,
        opened, tuple(leads) if leads else None,
        tuple(sorted(hide.items())) if hide else None, tuple(first) if first else None)
    if s.overlap_moe_ep_comm:  # combined 1F1B on an interleaved pipeline (no ZeRO-3)
        key += (tuple(x.merged_pieces for x in stages),)
    walked = costs.ctx.walks.get(key)
    if walked is None:
        if s.overlap_moe_ep_comm:
            (ends, chunk_ends), cooldown = merged_walk(
                s, fwd, bwd, [x.merged_pieces for x in stages],
                costs.compute.gpu.comm_interference, c, opened)
            walked = costs.ctx.walks[key] = (ends, chunk_ends, cooldown)
        elif not (early or late or streams):
            (ends, chunk_ends), cooldown = plain_tails(s, fwd, bwd, c, opened)
            walked = costs.ctx.walks[key] = (ends, chunk_ends, cooldown)
        else:
            walked = costs.ctx.walks[key] = (*interleaved(s, fwd, bwd, c, early, late, streams,
                                                          opened, leads, hide, first), None)
    return max(walked[0]), *walked


def _drained(stages: list[Stage], chunk_ends: Sequence[Sequence[int]]) -> list[list[int]]:
    """Each chunk's last backward's end with its streams drained: a ZeRO-3 walk ends a chunk
    with its compute (its last reduce-scatter, ``Stage.late_b``, runs after the send), where
    HSDP's cross-instance lanes (``Stage.outer_b``) count from the drained pass — the last
    block's all-reduce follows its reduce-scatter. Reading them from the compute end put the
    lane's end that much early: interleaved pipelines with prefetch up to 3.3% fast."""
    return [[e + late for e, late in zip(ce, x.late_b, strict=True)]
            for x, ce in zip(stages, chunk_ends, strict=True)]


def _leads(costs: Costs, stages: list[Stage]) -> list[tuple[int, float] | None] | None:
    """For the two-stream walk under interference, per pass in its maps' order (forwards, then
    backwards; stage by stage, chunk by chunk): the pass's leading blocks that gather nothing
    (``Stage.z3_lead_f``/``_b``) as (ns, κ scaled to their compute share), or None; None
    where no pass has any (or κ is 0)."""
    kappa = costs.compute.gpu.comm_interference
    if not kappa:
        return None
    out = [(ns, kappa * busy / ns) if ns else None
           for per_pass in ([x.z3_lead_f for x in stages], [x.z3_lead_b for x in stages])
           for per_stage in per_pass for ns, busy in per_stage]
    return out if any(out) else None


def _paced(costs: Costs, stages: list[Stage], c: list[int], alike: bool) -> bool:
    """Whether a 1F1B pipeline lies outside the closed form's domain (``_off_closed_form``),
    once per stage list: the layout memo (``_stages``) keeps each list alive for the context's
    life, and its sends follow from the same key."""
    got = costs.ctx.paced.get(id(stages))
    if got is None:
        got = costs.ctx.paced[id(stages)] = _off_closed_form(stages, c, alike)
    return got


def _off_closed_form(stages: list[Stage], c: list[int], alike: bool) -> bool:
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


def _sends_bind(stages: list[Stage], c: list[int]) -> bool:
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


def _closed_form_ends(s: Strategy, stages: list[Stage], c: list[int]) -> tuple[int, list[int]]:
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
    pipe = pipeline_ns(s, f_s, b_s, c, hidden, b_rep) - _merged_saving(s, stages[0])
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


def _merged_saving(s: Strategy, stage: Stage) -> int:
    """Combined 1F1B (pp 1): what merging each backward but the last with the forward after it
    saves, (m − 1)(F + B − merged pass) (``merged_pass``); 0 without it."""
    if not s.overlap_moe_ep_comm or s.pp > 1:  # (a pipeline's is walked: ``merged_walk``)
        return 0
    return (s.num_microbatches - 1) * (stage.fwd[0] + stage.bwd[0] - stage.merged[0][1])


def _gpipe_drain(ends: list[int], b_s: list[int], m: int) -> None:
    """GPipe's backwards drain as a flow shop (stage p − 1 first): the last micro-batch leaves
    stage st after Σ_{i≥st} b_i + (m − 1)·max_{k≥st} b_k (and the sends), so a stage after the
    slowest backward ends (m − 1)·(max_k b_k − max_{k≥st} b_k) before the chain from stage 0's
    end says (which holds only where each stage's last backward waits for the one after it)."""
    top, later = max(b_s), 0
    for st in range(len(b_s) - 1, 0, -1):
        later = max(later, b_s[st])
        ends[st] -= (m - 1) * (top - later)


def _alike_ends(s: Strategy, stages: list[Stage], hop: int) -> tuple[int, list[int]]:
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
        ends[0] = (span_ns(s, f0, b0, f0, b0 - first.overlap_b[0] if gpipe3 else b0, f0 + b0, 0)
                   - _merged_saving(s, first))
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


def _stages(costs: Costs) -> tuple[list[Stage], list[int], bool]:
    """``_layout_stages``, shared by every strategy with the same costs key (model, op lists,
    recompute, ZeRO-3's fields), group layout, chunks and uneven end stages (a sweep's ZeRO 0 and
    1 twins, its batch sizes and schedules; the stage list is never mutated)."""
    s = costs.s
    # (the chunks' placement too: a V's stage holds other global chunks than an interleaved
    # one's with the same vpp — omitted until the sixty-eighth session, when ZB-V and
    # interleaved ZB, alike in every other key, shared a layout in one process)
    key = (costs.key, costs._degrees, s.vpp, s.v_shape, s.first_stage_layers,
           s.last_stage_layers, s.pipeline_layout, s.account_for_embedding_in_pipeline_split,
           s.account_for_loss_in_pipeline_split)
    got = costs.ctx.layouts.get(key)
    if got is None:
        got = costs.ctx.layouts[key] = _layout_stages(costs)
    return got


def _layout_stages(costs: Costs) -> tuple[list[Stage], list[int], bool]:
    """Each stage's costs, its representative rank (pp = st, dp = cp = tp = 0 in Megatron
    order), and whether the stages are alike: each on whole nodes of its own (shifting a stage
    by whole nodes changes none of its group shapes), so the middle stages of an evenly split
    pipeline cost the same — with interleaving too: only stage 0's first chunk (embedding) and
    stage p−1's last (head) differ, and the walk still walks every stage."""
    s = costs.s
    per_stage = s.world_size // s.pp
    reps = list(range(0, s.world_size, per_stage))
    # (with several sites, stages on different sites or straddling two differ: each its own)
    uniform = per_stage % costs.gpn == 0 and not costs.site_gpus
    sig0 = costs.signature(0)
    alike = uniform and not costs.uneven
    if alike:
        edge = [costs.stage(st, reps[st], sig0) for st in range(min(2, s.pp))]
        middle = [edge[-1]] * max(0, s.pp - 3)
        last = [costs.stage(s.pp - 1, reps[-1], sig0)] if s.pp > 2 else []
        return edge + middle + last, reps, True
    return [costs.stage(st, r, sig0 if uniform else costs.signature(r))
            for st, r in enumerate(reps)], reps, False


def _peak_memory_bytes(costs: Costs, stages: list[Stage], alike: bool) -> int:
    """The largest per-rank memory of any stage. When the stages are alike, in-flight
    micro-batches never grow with the stage index, so the peak is on the first stage
    (embedding, most in flight) or the last (head, logits) — under ZB-H1 too, where stage i
    holds p − i micro-batches and i deferred W passes at most, linear in i. Otherwise any stage
    can hold it: one whose chunks hold more layers, or heavier ones (a MoE layer after dense
    first layers carries more optimizer state), can outweigh an earlier stage's extra
    micro-batches — so every stage is looked at."""
    m, s = costs.m, costs.s
    flash = costs.compute.gpu.flash_attention
    act = _act_bytes(costs)
    candidates = {0, s.pp - 1} if alike else range(s.pp)
    # params: (("dp", dense), ("edp", expert)) — experts shard over their own group
    any_layout = costs.compute.gpu.fp8_any_layout
    return max(memory_total_bytes(m, s, st, stages[st].total_params, act_per_layer=act,
                                  flash_attention=flash, layers=stages[st].layers,
                                  expert_params=stages[st].params[1][1],
                                  hold_bytes=stages[st].w_hold_bytes,  # (read under ZB-H1)
                                  fp8_any_layout=any_layout)
               for st in candidates)


def _act_bytes(costs: Costs) -> int:
    """A layer's activations a micro-batch (``activation_bytes_per_layer``), memoized: it reads
    the model, tp, sp, cp, micro-batch and recompute with its modules (and the system's
    attention)."""
    s = costs.s
    act_key = (costs.lists_key, s.recompute, costs.recomputed)
    act = costs.ctx.activations.get(act_key)
    if act is None:
        act = costs.ctx.activations[act_key] = activation_bytes_per_layer(
            costs.m, s, flash_attention=costs.compute.gpu.flash_attention)
    return act


def _param_gather_delay(costs: Costs, stages: list[Stage], reps: list[int], c: list[int],
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
            held = _held_forward(x.costs or costs, st, reps[st], x.fwd[0], arrival + delay)
            delay += held
            skip = middle and held == 0  # (only a middle stage speaks for the next ones)
        arrival += x.fwd[0] + c[st]
    return delay


def _opened(costs: Costs, stages: list[Stage], reps: list[int], c: list[int]) -> Opened:
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
           s.pipeline_layout, s.account_for_embedding_in_pipeline_split,
           s.account_for_loss_in_pipeline_split,
           s.dp_bucket_params, s.fp8_param_gather, s.schedule_group, tuple(c))
    got = costs.ctx.opened.get(key)
    if got is not None:
        return got
    starts = first_forwards(s.pp, s.vpp, [x.fwd for x in stages], c, s.schedule_group)
    floors, busy = _held_floors(costs, stages, reps, starts)
    share = tuple(phi for per_pass in ([x.busy_f for x in stages], [x.busy_b for x in stages])
                  for per_stage in per_pass for phi in per_stage)
    got = costs.ctx.opened[key] = Opened(tuple(floors), tuple(busy),
                                         costs.compute.gpu.comm_interference, share)
    return got


def _held_floors(costs: Costs, stages: list[Stage], reps: list[int],
                 starts: list[list[int]]
                 ) -> tuple[list[tuple[tuple[int, int], int]], list[tuple[int, ...]]]:
    """Each chunk's first forward that a gather holds, as ((stage, chunk), the time its
    forward ends held), with each stage's gather timeline (``_opened``, ``_opened_v``)."""
    floors: list[tuple[tuple[int, int], int]] = []
    busy: list[tuple[int, ...]] = []
    for st, x in enumerate(stages):
        own = x.costs or costs  # (a stage on another system: its own links and kernels)
        busy.append(tuple(_gather_timeline(own, st, reps[st])[2]))
        for ch in range(costs.s.vpp):
            held = _held_forward(own, st, reps[st], x.fwd[ch], starts[st][ch], ch)
            if held:
                floors.append(((st, ch), starts[st][ch] + x.fwd[ch] + held))
    return floors, busy


Passes = tuple[list[tuple[int, ...]], list[tuple[int, ...]], list[tuple[int, ...]]]


def _opened_v(costs: Costs, stages: list[Stage], views: list[Stage], reps: list[int],
              c: list[int], passes: Passes) -> Opened:
    """``_opened`` for the chunked zero-bubble walks (ZB-V, DualPipe-V, interleaved ZB): each
    chunk's first forward held from its start in the walk without gathers
    (``zbv_first_forwards``), and each pass's compute share per cost index,
    (kind·v + chunk)·p + stage — of its F, its B, or its W (the W view's)."""
    s = costs.s
    starts = zbv_first_forwards(s.num_microbatches, *passes, c, s.schedule)
    floors, busy = _held_floors(costs, stages, reps, starts)
    share = tuple(per[ch] for per_stage in ([x.busy_f for x in stages],
                                            [x.busy_b for x in stages],
                                            [v.busy_b for v in views])
                  for ch in range(s.vpp) for per in per_stage)
    return Opened(tuple(floors), tuple(busy), costs.compute.gpu.comm_interference, share)


def _gather_timeline(costs: Costs, st: int, rank: int
                     ) -> tuple[list[list[ParamBlock]], list[list[int]], list[int]]:
    """Stage ``st``'s parameter gathers (``overlap_param_gather``), each data-parallel stream's
    serial from the step's start, chunk after chunk: per chunk its blocks and when each block's
    bucket is in (0 for the blocks that open none), and when each stream's gathers end.
    Memoized by all it reads: the op lists' key, layout, chunks, bucket size and rank."""
    s = costs.s
    key = (costs.lists_key, costs._degrees, s.vpp, s.v_shape, s.first_stage_layers,
           s.last_stage_layers, s.pipeline_layout, s.account_for_embedding_in_pipeline_split,
           s.account_for_loss_in_pipeline_split,
           s.dp_bucket_params, s.fp8_param_gather, s.recompute_num_layers,
           s.cpu_offload_layers, st, rank)  # (the last two: which blocks are which kind)
    got = costs.ctx.gathers.get(key)
    if got is not None:
        return got
    blocks = [costs.prog.blocks_of_chunk(s.gci(st, ch), labels=False) for ch in range(s.vpp)]
    need = [[0] * len(own) for own in blocks]
    busy = []
    per_param = O.param_gather_bytes(s)
    for axis in ("dp", "edp") if costs.moe else ("dp",):
        group = shard_axis(s, axis)
        size = dp_group_size(s, group)
        if dp_group_size(s, axis) < 2 or size < 2:
            continue
        shape, t = costs.shape(group, rank), 0
        for own, ready in zip(blocks, need, strict=True):
            for first, n in reversed(bucket_plan(own, axis, s.dp_bucket_params)):
                t += costs.net.shape_ns("ALL_GATHER", -(-n // size) * per_param, shape)
                ready[first] = max(ready[first], t)
        busy.append(t)
    got = costs.ctx.gathers[key] = (blocks, need, busy)
    return got


def _held_forward(costs: Costs, st: int, rank: int, fwd: int, arrival: int, chunk: int = 0
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
    if costs.s.cpu_offload_layers:  # (pp 1: the copies pace the forward as the gathers do)
        return costs.offload_held(blocks, need, busy, rank)
    sig, t, plain = costs.signature(rank), arrival, 0
    for block, ready in zip(blocks, need, strict=True):
        if t >= free:  # every gather done: the rest at full speed
            return t - plain - arrival
        t, d = max(t, ready), costs.block(block, rank, sig)[0]
        if kappa:
            segs = costs.list_runs(block, "fwd", rank, sig)
            t = round(slowed_runs(t, segs, busy, kappa))
        else:
            t += d
        plain += d
    return t - arrival - fwd


def _sends(costs: Costs, reps: list[int], alike: bool) -> list[int]:
    """c[s]: one send between stage s and stage s + 1 (wrapping, for interleaved chunks)."""
    p = len(reps)
    if p == 1:
        return [0]
    nbytes = costs.p2p_bytes()
    if alike:  # every hop leaves the node and costs the same
        return [_send_ns(costs, reps[0], reps[1], nbytes)] * p
    return [_send_ns(costs, reps[st], reps[(st + 1) % p], nbytes) for st in range(p)]


def _send_ns(costs: Costs, src: int, dst: int, nbytes: int) -> int:
    """One pipeline send (replay's ``p2p``; between sites a stage's GPUs send at once),
    memoized by whether it stays in the node or the site."""
    site = costs.site_gpus
    inside = not site or src // site == dst // site
    stage = 0 if inside else costs.s.world_size // costs.s.pp
    key = (src // costs.gpn == dst // costs.gpn, inside, stage, nbytes)
    got = costs.ctx.sends.get(key)
    if got is None:
        got = costs.ctx.sends[key] = costs.net.p2p(src, dst, nbytes, stage).total_ns
    return got
