"""The fast path under ``Strategy.grad_reduce_per_microbatch``: every backward, not only a
chunk's last, reduces its gradient buckets (DeepSpeed's ZeRO-2, PyTorch FSDP's SHARD_GRAD_OP,
DDP outside ``no_sync``), so a stage's data-parallel streams carry work from pass to pass — a
slow network's reductions queue up across micro-batches and slow every pass they run beside.
No closed form holds that, so each stage's passes are walked in the trace's order
(``tracegen.schedule.stage_order``), each pass waiting for its input from the stage before
(forward) or after (backward) and its send, with each stage's streams carried along:

* a backward's buckets go onto its streams as ``dp_tails.drain_chunk`` issues them (the same
  drain as a step's last backward, starting from the streams' backlog), the backward slowed
  beside them; without ``overlap_grad_reduce`` each bucket blocks the backward where it fills
  (DeepSpeed without ``overlap_comm``), so the pass takes its buckets' time more;
* a forward runs slowed while a stream is still busy, at κ times its compute share over the
  whole pass as the backward's runs are (``dp_tails.slowed``: 1/(1 + κ·n) beside n busy
  streams, replay/sim.py's interference).

The step ends when each stage's streams have drained and, after the tied embedding's
all-reduce where there is one, its optimizer and parameter gathers have run (``dp_tails``'s
``_after``, as for the other schedules). The walk visits every pass, p·v·2m of them: this
option is screened at ~700 strategies a second (bench/bench_fastpath.py), not at the closed
forms' ~16,000."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from analysis.dp_tails import (
    _IDLE,
    Lanes,
    _after_memo,
    buckets_busy_ns,
    drain_chunk,
    embedding_all_reduce_ns,
    grad_lanes,
    slowed,
)
from tracegen.model import ModelSpec
from tracegen.schedule import Step, stage_order
from tracegen.strategy import Strategy
from tracegen.units import NS_PER_S

if TYPE_CHECKING:
    from analysis.fastpath_costs import Costs
    from analysis.fastpath_stages import Stage
    from replay.hardware import SystemSpec

Pass = tuple[str, int, int]  # (phase "F" or "B", micro-batch, global model chunk)


def per_microbatch_ns(costs: Costs, stages: list[Stage], reps: list[int], c: list[int]
                      ) -> tuple[int, int]:
    """(step ns, pipeline ns: the last pass's end) with every backward reducing its buckets."""
    walkers = _walk(costs, stages, reps, c)
    ends = [w.clock for w in walkers]
    chain = _embedding_chain(costs, stages, ends)
    finish = max(max(chain[st], *w.stream.values())
                 + _after_memo(w.costs, stages[st], reps[st], w.gathers)
                 for st, w in enumerate(walkers))
    return finish, max(ends)


def stream_summary(model: ModelSpec, s: Strategy, system: SystemSpec) -> dict[str, Any] | None:
    """Where a strategy reducing every micro-batch's gradients waits for them: of the stage
    whose streams drain last, one micro-batch's reductions on its data-parallel stream against
    its compute (forward and backward, every chunk), and how long after its last backward's
    compute its streams drain. None where nothing is reduced so (``estimate`` prints it)."""
    from analysis.fastpath import _sends, _stages
    from analysis.fastpath_costs import Costs

    if not s.grad_reduce_per_microbatch or s.dp * s.cp < 2:
        return None
    costs = Costs(model, s, system)
    stages, reps, alike = _stages(costs)
    walkers = _walk(costs, stages, reps, _sends(costs, reps, alike))
    w = max(walkers, key=lambda x: (max(x.stream.values()) - x.clock, -x.st))
    x = stages[w.st]
    reduce_ns = sum(buckets_busy_ns(w.costs, w.lanes_mb, blocks) for blocks in x.runs_bwd)
    return {"stage": w.st, "reduce_s_per_microbatch": reduce_ns / NS_PER_S,
            "compute_s_per_microbatch": (sum(x.fwd) + sum(x.bwd)) / NS_PER_S,
            "wait_after_last_backward_s": max(0, max(w.stream.values()) - w.clock) / NS_PER_S}


def _walk(costs: Costs, stages: list[Stage], reps: list[int], c: list[int]
          ) -> list[_StageWalk]:
    """Every stage's passes walked in the trace's order, each when its input is there."""
    s = costs.s
    p, v, m = s.pp, s.vpp, s.num_microbatches
    orders = [stage_order(s.order_id, m=m, p=p, v=v, stage=st) for st in range(p)]
    walkers = [_StageWalk(stages[st].costs or costs, stages[st], reps[st], orders[st], st, c)
               for st in range(p)]
    done: dict[Pass, int] = {}  # a pass's end (its send not included)
    left = sum(len(o) for o in orders)
    while left:
        moved = 0
        for w in walkers:
            moved += w.advance(done)
        if not moved:  # pragma: no cover - the schedules' orders never deadlock
            raise RuntimeError("the per-micro-batch walk found no pass ready to run")
        left -= moved
    return walkers


class _StageWalk:
    """One stage's clock, streams and place in its order."""

    def __init__(self, costs: Costs, stage: Stage, rank: int, order: list[Step], st: int,
                 c: list[int]) -> None:
        s = costs.s
        self.costs, self.x, self.order, self.st = costs, stage, order, st
        # per pass: its key, the pass it waits for (or None) and that pass's send
        self.steps = [_step(s, st, ph, mb, ch, c) for ph, mb, ch in order]
        self.lanes = grad_lanes(costs, rank)
        # an earlier micro-batch's buckets: inside the optimizer instance only (the shard goes
        # across the instances once, with the last's)
        self.lanes_mb: Lanes = [(axis, size, shape, None) for axis, size, shape, _ in self.lanes]
        self.kappa = costs.compute.gpu.comm_interference if s.overlap_grad_reduce else 0.0
        self.clock, self.i = 0, 0
        self.stream = {"dp": _IDLE, "edp": _IDLE}
        self.gathers: list[tuple[str, int, int]] = []  # the last backwards' (ZeRO ≥ 1)
        self.last = {ch: max(mb for ph, mb, cc in order if ph == "B" and cc == ch)
                     for ch in range(s.vpp)}
        # an earlier micro-batch's backward of a chunk that starts with its streams idle: its
        # delay and each stream's end after its start, the same wherever it starts
        self._idle: dict[int, tuple[int, dict[str, int | None]]] = {}

    def advance(self, done: dict[Pass, int]) -> int:
        """Run the stage's passes in order while their inputs are there; how many ran."""
        ran, steps = 0, self.steps
        while self.i < len(steps):
            key, dep, send = steps[self.i]
            t = self.clock
            if dep is not None:
                got = done.get(dep)
                if got is None:
                    break
                if got + send > t:
                    t = got + send
            ph, mb, ch = self.order[self.i]
            self.clock = (self._forward(t, ch) if ph == "F" else
                          self._backward(t, ch, last=mb == self.last[ch]))
            done[key] = self.clock
            self.i += 1
            ran += 1
        return ran

    def _forward(self, t: int, ch: int) -> int:
        f = self.x.fwd[ch]
        busy = [b for b in self.stream.values() if b > t]
        if not (busy and self.kappa):
            return t + f
        return round(slowed(t, f, busy, self.kappa * self.x.busy_f[ch]))

    def _backward(self, t: int, ch: int, *, last: bool) -> int:
        b = self.x.bwd[ch]
        gathers, lanes = (self.gathers, self.lanes) if last else ([], self.lanes_mb)
        if not self.costs.s.overlap_grad_reduce:  # each bucket blocks the backward
            queue = {"dp": _IDLE, "edp": _IDLE}
            drain_chunk(self.costs, lanes, self.x.runs_bwd[ch], t, t + b, t + b, queue,
                        0.0, 0.0, gathers)
            return max(t + b, *queue.values())
        idle = not last and max(self.stream.values()) <= t
        if idle and ch in self._idle:
            late, ends = self._idle[ch]
            self.stream = {k: (t + e if e is not None else _IDLE) for k, e in ends.items()}
            return t + b + late
        late = drain_chunk(self.costs, lanes, self.x.runs_bwd[ch], t, t + b, t + b,
                           self.stream, self.kappa, self.x.busy_b[ch], gathers)
        if idle:  # (a stream left idle by the chunk's buckets stays so)
            self._idle[ch] = late, {k: (e - t if e > t else None)
                                    for k, e in self.stream.items()}
        return t + b + late


def _step(s: Strategy, st: int, ph: str, mb: int, ch: int, c: list[int]
          ) -> tuple[Pass, Pass | None, int]:
    """A pass of stage ``st`` as the walk reads it: (its key, the pass whose output it waits
    for — the chunk before's forward, the chunk after's backward — or None, that one's send
    over ``c``, the hop between stages)."""
    gci, chunks = s.gci(st, ch), s.pp * s.vpp
    if ph == "F" and gci > 0:
        return (ph, mb, gci), ("F", mb, gci - 1), c[(gci - 1) % s.pp]
    if ph == "B" and gci < chunks - 1:
        return (ph, mb, gci), ("B", mb, gci + 1), c[gci % s.pp]
    return (ph, mb, gci), None, 0


def _embedding_chain(costs: Costs, stages: list[Stage], ends: list[int]) -> list[int]:
    """Each stage's end with the tied embedding's all-reduce between the first stage and its
    partner (after both last backwards' compute, on its own stream; ``dp_tails.tails_ns``)."""
    chain = list(ends)
    partner = costs.embd_partner
    if partner is None:
        return chain
    t = max(ends[0], ends[partner]) + embedding_all_reduce_ns(costs, stages, partner)
    chain[0], chain[partner] = max(t, ends[0]), max(t, ends[partner])
    return chain
