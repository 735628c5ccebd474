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
stage j, from fast-path estimates, healthy and with every NIC at the factor: the all-slowed
estimate's three deltas — the stages' own time per micro-batch (context- and expert-parallel
traffic that leaves the node), the pipeline's sends, the tail after the last backward (the
data-parallel gradient reduction and parameter gathers) — each charged as far as one NIC
carries it:

* the stage's own time (context- or expert-parallel traffic across nodes) by the schedule
  walked with only stage j slowed (``fastpath.estimate_stages``);
* the sends by the hops the NIC serves: a stage sends to and receives from its neighbours, an
  end stage has one of them (an interleaved pipeline wraps: every stage two), of the p − 1
  hops (p when it wraps) that the all-slowed estimate slowed; a send is as slow as the slower
  end (replay's degraded network: a transfer moves at its slowest link's rate);
* the tail (step − pipeline) in two parts. The fast path books there what overlapping
  communication takes from every stage's compute (``dp_tails.tails_ns``: stage 0 waits for
  what each later stage lost), so a third and fourth estimate without that interference
  separate it: one slow stage adds its own share of the interference (by its parameters,
  the bytes its reductions move), and the drain — stage 0's, which ends last — in proportion
  to stage j's parameters (stage 0's embedding makes its drain the longer), less the slack
  of stage j: its data-parallel groups (each has one rank on the slow NIC: a ring moves at
  its slowest hop) start after its last backward, Σ_{k<j} b_k / v before stage 0's (the
  last backwards run from the last stage to the first, b_k stage k's backward of a
  micro-batch over its v chunks).

A slow NIC is as likely on every stage: the step factor is the mean over stages; the worst is
reported beside it. At pp 1 it is the all-slowed estimate's ratio (every group waits for the
slow ring). Replay with a ``[[link]]`` scenario on the stage is the reference (tests).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from analysis.fail_slow import FailSlow, episode_text, pipeline_bound_s
from analysis.fastpath import FastEstimate, estimate, estimate_stages
from analysis.resilience import number
from replay.hardware import SystemSpec
from replay.scenario import tiers_slowed
from tracegen import ConfigError, ModelSpec, Strategy
from tracegen.program import RoleProgram

KEYS = {"rate_per_gpu_hour", "mean_duration_s", "bandwidth_factor", "detect_s"}
MIN_FACTOR = 1e-3  # below a thousandth of its bandwidth a NIC has failed: a [failures] matter


def slow_links_from(spec: dict[str, Any]) -> FailSlow:
    """A study's ``[slow_links]`` table, checked (every problem named in one error), as the
    episodes of ``analysis.fail_slow`` whose slowdown is 1 / bandwidth_factor."""
    unknown = sorted(set(spec) - KEYS)
    missing = sorted({"rate_per_gpu_hour", "mean_duration_s", "bandwidth_factor"} - set(spec))
    if unknown or missing:
        raise ConfigError((["unknown keys " + ", ".join(unknown)] if unknown else [])
                          + (["missing " + ", ".join(missing)] if missing else [])
                          + [f"keys: {', '.join(sorted(KEYS))} (detect_s optional)"],
                          what="study [slow_links]")
    factor = number("slow_links", "bandwidth_factor", spec["bandwidth_factor"], positive=True)
    if not MIN_FACTOR <= factor <= 1:
        raise ConfigError(f"bandwidth_factor = {factor:g}: it is the share of its healthy "
                          f"bandwidth the slow NIC keeps, from {MIN_FACTOR:g} to 1 (0.25 is a "
                          "quarter; above 1 it would be faster, near 0 it has failed: a "
                          "[failures] matter)", what="study [slow_links]")
    detect = spec.get("detect_s")
    return FailSlow(number("slow_links", "rate_per_gpu_hour", spec["rate_per_gpu_hour"],
                           positive=True),
                    number("slow_links", "mean_duration_s", spec["mean_duration_s"],
                           positive=True), 1 / factor,
                    None if detect is None else number("slow_links", "detect_s", detect,
                                                       positive=True))


def stage_factors(model: ModelSpec, s: Strategy, system: SystemSpec, factor: float
                  ) -> list[float]:
    """Per pipeline stage: the step time with one slow NIC on that stage over the healthy
    step, both from the fast path (the composition in the module's docstring)."""
    healthy = estimate(model, s, system)
    slow = estimate(model, s, tiers_slowed(system, factor, 1.0))
    step = healthy.step_time_s
    if s.pp == 1:
        return [slow.step_time_s / step]
    m, v = s.num_microbatches, s.vpp
    t = [f + b for f, b in zip(healthy.stage_fwd_s, healthy.stage_bwd_s, strict=True)]
    t_slow = [f + b for f, b in zip(slow.stage_fwd_s, slow.stage_bwd_s, strict=True)]
    sends = max(0.0, slow.pipeline_s - healthy.pipeline_s
                - (pipeline_bound_s(t_slow, m, v) - pipeline_bound_s(t, m, v)))
    tail = _tail_s(slow) - _tail_s(healthy)
    # the drain alone: without interference, which the fast path books in the tail, each
    # stage's loss propagated to stage 0 (``dp_tails.tails_ns``) — one slow stage adds its own
    quiet = [estimate(model, s, _quiet(x)) for x in (system, tiers_slowed(system, factor, 1.0))]
    drain = max(0.0, min(tail, _tail_s(quiet[1]) - _tail_s(quiet[0])))
    interference = max(0.0, tail - drain)
    wraps = s.schedule == "interleaved_1f1b"
    hops = s.pp if wraps else s.pp - 1
    prog = RoleProgram(model, s, 0)
    params = [sum(prog.params_of_stage(j).values()) for j in range(s.pp)]
    out = []
    for j in range(s.pp):
        own = 2 if wraps or 0 < j < s.pp - 1 else 1
        slack = sum(healthy.stage_bwd_s[:j]) / v
        # the stage's own traffic (context, experts) across nodes: its schedule walked
        stage = 0.0 if t_slow[j] == t[j] else estimate_stages(
            model, s, system, {j: tiers_slowed(system, factor, 1.0)}).step_time_s - step
        extra = (stage + sends * own / hops + interference * params[j] / sum(params)
                 + max(0.0, drain * params[j] / params[0] - slack))
        out.append(1 + extra / step)
    return out


def _tail_s(e: FastEstimate) -> float:
    return e.step_time_s - e.pipeline_s


def _quiet(system: SystemSpec) -> SystemSpec:
    """``system`` without compute slowed by overlapping communication."""
    return dataclasses.replace(system, gpu=dataclasses.replace(system.gpu,
                                                               comm_interference=0.0))


def step_factors(model: ModelSpec, s: Strategy, system: SystemSpec, factor: float
                 ) -> tuple[float, float]:
    """(mean over stages — a slow NIC is as likely on each —, worst) of ``stage_factors``."""
    factors = stage_factors(model, s, system, factor)
    return sum(factors) / len(factors), max(factors)


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
