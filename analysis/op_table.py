"""Where a stage's time goes, op by op: every operator and collective one micro-batch runs on
one pipeline stage — each block (embedding, transformer layer, head, …) once, with how many of
it the stage holds — priced by the same models the fast path and replay use
(``replay.compute.RooflineCompute.explain``, the network's collective cost for the stage's
groups), with the terms of each op's roofline: tensor-core time at its modelled efficiency
(the measured matmul or attention efficiency times wave quantization, reduction length,
sequence length and head size), HBM time, launch overhead, and which of them sets its time.

What the table leaves out: the pipeline's sends and the data-parallel gradient buckets,
optimizer and ZeRO 1-2 parameter gathers (``trainsim estimate``'s step breakdown); ZeRO-3's
per-block gathers and reduce-scatters are rows. Overlapped collectives (``overlapped``) run
beside the GEMM after them; what that costs a pass (kernels slowed beside them, a collective
longer than the GEMM it hides behind) is one ``overlap`` row, so the rows in series add up to
the fast path's stage forward and backward."""

from __future__ import annotations

import collections
from typing import Any

import polars as pl

from analysis.fastpath import resolve_specs
from analysis.fastpath_costs import Costs
from analysis.fastpath_stages import block_ns, zero3_axes
from replay.hardware import SystemSpec
from tracegen import ops as O
from tracegen.errors import ConfigError
from tracegen.fit import check_fits_model
from tracegen.model import ModelSpec
from tracegen.program import ParamBlock
from tracegen.strategy import Strategy
from tracegen.units import NS_PER_US

PASSES = ("forward", "recompute", "backward", "weights")  # (weights: ZB-H1's W pass)
SCHEMA = {
    "stage": pl.Int64, "block": pl.String, "count": pl.Int64, "pass": pl.String,
    "op": pl.String, "kind": pl.String, "axis": pl.String, "m": pl.Int64, "n": pl.Int64,
    "k": pl.Int64, "groups": pl.Int64, "dtype": pl.String, "flop": pl.Int64, "bytes": pl.Int64,
    "time_us": pl.Float64, "compute_us": pl.Float64, "memory_us": pl.Float64,
    "launch_us": pl.Float64, "efficiency": pl.Float64, "achieved_tflops": pl.Float64,
    "flop_per_byte": pl.Float64, "bound": pl.String, "overlapped": pl.Boolean,
}


def op_table(model: ModelSpec | str, strategy: Strategy, system: SystemSpec | str, *,
             stage: int = 0) -> pl.DataFrame:
    """One row per op or collective of one micro-batch on pipeline ``stage`` (module docstring),
    in the order each block runs them: forward, what recomputation runs again before the
    backward, backward (ZB-H1: its B pass, then its W pass as "weights"). ``count``: how many
    of the block the stage holds (its layers), so ``time_us × count`` summed over a pass is the
    stage's time for it."""
    model, system = resolve_specs(model, system)
    check_fits_model(strategy, model)
    if not 0 <= stage < strategy.pp:
        raise ConfigError(f"stage {stage} is not in a pipeline of {strategy.pp}: choose 0 … "
                          f"{strategy.pp - 1}", what="op table")
    costs = Costs(model, strategy, system)
    rank = stage * (strategy.world_size // strategy.pp)  # the stage's dp = cp = tp = 0 rank
    sig = costs.signature(rank)
    rows = []
    for block, count in _stage_blocks(costs, stage).items():
        for pass_, items, charged in _passes(costs, block, rank, sig):
            ours = [_row(costs, rank, it) for it in items]
            ours += _zero3_rows(costs, block, rank, pass_)
            # what the fast path charges the pass beyond its rows in series: kernels slowed
            # beside overlapped collectives, collectives longer than the kernel they hide
            # behind (``Costs.items_segments``), ZeRO-3's dense and expert streams side by side
            serial = sum(round(r["time_us"] * NS_PER_US) for r in ours if not r["overlapped"])
            if charged != serial:
                ours.append({"op": "beside overlapped collectives", "kind": "overlap",
                             "axis": "", "time_us": (charged - serial) / NS_PER_US,
                             "bound": "interference", "overlapped": False})
            rows += [r | {"stage": stage, "block": _label(block), "count": count,
                          "pass": pass_} for r in ours]
    return pl.DataFrame(rows, schema=SCHEMA)


def by_kind(table: pl.DataFrame) -> pl.DataFrame:
    """The table summed per pass and kind of op over the stage's blocks (× their counts):
    milliseconds and share of the serial sum (overlapped collectives apart: they run beside)."""
    serial = table.filter(~pl.col("overlapped"))
    total = (serial["time_us"] * serial["count"]).sum()
    return (table.with_columns((pl.col("time_us") * pl.col("count") / 1e3).alias("time_ms"))
            .group_by("pass", "kind", "overlapped", maintain_order=True)
            .agg(pl.col("time_ms").sum(), pl.col("flop").mul(pl.col("count")).sum())
            .with_columns(pl.when(~pl.col("overlapped"))
                          .then(pl.col("time_ms") * 1e3 / total * 100).alias("share_pct"))
            .sort(pl.col("pass").replace_strict(PASSES, range(len(PASSES)),
                                                return_dtype=pl.Int64),
                  pl.col("time_ms"), descending=[False, True]))


def _stage_blocks(costs: Costs, stage: int) -> dict[ParamBlock, int]:
    """The stage's blocks over all its chunks, each with how many of it the stage holds."""
    s = costs.s
    counts: dict[ParamBlock, int] = collections.Counter()
    for chunk in range(s.vpp):
        for block, count in costs.prog.chunk_runs(s.gci(stage, chunk)):
            counts[block] += count
    return dict(counts)


def _passes(costs: Costs, block: ParamBlock, rank: int, sig: int
            ) -> list[tuple[str, list[O.Item], int]]:
    """A block's passes as the fast path charges them (``fastpath_stages.block_ns``): (pass,
    its op list, its ns). ZeRO-3 with prefetch times whole chunks, not blocks
    (``fastpath_stages._prefetched_chunk``): its passes are charged their lists alone, with the
    gathers and reduce-scatters beside them."""
    s, prog = costs.s, costs.prog
    fwd = prog.block_items(block, "fwd")
    out = [("forward", fwd, costs.list_ns(block, "fwd", rank, sig))]
    if block.recomputes and s.recompute == "full":
        out.append(("recompute", fwd, out[0][2]))
    elif block.recomputes and s.recompute == "selective":
        out.append(("recompute", prog.selective_items(costs.recomputed, block.name),
                    costs.list_ns(block, costs.recomputed, rank, sig)))
    which = "b" if costs.zb else "bwd"  # (ZB-H1: the B pass, its weight GEMMs in W)
    bwd = costs.list_ns(block, which, rank, sig)
    if s.zero_stage == 3 and not s.zero3_prefetch:  # the gathers and scatters in the chain
        f, b = block_ns(costs, block, rank, sig)
        out[0] = ("forward", fwd, f)
        bwd = b - sum(charged for pass_, _, charged in out[1:])
    out.append(("backward", prog.block_items(block, which), bwd))
    if costs.zb:
        out.append(("weights", prog.block_items(block, "w"), costs.list_ns(block, "w", rank,
                                                                           sig)))
    return out


def _zero3_rows(costs: Costs, block: ParamBlock, rank: int, pass_: str
                ) -> list[dict[str, Any]]:
    """ZeRO-3: the block's parameter all-gathers (forward and backward) and gradient
    reduce-scatters (backward), dense and expert, as ``fastpath_stages.zero3_axes`` times them;
    beside the compute (``overlapped``) where prefetched."""
    s = costs.s
    if s.zero_stage != 3 or pass_ == "recompute":
        return []
    colls: tuple[O.CollType, ...] = (("ALL_GATHER",) if pass_ == "forward"
                                     else ("ALL_GATHER", "REDUCE_SCATTER"))
    out: list[dict[str, Any]] = []
    for coll in colls:
        for axis, ns in zip(("dp", "edp"), zero3_axes(costs, block, rank, coll), strict=True):
            if ns:
                out.append({"op": "param_all_gather" if coll == "ALL_GATHER"
                            else "grad_reduce_scatter", "kind": coll.lower(), "axis": axis,
                            "time_us": ns / NS_PER_US, "bound": "network",
                            "overlapped": s.zero3_prefetch})
    return out


def _label(block: ParamBlock) -> str:
    """A block's name, with the layers that keep their activations under partial recompute
    (``recompute_num_layers``) told apart."""
    return f"{block.name} (stored)" if block.stored else block.name


def _row(costs: Costs, rank: int, it: O.Item) -> dict[str, Any]:
    if isinstance(it, O.Comm):
        ns = costs.coll_ns(it, rank)
        return {"op": it.name, "kind": it.coll.lower(), "axis": it.axis,
                "bytes": it.size_bytes, "time_us": ns / NS_PER_US, "bound": "network",
                "overlapped": it.overlapped}
    cost = costs.compute.explain_op(it)
    return {"op": it.name, "kind": str(it.kind), "axis": "", "m": it.m, "n": it.n, "k": it.k,
            "groups": it.groups, "dtype": it.dtype, "flop": it.flop, "bytes": it.bytes,
            "time_us": cost.total_ns / NS_PER_US, "compute_us": cost.compute_ns / NS_PER_US,
            "memory_us": cost.memory_ns / NS_PER_US, "launch_us": cost.launch_ns / NS_PER_US,
            "efficiency": cost.efficiency or None,
            "achieved_tflops": it.flop / cost.total_ns / 1e3 if cost.total_ns else None,
            "flop_per_byte": it.flop / it.bytes if it.bytes else None, "bound": cost.bound,
            "overlapped": False}
