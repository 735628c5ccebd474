"""The ``trainsim`` command line. Catches only trainsim's own errors and prints them plainly."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import polars as pl
import typer
from rich.console import Console
from rich.table import Table

from analysis import cli_common as C
from analysis.cli_common import (
    app,
    build_strategy,
    console,
    note_combined_1f1b,
    note_param_gather,
    note_precision,
    output_dir,
    output_file,
    progress_bar,
    table_file,
    write_table,
)
from analysis.replay_size import MAX_REPLAY_NODES
from tracegen import (
    ConfigError,
    ModelSpec,
    Strategy,
    TrainsimError,
    generate,
    model_names,
    resolve_model,
)
from tracegen.catalog import get_model, model_source, model_toml
from tracegen.traceset import TraceSetSummary
from tracegen.units import GiB


@app.command("catalog")
def catalog_cmd(name: Annotated[str | None, typer.Argument(
        help="A preset: print it as a model file to edit (trainsim catalog llama3-70b > "
             "mine.toml; then --model mine.toml)")] = None) -> None:
    """List the preset models (or print one as a model file)."""
    if name is not None:
        sys.stdout.write(model_toml(name))
        return
    table = Table(title="Preset models")
    for col in ("name", "params (B)", "layers", "hidden", "heads/kv", "ffn", "experts", "vocab",
                "seq", "dropout", "source"):
        table.add_column(col)
    for name in model_names():
        m = get_model(name)
        layers = str(m.num_layers) + (f" +{m.mtp_layers} MTP" if m.mtp_layers else "")
        table.add_row(name, f"{m.num_params() / 1e9:.1f}", layers, str(m.hidden_size),
                      f"{m.num_attention_heads}/{m.num_kv_heads}", str(m.ffn_hidden_size),
                      _experts(m), str(m.vocab_size), str(m.seq_len), f"{m.dropout:g}",
                      model_source(name))
    console.print(table)
    windows = [f"{name} {get_model(name).window_summary()}" for name in model_names()
               if get_model(name).window]
    if windows:
        console.print("Sliding-window attention: " + "; ".join(windows))


def _experts(m: ModelSpec) -> str:
    """A MoE model's experts in a catalog cell: routed × width, top-k (within groups), shared,
    dense first."""
    if not m.is_moe:
        return "–"
    return (f"{m.num_experts}×{m.moe_ffn_hidden_size} top-{m.experts_per_token}"
            + (f" in {m.moe_router_group_topk} of {m.moe_router_num_groups} groups"
               if m.moe_router_num_groups else "")
            + (f" +{m.shared_expert_ffn_hidden_size} shared" if m.shared_expert_ffn_hidden_size
               else "")
            + (f", first {m.first_dense_layers} dense" if m.first_dense_layers else "")
            + (f", layers {m.moe_layer_pattern} (M: MoE)" if m.moe_layer_pattern else ""))


@app.command("tracegen", cls=C.OptionsOnly)
def tracegen_cmd(
    ctx: typer.Context,
    model: C.ModelOpt, gpus: C.GpusOpt, mbs: C.MbsOpt, gbs: C.GbsOpt,
    out: Annotated[Path, typer.Option("-o", "--out", help="Output directory.",
                                      rich_help_panel=C.PANEL_OUT)],
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
    mode: Annotated[str, typer.Option(help="full | representative",
                                      rich_help_panel=C.PANEL_OUT)] = "representative",
    system: Annotated[str | None, typer.Option(help="Flag ranks whose estimated memory exceeds "
                                                    "this system's GPU memory.",
                                                    rich_help_panel=C.PANEL_JOB)] = None,
    name: Annotated[str, typer.Option(help="Workload name: files are NAME.RANK.et",
                                      rich_help_panel=C.PANEL_OUT)] = "trainsim",
    stamp: Annotated[bool, typer.Option(
        "--stamp", help="Write each compute node's duration_micros from --system's GPU model "
                        "(for ASTRA-sim without its roofline; `trainsim stamp`).",
                        rich_help_panel=C.PANEL_OUT)] = False,
    stack: C.StackOpt = None,
) -> None:
    """Generate the per-rank Chakra execution traces of one training step."""
    spec = resolve_model(model, seq_len, documents)
    strategy = build_strategy(ctx.params)
    if stamp and system is None:
        raise ConfigError("--stamp times the compute nodes with a system's GPU model: give "
                          "--system too", what="tracegen options")
    sys_spec = None
    if system is not None:
        from replay import resolve_system

        sys_spec = resolve_system(system)
    if stack is not None:  # (the system's part applies to --stamp and the memory check)
        applied = C.with_stack(ctx, stack, spec, strategy, sys_spec,
                               kernel_given=system is not None and "@" in system)
        spec, strategy, sys_spec = applied.model, applied.strategy, applied.system
    output_dir(out, "--out")
    with progress_bar() as bar:
        task = bar.add_task("writing ranks", total=None)
        summary = generate(spec, strategy, out, mode=mode, name=name, gpus=gpus,  # type: ignore[arg-type]
                           progress=lambda i, n: bar.update(task, completed=i, total=n))
    capacity, any_layout = None, False
    if sys_spec is not None:
        capacity, any_layout = sys_spec.gpu.hbm_GiB, sys_spec.gpu.fp8_any_layout
        if stamp:
            from replay.stamp import stamp_trace_set

            stamped = stamp_trace_set(out, sys_spec)
            console.print(f"stamped {stamped.stamped:,} compute nodes with {sys_spec.name}'s "
                          f"GPU model ({stamped.stamped_us / 1e6:.6f} s of compute)")
    print_summary(summary, strategy, capacity_GiB=capacity, fp8_any_layout=any_layout)
    note_param_gather(strategy)
    note_combined_1f1b([strategy.overlap_moe_ep_comm])


@app.command("replay")
def replay_cmd(
    ctx: typer.Context,
    trace: Annotated[Path, typer.Argument(help="Trace-set directory, or a workload prefix "
                                               "path/name for path/name.<rank>.et")],
    system: Annotated[str, typer.Option(help="Preset system (see `trainsim systems`) or a TOML "
                                             "system file; append @KERNEL for an earlier "
                                             "attention kernel, e.g. "
                                             "dgx-h100@flashattention-2.")],
    comm_groups: Annotated[Path | None, typer.Option(help="ASTRA-sim comm-group JSON.")] = None,
    timeline: Annotated[Path | None, typer.Option(
        help="Write the simulated timeline: .json as a Perfetto/Chrome trace, .csv or .parquet "
             "as a table (one row per node: rank, op, stream, start and end in s).")] = None,
    summary: Annotated[Path | None, typer.Option(
        help="Write the step metrics as JSON ('-': to stdout, the printed results going to "
             "stderr).")] = None,
    breakdown: Annotated[Path | None, typer.Option(
        help="Write the per-rank breakdown (compute, exposed and overlapped communication, "
             "idle, interference; s) of every simulated rank as .csv or .parquet.")] = None,
    compute: Annotated[str, typer.Option(help="model | trace: time compute nodes with the GPU "
                                              "model or by their duration_micros")] = "model",
    astra_compat: Annotated[bool, typer.Option("--astra-compat", help="ASTRA-sim-compatible "
                                               "network: one flat ring per group, GB = 2^30.")]
    = False,
    no_fold: Annotated[bool, typer.Option("--no-fold", help="Simulate every rank of a full-mode "
                                          "set even when it is provably symmetric.")] = False,
    scenario: Annotated[Path | None, typer.Option(help="Scenario TOML: stragglers, degraded "
                                                       "links, heterogeneous GPUs.")] = None,
) -> None:
    """Simulate one training step of a Chakra trace set on a system."""
    from replay import load_trace_set, replay

    if compute not in ("model", "trace"):
        raise ConfigError(f"--compute must be 'model' or 'trace', got {compute!r}")
    timeline = table_file(timeline, "--timeline", also=(".json",), what="the timeline")
    to_stdout = C.data_to_stdout(ctx, summary)
    summary = None if to_stdout else output_file(summary, "--summary")
    breakdown = table_file(breakdown, "--breakdown", what="the breakdown")
    with progress_bar() as bar:
        task = bar.add_task("reading traces", total=None)
        fold = not (no_fold or astra_compat or scenario is not None)
        ts = load_trace_set(trace, comm_groups=comm_groups, fold=fold,
                            progress=lambda i, n: bar.update(task, completed=i, total=n))
        bar.update(task, description="simulating", completed=0, total=ts.num_nodes)
        result = replay(ts, system, compute=compute, astra_compat=astra_compat,  # type: ignore[arg-type]
                        scenario=scenario,
                        progress=lambda i, n: bar.update(task, completed=i, total=n))
    if timeline is not None and timeline.suffix.lower() == ".json":
        result.to_perfetto(timeline)
    elif timeline is not None:
        write_table(result.timeline, timeline)
    if breakdown is not None:
        write_table(result.breakdown, breakdown)
    C.write_json(result.metrics, summary, to_stdout)
    _print_replay(result)
    if compute == "trace":
        _note_untimed(ts)
        _note_stamped(ts, result.metrics["system"])
    if ts.manifest is not None and compute == "model":
        from replay import resolve_system

        note_precision({str(ts.manifest["strategy"].get("precision", "bf16"))},
                       resolve_system(system),
                       {str(ts.manifest["strategy"].get("fp8_recipe", "delayed"))})


def _note_untimed(ts: Any) -> None:
    """--compute trace times a compute node by its duration_micros; one without (every node of
    a set trainsim wrote) falls back to the GPU model: say how many did."""
    from tracegen.vocab import COMP_NODE

    comp = [n for r in ts.ranks for n in r.nodes if n.type == COMP_NODE]
    untimed = sum(not n.duration_micros for n in comp)
    if untimed:
        console.print(f"note: --compute trace: {untimed:,} of {len(comp):,} compute nodes carry "
                      "no duration_micros and were timed by the GPU model (`trainsim stamp` "
                      "writes the model's)")


def _note_stamped(ts: Any, system: str) -> None:
    """A set stamped with another system's GPU model (``stamp.json``): its times are that
    GPU's, whatever --system says; say so."""
    import json

    from replay.stamp import STAMP_FILE

    record = ts.ranks[0].path.parent / STAMP_FILE
    try:
        stamped = json.loads(record.read_text())["system"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    if stamped != system:
        console.print(f"note: --compute trace: the durations were stamped with {stamped}'s GPU "
                      f"model (`trainsim stamp`), not {system}'s: compute runs at {stamped}'s "
                      "speed, the network at the system's")


def _print_fit(m: dict[str, Any]) -> None:
    verdict = "fits" if m["fits"] else "[bold red]DOES NOT FIT[/]"
    if "gpu_mix" not in m:
        console.print(f"peak memory {m['peak_memory_GiB']:.1f} GiB per GPU: {verdict} in "
                      f"{m['system']}'s GPU memory")
        return
    mix = ", ".join(f"{n:,} on {name}" for name, n in m["gpu_mix"].items())
    console.print(f"peak memory {m['peak_memory_GiB']:.1f} GiB per GPU: {verdict} in each "
                  f"rank's own GPU ({mix}; MFU against their mean peak)")
    for s in m["memory_short"]:
        console.print(f"  {s['ranks']:,} ranks on {s['system']} need up to "
                      f"{s['need_GiB']:.1f} GiB of its {s['hbm_GiB']:g} GiB")


def _print_replay(result: Any) -> None:
    m = result.metrics
    line = (f"step time [bold]{m['step_time_s']:.4f} s[/] on {m['system']}: {m['ranks']} ranks "
            f"({m['ranks_simulated']} simulated), {m['nodes']:,} nodes")
    if "tokens_per_s" in m:
        line += (f"; {m['tokens_per_s']:,.0f} tokens/s, MFU {m['mfu']:.1%}, "
                 f"HFU {m['hfu']:.1%}")
    console.print(line)
    if "fits" in m:
        _print_fit(m)
    if m.get("folded"):
        console.print(f"[dim]folded: every rank provably runs its pipeline stage's program, so "
                      f"{m['ranks_simulated']} stage representatives were simulated (exact); "
                      "--no-fold simulates every rank[/]")
    table = Table(title="Per-rank breakdown (s)")
    cols = ["rank", "compute_s", "exposed_comm_s", "overlapped_comm_s", "idle_s",
            "interference_s"]
    for c in cols:
        table.add_column(c, justify="right")
    frame = result.breakdown
    if frame.height > 16:
        frame = frame.sort("end_s", descending=True).head(16).sort("rank")
        table.caption = "the 16 ranks that finish last"
    for row in frame.iter_rows(named=True):
        table.add_row(str(row["rank"]), *[f"{row[c]:.4f}" for c in cols[1:]])
    console.print(table)
    if m.get("comm_time_by_axis_s"):
        console.print("communication time by axis (busiest rank): " + ", ".join(
            f"{a} {t:.4f} s" for a, t in m["comm_time_by_axis_s"].items()))
    waits = result.waits
    if m.get("scenario") and waits.height:
        late = (waits.group_by("last_rank").agg(pl.len().alias("collectives"),
                                                pl.col("wait_s").sum().alias("others_wait_s"))
                .filter(pl.col("others_wait_s") >= 0.5e-4)  # what the line can print
                .sort("others_wait_s", descending=True).head(5))
        if late.is_empty():
            console.print(f"scenario {m['scenario']}: no collective kept its other ranks "
                          "waiting (the idle time, if any, is the pipeline's)")
            return
        console.print(f"scenario {m['scenario']}: who the collectives wait for — " + "; ".join(
            f"rank {r['last_rank']} last in {r['collectives']} collectives "
            f"(others waited {r['others_wait_s']:.4f} s)" for r in late.iter_rows(named=True)))


@app.command("systems")
def systems_cmd(name: Annotated[str | None, typer.Argument(
        help="A preset: print its system file, evidence comments included, to edit for your "
             "cluster (trainsim systems dgx-h100 > mine.toml; then --system mine.toml)")] = None
                ) -> None:
    """List the preset systems (or print one's system file)."""
    from replay import get_system, system_names
    from replay.hardware import preset_system_text

    if name is not None:
        sys.stdout.write(preset_system_text(name))
        return

    table = Table(title="Preset systems")
    for col in ("name", "gpu", "bf16 TFLOP/s", "GEMM in training", "HBM GiB", "HBM GB/s",
                "GPUs/node", "NVLink GB/s", "NVLS busbw GB/s", "NIC Gb/s/GPU", "host link GB/s",
                "host CPU GB/s", "host GiB (GPUs)"):
        table.add_column(col, no_wrap=col in ("name", "gpu"))
    for name in system_names():
        s = get_system(name)
        nvls = f"{s.node.nvls_busbw_GBps:g}" if s.node.nvls_busbw_GBps else "—"
        # a large bf16 GEMM as trainsim costs it: burst efficiency (MAMF) at the sustained clock
        gemm = s.gpu.tensor_flop_per_s("bf16") * s.gpu.gemm_efficiency / 1e12
        table.add_row(name, s.gpu.name, f"{s.gpu.peak_bf16_TFLOPs:g}", f"{gemm:.0f}",
                      f"{s.gpu.hbm_GiB:g}",
                      f"{s.gpu.hbm_GBps:g}", str(s.node.gpus_per_node), f"{s.node.nvlink_GBps:g}",
                      nvls, f"{s.scaleout.nic_Gbps_per_gpu:g}",
                      f"{s.node.host_link_GBps:g}" if s.node.host_link_GBps else "—",
                      f"{s.node.host_cpu_GBps:g}" if s.node.host_cpu_GBps else "—",
                      f"{s.node.host_memory_GiB:g} ({s.node.host_gpus})"
                      if s.node.host_memory_GiB else "—")
    console.print(table)
    # the descriptions under the table, a line each (a column of them had wrapped every row
    # into eight lines)
    for name in system_names():
        console.print(f"[bold]{name}[/]: {get_system(name).description}", soft_wrap=True)


def print_summary(s: TraceSetSummary, strategy: Strategy, *, capacity_GiB: float | None = None,
                  fp8_any_layout: bool = False) -> None:
    """The set's table; with ``--system``, each stage's memory as a rank needs it on that GPU
    (less the transposed FP8 weights a GPU with any-layout FP8 GEMMs does not keep: what
    ``replay`` reports there) against its capacity."""
    need_GiB = {st.stage: st.need_bytes(fp8_any_layout) / GiB for st in s.stages}
    console.print(f"[bold]{s.path}[/]: {s.mode} trace set, world size {s.world_size}, "
                  f"{s.ranks_written} rank file(s), {s.nodes_written:,} nodes "
                  f"({strategy.label()}, {strategy.num_microbatches} micro-batches, "
                  f"{strategy.schedule}, recompute {strategy.recompute}, "
                  f"ZeRO {strategy.zero_stage})")
    if s.stale_removed:
        console.print(f"removed {s.stale_removed} rank file(s) {s.name}.<rank>.et of an earlier "
                      "set in that folder that this set does not write")
    table = Table(title="Per rank of each pipeline stage")
    axes = sorted({a for st in s.stages for a in st.comm_bytes_by_axis})
    for col in ("stage", "nodes", "TFLOP fwd", "TFLOP bwd", "TFLOP recomp",
                *[f"{a} GB" for a in axes], "memory GiB"):
        table.add_column(col, justify="right")
    for st in s.stages:
        f = st.flop_by_phase
        table.add_row(str(st.stage), f"{st.nodes:,}", f"{f.get('fwd', 0) / 1e12:.1f}",
                      f"{f.get('bwd', 0) / 1e12:.1f}", f"{f.get('recompute', 0) / 1e12:.1f}",
                      *[f"{st.comm_bytes_by_axis.get(a, 0) / 1e9:.2f}" for a in axes],
                      _memory_cell(need_GiB[st.stage], capacity_GiB))
    console.print(table)
    if capacity_GiB is not None:
        over = [stage for stage, gib in need_GiB.items() if gib > capacity_GiB]
        if over:
            console.print(f"[bold red]does not fit:[/] stage(s) {over} need more than "
                          f"{capacity_GiB:g} GiB per GPU")


def _memory_cell(gib: float, capacity: float | None) -> str:
    if capacity is not None and gib > capacity:
        return f"[bold red]{gib:.1f} > {capacity:g}[/]"
    return f"{gib:.1f}"


import analysis.cli_estimate  # noqa: E402  (registers `estimate` on the app)
import analysis.cli_stamp  # noqa: E402  (registers `stamp` on the app)
import analysis.cli_study  # noqa: E402,F401  (registers the study commands on the app)

OUT_OF_MEMORY = (
    "MemoryError: this machine ran out of memory. A replay holds every node of the ranks it "
    "simulates: generate the set in representative mode (`trainsim tracegen --mode "
    "representative`, one program a pipeline stage), simulate fewer GPUs, or screen the "
    "strategy with `trainsim estimate` (the fast path builds no trace; `compare` and "
    f"`validate` keep its answer for sets past {MAX_REPLAY_NODES // 10**6} M nodes).")


def main() -> None:
    """Entry point: usage errors are typer's; trainsim's own errors print as ``Name: message``
    (exit 2), running out of memory as what to do instead (exit 3)."""
    try:
        app()
    except TrainsimError as exc:  # raised inside a command
        err = Console(stderr=True, soft_wrap=True, highlight=False)
        err.print(f"[bold red]{type(exc).__name__}[/]: ", end="")
        err.print(str(exc), markup=False)
        sys.exit(2)
    except MemoryError:  # the stack unwound: what was built for the command is free again
        Console(stderr=True, soft_wrap=True, highlight=False).print(OUT_OF_MEMORY, markup=False)
        sys.exit(3)


if __name__ == "__main__":
    main()
