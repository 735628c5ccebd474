"""Compare strategies: each one generated, replayed and (with a failure scenario) costed over the
whole run. One row per strategy, as a polars frame."""

from __future__ import annotations

import io
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl

from analysis import replay_size
from analysis.evaluate import resilience_rows
from analysis.glance import strategy_rates
from analysis.mixed import Placement, placed_fast
from analysis.strategy_row import FIELD_COLUMNS, cli_flags, row_fields
from analysis.study import Study, rank_key
from replay import ReplayResult, replay
from replay.hardware import system_toml
from replay.results import intervals_length, intervals_overlap, union_intervals
from tracegen import Strategy, TrainsimError, generate

RESULT_COLUMNS: dict[str, Any] = {
    "strategy": pl.String, "tp": pl.Int64, "pp": pl.Int64, "dp": pl.Int64, "cp": pl.Int64,
    "ep": pl.Int64, "vpp": pl.Int64, "micro_batch_size": pl.Int64, "schedule": pl.String,
    "recompute": pl.String, "zero_stage": pl.Int64, "sequence_parallel": pl.Boolean,
    "tp_comm_overlap": pl.Boolean, "overlap_param_gather": pl.Boolean,
    "expert_tp": pl.Int64, "zero3_prefetch": pl.Boolean, "status": pl.String,
    "step_time_s": pl.Float64, "fast_step_time_s": pl.Float64,
    "tokens_per_s": pl.Float64, "mfu": pl.Float64, "hfu": pl.Float64,
    "peak_memory_GiB": pl.Float64, "fits": pl.Boolean, "compute_s": pl.Float64,
    "exposed_tp_s": pl.Float64, "exposed_pp_s": pl.Float64, "exposed_dp_s": pl.Float64,
    "exposed_other_comm_s": pl.Float64, "bubble_s": pl.Float64, "optimizer_s": pl.Float64,
    "interference_s": pl.Float64,
    "goodput": pl.Float64, "time_to_train_s": pl.Float64,
    "time_to_train_p90_s": pl.Float64,  # (replayed rows: what nine runs in ten end by)
    "best_policy": pl.String,
    "best_policy_goodput": pl.Float64, "best_policy_time_to_train_s": pl.Float64,
}
# then the strategy's other fields (a row rebuilds it: ``strategy_row.strategy_from_row``) and
# the flags that rebuild it on the command line
RESULT_COLUMNS |= {k: v for k, v in FIELD_COLUMNS.items() if k not in RESULT_COLUMNS}
RESULT_COLUMNS["stage_systems"] = pl.String  # a study's [mixed] stages: 0-1=dgx-a100-80gb
RESULT_COLUMNS["flags"] = pl.String


def strategy_label(s: Strategy) -> str:
    """The name a result row goes by: the layout and every switch that is on."""
    return (s.label() + ("" if s.schedule == "1f1b" else f"-{s.schedule}")
            + f"-rc{s.recompute[0]}{s.recompute_num_layers or ''}"
            + (f".{s.recompute_modules.replace(',', '+')}"
               if s.recompute_modules != "core_attn" else "")
            + f"-z{s.zero_stage}" + ("-pmb" if s.grad_reduce_per_microbatch else "")
            + ("" if s.precision == "bf16" else f"-{s.precision}")
            + ("-sp" if s.sequence_parallel else "")
            + ("-tpo" if s.tp_comm_overlap else "")
            + ("-opg" if s.overlap_param_gather and s.zero_stage in (1, 2) else "")
            + ("-z3pf" if s.zero3_prefetch else "")
            + ("-seo" if s.moe_shared_expert_overlap else "")
            + (f"-adam{s.adam_moments_dtype}" if s.adam_moments_dtype != "fp32" else "")
            + ("-fp8pg" if s.fp8_param_gather else "")
            + (f"-layout[{s.pipeline_layout}]" if s.pipeline_layout else "")
            + ("-cpag" if s.cp > 1 and s.cp_comm_type == "all_gather" else "")
            + ("-cpseq" if s.cp > 1 and s.cp_balance == "sequence" else "")
            + _split_suffix(s))  # (the loss's fusion and FP8's recipe: in ``Strategy.label``)


def strategy_fields(s: Strategy) -> dict[str, Any]:
    """A result row's strategy columns: its name, every field, and the flags that rebuild it."""
    return {"strategy": strategy_label(s), **row_fields(s), "flags": cli_flags(s)}


def _split_suffix(s: Strategy) -> str:
    """An uneven pipeline's split, as the CLI's flags set it: the layers of the first and last
    chunk (``-first7-last7``), the embedding and loss counted as layers (``-embl``, ``-lossl``).
    A sweep sets these itself where pp · vpp does not divide the layers
    (``with_shorter_end_chunks``), so without them the label would name a strategy that
    ``trainsim estimate`` rejects as it reads."""
    return ((f"-first{s.first_stage_layers}" if s.first_stage_layers else "")
            + (f"-last{s.last_stage_layers}" if s.last_stage_layers else "")
            + ("-embl" if s.account_for_embedding_in_pipeline_split else "")
            + ("-lossl" if s.account_for_loss_in_pipeline_split else ""))


# A result row's replayed timeline (its first ranks) as Parquet bytes, under this key until
# the caller writes it (``compare``): the row comes back from wherever it ran — a local
# process or a Dask worker on another machine, whose disk the caller cannot see.
TIMELINE_KEY = "_timeline_parquet"


def evaluate_strategy(study: Study, s: Strategy, *, replay_it: bool = True,
                      keep_timeline: bool = False) -> dict[str, Any]:
    """One result row: fast path always; replay when asked and the strategy fits. With
    ``keep_timeline`` a replayed row carries its timeline's first ranks (``TIMELINE_KEY``)."""
    row: dict[str, Any] = dict.fromkeys(RESULT_COLUMNS)
    row.update(strategy_fields(s))
    try:
        s, fast, placed = placed_fast(study, s)
    except TrainsimError as exc:
        row["status"] = f"invalid: {exc}"
        return row
    step = fast.step_time_s
    if placed:  # (the row's strategy as placed: its layers split by the stages' speeds)
        row.update(strategy_fields(s), stage_systems=placed.stage_systems)
        row["flags"] += " " + placed.flag
    row.update(fast_step_time_s=step, peak_memory_GiB=fast.peak_memory_GiB, fits=fast.fits,
               step_time_s=step, status="screened")
    if not fast.fits:
        row["status"] = ("does not fit: offloading overfills a host's memory" if fast.host_short
                         else "does not fit")
        return row
    nodes = replay_size.oversized(study.model, s) if replay_it else None
    if replay_it and not nodes:
        res = _replay(study, s, placed)
        row.update(_from_replay(res), status="replayed")
        if keep_timeline:  # the first ranks, for the report's pipeline timeline
            first = res.timeline["rank"].unique().sort().head(4).to_list()
            buf = io.BytesIO()
            res.timeline.filter(pl.col("rank").is_in(first)).write_parquet(buf)
            row[TIMELINE_KEY] = buf.getvalue()
    else:
        row.update({"tokens_per_s": placed.estimate.tokens_per_s, "mfu": placed.estimate.mfu,
                    "hfu": placed.estimate.hfu} if placed else
                   strategy_rates(study.model, s, study.system, step))
        if nodes:
            row["status"] = "screened: not replayed, " + replay_size.why(nodes)
    if study.has_failures:  # (the end date's spread for the rows chosen for replay, replayed
        # or too large to be: a few, ms each — a scale study's best may be either)
        row.update(failure_columns(study, s, row["step_time_s"], fast, placed,
                                   spread=replay_it))
    elif study.tokens > 0:  # nothing fails: the healthy run (goodput is not modelled: empty)
        row["time_to_train_s"] = study.tokens / row["tokens_per_s"]
    return row


def _replay(study: Study, s: Strategy, placed: Placement | None = None) -> ReplayResult:
    """``s`` generated and replayed; with a placement, its stages on the other system by a
    ``[[gpu]]`` scenario on their representatives (the j-th simulated rank is stage j's)."""
    with tempfile.TemporaryDirectory(prefix="trainsim-compare-") as tmp:
        generate(study.model, s, tmp, mode="representative", gpus=study.gpus)
        if placed is None or study.mixed is None:
            return replay(tmp, study.system)
        reps = sorted(int(p.name.split(".")[1]) for p in Path(tmp).glob("*.et"))
        other = Path(tmp) / "other-system.toml"  # (a Dask worker elsewhere has no study files)
        other.write_text(system_toml(study.mixed.system), encoding="utf-8")
        scenario = Path(tmp) / "mixed.toml"
        scenario.write_text(f"[[gpu]]\nranks = {[reps[j] for j in placed.stages]}\n"
                            f"system = {json.dumps(str(other))}\n")
        return replay(tmp, study.system, scenario=scenario)


def _from_replay(res: ReplayResult) -> dict[str, Any]:
    m = res.metrics
    out = {"step_time_s": m["step_time_s"], "tokens_per_s": m["tokens_per_s"], "mfu": m["mfu"],
           "hfu": m["hfu"]}
    out.update(exposed_breakdown(res))
    return out


def exposed_breakdown(res: ReplayResult) -> dict[str, float]:
    """Where the step goes on the rank that finishes last: compute, the compute time lost to
    collectives in flight beside it (interference), communication per axis not hidden under
    compute, optimizer, and the rest (pipeline bubble and waiting). They add up to the step."""
    tl = res.timeline
    by_end = res.breakdown.sort("end_s", descending=True)
    last = by_end["rank"][0]
    r = tl.filter(pl.col("rank") == last)
    comp = r.filter(pl.col("stream") == "compute")
    step = res.step_time_s
    compute_iv = _union(comp)
    axis_of = {f"comm:{k}": v for k, v in res.metrics.get("group_axes", {}).items()}
    comm = r.filter(pl.col("kind") != "COMP_NODE").with_columns(
        pl.col("stream").replace_strict(axis_of, default="pp").alias("axis"))
    exposed: dict[str, float] = {}
    for axis in ("tp", "pp", "dp"):
        iv = _union(comm.filter(pl.col("axis") == axis))
        exposed[axis] = intervals_length(iv) - intervals_overlap(iv, compute_iv)
    other = _union(comm.filter(~pl.col("axis").is_in(["tp", "pp", "dp"])))
    opt = float(comp.filter(pl.col("op") == "optimizer").select(
        (pl.col("end_s") - pl.col("start_s")).sum()).item() or 0.0)
    compute = intervals_length(compute_iv) - opt
    other_exposed = intervals_length(other) - intervals_overlap(other, compute_iv)
    bubble = max(0.0, step - compute - opt - sum(exposed.values()) - other_exposed)
    lost = min(compute, float(by_end["interference_s"][0]))
    return {"compute_s": compute - lost, "interference_s": lost, "exposed_tp_s": exposed["tp"],
            "exposed_pp_s": exposed["pp"], "exposed_dp_s": exposed["dp"],
            "exposed_other_comm_s": other_exposed, "optimizer_s": opt, "bubble_s": bubble}


def _union(frame: pl.DataFrame) -> list[tuple[float, float]]:
    return union_intervals(frame["start_s"].to_numpy(), frame["end_s"].to_numpy())


def failure_columns(study: Study, s: Strategy, step_time_s: float, fast: Any,
                    placed: Placement | None, *, spread: bool = False,
                    by_s: float | None = None) -> dict[str, Any]:
    """A result row's columns under the study's failures at ``step_time_s``: the global
    restart's goodput, time to train and (``spread``) its P90, the best policy's; with
    ``by_s`` (and ``spread``), the global restart's chance of ending by then too
    (``deadline_probability``)."""
    rows = resilience_rows(study, s, fast._replace(step_time_s=step_time_s),
                           placed.where if placed else None, spread=spread, by_s=by_s)
    g = next(r for r in rows if r["policy"] == "global_restart")  # always among the policies
    if not study.tokens:  # no budget: goodput only (the wall clocks would be one step's)
        best = max(rows, key=lambda r: r["goodput"])  # the first of equals, as a sort
        return {"goodput": g["goodput"], "time_to_train_s": None, "time_to_train_p90_s": None,
                "best_policy": best["policy"], "best_policy_goodput": best["goodput"],
                "best_policy_time_to_train_s": None}
    best = min(rows, key=lambda r: r["expected_wall_clock_s"])  # the first of equals, as a sort
    out = {"goodput": g["goodput"], "time_to_train_s": g["expected_wall_clock_s"],
           "time_to_train_p90_s": g["wall_clock_p90_s"],
           "best_policy": best["policy"], "best_policy_goodput": best["goodput"],
           "best_policy_time_to_train_s": best["expected_wall_clock_s"]}
    if by_s is not None:
        out["deadline_probability"] = g.get("wall_clock_by_probability")
    return out


def compare(study: Study, *, progress: Callable[[int, int], None] | None = None,
            timeline_dir: str | None = None, workers: int = 1, scheduler: str | None = None,
            out_dir: str | Path | None = None, fresh: bool = False) -> pl.DataFrame:
    """Every listed strategy, replayed (in parallel with ``workers`` > 1 or on a Dask
    ``scheduler``); ranked by the study's criterion. With ``timeline_dir`` (made if missing),
    each strategy's timeline of its first ranks is saved there as ``<id>.parquet``, written
    by this process from the bytes its result brings back — a Dask worker on another machine
    needs no disk shared with the caller. With ``out_dir``, each strategy's row is kept there
    as it finishes (``parts/compare``, as a sweep keeps its chunks), and a re-run of the same
    study into it replays only the strategies it lacks (another study's folder is refused:
    ``analysis.resume``); ``fresh`` deletes what earlier runs kept there first."""
    if out_dir is None:
        return _compare(study, progress, timeline_dir, workers, scheduler, None)
    from analysis.resume import claim, clear, writing

    parts = Path(out_dir) / "parts"
    with writing(parts):  # one run at a time writes a folder's parts
        if fresh:
            clear(parts)
        claim(parts, study)
        return _compare(study, progress, timeline_dir, workers, scheduler, Path(out_dir))


def _compare(study: Study, progress: Callable[[int, int], None] | None,
             timeline_dir: str | None, workers: int, scheduler: str | None,
             out_dir: Path | None) -> pl.DataFrame:
    from analysis.runner import map_chunks, strategy_id
    from analysis.sweep import PartStore  # (it imports this module)

    store = kept = None
    if out_dir is not None:
        store = PartStore(out_dir, "compare")
        listed = [strategy_id(s) for s in study.strategies]  # a strategy struck off stays out
        kept = store.read().unique("id", keep="first").filter(pl.col("id").is_in(listed))
    have = set(kept["id"].to_list()) if kept is not None else set()
    rows: list[dict[str, Any]] = kept.to_dicts() if kept is not None else []
    chunks = [[s] for s in study.strategies if strategy_id(s) not in have]
    out = Path(timeline_dir) if timeline_dir else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    for done in map_chunks(study, chunks, True, scheduler, workers, out is not None):
        for row in done:  # timelines are written here, where the caller will read them
            data = row.pop(TIMELINE_KEY, None)
            if out is not None and data is not None:
                (out / f"{row['id']}.parquet").write_bytes(data)
        if store is not None:
            store.write(done)
        rows += done
        if progress:
            progress(len(rows), len(study.strategies))
    frame = pl.DataFrame(rows, schema={"id": pl.String, **RESULT_COLUMNS})
    return rank(frame, study.rank_by)


def rank(frame: pl.DataFrame, rank_by: str, *, verified_first: bool = False) -> pl.DataFrame:
    """Strategies that fit first, ordered by step time, expected time-to-train or the P90 of
    its end date (``study.rank_key``; a row without a P90, screened and not replayed, by its
    expected time). With ``verified_first`` (sweeps), the replayed strategies come before the
    screened ones. Equal times in the order of their labels: the same ranking however the
    workers returned them."""
    key = rank_key(rank_by)
    value = pl.col(key)
    if key == "time_to_train_p90_s":  # (a frame of an earlier version may lack the column)
        value = (value.fill_null(pl.col("time_to_train_s")) if key in frame.columns
                 else pl.col("time_to_train_s"))
    ordered = frame.with_columns(
        pl.col("fits").fill_null(False).alias("_fits"),
        (pl.col("status") == "replayed").fill_null(False).alias("_verified")
        if verified_first else pl.lit(True).alias("_verified"), value.alias("_key")).sort(
        ["_fits", "_verified", "_key", "strategy"], descending=[True, True, False, False],
        nulls_last=True).drop("_fits", "_verified", "_key")
    return ordered.with_row_index("rank", offset=1).with_columns(pl.col("rank").cast(pl.Int64))


__all__ = ["RESULT_COLUMNS", "compare", "evaluate_strategy", "rank", "strategy_fields",
           "strategy_label"]
