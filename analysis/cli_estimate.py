"""``trainsim estimate``: one strategy's step time, throughput and memory from the fast path."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

import polars as pl
import typer
from rich.table import Table

from analysis import cli_common as C
from analysis.cli_common import (
    app,
    build_strategy,
    console,
    note_combined_1f1b,
    note_moe,
    note_param_gather,
    note_precision,
    note_zero2,
    output_file,
    table_file,
    with_stack,
    write_table,
)
from analysis.glance import Glance, fit_advice, glance
from analysis.op_table import by_kind, op_table
from analysis.step_split import step_split
from replay.compute import RooflineCompute
from replay.hardware import SystemSpec
from tracegen import ConfigError, ModelSpec, Strategy, resolve_model
from tracegen import ops as O
from tracegen.units import GiB

MEMORY_COLUMNS = ("weights", "gradients", "optimizer", "activations", "logits", "transient")
# how the header names an FP8 recipe other than the default (delayed scaling)
RECIPE_WORDS = {"tensorwise": "current scaling", "mxfp8": "MXFP8 blocks"}


@app.command("estimate", cls=C.OptionsOnly)
def estimate_cmd(
    ctx: typer.Context,
    model: C.ModelOpt, gpus: C.GpusOpt, mbs: C.MbsOpt, gbs: C.GbsOpt,
    system: Annotated[str, typer.Option(help="Preset system (see `trainsim systems`) or a TOML "
                                             "system file; append @KERNEL for an earlier "
                                             "attention kernel, e.g. "
                                             "dgx-h100@flashattention-2.",
                                             rich_help_panel=C.PANEL_JOB)],
    tp: C.TpOpt = 1, pp: C.PpOpt = 1, cp: C.CpOpt = 1, ep: C.EpOpt = 1, vpp: C.VppOpt = 1,
    sp: C.SpOpt = False,
    tp_comm_overlap: C.TpOverlapOpt = False, schedule: C.ScheduleOpt = "1f1b",
    recompute: C.RecomputeOpt = "none", zero: C.ZeroOpt = 0,
    overlap_param_gather: C.ParamGatherOpt = False, precision: C.PrecisionOpt = "bf16",
    first_stage_layers: C.FirstLayersOpt = 0, last_stage_layers: C.LastLayersOpt = 0,
    account_for_embedding: C.EmbSplitOpt = False, account_for_loss: C.LossSplitOpt = False,
    microbatch_group_size: C.GroupOpt = 0, recompute_num_layers: C.RecomputeLayersOpt = 0,
    recompute_modules: C.ModulesOpt = "core_attn",
    grad_reduce_bf16: C.GradBf16Opt = False, cp_comm_type: C.CpCommOpt = "p2p",
    cp_balance: C.CpBalanceOpt = "document",
    expert_tp: C.ExpertTpOpt = 0, zero3_prefetch: C.Zero3PrefetchOpt = False,
    zb_w_regather: C.ZbRegatherOpt = False,
    moe_dispatcher: C.MoeDispatcherOpt = "alltoall",
    moe_shared_expert_overlap: C.SharedOverlapOpt = False,
    overlap_moe_expert_parallel_comm: C.EpOverlapOpt = False,
    delay_wgrad_compute: C.DelayWgradOpt = False, pipeline_layout: C.LayoutOpt = "",
    adam_moments: C.AdamMomentsOpt = "fp32", fp8_param_gather: C.Fp8GatherOpt = False,
    dist_opt_instances: C.InstancesOpt = 1, outer_dp_sharding: C.OuterShardingOpt = "no_shard",
    grad_reduce_per_microbatch: C.GradPerMbOpt = False, seq_len: C.SeqLenOpt = 0,
    documents: C.DocumentsOpt = "",
    cross_entropy_fusion: C.CeFusionOpt = "none", fp8_recipe: C.Fp8RecipeOpt = "delayed",
    cpu_offload_layers: C.OffloadOpt = 0,
    optimizer_offload_fraction: C.OptOffloadOpt = 0.0,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the estimate as "
                                                  "JSON to this file ('-': to stdout, the "
                                                  "printed estimate going to stderr).",
                                                  rich_help_panel=C.PANEL_OUT)] = None,
    gpu_spread: Annotated[float, typer.Option(
        "--gpu-spread", help="The fleet's spread of per-GPU speed: a GPU's compute time's "
                             "relative standard deviation (0.02: 2%); prints what the step "
                             "waits for its slowest GPUs.", rich_help_panel=C.PANEL_OUT)] = 0.0,
    ops: Annotated[int | None, typer.Option(
        "--ops", help="Also list where pipeline stage OPS spends its time, op by op, with each "
                      "op's roofline terms (0: the first stage).",
                      rich_help_panel=C.PANEL_OUT)] = None,
    ops_out: Annotated[Path | None, typer.Option(
        "--ops-out", help="Write that op table to this file (.csv or .parquet; stage 0 unless "
                          "--ops).", rich_help_panel=C.PANEL_OUT)] = None,
    roofline_plot: Annotated[Path | None, typer.Option(
        "--roofline", help="Plot that stage's ops on the GPU's roofline (.png, .svg, .pdf).",
        rich_help_panel=C.PANEL_OUT)
    ] = None,
    stage_system: Annotated[list[str] | None, typer.Option(
        "--stage-system", help="A mixed cluster: these pipeline stages on another system's "
                               "GPUs, e.g. 0-3=dgx-a100-80gb (repeatable; the rest on "
                               "--system).", rich_help_panel=C.PANEL_JOB)] = None,
    schedules: Annotated[bool, typer.Option(
        "--schedules", help="Also cost this layout under every pipeline schedule trainsim "
                            "models (1F1B, GPipe, interleaved 1F1B and ZB, ZB-H1, ZB-V, "
                            "DualPipe-V; a MoE model's merged passes too), fastest first; "
                            "needs pp ≥ 2.", rich_help_panel=C.PANEL_OUT)
    ] = False,
    precisions: Annotated[bool, typer.Option(
        "--precisions", help="Also cost this strategy in every precision and FP8 recipe "
                             "trainsim models (BF16, FP8 delayed / tensorwise / MXFP8, NVFP4), "
                             "fastest first; the ones its GPU cannot run named with why.",
                             rich_help_panel=C.PANEL_OUT)
    ] = False,
    stack: C.StackOpt = None,
    mixed_gpus: Annotated[str | None, typer.Option(
        "--mixed", help="A mixed cluster, placed for you: GPUS=SYSTEM, that many of the GPUs "
                        "on another system's nodes as whole pipeline stages (the first or the "
                        "last, whichever steps faster with the layers split by speed), e.g. "
                        "512=dgx-a100-80gb; a study's \\[mixed] table does the same.",
                        rich_help_panel=C.PANEL_JOB)] = None,
) -> None:
    """Step time, tokens/s, MFU and per-stage memory of one strategy (fast path; milliseconds)."""
    from replay import resolve_system

    to_stdout = C.data_to_stdout(ctx, json_out)
    json_out = None if to_stdout else output_file(json_out, "--json")
    ops_out = table_file(ops_out, "--ops-out", what="the op table")
    roofline_plot = output_file(roofline_plot, "--roofline", plot=True)
    spec = resolve_model(model, seq_len, documents)
    _refuse_options(pp, schedules, precisions, bool(stage_system or mixed_gpus), gpu_spread, ops)
    strategy = build_strategy(ctx.params)
    sys_spec = resolve_system(system)
    # what the JSON holds beyond the estimate, each part as printed (None: not printed)
    extras: dict[str, Any] = {}
    if stack is not None:
        applied = with_stack(ctx, stack, spec, strategy, sys_spec, kernel_given="@" in system,
                             mixed=bool(stage_system or mixed_gpus))
        spec, strategy = applied.model, applied.strategy
        sys_spec = applied.system or sys_spec
        # the stack named, what it set and what it left out
        extras["stack"] = {"name": stack, "said": list(applied.notes)}
    if mixed_gpus is not None:
        if stage_system:
            raise ConfigError("give --mixed (placed for you) or --stage-system (the stages "
                              "you choose), not both", what="mixed cluster")
        stage_system = [_placed_stages(spec, strategy, sys_spec, mixed_gpus)]
    g = glance(spec, strategy, sys_spec)
    if stage_system:
        extras.update(_mixed_notes(spec, strategy, sys_spec, g, stage_system))
    else:
        print_glance(g, strategy, alone=False, model=spec)
        extras.update(_healthy_notes(spec, strategy, sys_spec, g, gpu_spread))
    extras.update(_common_notes(spec, strategy, sys_spec, g, alone=not stage_system))
    if schedules:  # the layout under every schedule, as printed
        extras["schedules"] = [a.to_dict() for a in _print_schedules(spec, strategy, sys_spec)]
    if precisions:  # the strategy in every precision, as printed
        extras["precisions"] = [r.to_dict()
                                for r in _print_precisions(spec, strategy, sys_spec)]
    if ops is not None or ops_out is not None or roofline_plot is not None:
        table = op_table(spec, strategy, sys_spec, stage=ops or 0)
        _write_ops(table, sys_spec, ops_out, roofline_plot, strategy.precision)
        if ops is not None:  # printed, so in the JSON too
            print_ops(table)
            extras["ops"] = table.to_dicts()
    if json_out is not None or to_stdout:
        # every field of the strategy, for what the label leaves out (moments, FP8 gathers…)
        out = {**g.to_dict(), "strategy_fields": strategy.to_dict(),
               **{k: v for k, v in extras.items() if v is not None}}
        C.write_json(out, json_out, to_stdout)


def _refuse_options(pp: int, schedules: bool, precisions: bool, mixed: bool,
                    gpu_spread: float, ops: int | None) -> None:
    """Options that cannot go together, refused before the estimate is printed."""
    if ops is not None and not 0 <= ops < pp:
        raise ConfigError(f"--ops {ops}: stage {ops} is not in a pipeline of {pp}; choose 0 … "
                          f"{pp - 1}", what="option")
    if schedules and pp < 2:
        raise ConfigError("--schedules compares pipeline schedules: it needs --pp 2 or more, "
                          f"got --pp {pp}", what="option")
    if schedules and mixed:
        raise ConfigError("--schedules costs the layout on one system: drop --stage-system / "
                          "--mixed, or compare the mixed cluster's schedules one at a time "
                          "with --schedule", what="option")
    if precisions and mixed:
        raise ConfigError("--precisions costs the strategy on one system: drop --stage-system "
                          "/ --mixed, or compare the mixed cluster's precisions one at a time "
                          "with --precision", what="option")
    if gpu_spread:
        from analysis.gpu_spread import check_sd

        check_sd(gpu_spread, what="--gpu-spread")


def _print_window(spec: ModelSpec) -> None:
    if spec.window:
        console.print(f"sliding-window attention: {spec.window_summary()} (the others attend "
                      f"over the whole {spec.seq_len:,}-token sequence)"
                      if spec.window_pattern else
                      f"sliding-window attention: {spec.window_summary()}")


def _healthy_notes(spec: ModelSpec, s: Strategy, system: SystemSpec, g: Glance,
                   gpu_spread: float) -> dict[str, Any]:
    """What follows the estimate of a cluster of one system: the step's parts, the data's and
    the fleet's stragglers (the JSON's parts, keyed as it names them)."""
    split = step_split(spec, s, system)
    if split is not None:
        console.print(split.line())
    _print_window(spec)
    return {
        "step_split": split.as_dict() if split is not None else None,
        # the wait for the replica whose sequences attended most
        "data_straggler": note_documents(spec, s, system, g.step_time_s),
        # the wait for the slowest GPUs
        "gpu_spread": (note_gpu_spread(spec, s, system, gpu_spread, g.step_time_s)
                       if gpu_spread else None)}


def _mixed_notes(spec: ModelSpec, s: Strategy, system: SystemSpec, g: Glance,
                 stage_system: list[str]) -> dict[str, Any]:
    """A mixed cluster (``--stage-system``): the all-base estimate, then the mixed one, the
    layers split by the stages' speeds, and what would make it fit."""
    from analysis.mixed import mixed_estimate, parse_stage_systems
    from replay import resolve_system

    chosen = parse_stage_systems(stage_system, s.pp)
    mixed = mixed_estimate(spec, s, system, chosen)
    print_glance(g, s, alone=True, model=spec)
    _print_window(spec)
    for other in sorted(set(chosen.values())):
        note_precision({s.precision}, resolve_system(other), {s.fp8_recipe})
    print_mixed(mixed)
    balanced = _print_balanced(spec, s, system, chosen, mixed)
    if not (mixed.fits or (balanced is not None and balanced[1].fits)):
        _print_mixed_hints(spec, s, system, chosen)
    out = mixed.to_dict()
    if balanced is not None:
        out["balanced"] = {"pipeline_layout": balanced[0].pipeline_layout,
                           **balanced[1].to_dict()}
    return {"mixed": out}


def _common_notes(spec: ModelSpec, s: Strategy, system: SystemSpec, g: Glance,
                  alone: bool) -> dict[str, Any]:
    """The notes on the strategy's options (the JSON's parts, keyed as it names them); those
    that cost the step on one system only where ``alone`` (not a mixed cluster)."""
    note_param_gather(s)
    note_partial_domain(s, system)
    note_zero2(s, g.step_time_s, _per_microbatch_s(spec, s, system) if alone else 0.0)
    out: dict[str, Any] = {
        # every micro-batch's reductions against its compute; what crosses between sites
        "grad_stream": note_grad_stream(spec, s, system) if alone else None,
        "sites": note_sites(spec, s, system) if alone else None}
    note_combined_1f1b([s.overlap_moe_ep_comm])
    out["moe_reference"] = note_moe(spec)  # what the note says a MoE step is worth
    out["expert_group"] = note_small_experts(spec, s, system)  # a rank's group of experts
    if alone:
        out["fused_losses"] = note_loss(spec, s, system, g)
        out["offload"] = note_offload(spec, s, system, g)  # activation offloading vs none
        out["optimizer_offload"] = note_optimizer_offload(spec, s, system, g)
        if s.overlap_moe_ep_comm:  # the other end of the range the note speaks of
            out["without_merged_passes"] = _print_unmerged(spec, s, system, g)
        note_dualpipe_pairs(spec, s, system, g.step_time_s)
        note_fsdp_pipeline(spec, s, system, g.step_time_s)
    note_precision({s.precision}, system, {s.fp8_recipe})
    return out


def _print_unmerged(model: Any, s: Strategy, system: SystemSpec, g: Glance) -> dict[str, float]:
    """Combined 1F1B's estimate is a bound on what the overlap saves (``note_combined_1f1b``):
    the same strategy without the merged passes (nor the deferred weight gradients, which need
    them) is the other end, printed beside it so the range is read, not just the bound."""
    from analysis.fastpath import estimate

    plain = estimate(model, dataclasses.replace(s, overlap_moe_ep_comm=False,
                                                delay_wgrad_compute=False), system)
    saved = plain.step_time_s - g.step_time_s
    console.print(f"without the merged passes: step time {plain.step_time_s:.4f} s; the overlap "
                  f"saves at most {saved:.4f} s ({saved / plain.step_time_s:.1%}) a step")
    return {"step_time_s": plain.step_time_s, "saved_at_most_s": saved}


def _print_schedules(model: Any, s: Strategy, system: SystemSpec) -> list[Any]:
    """``--schedules``: this layout under every schedule (``analysis.schedules``), fastest
    first, the strategy as given marked; the ones it cannot run named with why."""
    from analysis.schedules import schedule_alternatives

    alts = schedule_alternatives(model, s, system)
    ran = [a for a in alts if not a.refused]
    mine = next((a.step_time_s for a in ran if a.current), None)
    table = Table(title="This layout under each pipeline schedule (fast path)")
    for col in ("schedule", "step s", "vs this", "memory GiB", "fits"):
        table.add_column(col, justify="left" if col == "schedule" else "right")
    for a in ran:
        vs = "" if mine is None else ("this" if a.current else
                                      f"{a.step_time_s / mine - 1:+.1%}")
        table.add_row(a.name + (" ←" if a.current else ""), f"{a.step_time_s:.4f}", vs,
                      f"{a.peak_memory_GiB:.1f}", "yes" if a.fits else "NO")
    console.print(table)
    for a in alts:
        if a.refused:
            console.print(f"  {a.name}: cannot run here: {a.refused}")
    return alts


def _print_precisions(model: Any, s: Strategy, system: SystemSpec) -> list[Any]:
    """``--precisions``: this strategy in every precision and FP8 recipe
    (``analysis.precisions``), fastest first, the strategy as given marked; the ones its GPU
    cannot run named with what it lacks."""
    from analysis.precisions import precision_rows

    rows = precision_rows(model, s, system)
    ran = [r for r in rows if not r.refused]
    mine = next((r.step_time_s for r in ran if r.current), None)
    table = Table(title=f"This strategy in each precision on {system.name} (fast path)")
    for col in ("precision", "step s", "vs this", "tokens/s", "memory GiB", "fits"):
        table.add_column(col, justify="left" if col == "precision" else "right")
    for r in ran:
        vs = "" if mine is None else ("this" if r.current else
                                      f"{r.step_time_s / mine - 1:+.1%}")
        table.add_row(r.name + (" ←" if r.current else ""), f"{r.step_time_s:.4f}", vs,
                      f"{r.tokens_per_s:,.0f}", f"{r.peak_memory_GiB:.1f}",
                      "yes" if r.fits else "NO")
    console.print(table)
    for r in rows:
        if r.refused:
            console.print(f"  {r.name}: cannot run here: {r.refused}")
    if any(r.name == "nvfp4" for r in ran):
        console.print("  nvfp4: its GEMM efficiency is an inference bench's; NVIDIA's NVFP4 "
                      "training runs measured 5-20% slower than trainsim predicts (README, "
                      "\"Reference sets\"): read its row as optimistic")
    return rows


def note_dualpipe_pairs(model: Any, s: Strategy, system: SystemSpec, step_s: float) -> None:
    """DualPipe-V on a MoE model with expert parallelism whose pairs run one after the other
    (PyTorch's runtime without an overlap function): what merging them, as torchtitan's
    overlap does (``--overlap-moe-expert-parallel-comm``), would give — the point of the
    schedule, which a plain DualPipe-V estimate leaves out."""
    if s.schedule != "dualpipe_v" or s.overlap_moe_ep_comm or s.ep < 2:
        return
    from analysis.fastpath import estimate

    try:
        merged = estimate(model, dataclasses.replace(s, overlap_moe_ep_comm=True), system)
    except ConfigError:  # (what combined 1F1B's merged pass refuses beside it)
        return
    console.print(f"note: DualPipe-V's paired passes run one after the other here (PyTorch's "
                  f"default); merged as torchtitan's overlap runs them "
                  f"(--overlap-moe-expert-parallel-comm): {merged.step_time_s:.4f} s a step "
                  f"({merged.step_time_s / step_s - 1:+.1%}), {merged.peak_memory_GiB:.1f} GiB")


def note_fsdp_pipeline(model: Any, s: Strategy, system: SystemSpec, step_s: float) -> None:
    """ZeRO-3 on a pipeline is costed as FSDP gathers without one: each block's parameters
    every micro-batch's forward and backward, its gradients reduce-scattered each backward.
    FSDP under PyTorch's pipelining (torchtitan's PP with FSDP) runs another pattern: its
    runtime unshards a stage before its first use and keeps it while at most three stages are
    active, and reduce-scatters once after the stage's last backward (``_add_unshard_reshard``,
    ``_add_reduce_grad``) — zero_stage 1 with overlapped parameter gathers, whose estimate is
    named beside (DESIGN.md, "Zero-bubble ZB-H1")."""
    if s.zero_stage != 3 or s.pp < 2:
        return
    from analysis.fastpath import estimate

    try:
        alt = estimate(model, dataclasses.replace(
            s, zero_stage=1, overlap_param_gather=True, zero3_prefetch=False,
            zero3_gather_bucket_params=0, outer_dp_sharding_strategy="no_shard"), system)
    except ConfigError:
        return
    console.print(f"note: ZeRO-3 on a pipeline is costed with FSDP's gathers every micro-batch; "
                  f"FSDP under PyTorch's pipelining (torchtitan) gathers each stage once a step "
                  f"and reduce-scatters after its last backward, as --zero 1 "
                  f"--overlap-param-gather runs: {alt.step_time_s:.4f} s a step "
                  f"({alt.step_time_s / step_s - 1:+.1%}), {alt.peak_memory_GiB:.1f} GiB"
                  f"{'' if alt.fits else ' (does not fit)'}")


SMALL_EXPERTS = 1.2  # a group this much slower than one GEMM of its FLOPs gets a note


def note_sites(model: Any, s: Strategy, system: SystemSpec) -> dict[str, Any] | None:
    """On a system of several sites, what crosses between them: the parallel groups (of any
    stage) that span sites and the pipeline hops that leave one. Returns that for the JSON, or
    None on one site (or a job inside one)."""
    from analysis.fastpath_costs import Costs
    from tracegen.dp_comm import dp_group_size

    site = system.scaleout.site_gpus
    if not site or s.world_size <= site:
        return None
    costs, per_stage = Costs(model, s, system), s.world_size // s.pp
    sizes = {"tp": s.tp, "cp": s.cp, "ep": s.ep, "dp": dp_group_size(s, "dp"),
             "edp": dp_group_size(s, "edp") if model.is_moe else 1}
    groups = [axis for axis, n in sizes.items() if n > 1 and any(
        costs.shape(axis, r)[4] > 1 for r in range(0, s.world_size, per_stage))]
    pairs = [(st, st + 1) for st in range(s.pp - 1)] + ([(s.pp - 1, 0)] if s.vpp > 1 else [])
    hops = sum(1 for a, b in pairs if any(  # a send goes from rank r to r's place on stage b
        r // site != (r + (b - a) * per_stage) // site
        for r in range(a * per_stage, (a + 1) * per_stage)))
    rates = {axis: costs.net.crossing_Bps(costs.shape(axis, _spanning_rank(costs, axis, s)),
                                          "ALL_TO_ALL" if axis == "ep" else "REDUCE_SCATTER")
             * 8 / 1e9 for axis in groups}
    if hops:
        rates["send"] = costs.net.send_crossing_Bps(per_stage) * 8 / 1e9
    nic = costs.net.nic.bytes_per_s * 8 / 1e9
    window = costs.net.site_window_Bps * 8 / 1e9

    def limit(g: float, links: str) -> str:
        """What sets a crossing rate of ``g`` Gb/s: the window, the NICs or the links."""
        if g >= window * (1 - 1e-12):
            return "its window over the round trip"
        return "its NICs'" if g >= nic * (1 - 1e-12) else links

    said = [f"{axis} {g:,.0f} Gb/s a flow ({limit(g, 'the links between the sites')})"
            for axis, g in rates.items() if axis != "send"]
    if hops:
        said.append(f"sends {rates['send']:,.1f} Gb/s a GPU ("
                    + limit(rates["send"], f"the links over a stage's {per_stage:,} GPUs")
                    + ")")
    console.print(f"{C.sites_words(system.scaleout, s.world_size)}: "
                  f"{', '.join(groups) or 'no parallel group'} spanning sites"
                  + (f", {hops} pipeline hop{'s' if hops > 1 else ''} between them" if hops
                     else "") + (f"; crossing at {', '.join(said)}" if said else ""))
    if s.pp > 1 and site % per_stage and per_stage % site:
        console.print(f"note: a site boundary falls inside a pipeline stage ({per_stage:,} GPUs a "
                      f"stage, {site:,} a site): some of its replicas' sends cross and others' "
                      "do not, and each hop is costed by the stage's first GPU's; a site of a "
                      "whole number of stages is what a split at the sites would run")
    return {"sites": -(-s.world_size // site), "groups_spanning_sites": groups,
            "pipeline_hops_between_sites": hops, "crossing_Gbps_per_flow": rates}


def note_documents(model: ModelSpec, s: Strategy, system: SystemSpec, step_s: float
                   ) -> dict[str, float] | None:
    """Under a document mask: its share of causal attention, and what the step waits on
    average for the data-parallel replica whose sequences attended most
    (``analysis.data_stragglers``; not in the step). None without one."""
    from analysis.data_stragglers import data_straggler

    if model.document_mask is None:
        return None
    console.print(f"document mask: {model.document_summary()} (MFU counts those pairs)")
    d = data_straggler(model, s, system)
    if d is None:
        return None
    console.print(_uneven_sentence(d, step_s))
    return dataclasses.asdict(d)


def note_gpu_spread(model: ModelSpec, s: Strategy, system: SystemSpec, sd: float,
                    step_s: float) -> dict[str, float]:
    """What a spread of per-GPU speed makes the step wait for its slowest GPUs
    (``analysis.gpu_spread``; not in the step)."""
    from analysis.gpu_spread import check_sd, spread_wait

    w = spread_wait(model, s, system, check_sd(sd, what="--gpu-spread"))
    inside = (f", {w.replica_s:.4f} s of it a replica's own slowest stages"
              if s.dp > 1 and w.replica_s else "")
    console.print(f"GPUs {w.sd:.1%} apart in speed (1 sd): each step waits ~{w.wait_s:.4f} s "
                  f"({w.wait_s / step_s:+.1%}) on average beyond the step above for the slowest "
                  f"of its {w.gpus:,} GPUs{inside} (a tensor-parallel group waits for its "
                  "slowest GPU, a pipeline for its slowest stage, the replicas for the slowest)")
    return dataclasses.asdict(w)


def _uneven_sentence(d: Any, step_s: float) -> str:
    """``note_documents``'s sentence: the variation, then what the step waits for — the
    slowest replica, and the bubbles uneven micro-batches leave in a replica's pipeline."""
    if d.replicas == 1 and not d.pipeline_s:
        return "one data-parallel replica and no pipeline: nothing waits for uneven sequences"
    spread = (f"sequences attend unevenly under it: a replica's attention varies by "
              f"{d.variation:.1%} a step (1 sd; {d.sequences:,} "
              f"sequence{'' if d.sequences == 1 else 's'} a replica), so ")
    wait = f"~{d.wait_s:.4f} s ({d.wait_s / step_s:+.1%}) on average beyond the step above"
    if d.replicas == 1:
        what = f"uneven micro-batches leave bubbles in the pipeline: the step takes {wait}"
    else:
        inside = (f", of which {d.pipeline_s:.4f} s is the bubbles uneven micro-batches leave "
                  f"in a replica's pipeline" if d.pipeline_s else "")
        what = (f"the slowest of {d.replicas:,} replicas keeps the step waiting {wait}"
                f"{inside}")
    return spread + what + " (packing by attention work, as WLB-LLM does, removes it)"


ATTENTION_NOTE_SHARE = 0.3  # (below it the causal count's MFU is within 15% of this one)


def note_attention_count(model: ModelSpec, s: Strategy, mfu: float) -> None:
    """Where attention weighs in the model FLOP count (long sequences), say that MFU counts it
    full, as Megatron-LM and the published MFUs do, and what counting a causal layer's half
    would give."""
    from tracegen.flops import attention_share

    share = attention_share(model, s.global_batch_size)
    if share >= ATTENTION_NOTE_SHARE:
        console.print(f"note: MFU counts attention in full, as Megatron-LM's count (and the "
                      f"published MFUs it is compared with) does; attention is {share:.0%} of "
                      f"that count here, and counting the causal half a layer computes, MFU "
                      f"would be {mfu * (1 - share / 2):.1%}")


def _spanning_rank(costs: Any, axis: str, s: Strategy) -> int:
    """A rank whose ``axis`` group spans sites (the first stage's first such)."""
    per_stage = s.world_size // s.pp
    return next(r for r in range(0, s.world_size, per_stage) if costs.shape(axis, r)[4] > 1)


def note_grad_stream(model: Any, s: Strategy, system: SystemSpec) -> dict[str, Any] | None:
    """With every micro-batch's gradients reduced: how long one micro-batch's reductions hold
    the data-parallel stream against its compute, and how long the step waits for them after
    its last backward — the network binds the step where they outlast the compute. Returns
    ``grad_stream.stream_summary`` for the JSON (None where nothing is reduced so)."""
    from analysis.grad_stream import stream_summary

    got = stream_summary(model, s, system)
    if got is None:
        return None
    r, c = got["reduce_s_per_microbatch"], got["compute_s_per_microbatch"]
    bound = (": the network binds the step (16-bit reductions, --grad-reduce-bf16, halve their "
             "bytes; a larger micro-batch makes fewer of them)" if r > c else "")
    console.print(f"gradients reduced in every micro-batch: {r * 1e3:,.1f} ms of collectives a "
                  f"micro-batch on stage {got['stage']}'s data-parallel stream against "
                  f"{c * 1e3:,.1f} ms of its compute; the stream drains "
                  f"{got['wait_after_last_backward_s']:.3f} s after its last backward{bound}")
    return got


LOSS_NOTE_SHARE = 0.01  # the fused losses are named where one saves this share of the step


def note_loss(model: Any, s: Strategy, system: SystemSpec, g: Glance
              ) -> dict[str, dict[str, float]] | None:
    """With the unfused loss (Megatron-LM's default): the step and peak memory Megatron-Core's
    fused loss (Megatron-Bridge's and NeMo 2's default) and Transformer Engine's would give,
    said where one saves at least ``LOSS_NOTE_SHARE`` of the step. Returns them for the JSON
    (None where the loss is fused already or the saving is smaller)."""
    if s.cross_entropy_fusion != "none":
        return None
    from analysis.fastpath import estimate

    alt = {}
    for impl in ("native", "te"):
        e = estimate(model, dataclasses.replace(s, cross_entropy_fusion=impl), system)
        alt[impl] = {"step_time_s": e.step_time_s, "peak_memory_GiB": e.peak_memory_GiB}
    if g.step_time_s - alt["te"]["step_time_s"] < LOSS_NOTE_SHARE * g.step_time_s:
        return None

    def change(impl: str) -> str:
        step = alt[impl]["step_time_s"]
        return f"{step:.4f} s ({step / g.step_time_s - 1:+.1%})"

    less = g.peak_memory_GiB - alt["te"]["peak_memory_GiB"]
    console.print(f"note: the loss runs unfused (Megatron-LM's default); Megatron-Core's fused "
                  f"loss (--cross-entropy-fusion native, Megatron-Bridge's and NeMo 2's default) "
                  f"gives {change('native')}, Transformer Engine's (te) {change('te')}"
                  + (f" and {less:.2f} GiB less at peak" if less >= 0.01 else ""))
    return alt


def note_partial_domain(s: Strategy, system: SystemSpec) -> None:
    """Where the GPUs do not fill whole NVLink domains (a 256-GPU job on 72-GPU racks): rank r
    sits in domain r // gpus_per_node, so the last is part-filled and groups straddle the
    boundaries over the NICs — said, with how to describe a job placed otherwise."""
    g, n = system.node.gpus_per_node, s.world_size
    if n <= g or not n % g:
        return
    full = f"{n // g:,} NVLink domain" + ("s" if n // g > 1 else "")
    console.print(f"note: {n:,} GPUs fill {full} of {g} and {n % g} GPUs of "
                  f"another; ranks are placed domain by domain, so groups that straddle a "
                  f"boundary go over the NICs. A job placed in smaller blocks (Megatron-Bridge "
                  f"runs 256 GPUs on GB200 as four 64-GPU Slurm segments) is that block size as "
                  f"gpus_per_node in a copy of the system file (`trainsim systems "
                  f"{system.name} > mine.toml`)")


def _against_none(model: Any, s: Strategy, system: SystemSpec, g: Glance, **off: Any
                  ) -> tuple[dict[str, float], float]:
    """An offloading against none (``off``: the fields that turn it off): the memory it frees
    at peak and the step without it (for the JSON), and the step's relative cost."""
    from analysis.fastpath import estimate

    none = estimate(model, dataclasses.replace(s, **off), system)
    return ({"freed_GiB": none.peak_memory_GiB - g.peak_memory_GiB,
             "step_time_s_without": none.step_time_s}, g.step_time_s / none.step_time_s - 1)


def note_offload(model: Any, s: Strategy, system: SystemSpec, g: Glance
                 ) -> dict[str, float] | None:
    """With activation offloading: a layer's copy over the host link, and what the offloading
    saves at peak and costs in step time against none (for the JSON; None without it)."""
    if not s.cpu_offload_layers:
        return None
    from tracegen.memory import activation_bytes_per_layer

    size = activation_bytes_per_layer(model, s)
    copy_ms = size / (system.node.host_link_GBps * 1e9) * 1e3
    out, cost = _against_none(model, s, system, g, cpu_offload_layers=0)
    out |= {"layers": s.cpu_offload_layers, "layer_bytes": size, "copy_ms": copy_ms,
            "host_link_GBps": system.node.host_link_GBps}
    console.print(f"activation offloading: the first {s.cpu_offload_layers} layers' "
                  f"{size / GiB:.2f} GiB a micro-batch each go to host memory and back at "
                  f"{system.node.host_link_GBps:g} GB/s ({copy_ms:.1f} ms a copy): "
                  f"{out['freed_GiB']:.1f} GiB less at peak, the step {cost:+.1%} against none"
                  + (" (the copies hide behind compute)" if abs(cost) < 0.001 else ""))
    return out


def note_optimizer_offload(model: Any, s: Strategy, system: SystemSpec, g: Glance
                           ) -> dict[str, float] | None:
    """With optimizer offloading: the CPU's share of the busiest shard, its AdamW time at the
    host's rate, and what the offloading frees and costs against none (None without it)."""
    f = s.optimizer_offload_fraction
    if not f:
        return None
    from tracegen.dp_comm import sharded_params
    from tracegen.program import RoleProgram

    shard = max(sharded_params(s, RoleProgram(model, s, st).stage_params())
                for st in range(s.pp))
    on_cpu = O.offloaded_shares(s, shard)[1]
    cpu_s = on_cpu * O.CPU_ADAM_BYTES_PER_PARAM / (system.node.host_cpu_GBps * 1e9)
    out, cost = _against_none(model, s, system, g, optimizer_offload_fraction=0.0)
    out |= {"fraction": f, "cpu_params": on_cpu, "cpu_adam_s": cpu_s,
            "host_cpu_GBps": system.node.host_cpu_GBps}
    console.print(f"optimizer offloading: {f:.0%} of a rank's optimizer shard ({on_cpu / 1e9:.2f} "
                  f"B parameters) updated by the CPU's AdamW at {system.node.host_cpu_GBps:g} GB/s "
                  f"of host memory ({cpu_s:.2f} s a step): {out['freed_GiB']:.1f} GiB less at "
                  f"peak, the step {cost:+.1%} against none")
    return out


def note_small_experts(model: Any, s: Strategy, system: SystemSpec) -> dict[str, Any] | None:
    """Where a rank's local experts each get few tokens, their GEMMs (one after another, each
    on its own tiles: measured so on an H200, ``tests/test_device_moe_evidence.py``) take
    noticeably longer than one GEMM of the same FLOPs: say by how much, and what gives each
    expert more tokens. Returns the group (experts, tokens each, the factor) for the JSON, or
    None where a rank holds one expert or none."""
    if not model.is_moe:
        return None
    fc1 = next((it for it in O.layer_fwd(model, s) if isinstance(it, O.Op)
                and it.name == "expert_fc1" and it.groups > 1), None)
    if fc1 is None:
        return None
    compute = RooflineCompute(system.gpu)
    one = O.gemm("one", fc1.flop // (2 * fc1.n * fc1.k), fc1.n, fc1.k, fc1.dtype)
    ratio = compute.op_time_ns(fc1) / compute.op_time_ns(one)
    if ratio >= SMALL_EXPERTS:
        console.print(f"note: each of a rank's {fc1.groups} local experts runs {fc1.m:,} tokens "
                      f"a micro-batch: their GEMMs, one after another, take {ratio:.2f}x one "
                      "GEMM of the same FLOPs; fewer experts a rank (a larger --ep) or a "
                      "larger micro-batch gives each more")
    return {"local_experts": fc1.groups, "tokens_per_expert": fc1.m,
            "fc1_over_one_gemm": ratio}


def print_mixed(m: Any) -> None:
    """The mixed cluster's step beside the all-base one printed above, and each stage's GPU."""
    verdict = "fits" if m.fits else "[bold red]DOES NOT FIT[/]"
    console.print(
        f"[bold]mixed cluster[/]: step time [bold]{m.step_time_s:.4f} s[/] "
        f"({m.step_time_s / m.base_step_time_s:.2f}× the step above; each stage costed on its "
        f"own GPUs, the schedule walked with them): {m.tokens_per_s:,.0f} tokens/s, MFU "
        f"{m.mfu:.1%} of the GPUs' mean peak; memory {verdict} on every stage's own GPU")
    table = Table(title="Per pipeline stage on its own GPUs (one micro-batch)")
    for col in ("stage", "system", "fwd+bwd ms", "memory GiB", "GPU GiB", "fits"):
        table.add_column(col, justify="right")
    for j, name in enumerate(m.stage_systems):
        mem, cap = m.stage_memory_GiB[j], m.stage_capacity_GiB[j]
        table.add_row(str(j), name, f"{m.stage_time_s[j] * 1e3:.2f}", f"{mem:.1f}", f"{cap:g}",
                      "yes" if mem <= cap else "[bold red]no[/]")
    console.print(table)


def _print_mixed_hints(model: Any, s: Strategy, system: SystemSpec, chosen: dict[int, str]
                       ) -> None:
    """What recomputation and what sharding would make the mixed cluster's stages fit, each
    candidate costed on them with its layers split by speed (``mixed.stages_cost``)."""
    from analysis.glance import fit_advice, fit_hints
    from analysis.mixed import balanced_layout, stages_cost

    found = fit_hints(model, s, system, cost=stages_cost(model, system, chosen))
    advice = fit_advice(*found, s)
    for hint, what, flags, _ in advice:
        fields = {k: v for k, v in hint.items() if k not in ("step_time_s", "peak_memory_GiB")}
        split = balanced_layout(model, dataclasses.replace(s, **fields), system, chosen)
        layout = f" --pipeline-layout '{split[0].pipeline_layout}'" if split else ""
        console.print(f"on the mixed cluster it fits with {what} ({flags}{layout}): up to "
                      f"{hint['peak_memory_GiB']:.1f} GiB a GPU, {hint['step_time_s']:.4f} s "
                      "a step")
    if not advice:
        console.print("on the mixed cluster neither recomputation nor ZeRO sharding makes "
                      "every stage fit: shard more (tp, pp) or put fewer stages on the "
                      "smaller GPUs")


def _placed_stages(model: Any, s: Strategy, system: SystemSpec, text: str) -> str:
    """``--mixed GPUS=SYSTEM`` as the ``--stage-system`` of its placement (``mixed.place``),
    said on the console."""
    from analysis.mixed import place
    from replay import resolve_system

    count, sep, ref = text.partition("=")
    if not sep or not ref or not count.strip().isdigit() or int(count) < 1:
        raise ConfigError(f"--mixed {text!r}: give GPUS=SYSTEM, how many of the GPUs are on "
                          "another system's nodes (e.g. 512=dgx-a100-80gb)",
                          what="mixed cluster")
    placed = place(model, s, system, resolve_system(ref), int(count), ref=ref)
    chosen = placed.stage_systems
    where = "first" if placed.stages[0] == 0 else "last"
    console.print(f"--mixed {text}: the {where} {len(placed.stages)} stage(s) "
                  f"(--stage-system {chosen}), of the first and the last the faster with the "
                  "layers split by the stages' speeds")
    return chosen


def _print_balanced(model: Any, s: Strategy, system: SystemSpec, chosen: dict[int, str],
                    mixed: Any) -> Any:
    """The layer split by the stages' speeds, where it shortens the mixed step (returned:
    ``mixed.balanced_layout``'s strategy and estimate, or None)."""
    from analysis.mixed import balanced_layout

    found = balanced_layout(model, s, system, chosen)
    if found is None:
        if s.pp > 1:
            console.print("[dim](no split of the layers by the stages' speeds shortens the "
                          "step: a layer moved off the slowest stage would leave one of its "
                          f"{s.vpp} chunk(s) empty, or another stage over its GPU's memory)[/]")
        return None
    bs, be = found
    console.print(f"layers split by the stages' speeds: --pipeline-layout '{bs.pipeline_layout}'"
                  f" → {be.step_time_s:.4f} s ({be.step_time_s / mixed.step_time_s:.2f}× the "
                  f"even split), {be.tokens_per_s:,.0f} tokens/s, up to "
                  f"{max(be.stage_memory_GiB):.1f} GiB a GPU"
                  + ("" if be.fits else " ([bold red]DOES NOT FIT[/] on every stage's GPU)")
                  + " (Megatron-Core's --pipeline-model-parallel-layout)")
    return found


def _write_ops(table: pl.DataFrame, system: SystemSpec, out: Path | None,
               plot: Path | None, precision: str) -> None:
    if out is not None:
        write_table(table, out)
        console.print(f"op table ({table.height} rows) → {out}")
    if plot is not None:
        from analysis.plots import roofline

        roofline(table, system.gpu, dtype=precision).savefig(plot, dpi=120)
        console.print(f"roofline → {plot}")


OPS_SHOWN = 60  # rows of the op table printed; --ops-out has them all


def print_ops(table: pl.DataFrame) -> None:
    """The op table as the stage spends its time: the largest rows first where it is long,
    then the time per pass and kind (``op_table.by_kind``)."""
    stage = int(table["stage"][0]) if table.height else 0
    shown = table.with_columns((pl.col("time_us") * pl.col("count") / 1e3).alias("stage_ms"))
    if shown.height > OPS_SHOWN:
        shown = shown.sort("stage_ms", descending=True).head(OPS_SHOWN)
    out = Table(title=f"Stage {stage}, one micro-batch, op by op (time per op; × count for the "
                      "stage)")
    for col in ("block", "×", "pass", "op", "kind", "shape m×n×k", "µs", "TFLOP/s", "eff",
                "bound"):
        out.add_column(col, justify="left" if col in ("block", "pass", "op", "kind", "bound")
                       else "right")
    for r in shown.iter_rows(named=True):
        shape = f"{r['m']}×{r['n']}×{r['k']}" if r["m"] else (r["axis"] or "")
        if (r.get("groups") or 1) > 1:  # a group of experts' GEMMs, one after another
            shape = f"{r['groups']} × {shape}"
        out.add_row(r["block"], str(r["count"]), r["pass"], r["op"]
                    + (" [dim](overlapped)[/]" if r["overlapped"] else ""), r["kind"], shape,
                    f"{r['time_us']:,.1f}",
                    f"{r['achieved_tflops']:,.1f}" if r["achieved_tflops"] else "",
                    f"{r['efficiency']:.0%}" if r["efficiency"] else "", r["bound"])
    console.print(out)
    if table.height > OPS_SHOWN:
        console.print(f"[dim]the {OPS_SHOWN} largest of {table.height} rows; --ops-out FILE "
                      "writes them all[/]")
    kinds = Table(title=f"Stage {stage}, one micro-batch, by kind")
    for col in ("pass", "kind", "ms", "share"):
        kinds.add_column(col, justify="right" if col in ("ms", "share") else "left")
    for r in by_kind(table).iter_rows(named=True):
        share = (f"{r['share_pct']:.1f}%" if r["share_pct"] is not None
                 else "[dim]overlapped[/]")
        kinds.add_row(r["pass"], r["kind"], f"{r['time_ms']:,.2f}", share)
    console.print(kinds)


def print_glance(g: Glance, s: Strategy, alone: bool = False,
                 model: ModelSpec | None = None) -> None:
    """The fast path's step, memory and per-stage table; ``alone``: a mixed cluster's
    estimate follows, so the hints say they are for the base system alone."""
    console.print(f"[bold]{g.model}[/] {g.strategy} on {g.system} ({s.world_size:,} GPUs; "
                  f"{s.num_microbatches} micro-batch{'es' if s.num_microbatches > 1 else ''}, "
                  f"{s.schedule}"
                  + (f" in groups of {s.schedule_group}" if s.schedule_group else "")
                  + (" combined (expert all-to-alls beside the other micro-batch's compute"
                     + (", weight gradients deferred)" if s.delay_wgrad_compute else ")")
                     if s.overlap_moe_ep_comm else "")
                  + f", recompute {s.recompute}"
                  + (" (first layer of each chunk)" if s.recompute_num_layers == 1 else
                     f" (first {s.recompute_num_layers} layers of each chunk)"
                     if s.recompute_num_layers else "")
                  + (f" ({s.recompute_modules.replace(',', ', ')})"
                     if s.recompute == "selective" else "") + ", "
                  f"ZeRO {s.zero_stage}, {s.precision}"
                  + (f" ({RECIPE_WORDS[s.fp8_recipe]})"
                     if s.precision == "fp8" and s.fp8_recipe != "delayed" else "")
                  + (f", {s.dist_opt_instances} optimizer instances of "
                     f"{s.dp * s.cp // s.dist_opt_instances} ranks"
                     + (" (HFSDP)" if s.hfsdp else " (HSDP)" if s.zero_stage == 3 else "")
                     if s.dist_opt_instances > 1 else "")
                  + (", gradients reduced in bf16" if s.grad_reduce_in_bf16 else "")
                  + (f", Adam moments in {s.adam_moments_dtype}"
                     if s.adam_moments_dtype != "fp32" else "")
                  + (", parameters gathered in FP8" if s.fp8_param_gather else "")
                  + _split_words(s) + ")")
    console.print(f"step time [bold]{g.step_time_s:.4f} s[/] (fast path; pipeline "
                  f"{g.pipeline_s:.4f} s, the busiest stage idle {g.pipeline_idle:.1%} of it): "
                  f"{g.tokens_per_s:,.0f} tokens/s, MFU {g.mfu:.1%}, HFU {g.hfu:.1%}")
    if model is not None:
        note_attention_count(model, s, g.mfu)
    if g.interference_s > 0:
        console.print(f"of which {g.interference_s:.4f} s is compute slowed beside overlapped "
                      f"collectives (interference; {g.interference_s / g.step_time_s:.1%} of "
                      "the step)")
    verdict = ("fits" if g.peak_memory_GiB <= g.capacity_GiB else "[bold red]DOES NOT FIT[/]")
    console.print(f"peak memory {g.peak_memory_GiB:.1f} GiB per GPU: {verdict} in "
                  f"{g.capacity_GiB:g} GiB")
    if g.peak_host_memory_GiB:
        console.print(_host_line(g))
    if not g.fits:
        for line in _fit_hint_lines(g, s):
            console.print(f"on {g.system} alone {line}" if alone else line)
    if g.instances_hint is not None:
        h = g.instances_hint
        n = h["dist_opt_instances"]
        console.print(f"with {n:,} distributed-optimizer instance{'s' if n > 1 else ''} "
                      f"(--dist-opt-instances {n}): {h['step_time_s']:.4f} s a step "
                      f"({h['step_time_s'] / g.step_time_s - 1:+.1%}), "
                      f"{h['peak_memory_GiB']:.1f} GiB")
    table = Table(title="Per pipeline stage (one micro-batch; memory per GPU in GiB)")
    for col in ("stage", "layers", "fwd ms", "bwd ms", *MEMORY_COLUMNS, "runtime+alloc",
                "total"):
        table.add_column(col, justify="right")
    for st in g.stages:
        mem = st.memory
        parts = [getattr(mem, f"{c}_bytes") / GiB for c in MEMORY_COLUMNS]
        other = (mem.runtime_bytes + mem.fragmentation_bytes) / GiB
        total = mem.total_bytes / GiB
        total_cell = (f"[bold red]{total:.1f}[/]" if total > g.capacity_GiB else f"{total:.1f}")
        mtp = f" +{st.mtp_layers} MTP" if st.mtp_layers else ""
        table.add_row(str(st.stage), f"{st.layers}{mtp}", f"{st.fwd_s * 1e3:.2f}",
                      f"{st.bwd_s * 1e3:.2f}",
                      *[f"{x:.2f}" for x in parts], f"{other:.2f}", total_cell)
    console.print(table)
    console.print("[dim]The fast path (closed forms, or the schedule walked pass by pass; no "
                  "event loop); `trainsim tracegen` then `trainsim replay` gives the simulated "
                  "timeline and the compute / communication split.[/]")


def _host_line(g: Glance) -> str:
    """What offloading keeps in one host's memory against what the host has."""
    need = g.peak_host_memory_GiB or 0.0
    head = (f"host memory {need:,.1f} GiB a host (what its GPUs offload: optimizer state, "
            "activations)")
    if not g.host_capacity_GiB:
        return head + ": not checked (the system gives no host_memory_GiB)"
    if need <= g.host_capacity_GiB:
        return head + f": fits in {g.host_capacity_GiB:,g} GiB"
    return (head + f": [bold red]DOES NOT FIT[/] in {g.host_capacity_GiB:,g} GiB — offload "
            "less (fewer --cpu-offload-layers, a smaller --optimizer-offload-fraction) or "
            "shard the optimizer over more ranks")


def _fit_hint_lines(g: Glance, s: Strategy) -> list[str]:
    """What recomputation and what sharding would make a strategy that does not fit fit
    (``glance.fit_hints``), each with its step and memory."""
    lines = [f"it fits with {what} ({flags}): {hint['peak_memory_GiB']:.1f} GiB, "
             f"{hint['step_time_s']:.4f} s a step"
             for hint, what, flags, _ in fit_advice(g.fit_hint, g.shard_hint, s)]
    flags = {"zb_w_regather": "--zb-w-regather",
             "1f1b": "--schedule 1f1b" + (" --vpp 1" if s.v_shape else "")
             + (" without --overlap-moe-expert-parallel-comm" if s.overlap_moe_ep_comm else "")}
    zb = [f"with {flags[name]}: {h['peak_memory_GiB']:.1f} GiB "
          f"({'fits' if h['fits'] else 'does not fit'}), {h['step_time_s']:.4f} s a step"
          for name, h in (g.zb_hint or {}).items()]
    return (lines or ["neither recomputation nor ZeRO sharding makes it fit: shard more (tp, pp)"
                      + (" or lower the micro-batch" if s.micro_batch_size > 1 else "")]) + zb


def _split_words(s: Strategy) -> str:
    """The header's words for an uneven pipeline: the first and last chunk's layers where set,
    Megatron-Core's account-for-embedding/loss split."""
    ends = [f"{w} chunk {n} layer{'s' if n != 1 else ''}"
            for w, n in (("first", s.first_stage_layers), ("last", s.last_stage_layers)) if n]
    counted = [w for w, on in (("embedding", s.account_for_embedding_in_pipeline_split),
                               ("loss", s.account_for_loss_in_pipeline_split)) if on]
    return ("".join(f", {e}" for e in ends)
            + (f", {' and '.join(counted)} counted as layers in the split" if counted else ""))


def _per_microbatch_s(spec: Any, s: Strategy, system: SystemSpec) -> float:
    """ZeRO-2 reducing once a step: its step with every micro-batch's buckets reduced (as
    DeepSpeed and FSDP's SHARD_GRAD_OP run it), or 0 where that is not modelled with it."""
    if s.zero_stage != 2 or s.grad_reduce_per_microbatch:
        return 0.0
    try:
        theirs = dataclasses.replace(s, grad_reduce_per_microbatch=True)
    except ConfigError:
        return 0.0
    from analysis.fastpath import estimate

    return estimate(spec, theirs, system).step_time_s
