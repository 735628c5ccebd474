"""Slow links over a whole run: episodes in which one GPU's NIC runs at a fraction of its
bandwidth (a flapping or degraded cable or transceiver, a congested rail, a link retrained to a
lower rate). Wu et al. 2024 (Falcon, arXiv:2410.12588) list cross-node network degradation
among the causes of fail-slow episodes on a 10,000-GPU production cluster. A study's
``[slow_links]`` table says how often, how long and how slow:

::

    [slow_links]
    rate_per_gpu_hour = 1e-5     # episodes per GPU's NIC per hour (one NIC a GPU, rail-optimized)
    mean_duration_s = 1800       # durations exponential with this mean
    bandwidth_factor = 0.25      # the NIC moves this share of its healthy bandwidth
    detect_s = 600               # optional: its node is evicted after this long (a restart,
                                 # counted as a failure under each policy); absent: ridden out

The occupancy and goodput are those of ``analysis.fail_slow`` (M/G/∞ episodes, ``g = 1 −
p(1 − 1/f)``). The step with one slow NIC (DESIGN.md, "Slow links over a run"), per pipeline
stage j: the fast path with stage j costed on the system whose NICs keep the factor — its own
cross-node traffic (context- and expert-parallel groups that leave the node), its sends to and
from its neighbours (a send is as slow as its slower end: replay's degraded network moves a
transfer at its slowest link's rate), its gradient reduction, optimizer step and parameter
gathers (each of its data-parallel groups has one rank on the slow NIC: a ring moves at its
slowest hop) — and the schedule walked with that one stage so slowed
(``fastpath.estimate_stages``), the others healthy. A slow NIC is as likely on every stage: the
step factor is the mean over stages; the worst is reported beside it. At pp 1 it is the
all-slowed estimate's ratio. Replay with a ``[[link]]`` scenario on the stage is the
reference (``tests/test_slow_links.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from analysis.fail_slow import (
    FailSlow,
    check_keys,
    episode_text,
    episodes,
    mean_and_worst,
    stage_factors_on,
)
from analysis.resilience import number
from replay.hardware import SystemSpec
from replay.scenario import tiers_slowed
from tracegen import ConfigError, ModelSpec, Strategy

KEYS = {"rate_per_gpu_hour", "mean_duration_s", "bandwidth_factor", "detect_s"}
MIN_FACTOR = 1e-3  # below a thousandth of its bandwidth a NIC has failed: a [failures] matter


def slow_links_from(spec: dict[str, Any]) -> FailSlow:
    """A study's ``[slow_links]`` table, checked (every problem named in one error), as the
    episodes of ``analysis.fail_slow`` whose slowdown is 1 / bandwidth_factor."""
    check_keys(spec, "slow_links", KEYS)
    factor = bandwidth_factor(spec, "slow_links", "its healthy bandwidth the slow NIC keeps",
                              "0.25 is a quarter; above 1 it would be faster, near 0 it has "
                              "failed: a [failures] matter")
    return episodes(spec, "slow_links", 1 / factor)


def bandwidth_factor(spec: dict[str, Any], table: str, keeps: str, hint: str) -> float:
    """A table's ``bandwidth_factor``, from ``MIN_FACTOR`` to 1, or a ConfigError saying it is
    the share of ``keeps`` (``hint``: what values mean)."""
    factor = number(table, "bandwidth_factor", spec["bandwidth_factor"], positive=True)
    if not MIN_FACTOR <= factor <= 1:
        raise ConfigError(f"bandwidth_factor = {factor:g}: it is the share of {keeps}, from "
                          f"{MIN_FACTOR:g} to 1 ({hint})", what=f"study [{table}]")
    return factor


def stage_factors(model: ModelSpec, s: Strategy, system: SystemSpec, factor: float,
                  placed: Mapping[int, SystemSpec] | None = None) -> list[float]:
    """Per pipeline stage: the step time with one slow NIC on that stage over the healthy
    step, both from the fast path: the stage spliced in from the system with every NIC at
    ``factor`` (its own cross-node traffic, its sends, its gradient reduction and gathers
    there) and the schedule walked (``fastpath.estimate_stages``). At pp 1 the slowed system's
    estimate itself (every group waits for the slow ring). ``placed``: stages on another
    system (a ``[mixed]`` cluster), each with its own NICs slowed."""
    return stage_factors_on(model, s, system, lambda x: tiers_slowed(x, factor, 1.0), placed)


def step_factors(model: ModelSpec, s: Strategy, system: SystemSpec, factor: float,
                 placed: Mapping[int, SystemSpec] | None = None,
                 weights: list[float] | None = None) -> tuple[float, float]:
    """(mean over stages — a slow NIC is as likely on each, or as ``weights`` say —, worst)
    of ``stage_factors``."""
    return mean_and_worst(stage_factors(model, s, system, factor, placed), weights)


def describe(row: dict[str, Any]) -> str:
    """What the episodes cost, in words, from a resilience row's ``slow_links_*`` columns (the
    CLI's line under each strategy's table and the report's under its policies)."""
    if row["slow_links_worst_step_factor"] <= 1:  # nothing crosses a NIC (one node)
        line = "slow links: none of this strategy's traffic crosses a NIC: a slow one costs nothing"
        if row.get("slow_links_detect_s") is not None:
            line += (f", but {row['slow_links_evicted_share']:.0%} of episodes outlast "
                     f"{row['slow_links_detect_s']:g} s and are evicted (counted among the "
                     "failures)")
        return line
    return episode_text(row, "slow_links", f"slow links: one NIC at "
                        f"{row['slow_links_bandwidth_factor']:.0%} of its bandwidth",
                        "on the worst stage")
