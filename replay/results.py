"""Replay results as polars frames: the timeline, per-rank breakdowns and step metrics; and the
Perfetto / Chrome trace-event export."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from replay import display
from replay.hardware import GPUSpec
from replay.reader import COLL_TYPE_NAMES, NODE_TYPE_NAMES
from replay.sim import Simulator
from replay.traceset import TraceSet
from tracegen.flops import step_rates
from tracegen.model import ModelSpec
from tracegen.strategy import Strategy
from tracegen.units import NS_PER_S


@dataclasses.dataclass(frozen=True, slots=True)
class ReplayResult:
    timeline: pl.DataFrame
    breakdown: pl.DataFrame
    metrics: dict[str, Any]
    waits: pl.DataFrame = dataclasses.field(default_factory=pl.DataFrame)
    fault_events: tuple[dict[str, Any], ...] = ()

    @property
    def step_time_s(self) -> float:
        return float(self.metrics["step_time_s"])

    def _title(self) -> str:
        m = self.metrics
        return (f"on {m.get('system', '?')}, {m.get('ranks', '?')} ranks "
                f"({m.get('ranks_simulated', '?')} simulated)"
                + (f", scenario {m['scenario']}" if m.get("scenario") else ""))

    def __repr__(self) -> str:
        return display.one_line("ReplayResult", self._title(), self.metrics) + (
            f" (frames: timeline {self.timeline.height:,} rows, breakdown "
            f"{self.breakdown.height:,}, waits {self.waits.height:,})")

    def _repr_html_(self) -> str:
        frame = self.breakdown.sort("end_s", descending=True).head(8) if (
            "end_s" in self.breakdown.columns) else self.breakdown.head(8)
        return display.html_table(
            f"Replay {self._title()}", display.figures(self.metrics),
            "<p>the ranks that finish last (.breakdown has every rank; .timeline every "
            "node)</p>" + frame._repr_html_())

    def to_perfetto(self, path: str | Path, *, extra_events: list[dict[str, Any]] | None = None
                    ) -> None:
        write_perfetto(self.timeline, path,
                       extra_events=[*self.fault_events, *(extra_events or [])])


def waits_frame(sim: Simulator) -> pl.DataFrame:
    """Who waits for whom: per collective, the last rank to arrive and how late it was."""
    rows = sim.coll_waits
    return pl.DataFrame(
        {"group": [r[0] for r in rows], "index": [r[1] for r in rows],
         "name": [r[2] for r in rows], "last_rank": [r[3] for r in rows],
         "wait_s": [r[4] / NS_PER_S for r in rows], "first_arrival_s": [r[5] / NS_PER_S
                                                                         for r in rows]},
        schema={"group": pl.String, "index": pl.Int64, "name": pl.String,
                "last_rank": pl.Int64, "wait_s": pl.Float64, "first_arrival_s": pl.Float64})


def timeline_frame(sim: Simulator, ts: TraceSet) -> pl.DataFrame:
    rec = sim.records
    ranks = np.frombuffer(rec.rank, dtype=np.int64) if len(rec.rank) else np.zeros(0, np.int64)
    pos = np.frombuffer(rec.pos, dtype=np.int64) if len(rec.pos) else np.zeros(0, np.int64)
    nodes = {r.rank: r.nodes for r in ts.ranks}
    ids, names, kinds, ops = [], [], [], []
    for r, p in zip(ranks.tolist(), pos.tolist(), strict=True):
        n = nodes[r][p]
        ids.append(n.id)
        names.append(n.name)
        kinds.append(NODE_TYPE_NAMES[n.type])
        ops.append(n.attrs.get("op_type") or COLL_TYPE_NAMES.get(n.attrs.get("comm_type", -1), ""))
    streams = [sim.stream_names[s] for s in rec.stream]
    return pl.DataFrame({
        "rank": ranks, "node_id": ids, "name": names, "kind": kinds, "op": ops,
        "stream": streams,
        "start_s": np.frombuffer(rec.start, dtype=np.int64) / NS_PER_S if len(rec.start) else [],
        "end_s": np.frombuffer(rec.end, dtype=np.int64) / NS_PER_S if len(rec.end) else [],
        "wait_start_s": (np.frombuffer(rec.wait_start, dtype=np.int64) / NS_PER_S
                         if len(rec.wait_start) else []),
    }, schema_overrides={"start_s": pl.Float64, "end_s": pl.Float64, "wait_start_s": pl.Float64})


def union_intervals(starts: np.ndarray, ends: np.ndarray) -> list[tuple[float, float]]:
    """Sorted, merged (start, end) intervals covering the given ones."""
    if len(starts) == 0:
        return []
    order = np.argsort(starts, kind="stable")
    out: list[tuple[float, float]] = []
    cs, ce = float(starts[order[0]]), float(ends[order[0]])
    for s, e in zip(starts[order].tolist(), ends[order].tolist(), strict=True):
        if s > ce:
            out.append((cs, ce))
            cs, ce = s, e
        elif e > ce:
            ce = e
    out.append((cs, ce))
    return out


def intervals_length(iv: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in iv)


def intervals_overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


# kinds that are not communication: compute, metadata, and copies to and from host memory
# (activation offloading: a compute wait on them is idle time, not exposed communication)
NOT_COMM = ("COMP_NODE", "METADATA_NODE", "MEM_STORE_NODE", "MEM_LOAD_NODE")


def breakdown_frame(timeline: pl.DataFrame, step_time_s: float,
                    interference_ns: dict[int, int] | None = None) -> pl.DataFrame:
    """Per rank: compute, exposed and overlapped communication, idle (bubbles included), and
    ``interference_s``: the part of its compute time that kernels lost to collectives in flight
    beside them (replay/sim.py; included in ``compute_s``)."""
    lost = interference_ns or {}
    rows = []
    for (rank,), g in timeline.group_by(["rank"], maintain_order=True):
        comp = g.filter((pl.col("stream") == "compute") & (pl.col("end_s") > pl.col("start_s")))
        comm = g.filter(~pl.col("kind").is_in(NOT_COMM))
        cu = union_intervals(comp["start_s"].to_numpy(), comp["end_s"].to_numpy())
        mu = union_intervals(comm["start_s"].to_numpy(), comm["end_s"].to_numpy())
        compute, comm_t = intervals_length(cu), intervals_length(mu)
        overlap = intervals_overlap(cu, mu)
        exposed = comm_t - overlap
        colls = comm.filter(pl.col("kind") == "COMM_COLL_NODE")
        wait = float((colls["start_s"] - colls["wait_start_s"]).sum())
        rows.append({"rank": rank, "compute_s": compute, "exposed_comm_s": exposed,
                     "overlapped_comm_s": overlap, "idle_s": max(0.0, step_time_s - compute
                                                                 - exposed),
                     "collective_wait_s": wait, "end_s": float(g["end_s"].max() or 0.0),  # type: ignore[arg-type]
                     "interference_s": lost.get(rank, 0) / NS_PER_S})
    return pl.DataFrame(rows, schema={"rank": pl.Int64, "compute_s": pl.Float64,
                                      "exposed_comm_s": pl.Float64,
                                      "overlapped_comm_s": pl.Float64, "idle_s": pl.Float64,
                                      "collective_wait_s": pl.Float64, "end_s": pl.Float64,
                                      "interference_s": pl.Float64}
                        ).sort("rank")


def expand_folded(breakdown: pl.DataFrame, ts: TraceSet) -> pl.DataFrame:
    """One breakdown row per rank of a folded set: each rank copies its stage representative's
    (exact: the set was proven symmetric before folding)."""
    if ts.manifest is None:
        return breakdown
    stage_of = {c[0]: c[1] for c in ts.manifest["coords"]}
    rep_of_stage = {stage_of[r.rank]: r.rank for r in ts.ranks}
    mapping = pl.DataFrame({"rank": list(stage_of), "rep": [rep_of_stage[s] for s in
                                                             stage_of.values()]})
    return (mapping.join(breakdown.rename({"rank": "rep"}), on="rep", how="left")
            .drop("rep").sort("rank"))


def stage_need_GiB(stage: dict[str, Any], gpu: GPUSpec) -> float:
    """What a rank of a manifest's stage needs on ``gpu``: its estimate, less the transposed
    FP8 weight copies a GPU whose FP8 GEMMs take any layout does not keep (the manifest's
    ``fp8_transpose_GiB``; a set written before it recorded them takes nothing off)."""
    cut = float(stage.get("fp8_transpose_GiB", 0.0)) if gpu.fp8_any_layout else 0.0
    return float(stage["memory"]["total_GiB"]) - cut


def step_metrics(ts: TraceSet, timeline: pl.DataFrame, end_ns: int, peak_flop_per_s: float,
                 gpu: GPUSpec) -> dict[str, Any]:
    step = end_ns / NS_PER_S
    out: dict[str, Any] = {"step_time_s": step, "ranks": ts.world_size,
                           "ranks_simulated": len(ts.ranks), "nodes": ts.file_nodes,
                           "nodes_simulated": ts.num_nodes}
    man = ts.manifest
    if man is not None and step > 0:
        m = ModelSpec.from_dict(man["model"])
        st = man["strategy"]
        gbs = int(st["global_batch_size"])
        out["tokens_per_step"] = gbs * m.seq_len
        # full recompute of the first recompute_num_layers of each chunk: their share
        recomputed = (Strategy.from_dict(st).recomputed_layers(m.num_layers)
                      if st.get("recompute_num_layers") else None)
        modules = tuple(str(st.get("recompute_modules", "core_attn")).split(","))
        out.update(step_rates(m, gbs, st["recompute"], step_s=step, gpus=ts.world_size,
                              peak_flop_per_s=peak_flop_per_s, recomputed_layers=recomputed,
                              modules=modules))
        out["comm_time_by_axis_s"] = _axis_times(ts, timeline)
        out["peak_memory_GiB"] = max(stage_need_GiB(s, gpu) for s in man["stages"])
    return out


def _axis_times(ts: TraceSet, timeline: pl.DataFrame) -> dict[str, float]:
    """Per group axis: the busiest rank's summed collective time (send/recv count as 'pp')."""
    comm = timeline.filter(~pl.col("kind").is_in(NOT_COMM))
    if comm.is_empty():
        return {}
    axis_of = {f"comm:{k}": v for k, v in ts.group_axis.items()}
    comm = comm.with_columns(
        pl.col("stream").replace_strict(axis_of, default="pp").alias("axis"),
        (pl.col("end_s") - pl.col("start_s")).alias("dur"))
    per = comm.group_by(["axis", "rank"]).agg(pl.col("dur").sum()).group_by("axis").agg(
        pl.col("dur").max())
    return {a: float(d) for a, d in per.sort("axis").iter_rows()}


def write_perfetto(timeline: pl.DataFrame, path: str | Path, *,
                   extra_events: list[dict[str, Any]] | None = None) -> None:
    """Chrome trace-event JSON (opens in ui.perfetto.dev): one process per rank, one thread per
    stream; times in µs as the format requires."""
    events: list[dict[str, Any]] = []
    tids: dict[str, int] = {}
    for rank in timeline["rank"].unique().sort().to_list():
        events.append({"ph": "M", "name": "process_name", "pid": rank,
                       "args": {"name": f"rank {rank}"}})
    for stream in timeline["stream"].unique().sort().to_list():
        tids[stream] = len(tids) + 1
    for rank in timeline["rank"].unique().sort().to_list():
        for stream, tid in tids.items():
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid,
                           "args": {"name": stream}})
    for row in timeline.iter_rows(named=True):
        events.append({"ph": "X", "name": row["name"], "cat": row["kind"], "pid": row["rank"],
                       "tid": tids[row["stream"]], "ts": row["start_s"] * 1e6,
                       "dur": (row["end_s"] - row["start_s"]) * 1e6,
                       "args": {"node_id": row["node_id"], "op": row["op"]}})
    events += extra_events or []
    Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ns"}))
