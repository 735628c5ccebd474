"""Where the fast path's step goes, without a replay: the busiest pipeline stage's micro-batches
split by what runs (``analysis.op_table``'s rows of that stage, summed by kind and times the
micro-batches), the rest of the pipeline's span (bubble, sends, waits for other stages), and
what follows it (the gradient reduction and optimizer after the last backward). The parts add
up to the step exactly — a conservation the tests hold — so a planner reads at a glance
whether a strategy is bound by its GEMMs, its attention, its exposed collectives (by axis) or
its pipeline.

What it is not: replay's per-rank breakdown, which times every rank's streams and their
overlaps; here a collective counts where it is exposed in series on the busiest stage (its
``overlap`` rows: what overlapped collectives add to the kernels beside them), and the
pipeline's part is what the stage's own work leaves of the span (prefetched ZeRO-3, timed by
chunk, has its own part: what its gathers and scatter tails add to the stage). Under merged
passes (combined 1F1B), which run one micro-batch's collectives beside another's compute,
that part can be negative: the time the merging hides."""

from __future__ import annotations

from typing import NamedTuple

import polars as pl

from analysis.fastpath import FastEstimate, estimate, resolve_specs
from analysis.op_table import op_table
from replay.hardware import SystemSpec
from tracegen.model import ModelSpec
from tracegen.strategy import Strategy

COMPUTE = {"gemm": "GEMMs", "attention": "attention"}
OTHER_COMPUTE = "memory-bound and other ops"  # norms, element-wise, loss, embedding, optimizer
BESIDE = "overlapped collectives' excess (kernels slowed, transfers outlasting them)"
SIDE_BY_SIDE = "ZeRO-3's dense and expert streams side by side (less than in series)"
ZERO3 = "ZeRO-3 gathers and reduce-scatters beyond the compute"
OTHER_STAGE = "the stage's other time"  # (none expected: the op table's rows are its time)
PIPELINE = "pipeline bubble, sends and waits"
MERGED = "hidden by merged passes"
OVERLAPPING = "work of one pass beside another's (in series beyond the span)"
AFTER = "after the pipeline (gradient reduction, optimizer)"


class StepSplit(NamedTuple):
    """``parts``: (label, seconds) in a fixed order, adding up to ``step_s``; ``stage``: the
    busiest pipeline stage, whose work the first parts are; ``microbatches``: how many of its
    micro-batches they count."""

    step_s: float
    stage: int
    microbatches: int
    parts: tuple[tuple[str, float], ...]

    def as_dict(self) -> dict[str, object]:
        return {"step_s": self.step_s, "stage": self.stage, "microbatches": self.microbatches,
                "parts_s": dict(self.parts)}

    def line(self) -> str:
        """One line for the terminal: the parts of at least 0.5% of the step."""
        shown = [f"{label} {sec:,.3f} s ({sec / self.step_s:.0%})" for label, sec in self.parts
                 if abs(sec) >= 0.005 * self.step_s]
        return (f"where the step goes (stage {self.stage}, the busiest, over its "
                f"{self.microbatches} micro-batches): " + "; ".join(shown))


def _label(kind: str, axis: str, us: float) -> str:
    if kind == "overlap":  # (less than the rows in series: ZeRO-3's two streams side by side)
        return BESIDE if us >= 0 else SIDE_BY_SIDE
    if axis:  # a collective in series: exposed on its axis
        return f"exposed {axis} communication"
    return COMPUTE.get(kind, OTHER_COMPUTE)


def stage_parts(table: pl.DataFrame) -> dict[str, float]:
    """One micro-batch of a stage's op table in seconds by part (the rows in series, × their
    counts; overlapped collectives run beside and are left out)."""
    serial = table.filter(~pl.col("overlapped"))
    out: dict[str, float] = {}
    for kind, axis, us, count in serial.select("kind", "axis", "time_us", "count").iter_rows():
        label = _label(kind, axis or "", us)
        out[label] = out.get(label, 0.0) + us * count * 1e-6
    return out


def step_split(model: ModelSpec | str, strategy: Strategy, system: SystemSpec | str,
               est: FastEstimate | None = None) -> StepSplit:
    """The parts of ``est``'s step (the fast path's, computed if not given), busiest stage
    first (module docstring)."""
    model, system = resolve_specs(model, system)
    est = est or estimate(model, strategy, system)
    busy = [f + b for f, b in zip(est.stage_fwd_s, est.stage_bwd_s, strict=True)]
    stage = max(range(len(busy)), key=busy.__getitem__)
    m = strategy.num_microbatches
    per_mb = stage_parts(op_table(model, strategy, system, stage=stage))
    work = {label: sec * m for label, sec in per_mb.items()}
    ordered = [label for label in (*COMPUTE.values(), OTHER_COMPUTE) if label in work]
    ordered += sorted(k for k in work if k.startswith("exposed "))
    ordered += [k for k in (BESIDE, SIDE_BY_SIDE) if k in work]
    parts = [(label, work[label]) for label in ordered]
    # prefetched ZeRO-3 times whole chunks, its gathers and scatter tails beside the passes
    # (``op_table``): what the stage's time holds beyond its rows is theirs
    streams = m * busy[stage] - sum(work.values())
    if abs(streams) > 1e-9 * est.pipeline_s:
        parts.append((ZERO3 if strategy.zero3_prefetch else OTHER_STAGE, streams))
    rest = est.pipeline_s - sum(sec for _, sec in parts)
    rest = 0.0 if abs(rest) < 1e-12 * est.pipeline_s else rest  # (float sums of equal times)
    if rest < 0 and parts[-1][0] == ZERO3:  # one pass's streams run on under the next (GPipe)
        parts[-1], rest = (ZERO3, parts[-1][1] + rest), 0.0
    label = PIPELINE if rest >= 0 else MERGED if strategy.overlap_moe_ep_comm else OVERLAPPING
    parts.append((label, rest))
    parts.append((AFTER, est.step_time_s - est.pipeline_s))
    return StepSplit(est.step_time_s, stage, m, tuple(parts))
