"""Combined 1F1B's merged pass in the fast path (``Strategy.overlap_moe_ep_comm``).

A forward and a backward of another micro-batch (of the same chunk without a pipeline; of
any two of a stage's chunks on an interleaved one) run as one pass
(``tracegen.program.RoleProgram.merged``): the blocks in ``merged_plan``'s groups, each group's
passes cut at their expert-parallel all-to-alls and their pieces issued in ``merged_turns``'
order. The pass is costed as replay runs it, one piece after another with no event loop:

* every piece runs on the one compute stream, after the piece before it (of either pass)
  and after what its own pass waits for (its last all-to-all, or at first its input: on a
  pipeline one may come later than the other, ``run_pieces``);
* every all-to-all runs on the expert-parallel group's one stream, in issue order, after its
  own pass's piece;
* a kernel runs at 1/(1 + κ·n) of its speed while n collectives are in flight beside it
  (replay/sim.py's interference, κ = ``GPUSpec.comm_interference``): the all-to-all (they are
  serialised on their stream, so at most one is) and, with TP overlap, the collective issued
  alongside the kernel itself, from the kernel's start to that collective's end.

The pass ends when both passes and the stream are done. Blocking collectives inside a piece
(tensor parallelism's) hold the compute stream as in replay and are not slowed. A piece is
costed as (kernel ns, overlapped collective ns) runs (``Costs.items_runs``), not as segments
with each kernel's slowdown by its own collective already added: beside an all-to-all too, a
kernel is slowed by both at once (1 + 2κ), as replay slows it, not by one after the other
((1 + κ)²: up to 0.09 points above replay with TP overlap; mean |error| over 40 such draws
0.033% → 0.022%).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

from analysis.fastpath_stages import Runs
from tracegen import ops as O
from tracegen.merged_plan import (
    defers_wgrads,
    delayed_wgrads,
    ep_pieces,
    merged_issues,
    merged_plan,
)
from tracegen.program import ParamBlock

if TYPE_CHECKING:
    from analysis.fastpath_costs import Costs


class PassClock:
    """The compute stream's and the all-to-all stream's times through one merged pass."""

    def __init__(self, kappa: float) -> None:
        self.kappa = kappa
        self.compute = 0.0  # when the compute stream is free
        self.stream = 0.0  # when the all-to-all stream is free
        # when each pass's next item may start ("W": the deferred weight gradients, which
        # wait for the compute stream only)
        self.ready = {"F": 0.0, "B": 0.0, "W": 0.0}
        self.flights: list[tuple[float, float]] = []  # the all-to-alls' [start, end)
        self._past = 0  # flights[:_past] ended before the compute stream's time

    def run(self, name: str, runs: Runs) -> None:
        """A piece of ``name``'s pass: its (kernel ns, collective ns) runs in order, each
        kernel beside the overlapped collective issued with it (a run without a kernel is a
        blocking collective, or one the piece ends with)."""
        if not runs:
            return
        t = max(self.compute, self.ready[name])
        for work, coll in runs:
            end = t + coll
            if work:
                t = self._kernel(t, work, end)
            if end > t:
                t = end
        self.compute = self.ready[name] = t

    def all_to_all(self, name: str, ns: int) -> None:
        start = max(self.stream, self.ready[name])
        self.stream = self.ready[name] = start + ns
        self.flights.append((start, start + ns))

    def end(self) -> float:
        return max(self.compute, self.stream, *self.ready.values())

    def _kernel(self, t: float, work: float, beside_until: float) -> float:
        """When compute of ``work`` ns started at ``t`` ends, at 1/(1 + κ·n) of its speed
        while n collectives run beside it: an all-to-all in flight, and its own overlapped
        collective until ``beside_until``. (The compute stream's time only grows, and the
        flights are in order and disjoint — one stream —, so the search starts at the first
        flight not yet over.)"""
        if not self.kappa:
            return t + work
        flights, i = self.flights, self._past
        while i < len(flights) and flights[i][1] <= t:
            i += 1
        self._past = i
        if t >= beside_until and (i == len(flights) or flights[i][0] >= t + work):
            return t + work  # nothing beside it (the common case: most kernels run alone)
        while True:
            n, turn = (1, beside_until) if t < beside_until else (0, math.inf)
            if i < len(flights):
                start, stop = flights[i]
                n, turn = (n + 1, min(turn, stop)) if start <= t else (n, min(turn, start))
            rate = 1 + self.kappa * n
            if work * rate <= turn - t:
                return t + work * rate
            work -= (turn - t) / rate
            t = turn
            while i < len(flights) and flights[i][1] <= t:
                i += 1


# (runs, the deferred weight gradients' or None, the all-to-all's ns or None)
Piece = tuple[Runs, Runs | None, int | None]
# One issue of a merged pass: ("F", "B" or "W", its compute runs, its all-to-all's ns or −1)
Issue = tuple[str, Runs, int]


class MergedPieces(NamedTuple):
    """A merged pass costed piece by piece, in issue order, and the index of the issue before
    which its sends go (``MergedPlan.sends_at``'s group, as an issue index)."""

    issues: tuple[Issue, ...]
    sends_at: int


def merged_pieces(costs: Costs, f_blocks: list[tuple[ParamBlock, int]],
                  b_blocks: list[tuple[ParamBlock, int]], rank: int) -> MergedPieces:
    """The merged pass of a forward through ``f_blocks`` and a backward through ``b_blocks``
    (chunks' runs of blocks; the same chunk's without a pipeline), its pieces costed."""
    memo: dict[tuple[str, ParamBlock], list[Piece]] = {}
    plan = merged_plan(_flat(f_blocks), _flat(b_blocks))
    for group in plan.groups:
        for key in group:
            if key not in memo:
                memo[key] = _pieces(costs, *key, rank)
    cut = [[(key[0], memo[key]) for key in group] for group in plan.groups]
    issues: list[Issue] = []
    sends_at = 0
    for name, runs, a2a_ns in merged_issues(cut, plan.sends_at):
        if name == "S":
            sends_at = len(issues)
        else:
            assert runs is not None
            issues.append((name, runs, -1 if a2a_ns is None else a2a_ns))
    return MergedPieces(tuple(issues), sends_at)


def run_pieces(pieces: MergedPieces, kappa: float, f_ready: float = 0.0,
               b_ready: float = 0.0) -> tuple[int, int]:
    """(when its sends go — the compute stream's time after its layers —, when it ends) of a
    merged pass that starts at 0 with the forward's input there at ``f_ready`` and the
    backward's at ``b_ready``: a pass's pieces wait for their own input, and every piece for
    the one before it on the compute stream (the backward's first pieces may run while the
    forward's input is still coming, as in replay)."""
    clock = PassClock(kappa)
    clock.ready.update(F=f_ready, B=b_ready)
    sends = 0.0
    for i, (name, runs, a2a_ns) in enumerate(pieces.issues):
        if i == pieces.sends_at:
            sends = clock.compute
        clock.run(name, runs)
        if a2a_ns >= 0:
            clock.all_to_all(name, a2a_ns)
    if pieces.sends_at == len(pieces.issues):
        sends = clock.compute
    return round(sends), round(clock.end())


def _flat(blocks: list[tuple[ParamBlock, int]]) -> list[ParamBlock]:
    return [b for b, count in blocks for _ in range(count)]


def _pieces(costs: Costs, name: str, block: ParamBlock, rank: int) -> list[Piece]:
    """A block's pass (``RoleProgram.pass_chain``) cut at its all-to-alls, costed, each
    piece's deferred weight gradients apart (``RoleProgram._delay_pieces``)."""
    delay = defers_wgrads(costs.s, name, block)
    out: list[Piece] = []
    for run, a2a in ep_pieces(costs.prog.pass_chain(name, block)):
        comm = None if a2a is None else a2a[0]
        assert comm is None or isinstance(comm, O.Comm)
        kept, later = delayed_wgrads(run) if delay else (run, [])
        out.append((costs.items_runs([it for it, _, _ in kept], rank),
                    costs.items_runs([it for it, _, _ in later], rank) if later else None,
                    None if comm is None else costs.coll_ns(comm, rank)))
    return out
