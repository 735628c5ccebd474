"""Identical GPUs are not equally fast: what a fleet's spread of per-GPU speed costs a step.

A synchronous step waits for its slowest member at every level: a tensor- or context-
parallel group runs each layer at its slowest GPU, so a pipeline stage of a replica runs at
the slowest of its tp·cp GPUs; the replica's schedule is walked with each stage so slowed
(``pipeline_imbalance.makespan`` over the fast path's chunk times, ``fastpath.chunk_times_s``);
and every replica waits for the slowest at the gradient reduction: the expected largest of dp
walks (their order statistics, or a normal fit past the draws, as ``data_stragglers`` takes
it). A GPU's compute time is 1 + sd·Z times the catalog's (Z standard normal, floored at half
the time), fixed over the run (manufacturing spread and power management: Sinha et al. 2022,
SC22, measured 8% average variation — at most 22% — across same-SKU V100 and MI60 GPUs of four
HPC clusters). No default: the spread is a fleet's own (a burn-in GEMM sweep over its GPUs
measures it), stated as ``[gpu_spread] sd`` in a study or ``estimate --gpu-spread``.

Only a pass's compute share is slowed (``ChunkTimes.busy_f``/``busy_b``: a slow GPU computes
slowly, its links run at their speed), and each stage's optimizer step runs after its last pass
at its factor. Left out: the gradient reduction between the last pass and the optimizer (the
same with and without the spread).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from analysis.data_stragglers import MIN_REPLICA_DRAWS, REPLICA_DRAWS, WALK_CELLS
from analysis.fastpath import ChunkTimes
from replay.hardware import SystemSpec
from tracegen import ModelSpec, Strategy
from tracegen.errors import ConfigError

FLOOR = 0.5  # a GPU's time factor is at least this (the normal's far left tail cut)
MAX_SD = 0.5


@dataclasses.dataclass(frozen=True, slots=True)
class SpreadWait:
    """What a spread of per-GPU speed costs a step."""

    sd: float  # the relative standard deviation of a GPU's compute time
    gpus: int  # the GPUs whose slowest decides (all of the job's)
    wait_s: float  # the expected step beyond the one of equal GPUs
    replica_s: float  # of which a replica's own slowest stages (one replica's mean)


def check_sd(sd: object, what: str = "gpu_spread") -> float:
    """``sd`` as a float, or a ConfigError that says what it is and its range."""
    if isinstance(sd, int | float) and not isinstance(sd, bool) and 0 <= sd <= MAX_SD:
        return float(sd)
    raise ConfigError(f"sd is a GPU's compute time's relative standard deviation across the "
                      f"fleet, from 0 to {MAX_SD} (0.03: 3%), got {sd!r}", what=what)


def spread_wait(model: ModelSpec, s: Strategy, system: SystemSpec, sd: float,
                seed: int = 2) -> SpreadWait:
    """The expected step beyond equal GPUs' when each GPU's compute takes 1 + sd·Z times the
    catalog's (module docstring)."""
    sd = check_sd(sd)
    if sd == 0:
        return SpreadWait(sd, s.world_size, 0.0, 0.0)
    draws = max(MIN_REPLICA_DRAWS, min(REPLICA_DRAWS, WALK_CELLS // (s.pp * s.vpp
                                                                      * s.num_microbatches)))
    rng = np.random.default_rng(seed)
    group = s.tp * s.cp  # (a stage's GPUs in one replica; experts' ranks are among them)
    factors = np.maximum(FLOOR, 1 + sd * rng.standard_normal((draws, s.pp, group))).max(axis=2)
    steps, alike = replica_steps_s(model, s, system, factors)
    return SpreadWait(sd, s.world_size, _slowest(steps, s.dp) - alike, float(steps.mean()) - alike)


def replica_steps_s(model: ModelSpec, s: Strategy, system: SystemSpec, factors: np.ndarray
                    ) -> tuple[np.ndarray, float]:
    """A replica's pipeline walked with each stage's compute ``factors`` times the catalog's
    (shape (draws, pp)), one step a draw, and the walk with every factor 1."""
    from analysis.fastpath import chunk_times_s
    from analysis.pipeline_imbalance import walked_schedule

    times = chunk_times_s(model, s, system)
    chunks, m = s.pp * s.vpp, s.num_microbatches
    stage = np.array([s.chunk_stage(g) for g in range(chunks)])
    per_stage = np.asarray(factors, dtype=float).T  # (stage, draw)
    order = walked_schedule(s.order_id)
    alike = float(_walk(times, np.ones((chunks, 1, 1)), np.ones((s.pp, 1)), order, s.pp, m)[0])
    return _walk(times, per_stage[stage][:, None, :], per_stage, order, s.pp, m), alike


def _walk(times: ChunkTimes, scale: np.ndarray, stage_scale: np.ndarray, order: str, p: int,
          m: int) -> np.ndarray:
    """Each draw's replica step: the chunks' passes scaled by their stages' factors, and each
    stage's optimizer step after its last (``stage_scale``: (p, draws))."""
    from analysis.pipeline_imbalance import stage_ends

    shape = (len(times.fwd), m, scale.shape[2])

    def scaled(x: tuple[float, ...], compute: tuple[float, ...]) -> np.ndarray:
        """Each chunk's pass with its compute share slowed, its communication not."""
        share = np.array(compute)[:, None, None] if compute else 1.0
        return np.broadcast_to(np.array(x)[:, None, None] * (1 + share * (scale - 1)), shape)

    ends = stage_ends(scaled(times.fwd, times.busy_f), scaled(times.bwd, times.busy_b), order,
                      p, times.sends, scaled(times.wgt, ()) if times.wgt else None)
    last: np.ndarray = np.max(ends + np.array(times.opt)[:, None] * stage_scale, axis=0)
    return last


def _slowest(steps: np.ndarray, replicas: int) -> float:
    """The expected largest of ``replicas`` replica steps (``data_stragglers``' estimator)."""
    from analysis.data_stragglers import expected_max_normal
    from analysis.pipeline_imbalance import expected_max

    if replicas <= 1:
        return float(steps.mean())
    if replicas <= len(steps):
        return expected_max(steps, replicas)
    return float(steps.mean()) + float(steps.std(ddof=1)) * expected_max_normal(replicas)


def describe(row: dict[str, Any]) -> str:
    """What the spread costs, in words, from a resilience row's ``gpu_spread_*`` columns."""
    return (f"GPUs {row['gpu_spread_sd']:.1%} apart in speed (1 sd): each step waits "
            f"{row['gpu_spread_wait_s']:.3g} s on average for its slowest GPUs: "
            f"{row['gpu_spread_loss']:.2%} of goodput, included above")
