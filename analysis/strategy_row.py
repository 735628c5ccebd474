"""A strategy as a result row carries it, and back: every field, so that nothing a row was costed
with is lost to its label, and the command-line flags that rebuild it.

A sweep's winner is where a plan goes next — ``trainsim estimate --ops`` for where its step goes,
``tracegen`` for ASTRA-sim, a study's ``[[strategies]]`` for its failure economics. Its label
(``tp4-pp2-…-rcf10-z1-sp``) names the layout but is not a format to read back, and its columns
had held fifteen of the strategy's thirty-seven fields: a recomputed-to-fit layer count or a
sweep's uneven split was in the label alone. A row now holds every field
(``strategy_from_row`` rebuilds the strategy exactly) and ``cli_flags`` writes the flags that
``trainsim estimate`` and ``trainsim tracegen`` take for it.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from collections.abc import Mapping
from typing import Any

import polars as pl

from tracegen import ConfigError, Strategy

_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(Strategy)}
_DTYPES = {bool: pl.Boolean, int: pl.Int64, float: pl.Float64, str: pl.String}

# Every strategy field's column type (``bool`` before ``int``: a bool is an int in Python).
FIELD_COLUMNS: dict[str, Any] = {name: _DTYPES[type(v)] for name, v in _DEFAULTS.items()}

# The flag of each field ``trainsim estimate``/``tracegen`` take (cli_common.build_strategy);
# dp is --gpus / (tp·pp·cp). A field absent here has no flag (only a study sets it).
FLAGS: dict[str, str] = {
    "tp": "--tp", "pp": "--pp", "cp": "--cp", "ep": "--ep", "vpp": "--vpp",
    "sequence_parallel": "--sp", "micro_batch_size": "--mbs", "global_batch_size": "--gbs",
    "schedule": "--schedule", "recompute": "--recompute", "zero_stage": "--zero",
    "precision": "--precision", "tp_comm_overlap": "--tp-comm-overlap",
    "overlap_param_gather": "--overlap-param-gather",
    "first_stage_layers": "--first-stage-layers", "last_stage_layers": "--last-stage-layers",
    "grad_reduce_in_bf16": "--grad-reduce-bf16", "cp_comm_type": "--cp-comm-type",
    "cp_balance": "--cp-balance",
    "expert_tp": "--expert-tp", "zero3_prefetch": "--zero3-prefetch",
    "zb_w_regather": "--zb-w-regather",
    "account_for_embedding_in_pipeline_split": "--account-for-embedding-in-pipeline-split",
    "account_for_loss_in_pipeline_split": "--account-for-loss-in-pipeline-split",
    "microbatch_group_size": "--microbatch-group-size",
    "recompute_num_layers": "--recompute-num-layers", "recompute_modules": "--recompute-modules",
    "moe_dispatcher": "--moe-dispatcher",
    "moe_shared_expert_overlap": "--moe-shared-expert-overlap",
    "overlap_moe_ep_comm": "--overlap-moe-expert-parallel-comm",
    "delay_wgrad_compute": "--delay-wgrad-compute",
    "pipeline_layout": "--pipeline-layout", "adam_moments_dtype": "--adam-moments",
    "fp8_param_gather": "--fp8-param-gather", "dist_opt_instances": "--dist-opt-instances",
    "outer_dp_sharding_strategy": "--outer-dp-sharding",
    "grad_reduce_per_microbatch": "--grad-reduce-per-microbatch",
    "cross_entropy_fusion": "--cross-entropy-fusion", "fp8_recipe": "--fp8-recipe",
    "cpu_offload_layers": "--cpu-offload-layers",
    "optimizer_offload_fraction": "--optimizer-offload-fraction",
}
_ALWAYS = ("micro_batch_size", "global_batch_size")  # the flags estimate requires


def row_fields(s: Strategy) -> dict[str, Any]:
    """Every field of ``s`` by name, as a result row holds them."""
    return {k: getattr(s, k) for k in FIELD_COLUMNS}  # (asdict copies deeply: slower)


def strategy_from_row(row: Mapping[str, Any]) -> Strategy:
    """The strategy a result row was costed with (a row of ``compare``, ``sweep`` or ``scale``).
    A row written before rows held every field is named, not guessed at."""
    missing = [k for k in FIELD_COLUMNS if row.get(k) is None]
    if missing:
        raise ConfigError(f"this result row lacks the strategy fields {', '.join(missing)} "
                          "(written by an earlier trainsim, whose rows held only the label's "
                          "fields): run the study again into a new folder", what="result row")
    return Strategy.from_dict({k: row[k] for k in FIELD_COLUMNS})


def cli_flags(s: Strategy) -> str:
    """The flags after ``trainsim estimate --model M --system S`` (or ``tracegen``) that rebuild
    ``s``: ``--gpus``, ``--mbs``, ``--gbs`` and every field off its default. A field no flag
    sets (a study's ``dp_bucket_params``, say) follows as a shell comment naming it."""
    words = ["--gpus", str(s.world_size)]
    for name, flag in FLAGS.items():
        value = getattr(s, name)
        if value == _DEFAULTS[name] and name not in _ALWAYS:
            continue
        # every switch is off by default, so one off its default is on
        words += [flag] if isinstance(value, bool) else [flag, shlex.quote(str(value))]
    text = " ".join(words)
    unflagged = [f"{k} = {json.dumps(getattr(s, k))}" for k in FIELD_COLUMNS
                 if k not in FLAGS and k != "dp" and getattr(s, k) != _DEFAULTS[k]]
    return text + (f"  # and, with no flag (a study's [[strategies]] key): "
                   f"{', '.join(unflagged)}" if unflagged else "")


def strategy_toml(s: Strategy) -> str:
    """``s`` as a study's ``[[strategies]]`` table (every field off its default; dp and the
    global batch follow from the study's gpus and global_batch_size)."""
    lines = ["[[strategies]]"] + [
        f"{k} = {json.dumps(getattr(s, k))}" for k in FIELD_COLUMNS
        if k not in ("dp", "global_batch_size") and getattr(s, k) != _DEFAULTS[k]]
    return "\n".join(lines)


def estimate_command(model_ref: str, system_ref: str, flags: str, stack: str = "") -> str:
    """``trainsim estimate`` of a strategy (its ``cli_flags``) on a model and system as the
    command line names them, under a study's ``stack`` (``stacks.command_parts``);
    ``tracegen`` takes the same flags."""
    extra = ""
    if stack:
        from analysis.stacks import command_parts

        system_ref, extra = command_parts(stack, system_ref)
    return (f"trainsim estimate --model {shlex.quote(model_ref)} "
            f"--system {shlex.quote(system_ref)} {flags}" + (f" {extra}" if extra else ""))


__all__ = ["FIELD_COLUMNS", "FLAGS", "cli_flags", "estimate_command", "row_fields",
           "strategy_from_row", "strategy_toml"]
