"""Rank ↔ mesh coordinates and communication groups, in Megatron's rank order.

Megatron-LM (``megatron/core/parallel_state.py``, order ``tp-cp-ep-dp-pp``) puts tensor
parallelism innermost, so a TP group is a block of consecutive ranks inside one node, then context
parallelism, then data parallelism (expert parallelism carved out of it), then pipeline stages::

    rank = tp_i + tp · (cp_i + cp · (dp_i + dp · pp_i))
"""

from __future__ import annotations

import dataclasses
import itertools
from functools import cached_property

from tracegen.model import ModelSpec
from tracegen.strategy import Strategy

# Collective axes in the order their groups are numbered (group ids start at 1, ASTRA-sim style).
# "dp" is the gradient-reduction group: every rank holding the same weights (dp × cp).
# "edp" is the expert-data-parallel group (dp / ep), "embd" joins the first and last stage
# for the shared embedding's gradient all-reduce (a tied head, or multi-token prediction).
# With several distributed-optimizer instances (``Strategy.dist_opt_instances`` R) "dps" is an
# instance (dp·cp / R consecutive members of the "dp" group: Megatron-Core's intra-instance
# partial data-parallel group) and "dpr" joins the members at one position of every instance
# (its inter-instance group); last, so the other groups keep their ids. A MoE model's expert
# gradients split the same way (Megatron-Core's intra- and inter-partial expert data-parallel
# groups, ``create_hierarchical_groups`` over the expert-data-parallel ranks): "edps", "edpr".
AXES: tuple[str, ...] = ("tp", "cp", "dp", "ep", "edp", "embd", "dps", "dpr", "edps", "edpr")


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


def embedding_partner(m: ModelSpec, s: Strategy) -> int | None:
    """The pipeline stage that holds stage 0's embedding weight too, its gradient all-reduced
    with stage 0's (Megatron's embedding group): the last, for a tied output head; the MTP
    modules' stage (``Strategy.mtp_chunk``), which reads the embedding; None on one stage or
    where no other stage holds it (a V's head is on stage 0)."""
    if s.pp == 1:
        return None
    if m.tied_embeddings:  # (in a V the head is on stage 0 with the embedding: none)
        return s.head_stage or None
    if m.mtp_layers and s.chunk_stage(s.mtp_chunk):
        return s.chunk_stage(s.mtp_chunk)
    return None


class Mesh:
    """The rank grid of a strategy and its collective groups (size-1 groups are omitted)."""

    def __init__(self, strategy: Strategy, *, embedding_stage: int | None = None,
                 moe: bool = False):
        """``embedding_stage``: the stage that shares stage 0's embedding (``embedding_partner``),
        joined with it in the "embd" group; None = no such stage."""
        self.s = strategy
        self.embedding_stage = embedding_stage
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
        return tuple(itertools.chain.from_iterable(self.member_ranges(axis, c)))

    def member_ranges(self, axis: str, c: Coord) -> list[range]:
        """The ranks of ``c``'s group on ``axis`` as arithmetic runs, in group order. With
        rank = tp_i + tp·(cp_i + cp·(dp_i + dp·pp_i)), an axis varies one or two mixed-radix
        digits, so its members are at most dp/ep runs of equally spaced ranks."""
        s, r = self.s, self.rank_of
        tp, cp = s.tp, s.cp
        if axis in ("edps", "edpr"):
            return self._expert_instance(axis, c)
        if axis in ("ep", "edp") and s.moe_folded:
            return self._folded_ranges(axis, c)
        if axis == "tp":
            start = r(pp=c.pp, dp=c.dp, cp=c.cp, tp=0)
            return [range(start, start + tp)]
        if axis == "cp":
            start = r(pp=c.pp, dp=c.dp, cp=0, tp=c.tp)
            return [range(start, start + tp * cp, tp)]
        if axis == "dp":  # (dp, cp) with cp innermost: one run of stride tp
            start = r(pp=c.pp, dp=0, cp=0, tp=c.tp)
            return [range(start, start + tp * cp * s.dp, tp)]
        if axis == "ep":
            start = r(pp=c.pp, dp=c.dp - c.dp % s.ep, cp=c.cp, tp=c.tp)
            return [range(start, start + tp * cp * s.ep, tp * cp)]
        if axis == "edp" and s.ep == 1:
            return self.member_ranges("dp", c)
        if axis == "edp" and cp == 1:
            start = r(pp=c.pp, dp=c.dp % s.ep, cp=0, tp=c.tp)
            return [range(start, start + tp * s.dp, tp * s.ep)]
        if axis == "edp":  # every ep-th dp index, each with all of cp
            return [range(b, b + tp * cp, tp) for b in
                    (r(pp=c.pp, dp=d, cp=0, tp=c.tp) for d in range(c.dp % s.ep, s.dp, s.ep))]
        if axis in ("dps", "dpr"):
            return [self._instance_range(axis, c)]
        if axis == "embd":
            partner = s.pp - 1 if self.embedding_stage is None else self.embedding_stage
            ends = dict.fromkeys(r(pp=p, dp=c.dp, cp=c.cp, tp=c.tp) for p in (0, partner))
            return [range(e, e + 1) for e in ends]
        raise ValueError(axis)

    def _instance_range(self, axis: str, c: Coord) -> range:
        """``c``'s distributed-optimizer instance ("dps": a block of ``dp·cp / R`` consecutive
        members of its "dp" group) or the R members at its position in every instance ("dpr")."""
        s = self.s
        start = self.rank_of(pp=c.pp, dp=0, cp=0, tp=c.tp)
        shard = s.dp * s.cp // s.dist_opt_instances
        i = c.cp + s.cp * c.dp  # position in the "dp" group
        if axis == "dps":
            first = start + s.tp * (i - i % shard)
            return range(first, first + s.tp * shard, s.tp)
        first = start + s.tp * (i % shard)
        return range(first, first + s.tp * s.dp * s.cp, s.tp * shard)

    def _expert_instance(self, axis: str, c: Coord) -> list[range]:
        """``c``'s expert optimizer instance ("edps": a block of edp / R consecutive members
        of its "edp" group) or the R members at its position in every instance ("edpr")."""
        members = self._members("edp", c)
        shard = len(members) // self.s.dist_opt_instances
        i = members.index(c.rank)
        picked = (members[i - i % shard:i - i % shard + shard] if axis == "edps"
                  else members[i % shard::shard])
        return [range(r, r + 1) for r in picked]

    def _folded_ranges(self, axis: str, c: Coord) -> list[range]:
        """MoE parallel folding (``Strategy.expert_tp`` 1): a stage's tp·cp·dp ranks in rank
        order split into EP groups of ``ep`` consecutive ranks; the expert-data-parallel group
        is every ep-th rank of the stage (Megatron-Core's expert rank order, tp-ep-dp with an
        expert tensor-parallel size of 1)."""
        s = self.s
        stage = s.tp * s.cp * s.dp
        base = c.pp * stage
        local = c.rank - base
        if axis == "ep":
            start = base + local - local % s.ep
            return [range(start, start + s.ep)]
        return [range(base + local % s.ep, base + stage, s.ep)]

    def _axis_used(self, axis: str) -> bool:
        if axis == "embd":
            return self.embedding_stage is not None and self.s.pp > 1
        if axis in ("ep", "edp"):
            return self.moe
        if axis in ("dps", "dpr"):
            return self.s.dist_opt_instances > 1
        if axis in ("edps", "edpr"):
            return self.moe and self.s.dist_opt_instances > 1
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
                 "edp": s.edp,
                 "embd": 2 if s.pp > 1 else 1,
                 "dps": s.dp * s.cp // s.dist_opt_instances, "dpr": s.dist_opt_instances}
        sizes |= {"edps": sizes["edp"] // s.dist_opt_instances, "edpr": s.dist_opt_instances}
        return sizes[axis] if self._axis_used(axis) else 1

    def pp_peer(self, rank: int, offset: int) -> int:
        """The rank ``offset`` stages away (wrapping: interleaved chunks go from last to first)."""
        c = self.coord(rank)
        return self.rank_of(pp=(c.pp + offset) % self.s.pp, dp=c.dp, cp=c.cp, tp=c.tp)
