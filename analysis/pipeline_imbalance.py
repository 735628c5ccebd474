"""A pipeline whose micro-batches cost unequally: the step as the longest path through the
schedule's dependencies, vectorized over many draws of the costs.

Each stage runs its passes in its schedule's order (``tracegen.schedule.stage_order``: GPipe,
1F1B, interleaved 1F1B with its micro-batch groups). A forward of micro-batch j on global
model chunk g waits for chunk g − 1's forward of j, a backward for chunk g + 1's backward of
j (the last chunk's for its own forward), and each pass for the pass before it on its stage;
sends are left out. Interleaved chunk c of stage s is global chunk c·p + s (Narayanan et al.
2021 §2.2.2). With every micro-batch alike 1F1B takes (m + p − 1)·(f + b) on equal stages and
interleaved 1F1B m·(f + b) + (p − 1)·(f + b)/v; with micro-batches of unequal cost the
slowest ones also stretch the warm-up and cool-down and stall the stages between them
(WLB-LLM, Wang et al. OSDI 2025, §3: pipeline bubbles from uneven micro-batches).
Zero-bubble schedules (their W passes) are walked as 1F1B (``walked_schedule``).
"""

from __future__ import annotations

import numpy as np

from tracegen.schedule import stage_order

# Schedules walked in their own order; the others (ZB-H1, ZB-V) as 1F1B with their chunks
WALKED = ("gpipe", "1f1b", "interleaved_1f1b")


def walked_schedule(order_id: str) -> str:
    """The order the walk takes for a strategy's ``Strategy.order_id`` (combined 1F1B's
    merged passes walked as their plain order)."""
    name = order_id.partition("+")[0]
    return name if name.partition("/")[0] in WALKED else "1f1b"


def makespan(fwd: np.ndarray, bwd: np.ndarray, schedule: str = "1f1b", p: int = 0,
             sends: tuple[float, ...] = ()) -> np.ndarray:
    """The step of ``fwd`` and ``bwd`` (shape (G, m, R): global chunk, micro-batch, draw; in
    seconds) for each of the R draws, the stages running ``schedule`` (a ``stage_order``
    name; p stages of G/p chunks each, p = G unless given): every pass starts when its stage
    is free and its input is there — from another stage, after the send between them
    (``sends[s]``: between stage s and s + 1, wrapping; none if not given)."""
    g_count, m, r = fwd.shape
    p = p or g_count
    v = g_count // p
    end = {"F": np.full((g_count, m, r), np.nan), "B": np.full((g_count, m, r), np.nan)}
    orders = [stage_order(schedule, m=m, p=p, v=v, stage=s) for s in range(p)]
    pos, clock = [0] * p, [np.zeros(r) for _ in range(p)]
    left = 2 * g_count * m
    while left:
        moved = 0
        for s in range(p):
            while pos[s] < len(orders[s]):
                phase, j, c = orders[s][pos[s]]
                g = c * p + s
                ready = _ready(end, phase, g, j, g_count, r)
                if ready is None:
                    break
                if sends and p > 1 and not (phase == "F" and g == 0) and not (
                        phase == "B" and g == g_count - 1):  # (its input crossed a hop)
                    ready = ready + sends[(g - 1) % p if phase == "F" else g % p]
                done = np.maximum(clock[s], ready) + (fwd if phase == "F" else bwd)[g, j]
                end[phase][g, j] = done
                clock[s], pos[s] = done, pos[s] + 1
                moved += 1
        if not moved:  # (an order that deadlocks: not a schedule's)
            raise RuntimeError(f"the {schedule} order deadlocked")
        left -= moved
    last: np.ndarray = np.max(np.stack(clock), axis=0)
    return last


def _ready(end: dict[str, np.ndarray], phase: str, g: int, j: int, g_count: int, r: int
           ) -> np.ndarray | None:
    """When pass ``phase`` of micro-batch ``j`` on global chunk ``g`` has its input (None:
    not yet)."""
    if phase == "F":
        if g == 0:
            return np.zeros(r)
        dep = end["F"][g - 1, j]
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
