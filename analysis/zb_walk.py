"""ZB-H1 in the fast path (``analysis/fastpath.py``; Qi et al. 2024, "Zero Bubble Pipeline
Parallelism", §3): each stage's forwards, B passes (input gradients) and W passes (weight
gradients) walked in ``tracegen.schedule.zb_h1``'s order, from each stage's pass times and one
send per hop, with ``pipeline_walk.periodic``'s shortcut at the schedule's exact steady rate.
Pure functions of integers (nanoseconds). ZB-V's V-shaped walk is ``analysis/zbv_walk.py``."""

from __future__ import annotations

import functools

from analysis.pipeline_walk import Walked, periodic
from tracegen.schedule import Step, zb_h1


@functools.lru_cache(maxsize=8)  # (a plan holds 2·m·p steps: 5 MiB at m 1,536, pp 16)
def _zb_plan(m: int, p: int) -> tuple[tuple[int, int, int, int, int], ...]:
    """ZB-H1's forwards and B passes (``tracegen.schedule.zb_h1``) in an order that respects
    each stage's order and every wait (a forward after the previous stage's, a B after the next
    stage's), each as (stage, its cost index kind·p + stage for kind 0/1 = F/B, the index of
    the pass it waits for in the walk's ends or −1, the index of the send it then pays — stage
    − 1 for a forward, the stage for a B —, and n·p + stage, the index of what the n W passes
    that follow it on its stage cost). A W waits for nothing but its stage's pass before it,
    and nothing waits for a W but its stage's next pass, so each run of W's rides on the pass
    before it (one step in three fewer than walking them)."""
    orders = [_folded(zb_h1(m, p, st)) for st in range(p)]
    placed = [[[-1] * m for _ in range(p)] for _ in range(2)]  # F's and B's places in the plan
    pos, plan = [0] * p, list[tuple[int, int, int, int, int]]()
    while len(plan) < 2 * m * p:
        for st in range(p):
            order, at = orders[st], pos[st]
            while at < 2 * m:
                kind, j, n = order[at]
                waits = (kind == 0 and st > 0) or (kind == 1 and st < p - 1)
                dep = placed[kind][st - 1 if kind == 0 else st + 1][j] if waits else -1
                if waits and dep < 0:
                    break  # (what it waits for is not placed yet)
                placed[kind][st][j] = len(plan)
                plan.append((st, kind * p + st, dep, st - 1 if kind == 0 else st, n * p + st))
                at += 1
            pos[st] = at
    return tuple(plan)


def _folded(order: list[Step]) -> list[tuple[int, int, int]]:
    """A stage's ZB-H1 order as its forwards and B passes, (kind 0/1, micro-batch, how many W
    passes follow it). Every W follows a B or another W (``zb_h1``), at most p of them in a
    row (the last B's, after those its stage deferred)."""
    out: list[tuple[int, int, int]] = []
    for ph, j, _ in order:
        if ph == "W":
            kind, mb, n = out[-1]
            out[-1] = (kind, mb, n + 1)
        else:
            out.append((0 if ph == "F" else 1, j, 0))
    return out


def zero_bubble(m: int, f: list[int], b: list[int], w: list[int], c: list[int]) -> list[int]:
    """ZB-H1: when each stage ends its last pass (the last micro-batch's W, whose weight
    gradients fill the buckets). A forward starts after the stage's previous pass and the
    previous stage's forward plus one send, a B after the next stage's B plus one send, a W
    after the stage's previous pass (Qi et al. 2024 §3; the same waits replay follows in the
    trace). The 1F1B closed form does not hold — a stage's steady period is F + B + W and its
    cooldown is paced by the Bs — so the passes are walked (``_zb_walk``), from 4p micro-batches
    on with ``periodic``'s shortcut at the schedule's exact steady rate (``zb_h1_rate``): the
    walks of p + r and 2p + r micro-batches (r = m mod p), extrapolated by whole rounds where
    the second adds p times the rate to every stage's end, and walked on round by round (at
    worst the whole run) where it does not. A test holds the shortcut equal to the whole walk
    on random costs."""
    p = len(f)
    if m < 4 * p:
        return _zb_walk(m, f, b, w, c)
    rate = zb_h1_rate(f, b, w, c)
    ends, _ = periodic(lambda n: _zb_ends(n, f, b, w, c), p, m, 1, 0, rate)
    return ends


def _zb_ends(m: int, f: list[int], b: list[int], w: list[int], c: list[int]) -> Walked:
    """``_zb_walk`` as ``periodic`` reads a walk (each stage one chunk)."""
    ends = _zb_walk(m, f, b, w, c)
    return ends, [[e] for e in ends]


def zb_h1_rate(f: list[int], b: list[int], w: list[int], c: list[int]) -> tuple[int, int]:
    """(W, A): ZB-H1's steady time per micro-batch as the ratio W / A, the max-plus eigenvalue of
    its steady order (the largest weight-per-advance of a cycle; Baccelli et al. 1992, ch. 3),
    as ``one_f_one_b_rate`` finds 1F1B's. Stage s runs F(j + w_s), B(j), W(j − s), w_s = p − s − 1
    (``tracegen.schedule.zb_h1``), so its cycles are each stage's F + B + W (advance one
    micro-batch) and each round trip from stage s up to t and back, F_s … F_t, B_t … B_s, then
    the W and the next F on stage s: Σ_{u=s..t}(f_u + b_u) + 2·Σ_{u=s..t−1} c_u + w_s over an
    advance of w_s − w_t + 1 = t − s + 1 micro-batches (a W waits for nothing else, so no other
    stage's W is on a cycle)."""
    best_w, best_a = max(x + y + z for x, y, z in zip(f, b, w, strict=True)), 1
    p = len(f)
    for s in range(p - 1):
        run = f[s] + b[s]
        for t in range(s + 1, p):
            run += f[t] + b[t] + 2 * c[t - 1]
            if (run + w[s]) * best_a > best_w * (t - s + 1):
                best_w, best_a = run + w[s], t - s + 1
    return best_w, best_a


def _zb_walk(m: int, f: list[int], b: list[int], w: list[int], c: list[int]) -> list[int]:
    """ZB-H1 walked pass by pass, its 2·m·p forwards and B passes each with the W passes that
    follow it (``_zb_plan``; ``zero_bubble``)."""
    p = len(f)
    clock = [0] * p
    cost = [*f, *b]
    extra = [n * x for n in range(p + 1) for x in w]  # n W passes on a stage
    plan = _zb_plan(m, p)
    ends = [0] * len(plan)
    for i, (st, k, dep, send, x) in enumerate(plan):
        start = clock[st]
        if dep >= 0:
            ready = ends[dep] + c[send]
            if ready > start:
                start = ready
        ends[i] = start = start + cost[k]
        clock[st] = start + extra[x]
    return clock
