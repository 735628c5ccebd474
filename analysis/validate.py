"""Validation against published training runs (the schema of shared/validation/public_runs.csv).

Each row becomes a model, a strategy and a system; trainsim predicts its step time (by replaying a
representative-mode trace set) and its peak memory per GPU, and compares with the measurement.
A row that lacks an input the prediction needs is reported as ``skipped: <field> missing`` —
never dropped, never guessed; an empty cell its other cells determine (virtual_pp at pp 1,
sequence_parallel at tp 1, ep on a dense model, dp or cp from tp·pp·dp·cp = num_gpus) is
filled and said so. The few conventions applied where the schema leaves one implicit
(an unstated 16-bit precision where bf16 and fp16 peaks are equal, Megatron's vocabulary padding,
shorter end chunks of a pipeline its depth does not divide) and any ``--set`` system override are
stated per row in ``assumptions``.
"""

from __future__ import annotations

import concurrent.futures as cf
import csv
import dataclasses
import functools
import itertools
import math
import multiprocessing
import re
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import polars as pl

from analysis import replay_size
from analysis.fastpath import estimate
from analysis.glance import strategy_rates
from analysis.runner import worker_deaths_said
from analysis.stacks import Layout, inapplicable, split_overrides
from replay import replay
from replay.attention_kernels import KERNELS, kernel_overrides
from replay.hardware import GPU_ALIASES, SystemSpec, get_system
from tracegen import ConfigError, ModelSpec, Strategy, TrainsimError, generate
from tracegen._config import is_finite_number
from tracegen.errors import unknown_key
from tracegen.fit import with_shorter_end_chunks
from tracegen.units import GiB

# The schema's columns a prediction reads. A file that lacks some of them still loads (the
# column reads as empty, so each row that needs it is skipped naming it), unless it lacks a key
# column or most of them: then it is not this schema.
KEY_COLUMNS = ("id", "measured_iter_time_s")
REQUIRED_COLUMNS = (
    "id", "arch", "num_layers", "hidden_size", "num_attention_heads",
    "num_kv_heads", "ffn_hidden_size", "vocab_size", "seq_len", "activation", "global_batch_size",
    "micro_batch_size", "num_gpus", "tp", "pp", "dp", "cp", "ep", "sequence_parallel",
    "virtual_pp", "recompute", "zero_stage", "precision", "gpu", "gpus_per_node",
    "scaleout_gbps_per_gpu", "measured_iter_time_s", "num_experts", "experts_per_token",
    "moe_ffn_hidden_size",
)
MODEL_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads",
                "ffn_hidden_size", "vocab_size", "seq_len", "activation")
STRATEGY_FIELDS = ("global_batch_size", "micro_batch_size", "num_gpus", "tp", "pp", "dp", "cp",
                   "ep", "sequence_parallel", "virtual_pp", "recompute", "zero_stage", "gpu",
                   "gpus_per_node")


@dataclasses.dataclass(frozen=True, slots=True)
class RunInputs:
    model: ModelSpec
    strategy: Strategy
    system: SystemSpec
    assumptions: str


INT_COLUMNS = ("num_layers", "hidden_size", "num_attention_heads", "num_kv_heads",
               "ffn_hidden_size", "vocab_size", "seq_len", "num_experts", "experts_per_token",
               "moe_ffn_hidden_size", "global_batch_size", "micro_batch_size", "num_gpus", "tp",
               "pp", "dp", "cp", "ep", "virtual_pp", "zero_stage", "gpus_per_node")
FLOAT_COLUMNS = ("scaleout_gbps_per_gpu", "measured_iter_time_s")
# Columns beyond the public schema, read when a file has them (empty = the default): what a
# model or layout needs that the schema cannot say — attention heads wider than hidden / heads
# (Qwen3), the experts' tensor parallelism (1 = Megatron-Core's MoE parallel folding), the
# shared experts' width (Qwen2-MoE), a MoE model's dense first layers (GLM-4.5), multi-head
# latent attention's widths, group-limited routing and multi-token prediction (DeepSeek-V3),
# the layers whose activations go to host memory (Megatron-Core's --cpu-offloading-num-layers),
# the share of the optimizer state the CPU updates (--optimizer-offload-fraction, a number),
# a sliding window or attention chunk (Mistral, Gemma 2/3, GPT-OSS; Llama 4) with, as text,
# the pattern of layers using it (``window_pattern``); as text, which layers are MoE
# (``moe_layer_pattern``, Llama 4 Maverick's "DM"); and, as text, the MoE
# dispatcher, the modules selective recompute names (Megatron-Core's --recompute-modules,
# comma-separated), the pipeline layout (--pipeline-model-parallel-layout) and Adam's moments'
# dtype (--exp-avg-dtype); as true/false, FP8 parameter gathers (--fp8-param-gather), combined
# 1F1B (--overlap-moe-expert-parallel-comm) with deferred weight gradients
# (--delay-wgrad-compute), TP communication overlap (--tp-comm-overlap), and 16-bit gradients
# (Megatron-Bridge's ``ddp.grad_reduce_in_fp32 = False``: grad_reduce_in_bf16). A row's true or
# false in one of these wins over a ``--set`` for the whole file (its recipe says what it ran).
EXTENSION_INT_COLUMNS = ("head_dim", "expert_tp", "shared_expert_ffn_hidden_size",
                         "first_dense_layers", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim",
                         "v_head_dim", "moe_router_num_groups", "moe_router_group_topk",
                         "mtp_layers", "sliding_window", "attention_chunk",
                         "cpu_offload_layers", "document_mean_tokens")
EXTENSION_FLOAT_COLUMNS = ("optimizer_offload_fraction", "document_length_sigma")
EXTENSION_TEXT_COLUMNS = ("moe_dispatcher", "recompute_modules", "pipeline_layout",
                          "adam_moments_dtype", "cross_entropy_fusion", "window_pattern",
                          "moe_layer_pattern", "fp8_recipe")
# read case-insensitively, as the enums below (a layout's E and L are upper case: kept)
LOWERCASE_TEXT_COLUMNS = ("moe_dispatcher", "recompute_modules", "adam_moments_dtype",
                          "cross_entropy_fusion", "fp8_recipe")
# A text column whose cell, where a row has one, wins over a ``--set`` (or a stack) for the
# whole file (the row's recipe says what it ran: an MXFP8 row among current-scaling ones, TE's
# fused loss beside the stack's native one, a row's dispatcher); the README's rule, a row's
# own cells over both
ROW_WINS_TEXT_COLUMNS = ("fp8_recipe", "cross_entropy_fusion", "moe_dispatcher")
BOOL_COLUMNS = ("sequence_parallel",)
EXTENSION_BOOL_COLUMNS = ("fp8_param_gather", "overlap_moe_ep_comm", "delay_wgrad_compute",
                          "tp_comm_overlap", "grad_reduce_per_microbatch", "grad_reduce_in_bf16")
# Read case-insensitively (the schema spells them in lower case: "bf16", "h100-sxm", "full").
ENUM_COLUMNS = ("arch", "activation", "recompute", "precision", "gpu")
# Two 800 Gb/s NICs per GPU, twice what any system offers (ConnectX-8: one 800 Gb/s per GPU): a
# larger per-GPU figure is a node's total in the wrong column.
MAX_NIC_GBPS_PER_GPU = 1600
# ... and below 1 Gb/s per GPU (less than a 10 Gb/s Ethernet port shared by eight GPUs) no
# published run trained (the slowest in ANCHORS.md: 100 GbE TCP): a smaller figure is a unit slip.
MIN_NIC_GBPS_PER_GPU = 1
VOCAB_PAD = 128  # Megatron-LM --make-vocab-size-divisible-by default
# No count in the schema comes near 2³¹ (the largest are vocabularies, ~10⁵–10⁶): a larger cell
# (1e30 GPUs) is a typo, named as unreadable like any other, not a 64-bit overflow deep inside.
MAX_INT_CELL = 2**31
BAD = "_unreadable"  # per row: the cells that did not parse, as "column 'text'"
RAGGED = "_ragged"  # per row read by ``_read_text``: its cell count, where over the header's


def load_runs(path: str | Path) -> pl.DataFrame:
    """The runs with each schema column parsed to its type. Every cell is read as text first,
    so one malformed cell (``N/A``, ``1.5`` GPUs, ``yes``) empties that cell and is named in
    the row's ``_unreadable`` column instead of failing the whole file."""
    p = Path(path)
    raw = _read_text(p)
    # a byte-order mark or stray spaces must not hide a column; a column of our own (a file
    # written from this frame, read again) is recomputed, not kept
    raw = raw.rename({c: c.lstrip("\ufeff").strip() for c in raw.columns})
    raw = raw.drop(BAD, strict=False)
    missing = [c for c in REQUIRED_COLUMNS if c not in raw.columns]
    if any(c in missing for c in KEY_COLUMNS) or len(missing) > len(REQUIRED_COLUMNS) // 2:
        raise ConfigError(f"{p} lacks the columns {', '.join(missing)} of the public-runs schema "
                          "(shared/validation/README.md)", what="runs file")
    raw = raw.with_columns(pl.lit(None, dtype=pl.String).alias(c) for c in missing)
    text = {c: pl.col(c).str.strip_chars() for c in raw.columns}
    ints = (*INT_COLUMNS, *(c for c in EXTENSION_INT_COLUMNS if c in raw.columns))
    floats = (*FLOAT_COLUMNS, *(c for c in EXTENSION_FLOAT_COLUMNS if c in raw.columns))
    num = {c: text[c].cast(pl.Float64, strict=False) for c in (*ints, *floats)}
    parsed = {
        **{c: pl.when((num[c] == num[c].round(0)) & (num[c].abs() < MAX_INT_CELL))
           .then(num[c]).cast(pl.Int64) for c in ints},
        **{c: pl.when(num[c].is_finite()).then(num[c]) for c in floats},
        **{c: text[c].str.to_lowercase().replace_strict(
            {"true": True, "false": False}, default=None, return_dtype=pl.Boolean)
           for c in (*BOOL_COLUMNS, *(c for c in EXTENSION_BOOL_COLUMNS if c in raw.columns))},
    }
    bad: list[pl.Expr] = [pl.when(text[c].is_not_null() & (text[c] != "") & parsed[c].is_null())
           .then(pl.lit(f"{c} '") + text[c] + pl.lit("'")) for c in parsed]
    if RAGGED in raw.columns:  # rows with more cells than the header (``_read_text``) first
        bad.insert(0, pl.col(RAGGED))
    return raw.with_columns(
        pl.concat_str(bad, separator=", ", ignore_nulls=True).alias(BAD),
        *(e.alias(c) for c, e in parsed.items()),
        *(pl.when(text[c] == "").then(None)
          .otherwise(text[c].str.to_lowercase() if c in (*ENUM_COLUMNS, *LOWERCASE_TEXT_COLUMNS)
                     else text[c]).alias(c)
          for c in raw.columns if c not in parsed)).drop(RAGGED, strict=False)


def _read_text(p: Path) -> pl.DataFrame:
    """Every cell of ``p`` as text. A row with more cells than the header (an unquoted comma in
    a note, say) cannot be mapped to the columns, so its cells are emptied and ``RAGGED`` says
    why; its first cell is kept, as it names the row. The other rows read as they are."""
    _refuse_repeated_columns(p)
    try:
        return pl.read_csv(p, infer_schema_length=0)
    except (OSError, pl.exceptions.PolarsError) as exc:
        if "more fields" not in str(exc):
            raise ConfigError(f"cannot read {p} as CSV: {exc}", what="runs file") from None
    with p.open(newline="", encoding="utf-8", errors="replace") as f:
        reader = csv.reader(f)
        header = next(reader, [])
        rows, last = [], reader.line_num
        for row in reader:  # (the line the row starts on, its cells)
            rows.append((last + 1, row))
            last = reader.line_num
    width, cols = len(header), {h: i for i, h in enumerate(header)}
    cells: dict[str, list[str | None]] = {h: [] for h in header}
    ragged: list[str | None] = []
    for line, row in rows:
        if not any(x.strip() for x in row):
            continue  # a blank line (the CSV reader gives it as no cells)
        over = len(row) > width
        ragged.append(f"row (line {line}: {len(row)} cells where the header has {width}; "
                      "quote a cell that holds a comma)" if over else None)
        for h, i in cols.items():
            cells[h].append(row[i] if i < len(row) and (not over or i == 0) else None)
    return pl.DataFrame({**cells, RAGGED: ragged}, schema={h: pl.String for h in (*header, RAGGED)})


def _refuse_repeated_columns(p: Path) -> None:
    """A header that names a column twice is refused, naming it and where: the CSV reader
    had kept the first and renamed the second (``…_duplicated_0``), which was then ignored
    whatever it held."""
    try:
        with p.open(newline="", encoding="utf-8", errors="replace") as f:
            header = next(csv.reader(f), [])
    except OSError as exc:
        raise ConfigError(f"cannot read {p}: {exc}", what="runs file") from None
    seen: dict[str, list[int]] = {}
    for i, name in enumerate(header, start=1):
        seen.setdefault(name.lstrip("\ufeff").strip(), []).append(i)
    twice = {k: v for k, v in seen.items() if len(v) > 1}
    if twice:
        said = "; ".join(f"{k!r} (columns {', '.join(map(str, v))})" for k, v in twice.items())
        raise ConfigError(f"{p} names a column more than once in its header: {said}; keep one "
                          "of each (which one a reader keeps is its choice, not yours)",
                          what="runs file")


def _missing(row: dict[str, Any], fields: tuple[str, ...]) -> list[str]:
    return [f for f in fields if row.get(f) is None]


# Model fields a row cannot give (no schema column), which ``model.field`` overrides may set.
MODEL_OVERRIDABLE = ("dropout", "tied_embeddings", "moe_load_imbalance", "moe_capacity_factor",
                     "moe_pad_to_capacity")
# ... of which these describe a MoE layer's routing: applied to MoE rows only
MOE_ONLY_OVERRIDES = ("moe_load_imbalance", "moe_capacity_factor", "moe_pad_to_capacity")


def _cell_problems(row: dict[str, Any]) -> list[str]:
    """Every reason a row cannot be predicted that its cells show on their own, all of them
    (whoever fixes the CSV fixes a row in one pass, not one reason per run of validate)."""
    out: list[str] = []
    measured = row["measured_iter_time_s"]
    if measured is None:
        out.append("measured_iter_time_s missing (" + (
            "measured_tokens_per_s_per_gpu gives it once global_batch_size, seq_len and "
            "num_gpus are given" if _throughput(row) else
            "and no measured_tokens_per_s_per_gpu to derive it from") + ")")
    elif measured <= 0:
        out.append(f"measured_iter_time_s must be > 0, got {measured}")
    missing = _missing(row, MODEL_FIELDS + STRATEGY_FIELDS)
    if row["arch"] == "moe":
        missing += _missing(row, ("num_experts", "experts_per_token", "moe_ffn_hidden_size"))
    if missing:
        out.append(f"{', '.join(missing)} missing")
    if row["gpu"] is not None and row["gpu"] not in GPU_ALIASES:
        out.append(f"gpu {row['gpu']!r} has no system preset; the schema's names: "
                   f"{', '.join(GPU_ALIASES)} (an H100 of unstated form factor is h100-sxm)")
    degrees = [row[k] for k in ("tp", "pp", "dp", "cp")]
    counts = {k: row[k] for k in ("num_gpus", "tp", "pp", "dp", "cp")}
    below = [f"{k} {v}" for k, v in counts.items() if v is not None and v < 1]
    if below:
        out.append(f"{', '.join(below)}: GPU counts and parallel degrees must be ≥ 1")
    elif None not in degrees and row["num_gpus"] is not None and math.prod(degrees) != row[
            "num_gpus"]:
        out.append(f"num_gpus {row['num_gpus']} ≠ tp·pp·dp·cp = {'·'.join(map(str, degrees))} = "
                   f"{math.prod(degrees)}")
    return out + _network_problems(row)


def _network_problems(row: dict[str, Any]) -> list[str]:
    """A multi-node row without its NIC bandwidth, or one in units the schema does not use."""
    nic, n, per_node = row["scaleout_gbps_per_gpu"], row["num_gpus"], row["gpus_per_node"]
    if nic is None:
        return (["scaleout_gbps_per_gpu missing (multi-node run)"]
                if None not in (n, per_node) and n > per_node else [])
    if 0 < nic < MIN_NIC_GBPS_PER_GPU:
        return [f"scaleout_gbps_per_gpu {nic:g} is slower than any training network "
                f"(≥ {MIN_NIC_GBPS_PER_GPU} Gb/s per GPU): the schema wants Gb/s per GPU — "
                "GB/s or Tb/s in the column?"]
    if nic > MAX_NIC_GBPS_PER_GPU:
        return [f"scaleout_gbps_per_gpu {nic:g} is more than any GPU's network "
                f"(≤ {MAX_NIC_GBPS_PER_GPU} Gb/s): the schema wants it per GPU — a node's total "
                f"divided by gpus_per_node ({per_node})"]
    return []


def _precision(row: dict[str, Any], base: SystemSpec) -> tuple[str | None, str]:
    """(the row's precision, a note where it was inferred), or (None, why it cannot be): an
    unstated 16-bit precision is the one the GPU has where its bf16 and fp16 peaks are equal."""
    precision = row["precision"]
    note = ""
    if precision is None:
        if base.gpu.peak_bf16_TFLOPs != base.gpu.peak_fp16_TFLOPs:
            return None, "precision missing"
        precision = "bf16" if base.gpu.bf16 else "fp16"
        note = (f"precision unstated 16-bit: {precision} (bf16 and fp16 peaks are equal on this "
                "GPU)")
    unsupported = _unsupported_precision(precision, row["gpu"], base)
    return (None, unsupported) if unsupported else (precision, note)


def row_inputs(row: dict[str, Any], overrides: dict[str, Any] | None = None,
               attention: str | None = None) -> RunInputs | str:
    """The inputs of one row, or the reason it is skipped. ``overrides``: system values to
    replace for every row (``{"gpu.flash_attention": False}`` for a pre-FlashAttention stack)
    and strategy fields the schema has no column for (``{"strategy.zero3_gather_bucket_params":
    50_000_000}``: ZeRO-3 gathers of at most 5e7 parameters). ``attention``: the attention
    kernel the runs used (``replay/attention_kernels.py``), applied before ``overrides``."""
    overrides, strategy_over, model_over = split_overrides(overrides or {})
    if row.get(BAD):
        return f"skipped: unreadable {row[BAD]}"
    row, implied = _implied(row)
    problems = _cell_problems(row)
    base = get_system(GPU_ALIASES[row["gpu"]]) if row["gpu"] in GPU_ALIASES else None
    kernel: list[str] = []
    if attention and base is not None:
        try:
            kernel_over = kernel_overrides(attention, base.gpu.name)
            base = base.with_overrides(kernel_over) if kernel_over else base
            kernel = [f"attention kernel {attention}"
                      + "".join(f", {k} = {v!r}" for k, v in kernel_over.items())]
        except ConfigError as exc:
            problems.append(str(exc))
    if overrides and base is not None:
        base = base.with_overrides(overrides)
    precision, said = _precision(row, base) if base is not None else (None, "")
    if base is not None and precision is None:
        problems.append(said)
    if problems or base is None or precision is None:  # (no base or precision: a problem says)
        return "skipped: " + "; ".join(problems)
    notes: list[str] = ([row[ASSUMED]] if row.get(ASSUMED) else []) + implied + kernel + [
        f"system override {k} = {v!r}" for k, v in overrides.items()]
    notes += [f"{what} override {k} = {v!r}" for what, over in
              (("model", model_over), ("strategy", strategy_over)) for k, v in over.items()]
    notes += [said] if said else []
    try:
        model = _padded_vocab(_model(row, _model_over_where_meaningful(model_over, row, notes)),
                              row["tp"], notes)
        strategy = _uneven_pipeline(_strategy(row, precision), row["num_layers"], notes)
        if strategy_over:
            strategy = Strategy.from_dict({**strategy.to_dict(),
                                           **_where_meaningful(strategy_over, row, notes)})
        if (row["zero_stage"] == 2 and row.get("grad_reduce_per_microbatch") is None
                and "grad_reduce_per_microbatch" not in strategy_over
                and strategy.num_microbatches > 1):  # (the convention, where it applied)
            notes.append("ZeRO-2: each micro-batch's gradients reduce-scattered in its backward "
                         "(DeepSpeed stage 2, FSDP SHARD_GRAD_OP)")
        if (strategy.precision == "fp8" and not row.get("fp8_recipe")
                and "fp8_recipe" not in strategy_over):
            notes.append("FP8 recipe: delayed scaling assumed (Transformer Engine's and "
                         "Megatron-LM's default; --set strategy.fp8_recipe=tensorwise or mxfp8 "
                         "for current scaling or MXFP8 blocks)")
        lacks = base.gpu.lacks(strategy.precision, strategy.fp8_recipe)
        if lacks:  # (the precision alone was checked above: here, FP8's recipe)
            return (f"skipped: fp8_recipe {strategy.fp8_recipe} on {row['gpu']}: it has "
                    f"{lacks}; check the row's fp8_recipe or gpu")
        return RunInputs(model, strategy, _system(row, base), "; ".join(notes))
    except TrainsimError as exc:
        return f"skipped: {exc}"


def _where_meaningful(over: dict[str, Any], row: dict[str, Any], notes: list[str]
                      ) -> dict[str, Any]:
    """Strategy overrides for one row, less those its layout has nothing for
    (``analysis.stacks.inapplicable``: TP communication overlap at tp 1 — NeMo turns it off
    there, as Megatron turns sequence parallelism off — or without sequence parallelism,
    ZeRO-3 prefetch below ZeRO-3, a MoE dispatcher on a dense model or without expert
    parallelism, FP8 parameter gathers off an FP8 run with ZeRO ≥ 1, the overlapped parameter
    gather off ZeRO 1 and 2), and a switch or FP8 recipe the row's own column sets otherwise
    (``EXTENSION_BOOL_COLUMNS``, ``ROW_WINS_TEXT_COLUMNS``), so one ``--set`` can describe a
    stack across a mixed set. Said per row."""
    drop = [k for k in (*EXTENSION_BOOL_COLUMNS, *ROW_WINS_TEXT_COLUMNS)
            if k in over and row.get(k) not in (None, "") and row[k] != over[k]]
    notes += [f"strategy override {k} not applied (the row says {str(row[k]).lower()})"
              for k in drop]
    layout = Layout(row["tp"], bool(row.get("sequence_parallel")), row["zero_stage"],
                    row.get("precision") or "", row["arch"] == "moe" and (row["ep"] or 1) > 1)
    for k, v in over.items():
        why = None if k in drop else inapplicable(k, v, layout)
        if why:
            notes.append(f"strategy override {k} not applied {why}")
            drop.append(k)
    return {k: v for k, v in over.items() if k not in drop}


def _model_over_where_meaningful(over: dict[str, Any], row: dict[str, Any], notes: list[str]
                                 ) -> dict[str, Any]:
    """Model overrides for one row, less the MoE routing ones on a dense model. Said."""
    moe_only = [k for k in MOE_ONLY_OVERRIDES if k in over]
    if moe_only and row["arch"] != "moe":
        notes.append(f"model override {', '.join(moe_only)} not applied (a dense model)")
        return {k: v for k, v in over.items() if k not in moe_only}
    return over


def _unsupported_precision(precision: str, gpu: str, system: SystemSpec) -> str | None:
    """Why a row's precision cannot have run on its GPU (a data error, not a prediction)."""
    lacks = system.gpu.lacks(precision)
    return (f"precision {precision} on {gpu}: it has {lacks}; check the row's precision or gpu"
            if lacks else None)


def _model(row: dict[str, Any], over: dict[str, Any]) -> ModelSpec:
    moe = row["arch"] == "moe"
    return ModelSpec(
        **over,
        name=row["id"], num_layers=row["num_layers"], hidden_size=row["hidden_size"],
        num_attention_heads=row["num_attention_heads"], num_kv_heads=row["num_kv_heads"],
        ffn_hidden_size=row["ffn_hidden_size"], vocab_size=row["vocab_size"],
        seq_len=row["seq_len"], activation=row["activation"],
        num_experts=row["num_experts"] if moe else 0,
        experts_per_token=row["experts_per_token"] if moe else 0,
        moe_ffn_hidden_size=row["moe_ffn_hidden_size"] if moe else 0,
        head_dim=row.get("head_dim") or 0,
        shared_expert_ffn_hidden_size=(row.get("shared_expert_ffn_hidden_size") or 0) if moe
        else 0, first_dense_layers=(row.get("first_dense_layers") or 0) if moe else 0,
        moe_layer_pattern=(row.get("moe_layer_pattern") or "") if moe else "",
        kv_lora_rank=row.get("kv_lora_rank") or 0, q_lora_rank=row.get("q_lora_rank") or 0,
        qk_rope_head_dim=row.get("qk_rope_head_dim") or 0,
        v_head_dim=row.get("v_head_dim") or 0,
        moe_router_num_groups=(row.get("moe_router_num_groups") or 0) if moe else 0,
        moe_router_group_topk=(row.get("moe_router_group_topk") or 0) if moe else 0,
        mtp_layers=row.get("mtp_layers") or 0,
        sliding_window=row.get("sliding_window") or 0,
        attention_chunk=row.get("attention_chunk") or 0,
        window_pattern=row.get("window_pattern") or "",
        document_mean_tokens=row.get("document_mean_tokens") or 0,
        document_length_sigma=row.get("document_length_sigma") or 0.0)


def _strategy(row: dict[str, Any], precision: str) -> Strategy:
    vpp = int(row["virtual_pp"])
    return Strategy(
        tp=row["tp"], pp=row["pp"], dp=row["dp"], cp=row["cp"], ep=row["ep"], vpp=vpp,
        sequence_parallel=bool(row["sequence_parallel"]),
        micro_batch_size=row["micro_batch_size"], global_batch_size=row["global_batch_size"],
        schedule="interleaved_1f1b" if vpp > 1 else "1f1b", recompute=row["recompute"],
        zero_stage=row["zero_stage"], precision=precision,  # type: ignore[arg-type]
        expert_tp=row.get("expert_tp") or 0,
        moe_dispatcher=row.get("moe_dispatcher") or "alltoall",
        # as Megatron's command line lists them (spaces) or as trainsim's (commas)
        recompute_modules=",".join(re.split(r"[\s,;]+", row.get("recompute_modules") or "")
                                   ).strip(",") or "core_attn",
        pipeline_layout=row.get("pipeline_layout") or "",
        adam_moments_dtype=row.get("adam_moments_dtype") or "fp32",
        cross_entropy_fusion=row.get("cross_entropy_fusion") or "none",
        fp8_recipe=row.get("fp8_recipe") or "delayed",
        fp8_param_gather=bool(row.get("fp8_param_gather")),
        overlap_moe_ep_comm=bool(row.get("overlap_moe_ep_comm")),
        delay_wgrad_compute=bool(row.get("delay_wgrad_compute")),
        tp_comm_overlap=bool(row.get("tp_comm_overlap")),
        grad_reduce_in_bf16=bool(row.get("grad_reduce_in_bf16")),
        grad_reduce_per_microbatch=_per_microbatch(row),
        cpu_offload_layers=row.get("cpu_offload_layers") or 0,
        optimizer_offload_fraction=row.get("optimizer_offload_fraction") or 0.0)


def _per_microbatch(row: dict[str, Any]) -> bool:
    """Whether a row's gradients are reduced in every micro-batch: as its column says, else for
    ZeRO-2. The schema's ZeRO stages name frameworks (Megatron's distributed optimizer is 1,
    FSDP's full shard 3), and a ZeRO-2 run shards its gradients — DeepSpeed's stage 2 or FSDP's
    SHARD_GRAD_OP —, which reduce each micro-batch's as its backward makes them
    (``Strategy.grad_reduce_per_microbatch``)."""
    said = row.get("grad_reduce_per_microbatch")
    return bool(said) if said is not None else row["zero_stage"] == 2


def _padded_vocab(model: ModelSpec, tp: int, notes: list[str]) -> ModelSpec:
    """The vocabulary as Megatron-LM lays it out: padded to a multiple of 128·tp
    (``--make-vocab-size-divisible-by`` 128, ``_vocab_size_with_padding``), so that every TP rank
    holds an equal, tensor-core-friendly slice. Only applied where tp does not divide it."""
    if model.vocab_size % tp == 0:
        return model
    multiple = VOCAB_PAD * tp
    padded = -(-model.vocab_size // multiple) * multiple
    notes.append(f"vocab {model.vocab_size} padded to {padded} (multiple of 128·tp, Megatron)")
    return dataclasses.replace(model, vocab_size=padded)


def _uneven_pipeline(s: Strategy, layers: int, notes: list[str]) -> Strategy:
    """Shorter first and last model chunks where pp · vpp does not divide the layers
    (``tracegen.fit.with_shorter_end_chunks``), stated in the row's notes."""
    out = with_shorter_end_chunks(s, layers)
    if out is not s:
        unit = "stages" if s.vpp == 1 else "model chunks"
        chunks = s.pp * s.vpp
        first, last = (len(out.chunk_layers(layers, g)) for g in (0, chunks - 1))
        notes.append(f"{layers} layers on pp {s.pp}" + (f" × vpp {s.vpp}" if s.vpp > 1 else "")
                     + f": first/last {unit} {first}/{last}, others "
                     f"{len(out.chunk_layers(layers, 1))}"
                     + (" (the embedding / loss counted as layers, Megatron-Core)"
                        if first == 0 or last == 0 else ""))
    return out


def _implied(row: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Empty cells the row's other cells determine (the schema README's identities, not
    guesses): virtual_pp 1 at pp 1, sequence_parallel false at tp 1, ep 1 on a dense model, and
    the one of dp and cp that tp·pp·dp·cp = num_gpus leaves. Each is stated per row."""
    out, notes = dict(row), []

    def fill(field: str, value: Any, why: str) -> None:
        out[field] = value
        notes.append(f"{field} = {value} implied ({why})")

    if out["virtual_pp"] is None and out["pp"] == 1:
        fill("virtual_pp", 1, "pp = 1")
    if out["sequence_parallel"] is None and out["tp"] == 1:
        fill("sequence_parallel", False, "tp = 1")
    elif out["sequence_parallel"] and out["tp"] == 1:  # Megatron-LM arguments.py does the same
        fill("sequence_parallel", False, "Megatron disables it at tp = 1")
    if out["ep"] is None and out["arch"] == "dense":
        fill("ep", 1, "dense model")
    n, tp, pp = out["num_gpus"], out["tp"], out["pp"]
    if None not in (n, tp, pp) and tp > 0 and pp > 0:
        for field, other in (("cp", "dp"), ("dp", "cp")):
            known = out[other]
            if out[field] is None and known and n % (tp * pp * known) == 0:
                fill(field, n // (tp * pp * known), f"tp·pp·dp·cp = num_gpus = {n}")
    ep, dp = out["ep"], out["dp"]
    if _folded(out):
        fill("expert_tp", 1, f"ep {ep} does not divide dp {dp}, only tp·cp·dp: expert "
             "parallelism folded over them, whole experts per rank (Megatron-Core MoE parallel "
             "folding)")
    return out, notes


def _folded(row: dict[str, Any]) -> bool:
    """A MoE row whose ep cannot be carved out of dp but divides tp·cp·dp: the one layout that
    runs it is Megatron-Core's parallel folding with whole experts (expert_tp 1)."""
    ep, dp, cp, tp = row["ep"], row["dp"], row["cp"], row["tp"]
    if (row["arch"] != "moe" or row.get("expert_tp") is not None or None in (ep, dp, cp, tp)
            or min(ep, dp, cp, tp) < 1):
        return False
    return bool(dp % ep) and (tp * cp * dp) % ep == 0


def _system(row: dict[str, Any], base: SystemSpec) -> SystemSpec:
    per_node, host = row["gpus_per_node"], base.node.gpus_per_host
    # (a host that no longer divides the row's domain, GB200's tray in a domain of 2: dropped)
    node = dataclasses.replace(base.node, gpus_per_node=per_node,
                               gpus_per_host=host if host and per_node % host == 0 else 0)
    out = base.scaleout
    if row["scaleout_gbps_per_gpu"] is not None:
        out = dataclasses.replace(out, nic_Gbps_per_gpu=float(row["scaleout_gbps_per_gpu"]))
    return dataclasses.replace(base, node=node, scaleout=out)


def predict(inputs: RunInputs) -> dict[str, Any]:
    """Step time (replay of a representative-mode set) and peak memory per GPU."""
    with tempfile.TemporaryDirectory(prefix="trainsim-validate-") as tmp:
        generate(inputs.model, inputs.strategy, tmp, mode="representative",
                 gpus=inputs.strategy.world_size)
        result = replay(tmp, inputs.system)
    # The memory model with the GPU known (unfused attention keeps its score matrices).
    peak = estimate(inputs.model, inputs.strategy, inputs.system).peak_memory_GiB * GiB
    # Where the step goes on the rank that finishes last: what an error has to be explained by.
    last = result.breakdown.sort("end_s").row(-1, named=True)
    return {"predicted_iter_time_s": result.step_time_s,
            "predicted_compute_s": last["compute_s"],
            "predicted_exposed_comm_s": last["exposed_comm_s"],
            "predicted_interference_s": last["interference_s"],
            "predicted_idle_s": last["idle_s"],
            "predicted_peak_memory_GiB": peak / GiB,
            "fits": peak <= inputs.system.gpu.hbm_bytes,
            "predicted_tokens_per_s": result.metrics["tokens_per_s"],
            "predicted_mfu": result.metrics["mfu"]}


def predict_fast(inputs: RunInputs) -> dict[str, Any]:
    """Step time and peak memory from the fast path, with tokens/s and MFU as replay derives them
    (replay/results.py); the compute / communication / idle split is left empty."""
    m, s, system = inputs.model, inputs.strategy, inputs.system
    est = estimate(m, s, system)
    rates = strategy_rates(m, s, system, est.step_time_s)
    return {"predicted_iter_time_s": est.step_time_s,
            "predicted_peak_memory_GiB": est.peak_memory_GiB,
            "fits": est.fits,
            "predicted_tokens_per_s": rates["tokens_per_s"],
            "predicted_mfu": rates["mfu"]}


def validate(path: str | Path, *, progress: Callable[[int, int], None] | None = None,
             jobs: int = 1, overrides: dict[str, Any] | None = None,
             fast: bool = False, assume: dict[str, Any] | None = None,
             attention: str | None = None) -> pl.DataFrame:
    """One row per run: status, predicted vs measured step time, error, memory and fit.
    ``jobs`` > 1 predicts rows in that many processes (rows are independent; order is kept).
    ``overrides`` replace system values for every row (checked on every preset first).
    ``fast`` predicts with the closed-form fast path instead of replay (seconds for a large set;
    within 2% of replay on healthy symmetric cases; no compute/communication breakdown).
    ``assume`` fills schema cells a row leaves empty (``{"micro_batch_size": 1}``) — the
    caller's assumption, stated per row; cells the row gives are kept. ``attention`` names the
    attention kernel the runs used (``replay/attention_kernels.py``; a GPU without a published
    curve for it skips its rows, saying so)."""
    if attention is not None and attention not in KERNELS:
        kernel_overrides(attention, "")  # raises, naming the kernels there are
    values = _assumptions(assume or {})
    runs = [_step_from_throughput(_assume(r, values))
            for r in load_runs(path).iter_rows(named=True)]
    system_over, strategy_over, model_over = split_overrides(overrides or {})
    for name in sorted(set(GPU_ALIASES.values())) if system_over else ():
        get_system(name).with_overrides(system_over)  # a bad override fails once, here
    unknown = sorted(set(strategy_over) - {f.name for f in dataclasses.fields(Strategy)})
    if unknown:  # ... and here; values are checked per row, with the row's own fields
        raise ConfigError([unknown_key(k, (f.name for f in dataclasses.fields(Strategy)))
                           for k in unknown], what="strategy override")
    wrong = [p for k, v in strategy_over.items() if (p := _override_type_problem(k, v))]
    if wrong:  # a value of the wrong kind fails every row: once, here (not 49 skipped rows)
        raise ConfigError(wrong, what="strategy override")
    unknown = sorted(set(model_over) - set(MODEL_OVERRIDABLE))
    if unknown:
        raise ConfigError([f"model.{k}: not a model field a row leaves open (those are "
                           f"{', '.join(MODEL_OVERRIDABLE)}; the rest come from the row's "
                           "columns)" for k in unknown], what="model override")
    if model_over:  # values checked once, on a placeholder shape
        try:
            moe: dict[str, Any] = dict(num_experts=2, experts_per_token=1,
                                       moe_ffn_hidden_size=8) if (
                set(MOE_ONLY_OVERRIDES) & set(model_over)) else {}
            ModelSpec(name="override", num_layers=1, hidden_size=8, num_attention_heads=1,
                      ffn_hidden_size=8, vocab_size=8, seq_len=8, **moe, **model_over)
        except ConfigError as exc:
            raise ConfigError(exc.problems, what="model override") from None
    one = functools.partial(_safe_row, overrides=overrides, fast=fast, attention=attention)
    if jobs <= 1 or len(runs) < 2:
        return _collect(map(one, runs), len(runs), progress)
    # "spawn", not fork: polars' thread pool does not survive a fork (as in analysis/runner.py)
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=min(jobs, len(runs)), mp_context=ctx) as pool, \
            worker_deaths_said("--jobs 1 / jobs=1"):
        return _collect(pool.map(one, runs), len(runs), progress)


def _override_type_problem(key: str, value: Any) -> str | None:
    """Whether a ``strategy.KEY`` value is of the field's kind (its default's type)."""
    default = next(f.default for f in dataclasses.fields(Strategy) if f.name == key)
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if isinstance(default, bool):
        kind, ok = "true or false", isinstance(value, bool)
    elif isinstance(default, int):
        kind, ok = "a whole number", number and isinstance(value, int)
    elif isinstance(default, float):
        kind, ok = "a number", number
    elif isinstance(default, str):
        kind, ok = "text", isinstance(value, str)
    else:
        return None
    if ok:
        return None
    hint = (f" (write {int(value)})" if isinstance(value, float) and value.is_integer()
            and isinstance(default, int) else "")
    return f"strategy.{key} must be {kind}, got {value!r}{hint}"


ASSUMED = "_assumed"  # per row: the cells ``assume`` filled, as text for its assumptions
DERIVED = "_derived"  # per row: how its measured step time was derived here, if it was


def _step_from_throughput(row: dict[str, Any]) -> dict[str, Any]:
    """A row without a step time but with its measured tokens/s per GPU gets the step time
    they imply, global batch × sequence ÷ (tokens/s per GPU × GPUs) — the schema's own
    ``from_tokens_per_s`` derivation (shared/validation/README.md), exact arithmetic on a
    measurement, not an assumption; the row says so. (MFU or TFLOP/s alone would need the
    source's FLOP formula: such rows stay skipped.)"""
    per_gpu = _throughput(row)
    if row.get("measured_iter_time_s") is not None or per_gpu is None:
        return row
    gbs, seq, gpus = (row.get(k) for k in ("global_batch_size", "seq_len", "num_gpus"))
    if not (isinstance(gbs, int) and isinstance(seq, int) and isinstance(gpus, int)
            and gpus > 0):
        return row
    step_s = gbs * seq / (per_gpu * gpus)
    return {**row, "measured_iter_time_s": step_s,
            DERIVED: f"measured_iter_time_s {step_s:.4g} s from measured_tokens_per_s_per_gpu "
                     f"{per_gpu:g} (global_batch_size × seq_len ÷ (tokens/s per GPU × "
                     "num_gpus): the row gives no step time)"}


def _throughput(row: dict[str, Any]) -> float | None:
    """The row's measured tokens/s per GPU where it gives a usable one (the column is text:
    not an input, so an unreadable cell is just absent)."""
    try:
        per_gpu = float(row.get("measured_tokens_per_s_per_gpu") or "nan")
    except (TypeError, ValueError):
        return None
    return per_gpu if math.isfinite(per_gpu) and per_gpu > 0 else None


def _assumptions(assume: dict[str, Any]) -> dict[str, Any]:
    """``assume`` checked against the schema: input columns only, each value of its type."""
    problems, out = [], {}
    allowed = set(REQUIRED_COLUMNS) - set(KEY_COLUMNS)
    for col, v in assume.items():
        if col not in allowed:
            problems.append(f"{col!r} is not an input column of the schema (one of "
                            f"{', '.join(sorted(allowed))})")
        elif col in INT_COLUMNS and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            problems.append(f"{col} takes a whole number ≥ 0, got {v!r}")
        elif col in FLOAT_COLUMNS and not is_finite_number(v):
            problems.append(f"{col} takes a finite number, got {v!r}")
        elif col in BOOL_COLUMNS and not isinstance(v, bool):
            problems.append(f"{col} takes true or false, got {v!r}")
        elif col not in INT_COLUMNS + FLOAT_COLUMNS + BOOL_COLUMNS and not isinstance(v, str):
            problems.append(f"{col} takes text, got {v!r}")
        else:
            out[col] = v.strip().lower() if col in ENUM_COLUMNS and isinstance(v, str) else v
    if problems:
        raise ConfigError(problems, what="--assume")
    return out


def _assume(row: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """The row with its empty cells among ``values`` filled, and what was filled noted."""
    filled = {c: v for c, v in values.items() if row.get(c) is None}
    if not filled:
        return row
    note = "; ".join(f"{c} = {v} assumed (--assume; not in the source)" for c, v in filled.items())
    return {**row, **filled, ASSUMED: note}


def _collect(results: Iterable[dict[str, Any]], n: int,
             progress: Callable[[int, int], None] | None) -> pl.DataFrame:
    rows = []
    for i, result in enumerate(results):
        rows.append(result)
        if progress:
            progress(i + 1, n)
    return pl.DataFrame(rows, schema=RESULT_SCHEMA)


def _safe_row(row: dict[str, Any], overrides: dict[str, Any] | None = None, fast: bool = False,
              attention: str | None = None) -> dict[str, Any]:
    try:
        return _validate_row(row, overrides, fast, attention)
    except Exception as exc:  # one odd row must not sink a whole batch
        return {**{k: None for k in RESULT_SCHEMA}, "id": row.get("id"),
                "status": _one_line(f"skipped: unexpected {type(exc).__name__}: "
                                    f"{exc} (a trainsim bug: please report this row)")}


RESULT_SCHEMA = {
    "id": pl.String, "source": pl.String, "model": pl.String, "gpu": pl.String,
    "status": pl.String,
    "predicted_iter_time_s": pl.Float64, "measured_iter_time_s": pl.Float64,
    "error_pct": pl.Float64, "predicted_peak_memory_GiB": pl.Float64, "fits": pl.Boolean,
    "predicted_tokens_per_s": pl.Float64, "predicted_mfu": pl.Float64,
    "predicted_compute_s": pl.Float64, "predicted_exposed_comm_s": pl.Float64,
    "predicted_idle_s": pl.Float64, "predicted_interference_s": pl.Float64,
    "assumptions": pl.String,
}


def _one_line(text: str) -> str:
    """A status cell on one line (CSV readers and the table both prefer it)."""
    return " ".join(text.split())


def _validate_row(row: dict[str, Any], overrides: dict[str, Any] | None = None,
                  fast: bool = False, attention: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {k: None for k in RESULT_SCHEMA}
    out.update(id=row["id"], source=str(row["id"]).split("-")[0], model=row.get("model_name"),
               gpu=row["gpu"], measured_iter_time_s=row["measured_iter_time_s"])
    inputs = row_inputs(row, overrides, attention)
    if isinstance(inputs, str):
        out["status"] = _one_line(inputs)
        return out
    notes = "; ".join(filter(None, (row.get(DERIVED), inputs.assumptions)))
    nodes = None if fast else replay_size.oversized(inputs.model, inputs.strategy)
    if nodes:
        fast = True
        notes = "; ".join(filter(None, (notes, "predicted by the fast path: "
                                        + replay_size.why(nodes))))
    try:
        pred = predict_fast(inputs) if fast else predict(inputs)
    except TrainsimError as exc:
        out["status"] = _one_line(f"skipped: {type(exc).__name__}: {exc}")
        return out
    except Exception as exc:  # one odd row must not sink a whole batch
        out["status"] = _one_line(f"skipped: unexpected {type(exc).__name__}: {exc} "
                                  "(a trainsim bug: please report this row)")
        return out
    # the measurement is judged once the inputs have proved predictable: a row that is wrong
    # on both counts is told first what keeps it from being predicted
    impossible = (_faster_than_peak(inputs, row["measured_iter_time_s"])
                  or _disagrees_with_throughput(row, inputs))
    if impossible:
        out["status"] = impossible
        return out
    out.update(pred, status="ok", assumptions=notes)
    measured = row["measured_iter_time_s"]
    out["error_pct"] = 100 * (pred["predicted_iter_time_s"] - measured) / measured
    return out


def _faster_than_peak(inputs: RunInputs, measured_s: float) -> str | None:
    """A measured step shorter than the model's FLOPs at the GPUs' datasheet peak is a data
    error (milliseconds in the seconds column, a per-GPU batch as the global one): say so."""
    m, s, system = inputs.model, inputs.strategy, inputs.system
    mfu = strategy_rates(m, s, system, measured_s)["mfu"]
    if mfu <= 1:
        return None
    return (f"skipped: measured_iter_time_s {measured_s:g} s would be {100 * mfu:.0f}% of the "
            f"GPUs' {s.precision} peak in model FLOPs alone: not seconds per global batch "
            "(milliseconds? a per-GPU batch?)")


# A row's measured step time and its measured tokens/s per GPU describe one step: a published
# pair agrees to rounding (the public set's eleven such rows within 0.2%). Beyond this factor
# (twice, leaving room for a convention we do not know) one of them is in other units
# (milliseconds; a per-node figure; a per-GPU batch as the global one), and the step
# time is not trusted: it is what the prediction is judged against.
THROUGHPUT_MISMATCH = 2.0


def _disagrees_with_throughput(row: dict[str, Any], inputs: RunInputs) -> str | None:
    """The step time the row's measured tokens/s per GPU implies (global batch × sequence ÷
    (tokens/s per GPU × GPUs)), where the row has one, against its measured step time."""
    per_gpu = _throughput(row)
    if per_gpu is None:
        return None
    s, measured = inputs.strategy, row["measured_iter_time_s"]
    implied = s.global_batch_size * inputs.model.seq_len / (per_gpu * s.world_size)
    if max(measured / implied, implied / measured) <= THROUGHPUT_MISMATCH:
        return None
    return (f"skipped: measured_iter_time_s {measured:g} s disagrees with the row's "
            f"measured_tokens_per_s_per_gpu {per_gpu:g}, which gives {implied:.4g} s for "
            f"{s.global_batch_size} × {inputs.model.seq_len} tokens on {s.world_size} GPUs "
            f"({measured / implied:.3g}×): one is in other units (milliseconds? a per-node "
            "figure?); correct the row")


def summarize(results: pl.DataFrame) -> pl.DataFrame:
    """Median, p90 and max |error| overall, by GPU type and by source; where ``assume`` completed
    some rows, also apart: the rows from the source alone, and those."""
    ok = results.filter(pl.col("status") == "ok").with_columns(
        pl.col("error_pct").abs().alias("abs_error_pct"))
    parts = [ok.with_columns(pl.lit("all").alias("group"))]
    parts += [ok.with_columns(("gpu=" + pl.col("gpu")).alias("group")),
              ok.with_columns(("source=" + pl.col("source")).alias("group"))]
    assumed = pl.col("assumptions").fill_null("").str.contains("--assume", literal=True)
    if ok.filter(assumed).height:
        parts += [ok.filter(~assumed).with_columns(pl.lit("inputs=source").alias("group")),
                  ok.filter(assumed).with_columns(pl.lit("inputs=--assume").alias("group"))]
    frame = pl.concat(parts)
    return frame.group_by("group", maintain_order=True).agg(
        pl.len().alias("rows"),
        pl.col("abs_error_pct").median().alias("median_abs_error_pct"),
        pl.col("abs_error_pct").quantile(0.9, "linear").alias("p90_abs_error_pct"),
        pl.col("abs_error_pct").max().alias("max_abs_error_pct"),
        pl.col("error_pct").mean().alias("mean_signed_error_pct"))



PAIR_SCHEMA = {"source": pl.String, "model": pl.String, "a": pl.String, "b": pl.String,
               "measured_ratio": pl.Float64, "predicted_ratio": pl.Float64,
               "ratio_error_pct": pl.Float64, "order_right": pl.Boolean}


def pairs(results: pl.DataFrame) -> pl.DataFrame:
    """Relative accuracy, what a planner choosing between configurations relies on: every pair
    of predicted runs of one model from one source (a before b by id), the measured and the
    predicted ratio of their step times a/b, the ratio's error, and whether the prediction
    orders them as the measurement does (a tie measured counts as ordered only if predicted)."""
    ok = results.filter((pl.col("status") == "ok") & pl.col("model").is_not_null()).sort("id")
    rows = []
    for (source, model), g in ok.group_by(["source", "model"], maintain_order=True):
        runs = list(g.iter_rows(named=True))
        for a, b in itertools.combinations(runs, 2):
            m = a["measured_iter_time_s"] / b["measured_iter_time_s"]
            p = a["predicted_iter_time_s"] / b["predicted_iter_time_s"]
            rows.append({"source": source, "model": model, "a": a["id"], "b": b["id"],
                         "measured_ratio": m, "predicted_ratio": p,
                         "ratio_error_pct": 100 * (p / m - 1),
                         "order_right": (p > 1) - (p < 1) == (m > 1) - (m < 1)})
    return pl.DataFrame(rows, schema=PAIR_SCHEMA)


def summarize_pairs(frame: pl.DataFrame) -> pl.DataFrame:
    """Pairs, median and max |ratio error| and the share ordered right, overall and by source."""
    parts = [frame.with_columns(pl.lit("all").alias("group")),
             frame.with_columns(("source=" + pl.col("source")).alias("group"))]
    return pl.concat(parts).with_columns(pl.col("ratio_error_pct").abs().alias("abs")).group_by(
        "group", maintain_order=True).agg(
        pl.len().alias("pairs"),
        pl.col("abs").median().alias("median_abs_ratio_error_pct"),
        pl.col("abs").max().alias("max_abs_ratio_error_pct"),
        (100 * pl.col("order_right").mean()).alias("ordered_right_pct"))
