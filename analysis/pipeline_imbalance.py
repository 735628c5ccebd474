"""A 1F1B pipeline whose micro-batches cost unequally: the makespan as the longest path
through the schedule's dependencies, vectorized over many draws of the costs.

Megatron's non-interleaved 1F1B (Narayanan et al. 2021 §2.2.1; ``forward_backward_pipelining
_without_interleaving``): stage s of p runs min(p − s − 1, m) warm-up forwards, then one
forward and one backward in turn, then the remaining backwards. A forward of micro-batch j on
stage s waits for stage s − 1's forward of j, a backward for stage s + 1's backward of j (the
last stage's for its own forward), and each op for the op before it on its stage; sends are
left out. With every micro-batch alike the makespan is (m + p − 1)·(f + b) for equal stages;
with micro-batches of unequal cost the slowest ones also stretch the warm-up and cool-down
(WLB-LLM, Wang et al. OSDI 2025, §3: pipeline bubbles from uneven micro-batches).
"""

from __future__ import annotations

import numpy as np


def one_f_one_b_order(stage: int, p: int, m: int) -> list[tuple[bool, int]]:
    """Stage ``stage``'s ops in 1F1B order: (is forward, micro-batch)."""
    warm = min(p - stage - 1, m)
    order = [(True, j) for j in range(warm)]
    for i in range(m - warm):
        order += [(True, warm + i), (False, i)]
    return order + [(False, j) for j in range(m - warm, m)]


def makespan(fwd: np.ndarray, bwd: np.ndarray) -> np.ndarray:
    """The 1F1B step of ``fwd`` and ``bwd`` (shape (p, m, R): stage, micro-batch, draw; in
    seconds) for each of the R draws: every op starts when its stage is free and its input is
    there."""
    p, m, r = fwd.shape
    end_f = np.full((p, m, r), np.nan)
    end_b = np.full((p, m, r), np.nan)
    orders = [one_f_one_b_order(s, p, m) for s in range(p)]
    pos, clock = [0] * p, [np.zeros(r) for _ in range(p)]
    left = 2 * p * m
    while left:
        moved = 0
        for s in range(p):
            while pos[s] < len(orders[s]):
                forward, j = orders[s][pos[s]]
                ready = (np.zeros(r) if s == 0 else end_f[s - 1, j]) if forward else (
                    end_f[s, j] if s == p - 1 else end_b[s + 1, j])
                if np.isnan(ready[0]):
                    break
                done = np.maximum(clock[s], ready) + (fwd if forward else bwd)[s, j]
                (end_f if forward else end_b)[s, j] = done
                clock[s], pos[s] = done, pos[s] + 1
                moved += 1
        if not moved:  # (an order that deadlocks: not 1F1B's)
            raise RuntimeError("the 1F1B order deadlocked")
        left -= moved
    last: np.ndarray = np.max(np.stack(clock), axis=0)
    return last


def expected_max(draws: np.ndarray, k: int) -> float:
    """E[max of k independent draws from the empirical distribution of ``draws``]:
    Σᵢ v₍ᵢ₎·((i/R)^k − ((i − 1)/R)^k) over the sorted draws (exact for resampling them)."""
    v = np.sort(draws)
    r = len(v)
    i = np.arange(1, r + 1) / r
    return float(np.sum(v * (i**k - (i - 1 / r) ** k)))
