"""A pipeline whose micro-batches cost unequally: the step as the longest path through the
schedule's dependencies, vectorized over many draws of the costs.

Each stage runs its passes in its schedule's order (``tracegen.schedule.stage_order``: GPipe,
1F1B, interleaved 1F1B with its micro-batch groups, ZB-H1, ZB-V, DualPipe-V and interleaved
ZB with their W passes). A
forward of micro-batch j on global model chunk g waits for chunk g − 1's forward of j, a
backward (a zero-bubble schedule's B pass) for chunk g + 1's backward of j (the last chunk's
for its own forward), a W pass for its own B, and each pass for the pass before it on its
stage; an input from another stage also waits for the send between them. Interleaved chunk c
of stage s is global chunk c·p + s (Narayanan et al. 2021 §2.2.2), a V's second chunk
2p − 1 − s (Qi et al. 2024, ZB-V; ``Strategy.gci``). With every micro-batch alike 1F1B
takes (m + p − 1)·(f + b) on equal stages and interleaved 1F1B m·(f + b) + (p − 1)·(f + b)/v;
with micro-batches of unequal cost the slowest ones also stretch the warm-up and cool-down
and stall the stages between them (WLB-LLM, Wang et al. OSDI 2025, §3: pipeline bubbles from
uneven micro-batches).
"""

from __future__ import annotations

import numpy as np

from tracegen.schedule import stage_order
from tracegen.strategy import V_SCHEDULES

# Schedules walked in their own order (every schedule trainsim generates)
WALKED = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v", "dualpipe_v", "interleaved_zb")
ZERO_BUBBLE = ("zb_h1", "zb_v", "dualpipe_v", "interleaved_zb")


def walked_schedule(order_id: str) -> str:
    """The order the walk takes for a strategy's ``Strategy.order_id`` (combined 1F1B's
    merged passes walked as their plain order)."""
    name = order_id.partition("+")[0]
    return name if name.partition("/")[0] in WALKED else "1f1b"


def makespan(fwd: np.ndarray, bwd: np.ndarray, schedule: str = "1f1b", p: int = 0,
             sends: tuple[float, ...] = (), wgt: np.ndarray | None = None) -> np.ndarray:
    """The step: the last stage's end of ``stage_ends`` (same arguments), per draw."""
    last: np.ndarray = np.max(stage_ends(fwd, bwd, schedule, p, sends, wgt), axis=0)
    return last


def stage_ends(fwd: np.ndarray, bwd: np.ndarray, schedule: str = "1f1b", p: int = 0,
               sends: tuple[float, ...] = (), wgt: np.ndarray | None = None) -> np.ndarray:
    """When each stage ends its passes (shape (p, R)) with ``fwd`` and ``bwd`` (shape
    (G, m, R): global chunk, micro-batch, draw; in seconds), the stages running ``schedule``
    (a ``stage_order`` name; p stages of G/p chunks each, p = G unless given; under a
    zero-bubble schedule ``bwd`` is the B pass and ``wgt`` the W pass, of the same shape):
    every pass starts when its stage is free and its input is there — from another stage,
    after the send between them (``sends[s]``: between stage s and s + 1, wrapping; none if
    not given)."""
    g_count, m, r = fwd.shape
    p = p or g_count
    v = g_count // p
    zb = schedule in ZERO_BUBBLE
    if zb and wgt is None:
        raise ValueError(f"the {schedule} walk needs the W passes' times (wgt)")
    cost = {"F": fwd, "B": bwd, "W": bwd if wgt is None else wgt}
    end = {ph: np.full((g_count, m, r), np.nan) for ph in ("FBW" if zb else "FB")}
    orders = [stage_order(schedule, m=m, p=p, v=v, stage=s) for s in range(p)]
    hops = _Hops(p, g_count, schedule in V_SCHEDULES, sends)
    pos, clock = [0] * p, [np.zeros(r) for _ in range(p)]
    left = len(end) * g_count * m
    while left:
        moved = 0
        for s in range(p):
            while pos[s] < len(orders[s]):
                phase, j, c = orders[s][pos[s]]
                g = hops.gci(s, c)
                ready = _ready(end, phase, g, j, g_count, r)
                if ready is None:
                    break
                done = np.maximum(clock[s], ready + hops.cost(phase, g)) + cost[phase][g, j]
                end[phase][g, j] = done
                clock[s], pos[s] = done, pos[s] + 1
                moved += 1
        if not moved:  # (an order that deadlocks: not a schedule's)
            raise RuntimeError(f"the {schedule} order deadlocked")
        left -= moved
    return np.stack(clock)


class _Hops:
    """Where each global chunk runs and what its input's send costs."""

    def __init__(self, p: int, g_count: int, v_shape: bool, sends: tuple[float, ...]) -> None:
        self.p, self.g_count, self.v_shape, self.sends = p, g_count, v_shape, sends

    def gci(self, stage: int, chunk: int) -> int:
        """``Strategy.gci``: the global chunk a stage runs as its local ``chunk``."""
        return 2 * self.p - 1 - stage if self.v_shape and chunk else chunk * self.p + stage

    def stage(self, g: int) -> int:
        return 2 * self.p - 1 - g if self.v_shape and g >= self.p else g % self.p

    def cost(self, phase: str, g: int) -> float:
        """The send before pass ``phase`` of chunk ``g`` can start: 0 where its input is made on
        its own stage (the first forward, the last chunk's backward, a W, a V's turn)."""
        if not self.sends or self.p == 1 or phase == "W":
            return 0.0
        if (phase == "F" and g == 0) or (phase == "B" and g == self.g_count - 1):
            return 0.0
        src = self.stage(g - 1 if phase == "F" else g + 1)
        dst = self.stage(g)
        if src == dst:
            return 0.0
        if self.v_shape:  # (no wrap: the hop between neighbours s and s + 1)
            return self.sends[min(src, dst)]
        return self.sends[src if phase == "F" else dst]


def _ready(end: dict[str, np.ndarray], phase: str, g: int, j: int, g_count: int, r: int
           ) -> np.ndarray | None:
    """When pass ``phase`` of micro-batch ``j`` on global chunk ``g`` has its input (None:
    not yet)."""
    if phase == "F":
        if g == 0:
            return np.zeros(r)
        dep = end["F"][g - 1, j]
    elif phase == "W":
        dep = end["B"][g, j]
    else:
        dep = end["F"][g, j] if g == g_count - 1 else end["B"][g + 1, j]
    return None if np.isnan(dep[0]) else dep


def expected_max(draws: np.ndarray, k: int) -> float:
    """E[max of k independent draws from the empirical distribution of ``draws``]:
    Σᵢ v₍ᵢ₎·((i/R)^k − ((i − 1)/R)^k) over the sorted draws (exact for resampling them)."""
    v = np.sort(draws)
    r = len(v)
    i = np.arange(1, r + 1) / r
    return float(np.sum(v * (i**k - (i - 1 / r) ** k)))
