"""Rank ↔ mesh coordinates and communication groups, in Megatron's rank order.

Megatron-LM (``megatron/core/parallel_state.py``, order ``tp-cp-ep-dp-pp``) puts tensor
parallelism innermost, so a TP group is a block of consecutive ranks inside one node, then context
parallelism, then data parallelism (expert parallelism carved out of it), then pipeline stages::

    rank = tp_i + tp · (cp_i + cp · (dp_i + dp · pp_i))
"""

from __future__ import annotations

import dataclasses
from functools import cached_property

from tracegen.strategy import Strategy

# Collective axes in the order their groups are numbered (group ids start at 1, ASTRA-sim style).
# "dp" is the gradient-reduction group: every rank holding the same weights (dp × cp).
# "edp" is the expert-data-parallel group (dp / ep), "embd" joins the first and last stage
# for the tied-embedding gradient all-reduce.
AXES: tuple[str, ...] = ("tp", "cp", "dp", "ep", "edp", "embd")


@dataclasses.dataclass(frozen=True, slots=True)
class Coord:
    rank: int
    pp: int
    dp: int
    cp: int
    tp: int

    def ep(self, ep: int) -> int:
        return self.dp % ep


@dataclasses.dataclass(frozen=True, slots=True)
class Group:
    gid: int
    axis: str
    ranks: tuple[int, ...]


class Mesh:
    """The rank grid of a strategy and its collective groups (size-1 groups are omitted)."""

    def __init__(self, strategy: Strategy, *, tied_embeddings: bool = False, moe: bool = False):
        self.s = strategy
        self.tied_embeddings = tied_embeddings
        self.moe = moe

    def rank_of(self, *, pp: int, dp: int, cp: int, tp: int) -> int:
        s = self.s
        return tp + s.tp * (cp + s.cp * (dp + s.dp * pp))

    def coord(self, rank: int) -> Coord:
        s = self.s
        tp, r = rank % s.tp, rank // s.tp
        cp, r = r % s.cp, r // s.cp
        dp, pp = r % s.dp, r // s.dp
        return Coord(rank, pp, dp, cp, tp)

    def representatives(self) -> list[int]:
        """One rank per distinct role: the (dp, cp, tp) = 0 rank of every pipeline stage."""
        return [self.rank_of(pp=p, dp=0, cp=0, tp=0) for p in range(self.s.pp)]

    @property
    def multiplicity(self) -> int:
        """Ranks each representative stands for: all ranks of its stage."""
        return self.s.tp * self.s.cp * self.s.dp

    def _members(self, axis: str, c: Coord) -> tuple[int, ...]:
        s, r = self.s, self.rank_of
        if axis == "tp":
            return tuple(r(pp=c.pp, dp=c.dp, cp=c.cp, tp=t) for t in range(s.tp))
        if axis == "cp":
            return tuple(r(pp=c.pp, dp=c.dp, cp=x, tp=c.tp) for x in range(s.cp))
        if axis == "dp":
            return tuple(r(pp=c.pp, dp=d, cp=x, tp=c.tp) for d in range(s.dp) for x in range(s.cp))
        if axis == "ep":
            base = c.dp - c.dp % s.ep
            return tuple(r(pp=c.pp, dp=base + e, cp=c.cp, tp=c.tp) for e in range(s.ep))
        if axis == "edp":
            e = c.dp % s.ep
            return tuple(r(pp=c.pp, dp=d, cp=x, tp=c.tp)
                         for d in range(e, s.dp, s.ep) for x in range(s.cp))
        if axis == "embd":
            return tuple(dict.fromkeys(r(pp=p, dp=c.dp, cp=c.cp, tp=c.tp) for p in (0, s.pp - 1)))
        raise ValueError(axis)

    def _axis_used(self, axis: str) -> bool:
        if axis == "embd":
            return self.tied_embeddings and self.s.pp > 1
        if axis in ("ep", "edp"):
            return self.moe
        return True

    @cached_property
    def groups(self) -> dict[int, Group]:
        out: dict[int, Group] = {}
        for axis in AXES:
            if not self._axis_used(axis):
                continue
            assigned: set[int] = set()
            for rank in range(self.s.world_size):
                if rank in assigned:
                    continue
                members = self._members(axis, self.coord(rank))
                if rank not in members:  # e.g. a middle stage has no embedding group
                    continue
                assigned.update(members)
                if len(members) >= 2:
                    gid = len(out) + 1
                    out[gid] = Group(gid, axis, members)
        return out

    @cached_property
    def _group_index(self) -> dict[tuple[str, int], int]:
        return {(g.axis, r): g.gid for g in self.groups.values() for r in g.ranks}

    def group_id(self, axis: str, rank: int) -> int | None:
        """The id of ``rank``'s group on ``axis``; None when that group has one member."""
        return self._group_index.get((axis, rank))

    def group_size(self, axis: str) -> int:
        s = self.s
        sizes = {"tp": s.tp, "cp": s.cp, "dp": s.dp * s.cp, "ep": s.ep,
                 "edp": s.dp // s.ep * s.cp, "embd": 2 if s.pp > 1 else 1}
        return sizes[axis] if self._axis_used(axis) else 1

    def pp_peer(self, rank: int, offset: int) -> int:
        """The rank ``offset`` stages away (wrapping: interleaved chunks go from last to first)."""
        c = self.coord(rank)
        return self.rank_of(pp=(c.pp + offset) % self.s.pp, dp=c.dp, cp=c.cp, tp=c.tp)
