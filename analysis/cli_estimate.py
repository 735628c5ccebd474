"""``trainsim estimate``: one strategy's step time, throughput and memory from the fast path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from analysis import cli_common as C
from analysis.cli_common import (
    app,
    build_strategy,
    console,
    note_param_gather,
    note_precision,
    output_file,
)
from analysis.glance import Glance, fit_hint_words, glance
from tracegen import Strategy, resolve_model
from tracegen.units import GiB

MEMORY_COLUMNS = ("weights", "gradients", "optimizer", "activations", "logits", "transient")


@app.command("estimate")
def estimate_cmd(
    model: C.ModelOpt, gpus: C.GpusOpt, mbs: C.MbsOpt, gbs: C.GbsOpt,
    system: Annotated[str, typer.Option(help="Preset system (see `trainsim systems`) or a TOML "
                                             "system file; append @KERNEL for an earlier "
                                             "attention kernel, e.g. "
                                             "dgx-h100@flashattention-2.")],
    tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, vpp: C.VppOpt = 1, sp: C.SpOpt = False,
    tp_comm_overlap: C.TpOverlapOpt = False, schedule: C.ScheduleOpt = "1f1b",
    recompute: C.RecomputeOpt = "none", zero: C.ZeroOpt = 0,
    overlap_param_gather: C.ParamGatherOpt = False, precision: C.PrecisionOpt = "bf16",
    first_stage_layers: C.FirstLayersOpt = 0, last_stage_layers: C.LastLayersOpt = 0,
    account_for_embedding: C.EmbSplitOpt = False, account_for_loss: C.LossSplitOpt = False,
    microbatch_group_size: C.GroupOpt = 0, recompute_num_layers: C.RecomputeLayersOpt = 0,
    recompute_modules: C.ModulesOpt = "core_attn",
    grad_reduce_bf16: C.GradBf16Opt = False, cp_comm_type: C.CpCommOpt = "p2p",
    expert_tp: C.ExpertTpOpt = 0, zero3_prefetch: C.Zero3PrefetchOpt = False,
    moe_dispatcher: C.MoeDispatcherOpt = "alltoall",
    moe_shared_expert_overlap: C.SharedOverlapOpt = False, pipeline_layout: C.LayoutOpt = "",
    adam_moments: C.AdamMomentsOpt = "fp32", fp8_param_gather: C.Fp8GatherOpt = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the estimate as "
                                                  "JSON to this file.")] = None,
) -> None:
    """Step time, tokens/s, MFU and per-stage memory of one strategy (fast path; milliseconds)."""
    from replay import resolve_system

    json_out = output_file(json_out, "--json")
    spec = resolve_model(model)
    strategy = build_strategy(
        gpus=gpus, tp=tp, pp=pp, cp=cp, ep=ep, vpp=vpp, sp=sp, tp_comm_overlap=tp_comm_overlap,
        mbs=mbs, gbs=gbs, schedule=schedule, recompute=recompute, zero=zero,
        overlap_param_gather=overlap_param_gather, precision=precision,
        first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers,
        grad_reduce_bf16=grad_reduce_bf16, cp_comm_type=cp_comm_type, expert_tp=expert_tp,
        zero3_prefetch=zero3_prefetch, account_for_embedding=account_for_embedding,
        account_for_loss=account_for_loss, microbatch_group_size=microbatch_group_size,
        recompute_num_layers=recompute_num_layers, recompute_modules=recompute_modules,
        moe_dispatcher=moe_dispatcher, moe_shared_expert_overlap=moe_shared_expert_overlap,
        pipeline_layout=pipeline_layout, adam_moments=adam_moments,
        fp8_param_gather=fp8_param_gather)
    sys_spec = resolve_system(system)
    g = glance(spec, strategy, sys_spec)
    print_glance(g, strategy)
    note_param_gather(strategy)
    note_precision({strategy.precision}, sys_spec)
    if json_out is not None:
        # every field of the strategy, for what the label leaves out (moments, FP8 gathers…)
        out = {**g.to_dict(), "strategy_fields": strategy.to_dict()}
        json_out.write_text(json.dumps(out, indent=1) + "\n")


def print_glance(g: Glance, s: Strategy) -> None:
    console.print(f"[bold]{g.model}[/] {g.strategy} on {g.system} ({s.world_size:,} GPUs; "
                  f"{s.num_microbatches} micro-batches, {s.schedule}"
                  + (f" in groups of {s.schedule_group}" if s.schedule_group else "")
                  + f", recompute {s.recompute}"
                  + (" (first layer of each chunk)" if s.recompute_num_layers == 1 else
                     f" (first {s.recompute_num_layers} layers of each chunk)"
                     if s.recompute_num_layers else "")
                  + (f" ({s.recompute_modules.replace(',', ', ')})"
                     if s.recompute == "selective" else "") + ", "
                  f"ZeRO {s.zero_stage}, {s.precision}"
                  + (", gradients reduced in bf16" if s.grad_reduce_in_bf16 else "")
                  + (f", Adam moments in {s.adam_moments_dtype}"
                     if s.adam_moments_dtype != "fp32" else "")
                  + (", parameters gathered in FP8" if s.fp8_param_gather else "")
                  + _split_words(s) + ")")
    console.print(f"step time [bold]{g.step_time_s:.4f} s[/] (fast path; pipeline "
                  f"{g.pipeline_s:.4f} s, the busiest stage idle {g.pipeline_idle:.1%} of it): "
                  f"{g.tokens_per_s:,.0f} tokens/s, MFU {g.mfu:.1%}, HFU {g.hfu:.1%}")
    if g.interference_s > 0:
        console.print(f"of which {g.interference_s:.4f} s is compute slowed beside overlapped "
                      f"collectives (interference; {g.interference_s / g.step_time_s:.1%} of "
                      "the step)")
    verdict = "fits" if g.fits else "[bold red]DOES NOT FIT[/]"
    console.print(f"peak memory {g.peak_memory_GiB:.1f} GiB per GPU: {verdict} in "
                  f"{g.capacity_GiB:g} GiB")
    if not g.fits:
        console.print(_fit_hint_line(g.fit_hint, s))
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
    console.print("[dim]The fast path's closed form; `trainsim tracegen` then `trainsim replay` "
                  "gives the simulated timeline and the compute / communication split.[/]")


def _fit_hint_line(hint: dict[str, Any] | None, s: Strategy) -> str:
    """What recomputation would make a strategy that does not fit fit (``fit_by_recompute``)."""
    if hint is None:
        return ("no recomputation makes it fit: shard more (tp, pp, ZeRO)"
                + (" or lower the micro-batch" if s.micro_batch_size > 1 else ""))
    what, flags, _ = fit_hint_words(hint)
    return (f"it fits with {what} ({flags}): {hint['peak_memory_GiB']:.1f} GiB, "
            f"{hint['step_time_s']:.4f} s a step")


def _split_words(s: Strategy) -> str:
    """The header's words for Megatron-Core's account-for-embedding/loss split, if set."""
    counted = [w for w, on in (("embedding", s.account_for_embedding_in_pipeline_split),
                               ("loss", s.account_for_loss_in_pipeline_split)) if on]
    return f", {' and '.join(counted)} counted as layers in the split" if counted else ""
