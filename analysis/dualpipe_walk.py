"""DualPipe-V with its paired passes merged in the fast path (``Strategy.overlap_moe_ep_comm``
with ``dualpipe_v``; torchtitan's DualPipeV overlap): each stage's units
(``tracegen.schedule.dualpipe_v_units``: a pass, or a forward merged with a full backward)
walked in an order that respects every wait, every unit once — O(m·p), as ``merged_walk``
walks combined 1F1B on an interleaved pipeline, here on ZB-V's V placement with its W passes.

A forward of global chunk g waits for chunk g − 1's forward of its micro-batch, a backward (B
pass) for chunk g + 1's backward, each plus the send where the two run on different stages
(none where the V turns round on the last stage); a W pass for nothing but its stage. A merged
unit starts when its stage is free, each pass's pieces waiting for that pass's input
(``merged_pass.run_pieces``, memoized by how late each comes); its outputs go when its layers
are done (the forward's head and the backward's embedding come after the sends) and the stage
is free at its end. ``opened`` (overlapped parameter gathers) as ``zbv_walk``'s: a unit's
compute share slowed while its stage's gathers are in flight (a merged unit's share the mean
of its two passes'), each chunk's first forward ending no earlier than its floor. Pure
functions of integers (nanoseconds).
"""

from __future__ import annotations

from collections.abc import Sequence

from analysis.dp_tails import slowed
from analysis.merged_pass import MergedPieces
from analysis.merged_walk import MergedMemo, walk_units
from analysis.pipeline_walk import Opened
from tracegen.schedule import Unit, dualpipe_v_units

Key = tuple[int, int]  # (micro-batch, global chunk)


def dualpipe_merged_walk(m: int, f: Sequence[Sequence[int]], b: Sequence[Sequence[int]],
                         w: Sequence[Sequence[int]], pieces: Sequence[Sequence[MergedPieces]],
                         kappa: float, c: Sequence[int], opened: Opened | None = None
                         ) -> tuple[list[int], list[list[int]]]:
    """(each stage's end, each stage's chunks' last W ends — their weight gradients fill the
    buckets), as ``zbv_walk.zero_bubble_v`` gives them, from per stage and chunk F, B and W ns,
    the merged units' pieces per (forward chunk · 2 + backward chunk), the interference κ and
    ``c[s]``, one send between stages s and s + 1."""
    p = len(f)
    walk = _Walk(p, f, b, w, pieces, kappa, c, opened)
    walk_units([dualpipe_v_units(m, p, st) for st in range(p)], walk.run, "DualPipe-V")
    return walk.clock, walk.last_w


class _Walk:
    """The walk's state: each stage's clock, when each pass's output may be received."""

    def __init__(self, p: int, f: Sequence[Sequence[int]], b: Sequence[Sequence[int]],
                 w: Sequence[Sequence[int]], pieces: Sequence[Sequence[MergedPieces]],
                 kappa: float, c: Sequence[int], opened: Opened | None) -> None:
        self.p, self.cost, self.c, self.opened = p, (f, b, w), c, opened
        self._merged = MergedMemo(pieces, kappa)
        self.floors = dict(opened.floors) if opened else {}
        self.until = ([max(x, default=0) if opened.kappa else 0 for x in opened.busy]
                      if opened else [0] * p)
        self.clock = [0] * p
        self.last_w = [[0, 0] for _ in range(p)]
        self.out: dict[tuple[str, int, int], int] = {}  # ("F"/"B", mb, gci) → output there

    def _gci(self, st: int, ch: int) -> int:
        return 2 * self.p - 1 - st if ch else st

    def _send(self, st: int, gci: int) -> int:
        """The send from stage ``st`` to global chunk ``gci``'s stage (0 on the same one)."""
        other = gci if gci < self.p else 2 * self.p - 1 - gci
        return 0 if other == st else self.c[min(st, other)]

    def _ready(self, st: int, phase: str, mb: int, ch: int) -> int | None:
        """When a pass's input has come (0 for none), or None if it has not been walked."""
        gci, n = self._gci(st, ch), 2 * self.p
        if phase == "F":
            return 0 if gci == 0 else self.out.get(("F", mb, gci - 1))
        if phase == "B":
            return 0 if gci == n - 1 else self.out.get(("B", mb, gci + 1))
        return 0

    def _emit(self, st: int, phase: str, mb: int, ch: int, at: int) -> None:
        """A pass's output leaves stage ``st`` at ``at`` for the next chunk (forward) or the
        one before (backward)."""
        gci = self._gci(st, ch)
        to = gci + 1 if phase == "F" else gci - 1
        if 0 <= to < 2 * self.p:
            self.out[phase, mb, gci] = at + self._send(st, to)

    def run(self, st: int, unit: Unit) -> bool:
        """Walk ``unit`` on stage ``st`` if its inputs have come; whether it was walked."""
        ready = [self._ready(st, *step) for step in unit]
        if any(r is None for r in ready):
            return False
        start = self.clock[st]
        if len(unit) == 2:  # each pass's pieces wait for its own input
            (_, f_mb, f_ch), (_, b_mb, b_ch) = unit
            late = [max(0, r - start) for r in ready if r is not None]
            sends, total = self._merged(st, f_ch * 2 + b_ch, late[0], late[1])
            end = self._slowed(st, start, total, unit)
            out = end - (total - sends)  # (the head and embedding passes follow the sends)
            self._emit(st, "F", f_mb, f_ch, out)
            self._emit(st, "B", b_mb, b_ch, out)
        else:
            phase, mb, ch = unit[0]
            start = max(start, *(r for r in ready if r is not None))
            end = self._slowed(st, start, self.cost["FBW".index(phase)][st][ch], unit)
            if phase == "F" and mb == 0 and (floor := self.floors.get((st, ch))) is not None:
                end = max(end, floor)
            if phase == "W":
                self.last_w[st][ch] = end
            else:
                self._emit(st, phase, mb, ch, end)
        self.clock[st] = end
        return True

    def _slowed(self, st: int, start: int, ns: int, unit: Unit) -> int:
        """``start`` + ``ns``, the compute share slowed while the stage's gathers are in
        flight (``Opened``; its shares per cost index (kind·2 + chunk)·p + stage)."""
        if self.opened is None or start >= self.until[st]:
            return start + ns
        shares = [self.opened.share[("FBW".index(ph) * 2 + ch) * self.p + st]
                  for ph, _, ch in unit]
        compute = ns * sum(shares) / len(shares)
        return round(slowed(start, compute, self.opened.busy[st], self.opened.kappa)
                     + ns - compute)
