"""The pipeline part of the fast path (``analysis/fastpath.py``): the GPipe and 1F1B closed forms
(Narayanan et al. 2021 §2.2; Huang et al. 2019), and Megatron's interleaved order walked step by
step, from each stage's per-micro-batch forward and backward times and one send per hop. Pure
functions of integers (nanoseconds): no model, no memo of a sweep's costs."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

from analysis.dp_tails import slowed
from tracegen.schedule import Step, stage_order
from tracegen.strategy import Strategy


def pipeline_ns(s: Strategy, f_s: list[int], b_s: list[int], c: list[int], hidden: int = 0,
                b_rep: list[int] | None = None) -> int:
    """GPipe and 1F1B, from each stage's forward and backward of one micro-batch. ``hidden``:
    ZeRO-3 gathers that run while a stage waits for its input during the fill and the drain
    (the first gather of a pass does not depend on the received tensor). ``b_rep``: GPipe,
    what each further backward of a stage adds when they run back to back (default ``b_s``)."""
    comm = 2 * sum(c[: s.pp - 1]) - hidden
    if s.schedule == "gpipe":
        return span_ns(s, sum(f_s), sum(b_s), max(f_s), max(b_rep or b_s), 0, comm)
    return span_ns(s, sum(f_s), sum(b_s), 0, 0, max(map(int.__add__, f_s, b_s)), comm)


def span_ns(s: Strategy, f_sum: int, b_sum: int, f_max: int, b_max: int, fb_max: int,
            comm: int) -> int:
    """``pipeline_ns`` from the sums and maxima over stages (GPipe reads ``f_max`` and
    ``b_max``, 1F1B ``fb_max``) and the sends on the fill and drain path, ``comm``: the first
    micro-batch crosses every stage forward and back, each further one adds the slowest stage."""
    m = s.num_microbatches
    if s.schedule == "gpipe":
        return f_sum + (m - 1) * f_max + b_sum + (m - 1) * b_max + comm
    return f_sum + b_sum + (m - 1) * fb_max + comm


@functools.lru_cache(maxsize=256)
def _plan(schedule: str, m: int, p: int, v: int) -> tuple[tuple[int, bool, int, int, int], ...]:
    """Every step of the interleaved schedule as (stage, backward?, index, index of the step it
    waits for or -1, chunk), in an order that respects each stage's own order and every
    cross-stage wait. Event times do not depend on which such order is walked, so one is found
    once per (m, p, v) and shared across a sweep. Index = micro-batch · p·v + global chunk."""
    n = p * v
    orders = [stage_order(schedule, m=m, p=p, v=v, stage=st) for st in range(p)]
    done_f, done_b = [False] * (m * n), [False] * (m * n)
    pos = [0] * p
    plan: list[tuple[int, bool, int, int, int]] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for st in range(p):
            order = orders[st]
            while pos[st] < len(order):
                phase, mb, ch = order[pos[st]]
                gci = ch * p + st
                k = mb * n + gci
                if phase == "B":
                    dep = k + 1 if gci < n - 1 else -1
                    if dep >= 0 and not done_b[dep]:
                        break
                    done_b[k] = True
                else:
                    dep = k - 1 if gci > 0 else -1
                    if dep >= 0 and not done_f[dep]:
                        break
                    done_f[k] = True
                plan.append((st, phase == "B", k, dep, ch))
                pos[st] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - the schedules are deadlock-free
            raise RuntimeError("interleaved schedule did not progress")
    return tuple(plan)


def interleaved(s: Strategy, fwd: list[tuple[int, ...]], bwd: list[tuple[int, ...]], c: list[int],
                early: dict[tuple[str, int, int], int] | None = None,
                late: dict[tuple[int, int], int] | None = None,
                streams: tuple[Z3Stages, Z3Stages] | None = None,
                opened: Opened | None = None,
                leads: list[tuple[int, float] | None] | None = None,
                hide: dict[tuple[int, int], tuple[int, int]] | None = None,
                first: list[tuple[tuple[int, int], ...]] | None = None
                ) -> tuple[list[int], list[list[int]]]:
    """(end of each stage's last backward, when each chunk's last backward ends) under Megatron's
    interleaved order. The schedule is a max-plus linear system: once periodic, each further
    round of p micro-batches shifts every event by the same amount λ. Long runs are walked for
    p and 2p micro-batches (each plus m mod p: a 1F1B or GPipe run need not be whole rounds); if
    every event moved by the busiest stage's work per round (the usual λ; for GPipe passes with
    two streams, ``_gpipe_round``) they are extrapolated from 2p. Otherwise further rounds are
    walked until their increments repeat with a period of up to ``CYCLE_ROUNDS`` rounds, and
    cycled on (``periodic``); failing that (and for m < 4p) the whole run is walked. Until the
    seventeenth session two equal increments after 2p were taken for a period of one round; a
    1F1B pipeline of stages not alike whose sends pace it repeats every three, and came out
    0.8–1.2% too slow. The shortcut is not a proof: it matched the
    full walk exactly on every case tried — 3,492 sweep strategies and a hypothesis test with
    the 2p/3p start; with the p/2p start (twelfth session: 40% less walking) 480 strategies of
    three real models (ZeRO 1 and 3, uneven first and last stages); 6,700 MoE ZeRO-3 walks but
    4, of pp 3 with a one-layer first stage (within 0.15%). On schedules with random
    per-stage, per-chunk costs, which no pipeline has, either start can be off (15 and 13 of
    3,000, by up to 2.8%; with cycles looked for, 6 of 3,000, up to −2.5%, each where the first
    round moved every event by the busiest stage's work and a longer transient followed;
    plain 1F1B walks are now checked against their exact rate, ``one_f_one_b_rate``, and
    plain interleaved ones against a certificate of theirs, ``_certified``: 0 of 12,000, where
    24 of 3,000 had been off by up to −3.8%; interleaved ones with ZeRO-3 terms against
    ``_certified_gathers``: 0 of 7,500, where 6 of 1,500 with prefetch had been off by up to
    −1.6%, and 4 of 1,212 real ZeRO-3 strategies by up to −0.64%; the two-stream MoE walks
    against ``_certified_streams``, but where a pass is led by blocks that gather nothing;
    1F1B walks with ZeRO-3 terms or two streams alike: 3 of 678 real ZeRO-3 1F1B strategies
    had been off by up to −0.63%, 0 since; GPipe's order has no steady round and keeps the
    first check).
    With ``streams`` (ZeRO-3 on a MoE model: each stage chunk's forward and backward as runs of
    blocks) the steps are walked with each stage's dense and expert streams (``_walk_streams``)
    instead of ``early`` and ``late``. Those and the plain walk (neither) branch: every walk
    after the first branches from the longest before (``_Walker``), only the steps the two do
    not share walked, which changes no answer. ``opened`` (plain walks): the parameter gathers
    that open the step (``Opened``). ``first`` (HFSDP, with ZeRO-3's terms), per stage and
    chunk: the first forward's gather and duration, in place of ``early``'s and ``fwd``'s
    (``_walk``)."""
    p, m, v = s.pp, s.num_microbatches, s.vpp
    if not streams and not early and not late:
        return _plain_periodic(s, _Plain(s.order_id, p, v, fwd, bwd, c, opened))

    busiest = (_gpipe_round(p, *streams) if streams and s.schedule == "gpipe" else
               max(p * (sum(f) + sum(b)) for f, b in zip(fwd, bwd, strict=True)))
    if streams:
        walker = _Streams(s.order_id, p, v, *streams, c, leads)

        def certify_streams(lam: int) -> bool:
            assert walker.longest is not None
            return _certified_streams(s.order_id, p, v, walker, lam, *walker.longest)

        return periodic(walker.branched(), p, m, v, busiest, group=s.schedule_group,
                         certify=certify_streams if s.schedule != "gpipe" else None)

    longest: list[int] = [0]  # the longest walk's micro-batches so far
    held: list[list[int]] = []  # and its ``record`` (``_walk``), for the certificate

    def walk(mb: int) -> Walked:
        record: list[list[int]] = []
        out = _walk(s.order_id, p, mb, v, fwd, bwd, c, early, late, hide, record, first)
        if mb > longest[0]:
            longest[0], held[:] = mb, record
        return out

    def certify(lam: int) -> bool:
        return _certified_gathers(s.order_id, lam, longest[0], held, fwd, bwd, c, early, late,
                                  hide)

    return periodic(walk, p, m, v, busiest, group=s.schedule_group,
                     certify=certify if s.schedule != "gpipe" else None)


# A stage's steps from its first bucket-issuing backward (chunk v − 1's last) to its end, each
# as (end, duration, chunk, whether it is its chunk's last backward: the one that issues the
# chunk's gradient buckets, where the step it waits for stands in the tail of the stage that
# runs it — the next stage, or stage 0 for the last — or −1); every stage's tail on one clock
Tail = tuple[tuple[int, int, int, bool, int], ...]


# Every stage's ``Tail``, and every tail step as (stage, place in its tail) in an order that
# respects each stage's order and every wait
Tails = tuple[tuple[Tail, ...], tuple[tuple[int, int], ...]]


def plain_tails(s: Strategy, fwd: list[tuple[int, ...]], bwd: list[tuple[int, ...]],
                c: list[int], opened: Opened | None = None) -> tuple[Walked, Tails]:
    """``interleaved`` without ZeRO-3 terms, and each stage's ``Tail`` as the longest run it
    walked ran it (all m micro-batches when m < 4p; else a run of k·p + m mod p, whose cooldown
    is the extrapolated run's shifted, once the walk is periodic): the steps the gradient
    buckets drain beside (``dp_tails``)."""
    p, v = s.pp, s.vpp
    plain = _Plain(s.order_id, p, v, fwd, bwd, c, opened)
    walked = _plain_periodic(s, plain)
    assert plain.longest is not None
    run, slots = plain.longest
    slot, send, cost = slots[0], plain.send, plain.cost
    plan, order = _tail_plan(s.order_id, run, p, v)
    return walked, (tuple(tuple((slot[k] - send[i], cost[i], ch, last, dep)
                                for k, i, ch, last, dep in steps) for steps in plan), order)


def _plain_periodic(s: Strategy, plain: _Plain) -> Walked:
    """``periodic`` over a plain walk; for 1F1B with its exact steady rate, for the interleaved
    schedule with a certificate that the busiest stage's work is its rate (``_certified``)."""
    rate = one_f_one_b_rate(plain.cost[:s.pp], plain.cost[s.pp:], plain.c) if (
        s.schedule == "1f1b") else None
    certify = None
    if s.schedule == "interleaved_1f1b":
        def certify(lam: int) -> bool:
            assert plain.longest is not None
            return _certified(s.order_id, s.pp, s.vpp, plain, lam, *plain.longest)
    return periodic(plain.branched(), s.pp, s.num_microbatches, s.vpp, plain.busiest, rate,
                     s.schedule_group, certify)


# The round of a reference order (in rounds of p micro-batches) read for the steady schedule's
# edges, and its length. A stage's warm-up is (p − st − 1)·2 + (v − 1)·p < (v + 1)·p virtual
# micro-batches (under two rounds of p·v; 1F1B's p − st − 1), so every forward of round 2 is
# past it, and every backward of round 2 has the forward that precedes it in the steady order
# (that many virtual micro-batches later) when 6 rounds are ordered; a test holds it equal to
# round 6 of 12.
_STEADY_ROUND, _REFERENCE_ROUNDS = 2, 6


@functools.lru_cache(maxsize=64)
def steady_edges(schedule: str, p: int, v: int) -> tuple[tuple[int, int, int, int, bool], ...]:
    """An interleaved (or 1F1B: v 1) schedule's steady state as a periodic graph: per edge
    (class of the step waited for, class of the step, rounds of p micro-batches between them,
    the step's cost index, whether it is a data edge — the neighbouring chunk's same
    micro-batch, which pays that step's send — or the stage's previous step). A class is a
    step's slot modulo a round (``_slot``), the edges those into the steps of a round far from
    both ends of each stage's order (read from the orders: ``_plan``'s interleaving of the
    stages is not needed)."""
    n = p * v
    per = 2 * p * n  # slots a round
    edges = set()
    for st in range(p):
        prev = 0
        for phase, mb, ch in stage_order(schedule, m=_REFERENCE_ROUNDS * p, p=p, v=v, stage=st):
            bw, gci = phase == "B", ch * p + st
            k = mb * n + gci
            slot = _slot(k, bw)
            if (slot - 1) // per == _STEADY_ROUND:
                i = (bw * p + st) * v + ch
                edges.add(((prev - 1) % per, (slot - 1) % per,
                           _STEADY_ROUND - (prev - 1) // per, i, False))
                dep = (k + 1 if gci < n - 1 else -1) if bw else (k - 1 if gci > 0 else -1)
                if dep >= 0:  # as ``_plan``: the next chunk's gradient, the previous one's output
                    d = _slot(dep, bw)
                    edges.add(((d - 1) % per, (slot - 1) % per,
                               _STEADY_ROUND - (d - 1) // per, i, True))
            prev = slot
    return tuple(sorted(edges))


@functools.lru_cache(maxsize=256)
def potential_rounds(schedule: str, m: int, p: int, v: int) -> tuple[int, ...]:
    """Per class of the steady graph (``steady_edges``), the round of a walk of ``m``
    micro-batches whose step ``_certified`` reads for the potential: the latest whose step waits
    as the steady state's does, or −1 where none does. Any round is valid; a steady one is what
    lets a steady walk pass. A step's data edge (the neighbouring chunk's same micro-batch) is
    the steady one in every round, so a step waits as the steady state's does when its stage's
    previous step is of the steady class, as many rounds back."""
    per = 2 * p * p * v
    clock_edge = [(-1, 0)] * per  # per class: its stage's previous step's class, rounds back
    for q, e, delta, _, data in steady_edges(schedule, p, v):
        if not data:
            clock_edge[e] = (q, delta)
    rounds = [-1] * per
    prev = [0] * p
    for st, bw, k, _, _ in _plan(schedule, m, p, v):
        slot = _slot(k, bw)
        r, c = divmod(slot - 1, per)
        before = prev[st]
        q, delta = clock_edge[c]
        if before and (before - 1) % per == q and r - (before - 1) // per == delta \
                and r > rounds[c]:
            rounds[c] = r
        prev[st] = slot
    return tuple(rounds)


@functools.lru_cache(maxsize=256)
def _checked_edges(schedule: str, m: int, p: int, v: int
                   ) -> tuple[tuple[int, int, int, int, bool], ...]:
    """The steady graph's edges (``steady_edges``) a certificate on a walk of ``m``
    micro-batches checks. An edge into a step read at a steady round (``potential_rounds``)
    from the step it waits for, read at that many rounds before, holds by itself (the walk
    started the one after the other), so only the others are checked: a few per stage, where
    the rounds read change, instead of 2·p²·v."""
    rounds = potential_rounds(schedule, m, p, v)
    return tuple(x for x in steady_edges(schedule, p, v)
                 if rounds[x[1]] < 0 or rounds[x[0]] != rounds[x[1]] - x[2])


@functools.lru_cache(maxsize=256)
def _certificate_plan(schedule: str, m: int, p: int, v: int
                      ) -> tuple[tuple[int, int, int, int, int, int], ...]:
    """For ``_certified`` on a walk of ``m`` micro-batches, the edges to check
    (``_checked_edges``) with where their ends are read (``potential_rounds``): per edge, (the
    step's slot, the slot of the step it waits for, the rounds of λ between the two as read
    less the edge's own, the step's cost index, the cost index whose send a stage edge takes
    off the step waited for or −1 for a data edge, the cost index whose send the step's slot
    holds)."""
    per = 2 * p * p * v
    rounds = potential_rounds(schedule, m, p, v)
    index = _class_costs(p, v)
    out = []
    for q, e, delta, i, data in _checked_edges(schedule, m, p, v):
        rq, re_ = max(rounds[q], 0), max(rounds[e], 0)
        out.append((1 + e + re_ * per, 1 + q + rq * per, rq - re_ + delta, i,
                    -1 if data else index[q], index[e]))
    return tuple(out)


def _certified(schedule: str, p: int, v: int, plain: _Plain, lam: int, m: int, slots: Slots
               ) -> bool:
    """Whether no cycle of the interleaved schedule's steady state is slower than ``lam`` per
    round of p micro-batches (at the busiest stage's work, which its own cycle takes: then that
    is the steady rate). A potential u on the steady graph's classes (``steady_edges``) with
    u(e) + δ·λ ≥ u(q) + w on every edge q → e of weight w over δ rounds bounds every cycle's
    weight by λ per round (sum the inequalities round the cycle; Baccelli et al. 1992, ch. 3,
    the max-plus eigenvalue as the largest cycle mean). u is the walk's own step ends, each
    class's at its latest steady round less that many λ (``potential_rounds``). A proof where
    it holds; where a round trip through the stages is slower (random per-stage, per-chunk
    costs), it fails and walking goes on. The extrapolation then also rests on the round
    before it adding λ to every end, as before: the rate is proved, the end of the transient
    is observed."""
    cost, send, slot = plain.cost, plain.send, slots[0]
    # u(x) = slot(x) − send(x) − R·λ at x's round R: the edge's u(e) + δ·λ ≥ u(q) + w, where a
    # data edge reads q as sent (slot(q)) and a stage edge its end (slot(q) − send(q))
    for e, q, k, i, off, own in _certificate_plan(schedule, m, p, v):
        if slot[e] - slot[q] + k * lam < cost[i] + send[own] - (send[off] if off >= 0 else 0):
            return False
    return True


@functools.lru_cache(maxsize=64)
def _class_costs(p: int, v: int) -> tuple[int, ...]:
    """Per class (a slot modulo a round, ``steady_edges``), its steps' cost index."""
    n = p * v
    out = []
    for c in range(2 * p * n):
        k, bw = divmod(c, 2)
        st, ch = k % n % p, k % n // p
        out.append((bw * p + st) * v + ch)
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _tail_plan(schedule: str, m: int, p: int, v: int
               ) -> tuple[tuple[tuple[tuple[int, int, int, bool, int], ...], ...],
                          tuple[tuple[int, int], ...]]:
    """Per stage, the steps of ``Tail`` as (slot, cost index, chunk, last backward of its
    chunk, where the step it waits for stands in its stage's tail or −1) (``_slot``,
    ``_flat_plan``'s cost index); and every tail step as (stage, place in its tail) in
    ``_plan``'s order, which respects each stage's order and every wait. A backward of global
    chunk g waits for g + 1's: the next stage's same chunk, or for the last stage stage 0's
    next chunk."""
    n = p * v
    tails = []
    for st in range(p):
        order = stage_order(schedule, m=m, p=p, v=v, stage=st)
        tails.append(order[order.index(("B", m - 1, v - 1)):])
    where, deps = tail_deps(tails)
    out = [tuple((_slot(mb * n + ch * p + st, phase == "B"), ((phase == "B") * p + st) * v + ch,
                  ch, phase == "B" and mb == m - 1, dep)
                 for (phase, mb, ch), dep in zip(tail, deps[st], strict=True))
           for st, tail in enumerate(tails)]
    steps = ((st, where[st].get(("B" if bw else "F", k // n, k % n // p)))
             for st, bw, k, _, _ in _plan(schedule, m, p, v))
    return tuple(out), tuple((st, q) for st, q in steps if q is not None)


def tail_deps(tails: list[list[Step]]) -> tuple[list[dict[Step, int]], list[list[int]]]:
    """Each stage's tail steps' places in it, and per tail step where the step it waits for
    stands in the tail of the stage that runs it or −1: a backward of global chunk g waits
    for g + 1's — the next stage's same chunk, or for the last stage stage 0's next chunk."""
    p = len(tails)
    where = [{step: q for q, step in enumerate(tail)} for tail in tails]
    deps = []
    for st, tail in enumerate(tails):
        nxt, shift = (st + 1, 0) if st < p - 1 else (0, 1)
        deps.append([where[nxt].get((phase, mb, ch + shift), -1) if phase == "B" else -1
                     for phase, mb, ch in tail])
    return where, deps


def first_forwards(p: int, v: int, fwd: list[tuple[int, ...]], c: list[int], group: int = 0
                   ) -> list[list[int]]:
    """When each stage starts its first forward of each chunk under Megatron's interleaved order
    (no gathers), with micro-batch groups of N = ``group`` (p where 0): virtual micro-batch k
    of a stage is micro-batch k mod N of chunk k // N for k < N·v (the first group is whole:
    N ≤ m), and every stage's warm-up runs forwards only through k = (v − 1)·N (its warm-up is
    (p − st − 1)·2 + (v − 1)·N; the last stage's k = (v − 1)·N opens its steady phase with a
    forward), so walking those forwards alone — each after the stage's previous one and after
    its input, sent over c from the previous global chunk — gives the starts exactly."""
    n = group or p
    end: list[list[int]] = []  # [k][stage]: when the forward of virtual micro-batch k ends
    clock, out = [0] * p, [[0] * v for _ in range(p)]
    for k in range((v - 1) * n + 1):
        ch, mb = divmod(k, n)
        end.append([0] * p)
        for st in range(p):
            ready = (end[k][st - 1] + c[st - 1] if st else
                     end[k - n][p - 1] + c[p - 1] if ch else 0)
            start = max(clock[st], ready)
            clock[st] = end[k][st] = start + fwd[st][ch]
            if not mb:
                out[st][ch] = start
    return out


# The longest period, in rounds of p micro-batches, that ``periodic`` looks for. A max-plus
# system's increments settle into a cycle of some length (its cyclicity; Baccelli et al. 1992,
# ch. 3), not always one round: a 1F1B pipeline of stages not alike whose sends pace it went
# 32.5, 34.3, 34.3, 32.5, … ms a round, which two equal increments had taken for a period of one.
CYCLE_ROUNDS = 4


def one_f_one_b_rate(f: list[int], b: list[int], c: list[int]) -> tuple[int, int]:
    """(W, A): a plain 1F1B pipeline's steady time per micro-batch as the ratio W / A, the
    max-plus eigenvalue of its steady order (the largest weight-per-advance of a cycle; Baccelli
    et al. 1992, ch. 3). Stage s runs F(j) then B(j − w_s), w_s = p − s − 1, so its cycles are
    each stage's F + B (advance one micro-batch) and each round trip from stage s down to t and
    back, F_s … F_t, B_t … B_s, then the next F_s: Σ_{u=s..t}(f_u + b_u) + 2·Σ_{u=s..t−1} c_u over
    an advance of w_s − w_t + 1 = t − s + 1 micro-batches (every other simple cycle passes a
    node twice). Checked against long walks (tests/test_fastpath.py)."""
    best_w, best_a = max(map(int.__add__, f, b)), 1
    p = len(f)
    for s in range(p - 1):
        w = f[s] + b[s]
        for t in range(s + 1, p):
            w += f[t] + b[t] + 2 * c[t - 1]
            if w * best_a > best_w * (t - s + 1):
                best_w, best_a = w, t - s + 1
    return best_w, best_a


def periodic(walk: Callable[[int], Walked], p: int, m: int, v: int, busiest: float,
              rate: tuple[int, int] | None = None, group: int = 0,
              certify: Callable[[int], bool] | None = None) -> Walked:
    """``interleaved``'s shortcut over ``walk`` (the walk of so many micro-batches): walks of
    k·p + r micro-batches, r = m mod p, so that whole rounds of p lead from each to m (a 1F1B
    or GPipe run need not be whole rounds). Where the first round's increments are not the
    busiest stage's work, rounds are walked until the increments from 2p on repeat with a
    period of q ≤ ``CYCLE_ROUNDS`` rounds over q + ``CYCLE_ROUNDS`` rounds (enough, by Fine and
    Wilf's theorem, that no other period up to ``CYCLE_ROUNDS`` fits them), then cycled on.
    ``rate`` (plain 1F1B: ``one_f_one_b_rate``): the steady rate W / A per micro-batch, which
    every event reaches once periodic, so a round (or a period of q) that does not add p · W / A
    per micro-batch (q · p · W / A) to every event is a transient and walking goes on. Without
    it, a first round that moved every event by the busiest stage's work, or a few equal rounds
    at another rate, were taken for the steady state where a round trip's sends set a higher
    one: 5 of 1,500 random-cost 1F1B pipelines up to 2.5% too fast. A micro-batch ``group``
    other than p (interleaved) repeats in groups, not rounds of p, and a shorter run need not
    be a valid grouping: the whole run is walked. ``certify`` (interleaved and, with ZeRO-3
    terms, 1F1B walks: ``_certified``, ``_certified_gathers``, ``_certified_streams``):
    whether no cycle of the steady schedule is slower than a given rate per round, read from
    the longest walk; the first round checked is then the one from 2p + r to 3p + r (the walk
    of 3p + r holds a steady round of every step class, which the potentials need), taken
    where it adds the busiest stage's work to every event and the certificate holds, and a
    period of one round found later only if certified at its increment. Without it 24 of
    3,000 random-cost interleaved pipelines came out up to 3.8% too fast: a round trip through
    the stages slower than the busiest stage overtook it only after a few rounds at its
    rate."""
    r = m % p
    if m < 4 * p or group:
        return walk(m)
    w, a = rate or (busiest, 1)  # (busiest is an int wherever ``rate`` is not given)
    seen: list[list[int]] = []  # each further round's increments
    last = walk(2 * p + r)
    if certify is not None:  # the round after 2p (the potentials need the walk of 3p)
        k, run = 3, walk(3 * p + r)
        seen.append(_increments(last, run))
        last = run
        if all(d == busiest for d in seen[-1]) and certify(int(busiest)):
            return _extrapolate(last, seen[-1:], k, p, m, v)
    else:
        k, step = 2, _increments(walk(p + r), last)
        if all(d * a == p * w if rate else d == busiest for d in step):
            return _extrapolate(last, [step], 2, p, m, v)
    while True:
        k += 1
        if k * p + r >= m or k > 2 + 3 * CYCLE_ROUNDS:
            return walk(m)
        run = walk(k * p + r)
        seen.append(_increments(last, run))
        last = run
        q = _period(seen)
        if q and (rate is None or all(sum(col) * a == q * p * w
                                      for col in zip(*seen[-q:], strict=True))) and (
                certify is None or (q == 1 and len(set(seen[-1])) == 1
                                    and certify(seen[-1][0]))):
            return _extrapolate(last, seen[-q:], k, p, m, v)


def _period(seen: list[list[int]]) -> int:
    """The least q ≤ ``CYCLE_ROUNDS`` with which the last q + ``CYCLE_ROUNDS`` increments repeat
    (0: none yet)."""
    for q in range(1, CYCLE_ROUNDS + 1):
        window = seen[-(q + CYCLE_ROUNDS):]
        if len(window) < q + CYCLE_ROUNDS:
            return 0
        if all(window[j] == window[j - q] for j in range(q, len(window))):
            return q
    return 0


def _gpipe_round(p: int, z3_f: Z3Stages, z3_b: Z3Stages) -> float:
    """GPipe with two-stream passes: what p more micro-batches add once periodic — the slowest
    stage's forward and the slowest stage's backward, each pass back to back with the one
    before, p times: its map's max-plus eigenvalue (``_cycle_mean``), as the closed form's
    (m − 1)·(max F + max B)."""
    return p * (max(_cycle_mean(z3_map(x[0])) for x in z3_f)
                + max(_cycle_mean(z3_map(x[0])) for x in z3_b))


def _cycle_mean(pass_map: Z3Map) -> float:
    """The max-plus eigenvalue of a pass's map on the stage's state (chain, dense, expert
    stream; the input's arrival left out): the largest mean weight of a cycle, of length one,
    two or three (the eigenvalue of a max-plus matrix: Baccelli, Cohen, Olsder and Quadrat
    1992, *Synchronization and Linearity*, ch. 3)."""
    a = [row[:3] for row in pass_map]
    best: float = max(a[i][i] for i in range(3))
    for i, j in ((0, 1), (0, 2), (1, 2)):
        best = max(best, (a[i][j] + a[j][i]) / 2)
    return max(best, (a[0][1] + a[1][2] + a[2][0]) / 3, (a[0][2] + a[2][1] + a[1][0]) / 3)


def _extrapolate(last_run: tuple[list[int], list[list[int]]], steps: list[list[int]],
                 base: int, p: int, m: int, v: int) -> tuple[list[int], list[list[int]]]:
    """The walk of ``m`` micro-batches from that of ``base``·p + (m mod p), every event moved
    per further round of p by the increments of ``steps`` in turn (one, or a cycle of them)."""
    rounds, q = (m - base * p) // p, len(steps)
    if q == 1:  # (the usual case, and the hot one of interleaved screening)
        step = [rounds * d for d in steps[0]]
    else:
        whole, part = divmod(rounds, q)
        step = [whole * sum(col) + sum(col[:part]) for col in zip(*steps, strict=True)]
    ends, last = last_run
    return ([e + d for e, d in zip(ends, step[:p], strict=True)],
            [[t + step[p + st * v + ch] for ch, t in enumerate(chunks)]
             for st, chunks in enumerate(last)])


class Opened(NamedTuple):
    """``overlap_param_gather`` on an interleaved pipeline: the parameter all-gathers that open
    the step (``fastpath._opened``), as the walk sees them."""

    floors: tuple[tuple[tuple[int, int], int], ...]  # ((stage, chunk), earliest first-fwd end)
    busy: tuple[tuple[int, ...], ...]  # per stage, when each of its gather streams is done
    kappa: float  # a kernel's slowdown per busy stream (``GPUSpec.comm_interference``)
    share: tuple[float, ...]  # per cost index: the share of the pass that is compute


# One stage's run of consecutive steps in a walk order: (stage, ((slot, slot waited for, cost
# index), ...)); see ``_flat_plan``.
Run = tuple[int, tuple[tuple[int, int, int], ...]]


def _slot(k: int, backward: bool) -> int:
    """Where a walk keeps step ``k`` (``_plan``'s index) of a pass: forward and backward steps
    side by side, after slot 0 (the time of the slot a step that waits for nothing reads), so a
    step's slot does not depend on the number of micro-batches walked."""
    return 1 + 2 * k + backward


@functools.lru_cache(maxsize=256)
def _flat_plan(schedule: str, m: int, p: int, v: int) -> tuple[Run, ...]:
    """``_plan`` for ``_Walker``, as runs of consecutive steps of one stage (3–4 on average:
    a stage's clock is read and written once per run, not per step). Per step: its slot
    (``_slot``), the slot it waits for (0 for none) and its cost index, (backward · p + stage)
    · v + chunk into the strategy's flattened costs."""
    return _runs(_plan(schedule, m, p, v), p, v, [0] * p)


def _runs(plan: tuple[tuple[int, bool, int, int, int], ...], p: int, v: int,
          skip: list[int]) -> tuple[Run, ...]:
    """``plan`` as ``_flat_plan``'s runs, without each stage's first ``skip[stage]`` steps."""
    runs: list[tuple[int, list[tuple[int, int, int]]]] = []
    seen = [0] * p
    for st, bw, k, dep, ch in plan:
        seen[st] += 1
        if seen[st] <= skip[st]:
            continue
        step = (_slot(k, bw), _slot(dep, bw) if dep >= 0 else 0, (bw * p + st) * v + ch)
        if runs and runs[-1][0] == st:
            runs[-1][1].append(step)
        else:
            runs.append((st, [step]))
    return tuple((st, tuple(steps)) for st, steps in runs)


@functools.lru_cache(maxsize=256)
def _branch_plan(schedule: str, m: int, base: int, p: int, v: int
                 ) -> tuple[tuple[Run, ...], tuple[tuple[int, int], ...]]:
    """The walk of ``m`` micro-batches as a branch of the walk of ``base``: (the steps to walk,
    and per stage the slot and cost index of its last step shared with that walk, (0, 0) for
    none). A step is shared when it stands at the same place in its stage's order in both walks
    and so do the step before it and the one it waits for: by induction it ends at the same
    time in both, so the branch reads it from the base walk's slots. Each stage's shared steps
    are a prefix of its order (the longest whose waits are all shared, found by shrinking the
    common prefixes to a fixed point); the rest — a longer run's further rounds, a shorter
    run's drain — is walked in ``_plan``'s order, which respects every wait."""
    orders = [stage_order(schedule, m=m, p=p, v=v, stage=st) for st in range(p)]
    others = [stage_order(schedule, m=base, p=p, v=v, stage=st) for st in range(p)]
    # (orders of different lengths: the common prefix ends with the shorter one at the latest)
    shared = [next((q for q, (x, y) in enumerate(zip(o, b, strict=False)) if x != y),
                   min(len(o), len(b))) for o, b in zip(orders, others, strict=True)]
    where = [{step: q for q, step in enumerate(o)} for o in orders]
    n, changed = p * v, True
    while changed:
        changed = False
        for st in range(p):
            for q in range(shared[st]):
                phase, mb, ch = orders[st][q]
                dep = ch * p + st + (1 if phase == "B" else -1)
                if 0 <= dep < n and where[dep % p][phase, mb, dep // p] >= shared[dep % p]:
                    shared[st], changed = q, True
                    break
    starts = []
    for st, q in enumerate(shared):
        if not q:
            starts.append((0, 0))
            continue
        phase, mb, ch = orders[st][q - 1]
        bw = phase == "B"
        starts.append((_slot(mb * n + ch * p + st, bw), (bw * p + st) * v + ch))
    return _runs(_plan(schedule, m, p, v), p, v, shared), tuple(starts)


_NEVER = -(1 << 62)  # the time of the slot a step that waits for nothing reads

Walked = tuple[list[int], list[list[int]]]  # (each stage's end, each stage's chunk ends)


# A walk's slots: per array (one, or three with streams) a value per step (``_slot``)
Slots = list[list[int]]


class _Walker:
    """A walk over ``_flat_plan`` that stores per step its end plus the send its successor pays
    (a forward on stage st feeds stage st + 1 over c[st]; a backward feeds stage st − 1 over
    c[st − 1]), so the successor reads one slot; the chunk ends take the send off again. A walk
    of another length branches from an earlier one (``_branch_plan``): only the steps the two
    do not share are walked, each stage resuming from its last shared step's state, which
    ``arrays`` slots per step hold."""

    arrays = 1

    def __init__(self, schedule: str, p: int, v: int, c: list[int]) -> None:
        self.schedule, self.p, self.v, self.c = schedule, p, v, c
        self.send = [c[st] for st in range(p) for _ in range(v)] + [
            c[(st - 1) % p] for st in range(p) for _ in range(v)]

    def walk(self, m: int, base: tuple[int, Slots] | None = None
             ) -> tuple[Walked, tuple[int, Slots]]:
        """(the walk of ``m`` micro-batches, its slots), branched from ``base`` (an earlier
        walk's micro-batches and slots) where given."""
        p, n = self.p, self.p * self.v
        size = 1 + 2 * m * n
        if base is None:
            runs = _flat_plan(self.schedule, m, p, self.v)
            slots = [[0] * size for _ in range(self.arrays)]
            slots[0][0] = _NEVER
            starts: tuple[tuple[int, int], ...] = ((0, 0),) * p
        else:
            runs, starts = _branch_plan(self.schedule, m, base[0], p, self.v)
            slots = [a + [0] * (size - len(a)) if size > len(a) else a[:] for a in base[1]]
        ends = self._steps(runs, slots, starts)
        last = 2 + 2 * (m - 1) * n  # the last micro-batch's backward slots
        back = self.c[-1:] + self.c[:-1]  # c[st − 1]: what a backward on stage st added
        slot = slots[0]
        return (ends, [[slot[last + 2 * (ch * p + st)] - back[st] for ch in range(self.v)]
                       for st in range(p)]), (m, slots)

    def _steps(self, runs: tuple[Run, ...], slots: Slots, starts: tuple[tuple[int, int], ...]
               ) -> list[int]:
        """Walk ``runs`` from each stage's state after the step of ``starts`` (its slot and
        cost index; slot 0: the stage's start); each stage's end."""
        raise NotImplementedError

    def branched(self) -> Callable[[int], Walked]:
        """A walk function for ``periodic``: each walk branches from the longest one before
        (kept in ``longest``: its micro-batches and slots)."""
        self.longest: tuple[int, Slots] | None = None

        def walk(m: int) -> Walked:
            walked, at = self.walk(m, self.longest)
            if self.longest is None or m > self.longest[0]:
                self.longest = at
            return walked
        return walk


class _Plain(_Walker):
    """``_walk`` without ZeRO-3 gathers (the common case, and the hot loop of interleaved
    screening): the same recurrences with the gather and late reduce-scatter terms at zero."""

    def __init__(self, schedule: str, p: int, v: int, fwd: list[tuple[int, ...]],
                 bwd: list[tuple[int, ...]], c: list[int],
                 opened: Opened | None = None) -> None:
        super().__init__(schedule, p, v, c)
        self.cost = [d for per_stage in (fwd, bwd) for durs in per_stage for d in durs]
        self.busiest = max(p * (sum(f) + sum(b)) for f, b in zip(fwd, bwd, strict=True))
        self.opened = opened
        # slot of a stage's first forward of a chunk (micro-batch 0) → the earliest it ends
        self.floors = {_slot(ch * p + st, False): end for (st, ch), end in opened.floors
                       } if opened else None

    def _steps(self, runs: tuple[Run, ...], slots: Slots, starts: tuple[tuple[int, int], ...]
               ) -> list[int]:
        """Each stage's clock moves through its steps, each step waiting for the slot it reads
        and storing its end plus its send (no earlier than its floor, where it has one)."""
        slot, cost, send = slots[0], self.cost, self.send
        clock = [slot[k] - send[i] if k else 0 for k, i in starts]
        if self.opened:
            return self._opening(runs, slot, clock)
        for st, steps in runs:
            t = clock[st]
            for k, dep, i in steps:
                u = slot[dep]
                if u > t:
                    t = u
                t += cost[i]
                slot[k] = t + send[i]
            clock[st] = t
        return clock

    def _opening(self, runs: tuple[Run, ...], slot: list[int], clock: list[int]) -> list[int]:
        """``_steps`` while the parameter gathers that open the step are in flight
        (``Opened``): a step that starts before its stage's gathers are done has its compute
        share slowed (``dp_tails.slowed``) until they are, and a first forward of a chunk ends
        no earlier than its floor. A run that starts after both walks as ``_steps`` does."""
        assert self.opened and self.floors is not None
        cost, send, floors = self.cost, self.send, self.floors
        kappa, share, busy = self.opened.kappa, self.opened.share, self.opened.busy
        until = [max(b, default=0) if kappa else 0 for b in busy]
        floored = max(floors, default=0)  # (first forwards: the lowest slots of a walk)
        for st, steps in runs:
            t = clock[st]
            if t >= until[st] and steps[0][0] > floored:
                for k, dep, i in steps:
                    u = slot[dep]
                    if u > t:
                        t = u
                    t += cost[i]
                    slot[k] = t + send[i]
                clock[st] = t
                continue
            gathers = list(busy[st])
            for k, dep, i in steps:
                u = slot[dep]
                if u > t:
                    t = u
                d = cost[i]
                if t < until[st]:
                    compute = d * share[i]
                    t = round(slowed(t, compute, gathers, kappa) + d - compute)
                else:
                    t += d
                if k <= floored and (floor := floors.get(k)) is not None and floor > t:
                    t = floor
                slot[k] = t + send[i]
            clock[st] = t
        return clock


class _Streams(_Walker):
    """``_walk`` with each stage's two data-parallel streams carried from step to step (ZeRO-3
    on a MoE model, where one number after a step cannot say which stream is still busy): a
    step's first gathers go as soon as the chain and their stream allow, its first compute
    waits for its input too, and its reduce-scatters stay on their streams while the next step
    starts (``z3_map``). A stage ends when its last compute and its streams are done; a chunk's
    last backward ends at its last compute (its gradient is sent then). The streams' times
    after each step are kept beside its slot, for branches to resume from."""

    arrays = 3

    def __init__(self, schedule: str, p: int, v: int, z3_f: Z3Stages, z3_b: Z3Stages,
                 c: list[int], leads: list[tuple[int, float] | None] | None = None) -> None:
        super().__init__(schedule, p, v, c)
        self.maps = [z3_map(runs) for per_pass in (z3_f, z3_b) for per_stage in per_pass
                     for runs in per_stage]
        self.leads = leads

    def _steps(self, runs: tuple[Run, ...], slots: Slots, starts: tuple[tuple[int, int], ...]
               ) -> list[int]:
        slot, dense_at, expert_at = slots
        maps, send, leads = self.maps, self.send, self.leads
        chain = [slot[k] - send[i] if k else 0 for k, i in starts]
        dense = [dense_at[k] for k, _ in starts]  # (slot 0 of these holds 0: a stage's start)
        expert = [expert_at[k] for k, _ in starts]
        for st, steps in runs:
            t, fd, fe = chain[st], dense[st], expert[st]
            for k, dep, i in steps:
                a = slot[dep]
                if leads is not None and (lead := leads[i]) is not None:
                    t, a = _led(t, a, fd, fe, lead)
                (t0, t1, t2, t3), (d0, d1, d2, d3), (e0, e1, e2, e3) = maps[i]
                # the three maxima spelled out: a third of the time of calling max (the hot
                # loop of screening MoE ZeRO-3 strategies)
                x, y = t + t0, fd + t1
                if y > x:
                    x = y
                if (y := fe + t2) > x:
                    x = y
                if (y := a + t3) > x:
                    x = y
                z, y = t + d0, fd + d1
                if y > z:
                    z = y
                if (y := fe + d2) > z:
                    z = y
                if (y := a + d3) > z:
                    z = y
                w, y = t + e0, fd + e1
                if y > w:
                    w = y
                if (y := fe + e2) > w:
                    w = y
                if (y := a + e3) > w:
                    w = y
                t, fd, fe = x, z, w
                slot[k] = t + send[i]
                dense_at[k], expert_at[k] = fd, fe
            chain[st], dense[st], expert[st] = t, fd, fe
        return [max(x) for x in zip(chain, dense, expert, strict=True)]


def _certified_streams(schedule: str, p: int, v: int, walker: _Streams, lam: int, m: int,
                       slots: Slots) -> bool:
    """``_certified`` for the two-stream walk (``_Streams``): a step's three ends (chain, dense
    and expert stream) are each the maximum of its pass's map (``z3_map``) over the stage's
    previous three and the input as sent, so the steady graph's nodes are (class, end) and its
    edges the map's offsets; the same potential argument, and the same skipping of edges read
    from linked rounds. A pass led by blocks that gather nothing (``leads``) is slowed by the
    streams still busy, which is not a maximum of offsets: such walks are not certified."""
    if walker.leads is not None and any(x is not None for x in walker.leads):
        return False
    slot, dense_at, expert_at = slots
    maps, send = walker.maps, walker.send
    per = 2 * p * p * v
    rounds = potential_rounds(schedule, m, p, v)
    index = _class_costs(p, v)

    def ends(cls: int) -> tuple[int, int, int]:
        r = max(rounds[cls], 0)
        at = 1 + cls + r * per
        return (slot[at] - send[index[cls]] - r * lam, dense_at[at] - r * lam,
                expert_at[at] - r * lam)

    for q, e, delta, i, data in _checked_edges(schedule, m, p, v):
        before, after = ends(q), ends(e)
        # a data edge: the input as sent (its chain plus its send), the map's last column
        sources = (((before[0] + send[index[q]], 3),) if data else
                   ((before[0], 0), (before[1], 1), (before[2], 2)))
        for out, row in zip(after, maps[i], strict=True):
            if any(out + delta * lam < value + row[j] for value, j in sources):
                return False
    return True


def _led(t: int, a: int, dense: int, expert: int, lead: tuple[int, float]) -> tuple[int, int]:
    """(chain, input arrival) of a pass whose leading blocks gather nothing, each moved on by
    how much longer those blocks take beside the streams still busy from before (until
    ``dense`` and ``expert``; replay slows kernels at 1/(1 + κ·n) with n in flight): what
    follows them in the pass is max-plus in the chain after them, which starts at max(t, a),
    so shifting both by the delay is exact. (The walk had run them unslowed: a tied MoE
    model's GPipe backwards, back to back on 72-GPU nodes, −1.0…−1.1%.)"""
    start = t if t > a else a
    ns, kappa = lead
    if dense <= start and expert <= start:
        return t, a
    extra = round(slowed(start, ns, (dense, expert), kappa)) - start - ns
    return t + extra, a + extra


def _increments(a: tuple[list[int], list[list[int]]], b: tuple[list[int], list[list[int]]]
                ) -> list[int]:
    """Per event (stage ends, then chunk ends), how far run b is behind run a."""
    flat_a = [*a[0], *(t for chunk in a[1] for t in chunk)]
    flat_b = [*b[0], *(t for chunk in b[1] for t in chunk)]
    return [y - x for x, y in zip(flat_a, flat_b, strict=True)]


def _walk(schedule: str, p: int, m: int, v: int, fwd: list[tuple[int, ...]],
          bwd: list[tuple[int, ...]], c: list[int],
          early: dict[tuple[str, int, int], int] | None,
          late: dict[tuple[int, int], int] | None,
          hide: dict[tuple[int, int], tuple[int, int]] | None = None,
          record: list[list[int]] | None = None,
          first: list[tuple[tuple[int, int], ...]] | None = None
          ) -> tuple[list[int], list[list[int]]]:
    """Walk the interleaved order: each step waits for its stage's previous step and for the
    neighbouring chunk's same micro-batch (+ one send). O(p·m·v). ``hide`` (ZeRO-3 with
    prefetch), per stage and chunk: how long after the stage's streams free a backward that
    started beside them ends, and ends its compute (``fastpath_stages._prefetched_chunk``). Such a
    backward may start as the step before ends its compute, its first block gathering nothing
    (a tied head's, or a head whose data-parallel group is one rank), and the pass is max-plus
    in its start and the streams' end, so it ends at the latest of the two ways; where its
    first block gathers, and without ``hide``, those are the step's end plus the whole
    backward (and its compute less the late reduce-scatter). (Without it GPipe's back-to-back
    backwards each waited for the tail before: +3.9% on a folded MoE model at dp 1.)
    ``record``: filled with every step's ends, for ``_certified_gathers`` — a forward's (its
    streams' and its compute's are one), a backward's compute's and its streams', by step
    index. ``first``: each stage chunk's first forward (micro-batch 0) as (gather, forward),
    HFSDP's, whose blocks are gathered across the instances too; the certificate needs no
    change: its walk's edges into and out of a longer first forward hold a fortiori."""
    n = p * v
    if not early and not late:
        return _Plain(schedule, p, v, fwd, bwd, c).walk(m)[0]
    e_f, e_b, lt = _gather_terms(p, v, early, late)
    hop_in = [c[(st - 1) % p] for st in range(p)]
    done_f, done_b, clock_b = [0] * (m * n), [0] * (m * n), [0] * (m * n)
    if record is not None:
        record[:] = [done_f, done_b, clock_b]
    clock = [0] * p
    computed = [0] * p  # when each stage's last compute ended (its streams may run on)
    for st, backward, k, dep, ch in _plan(schedule, m, p, v):
        if backward:  # waits for the next chunk's gradient, sent out of this stage
            g = e_b[st][ch]  # a ZeRO-3 gather that runs before the input arrives
            b = bwd[st][ch]
            # the last ZeRO-3 reduce-scatter of a backward runs after its send; without
            # ``hide`` a backward waits for the tail before it: (b, b − late)
            after, after_last = hide[st, ch] if hide else (b, b - lt[st][ch])
            start = computed[st] + g  # beside the tail, the input permitting
            if dep >= 0 and done_b[dep] + c[st] > start:
                start = done_b[dep] + c[st]
            free = clock[st]  # when the streams the step before left busy free
            clock_b[k] = clock[st] = max(start + b - g, free + after)
            done_b[k] = computed[st] = max(start + b - g - lt[st][ch], free + after_last)
        else:  # waits for the previous chunk's activation, sent into this stage
            g, f = first[st][ch] if first and k < n else (e_f[st][ch], fwd[st][ch])
            t = clock[st] + g
            if dep >= 0 and done_f[dep] + hop_in[st] > t:
                t = done_f[dep] + hop_in[st]
            clock[st] = computed[st] = t + f - g
            done_f[k] = clock[st]
    last = (m - 1) * n
    return clock, [[done_b[last + ch * p + st] for ch in range(v)] for st in range(p)]


def _gather_terms(p: int, v: int, early: dict[tuple[str, int, int], int] | None,
                  late: dict[tuple[int, int], int] | None
                  ) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Per stage and chunk: the ZeRO-3 gather before a forward and before a backward, and the
    reduce-scatter after a backward's send (``_walk``)."""
    return ([[early.get(("F", st, ch), 0) if early else 0 for ch in range(v)] for st in range(p)],
            [[early.get(("B", st, ch), 0) if early else 0 for ch in range(v)] for st in range(p)],
            [[late.get((st, ch), 0) if late else 0 for ch in range(v)] for st in range(p)])


def _certified_gathers(schedule: str, lam: int, m: int, walked: list[list[int]],
                       fwd: list[tuple[int, ...]], bwd: list[tuple[int, ...]], c: list[int],
                       early: dict[tuple[str, int, int], int] | None,
                       late: dict[tuple[int, int], int] | None,
                       hide: dict[tuple[int, int], tuple[int, int]] | None) -> bool:
    """``_certified`` for ``_walk``'s recurrences, whose steps have two ends (a backward's
    compute, and its streams', which its stage's next step also waits for): the steady graph's
    nodes are (class, end), its edges those ``_walk`` takes the maximum over — into a forward,
    the stage's previous streams' end plus f and the input as sent plus f − g; into a
    backward's streams' end, the previous compute's end plus b, the previous streams' end plus
    what ``hide`` says (b without it) and the input as sent plus b − g; into its compute's end
    the same less the late reduce-scatter. The same potential argument: the walk's own ends,
    each class's at its latest steady round (``potential_rounds``) less that many λ, satisfying
    every edge at λ bound every cycle by λ per round; edges whose ends are read from linked
    rounds hold by themselves. ``walked``: the walk of ``m``'s ``record``."""
    p, v = len(fwd), len(fwd[0])
    n = p * v
    done_f, done_b, clock_b = walked
    e_f, e_b, lt = _gather_terms(p, v, early, late)
    rounds = potential_rounds(schedule, m, p, v)

    def end(cls: int, streams: bool) -> int:
        r = max(rounds[cls], 0)
        k, bw = divmod(cls, 2)
        k += r * p * n
        return (done_f[k] if not bw else clock_b[k] if streams else done_b[k]) - r * lam

    for q, e, delta, _, data in _checked_edges(schedule, m, p, v):
        k, bw = divmod(e, 2)
        st, ch = k % n % p, k % n // p
        if not bw:  # a forward: both its ends are one
            f, g = fwd[st][ch], e_f[st][ch]
            need = end(q, False) + c[(st - 1) % p] + f - g if data else end(q, True) + f
            if end(e, True) + delta * lam < need:
                return False
            continue
        b, g, tail = bwd[st][ch], e_b[st][ch], lt[st][ch]
        after, after_last = hide[st, ch] if hide else (b, b - tail)
        if data:
            need_streams = need_compute = end(q, False) + c[st] + b - g
        else:
            need_streams = max(end(q, False) + b, end(q, True) + after)
            need_compute = max(end(q, False) + b, end(q, True) + after_last + tail)
        if (end(e, True) + delta * lam < need_streams
                or end(e, False) + delta * lam < need_compute - tail):
            return False
    return True


# ZeRO-3 on a MoE model: one pass of a stage chunk as runs of equal blocks, each block as (dense
# gather, expert gather, compute, dense reduce-scatter, expert reduce-scatter) ns with its count
# in a row (``fastpath_stages._zero3_runs``); per stage, per chunk
Z3Block = tuple[int, int, int, int, int]
Z3Runs = tuple[tuple[Z3Block, int], ...]
Z3Stages = list[tuple[Z3Runs, ...]]
# A pass as a max-plus map: per output (chain, dense stream, expert stream), its offset from
# each input (chain, dense stream, expert stream, the input's arrival); ``_NEVER`` (the
# max-plus zero, far below any time even after a step's offsets) where it has none
Z3Map = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def _walk_streams(schedule: str, p: int, m: int, v: int, z3_f: Z3Stages, z3_b: Z3Stages,
                  c: list[int]) -> Walked:
    """The two-stream walk of ``m`` micro-batches from the start (``_Streams``)."""
    return _Streams(schedule, p, v, z3_f, z3_b, c).walk(m)[0]


@functools.lru_cache(maxsize=4096)
def z3_map(runs: Z3Runs) -> Z3Map:
    """One pass over ``runs`` as a max-plus map of the stage's state before it and the input's
    arrival: each block gathers on the dense, then the expert stream (the chain waits for each),
    computes — the first block that computes not before the input — and reduce-scatters on
    both streams. A pass is maxima and sums, so each output is max_j(input_j + offset_j); the
    offsets are found once per pass by stepping its blocks on offset vectors instead of times.
    Once a block of a run (past the input's arrival) moves every offset by the same λ, each
    further one does too (its map is the same max-plus map, which commutes with adding a
    constant), so the rest of the run is λ per block. (Until the thirty-eighth session the
    input waited for the first block: an MTP stage's modules gathered only after it came, 2.4%
    above replay on a one-micro-batch draw.)"""
    no = _NEVER
    t, fd, fe = [0, no, no, no], [no, 0, no, no], [no, no, 0, no]
    arrive: list[int] | None = [no, no, no, 0]
    # the input waits for the first block that computes: an MTP stage's embedding copy opens
    # its forward with a gather and no kernel, and the modules' gathers follow it at once
    first = next((i for i, (run, _) in enumerate(runs) if run[2]), len(runs) - 1)
    for i, ((g_dp, g_edp, comp, r_dp, r_edp), count) in enumerate(runs):
        left = count
        while left:
            before = (t, fd, fe) if arrive is None else None
            if g_dp:
                t = fd = _plus(_vmax(t, fd), g_dp)
            if g_edp:
                t = fe = _plus(_vmax(t, fe), g_edp)
            if arrive is not None and i >= first:
                t, arrive = _vmax(t, arrive), None
            t = _plus(t, comp)
            if r_dp:
                fd = _plus(_vmax(t, fd), r_dp)
            if r_edp:
                fe = _plus(_vmax(t, fe), r_edp)
            left -= 1
            lam = _shift(before, (t, fd, fe)) if before and left else None
            if lam is not None:
                t, fd, fe = (_plus(x, lam * left) for x in (t, fd, fe))
                left = 0
    return tuple(t), tuple(fd), tuple(fe)


def _shift(a: tuple[list[int], ...], b: tuple[list[int], ...]) -> int | None:
    """λ where every offset of ``b`` is that of ``a`` plus λ (the max-plus zeros staying zeros,
    whatever they hold: they never win a maximum), else None."""
    lam = None
    for x, y in zip((v for vec in a for v in vec), (v for vec in b for v in vec), strict=True):
        if x < _ZERO or y < _ZERO:
            if (x < _ZERO) != (y < _ZERO):
                return None
            continue
        if lam is None:
            lam = y - x
        elif y - x != lam:
            return None
    return lam


_ZERO = _NEVER // 2  # below this an offset is the max-plus zero (``_NEVER`` plus some sums)


def _vmax(a: list[int], b: list[int]) -> list[int]:
    return [x if x > y else y for x, y in zip(a, b, strict=True)]


def _plus(a: list[int], d: int) -> list[int]:
    return [x + d for x in a]
