"""Degraded links between sites over a whole run: episodes in which the links joining a job's
sites (data centres, or buildings of one campus: ``[scaleout] site_gpus``) carry a fraction of
their bandwidth — a cut fibre among several, a failed wavelength or amplifier, traffic moved to
a longer protection path — for a while. Every GPU's traffic between sites shares those links,
so an episode slows every cross-site transfer at once, unlike a slow NIC (``analysis.
slow_links``), which slows one GPU's. A study's ``[site_links]`` table says how often, how long
and how slow:

::

    [site_links]
    rate_per_hour = 0.002        # episodes per hour on the links between the sites, together
    mean_duration_s = 7200       # durations exponential with this mean
    bandwidth_factor = 0.5       # the links carry this share of their bandwidth meanwhile
    latency_us = 600             # optional: the one-way latency meanwhile (a longer path);
                                 # absent: the system's site_latency_us

The step during an episode is the fast path's on the system with ``site_Gbps_per_gpu`` scaled
by the factor (and the latency replaced): the same cross-site groups and sends, slower — a
strategy whose groups stay inside a site loses nothing. The goodput kept is that of
``analysis.fail_slow`` with one source of episodes: the share of time with one in progress is
p = 1 − exp(−λ·E[D]) (M/G/∞, Poisson arrivals), and progress keeps 1 − p(1 − 1/f) of its
healthy rate (f: the step factor). Episodes are ridden out: the job does not restart for them.
On a ``[mixed]`` cluster the step is the mixed one (``fastpath.estimate_stages``), healthy and
degraded: the other generation's GPUs stand on the system's sites, by rank, unless their own
system file gives sites of its own, and an episode slows the links between the sites of both.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from analysis.fail_slow import check_keys
from analysis.fastpath import estimate, estimate_stages
from analysis.resilience import number
from analysis.slow_links import bandwidth_factor
from replay.hardware import SystemSpec
from tracegen import ConfigError, ModelSpec, Strategy

KEYS = {"rate_per_hour", "mean_duration_s", "bandwidth_factor", "latency_us"}
HOUR_S = 3600.0


@dataclasses.dataclass(frozen=True, slots=True)
class SiteLinkEpisodes:
    """A study's ``[site_links]``: episodes at ``rate_per_hour`` on the links between the
    sites, ``mean_duration_s`` long on average, ``bandwidth_factor`` of their bandwidth left and,
    where given, ``latency_us`` one way meanwhile."""

    rate_per_hour: float
    mean_duration_s: float
    bandwidth_factor: float
    latency_us: float | None = None

    def active_share(self) -> float:
        """The share of time with an episode in progress: 1 − exp(−λ·E[D])."""
        return -math.expm1(-self.rate_per_hour * self.mean_duration_s / HOUR_S)

    def progress(self, step_factor: float) -> float:
        """The share of the healthy progress rate kept: 1 − p(1 − 1/f)."""
        return 1 - self.active_share() * (1 - 1 / step_factor)


def site_links_from(spec: dict[str, Any]) -> SiteLinkEpisodes:
    """A study's ``[site_links]`` table, checked (every problem named in one error)."""
    check_keys(spec, "site_links", KEYS, optional="latency_us")
    rate = number("site_links", "rate_per_hour", spec["rate_per_hour"], positive=True)
    mean = number("site_links", "mean_duration_s", spec["mean_duration_s"], positive=True)
    factor = bandwidth_factor(spec, "site_links", "their healthy bandwidth the links between "
                              "the sites keep", "0.5: half; near 0 the sites are cut apart, "
                              "which a job across them cannot ride out")
    latency = spec.get("latency_us")
    if latency is not None:
        latency = number("site_links", "latency_us", latency, positive=True)
    return SiteLinkEpisodes(rate, mean, factor, latency)


def check_system(system: SystemSpec) -> None:
    """ConfigError unless ``system`` has several sites (there are no links between sites to
    degrade otherwise)."""
    if not system.scaleout.site_gpus:
        raise ConfigError(f"[site_links] needs a system of several sites: {system.name} has "
                          "none ([scaleout] site_gpus, site_Gbps_per_gpu, site_latency_us; "
                          "tests/data/two-sites-h100.toml is an example)", what="study")


def degraded(system: SystemSpec, ep: SiteLinkEpisodes) -> SystemSpec:
    """``system`` with the links between its sites as an episode leaves them."""
    out = system.scaleout
    slowed = dataclasses.replace(
        out, site_Gbps_per_gpu=out.site_Gbps_per_gpu * ep.bandwidth_factor,
        site_latency_us=out.site_latency_us if ep.latency_us is None else ep.latency_us)
    return dataclasses.replace(system, scaleout=slowed)


def step_factor(model: ModelSpec, s: Strategy, system: SystemSpec, ep: SiteLinkEpisodes,
                where: Mapping[int, SystemSpec] | None = None) -> float:
    """The fast path's step during an episode over its healthy step (1 exactly where no group
    or send crosses a site). ``where``: on a ``[mixed]`` cluster, the stages on the other
    system (``mixed.Placement.where``); they stand on ``system``'s sites unless their system
    has its own (``hardware.on_sites_of``), whose links the episode degrades too."""
    if not where:
        healthy = estimate(model, s, system).step_time_s
        return estimate(model, s, degraded(system, ep)).step_time_s / healthy
    healthy = estimate_stages(model, s, system, where).step_time_s
    slowed = {st: degraded(other, ep) if other.scaleout.site_gpus else other
              for st, other in where.items()}
    return estimate_stages(model, s, degraded(system, ep), slowed).step_time_s / healthy


def describe(row: dict[str, Any]) -> str:
    """What the episodes cost, in words, from a resilience row's ``site_links_*`` columns."""
    latency = row.get("site_links_latency_us")
    at = f", {latency:g} µs" if latency is not None else ""
    return (f"site links at {row['site_links_bandwidth_factor']:g} of their bandwidth{at} "
            f"stretch a step {row['site_links_step_factor']:.2f}×; episodes in progress "
            f"{row['site_links_active_share']:.1%} of the time: {row['site_links_loss']:.2%} of "
            "goodput, included above")
