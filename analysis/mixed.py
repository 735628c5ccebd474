"""A pipeline over mixed GPU generations: some stages on another system's GPUs.

A planner with, say, H100 and A100 nodes asks what a step costs if the older GPUs take some
pipeline stages, and whether each stage still fits. Each stage is costed on its own GPUs (the
fast path on its system: compute, and the collectives of its tensor- and data-parallel groups
on that system's links), and the schedule walked with the stages so unequal
(``fastpath.estimate_stages``: each stage's gradient reduction, optimizer step and gathers on
its own system, each send at its slower end's cost). Where every stage is on one
system, that system's own estimate. Replay with a ``[[gpu]]`` scenario on whole stages is the
reference (``tests/test_mixed.py``). Memory: each stage against its own GPU's capacity. MFU:
against the mean of the GPUs' peaks (every stage has as many GPUs). Split evenly, the slower
GPUs' stages pace the pipeline: ``balanced_layout`` gives them fewer layers, as a Megatron-Core
pipeline layout.
"""

from __future__ import annotations

import dataclasses
import shlex
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from analysis.fail_slow import pipeline_bound_s
from analysis.fastpath import estimate, estimate_stages, resolve_specs
from analysis.glance import fit_hints, stage_glances
from replay.hardware import SystemSpec, on_sites_of, resolve_system
from tracegen import ConfigError, ModelSpec, Strategy
from tracegen.fit import check_fits_model
from tracegen.flops import step_rates
from tracegen.layout import parse_layout
from tracegen.units import GiB

if TYPE_CHECKING:
    from analysis.fastpath import FastEstimate
    from analysis.study import Study


@dataclasses.dataclass(frozen=True, slots=True)
class MixedEstimate:
    step_time_s: float
    base_step_time_s: float  # every stage on the base system
    tokens_per_s: float
    mfu: float  # against the mean peak of the stages' GPUs
    stage_systems: tuple[str, ...]
    stage_time_s: tuple[float, ...]  # forward + backward of one micro-batch, every chunk
    stage_memory_GiB: tuple[float, ...]
    stage_capacity_GiB: tuple[float, ...]
    hfu: float = 0.0  # against the same mean peak

    @property
    def fits(self) -> bool:
        return all(m <= c for m, c in zip(self.stage_memory_GiB, self.stage_capacity_GiB,
                                          strict=True))

    def to_dict(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                "fits": self.fits}


def parse_stage_systems(items: list[str], pp: int) -> dict[int, str]:
    """``["0-3=dgx-a100-80gb", "7=FILE.toml"]`` → {stage: system}; stages in 0…pp−1."""
    out: dict[int, str] = {}
    for item in items:
        stages, sep, system = item.partition("=")
        lo, _, hi = stages.partition("-")
        if not sep or not system or not lo.strip().isdigit() or (hi and not hi.strip().isdigit()):
            raise ConfigError(f"--stage-system {item!r}: give STAGE=SYSTEM or FIRST-LAST=SYSTEM "
                              "(e.g. 0-3=dgx-a100-80gb)", what="mixed cluster")
        first, last = int(lo), int(hi or lo)
        if not 0 <= first <= last < pp:
            raise ConfigError(f"--stage-system {item!r}: stages run from 0 to {pp - 1} (pp "
                              f"{pp}), first ≤ last", what="mixed cluster")
        for st in range(first, last + 1):
            if st in out:
                raise ConfigError(f"stage {st} is given two systems", what="mixed cluster")
            out[st] = system
    return out


def mixed_estimate(model: ModelSpec | str, s: Strategy, system: SystemSpec | str,
                   stage_systems: Mapping[int, SystemSpec | str]) -> MixedEstimate:
    """``s`` with the stages of ``stage_systems`` on those systems' GPUs, the rest on
    ``system``'s (on its sites, where a stage's system has none: ``hardware.on_sites_of``)."""
    model, base = resolve_specs(model, system)
    specs = [base] * s.pp
    for st, sysm in stage_systems.items():
        if not 0 <= st < s.pp:
            raise ConfigError(f"stage {st} is outside the pipeline (pp {s.pp})",
                              what="mixed cluster")
        specs[st] = on_sites_of(sysm if isinstance(sysm, SystemSpec) else resolve_system(sysm),
                                base)
    # one estimate per distinct system (by value: a copy of a preset's file may keep its name)
    distinct: list[SystemSpec] = []
    for spec in specs:
        if spec not in distinct:
            distinct.append(spec)
    ests = [estimate(model, s, spec) for spec in distinct]
    own = [ests[distinct.index(spec)] for spec in specs]
    t = [e.stage_fwd_s[j] + e.stage_bwd_s[j] for j, e in enumerate(own)]
    base_est = ests[distinct.index(base)] if base in distinct else estimate(model, s, base)
    if len(distinct) == 1:  # one system throughout: its own estimate
        step = own[0].step_time_s
    else:
        step = estimate_stages(model, s, base, {st: spec for st, spec in enumerate(specs)
                                                if spec != base}).step_time_s
    memory = [stage_glances(model, s, spec, e)[j].memory.total_bytes / GiB
              for j, (spec, e) in enumerate(zip(specs, own, strict=True))]
    peak = sum(spec.gpu.peak_flop_per_s(s.precision) for spec in specs) / len(specs)
    rates = step_rates(model, s.global_batch_size, s.recompute, step_s=step, gpus=s.world_size,
                       peak_flop_per_s=peak, modules=s.selective_modules,
                       recomputed_layers=s.recomputed_layers(model.num_layers))
    return MixedEstimate(step, base_est.step_time_s, rates["tokens_per_s"], rates["mfu"],
                         tuple(spec.name for spec in specs), tuple(t), tuple(memory),
                         tuple(spec.gpu.hbm_bytes / GiB for spec in specs), rates["hfu"])


MAX_MOVES = 4096  # one layer moved per round; a pipeline of thousands of layers is not a model


def layout_text(layers: list[int], mtp: int = 0, vpp: int = 1, *, v_shape: bool = False
                ) -> str:
    """Megatron-Core's ``--pipeline-model-parallel-layout`` with ``layers[j]`` transformer
    layers on stage j (over its ``vpp`` chunks as evenly as they go; the remainder to the
    chunks that hold neither the embedding nor the loss first, so that a stage one layer
    short leaves those two alone, not an empty chunk), the embedding first in the first
    chunk, the MTP modules and the loss last in the last. Chunks in the global order: every
    stage's first chunk, then every second — in a V (ZB-V, ``v_shape``) the second chunks from
    the last stage back to stage 0, which holds the loss too."""
    p = len(layers)

    def chunk(c: int, j: int) -> str:
        rank = vpp - 1 - c if j == 0 else c  # which of the stage's chunks gets extra first
        n = layers[j] // vpp + (1 if rank < layers[j] % vpp else 0)
        last = c == vpp - 1 and j == (0 if v_shape else p - 1)
        return (("E" if c == j == 0 else "") + (f"t*{n}" if n > 1 else "t" * n)
                + ((f"m*{mtp}" if mtp > 1 else "m" * mtp) + "L" if last else ""))

    return "|".join(chunk(c, j) for c in range(vpp)
                    for j in (reversed(range(p)) if v_shape and c % 2 else range(p)))


def balanced_layout(model: ModelSpec | str, s: Strategy, system: SystemSpec | str,
                    stage_systems: Mapping[int, SystemSpec | str]
                    ) -> tuple[Strategy, MixedEstimate] | None:
    """The same strategy with the layers split by the stages' speeds: one layer at a time from
    the slowest stage to the one that would then finish first, while the pipeline bound falls
    and, once every stage fits its GPU, it still does (Megatron-Core runs any split as a
    pipeline layout).
    With interleaved chunks a stage's layers are spread over its chunks as evenly as they go
    (ZB-V's two too, in their V). None where there is nothing to balance (pp 1, a layout with
    MTP modules off the last chunk, no shorter step found)."""
    model, base = resolve_specs(model, system)
    if s.pp < 2:
        return None
    if s.pipeline_layout and any(c.mtp for c in parse_layout(s.pipeline_layout)[:-1]):
        return None  # (the walk keeps the MTP modules with the loss)
    layers = [s.stage_layers(model.num_layers, j) for j in range(s.pp)]
    plain = dataclasses.replace(s, first_stage_layers=0, last_stage_layers=0,
                                account_for_embedding_in_pipeline_split=False,
                                account_for_loss_in_pipeline_split=False)
    best_s = dataclasses.replace(plain, pipeline_layout=layout_text(
        layers, model.mtp_layers, s.vpp, v_shape=s.v_shape))
    best = mixed_estimate(model, best_s, base, stage_systems)
    start = best.step_time_s
    for _ in range(MAX_MOVES):
        per_layer = [t / max(n, 1) for t, n in zip(best.stage_time_s, layers, strict=True)]
        slow = max(range(s.pp), key=lambda j: best.stage_time_s[j])
        if layers[slow] <= s.vpp:  # every chunk keeps a layer
            break
        fast = min((j for j in range(s.pp) if j != slow),
                   key=lambda j: best.stage_time_s[j] + per_layer[j])
        trial = list(layers)
        trial[slow] -= 1
        trial[fast] += 1
        cand_s = dataclasses.replace(plain, pipeline_layout=layout_text(
            trial, model.mtp_layers, s.vpp, v_shape=s.v_shape))
        cand = mixed_estimate(model, cand_s, base, stage_systems)
        # the pipeline bound decides (the walked step's tails move a little with every split
        # and would stop the walk on a plateau of equal slow stages)
        if _bound(cand, s) >= _bound(best, s) or (best.fits and not cand.fits):
            break  # (a split that does not fit may move on: its stages' needs change too)
        layers, best_s, best = trial, cand_s, cand
    return None if best.step_time_s >= start else (best_s, best)


def split(model: ModelSpec, s: Strategy, base: SystemSpec,
          where: Mapping[int, SystemSpec | str], *, balance: bool = True
          ) -> tuple[Strategy, MixedEstimate]:
    """``s`` on the mixed cluster of ``where`` with its layers split by the stages' speeds
    where ``balance`` asks and that shortens the step (``balanced_layout``), else as it is."""
    found = balanced_layout(model, s, base, where) if balance else None
    return found or (s, mixed_estimate(model, s, base, where))


def _bound(e: MixedEstimate, s: Strategy) -> float:
    return pipeline_bound_s(list(e.stage_time_s), s.num_microbatches, s.vpp)


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """Where a study's ``[mixed]`` GPUs go in one strategy: the strategy (with the layers split
    by the stages' speeds where that was asked and shortens the step), its estimate, the
    stages on the other system, and ``--stage-system`` as estimate takes it."""

    strategy: Strategy
    estimate: MixedEstimate
    stages: tuple[int, ...]
    stage_systems: str  # as --stage-system takes it: FIRST-LAST=SYSTEM
    system: SystemSpec  # the other system, whose GPUs the stages are on

    @property
    def flag(self) -> str:
        return "--stage-system " + shlex.quote(self.stage_systems)

    @property
    def where(self) -> dict[int, SystemSpec]:
        """The stages on the other system, as ``fastpath.estimate_stages`` takes them."""
        return dict.fromkeys(self.stages, self.system)


def place(model: ModelSpec, s: Strategy, base: SystemSpec, other: SystemSpec, gpus: int, *,
          balance: bool = True, ref: str = "") -> Placement:
    """``gpus`` of ``s``'s GPUs on ``other``, as whole pipeline stages: the first ones or the
    last ones, whichever steps faster (of those that fit, if any does). ``ref``: the other
    system as the command line names it (its name if not given)."""
    from analysis.study import mixed_stages

    check_fits_model(s, model)  # (its own problems first, not a layout's made from it)
    k = mixed_stages(s, gpus, other.name)
    candidates = []
    for stages in (tuple(range(k)), tuple(range(s.pp - k, s.pp))):
        strat, est = split(model, s, base, dict.fromkeys(stages, other), balance=balance)
        value = f"{stages[0]}" + (f"-{stages[-1]}" if k > 1 else "") + f"={ref or other.name}"
        candidates.append(Placement(strat, est, stages, value, other))
    return min(candidates, key=lambda c: (not c.estimate.fits, c.estimate.step_time_s))


def study_placement(study: Study, s: Strategy) -> Placement | None:
    """Where a study's ``[mixed]`` GPUs go in ``s`` (None for a study without them)."""
    m = study.mixed
    if m is None:
        return None
    return place(study.model, s, study.system, m.system, m.gpus, balance=m.balance, ref=m.ref)


def placed_fast(study: Study, s: Strategy
                ) -> tuple[Strategy, FastEstimate, Placement | None]:
    """``s`` as the study's cluster runs it, its fast-path estimate, and its placement: on a
    ``[mixed]`` cluster the placed strategy, and its step, largest stage and fit in the base
    system's estimate of it (whose other fields — the job's shape — the resilience model
    reads); elsewhere ``s``, its estimate and None."""
    placed = study_placement(study, s)
    if placed is None:
        return s, estimate(study.model, s, study.system), None
    return placed.strategy, as_fast(study.model, placed.strategy, study.system,
                                    placed.estimate), placed


def as_fast(model: ModelSpec, s: Strategy, base: SystemSpec, e: MixedEstimate) -> FastEstimate:
    """The base system's estimate of ``s`` with the mixed cluster's step, largest stage and
    fit (what the resilience model and the fit hints read of a step)."""
    own = estimate(model, s, base)  # (a host short of memory on the base system: short)
    return own._replace(step_time_s=e.step_time_s, peak_memory_GiB=max(e.stage_memory_GiB),
                        fits=e.fits and not own.host_short)


def stages_cost(model: ModelSpec, base: SystemSpec, where: Mapping[int, SystemSpec | str]
                ) -> Callable[[Strategy], FastEstimate]:
    """A candidate strategy costed on a mixed cluster with the stages of ``where`` on other
    systems, its layers split by the stages' speeds where that shortens the step (the
    ``cost`` of ``glance.fit_hints`` for ``estimate --stage-system``)."""
    def cost(c: Strategy) -> FastEstimate:
        strat, e = split(model, c, base, where)
        return as_fast(model, strat, base, e)
    return cost


def study_cost(study: Study) -> Callable[[Strategy], FastEstimate]:
    """A candidate strategy costed as the study's cluster runs it (``placed_fast``: on a
    ``[mixed]`` cluster placed there, each stage against its own GPU) — the ``cost`` of
    ``glance.fit_hints`` for a study's hints and a sweep's recompute-to-fit variants."""
    return lambda c: placed_fast(study, c)[1]


def study_fit_hints(study: Study, s: Strategy
                    ) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """``glance.fit_hints`` of a study's strategy that does not fit, each candidate costed as
    the study's cluster runs it (``study_cost``)."""
    return fit_hints(study.model, s, study.system, cost=study_cost(study))
