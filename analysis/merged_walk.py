"""Combined 1F1B on an interleaved pipeline in the fast path (``Strategy.overlap_moe_ep_comm``
with ``interleaved_1f1b``): each stage's units (``tracegen.schedule.combined``: a pass, or a
forward merged with a backward) walked in an order that respects every wait, every step once.

A unit starts when its stage is free and its inputs have come: a forward's from the stage
before (its end plus the send), a backward's from the stage after. A merged unit starts when
its stage is free, each pass's pieces waiting for that pass's input (the backward's first
pieces run while the forward's input is still coming, as in replay: ``run_pieces``, memoized
by how late each comes); its outputs go when its layers are done (the forward's head and the
backward's embedding come after the sends) and the stage is free at its end. Nothing here is
periodic: the walk is O(m·v·p), the price of a schedule whose steady state pairs passes of
different chunks (the interleaved walks' periodic shortcut and certificates,
``pipeline_walk``, know F and B steps only). The cool-down (the last warm-up's
worth of backwards, which holds every chunk's last backward) is plain, so the walk hands
``dp_tails`` the same ``Tails`` the plain walks do. ``opened`` (overlapped parameter gathers):
as ``pipeline_walk._Plain._opening``, a unit's compute share slowed while its stage's gathers
are in flight (a merged unit's share the mean of its two passes'), each chunk's first forward
ending no earlier than its floor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from analysis.dp_tails import slowed
from analysis.merged_pass import MergedPieces, run_pieces
from analysis.pipeline_walk import Opened, Tail, Tails, Walked, tail_deps
from tracegen.schedule import Step, Unit, combined
from tracegen.strategy import Strategy

Key = tuple[int, int]  # (micro-batch, global chunk)


def merged_walk(s: Strategy, fwd: Sequence[Sequence[int]], bwd: Sequence[Sequence[int]],
                pieces: Sequence[Sequence[MergedPieces]], kappa: float, c: Sequence[int],
                opened: Opened | None = None) -> tuple[Walked, Tails]:
    """(each stage's end, each stage's chunk ends — its last backward of each chunk —) and
    the cool-down ``Tails``, from per stage: forward and backward ns per chunk, the merged
    units' pieces per (forward chunk · v + backward chunk) with the interference κ, and the
    sends ``c`` (``c[st]`` from stage st to st + 1, the last to stage 0)."""
    p, v, m = s.pp, s.vpp, s.num_microbatches
    units = [combined(s.order_id, m=m, p=p, v=v, stage=st) for st in range(p)]
    walk = _Walk(p, v, fwd, bwd, pieces, kappa, c, opened)
    walk_units(units, walk.run, "combined 1F1B")
    chunk_ends = [[walk.b_end[m - 1, ch * p + st] for ch in range(v)] for st in range(p)]
    return (walk.clock, chunk_ends), _tails(units, walk, m, p, v)


def walk_units(units: Sequence[Sequence[Unit]], run: Callable[[int, Unit], bool],
               what: str) -> None:
    """Each stage's units in turn, as many as ``run`` walks (those whose inputs have come),
    until every one is walked (also ``dualpipe_walk``'s)."""
    p = len(units)
    pos, remaining = [0] * p, sum(map(len, units))
    while remaining:
        progressed = False
        for st in range(p):
            while pos[st] < len(units[st]) and run(st, units[st][pos[st]]):
                pos[st] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - the schedules are deadlock-free
            raise RuntimeError(f"the {what} schedule did not progress")


class MergedMemo:
    """Merged passes' (sends, end) by stage, chunk pair and how late each input comes after
    the pass's start (``run_pieces``; a steady state repeats a few)."""

    def __init__(self, pieces: Sequence[Sequence[MergedPieces]], kappa: float) -> None:
        self.pieces, self.kappa = pieces, kappa
        self.got: dict[tuple[int, int, int, int], tuple[int, int]] = {}

    def __call__(self, st: int, pair: int, f_late: int, b_late: int) -> tuple[int, int]:
        key = (st, pair, f_late, b_late)
        got = self.got.get(key)
        if got is None:
            got = self.got[key] = run_pieces(self.pieces[st][pair], self.kappa, f_late, b_late)
        return got


class _Walk:
    """The walk's state: each stage's clock, each pass's end (and when its output goes)."""

    def __init__(self, p: int, v: int, fwd: Sequence[Sequence[int]],
                 bwd: Sequence[Sequence[int]], pieces: Sequence[Sequence[MergedPieces]],
                 kappa: float, c: Sequence[int], opened: Opened | None) -> None:
        self.p, self.v, self.fwd, self.bwd, self.c = p, v, fwd, bwd, c
        self.opened = opened
        self._merged = MergedMemo(pieces, kappa)
        self.floors = dict(opened.floors) if opened else {}
        self.until = ([max(b, default=0) if opened.kappa else 0 for b in opened.busy]
                      if opened else [0] * p)
        self.clock = [0] * p
        self.f_out: dict[Key, int] = {}  # when a forward's output may be received
        self.b_out: dict[Key, int] = {}
        self.b_end: dict[Key, int] = {}  # when a backward's compute ends
        self.order: list[tuple[int, Unit]] = []  # (stage, unit), as walked

    def _ready(self, st: int, step: Step) -> int | None:
        """When ``step``'s input has come (0 for none), or None if it has not been walked."""
        phase, mb, ch = step
        gci, n = ch * self.p + st, self.p * self.v
        if phase == "F":
            return 0 if gci == 0 else self.f_out.get((mb, gci - 1))
        return 0 if gci == n - 1 else self.b_out.get((mb, gci + 1))

    def run(self, st: int, unit: Unit) -> bool:
        """Walk ``unit`` on stage ``st`` if its inputs have come; whether it was walked."""
        ready = [self._ready(st, step) for step in unit]
        if any(r is None for r in ready):
            return False
        if len(unit) == 2:  # it starts with the stage; each pass's pieces wait for its input
            start = self.clock[st]
            (_, f_mb, f_ch), (_, b_mb, b_ch) = unit
            sends, total = self._merged(st, f_ch * self.v + b_ch,
                                        *(max(0, r - start) for r in ready if r is not None))
            end = self._slowed(st, start, total, unit)
            out = end - (total - sends)  # (the head and embedding passes follow the sends)
            self.f_out[f_mb, f_ch * self.p + st] = out + self.c[st]
            self.b_out[b_mb, b_ch * self.p + st] = out + self.c[(st - 1) % self.p]
            self.b_end[b_mb, b_ch * self.p + st] = out
        else:
            start = max(self.clock[st], *(r for r in ready if r is not None))
            phase, mb, ch = unit[0]
            key = (mb, ch * self.p + st)
            if phase == "F":
                end = self._slowed(st, start, self.fwd[st][ch], unit)
                if mb == 0 and (floor := self.floors.get((st, ch))) is not None:
                    end = max(end, floor)
                self.f_out[key] = end + self.c[st]
            else:
                end = self._slowed(st, start, self.bwd[st][ch], unit)
                self.b_out[key] = end + self.c[(st - 1) % self.p]
                self.b_end[key] = end
        self.order.append((st, unit))
        self.clock[st] = end
        return True

    def _slowed(self, st: int, start: int, ns: int, unit: Unit) -> int:
        """``start`` + ``ns``, the compute share slowed while the stage's gathers are in
        flight (``Opened``)."""
        if self.opened is None or start >= self.until[st]:
            return start + ns
        shares = [self.opened.share[((ph == "B") * self.p + st) * self.v + ch]
                  for ph, _, ch in unit]
        compute = ns * sum(shares) / len(shares)
        return round(slowed(start, compute, self.opened.busy[st], self.opened.kappa)
                     + ns - compute)


def _tails(units: list[list[Unit]], walk: _Walk, m: int, p: int, v: int) -> Tails:
    """Each stage's steps from its chunk v − 1's last backward to its end (all plain
    backwards: the cool-down holds them), as ``pipeline_walk.Tail``, and every tail step as
    (stage, place) in the order walked, which respects every wait."""
    tails: list[list[Step]] = []
    for st in range(p):
        steps = [u[0] for u in units[st]]
        first = steps.index(("B", m - 1, v - 1))
        assert all(len(u) == 1 for u in units[st][first:])
        tails.append(steps[first:])
    where, deps = tail_deps(tails)
    out: list[Tail] = [tuple(_tail_step(walk, st, step, dep, m)
                             for step, dep in zip(tail, deps[st], strict=True))
                       for st, tail in enumerate(tails)]
    order = tuple((st, where[st][u[0]]) for st, u in walk.order
                  if len(u) == 1 and u[0] in where[st])
    return tuple(out), order


def _tail_step(walk: _Walk, st: int, step: Step, dep: int, m: int
               ) -> tuple[int, int, int, bool, int]:
    """(end, duration, chunk, last backward of its chunk, dep) of a cool-down step."""
    phase, mb, ch = step
    key = (mb, ch * walk.p + st)
    if phase == "B":
        return walk.b_end[key], walk.bwd[st][ch], ch, mb == m - 1, dep
    return walk.f_out[key] - walk.c[st], walk.fwd[st][ch], ch, False, dep
