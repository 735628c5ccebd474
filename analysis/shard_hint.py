"""Where a strategy does not fit: the sharding that makes it fit with everything else kept.

``fit_by_recompute`` (analysis/glance.py) trades compute for memory; this trades communication:
a higher ZeRO stage (1: the distributed optimizer's state over dp·cp, Rajbhandari et al. 2020
§5; 2: and the gradients; 3: and the weights, gathered block by block — with prefetch or
without), fewer distributed-optimizer instances (each shards over dp·cp / R ranks), or, for
ZeRO-3 with several instances, the optimizer sharded across them too (HFSDP, Megatron-FSDP's
``--outer-dp-sharding-strategy optim``). Every combination that shards at least as much as the
strategy is costed with the fast path; of those that fit, the hint is the one that needs the
least memory among those within ``NEAR`` of the fastest (as the instances hint: a step 0.5%
shorter is not worth a run at the edge of its memory). Where neither recomputation
(``fit_by_recompute``) nor sharding alone fits, each candidate is given the least
recomputation that makes it fit, and the same rule picks among those. Combinations the
strategy's other fields forbid (Megatron-Core refuses instances with expert parallelism, say)
are skipped, as ``Strategy`` and ``check_fits_model`` refuse them.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from analysis.fastpath import FastEstimate
from replay.hardware import SystemSpec
from tracegen.errors import ConfigError
from tracegen.model import ModelSpec
from tracegen.strategy import OuterDpSharding, Strategy

if TYPE_CHECKING:
    from analysis.glance import Cost

# how much slower than the fastest option a suggested one may be where it needs less memory
NEAR = 0.01


def candidates(s: Strategy) -> list[Strategy]:
    """The strategies that shard at least as much as ``s`` and differ from it in the ZeRO
    stage, the instance count, the outer sharding or (entering ZeRO-3) prefetch alone."""
    ranks = s.dp * s.cp
    fewer = [r for r in range(1, s.dist_opt_instances + 1) if ranks % r == 0]
    out: list[Strategy] = []
    for zero in range(max(s.zero_stage, 1), 4):
        prefetch = ((s.zero3_prefetch,) if s.zero_stage == 3 else (True, False)) \
            if zero == 3 else (False,)
        for r in fewer:
            outer: tuple[OuterDpSharding, ...] = (
                ("optim", "no_shard") if zero == 3 and r > 1 else ("no_shard",))
            for o in outer:
                if s.hfsdp and r > 1 and o == "no_shard":
                    continue  # HSDP replicates the optimizer HFSDP shards over every rank
                for p in prefetch:
                    try:
                        c = dataclasses.replace(s, zero_stage=zero, dist_opt_instances=r,
                                                outer_dp_sharding_strategy=o, zero3_prefetch=p,
                                                # (ZeRO-3 reduces every backward anyway)
                                                grad_reduce_per_microbatch=(
                                                    s.grad_reduce_per_microbatch and zero < 3))
                    except ConfigError:
                        continue
                    if c != s:
                        out.append(c)
    return out


def fit_by_sharding(model: ModelSpec, s: Strategy, system: SystemSpec, *,
                    recompute: bool = False, cost: Cost | None = None
                    ) -> tuple[Strategy, FastEstimate] | None:
    """For a strategy that does not fit: of the ``candidates`` that fit, the one that needs the
    least memory among those within ``NEAR`` of the fastest; None where none fits. With
    ``recompute``, each candidate with the recomputation that makes it fit, where it needs
    one (``fit_by_recompute``): for a strategy that neither alone rescues. ``cost``: as
    ``glance.fit_hints``."""
    from analysis.glance import fast_cost, fit_by_recompute  # (glance shows this module's hint)

    cost = cost or fast_cost(model, system)

    options: list[tuple[float, int, Strategy, FastEstimate]] = []
    for i, c in enumerate(candidates(s)):
        try:
            est = cost(c)
            got = (fit_by_recompute(model, c, system, cost=cost) if recompute and not est.fits
                   else (c, est))
        except ConfigError:  # a field the model refuses with this sharding
            continue
        if got is not None and got[1].fits:
            options.append((got[1].peak_memory_GiB, i, *got))
    if not options:
        return None
    near = min(o[3].step_time_s for o in options) * (1 + NEAR)
    *_, c, best = min(o for o in options if o[3].step_time_s <= near)
    return c, best


def shard_hint(model: ModelSpec, s: Strategy, system: SystemSpec, *, recompute: bool = False,
               cost: Cost | None = None) -> dict[str, Any] | None:
    """``fit_by_sharding`` as ``Glance.shard_hint``: the sharding fields, step and memory, and
    (``recompute``, where the hint recomputes more than ``s``) the recompute fields."""
    got = fit_by_sharding(model, s, system, recompute=recompute, cost=cost)
    if got is None:
        return None
    c, est = got
    out: dict[str, Any] = {
        "zero_stage": c.zero_stage, "dist_opt_instances": c.dist_opt_instances,
        "outer_dp_sharding_strategy": c.outer_dp_sharding_strategy,
        "zero3_prefetch": c.zero3_prefetch, "step_time_s": est.step_time_s,
        "peak_memory_GiB": est.peak_memory_GiB}
    if (c.recompute, c.recompute_num_layers, c.recompute_modules, c.cpu_offload_layers,
            c.optimizer_offload_fraction) != (
            s.recompute, s.recompute_num_layers, s.recompute_modules, s.cpu_offload_layers,
            s.optimizer_offload_fraction):
        out |= {"recompute": c.recompute, "recompute_num_layers": c.recompute_num_layers,
                "recompute_modules": c.recompute_modules,
                "cpu_offload_layers": c.cpu_offload_layers,
                "optimizer_offload_fraction": (
                    c.optimizer_offload_fraction
                    if c.optimizer_offload_fraction != s.optimizer_offload_fraction else 0.0)}
    return out


def shard_hint_words(hint: dict[str, Any], s: Strategy) -> tuple[str, str, str]:
    """(what the hint shards — and recomputes, where it does —, its CLI flags, its study-file
    fields), naming only what differs from ``s``."""
    words, flags, fields = [], [], []
    zero, r = hint["zero_stage"], hint["dist_opt_instances"]
    prefetch, optim = hint["zero3_prefetch"], hint["outer_dp_sharding_strategy"] == "optim"
    if zero != s.zero_stage or prefetch != s.zero3_prefetch:
        words.append(f"ZeRO-{zero}" + (" with prefetch" if prefetch else ""))
        flags.append(f"--zero {zero}" + (" --zero3-prefetch" if prefetch else ""))
        fields.append(f"zero_stage = {zero}" + (", zero3_prefetch = true" if prefetch else ""))
    if r != s.dist_opt_instances:
        words.append(f"{r} optimizer instances" if r > 1 else
                     f"one optimizer instance over all {s.dp * s.cp:,} data-parallel ranks")
        flags.append(f"--dist-opt-instances {r}")
        fields.append(f"dist_opt_instances = {r}")
    if optim != s.hfsdp:  # (back to no_shard only with one instance: its words said it)
        if optim:
            words.append("the optimizer sharded across the instances (HFSDP)")
        flags.append(f"--outer-dp-sharding {hint['outer_dp_sharding_strategy']}")
        fields.append(f'outer_dp_sharding_strategy = "{hint["outer_dp_sharding_strategy"]}"')
    if "recompute" in hint:  # with the recomputation (or offloading) it needs too
        from analysis.glance import fit_hint_words

        more = fit_hint_words(hint)
        words, flags, fields = [*words, more[0]], [*flags, more[1]], [*fields, more[2]]
    return ", ".join(words), " ".join(flags), ", ".join(fields)
