"""The replay entry point: a trace set + a system → ReplayResult."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from replay.compute import ComputeSource, RooflineCompute
from replay.hardware import SystemSpec, on_sites_of, resolve_system
from replay.network import AlphaBetaNetwork, NetworkModel
from replay.results import (
    ReplayResult,
    breakdown_frame,
    expand_folded,
    stage_need_GiB,
    step_metrics,
    timeline_frame,
    waits_frame,
)
from replay.scenario import (
    DegradedNetwork,
    MixedNetwork,
    Scenario,
    compute_for,
    load_scenario,
)
from replay.sim import Simulator
from replay.traceset import TraceSet, load_trace_set
from tracegen.gcpause import gc_paused
from tracegen.memory import host_peak_bytes
from tracegen.strategy import Strategy


@gc_paused
def replay(trace: str | Path | TraceSet, system: str | Path | SystemSpec, *,
           comm_groups: str | Path | None = None, compute: ComputeSource = "model",
           astra_compat: bool = False, fold: bool = True, contention: bool = True,
           scenario: str | Path | Scenario | None = None,
           progress: Callable[[int, int], None] | None = None) -> ReplayResult:
    """Simulate one step of a trace set on ``system`` (a preset name, TOML file or SystemSpec),
    optionally perturbed by a scenario (stragglers, degraded links, heterogeneous GPUs)."""
    ts = trace if isinstance(trace, TraceSet) else load_trace_set(
        trace, comm_groups=comm_groups, fold=fold and not astra_compat and scenario is None)
    sys_spec = system if isinstance(system, SystemSpec) else resolve_system(system)
    model = RooflineCompute(sys_spec.gpu, compute)
    stage = _stage_gpus(ts)
    net: NetworkModel = AlphaBetaNetwork(sys_spec, astra_compat=astra_compat, stage_gpus=stage)
    scen = _scenario(scenario, ts, sys_spec)
    overrides = compute_for(scen, compute) if scen else {}
    mix = _gpu_mix(ts, sys_spec, scen)
    if any(spec != sys_spec for spec, _ in mix.values()):  # their nodes' own links
        nets = {key: AlphaBetaNetwork(spec, astra_compat=astra_compat,  # one per system
                                      stage_gpus=stage)
                for key, (spec, _) in mix.items() if spec != sys_spec}
        net = MixedNetwork(net, {r: nets[key] for key, (spec, ranks) in mix.items()
                                 if spec != sys_spec for r in ranks})
    if scen and scen.links:
        net = DegradedNetwork(net, scen.links)
    sim = Simulator(ts, model, net, astra_compat=astra_compat, contention=contention,
                    slowdown=scen.slowdown if scen and scen.episodes else None,
                    compute_overrides=overrides, progress=progress,
                    interference=_interference(sys_spec, scen),
                    host_Bps=_host_rates(mix, sys_spec, "host_link_GBps"),
                    host_cpu_Bps=_host_rates(mix, sys_spec, "host_cpu_GBps"))
    end_ns = sim.run()
    timeline = timeline_frame(sim, ts)
    metrics = step_metrics(ts, timeline, end_ns, _mean_peak(mix, sys_spec, _dtype(ts)),
                           sys_spec.gpu)
    metrics["system"] = sys_spec.name
    if "peak_memory_GiB" in metrics:  # flagged wherever a strategy appears (DESIGN.md, Memory)
        metrics["fits"] = metrics["peak_memory_GiB"] <= sys_spec.gpu.hbm_GiB
        if scen and scen.gpus:
            _fit_per_gpu(metrics, ts, mix, sys_spec)
        _fit_host(metrics, ts, sys_spec)
    metrics["folded"] = ts.folded
    metrics["group_axes"] = dict(ts.group_axis)
    breakdown = breakdown_frame(timeline, metrics["step_time_s"], sim.interference_ns)
    if ts.folded:
        breakdown = expand_folded(breakdown, ts)
    faults = tuple(scen.perfetto_events(end_ns)) if scen else ()
    if scen:
        metrics["scenario"] = scen.name
    return ReplayResult(timeline, breakdown, metrics, waits_frame(sim), faults)


def _host_rates(mix: dict[str, tuple[SystemSpec, list[int]]], sys_spec: SystemSpec,
                field: str) -> Callable[[int], float]:
    """Each rank's host rate ``field`` of its GPU's system's node in bytes/s: its host link,
    each way (``host_link_GBps``), or what its CPU ops move of host memory (``host_cpu_GBps``)."""
    rate = {r: getattr(spec.node, field) * 1e9 for spec, ranks in mix.values() for r in ranks}
    default = getattr(sys_spec.node, field) * 1e9
    return lambda rank: rate.get(rank, default)


def _scenario(scenario: str | Path | Scenario | None, ts: TraceSet, sys_spec: SystemSpec
              ) -> Scenario | None:
    if scenario is None or isinstance(scenario, Scenario):
        return scenario
    # a scenario's nodes are hosts (a server; GB200's 4-GPU compute tray, not its rack)
    return load_scenario(scenario, world_size=ts.world_size,
                         gpus_per_node=sys_spec.node.host_gpus,
                         simulated={r.rank for r in ts.ranks}, stands_for=_stands_for(ts))


def _stands_for(ts: TraceSet) -> dict[int, tuple[int, ...]] | None:
    """In a representative-mode set, each simulated rank → the ranks of its pipeline stage
    (the manifest's coordinates), which it stands for; None where every rank is simulated."""
    if not ts.representative or ts.manifest is None:
        return None
    stage = _stage_of(ts.manifest)
    by_stage: dict[int, list[int]] = {}
    for rank, pp in stage.items():
        by_stage.setdefault(pp, []).append(rank)
    return {r.rank: tuple(sorted(by_stage[stage[r.rank]])) for r in ts.ranks}


def _stage_gpus(ts: TraceSet) -> int:
    """The GPUs of a pipeline stage (they send across a site boundary at once), from the
    manifest's coordinates; 0 for a trace set without one (a foreign set)."""
    if ts.manifest is None or "coords" not in ts.manifest:
        return 0
    return sum(1 for pp in _stage_of(ts.manifest).values() if pp == 0)


def _stage_of(manifest: dict[str, Any]) -> dict[int, int]:
    """Every rank's pipeline stage, from the manifest's coordinates."""
    order = manifest["coords_order"]
    rank_at, pp_at = order.index("rank"), order.index("pp")
    return {c[rank_at]: c[pp_at] for c in manifest["coords"]}


def _gpu_mix(ts: TraceSet, sys_spec: SystemSpec, scen: Scenario | None
             ) -> dict[str, tuple[SystemSpec, list[int]]]:
    """The cluster's GPU types: system name → (its spec, on ``sys_spec``'s sites where it has
    none of its own; every rank on it), a representative counted as every rank of its stage;
    the rest of the world is on ``sys_spec``."""
    if not scen or not scen.gpus:
        return {}
    stands = _stands_for(ts) or {}
    mix: dict[str, tuple[SystemSpec, list[int]]] = {}
    moved: set[int] = set()
    for rank, name in scen.gpus:
        if name not in mix:
            mix[name] = (on_sites_of(resolve_system(name), sys_spec), [])
        ranks = stands.get(rank, (rank,))
        mix[name][1].extend(ranks)
        moved.update(ranks)
    rest = [r for r in range(ts.world_size) if r not in moved]
    if rest:
        mix.setdefault(sys_spec.name, (sys_spec, []))[1].extend(rest)
    return mix


def _mean_peak(mix: dict[str, tuple[SystemSpec, list[int]]], sys_spec: SystemSpec,
               dtype: str) -> float:
    """MFU's peak per GPU: on a mixed cluster the mean of its GPUs' peaks, so that MFU is the
    model FLOPs over what the whole cluster could do (Chowdhery et al. 2022's definition)."""
    if not mix:
        return sys_spec.gpu.peak_flop_per_s(dtype)
    total = sum(spec.gpu.peak_flop_per_s(dtype) * len(ranks) for spec, ranks in mix.values())
    return total / sum(len(ranks) for _, ranks in mix.values())


def _fit_per_gpu(metrics: dict[str, Any], ts: TraceSet,
                 mix: dict[str, tuple[SystemSpec, list[int]]], sys_spec: SystemSpec) -> None:
    """A mixed cluster fits when every rank's stage fits in its own GPU's memory: ``short``
    lists each GPU type whose ranks do not (system, GiB it has, GiB needed, how many ranks)."""
    man = ts.manifest
    if man is None:
        return
    stage_of = _stage_of(man)
    short = []
    for name, (spec, ranks) in mix.items():
        need = {int(s["stage"]): stage_need_GiB(s, spec.gpu) for s in man["stages"]}
        over = [r for r in ranks if need[stage_of[r]] > spec.gpu.hbm_GiB]
        if over:
            short.append({"system": name, "hbm_GiB": spec.gpu.hbm_GiB, "ranks": len(over),
                          "need_GiB": max(need[stage_of[r]] for r in over)})
    metrics["fits"] = not short
    metrics["memory_short"] = short
    metrics["gpu_mix"] = {name: len(ranks) for name, (_, ranks) in mix.items()}


def _fit_host(metrics: dict[str, Any], ts: TraceSet, sys_spec: SystemSpec) -> None:
    """With offloading (the manifest's ``host_GiB`` a stage's rank): ``peak_host_memory_GiB``,
    what one host's GPUs keep in its memory together, and no fit where that is more than the
    host has (``host_memory_GiB``; not checked where the system does not say)."""
    man = ts.manifest
    if man is None:
        return
    per_stage = {int(st["stage"]): float(st["memory"].get("host_GiB", 0.0))
                 for st in man["stages"]}
    if not any(per_stage.values()):
        return
    s = Strategy.from_dict(man["strategy"])
    need = host_peak_bytes([per_stage[k] for k in range(s.pp)], s, sys_spec.node.host_gpus)
    metrics["peak_host_memory_GiB"] = need
    if sys_spec.node.host_memory_GiB and need > sys_spec.node.host_memory_GiB:
        metrics["fits"] = False


def _interference(sys_spec: SystemSpec, scen: Scenario | None) -> Callable[[int], float]:
    """κ per rank: its GPU's ``comm_interference`` (a scenario may put a rank on another GPU)."""
    base = sys_spec.gpu.comm_interference
    by_name: dict[str, float] = {}
    other: dict[int, float] = {}
    for rank, name in scen.gpus if scen else ():
        if name not in by_name:  # a scenario may put hundreds of ranks on one other system
            by_name[name] = resolve_system(name).gpu.comm_interference
        other[rank] = by_name[name]
    return lambda rank: other.get(rank, base)


def _dtype(ts: TraceSet) -> str:
    if ts.manifest is None:
        return "bf16"
    return str(ts.manifest["strategy"].get("precision", "bf16"))
