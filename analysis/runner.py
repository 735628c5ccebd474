"""Run evaluation chunks on a local process pool or a Dask cluster."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import hashlib
import multiprocessing
import operator
from collections.abc import Iterable, Iterator
from typing import Any

from analysis.compare import evaluate_strategy
from analysis.study import Study
from tracegen import Strategy, TrainsimError
from tracegen.gcpause import gc_paused

# The fields strategy ids were first made of, in declaration order (all are scalars, so this is
# ``dataclasses.astuple`` without its recursive deep copy, a fifth of a screening chunk's time).
# Fields added later join the key as (name, value) only when set away from their default, so a
# strategy that does not use them keeps its id and finished sweeps resume.
_ID_FIELDS = ("tp", "pp", "dp", "cp", "ep", "vpp", "sequence_parallel", "micro_batch_size",
              "global_batch_size", "schedule", "recompute", "zero_stage", "precision",
              "overlap_grad_reduce", "tp_comm_overlap", "overlap_param_gather",
              "first_stage_layers", "last_stage_layers", "dp_bucket_params",
              "zero3_gather_bucket_params")
_STRATEGY_FIELDS = operator.attrgetter(*_ID_FIELDS)
_LATER_FIELDS = tuple((f.name, f.default) for f in dataclasses.fields(Strategy)
                      if f.name not in _ID_FIELDS)


def strategy_key(s: Strategy) -> tuple[Any, ...]:
    """Every field: two strategies are the same only if nothing tells them apart."""
    key: tuple[Any, ...] = _STRATEGY_FIELDS(s)
    for name, default in _LATER_FIELDS:
        value = getattr(s, name)
        if value != default:
            key += ((name, value),)
    return key


def strategy_id(s: Strategy) -> str:
    return hashlib.sha1(repr(strategy_key(s)).encode()).hexdigest()[:16]


@gc_paused  # a chunk fills the fast path's memos: long-lived objects the collector rescans
def evaluate_chunk(study: Study, strategies: list[Strategy], replay_it: bool,
                   keep_timeline: bool = False) -> list[dict[str, Any]]:
    """Result rows of a chunk of strategies, each with its id (and, with ``keep_timeline``,
    its replayed timeline: ``compare.TIMELINE_KEY``)."""
    rows = []
    for s in strategies:
        row = evaluate_strategy(study, s, replay_it=replay_it, keep_timeline=keep_timeline)
        row["id"] = strategy_id(s)
        rows.append(row)
    return rows


SCHEDULER_TIMEOUT_S = 15  # an unreachable scheduler is reported after this long
WORKER_WAIT_S = 60.0  # and one that has no worker after this long (workers may start later)


def _client(scheduler: str) -> Any:
    """A Dask client of ``scheduler``, or a TrainsimError that says how to get one (distributed
    raises OSError / ValueError from inside its comm layer)."""
    from distributed import Client

    try:
        client = Client(scheduler, timeout=SCHEDULER_TIMEOUT_S)  # type: ignore[no-untyped-call]
    except (OSError, ValueError, TypeError) as exc:
        raise TrainsimError(f"cannot reach the Dask scheduler at {scheduler!r} "
                            f"({str(exc).splitlines()[0]}): start one (`dask scheduler` and "
                            "`dask worker ADDRESS`) or leave out --scheduler to run on local "
                            "processes") from None
    try:  # a scheduler without workers takes tasks and runs none: the run had waited for ever
        client.wait_for_workers(1, timeout=WORKER_WAIT_S)
    except TimeoutError:
        client.close()  # type: ignore[no-untyped-call]
        raise TrainsimError(f"the Dask scheduler at {scheduler!r} has no workers (none joined "
                            f"in {WORKER_WAIT_S:g} s): start one with `dask worker "
                            f"{scheduler}`, or leave out --scheduler to run on local "
                            "processes") from None
    return client


def _ready() -> None:
    """A no-op task: a worker that ran it has imported everything a chunk needs."""


def local_pool(workers: int) -> cf.ProcessPoolExecutor:
    """A pool of ``workers`` local processes, started at once (each imports the fast path and
    replay while the caller goes on, e.g. enumerating a sweep's space) and reusable for every
    phase of a sweep. "spawn", not fork: polars' thread pool does not survive a fork (the child
    can deadlock)."""
    pool = cf.ProcessPoolExecutor(max_workers=workers,
                                  mp_context=multiprocessing.get_context("spawn"))
    for _ in range(workers):
        pool.submit(_ready)
    return pool


@contextlib.contextmanager
def cluster_pool(scheduler: str) -> Iterator[tuple[cf.Executor, int]]:
    """(an executor on the Dask cluster at ``scheduler``, its worker threads): one client for
    every phase of a sweep, and the thread count sizes its tasks."""
    with _client(scheduler) as client:
        threads = sum(client.nthreads().values()) or 1
        executor = client.get_executor(pure=False)
        try:
            yield executor, threads
        finally:
            executor.shutdown(wait=False)


def map_chunks(study: Study, chunks: list[list[Strategy]], replay_it: bool,
               scheduler: str | None, workers: int, keep_timeline: bool = False,
               pool: cf.Executor | None = None) -> Iterable[list[dict[str, Any]]]:
    """Results of each chunk as it finishes (order not kept), on ``pool`` when given (a local
    pool or a cluster's executor; the caller shuts it down), else on a Dask cluster, in this
    process or on a pool of its own."""
    if not chunks:
        return
    if pool is not None:
        yield from _on_pool(pool, study, chunks, replay_it, keep_timeline)
        return
    if scheduler is not None:
        from distributed import as_completed

        with _client(scheduler) as client:
            futures = [client.submit(evaluate_chunk, study, c, replay_it, keep_timeline,
                                     pure=False) for c in chunks]
            for fut in as_completed(futures):  # type: ignore[no-untyped-call]
                yield fut.result()
        return
    if workers <= 1 or len(chunks) == 1:
        for c in chunks:
            yield evaluate_chunk(study, c, replay_it, keep_timeline)
        return
    with local_pool(workers) as own:
        yield from _on_pool(own, study, chunks, replay_it, keep_timeline)


def _on_pool(pool: cf.Executor, study: Study, chunks: list[list[Strategy]], replay_it: bool,
             keep_timeline: bool) -> Iterable[list[dict[str, Any]]]:
    futs = [pool.submit(evaluate_chunk, study, c, replay_it, keep_timeline) for c in chunks]
    with worker_deaths_said("--workers 1 / workers=1", kept="; the chunks that finished are "
                            "kept, and the same run again resumes from them"):
        for f in cf.as_completed(futs):
            yield f.result()


@contextlib.contextmanager
def worker_deaths_said(fewer: str, kept: str = "") -> Iterator[None]:
    """A local pool whose worker process died (``BrokenProcessPool``: killed for memory, or a
    caller's script the spawned workers cannot import) raised as what to do about it, where
    Python says only that a process "terminated abruptly"; ``fewer``: how to ask for fewer
    workers where this was called; ``kept``: what of the work is kept, said last."""
    try:
        yield
    except cf.process.BrokenProcessPool as exc:
        raise TrainsimError(
            f"a worker process stopped before returning its work ({exc}). Likeliest causes: "
            f"the machine ran out of memory (use fewer workers: {fewer}), or, called from "
            "Python, a script the workers cannot import: one read from stdin or a pipe, or "
            "one without an `if __name__ == \"__main__\":` guard (run it from a file with "
            f"the guard, or with one worker){kept}") from None
