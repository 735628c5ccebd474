"""Shared pieces of the command line: the typer app, the console, progress bars."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from typer.core import TyperCommand

from replay.hardware import ScaleOutSpec, SystemSpec
from tracegen import ConfigError, ModelSpec, Strategy

if TYPE_CHECKING:  # polars loads only where a table is written
    import polars as pl

    from analysis.stacks import Applied

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="trainsim: trace-driven performance modeling of distributed training.")
# Wide enough for the result tables when output goes to a file or a CI log (not a terminal).
console = Console(width=None if sys.stdout.isatty() else 150)



def data_to_stdout(ctx: typer.Context, path: Path | None) -> bool:
    """Whether an output file is '-' (the data goes to stdout); if so, what the command prints
    goes to stderr until it returns (``printed_to_stderr``), so a pipe reads the data alone."""
    on = path is not None and str(path) == "-"
    ctx.with_resource(printed_to_stderr(on))
    return on


def write_json(data: Any, path: Path | None, to_stdout: bool) -> None:
    """``data`` as indented JSON (``jsonout``) to ``path``, or to stdout where the output was
    '-' (``data_to_stdout``); nothing where neither was asked for."""
    from analysis import jsonout

    if to_stdout:
        sys.stdout.write(jsonout.dumps(data, indent=1) + "\n")
    elif path is not None:
        path.write_text(jsonout.dumps(data, indent=1))


@contextlib.contextmanager
def printed_to_stderr(enabled: bool) -> Iterator[None]:
    """What the command prints sent to stderr while it runs (``enabled``), so that its stdout
    carries only data (``estimate --json -``)."""
    if not enabled:
        yield
        return
    before = console.file
    console.file = sys.stderr
    try:
        yield
    finally:
        console.file = before

class OptionsOnly(TyperCommand):
    """A command whose every input is an option (``estimate``, ``tracegen``): a value typed
    without its option, as in ``trainsim estimate llama3-8b dgx-h100``, is named with the
    option it reads as and the ones the command needs, where click would say only that the
    first required option is missing."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        # (ctx: the Context of the click typer builds on: a vendored copy in recent typer)
        if "--help" not in args:
            _, stray, _ = self.make_parser(ctx).parse_args(args=list(args))
            if stray:
                needed = ", ".join(str(p.opts[0]) for p in self.params
                                   if p.required and p.opts)
                raise ConfigError(
                    f"{', '.join(map(repr, stray))}: `trainsim {ctx.info_name}` takes every "
                    f"input as an option{_stray_hint(stray)} (it needs {needed})",
                    what="arguments")
        return super().parse_args(ctx, args)


def _stray_hint(stray: list[str]) -> str:
    """The options a preset model's or system's name reads as (``--model llama3-8b``)."""
    from replay.hardware import system_names
    from tracegen.catalog import model_names

    models, systems = set(model_names()), set(system_names())
    said = [f"--model {a}" if a.partition("@")[0] in models else f"--system {a}"
            for a in stray if a.partition("@")[0] in models | systems]
    return f", e.g. {' '.join(said)}" if said else ""


def output_file(path: Path | None, option: str, plot: bool = False) -> Path | None:
    """``path`` made ready to write before any work: its folder created, and a clear error
    where it cannot be written (a folder in the way, a plot format matplotlib cannot save)
    instead of a traceback after minutes of simulation."""
    if path is None:
        return None
    if path.is_dir():
        raise ConfigError(f"{path} is a folder; give a file name", what=option)
    if plot:
        from matplotlib.figure import Figure

        formats = Figure().canvas.get_supported_filetypes()
        if path.suffix.lstrip(".").lower() not in formats:
            raise ConfigError(f"{path.name!r}: a plot needs one of the endings "
                              f"{', '.join('.' + f for f in sorted(formats))}", what=option)
    output_dir(path.parent, option)
    return path


TABLE_SUFFIXES = (".csv", ".parquet")


def table_file(path: Path | None, option: str, *, also: tuple[str, ...] = (),
               what: str = "the table") -> Path | None:
    """``output_file`` for a table, written as .csv or .parquet (or one of ``also``)."""
    path = output_file(path, option)
    endings = (*TABLE_SUFFIXES, *also)
    if path is not None and path.suffix.lower() not in endings:
        named = ", ".join(endings[:-1]) + " or " + endings[-1]
        raise ConfigError(f"{path.name!r}: {what} is written as {named}", what=option)
    return path


def write_table(frame: pl.DataFrame, path: Path) -> None:
    """A polars frame as Parquet or CSV, by the file's ending (``table_file`` checked it)."""
    if path.suffix.lower() == ".parquet":
        frame.write_parquet(path)
    else:
        frame.write_csv(path)


def output_dir(path: Path | None, option: str) -> Path | None:
    """``path`` created as a folder before any work, or a clear error where a file is in the
    way or it cannot be created."""
    if path is None:
        return None
    blocked = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if blocked is not None:
        raise ConfigError(f"{blocked} is a file, not a folder", what=option)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create {path}: {exc.strerror}", what=option) from None
    return path


def progress_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console, transient=True)


# The panels `estimate --help` and `tracegen --help` group their options in (rich's).
PANEL_JOB = "Model, cluster and batch"
PANEL_PAR = "Parallelism and pipeline"
PANEL_MEM = "Memory: recompute, sharding, offloading"
PANEL_COMM = "Communication and its overlap"
PANEL_PREC = "Precision"
PANEL_MOE = "Mixture of experts"
PANEL_OUT = "Output"
TpOpt = Annotated[int, typer.Option(help="Tensor-parallel degree.", rich_help_panel=PANEL_PAR)]
PpOpt = Annotated[int, typer.Option(help="Pipeline stages.", rich_help_panel=PANEL_PAR)]
CpOpt = Annotated[int, typer.Option(help="Context-parallel degree (the sequence split).",
                                    rich_help_panel=PANEL_PAR)]
EpOpt = Annotated[int, typer.Option(help="Expert-parallel degree (a MoE model's experts "
                                         "split).", rich_help_panel=PANEL_PAR)]
# The strategy options `tracegen` and `estimate` share (one declaration, one meaning).
ModelOpt = Annotated[str, typer.Option(help="Preset name (see `trainsim catalog`), a TOML/JSON "
                                            "model file, or a Hugging Face config.json (with "
                                            "--seq-len) (NAME@seqN: at N tokens a sequence).",
                                       rich_help_panel=PANEL_JOB)]
SeqLenOpt = Annotated[int, typer.Option(
    "--seq-len", help="Tokens per sequence; 0 = the model's own (the model is then named "
    "NAME@seqN).", rich_help_panel=PANEL_JOB)]
DocumentsOpt = Annotated[str, typer.Option(
    "--documents", help="Train under a document mask: MEAN[~SIGMA], the data's mean document "
    "length in tokens and the σ of the lengths' logarithm (log-normal; 0 = one length), e.g. "
    "2000~1.0 (the model is then named NAME@docMEAN~SIGMA, which --model also takes).",
    rich_help_panel=PANEL_JOB)]
GpusOpt = Annotated[int, typer.Option(help="GPU count; dp = gpus / (tp·pp·cp).",
                                      rich_help_panel=PANEL_JOB)]
MbsOpt = Annotated[int, typer.Option(help="Micro-batch size (sequences).",
                                     rich_help_panel=PANEL_JOB)]
GbsOpt = Annotated[int, typer.Option(help="Global batch size (sequences per step).",
                                     rich_help_panel=PANEL_JOB)]
VppOpt = Annotated[int, typer.Option(help="Virtual stages per rank (interleaved 1F1B).",
                                     rich_help_panel=PANEL_PAR)]
SpOpt = Annotated[bool, typer.Option("--sp", help="Sequence parallelism.",
                                     rich_help_panel=PANEL_PAR)]
TpOverlapOpt = Annotated[bool, typer.Option(
    "--tp-comm-overlap", help="Overlap SP collectives with their GEMMs, which then run in "
    "Transformer Engine's chunks (needs --sp).", rich_help_panel=PANEL_COMM)]
ScheduleOpt = Annotated[str, typer.Option(
    help="gpipe | 1f1b | interleaved_1f1b | zb_h1 | interleaved_zb (with --vpp ≥ 2) | zb_v "
         "or dualpipe_v (with --vpp 2)", rich_help_panel=PANEL_PAR)]
RecomputeOpt = Annotated[str, typer.Option(help="none | selective | full",
                                           rich_help_panel=PANEL_MEM)]
ZeroOpt = Annotated[int, typer.Option(help="ZeRO stage 0-3 (1 = distributed optimizer).",
                                      rich_help_panel=PANEL_MEM)]
ParamGatherOpt = Annotated[bool, typer.Option(
    "--overlap-param-gather", help="ZeRO-1/2: gather updated parameters during the next "
    "forward (Megatron --overlap-param-gather).", rich_help_panel=PANEL_COMM)]
PrecisionOpt = Annotated[str, typer.Option(
    help="bf16 | fp16 | fp8 | nvfp4 (Transformer Engine's NVFP4 recipe, Blackwell: the linear "
         "layers' GEMMs in 4 bits, attention and the output head in BF16)",
    rich_help_panel=PANEL_PREC)]
CpCommOpt = Annotated[str, typer.Option(
    help="p2p (ring alongside attention, Megatron's default) | all_gather (K/V gathered "
         "first, Llama 3)", rich_help_panel=PANEL_PAR)]
CpBalanceOpt = Annotated[str, typer.Option(
    "--cp-balance", help="Under a document mask (--documents), how context parallelism splits "
    "a packed sequence: document (each document over the ranks: Transformer Engine's THD, "
    "balanced) | sequence (the sequence whole, as Llama 3's: the busiest rank sets each "
    "layer's pace)", rich_help_panel=PANEL_PAR)]
ZbRegatherOpt = Annotated[bool, typer.Option(
    "--zb-w-regather", help="ZB-H1 with --sp: each W pass gathers its GEMMs' inputs again "
                            "instead of keeping them gathered from B (less memory, more "
                            "communication).", rich_help_panel=PANEL_PAR)]
Zero3PrefetchOpt = Annotated[bool, typer.Option(
    "--zero3-prefetch", help="ZeRO-3: gather the next block's parameters alongside the current "
                             "block's compute (FSDP prefetch, Megatron-FSDP).",
    rich_help_panel=PANEL_MEM)]
ExpertTpOpt = Annotated[int, typer.Option(
    "--expert-tp", help="Tensor parallelism of the experts (Megatron --expert-tensor-parallel-"
                        "size): 0 = tp; 1 folds ep over tp·cp·dp, whole experts per rank.",
    rich_help_panel=PANEL_PAR)]
MoeDispatcherOpt = Annotated[str, typer.Option(
    "--moe-dispatcher",
    help="alltoall (Megatron-Core's all-to-all token dispatcher: a copy per token and expert) "
         "| deepep (its flex dispatcher on DeepEP: a token crosses the NICs once per "
         "destination node, then NVLink)", rich_help_panel=PANEL_MOE)]
SharedOverlapOpt = Annotated[bool, typer.Option(
    "--moe-shared-expert-overlap",
    help="Run a MoE layer's shared experts beside the dispatch and combine (Megatron-Core "
         "--moe-shared-expert-overlap; all-to-all dispatcher).", rich_help_panel=PANEL_MOE)]
EpOverlapOpt = Annotated[bool, typer.Option(
    "--overlap-moe-expert-parallel-comm",
    help="Combined 1F1B: each forward merged with the backward before it, layer by layer, "
         "one's expert all-to-alls beside the other's compute (Megatron-Core "
         "--overlap-moe-expert-parallel-comm; pp 1, or an interleaved pipeline).",
    rich_help_panel=PANEL_MOE)]
DelayWgradOpt = Annotated[bool, typer.Option(
    "--delay-wgrad-compute",
    help="With combined 1F1B: the layers' weight gradients run after the backward's next "
         "expert all-to-all is issued, which then waits for the data gradients only "
         "(Megatron-Core --delay-wgrad-compute).", rich_help_panel=PANEL_MOE)]
GradBf16Opt = Annotated[bool, typer.Option(
    "--grad-reduce-bf16", help="Gradient buffer and data-parallel reduction in 16 bits, not "
    "fp32 (Megatron --grad-reduce-in-bf16).", rich_help_panel=PANEL_COMM)]
AdamMomentsOpt = Annotated[str, typer.Option(
    "--adam-moments", help="fp32 | bf16 | fp16 | fp8: Adam's moments in that dtype "
    "(Megatron-Core's precision-aware optimizer, --exp-avg-dtype/--exp-avg-sq-dtype; needs "
    "--zero ≥ 1).", rich_help_panel=PANEL_MEM)]
Fp8GatherOpt = Annotated[bool, typer.Option(
    "--fp8-param-gather", help="FP8 runs, ZeRO ≥ 1: all-gather the parameters in 1 byte "
    "(Megatron --fp8-param-gather; Megatron-FSDP's gathers under ZeRO-3).",
    rich_help_panel=PANEL_COMM)]
InstancesOpt = Annotated[int, typer.Option(
    "--dist-opt-instances", help="ZeRO ≥ 1: shard the optimizer (ZeRO-3: and the parameters "
    "and gradients, HSDP) over dp·cp / N ranks, replicated N times; gradients reduce-scattered "
    "inside an instance, then all-reduced across them (Megatron-Core "
    "--num-distributed-optimizer-instances; ZeRO-3: on the last micro-batch, Megatron-FSDP's "
    "HSDP; dense models).", rich_help_panel=PANEL_MEM)]
OuterShardingOpt = Annotated[str, typer.Option(
    "--outer-dp-sharding", help="ZeRO-3 with --dist-opt-instances: 'no_shard' replicates the "
    "optimizer across the instances (HSDP); 'optim' shards it across them too (HFSDP: each "
    "block's shard reduce-scattered across the instances on the last micro-batch, gathered back "
    "in the next step's first forward; Megatron-FSDP's --outer-dp-sharding-strategy).",
    rich_help_panel=PANEL_MEM)]
GradPerMbOpt = Annotated[bool, typer.Option(
    "--grad-reduce-per-microbatch", help="ZeRO 0-2: reduce the gradient buckets in every "
    "micro-batch's backward, not once a step after the last (DeepSpeed's ZeRO-2, PyTorch "
    "FSDP's SHARD_GRAD_OP, DDP outside no_sync; not with --overlap-param-gather).",
    rich_help_panel=PANEL_MEM)]
CeFusionOpt = Annotated[str, typer.Option(
    "--cross-entropy-fusion", help="The loss's implementation: 'none' (eager ops, Megatron-LM's "
    "default), 'native' (Megatron-Core's --cross-entropy-loss-fusion, on by default in "
    "Megatron-Bridge and NeMo 2), 'te' (--cross-entropy-fusion-impl te: Transformer Engine's "
    "kernel, no fp32 logits kept).", rich_help_panel=PANEL_PREC)]
Fp8RecipeOpt = Annotated[str, typer.Option(
    "--fp8-recipe", help="FP8's scaling (Transformer Engine): 'delayed' (the amax history, "
    "Megatron-LM's default) | 'tensorwise' (current scaling, Megatron --fp8-recipe tensorwise, "
    "Megatron-Bridge's FP8-CS: each cast reads its tensor for the amax first) | 'mxfp8' "
    "(MXFP8 block scaling, Megatron --fp8-recipe mxfp8, Megatron-Bridge's FP8-MX; Blackwell: "
    "scales a block of 32, sequence-parallel gathers in 16 bits).", rich_help_panel=PANEL_PREC)]
LayoutOpt = Annotated[str, typer.Option(
    "--pipeline-layout",
    help="Megatron-Core's --pipeline-model-parallel-layout: what each model chunk holds, "
         "e.g. 'Et*3|(tt|)*29,m|L' (E embedding, t layer, m MTP module, L loss; chunks split "
         "by |, listed stage by stage for each virtual stage). Lists pp·vpp chunks.",
    rich_help_panel=PANEL_PAR)]
FirstLayersOpt = Annotated[int, typer.Option(
    help="Layers of the first model chunk (stage at vpp 1); 0 = even split.",
    rich_help_panel=PANEL_PAR)]
LastLayersOpt = Annotated[int, typer.Option(
    help="Layers of the last model chunk (stage at vpp 1); 0 = even split.",
    rich_help_panel=PANEL_PAR)]
EmbSplitOpt = Annotated[bool, typer.Option(
    "--account-for-embedding-in-pipeline-split",
    help="Count the embedding as a layer in the pipeline split: the first chunk holds one "
         "layer fewer, none where chunks hold one (Megatron-Core; Llama 3).",
    rich_help_panel=PANEL_PAR)]
LossSplitOpt = Annotated[bool, typer.Option(
    "--account-for-loss-in-pipeline-split",
    help="Count the loss as a layer in the pipeline split: the last chunk holds one layer "
         "fewer (Megatron-Core; Llama 3).", rich_help_panel=PANEL_PAR)]
OffloadOpt = Annotated[int, typer.Option(
    "--cpu-offload-layers",
    help="Offload the first N layers' activations to host memory between their forward and "
         "backward, over the GPU's host link (Megatron-Core --cpu-offloading "
         "--cpu-offloading-num-layers; pp 1, no recompute); 0 = none.", rich_help_panel=PANEL_MEM)]
OptOffloadOpt = Annotated[float, typer.Option(
    "--optimizer-offload-fraction",
    help="Share of the optimizer state updated on the CPU, in (0, 1]: its gradients copied to "
         "host memory, CPU AdamW, the master weights copied back (Megatron-Core "
         "--optimizer-cpu-offload --optimizer-offload-fraction; needs --zero 1 or 2); 0 = none.",
    rich_help_panel=PANEL_MEM)]
RecomputeLayersOpt = Annotated[int, typer.Option(
    "--recompute-num-layers",
    help="With --recompute full: only the first N layers of each model chunk recompute, the "
         "rest keep their activations; 0 = every layer (Megatron --recompute-method block "
         "--recompute-num-layers).", rich_help_panel=PANEL_MEM)]
ModulesOpt = Annotated[str, typer.Option(
    "--recompute-modules",
    help="With --recompute selective: what runs again in the backward, comma-separated among "
         "layernorm, mla_up_proj (MLA's up-projections), core_attn, mlp (a dense MLP), moe "
         "(a whole MoE layer), moe_act (the experts' activation) and shared_experts "
         "(Megatron-Core --recompute-modules).", rich_help_panel=PANEL_MEM)]
GroupOpt = Annotated[int, typer.Option(
    "--microbatch-group-size",
    help="Interleaved 1F1B: micro-batches run through a chunk before the next, from pp up "
         "to the micro-batch count; 0 = pp (Megatron-Core "
         "--microbatch-group-size-per-virtual-pipeline-stage). Lets the micro-batch count be other "
         "than a multiple of pp.", rich_help_panel=PANEL_PAR)]


# the shared options whose names are not the strategy's field names (``build_strategy``)
OPTION_FIELDS = {"sp": "sequence_parallel", "mbs": "micro_batch_size",
                 "gbs": "global_batch_size", "zero": "zero_stage",
                 "grad_reduce_bf16": "grad_reduce_in_bf16",
                 "account_for_embedding": "account_for_embedding_in_pipeline_split",
                 "account_for_loss": "account_for_loss_in_pipeline_split",
                 "overlap_moe_expert_parallel_comm": "overlap_moe_ep_comm",
                 "adam_moments": "adam_moments_dtype",
                 "outer_dp_sharding": "outer_dp_sharding_strategy"}


def build_strategy(params: Mapping[str, Any]) -> Strategy:
    """The strategy the shared options describe (a command's ``ctx.params``, dp from the GPU
    count): each option under its field's name (``OPTION_FIELDS``), the command's other
    options left out."""
    gpus, tp, pp, cp = (params[k] for k in ("gpus", "tp", "pp", "cp"))
    small = [f"--{k} must be ≥ 1, got {v}" for k, v in
             (("gpus", gpus), ("tp", tp), ("pp", pp), ("cp", cp)) if v < 1]
    if small:
        raise ConfigError(small, what="strategy")
    denom = tp * pp * cp
    if gpus % denom:
        raise ConfigError(f"--gpus {gpus} is not divisible by tp·pp·cp = {tp}·{pp}·{cp} = {denom}; "
                          "choose a GPU count that is a multiple of it", what="strategy")
    named = {OPTION_FIELDS.get(k, k): v for k, v in params.items()}
    return Strategy(dp=gpus // denom, **{f.name: named[f.name]
                                         for f in dataclasses.fields(Strategy)
                                         if f.name in named})


def note_precision(precisions: set[str], system: SystemSpec,
                   recipes: set[str] | frozenset[str] = frozenset()) -> None:
    """Say where a precision runs on a GPU without its tensor cores: the catalog costs it at the
    rate the GPU has (fp8 at its 16-bit rate, bf16 as fp16 on Volta), which no such run gets;
    and where an FP8 recipe (``recipes``: the FP8 strategies' ``fp8_recipe``) needs a later
    GPU."""
    gpu = system.gpu
    if "fp8" not in precisions and set(recipes) - {"delayed"}:
        console.print("note: an FP8 recipe (--fp8-recipe, fp8_recipe) applies to FP8 runs "
                      f"only (--precision fp8); {', '.join(sorted(precisions))} ignores it")
    if "fp8" in precisions and "mxfp8" in recipes and gpu.lacks("fp8", "mxfp8") and not (
            gpu.lacks("fp8")):
        console.print(f"note: {system.name} has {gpu.lacks('fp8', 'mxfp8')}; mxfp8 is costed "
                      "as FP8 on it")
    if "fp8" in precisions and gpu.lacks("fp8"):
        console.print(f"note: {system.name} has {gpu.lacks('fp8')}; fp8 GEMMs are costed at "
                      "its 16-bit rate")
    if "nvfp4" in precisions and gpu.lacks("nvfp4"):
        console.print(f"note: {system.name} has {gpu.lacks('nvfp4')}; nvfp4 GEMMs are costed "
                      "at its FP8 rate")
    elif "nvfp4" in precisions:
        console.print("note: NVFP4 GEMMs are costed at an efficiency from an inference GEMM "
                      "bench; NVIDIA's own NVFP4 training runs measured 5-20% slower than "
                      "trainsim predicts (README, \"Reference sets\"): read this step as "
                      "optimistic")
    if "bf16" in precisions and not gpu.bf16:
        console.print(f"note: {system.name} has no bf16 tensor cores (Volta); bf16 is costed as "
                      "the fp16 it would run (--precision fp16 says so)")


# What a combined-1F1B estimate is worth (DESIGN.md, "Combined 1F1B"): on the first published
# pair with and without it (Megatron-MoE-ModelZoo, Qwen3-235B on 256 H100s, 19.7 → 17.6 s),
# trainsim's saving was 2.4 times the measured one (tests/test_megatron_moe_runs.py); on
# Megatron-Bridge's (Qwen3-30B-A3B on 16 H100s, EP 16 over two nodes, 41.25 → 31.31 s) 1.5
# times (tests/test_megatron_bridge_moe_runs.py)
COMBINED_1F1B_NOTE = (
    "note: merged passes (--overlap-moe-expert-parallel-comm: combined 1F1B, or DualPipe-V's "
    "pairs) are costed with each expert "
    "all-to-all at its full speed beside the other micro-batch's compute; on the two published "
    "pairs with and without it (Megatron-MoE-ModelZoo's Qwen3-235B on 256 H100s, "
    "Megatron-Bridge's Qwen3-30B on 16) trainsim's saving was 2.4 and 1.5 times the measured "
    "one: read the step time of such a strategy as a bound on what the overlap can save, not "
    "a forecast")


# What a MoE step is worth (README, "Reference sets"): NVIDIA's published MoE runs in the
# reference sets (tests/test_moe_note.py counts them and holds these figures)
MOE_NOTE = (
    "note: for NVIDIA's {runs} published MoE runs in trainsim's reference sets (Qwen3, "
    "DeepSeek-V3 and GPT-OSS on H100, B200, GB200 and GB300) trainsim predicts a step a median "
    "{median}% shorter than measured, {slower} of them too short, {close} within 10%: read a "
    "MoE step as optimistic (README, \"Reference sets\")")
MOE_REFERENCE = {"runs": 30, "median": 27, "slower": 29, "close": 6}


def note_moe(model: ModelSpec) -> dict[str, int] | None:
    """Say what a MoE model's step is worth against NVIDIA's published MoE runs; the figures
    said (for ``estimate --json``), or None for a dense model."""
    if not model.is_moe:
        return None
    console.print(MOE_NOTE.format(**MOE_REFERENCE))
    return dict(MOE_REFERENCE)


def note_combined_1f1b(overlaps: Iterable[bool]) -> None:
    """Say what a combined-1F1B estimate is worth, once, where any strategy runs it."""
    if any(overlaps):
        console.print(COMBINED_1F1B_NOTE)


ZERO2_NOTE = ("note: ZeRO-2 is costed with one gradient reduce-scatter a step, after the last "
              "micro-batch (as Megatron's distributed optimizer reduces), and with only the "
              "gradient shard in memory; DeepSpeed's ZeRO-2 and PyTorch FSDP's SHARD_GRAD_OP "
              "reduce every micro-batch's gradients to free them")


def sites_words(scaleout: ScaleOutSpec, gpus: int) -> str:
    """The sites ``gpus`` span, in words: "2 sites of 4,096 GPUs (2 Gb/s a GPU between them,
    250 µs)"."""
    window = (f", {scaleout.site_window_MiB:g} MiB in flight a flow"
              if scaleout.site_window_MiB else "")
    return (f"{-(-gpus // scaleout.site_gpus)} sites of {scaleout.site_gpus:,} GPUs "
            f"({scaleout.site_Gbps_per_gpu:g} Gb/s a GPU between them, "
            f"{scaleout.site_latency_us:g} µs{window})")


def note_zero2(strategy: Strategy, step_s: float = 0.0, per_microbatch_s: float = 0.0) -> None:
    """ZeRO-2's memory holds the gradient shard, its communication is by default Megatron's
    distributed optimizer's (one reduce-scatter a step): say so where micro-batches accumulate,
    since the frameworks whose ZeRO-2 frees the gradients reduce every micro-batch — and, given
    the step with ``--grad-reduce-per-microbatch`` (``per_microbatch_s``), what it costs them."""
    s = strategy
    if s.zero_stage == 2 and not s.grad_reduce_per_microbatch and s.dp * s.cp > 1 and (
            s.num_microbatches > 1):
        theirs = (f": {per_microbatch_s:.4f} s a step that way "
                  f"({per_microbatch_s / step_s - 1:+.1%}; --grad-reduce-per-microbatch)"
                  if per_microbatch_s and step_s else
                  " (--grad-reduce-per-microbatch costs that)")
        console.print(f"{ZERO2_NOTE}, {s.num_microbatches} reduce-scatters a step here{theirs}")


def note_zero2_study(stages: Iterable[int]) -> None:
    """``note_zero2`` once for a study whose strategies (or space) hold ZeRO-2."""
    if 2 in set(stages):
        console.print(f"{ZERO2_NOTE}: their steps may be longer than these ZeRO-2 ones "
                      "(grad_reduce_per_microbatch = true costs theirs)")


def note_param_gather(strategy: Strategy) -> None:
    if strategy.overlap_param_gather and strategy.zero_stage not in (1, 2):
        console.print(f"note: --overlap-param-gather changes nothing at --zero "
                      f"{strategy.zero_stage}: only ZeRO 1 and 2 gather the updated parameters "
                      "after the step")


StackOpt = Annotated[str | None, typer.Option(
    "--stack", help="Run it as a framework's recipes do, as trainsim's reference sets are "
                    "validated: megatron-bridge, nemo-24.07, megatron-moe-modelzoo, "
                    "megatron-lm-2022, llm-foundry (their overlaps, FP8 gathers, fused loss, "
                    "gradient dtype, attention kernel; an option you give wins, and each value "
                    "the layout has no use for is said).", rich_help_panel=PANEL_JOB)]


def with_stack(ctx: typer.Context, name: str, spec: ModelSpec, strategy: Strategy,
               system: SystemSpec | None, *, kernel_given: bool, mixed: bool = False
               ) -> Applied:
    """``--stack``: the strategy as that stack runs it (``analysis.stacks.apply_stack``, its
    ``Applied``), the options given on the command line winning; what it set and left out
    printed."""
    from analysis.stacks import CLI_OPTION, apply_stack, get_stack, split_overrides

    chosen = get_stack(name)
    if mixed and (chosen.attention or split_overrides(chosen.overrides)[0]):
        raise ConfigError(f"stack {name} sets the GPUs' attention: give it a one-system "
                          "estimate, or name each system's kernel (SYSTEM@KERNEL) without "
                          "--stack", what="--stack")
    given = {f for f in strategy.to_dict()
             if getattr(ctx.get_parameter_source(CLI_OPTION.get(f, f)), "name", "DEFAULT")
             in ("COMMANDLINE", "ENVIRONMENT")}  # (typer's click, by name)
    applied = apply_stack(chosen, spec, strategy, system, given=given, kernel_given=kernel_given)
    for line in applied.notes:
        console.print(line if line.startswith("stack ") else f"  {line}")
    return applied
