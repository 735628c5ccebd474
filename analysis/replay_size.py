"""How large one step's replay trace would be, and the limit past which ``validate``, ``compare``
and ``sweep`` keep the fast path's answer instead of building it: trace building and replay run
~50 k nodes/s together (Megatron's 1T run, 2.6 M nodes, takes ~1 min, the largest row of any
validation set here), while the fast path agrees with replay within 1% at real sizes
(bench/bench_fastpath_agreement.py). A typo'd batch of 60 M sequences would hold ~1 G nodes."""

from __future__ import annotations

from tracegen.model import ModelSpec
from tracegen.program import RoleProgram
from tracegen.strategy import Strategy

MAX_REPLAY_NODES = 10_000_000


def oversized(model: ModelSpec, strategy: Strategy) -> int | None:
    """The node count of the step's trace set where it passes the limit, else None
    (``RoleProgram.step_op_count``: within 15% of the built set)."""
    nodes = RoleProgram(model, strategy, 0).step_op_count()
    return nodes if nodes > MAX_REPLAY_NODES else None


def why(nodes: int) -> str:
    return (f"the replay trace would hold ~{nodes / 1e6:,.0f} M nodes (more than "
            f"{MAX_REPLAY_NODES // 10**6} M, minutes to build)")
