"""Published layouts of one model against their published MFU, with the data-parallel gradients
reduced once a step (Megatron's distributed optimizer) and in every micro-batch (sharded
gradients: DeepSpeed's ZeRO-2, FSDP's SHARD_GRAD_OP, Meta's Llama 3 FSDP): which reading the
measurement supports. A runs table lists ``gpus, tp, cp, pp, dp, seq_len, batch_sequences,
measured_mfu_pct`` (``tests/data/llama3_table4.csv``: Dubey et al. 2024 Table 4); the fields
every row shares (schedule, chunks, ZeRO stage, …) are given as strategy fields."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import polars as pl

from analysis.fastpath import estimate
from analysis.glance import strategy_rates
from replay.hardware import SystemSpec
from tracegen import ConfigError, ModelSpec, Strategy, with_seq_len
from tracegen.fit import with_shorter_end_chunks

COLUMNS = ("gpus", "tp", "cp", "pp", "dp", "seq_len", "batch_sequences", "measured_mfu_pct")


def read_layouts(path: str | Path) -> pl.DataFrame:
    """A runs table (``#`` lines are its source), its columns checked."""
    frame = pl.read_csv(path, comment_prefix="#")
    missing = [c for c in COLUMNS if c not in frame.columns]
    if missing:
        raise ConfigError(f"{path}: columns {missing} missing (a layouts table has "
                          f"{', '.join(COLUMNS)})", what="layouts")
    return frame


def layout_mfu(runs: pl.DataFrame, model: ModelSpec, system: SystemSpec, **fields: Any
               ) -> pl.DataFrame:
    """Per row: predicted MFU (fast path, Megatron's FLOP count) with the gradients reduced
    once a step and in every micro-batch, and each one's error against the published MFU."""
    out = []
    for row in runs.iter_rows(named=True):
        m = with_seq_len(model, row["seq_len"])
        base = Strategy(tp=row["tp"], cp=row["cp"], pp=row["pp"], dp=row["dp"],
                        global_batch_size=row["batch_sequences"],
                        cp_comm_type="all_gather" if row["cp"] > 1 else "p2p", **fields)
        base = with_shorter_end_chunks(base, m.num_layers)
        mfu = {per: 100 * _mfu(m, dataclasses.replace(base, grad_reduce_per_microbatch=per),
                               system) for per in (False, True)}
        measured = row["measured_mfu_pct"]
        out.append({"run": f"{row['gpus']:,} GPUs, {row['seq_len'] // 1024}K tokens"
                           + (f", cp {row['cp']}" if row["cp"] > 1 else ""),
                    "measured_mfu_pct": float(measured),
                    "once_mfu_pct": mfu[False], "per_microbatch_mfu_pct": mfu[True],
                    "once_error_pct": 100 * (mfu[False] / measured - 1),
                    "per_microbatch_error_pct": 100 * (mfu[True] / measured - 1)})
    return pl.DataFrame(out)


def _mfu(model: ModelSpec, s: Strategy, system: SystemSpec) -> float:
    """MFU of the fast path's step (``glance``'s rates, without its hints' extra estimates)."""
    return strategy_rates(model, s, system, estimate(model, s, system).step_time_s)["mfu"]
