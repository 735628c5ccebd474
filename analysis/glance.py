"""One strategy at a glance, without traces: the fast path's step time with tokens/s, MFU and HFU,
how much of the pipeline the busiest stage sits idle, and each stage's forward / backward time
per micro-batch and memory breakdown. What ``trainsim estimate`` prints; in milliseconds where
generating and replaying the trace set takes seconds to minutes.

The pipeline's idle share is ``1 − m·(F + B) / T_pipeline`` of the busiest stage (m micro-batches,
F and B its forward and backward of one, every chunk): for p alike stages under 1F1B with free
sends it is the bubble fraction (p − 1)/(m + p − 1) (Narayanan et al. 2021 §2.2.1); exposed
sends and uneven stages add to it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from analysis.fastpath import FastEstimate, estimate, resolve_specs
from analysis.shard_hint import NEAR as INSTANCES_NEAR
from analysis.shard_hint import shard_hint, shard_hint_words
from replay import display
from replay.hardware import SystemSpec
from tracegen import memory
from tracegen.errors import ConfigError
from tracegen.flops import step_rates
from tracegen.model import ModelSpec
from tracegen.program import RoleProgram
from tracegen.strategy import Strategy
from tracegen.units import GiB

# a candidate strategy's fast-path estimate (``fast_cost``: on one system; a mixed cluster's
# places it first, ``mixed.study_fit_hints``)
Cost = Callable[[Strategy], FastEstimate]


def fast_cost(model: ModelSpec, system: SystemSpec) -> Cost:
    return lambda c: estimate(model, c, system)


@dataclasses.dataclass(frozen=True, slots=True)
class StageGlance:
    stage: int
    fwd_s: float  # one micro-batch, every chunk of the stage
    bwd_s: float  # with recomputation
    memory: memory.MemoryEstimate
    layers: int = 0  # transformer layers the stage holds, every chunk of it
    mtp_layers: int = 0  # multi-token-prediction modules it runs (``Strategy.mtp_chunk``)


@dataclasses.dataclass(frozen=True, slots=True)
class Glance:
    model: str
    strategy: str
    system: str
    step_time_s: float
    pipeline_s: float
    pipeline_idle: float  # share of the pipeline the busiest stage waits (bubble, sends)
    tokens_per_s: float
    mfu: float
    hfu: float
    peak_memory_GiB: float
    capacity_GiB: float
    fits: bool
    stages: tuple[StageGlance, ...]
    # how much longer the step is for compute slowed beside collectives in flight (the same
    # strategy with the GPU's ``comm_interference`` set to 0; 0 where it is 0 already)
    interference_s: float = 0.0
    # where it does not fit: the least recomputation that fits (``fit_by_recompute``)
    fit_hint: dict[str, Any] | None = None
    # where it fits and several distributed-optimizer instances would make the step at least
    # ``INSTANCES_GAIN`` shorter: the fastest such count that fits (``instances_hint``)
    instances_hint: dict[str, Any] | None = None
    # where it does not fit: the sharding that fits (``analysis.shard_hint``), with the
    # recomputation it needs where neither alone fits
    shard_hint: dict[str, Any] | None = None
    # ZB-H1 or ZB-V that does not fit: what its W passes' alternatives need (``zb_hint``)
    zb_hint: dict[str, dict[str, Any]] | None = None
    # with offloading: what one host's GPUs keep in its memory together
    # (``memory.host_peak_bytes``; None without offloading) and what it has (0: the system
    # does not say)
    peak_host_memory_GiB: float | None = None
    host_capacity_GiB: float = 0.0

    def __repr__(self) -> str:
        return display.one_line("Glance", f"{self.model} {self.strategy} on {self.system}",
                                self.to_dict()) + " (.to_dict() for the stages and hints)"

    def _repr_html_(self) -> str:
        stages = "".join(
            f"<tr><td>{st.stage}</td><td>{st.layers}</td><td>{st.fwd_s * 1e3:.2f}</td>"
            f"<td>{st.bwd_s * 1e3:.2f}</td><td>{st.memory.total_bytes / GiB:.1f}</td></tr>"
            for st in self.stages)
        return display.html_table(
            f"{self.model} {self.strategy} on {self.system} (fast path)",
            display.figures(self.to_dict()),
            "<table><tr><th>stage</th><th>layers</th><th>fwd ms</th><th>bwd ms</th>"
            f"<th>memory GiB</th></tr>{stages}</table>")

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "stages"}
        out["stages"] = [{"stage": st.stage, "layers": st.layers, "mtp_layers": st.mtp_layers,
                          "fwd_s": st.fwd_s, "bwd_s": st.bwd_s, **st.memory.to_dict()}
                         for st in self.stages]
        return out


def strategy_rates(model: ModelSpec, s: Strategy, system: SystemSpec, step_s: float
                   ) -> dict[str, float]:
    """Tokens/s, MFU and HFU of a step of ``step_s`` seconds of ``s`` on ``system``."""
    return step_rates(model, s.global_batch_size, s.recompute, step_s=step_s, gpus=s.world_size,
                      recomputed_layers=s.recomputed_layers(model.num_layers),
                      peak_flop_per_s=system.gpu.peak_flop_per_s(s.precision),
                      modules=s.selective_modules)


def glance(model: ModelSpec | str, strategy: Strategy, system: SystemSpec | str) -> Glance:
    """The fast-path estimate of one strategy with its per-stage breakdown. ``model`` and
    ``system``: specs, or preset names / files as the CLI takes them."""
    model, system = resolve_specs(model, system)
    est = estimate(model, strategy, system)
    s = strategy
    rates = strategy_rates(model, s, system, est.step_time_s)
    lost = 0.0
    if system.gpu.comm_interference:
        free = dataclasses.replace(system, gpu=dataclasses.replace(system.gpu,
                                                                  comm_interference=0.0))
        lost = est.step_time_s - estimate(model, s, free).step_time_s
    recompute, shard = (None, None) if est.fits else fit_hints(model, s, system)
    stages = stage_glances(model, s, system, est)
    host = memory.host_peak_bytes([st.memory.host_bytes for st in stages], s, system.node.host_gpus)
    return Glance(model.name, s.label(), system.name, est.step_time_s, est.pipeline_s,
                  _idle(est, s.num_microbatches), rates["tokens_per_s"], rates["mfu"],
                  rates["hfu"], est.peak_memory_GiB, system.gpu.hbm_bytes / GiB, est.fits,
                  stages, lost, recompute,
                  instances_hint(model, s, system, est.step_time_s) if est.fits else None,
                  shard, zb_hint(model, s, system) if not est.fits else None,
                  peak_host_memory_GiB=host / GiB if host else None,
                  host_capacity_GiB=system.node.host_memory_GiB)


def zb_hint(model: ModelSpec, s: Strategy, system: SystemSpec
            ) -> dict[str, dict[str, Any]] | None:
    """For a ZB-H1 or ZB-V strategy: the step and memory of the same strategy with its W
    passes gathering their inputs again ("zb_w_regather", where SP runs and it does not
    already) and under 1F1B ("1f1b", one chunk a stage) — the deferred W passes' operands are
    what the zero-bubble schedules add to memory (DESIGN.md, "Zero-bubble ZB-H1"). None for
    other schedules."""
    if not s.split_w:
        return None
    # (DualPipe-V's merged pairs have no 1F1B counterpart on a pipeline: dropped there)
    alternatives = {"1f1b": dataclasses.replace(s, schedule="1f1b", vpp=1, zb_w_regather=False,
                                                overlap_moe_ep_comm=False)}
    if s.sequence_parallel and not s.zb_w_regather:
        alternatives = {"zb_w_regather": dataclasses.replace(s, zb_w_regather=True),
                        **alternatives}
    out = {}
    for name, alt in alternatives.items():
        est = estimate(model, alt, system)
        out[name] = {"step_time_s": est.step_time_s, "peak_memory_GiB": est.peak_memory_GiB,
                     "fits": est.fits}
    return out


# the least share of a step several optimizer instances must save to be suggested
INSTANCES_GAIN = 0.02
# (``INSTANCES_NEAR``: how much slower than the fastest count a suggested one may be where it
# needs less memory; the shard hint's ``NEAR``)


def instances_hint(model: ModelSpec, s: Strategy, system: SystemSpec, step_s: float
                   ) -> dict[str, Any] | None:
    """For a ZeRO ≥ 1 strategy (a MoE model's HFSDP refused): the number of distributed-optimizer
    instances (``Strategy.dist_opt_instances``, ZeRO-3's HSDP replicas; every divisor of dp·cp
    that the layout takes tried with the fast path) to suggest where the fastest that fits is
    at least ``INSTANCES_GAIN`` shorter than ``step_s`` — a long data-parallel ring whose
    latency the reduce-scatters expose: of the counts within ``INSTANCES_NEAR`` of that
    fastest step, the one that needs the least memory (more instances shard less; a step 0.5%
    shorter is not worth a GPU run at the edge of its memory). None otherwise."""
    ranks = s.dp * s.cp
    if not s.zero_stage or (model.is_moe and s.hfsdp):
        return None
    fitting: list[tuple[float, int, FastEstimate]] = []
    for r in range(2 if s.hfsdp else 1, ranks + 1):  # (HFSDP needs several: kept as asked)
        if ranks % r or r == s.dist_opt_instances:
            continue
        try:  # (not every option is modelled with several instances; experts' groups must
            other = dataclasses.replace(s, dist_opt_instances=r)  # split evenly too)
            est = estimate(model, other, system)
        except ConfigError:
            continue
        if est.fits:
            fitting.append((est.step_time_s, r, est))
    if not fitting or min(fitting)[0] > step_s * (1 - INSTANCES_GAIN):
        return None
    near = min(fitting)[0] * (1 + INSTANCES_NEAR)
    _, r, est = min((e.peak_memory_GiB, r, e) for t, r, e in fitting if t <= near)
    return {"dist_opt_instances": r, "step_time_s": est.step_time_s,
            "peak_memory_GiB": est.peak_memory_GiB}


def fit_hints(model: ModelSpec, s: Strategy, system: SystemSpec, *, cost: Cost | None = None
              ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """For a strategy that does not fit: (``fit_hint``, the recomputation that fits;
    ``shard_hint``, the sharding that fits — with the recomputation it needs where neither
    alone fits). ``cost``: how a candidate's step and fit are found (the fast path on
    ``system`` unless given: a mixed cluster places each candidate, ``mixed``)."""
    recompute, shard = fit_hint(model, s, system, cost=cost), shard_hint(model, s, system,
                                                                          cost=cost)
    if recompute is None and shard is None:
        shard = shard_hint(model, s, system, recompute=True, cost=cost)
    return recompute, shard


def fit_advice(recompute: dict[str, Any] | None, shard: dict[str, Any] | None, s: Strategy
               ) -> list[tuple[dict[str, Any], str, str, str]]:
    """``fit_hints`` in words, each hint with (what it changes, its CLI flags, its study-file
    fields), for ``estimate`` and ``resilience``."""
    out = []
    if recompute is not None:
        out.append((recompute, *fit_hint_words(recompute)))
    if shard is not None:
        out.append((shard, *shard_hint_words(shard, s)))
    return out


def fit_hint_words(hint: dict[str, Any]) -> tuple[str, str, str]:
    """(what the hint recomputes, its CLI flags, its study-file fields) — ``Glance.fit_hint``
    in words for ``estimate`` and ``resilience``."""
    n = hint["recompute_num_layers"]
    if f := hint.get("optimizer_offload_fraction", 0.0):
        return (f"{f:.0%} of the optimizer state offloaded to the CPU",
                f"--optimizer-offload-fraction {f:g}", f"optimizer_offload_fraction = {f:g}")
    if (k := hint.get("cpu_offload_layers", 0)) and hint["recompute"] == "none":
        return (f"the first {_layers(k)}' activations offloaded to host memory",
                f"--cpu-offload-layers {k}", f"cpu_offload_layers = {k}")
    if hint["recompute"] == "selective":
        mods = hint.get("recompute_modules", "core_attn")
        if mods == "core_attn":
            return "selective recompute", "--recompute selective", 'recompute = "selective"'
        return (f"selective recompute of {mods.replace(',', ', ')}",
                f"--recompute selective --recompute-modules {mods}",
                f'recompute = "selective", recompute_modules = "{mods}"')
    if n:
        return (f"full recompute of the first {_layers(n)} of each chunk",
                f"--recompute full --recompute-num-layers {n}",
                f'recompute = "full", recompute_num_layers = {n}')
    return "full recompute", "--recompute full", 'recompute = "full"'


def _layers(n: int) -> str:
    return "layer" if n == 1 else f"{n} layers"


def fit_hint(model: ModelSpec, s: Strategy, system: SystemSpec, *, cost: Cost | None = None
             ) -> dict[str, Any] | None:
    """``fit_by_recompute`` as ``Glance.fit_hint``: the recompute fields, step and memory."""
    got = fit_by_recompute(model, s, system, cost=cost)
    if got is None:
        return None
    return {"recompute": got[0].recompute, "recompute_num_layers": got[0].recompute_num_layers,
            "recompute_modules": got[0].recompute_modules,
            "cpu_offload_layers": got[0].cpu_offload_layers,
            "optimizer_offload_fraction": (got[0].optimizer_offload_fraction
                                           if got[0].optimizer_offload_fraction
                                           != s.optimizer_offload_fraction else 0.0),
            "step_time_s": got[1].step_time_s, "peak_memory_GiB": got[1].peak_memory_GiB}


def fit_by_recompute(model: ModelSpec, s: Strategy, system: SystemSpec, *,
                     cost: Cost | None = None) -> tuple[Strategy, FastEstimate] | None:
    """For a strategy that does not fit, the fastest of the recomputations that fit with
    everything else kept: selective (of the core attention, and of it with the MLP or the
    experts' activation or the whole MoE layer, and with MLA's up-projections where the model
    has them: Megatron-Core's recompute modules), and full recompute of the first N
    layers of each chunk for the least N that fits (a chunk's memory falls as N grows: each
    recomputed layer keeps its input instead of its activations; N = the largest chunk is
    every layer). None where none fits, or none recomputes less than ``s`` does. ``cost``:
    as ``fit_hints``."""
    cost = cost or fast_cost(model, system)
    options: list[tuple[Strategy, FastEstimate]] = []
    more = "moe_act" if model.is_moe else "mlp"
    kept = set(s.selective_modules)  # what ``s`` already recomputes stays recomputed
    adds = [{"core_attn"}, {"core_attn", more}, *([{"core_attn", "moe"}] if model.is_moe else [])]
    if model.is_mla:  # and MLA's up-projections (NVIDIA's DeepSeek-V3 recipe: with the MLP)
        adds += [{"core_attn", "mla_up_proj"}, {"core_attn", "mla_up_proj", more}]
    for add in adds:
        if s.recompute == "full" or add <= kept:
            continue
        sel = _variant(s, recompute="selective", recompute_modules=",".join(sorted(kept | add)))
        if sel is not None and (got := cost(sel)).fits:
            options.append((sel, got))
    # full recompute of more layers than ``s`` recomputes (recompute_num_layers is 0 unless
    # full; full of every layer leaves nothing more)
    most = max(len(s.chunk_layers(model.num_layers, g)) for g in range(s.pp * s.vpp))
    if (s.recompute != "full" or s.recompute_num_layers) and s.recompute_num_layers < most:
        found = _least_fitting(s, cost, s.recompute_num_layers + 1, most)
        if found is not None:
            options.append(found)
    if system.node.host_link_GBps:
        found = _least_offload(s, cost, model.num_layers - 1)
        if found is not None:
            options.append(found)
    if system.node.host_link_GBps and system.node.host_cpu_GBps:
        found = _least_optimizer_offload(s, cost)
        if found is not None:
            options.append(found)
    return min(options, key=lambda o: o[1].step_time_s) if options else None


def _least_optimizer_offload(s: Strategy, cost: Cost) -> tuple[Strategy, FastEstimate] | None:
    """The least quarter of the optimizer state that, updated on the CPU (optimizer
    offloading), makes ``s`` fit (where ``s`` allows it: ZeRO 1 or 2, fp32 moments): above
    the share ``s`` offloads where the GPU is short, below it where a host is."""
    if _variant(s, optimizer_offload_fraction=1.0) is None:
        return None

    def at(n: int) -> tuple[Strategy, FastEstimate]:
        offloaded = dataclasses.replace(s, optimizer_offload_fraction=n / 4)
        return offloaded, cost(offloaded)

    return _least(1, 4, at)


def _least_offload(s: Strategy, cost: Cost, most: int) -> tuple[Strategy, FastEstimate] | None:
    """The least count of first layers whose activations, offloaded to host memory, make
    ``s`` fit (where ``s`` allows offloading: pp 1, no recompute), in [1, most]: more than
    ``s`` offloads where the GPU is short, fewer where a host is."""
    if _variant(s, cpu_offload_layers=most) is None:
        return None

    def at(n: int) -> tuple[Strategy, FastEstimate]:
        offloaded = dataclasses.replace(s, cpu_offload_layers=n)
        return offloaded, cost(offloaded)

    return _least(1, most, at)


def _variant(s: Strategy, **fields: Any) -> Strategy | None:
    """``s`` with ``fields`` changed, or None where that is no valid strategy (a recompute
    the rest of ``s`` rules out: full recompute beside combined 1F1B, say)."""
    try:
        return dataclasses.replace(s, **fields)
    except ConfigError:
        return None


def _least_fitting(s: Strategy, cost: Cost, lo: int, hi: int
                   ) -> tuple[Strategy, FastEstimate] | None:
    """The least N in [lo, hi] whose full recompute of the first N layers of each chunk fits
    (N = hi: every layer, said as N = 0)."""
    def at(n: int) -> tuple[Strategy, FastEstimate]:
        full = dataclasses.replace(s, recompute="full", recompute_num_layers=0 if n >= hi else n,
                                   recompute_modules="core_attn")
        return full, cost(full)

    if _variant(s, recompute="full", recompute_num_layers=0, recompute_modules="core_attn"
                ) is None:  # (full recompute is not an option beside what ``s`` runs)
        return None
    return _least(lo, hi, at)


def _least(lo: int, hi: int, at: Callable[[int], tuple[Strategy, FastEstimate]]
           ) -> tuple[Strategy, FastEstimate] | None:
    """Bisection for the least n in [lo, hi] whose strategy ``at(n)`` fits (peak memory falls
    as n grows), or None where none does. The GPU's memory is bisected first; where the least
    n that it holds overfills a host's memory (offloading: ``FastEstimate.host_short``), a
    larger n fits only if host use falls as n grows (more recomputation, smaller offloaded
    activations), so the fit itself is bisected above it where ``at(hi)`` fits; more
    offloading only adds to the host's, and then none fits."""
    top = at(hi)
    if not _gpu_fits(top[1]):
        return None
    best = _bisect(lo, hi, at, _gpu_fits, top)
    if best[1].fits or not top[1].fits:
        return best if best[1].fits else None
    return _bisect(lo, hi, at, lambda e: e.fits, top)  # (then monotone over all of it)


def _bisect(lo: int, hi: int, at: Callable[[int], tuple[Strategy, FastEstimate]],
            ok: Callable[[FastEstimate], bool], top: tuple[Strategy, FastEstimate]
            ) -> tuple[Strategy, FastEstimate]:
    """The least n in [lo, hi] whose ``at(n)`` is ``ok`` (monotone in n; ``top``: at(hi),
    which is)."""
    best = top
    while lo < hi:
        mid = (lo + hi) // 2
        got = at(mid)
        if ok(got[1]):
            best, hi = got, mid
        else:
            lo = mid + 1
    return best


def _gpu_fits(est: FastEstimate) -> bool:
    return est.fits or est.host_short


def _idle(est: FastEstimate, microbatches: int) -> float:
    busiest = max(f + b for f, b in zip(est.stage_fwd_s, est.stage_bwd_s, strict=True))
    return max(0.0, 1.0 - microbatches * busiest / est.pipeline_s) if est.pipeline_s else 0.0


def stage_glances(model: ModelSpec, s: Strategy, system: SystemSpec, est: FastEstimate
                  ) -> tuple[StageGlance, ...]:
    """Each pipeline stage's times (from ``est``) and memory breakdown on ``system``."""
    flash = system.gpu.flash_attention
    out = []
    for st in range(s.pp):
        held = RoleProgram(model, s, st).stage_params()
        mem = memory.estimate(model, s, st, sum(held.values()), flash_attention=flash,
                              expert_params=held["edp"],
                              fp8_any_layout=system.gpu.fp8_any_layout)
        mtp = model.mtp_layers if model.mtp_layers and st == s.chunk_stage(s.mtp_chunk) else 0
        out.append(StageGlance(st, est.stage_fwd_s[st], est.stage_bwd_s[st], mem,
                               s.stage_layers(model.num_layers, st), mtp))
    return tuple(out)
