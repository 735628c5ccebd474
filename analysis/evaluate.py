"""Evaluate a study's strategies: step time (fast path or replay), memory, and — with a failure
scenario — goodput and expected time-to-train per recovery policy."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import polars as pl

from analysis import resilience as R
from analysis.checkpoint_share import CheckpointShare, checkpoint_share
from analysis.fastpath import FastEstimate, estimate_stages
from analysis.study import Study
from replay.hardware import SystemSpec
from tracegen import ConfigError, Strategy
from tracegen.units import GiB


def tokens_per_step(study: Study, s: Strategy) -> int:
    return s.global_batch_size * study.model.seq_len


def job_shape(study: Study, s: Strategy, fast: FastEstimate,
              where: Mapping[int, SystemSpec] | None = None,
              share: CheckpointShare | None = None) -> R.JobShape:
    """The job as the recovery costs see it. ``where``: stages on another system's GPUs (a
    ``[mixed]`` cluster): a checkpoint waits for its slowest writer, so the NIC and the host
    link are the slower of the systems'; the shrunk replica is costed on the same stages.
    ``share``: ``checkpoint_share``'s, where the caller has it."""
    if share is None:
        share = checkpoint_share(study.model, s, study.system, where, staging=_staging(study))
    nic = min(x.scaleout.nic_Gbps_per_gpu / 8 * 1e9 * x.scaleout.nic_efficiency
              for x in (study.system, *(where or {}).values()))
    host = min(x.node.host_link_GBps * 1e9 for x in (study.system, *(where or {}).values()))
    return R.JobShape(gpus=s.world_size, params=study.model.num_params(),
                      model_parallel=s.tp * s.pp * s.cp, dp=s.dp, nic_bytes_per_s=nic,
                      step_time_s=fast.step_time_s,
                      shrunk_throughput=_shrunk_throughput(study, s, fast, where or {}),
                      host_bytes_per_s=host, staged_bytes=share.staged_bytes,
                      load_bytes=share.load_bytes,
                      hosts=-(-s.world_size // study.system.node.host_gpus))


def _staging(study: Study) -> str:
    """The study's ``[checkpoint] staging``, as its recovery tables are read."""
    return R.recovery_inputs(study.checkpoint, study.restart, study.policies).staging


def _shrunk_throughput(study: Study, s: Strategy, fast: FastEstimate,
                       where: Mapping[int, SystemSpec]) -> float:
    """Elastic shrink: re-plan on one data-parallel replica fewer (same tp/pp, the global batch
    rounded to what dp − 1 replicas can take; on a ``[mixed]`` cluster the same stages on the
    other GPUs) and compare tokens/s, both from trainsim."""
    if s.dp < 2:
        return 0.0
    dp = s.dp - 1
    unit = s.micro_batch_size * dp
    gbs = max(unit, s.global_batch_size // unit * unit)
    try:
        shrunk = dataclasses.replace(s, dp=dp, global_batch_size=gbs, ep=math.gcd(dp, s.ep))
        est = estimate_stages(study.model, shrunk, study.system, where)
    except ConfigError:
        return 0.0
    full_tps = tokens_per_step(study, s) / fast.step_time_s
    return (gbs * study.model.seq_len / est.step_time_s) / full_tps


def resilience_frame(study: Study, s: Strategy, fast: FastEstimate | None = None
                     ) -> pl.DataFrame:
    """Per recovery policy for one strategy (needs a study with [failures])."""
    from analysis.compare import strategy_label  # (it imports this module)

    _require_failures(study)  # before estimating: the missing table is the error to report
    where = None  # (a caller's ``fast`` is one system's)
    if fast is None:  # (on a [mixed] cluster: the strategy as placed, its mixed step)
        from analysis.mixed import placed_fast

        s, fast, placed = placed_fast(study, s)
        where = placed.where if placed else None
    work_s = _work_s(study, s, fast)
    return pl.DataFrame(resilience_rows(study, s, fast, where, spread=True)).with_columns(
        pl.lit(strategy_label(s)).alias("strategy"),  # the name results carry
        pl.lit(work_s).alias("failure_free_s"),
        pl.lit(fast.step_time_s).alias("step_time_s"),
        pl.lit(fast.peak_memory_GiB).alias("peak_memory_GiB"), pl.lit(fast.fits).alias("fits"))


def _work_s(study: Study, s: Strategy, fast: FastEstimate) -> float:
    """Failure-free training time of the study's token budget (one step without one)."""
    steps = study.tokens / tokens_per_step(study, s) if study.tokens else 1.0
    return steps * fast.step_time_s


def resilience_rows(study: Study, s: Strategy, fast: FastEstimate,
                    where: Mapping[int, SystemSpec] | None = None, *,
                    spread: bool = False, by_s: float | None = None) -> list[dict[str, Any]]:
    """``resilience_frame``'s per-policy rows as dicts, without the strategy columns.
    ``where``: on a ``[mixed]`` cluster, the stages on the other system (``Placement.where``;
    ``fast`` is then the placed step, ``mixed.placed_fast``'s). ``spread``: the wall clock's
    percentiles too, and with ``by_s`` the chance of ending by then
    (``resilience.policy_rows``)."""
    _require_failures(study)
    failure = R.failure_model(study.failures, gpus_per_host=study.system.node.host_gpus)
    if study.mixed is not None and study.mixed.failure_rate_factor != 1.0:
        failure = dataclasses.replace(failure, rate_per_gpu_hour=failure.rate_per_gpu_hour
                                      * study.mixed.job_rate_factor(s.world_size))
    # in memory, a host keeps its own ranks' snapshots and a peer's (Gemini, Wang et al. SOSP
    # 2023, keeps checkpoint replicas in other machines' CPU memory: one peer's is the fewest
    # that survive a machine's loss)
    given = R.recovery_inputs(study.checkpoint, study.restart, study.policies)
    mode = given.mode
    share = checkpoint_share(study.model, s, study.system, where,
                             copies=2 if mode == "in_memory" else 1, staging=given.staging)
    job = job_shape(study, s, fast, where, share)
    costs = R.recovery_costs(job, study.checkpoint, study.restart, study.policies)
    keep, slow = 1.0, dict[str, float | None]()
    for table in ("fail_slow", "slow_links"):  # independent episodes: their keeps multiply
        if getattr(study, table):
            failure, kept, cols = _episodes(study, s, failure, table, where)
            keep *= kept
            slow |= cols
    if study.site_links:
        kept, cols = _site_episodes(study, s, where)
        keep *= kept
        slow |= cols
    if study.model.document_mask is not None:
        kept, cols = _data_wait(study, s, fast)
        keep *= kept
        slow |= cols
    if study.gpu_spread:
        kept, cols = _spread_wait(study, s, fast)
        keep *= kept
        slow |= cols
    rows = R.policy_rows(failure=failure, gpus=s.world_size, work_s=_work_s(study, s, fast),
                         costs=costs, step_s=fast.step_time_s, progress=keep, spread=spread,
                         by_s=by_s)
    snap = _snapshot_columns(mode != "sync", share, given.staging)
    return [{**r, **slow, **snap} for r in rows]


def _snapshot_columns(snapshot: bool, share: CheckpointShare, staging: str
                      ) -> dict[str, float | str | None]:
    """What the checkpoint's copies take: a GPU's (all it holds or the share it writes:
    ``staging``), and a host's with what offloading keeps there, against the host's memory
    (None: a synchronous save, ``snapshot`` False, keeps no snapshot, or the system gives no
    host memory)."""
    return {"staged_GiB": share.staged_bytes / GiB, "checkpoint_staging": staging,
            "snapshot_host_GiB": share.host_peak_GiB if snapshot else None,
            "host_memory_GiB": share.host_capacity_GiB or None}


def _episodes(study: Study, s: Strategy, failure: R.FailureModel, table: str,
              where: Mapping[int, SystemSpec] | None
              ) -> tuple[R.FailureModel, float, dict[str, float | None]]:
    """The failure model with the evictions added, the progress kept between failures, and
    the columns that say why, of the study's ``[fail_slow]`` (slow GPUs,
    ``analysis.fail_slow``) or ``[slow_links]`` (slow NICs, ``analysis.slow_links``)."""
    from analysis import fail_slow, slow_links

    weights = _stage_weights(study, s, table, where)
    if table == "fail_slow":
        fs = fail_slow.fail_slow_from(study.fail_slow)
        mean, worst = fail_slow.step_factors(study.model, s, study.system, fs.slowdown, where,
                                             weights)
        what = {"fail_slow_slowdown": fs.slowdown}
    else:
        fs = slow_links.slow_links_from(study.slow_links)
        mean, worst = slow_links.step_factors(study.model, s, study.system, 1 / fs.slowdown,
                                              where, weights)
        what = {"slow_links_bandwidth_factor": 1 / fs.slowdown}
    rate = 1.0 if study.mixed is None else study.mixed.job_rate_factor(s.world_size, table)
    if rate != 1.0:  # the other system's GPUs at their own rate: more (or fewer) episodes,
        fs = dataclasses.replace(fs, rate_per_gpu_hour=fs.rate_per_gpu_hour * rate)
    keep = fail_slow.progress(fs, s.world_size, mean)
    if fs.detect_s is not None:
        failure = dataclasses.replace(
            failure, rate_per_gpu_hour=failure.rate_per_gpu_hour + fs.evicted_rate_per_gpu_hour())
    return failure, keep, {**what, f"{table}_detect_s": fs.detect_s,
                           f"{table}_step_factor": mean,
                           f"{table}_worst_step_factor": worst,
                           f"{table}_active_share": fs.active_share(s.world_size),
                           f"{table}_loss": 1 - keep,
                           f"{table}_evicted_share": fs.evicted_share()}


def _site_episodes(study: Study, s: Strategy, where: Mapping[int, SystemSpec] | None
                   ) -> tuple[float, dict[str, float | None]]:
    """The progress kept through the study's ``[site_links]`` episodes (degraded links between
    sites, ``analysis.site_links``) and the columns that say why. The step factor is the fast
    path's own ratio (its healthy step estimated again: a caller's step may be replay's, as
    compare's is); ``where``: a ``[mixed]`` cluster's stages on the other system."""
    from analysis import site_links

    ep = site_links.site_links_from(study.site_links)
    factor = site_links.step_factor(study.model, s, study.system, ep, where)
    keep = ep.progress(factor)
    return keep, {"site_links_bandwidth_factor": ep.bandwidth_factor,
                  "site_links_latency_us": ep.latency_us, "site_links_step_factor": factor,
                  "site_links_active_share": ep.active_share(), "site_links_loss": 1 - keep}


def _data_wait(study: Study, s: Strategy, fast: FastEstimate
               ) -> tuple[float, dict[str, float | None]]:
    """Under a document mask, the progress kept while every step waits for the replica whose
    sequences attended most (``analysis.data_stragglers``: an expected wait each step, so the
    share step / (step + wait)), and the columns that say why. On a ``[mixed]`` cluster the
    attention is the base system's."""
    from analysis.data_stragglers import data_straggler

    d = data_straggler(study.model, s, study.system)
    assert d is not None  # (a document mask)
    keep = fast.step_time_s / (fast.step_time_s + d.wait_s)
    return keep, {"data_wait_s": d.wait_s, "data_variation": d.variation,
                  "data_replicas": float(d.replicas), "data_straggler_loss": 1 - keep}


def _spread_wait(study: Study, s: Strategy, fast: FastEstimate
                 ) -> tuple[float, dict[str, float | None]]:
    """Under ``[gpu_spread]``, the progress kept while every step waits for its slowest GPUs
    (``analysis.gpu_spread``: an expected wait each step, so the share step / (step + wait)),
    and the columns that say why (on a ``[mixed]`` cluster, the base system's chunks)."""
    from analysis.gpu_spread import spread_wait

    w = spread_wait(study.model, s, study.system, float(study.gpu_spread["sd"]))
    keep = fast.step_time_s / (fast.step_time_s + w.wait_s)
    return keep, {"gpu_spread_sd": w.sd, "gpu_spread_wait_s": w.wait_s,
                  "gpu_spread_loss": 1 - keep}


def _stage_weights(study: Study, s: Strategy, table: str,
                   where: Mapping[int, SystemSpec] | None) -> list[float]:
    """How likely an episode of ``table`` is on each pipeline stage: alike but where a
    ``[mixed]`` cluster's other GPUs (the stages in ``where``) have them at their own rate
    (every stage has as many GPUs). At pp 1 one stage, whatever its GPUs."""
    if s.pp == 1 or study.mixed is None or not where:
        return [1.0] * s.pp
    other = study.mixed.rate_factor(table)
    return [other if j in where else 1.0 for j in range(s.pp)]


def snapshot_line(row: dict[str, Any]) -> str | None:
    """Where an async or in-memory checkpoint's copies do not fit in a host's memory (beside
    what offloading keeps there), the sentence that says so and what to change; else None."""
    peak, cap = row.get("snapshot_host_GiB"), row.get("host_memory_GiB")
    if peak is None or not cap or peak <= cap:
        return None
    # (a fully parallel save's shares are already spread over the data-parallel group)
    fixes = ("spread the model over more GPUs" if row.get("checkpoint_staging") == "fully_parallel"
             else "shard the optimizer state (zero_stage), copy only the share each GPU writes "
                  "([checkpoint] staging = \"fully_parallel\", Megatron-Core's save) or spread "
                  "the model over more GPUs")
    return (f"checkpoint snapshots overfill a host: each GPU copies {row['staged_GiB']:,.1f} GiB "
            f"of the checkpoint to host memory, {peak:,.0f} GiB a host with what offloading "
            f"keeps there, against its {cap:,.0f} GiB — {fixes}, or checkpoint with "
            "mode = \"sync\"")


def spare_line(row: dict[str, Any]) -> str | None:
    """For the hot-spares row of a study that gives them a pool (``[policies.hot_spares]
    spares, repair_s``): how often a failure finds none, and the pool that leaves under 1%
    without one (None for any other row)."""
    if row.get("spare_miss") is None:
        return None
    hosts, factor = row.get("spare_job_hosts") or 0, row.get("spare_idle_failure_factor") or 0.0
    n = round(row["spares"])
    job = row["spare_repair_s"] / row["job_mttf_s"]
    in_repair = R.pool_in_repair(job, n, hosts, factor)  # (idle spares' failures with them)
    need = R.spares_for(job, 0.01, hosts, factor)
    mean = f"{in_repair:.1f}" if in_repair >= 1 else f"{in_repair:.2g}"  # (0.04, not 0.0)
    return (f"hot_spares: {n} spare host{'' if n == 1 else 's'}, a failed one back after "
            f"{row['spare_repair_s'] / 3600:g} h ({mean} in repair on average): "
            f"{_share(row['spare_miss'])} of failures find none and restart as "
            f"global_restart does; {need} spares leave fewer than 1% without one")


def days_range(row: dict[str, Any]) -> str:
    """The wall clock's 10th to 90th percentile in days (``analysis.wall_spread``), to the
    digit where they differ; "–" where the policy's form gives none."""
    lo, hi = row.get("wall_clock_p10_s"), row.get("wall_clock_p90_s")
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return "–"
    if lo == hi:  # (nine runs in ten meet no failure: the failure-free time)
        return f"{lo / 86400:.1f}"
    digits = 1
    while digits < 4 and f"{lo / 86400:.{digits}f}" == f"{hi / 86400:.{digits}f}" and lo != hi:
        digits += 1
    return f"{lo / 86400:.{digits}f}–{hi / 86400:.{digits}f}"


def spread_line(row: dict[str, Any]) -> str:
    """What the P10–P90 days hold: the failure process's randomness at the study's rate, and
    where the rate was counted from failures (``observed_failures``), its uncertainty."""
    count = row.get("failure_rate_count") or 0.0
    what = ("the failure process's randomness and the rate's own uncertainty (counted from "
            f"{count:,.4g} failures: ±{1 / math.sqrt(count):.1%} at one standard deviation)"
            if count else "the failure process's randomness at the study's rate, taken as "
            "exact ([failures] observed_failures = N gives the count it was measured from)")
    return f"P10–P90: the days the run ends by in one run in ten and in nine in ten, from {what}"


def _share(x: float) -> str:
    """A share as a percentage, "under 0.1%" where one decimal would show a non-zero one as 0."""
    return "under 0.1%" if 0 < x < 0.0005 else f"{x:.1%}"


def episode_lines(row: dict[str, Any]) -> list[str]:
    """What a resilience row's slow-GPU and slow-NIC episodes cost, a sentence each (the CLI
    prints them under a strategy's table)."""
    return [text for _, text in episode_sentences(row)]


def episode_sentences(row: dict[str, Any]) -> list[tuple[str, str]]:
    """``episode_lines`` with each sentence's table, as an id (``fail-slow``, ``slow-links``,
    ``site-links``, ``data-stragglers``, ``gpu-spread``: the report's element ids)."""
    from analysis import data_stragglers, fail_slow, gpu_spread, site_links, slow_links

    return [(name, m.describe(row)) for name, m, col in (
        ("fail-slow", fail_slow, "fail_slow_loss"), ("slow-links", slow_links, "slow_links_loss"),
        ("site-links", site_links, "site_links_loss"),
        ("data-stragglers", data_stragglers, "data_straggler_loss"),
        ("gpu-spread", gpu_spread, "gpu_spread_loss")) if row.get(col) is not None]


def _require_failures(study: Study) -> None:
    if not study.has_failures:
        raise ConfigError("the study has no [failures] table: add preset = NAME or "
                          "rate_per_gpu_hour", what=f"study {study.name!r}")


def strategy_dict(frame: pl.DataFrame) -> dict[str, Any]:
    """What ``resilience_frame`` says of its strategy itself: the failure-free step and
    training time and whether it fits in memory (a run that cannot start has no goodput)."""
    row = frame.row(0, named=True)
    return {k: row[k] for k in ("step_time_s", "failure_free_s", "peak_memory_GiB", "fits")}


def summary_dict(frame: pl.DataFrame) -> dict[str, Any]:
    """Per policy, what ``--summary`` writes (with a study's [fail_slow], [slow_links] or
    [site_links], what they cost too)."""
    keys = ("goodput", "expected_wall_clock_s", "wall_clock_p10_s", "wall_clock_p50_s",
            "wall_clock_p90_s", "checkpoint_interval_s", "expected_failures",
            "expected_gpu_hours", "job_mttf_s", "checkpoint_s", "restart_s", "persist_s",
            "staged_GiB", "snapshot_host_GiB", "host_memory_GiB",
            *(c for c in frame.columns
              if c.startswith(("fail_slow_", "slow_links_", "site_links_"))))
    return {row["policy"]: {k: row[k] for k in keys} for row in frame.iter_rows(named=True)}
