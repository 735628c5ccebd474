"""ZB-V's walk for the fast path (``analysis/fastpath.py``): the passes of PyTorch's
``ScheduleZBVZeroBubble`` order (``tracegen.schedule.zb_v``; Qi et al. 2024 §6) walked in an
order that respects every wait, from per stage and chunk F, B and W ns and one send between
neighbouring stages. Pure functions of integers (nanoseconds).

A long run's steady passes repeat: after its first 5p − 3s − 1 passes, stage s runs F and B and
W of chunk 0 then of chunk 1, one micro-batch a round, for m − 2p + 1 rounds on every stage. Laid
out round by round, each round's stages from the last to the first (a chunk-1 forward and a
chunk-0 B wait for the stage above in the same round, every other wait is for the round
before), the rounds are one block of 6p passes repeated, each waiting only on the round before
it. The walk is max-plus linear (Baccelli, Cohen, Olsder and Quadrat 1992, *Synchronization
and Linearity*, ch. 3), and a block of q rounds whose increments repeat stays affine in the
block index until some pass's other wait overtakes the one it takes: the walk jumps those
blocks at once (``_regime``; a uniform increment, the steady rate, to the end) and walks the
cool-down from the last rounds — exact, not extrapolated at a guessed rate. Where one stage is
slower (stage 0, with the embedding and the head), its pace takes the others over one by one,
a switch every few rounds; each stretch between is jumped. Until the forty-first session the
whole run was walked (6·m·p passes) from a plan built per micro-batch count. DualPipe-V
(PyTorch's ``ScheduleDualPipeV``, ``tracegen.schedule.dualpipe_v``) has ZB-V's placement and
waits and steady rounds of the same six passes in another order (F0 B1 W1 F1 B0 W0), from its
5p − 3s − 3-th pass on: jumped the same way since the sixty-ninth session; interleaved ZB's
ring is walked pass by pass."""

from __future__ import annotations

import functools
from typing import NamedTuple

from analysis.dp_tails import slowed
from analysis.pipeline_walk import Opened
from tracegen.schedule import dualpipe_v, interleaved_zb, zb_v

# A pass as the walk reads it: (stage, cost index (kind·2 + chunk)·p + stage for kind 0/1/2 =
# F/B/W, how many passes back in the walk the pass it waits for is (0: none), the send it then
# pays — the link below the higher of the two stages, or p where the V turns round on one
# stage and the tensor stays).
Entry = tuple[int, int, int, int]
STEADY_ROUNDS = 4  # rounds the repeating pieces are cut from (``_pieces``)
# The V schedules whose steady rounds are jumped: stage s's first steady pass is its
# 5p − 3s − (this)-th (ZB-V: F1 B1 W1 F0 B0 W0 a round; DualPipe-V: F0 B1 W1 F1 B0 W0, its
# pairs' passes, reached two passes sooner). Interleaved ZB is walked pass by pass.
STEADY_OFFSET = {"zb_v": 1, "dualpipe_v": 3}
MAX_PERIOD = 4  # the longest period of rounds looked for before walking on


class _Pieces(NamedTuple):
    """A run of m ≥ 2p − 1 + ``STEADY_ROUNDS`` micro-batches as its warm-up with the first
    steady round (``head``), m − 2p steady rounds of ``body`` and the rest (``tail``)."""

    head: tuple[Entry, ...]
    body: tuple[Entry, ...]
    tail: tuple[Entry, ...]
    first_f: tuple[tuple[int, int], ...]  # each stage's chunks' first forwards, in ``head``
    last_w: tuple[tuple[int, int], ...]  # each stage's chunks' last W's, from ``tail``'s start
    stage_last: tuple[int, ...]  # each stage's last pass in ``body``
    prev: tuple[int, ...]  # per ``body`` pass, how many passes back its stage's previous one is


def zero_bubble_v(m: int, f: list[tuple[int, ...]], b: list[tuple[int, ...]],
                  w: list[tuple[int, ...]], c: list[int], opened: Opened | None = None,
                  schedule: str = "zb_v") -> tuple[list[int], list[list[int]]]:
    """ZB-V walked (``_walk``): (each stage's end, each stage's chunks' last W ends — their
    weight gradients fill the buckets) from per stage and chunk F, B and W ns and ``c[s]``,
    one send between stages s and s + 1. A forward starts after its stage's previous pass and
    the previous chunk's forward (plus a send where that ran on another stage), a B after the
    next chunk's B likewise, a W after its stage's previous pass (Qi et al. 2024 §6; the waits
    replay follows in the trace). ``opened``: the parameter gathers that open the step
    (``overlap_param_gather``; its shares per cost index, its floors per (stage, chunk)), as
    ``pipeline_walk._Plain._opening`` walks them. ``schedule``: "zb_v", or "dualpipe_v"
    (``tracegen.schedule.dualpipe_v``: the same placement and waits, another order, whose
    steady rounds are jumped the same way; until the sixty-ninth session it was walked pass
    by pass, 6·m·p of them)."""
    clock, last_w, _ = _walk(m, f, b, w, c, opened, schedule)
    return clock, last_w


def zbv_first_forwards(m: int, f: list[tuple[int, ...]], b: list[tuple[int, ...]],
                       w: list[tuple[int, ...]], c: list[int], schedule: str = "zb_v"
                       ) -> list[list[int]]:
    """When each stage starts its first forward of each chunk in ZB-V's walk without gathers
    (``zero_bubble_v``): where ``overlap_param_gather``'s holds are measured from."""
    return _walk(m, f, b, w, c, None, schedule)[2]


def _walk(m: int, f: list[tuple[int, ...]], b: list[tuple[int, ...]],
          w: list[tuple[int, ...]], c: list[int], opened: Opened | None = None,
          schedule: str = "zb_v") -> tuple[list[int], list[list[int]], list[list[int]]]:
    """(each stage's end, its chunks' last W ends, its chunks' first forward starts): a short
    run walked pass by pass from its own plan (``_plan``), a long one from the repeating pieces
    (``_pieces``) with the steady rounds jumped where they are affine (``_rounds``)."""
    p = len(f)
    v = len(f[0])
    cost = [x[ch] for y in (f, b, w) for ch in range(v) for x in y]
    sends = [*c[:p], 0]  # (index p: the V's turn, no send)
    clock, ends = [0] * p, list[int]()
    run = _Run(cost, sends, clock, ends, opened)
    rounds = m - 2 * p + 1
    if rounds < STEADY_ROUNDS or schedule not in STEADY_OFFSET:
        plan, first_f, last_w = _plan(m, p, schedule, v)
        run.walk(plan, first_f)
        at = 0
    else:
        pieces = _pieces(p, schedule)
        plan, first_f, last_w = pieces.tail, pieces.first_f, pieces.last_w
        run.walk(pieces.head, first_f)
        _rounds(run, pieces, rounds - 1)
        at = len(ends)
        run.walk(plan)
    starts = [[ends[i] - cost[k] for i, k in zip(ff, range(st, v * p, p), strict=True)]
              for st, ff in enumerate(first_f)]
    return clock, [[ends[at + i] for i in lw] for lw in last_w], starts


class _Run:
    """A walk in progress: each stage's clock and each walked pass's end, in walk order."""

    def __init__(self, cost: list[int], sends: list[int], clock: list[int], ends: list[int],
                 opened: Opened | None) -> None:
        self.cost, self.sends, self.clock, self.ends, self.opened = cost, sends, clock, ends, opened
        if opened is not None:
            self.until = [max(x, default=0) if opened.kappa else 0 for x in opened.busy]

    def walk(self, entries: tuple[Entry, ...], first_f: tuple[tuple[int, ...], ...] = ()
             ) -> None:
        """Walk ``entries`` on (``first_f``: the head's first forwards, which an opening's
        floors hold)."""
        if self.opened is not None:
            self._opening(entries, first_f)
            return
        clock, ends, cost, sends = self.clock, self.ends, self.cost, self.sends
        for st, k, back, send in entries:
            t = clock[st]
            if back:
                ready = ends[-back] + sends[send]
                if ready > t:
                    t = ready
            clock[st] = t = t + cost[k]
            ends.append(t)

    def _opening(self, entries: tuple[Entry, ...], first_f: tuple[tuple[int, ...], ...]
                 ) -> None:
        """``walk`` while the parameter gathers that open the step are in flight: a pass that
        starts before its stage's gathers are done has its compute share slowed
        (``dp_tails.slowed``) until they are, and a chunk's first forward ends no earlier than
        its floor (``pipeline_walk._Plain._opening``, the interleaved walk's)."""
        opened = self.opened
        assert opened is not None
        clock, ends, cost, sends, until = self.clock, self.ends, self.cost, self.sends, self.until
        kappa, share, busy = opened.kappa, opened.share, opened.busy
        base = len(ends)
        floors = {first_f[st][ch] + base: end for (st, ch), end in opened.floors} if (
            first_f) else {}
        for st, k, back, send in entries:
            t = clock[st]
            if back and ends[-back] + sends[send] > t:
                t = ends[-back] + sends[send]
            d = cost[k]
            if t < until[st]:
                compute = d * share[k]
                t = round(slowed(t, compute, busy[st], kappa) + d - compute)
            else:
                t += d
            floor = floors.get(len(ends))
            if floor is not None and floor > t:
                t = floor
            clock[st] = t
            ends.append(t)

    def settled(self) -> bool:
        """Whether no pass from here on is slowed by the opening's gathers (each stage's clock
        past its gathers), so that a round is the same function of the round before."""
        return self.opened is None or all(map(int.__ge__, self.clock, self.until))


def _rounds(run: _Run, pieces: _Pieces, n: int) -> None:
    """The ``n`` steady rounds after the head's, walked round by round and jumped over where
    they are affine (``_regime``): the last rounds the tail waits on are then written down,
    and each stage's clock set to its last pass in round n."""
    body, ends, size = pieces.body, run.ends, len(pieces.body)
    done, fresh = 0, 1  # rounds walked or jumped; contiguous rounds at the end of ``ends``
    wait = 0  # rounds to walk before looking again (after a look that found nothing)
    settled = n + 1  # the first round no opening gather slows (found as the rounds go)
    while done < n:
        if settled > n and run.settled():
            settled = done + 1
        run.walk(body)
        done, fresh = done + 1, fresh + 1
        if wait:
            wait -= 1
            continue
        # (a block of q rounds whose passes are all unslowed: the same function of the last)
        for q in range(1, min(MAX_PERIOD, fresh // 3, done - settled + 1) + 1):
            jump = _regime(run, pieces, q, (n - done) // q)
            if jump is None:
                continue
            k, shift = jump
            if k:
                # the last three blocks moved k blocks on: the tail's rounds, and the next look's
                keep = 3 * q
                back = ends[-keep * size:]
                ends += [e + shift[j % (q * size)] * k for j, e in enumerate(back)]
                done, fresh = done + k * q, keep
                run.clock[:] = [ends[j - size] for j in pieces.stage_last]
            break
        else:
            wait = 1 + fresh // 8


def _regime(run: _Run, pieces: _Pieces, q: int, most: int) -> tuple[int, list[int]] | None:
    """Whether the last block of q rounds is affine in the block index, and for how many more
    blocks: (k ≤ ``most``, each round position's increment per block), or None.

    With the last three blocks x₋₂, x₋₁, x₀ and the increments D = x₀ − x₋₁ = x₋₁ − x₋₂, every
    pass that waits on two things (its stage's previous pass, and another stage's with a send)
    takes the later: a at growth g_a, b at g_b. Where the later one's growth is the pass's own
    (or both are equal and the pass grows as the faster), x_{k} = x₀ + k·D holds as long as no
    pass's other term overtakes: k ≤ (a − b) / (g_b − g_a) where g_b > g_a (induction over the
    walk order: every term is a pass before it, of this block or the last). A uniform D is a
    steady rate (no bound), and every other D a transient whose next change is found."""
    ends, size = run.ends, len(pieces.body)
    block = q * size
    cur, prev, prev2 = ends[-block:], ends[-2 * block:-block], ends[-3 * block:-2 * block]
    shift = [x - y for x, y in zip(cur, prev, strict=True)]
    if shift != [x - y for x, y in zip(prev, prev2, strict=True)]:
        return None
    if shift.count(shift[0]) == block:
        return most, shift
    k, base, sends = most, len(ends) - block, run.sends
    for at, (_, _, back, send) in enumerate(pieces.body * q):
        if not back:
            continue
        src = at - pieces.prev[at % size]  # the stage's previous pass
        a, b = ends[base + src], ends[base + at - back] + sends[send]
        ga, gb, own = shift[src % block], shift[(at - back) % block], shift[at]
        if a > b:
            if own != ga:
                return None
            if gb > ga:
                k = min(k, (a - b) // (gb - ga))
        elif b > a:
            if own != gb:
                return None
            if ga > gb:
                k = min(k, (b - a) // (ga - gb))
        elif own != max(ga, gb):
            return None
    return k, shift


def _order(p: int, m: int, schedule: str = "zb_v", v: int = 2
           ) -> list[list[tuple[int, int, int, int]]]:
    """Each stage's order as (kind 0/1/2 = F/B/W, micro-batch, chunk, global chunk): in a V
    global chunk g runs on stage g or 2p − 1 − g, interleaved (``interleaved_zb``) on g mod p
    as chunk g // p."""
    if schedule == "interleaved_zb":
        return [[("FBW".index(ph), j, ch, ch * p + st)
                 for ph, j, ch in interleaved_zb(m, p, v, st)] for st in range(p)]
    order = zb_v if schedule == "zb_v" else dualpipe_v
    return [[("FBW".index(ph), j, ch, p * 2 - 1 - st if ch else st)
             for ph, j, ch in order(m, p, st)] for st in range(p)]


class _Placer:
    """Places passes in a walk order: each after what it waits for (``_plan``, ``_pieces``)."""

    def __init__(self, m: int, p: int, schedule: str = "zb_v", v: int = 2) -> None:
        self.p, self.v, self.orders = p, v, _order(p, m, schedule, v)
        self.ring = schedule == "interleaved_zb"  # chunks round the stages, else in a V
        # the stage of each global chunk
        self.v_stage = ([g % p for g in range(v * p)] if self.ring
                        else [*range(p), *reversed(range(p))])
        self.placed = [[[-1] * m for _ in range(v * p)] for _ in range(2)]  # F's, B's by chunk
        self.first_f = [[-1] * v for _ in range(p)]
        self.last_w = [[-1] * v for _ in range(p)]
        self.pos, self.plan = [0] * p, list[Entry]()

    def place(self, st: int) -> bool:
        """Place stage ``st``'s next pass if what it waits for is placed."""
        p, plan = self.p, self.plan
        kind, j, ch, g = self.orders[st][self.pos[st]]
        src = g - 1 if kind == 0 else g + 1
        waits = kind < 2 and 0 <= src < self.v * p
        dep = self.placed[kind][src][j] if waits else -1
        if waits and dep < 0:
            return False
        other = self.v_stage[src] if waits else st
        if kind < 2:
            self.placed[kind][g][j] = len(plan)
        else:
            self.last_w[st][ch] = len(plan)
        if kind == 0 and j == 0:
            self.first_f[st][ch] = len(plan)
        plan.append((st, ((kind * self.v) + ch) * p + st, len(plan) - dep if dep >= 0 else 0,
                     self._link(st, other, kind)))
        self.pos[st] += 1
        return True

    def _link(self, st: int, other: int, kind: int) -> int:
        """The send a pass on ``st`` pays for its input from ``other``: the link between
        neighbouring stages s and s + 1 is ``c[s]`` (round the ring, the last stage's to stage
        0 is ``c[p − 1]``); p where the input stays on the stage (the V's turn)."""
        if other == st:
            return self.p
        if self.ring:  # a forward comes from the stage before, a backward from the one after
            return other if kind == 0 else st
        return min(st, other)

    def greedy(self, upto: list[int]) -> None:
        """Each stage's passes in turn, as many as are ready, until each reaches ``upto``."""
        while any(map(int.__lt__, self.pos, upto)):
            placed_before = len(self.plan)
            for st in range(self.p):
                while self.pos[st] < upto[st] and self.place(st):
                    pass
            if len(self.plan) == placed_before:  # (the orders' tests hold it never happens)
                raise AssertionError(f"a zero-bubble order waits on itself at p {self.p}")

    def done(self) -> list[int]:
        return [len(order) for order in self.orders]


@functools.lru_cache(maxsize=8)
def _plan(m: int, p: int, schedule: str = "zb_v", v: int = 2
          ) -> tuple[tuple[Entry, ...], tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
    """A short run's passes in a walk order (each stage's in turn, as many as are ready), with
    each stage's chunks' first forwards and last W's as places in it."""
    placer = _Placer(m, p, schedule, v)
    placer.greedy(placer.done())
    return (tuple(placer.plan), tuple(map(tuple, placer.first_f)),
            tuple(map(tuple, placer.last_w)))


@functools.lru_cache(maxsize=32)
def _pieces(p: int, schedule: str = "zb_v") -> _Pieces:
    """The repeating pieces of a long run (``_Pieces``), cut from a run of
    ``STEADY_ROUNDS`` steady rounds: its warm-up placed as ready, then its steady rounds, each
    round's stages from the last to the first, then the rest as ready. The rounds after the
    first must be one block that waits on nothing before the round before it, and the tail on
    no pass before the last three rounds; both are checked here."""
    m = 2 * p - 1 + STEADY_ROUNDS
    placer = _Placer(m, p, schedule)
    # stage st's first steady pass
    steady = [5 * p - 3 * st - STEADY_OFFSET[schedule] for st in range(p)]
    placer.greedy(steady)
    size = 6 * p
    for _ in range(STEADY_ROUNDS):
        for st in reversed(range(p)):
            for _ in range(6):
                if not placer.place(st):
                    raise AssertionError(f"{schedule}'s steady round waits ahead at p {p}")
    placer.greedy(placer.done())
    plan = placer.plan
    rounds_end = sum(steady) + STEADY_ROUNDS * size
    head_end = rounds_end - (STEADY_ROUNDS - 1) * size
    body = plan[head_end:head_end + size]
    for r in range(1, STEADY_ROUNDS - 1):
        assert plan[head_end + r * size:head_end + (r + 1) * size] == body, (p, r)
    assert all(back <= at + size for at, (_, _, back, _) in enumerate(body)), p
    tail = plan[rounds_end:]
    # no further back than the rounds after the head's, and than the three a jump writes
    assert all(back - at <= 3 * size for at, (_, _, back, _) in enumerate(tail)), p
    stage_last = [max(at for at, e in enumerate(body) if e[0] == st) for st in range(p)]
    prev = [at - max(j for j in range(at - size, at) if body[j % size][0] == e[0])
            for at, e in enumerate(body)]
    assert all(i < head_end for row in placer.first_f for i in row), p
    return _Pieces(tuple(plan[:head_end]), tuple(body), tuple(tail),
                   tuple(map(tuple, placer.first_f)),  # type: ignore[arg-type]
                   tuple((a - rounds_end, b - rounds_end) for a, b in placer.last_w),
                   tuple(stage_last), tuple(prev))
