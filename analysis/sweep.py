"""Sweeps: enumerate every valid strategy of a search space, drop those that do not fit,
screen the rest with the fast path, replay the best K, rank.

Work runs in chunks on a local process pool, or on an existing Dask cluster when given its
scheduler address. Each finished chunk is written at once as a Parquet part file (written to a
temporary name, then renamed: a part is either whole or absent), so a killed sweep loses at most
the chunks in flight, and re-running the same study resumes: strategies already in a part are
skipped, never duplicated.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import itertools
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl

from analysis.compare import RESULT_COLUMNS, rank
from analysis.resume import claim, clear, writing
from analysis.runner import cluster_pool, local_pool, map_chunks, strategy_id, strategy_key
from analysis.stacks import get_stack, with_stack_strategy
from analysis.study import Study, mixed_stages
from tracegen import ConfigError, Strategy
from tracegen.fit import check_fits_model, with_shorter_end_chunks
from tracegen.strategy import ruled_out

DEFAULT_SPACE: dict[str, list[Any]] = {
    "tp": [1, 2, 4, 8], "pp": [1, 2, 4, 8, 16], "vpp": [1, 2], "micro_batch_size": [1, 2, 4],
    "recompute": ["none", "selective", "full"], "zero_stage": [0, 1],
    "sequence_parallel": [False, True],
}
OPTIONAL_DIMENSIONS = ("cp", "ep", "expert_tp", "schedule", "tp_comm_overlap",
                       "overlap_param_gather", "zero3_prefetch", "recompute_num_layers",
                       "recompute_modules", "moe_dispatcher", "moe_shared_expert_overlap",
                       "overlap_moe_ep_comm", "delay_wgrad_compute", "pipeline_layout",
                       "adam_moments_dtype",
                       "fp8_param_gather", "precision", "dist_opt_instances",
                       "outer_dp_sharding_strategy", "grad_reduce_per_microbatch",
                       "cross_entropy_fusion", "cp_comm_type", "cp_balance", "fp8_recipe")
Progress = Callable[[str, int, int], None]


def enumerate_space(study: Study) -> tuple[list[Strategy], int]:
    """(valid strategies, number of invalid combinations) of the study's search space."""
    return _enumerate(study, search_space(study))


def search_space(study: Study) -> dict[str, list[Any]]:
    """Every search dimension's values: the defaults, overridden by the study's [search]."""
    bad = [k for k, v in study.search.items()
           if not (isinstance(v, list) and v and all(isinstance(x, int | str) for x in v))]
    if bad:
        raise ConfigError(f"search dimension(s) {sorted(bad)} must each be a non-empty list of "
                          "values, e.g. tp = [1, 2, 4, 8] or recompute = [\"none\", \"full\"]",
                          what=f"study {study.name!r}")
    space = {**DEFAULT_SPACE, **{k: list(v) for k, v in study.search.items()}}
    unknown = set(space) - set(DEFAULT_SPACE) - set(OPTIONAL_DIMENSIONS)
    if unknown:
        raise ConfigError(f"unknown search dimension(s) {sorted(unknown)}; known: "
                          f"{', '.join(sorted(DEFAULT_SPACE))}, {', '.join(OPTIONAL_DIMENSIONS)}",
                          what=f"study {study.name!r}")
    problems = [p for k, v in space.items() if (p := _value_problem(k, v))]
    if problems:
        raise ConfigError(problems, what=f"study {study.name!r}")
    return space


# what each dimension's values must be: (kind, least value for whole numbers)
_WHOLE = {"tp": 1, "pp": 1, "vpp": 1, "micro_batch_size": 1, "cp": 1, "ep": 1,
          "zero_stage": 0, "expert_tp": 0, "recompute_num_layers": 0, "dist_opt_instances": 1}
_FLAGS = ("sequence_parallel", "tp_comm_overlap", "overlap_param_gather", "zero3_prefetch",
          "moe_shared_expert_overlap", "fp8_param_gather", "overlap_moe_ep_comm",
          "delay_wgrad_compute", "grad_reduce_per_microbatch")


def _value_problem(name: str, values: list[Any]) -> str | None:
    """What is wrong with one search dimension's values, if anything: whole numbers (not
    booleans) of at least 1 for degrees and sizes (0 for zero_stage and expert_tp), true or
    false for switches, strings for the rest (the strategy names a wrong one)."""
    if name in _WHOLE:
        least = _WHOLE[name]
        bad = [x for x in values if isinstance(x, bool) or not isinstance(x, int) or x < least]
        return (f"search {name} must hold whole numbers ≥ {least}, got {bad}") if bad else None
    if name in _FLAGS:
        bad = [x for x in values if not isinstance(x, bool)]
        return (f"search {name} must hold true or false, got {bad}") if bad else None
    bad = [x for x in values if not isinstance(x, str)]
    return (f"search {name} must hold strings, got {bad}") if bad else None


# schedules that need pp > 1
PIPELINE_ONLY = ("interleaved_1f1b", "zb_h1", "zb_v", "dualpipe_v", "interleaved_zb")
# A dimension that does not apply where another takes a value (sequence parallelism at tp 1,
# interleaving at pp 1, prefetching below ZeRO-3, …): (dimension, its off value, where it does
# not apply). A product of dimensions names such combinations by the dozen; as frameworks do
# (Megatron-LM turns sequence parallelism off at tp 1), they mean the strategy with the switch
# off, not an invalid one. Later rules see earlier rules' results.
_OFF_WHERE: tuple[tuple[str, Any, Callable[[dict[str, Any]], bool]], ...] = (
    ("sequence_parallel", False, lambda d: d["tp"] == 1),
    ("tp_comm_overlap", False, lambda d: not d["sequence_parallel"]),
    ("vpp", 1, lambda d: d["pp"] == 1),
    ("schedule", "1f1b", lambda d: d["pp"] == 1 and d["schedule"] in PIPELINE_ONLY),
    ("zero3_prefetch", False, lambda d: d["zero_stage"] != 3),
    ("cp_comm_type", "p2p", lambda d: d.get("cp", 1) == 1),
    ("cp_balance", "document", lambda d: d.get("cp", 1) == 1),
    ("recompute_num_layers", 0, lambda d: d["recompute"] != "full"),
    ("recompute_modules", "core_attn", lambda d: d["recompute"] != "selective"),
    ("dist_opt_instances", 1, lambda d: d["zero_stage"] == 0),
    ("outer_dp_sharding_strategy", "no_shard",
     lambda d: d["zero_stage"] != 3 or d.get("dist_opt_instances", 1) == 1),
    ("adam_moments_dtype", "fp32", lambda d: d["zero_stage"] == 0),
    ("fp8_param_gather", False,
     lambda d: d["zero_stage"] == 0 or d.get("precision", "bf16") != "fp8"),
    ("fp8_recipe", "delayed", lambda d: d.get("precision", "bf16") != "fp8"),
    ("moe_dispatcher", "alltoall", lambda d: d.get("ep", 1) == 1),
    ("moe_shared_expert_overlap", False,
     lambda d: d.get("ep", 1) == 1 or d.get("moe_dispatcher", "alltoall") != "alltoall"),
    ("overlap_moe_ep_comm", False, lambda d: d.get("ep", 1) == 1),
    ("delay_wgrad_compute", False, lambda d: not d.get("overlap_moe_ep_comm", False)),
    # (ZeRO-3 reduce-scatters every backward's gradients whatever it says)
    ("grad_reduce_per_microbatch", False, lambda d: d["zero_stage"] == 3),
)
def applicable(d: dict[str, Any]) -> dict[str, Any]:
    """One combination of the space with each dimension that does not apply at its off value
    (``_OFF_WHERE``); the combination itself where every dimension applies."""
    out = d
    for key, off, idle in _OFF_WHERE:
        if key in out and out[key] != off and idle(out):
            out = {**out, key: off}
    return out


# The dimensions ``ruled_out`` reads (with the GPU count): a layout it rules out rules out every
# value of the other dimensions, which are then counted, not built.
_LAYOUT = ("tp", "pp", "cp", "vpp", "micro_batch_size", "sequence_parallel", "tp_comm_overlap",
           "schedule")


def _enumerate(study: Study, space: dict[str, list[Any]], progress: Progress | None = None
               ) -> tuple[list[Strategy], int]:
    """(valid strategies, invalid combinations): layout by layout, each layout's other
    dimensions built only where ``ruled_out`` leaves the layout standing, and a combination
    that ``applicable`` folds onto one already built counted as that one was."""
    keys = sorted(space)
    layout_keys = [k for k in keys if k in _LAYOUT]
    other_keys = [k for k in keys if k not in _LAYOUT]
    others = [dict(zip(other_keys, v, strict=True))
              for v in itertools.product(*(space[k] for k in other_keys))]
    layouts = list(itertools.product(*(space[k] for k in layout_keys)))
    valid: list[Strategy] = []
    invalid = 0
    seen: set[tuple[Any, ...]] = set()
    for i, values in enumerate(layouts):
        if progress and i % 256 == 0:
            progress("enumerating", i, len(layouts))
        layout = applicable(dict(zip(layout_keys, values, strict=True)))
        if _ruled_out_early(study, layout):
            invalid += len(others)
            continue
        outcome: dict[tuple[Any, ...], bool] = {}  # folding stays inside a layout
        for rest in others:
            d = applicable({**layout, **rest})
            folded = tuple(d[k] for k in keys)
            if folded in outcome:
                invalid += not outcome[folded]
                continue
            s = _strategy(study, d)
            outcome[folded] = s is not None
            if s is None:
                invalid += 1
                continue
            key = strategy_key(s)
            if key not in seen:
                seen.add(key)
                valid.append(s)
    if progress:
        progress("enumerating", len(layouts), len(layouts))
    return valid, invalid


def invalid_reasons(study: Study, *, limit: int = 3, sample: int = 2000,
                    budget: int = 200_000) -> tuple[list[tuple[str, int]], int]:
    """Why the space's invalid combinations are invalid: (a reason as the strategy check words
    it, how many of the looked-at combinations it rules out) for the ``limit`` commonest, of
    the first ``sample`` invalid combinations among the first ``budget`` combinations (each is
    built: a vast space of mostly valid ones would otherwise take minutes), and how many were
    looked at. Reasons of one rule count as one (they differ in numbers, quoted values,
    examples or the advice after the rule; the first met is shown)."""
    space = search_space(study)
    keys = sorted(space)
    counts: collections.Counter[str] = collections.Counter()
    first: dict[str, str] = {}
    seen = 0
    combinations = itertools.islice(itertools.product(*(space[k] for k in keys)), budget)
    for values in combinations:
        try:
            _build(study, applicable(dict(zip(keys, values, strict=True))))
        except ConfigError as exc:
            reason = exc.problems[0]
            # the rule, not its numbers, its examples or the advice after it
            rule = re.sub(r"\s*\(e\.g\.[^)]*\)", "", reason.split("; ")[0])
            pattern = re.sub(r"'[^']*'", "'S'", re.sub(r"\d+", "N", rule))  # values too
            first.setdefault(pattern, reason)
            counts[pattern] += 1
            seen += 1
            if seen >= sample:
                break
    return [(first[p], n) for p, n in counts.most_common(limit)], seen


def _ruled_out_early(study: Study, d: dict[str, Any]) -> bool:
    """Whether the layout fields of ``d`` (``_LAYOUT``) already make it invalid, on plain
    values (most of a space: skipped before a Strategy and its message are built)."""
    tp, pp, cp = int(d["tp"]), int(d["pp"]), int(d.get("cp", 1))
    if study.gpus % (tp * pp * cp):
        return True
    vpp, dp = int(d["vpp"]), study.gpus // (tp * pp * cp)
    schedule = d.get("schedule") or ("interleaved_1f1b" if vpp > 1 else "1f1b")
    return ruled_out(tp=tp, pp=pp, dp=dp, vpp=vpp, micro_batch_size=int(d["micro_batch_size"]),
                     global_batch_size=study.global_batch_size,
                     sequence_parallel=bool(d["sequence_parallel"]),
                     tp_comm_overlap=bool(d.get("tp_comm_overlap", False)), schedule=schedule)


def _strategy(study: Study, d: dict[str, Any]) -> Strategy | None:
    if _ruled_out_early(study, d):
        return None
    try:
        return _build(study, d)
    except ConfigError:
        return None


def _build(study: Study, d: dict[str, Any]) -> Strategy:
    """The strategy of one combination of the space, or the ConfigError that says why none."""
    tp, pp, cp = int(d["tp"]), int(d["pp"]), int(d.get("cp", 1))
    if study.gpus % (tp * pp * cp):
        raise ConfigError(f"gpus {study.gpus} is not divisible by tp·pp·cp = {tp}·{pp}·{cp} = "
                          f"{tp * pp * cp}", what="strategy")
    vpp, dp = int(d["vpp"]), study.gpus // (tp * pp * cp)
    schedule = d.get("schedule") or ("interleaved_1f1b" if vpp > 1 else "1f1b")
    s = Strategy(tp=tp, pp=pp, cp=cp, ep=int(d.get("ep", 1)), vpp=vpp,
                 expert_tp=int(d.get("expert_tp", 0)),
                 zero3_prefetch=bool(d.get("zero3_prefetch", False)),
                 dp=dp,
                 sequence_parallel=bool(d["sequence_parallel"]),
                 tp_comm_overlap=bool(d.get("tp_comm_overlap", False)),
                 overlap_param_gather=bool(d.get("overlap_param_gather", False)),
                 micro_batch_size=int(d["micro_batch_size"]),
                 global_batch_size=study.global_batch_size,
                 schedule=schedule,  # type: ignore[arg-type]
                 recompute=d["recompute"], zero_stage=int(d["zero_stage"]),
                 recompute_num_layers=int(d.get("recompute_num_layers", 0)),
                 recompute_modules=str(d.get("recompute_modules", "core_attn")),
                 moe_dispatcher=d.get("moe_dispatcher", "alltoall"),
                 moe_shared_expert_overlap=bool(d.get("moe_shared_expert_overlap", False)),
                 overlap_moe_ep_comm=bool(d.get("overlap_moe_ep_comm", False)),
                 delay_wgrad_compute=bool(d.get("delay_wgrad_compute", False)),
                 pipeline_layout=str(d.get("pipeline_layout", "")),
                 adam_moments_dtype=d.get("adam_moments_dtype", "fp32"),
                 fp8_param_gather=bool(d.get("fp8_param_gather", False)),
                 precision=d.get("precision", "bf16"),
                 dist_opt_instances=int(d.get("dist_opt_instances", 1)),
                 outer_dp_sharding_strategy=d.get("outer_dp_sharding_strategy",
                                                  "no_shard"),
                 grad_reduce_per_microbatch=bool(d.get("grad_reduce_per_microbatch", False)),
                 cross_entropy_fusion=d.get("cross_entropy_fusion", "none"),
                 fp8_recipe=d.get("fp8_recipe", "delayed"),
                 cp_comm_type=d.get("cp_comm_type", "p2p"),
                 cp_balance=d.get("cp_balance", "document"))
    if study.stack:  # (its values where the space leaves a field and the layout can use it)
        s = with_stack_strategy(get_stack(study.stack), s, study.model, given=set(d))
    _check_tensor_cores(study, s)
    # a layer count pp·vpp does not divide: shorter end chunks, as frameworks run it
    s = with_shorter_end_chunks(s, study.model.num_layers)
    check_fits_model(s, study.model)
    if study.mixed is not None:  # its GPUs fill whole stages, or the layout is not one
        mixed_stages(s, study.mixed.gpus, study.mixed.system.name)
    return s


def _check_tensor_cores(study: Study, s: Strategy) -> None:
    """A narrow precision (or FP8 recipe) the study's GPUs cannot run is no candidate: a
    search space names it for every system it may run on, and costed at a rate the GPU falls
    back to it would rank a run no framework starts (one strategy asked for by name is costed
    with a note instead). BF16 on Volta stays: it is costed as the FP16 it would run."""
    if s.precision == "bf16":
        return
    for system in (study.system, *((study.mixed.system,) if study.mixed else ())):
        lacks = system.gpu.lacks(s.precision, s.fp8_recipe)
        if lacks:
            what = f"{s.precision} ({s.fp8_recipe})" if s.precision == "fp8" else s.precision
            raise ConfigError(f"precision {what} on {system.name}: it has {lacks}; drop it "
                              "from the space or search on a GPU that has them",
                              what="strategy")


SCHEMA = {"id": pl.String, **RESULT_COLUMNS}


class PartStore:
    """Parquet part files of one phase; the union is the results so far."""

    def __init__(self, directory: Path, phase: str) -> None:
        self.dir = directory / "parts" / phase
        self.dir.mkdir(parents=True, exist_ok=True)
        # numbered on from the highest part, not the count: where a part was lost, a count
        # would name the next part as one that exists (and, in the same process, replace it)
        numbers = [int(p.name.split("-")[1]) for p in self.dir.glob("part-*.parquet")
                   if p.name.split("-")[1].isdigit()]
        self._n = max(numbers, default=0)

    def done_ids(self) -> set[str]:
        frame = self.read()
        return set(frame["id"].to_list()) if frame.height else set()

    def read(self) -> pl.DataFrame:
        parts = sorted(self.dir.glob("part-*.parquet"))
        if not parts:
            return pl.DataFrame(schema=SCHEMA)
        frame = pl.concat([pl.read_parquet(p) for p in parts], how="diagonal_relaxed")
        # parts an earlier trainsim wrote lack the columns added since: null there, not an error
        return frame.with_columns(pl.lit(None, dtype=t).alias(k) for k, t in SCHEMA.items()
                                  if k not in frame.columns).select(list(SCHEMA))

    def write(self, rows: list[dict[str, Any]]) -> None:
        frame = pl.DataFrame(rows, schema=SCHEMA)
        self._n += 1
        final = self.dir / f"part-{self._n:06d}-{os.getpid()}.parquet"
        tmp = final.with_suffix(".tmp")
        frame.write_parquet(tmp)
        os.replace(tmp, final)


def _run(study: Study, todo: list[Strategy], store: PartStore, *, replay_it: bool,
         chunk: int, pool: cf.Executor | None, phase: str, progress: Progress | None) -> None:
    """``todo`` in chunks on ``pool`` (in this process without one), each part written as it
    comes."""
    chunks = [todo[i:i + chunk] for i in range(0, len(todo), chunk)]
    done = 0
    if progress:
        progress(phase, 0, len(todo))
    for rows in map_chunks(study, chunks, replay_it, None, 1, pool=pool):
        store.write(rows)
        done += len(rows)
        if progress:
            progress(phase, done, len(todo))


SCREEN_CHUNKS_PER_WORKER = 8  # enough to balance slow (interleaved) and fast chunks
SCREEN_CHUNK_MIN, SCREEN_CHUNK_MAX = 64, 4096


def screening_chunk(n: int, workers: int) -> int:
    """Strategies per screening task: about an eighth of each worker's (or cluster thread's)
    share, 64–4,096 (a part file per task: a few dozen, not thousands; a killed sweep loses at
    most a second or so of screening per worker)."""
    per = -(-n // (workers * SCREEN_CHUNKS_PER_WORKER))
    return max(SCREEN_CHUNK_MIN, min(SCREEN_CHUNK_MAX, per))


def sweep(study: Study, out_dir: str | Path, *, top_k: int = 10, scheduler: str | None = None,
          workers: int | None = None, chunk: int | None = None,
          progress: Progress | None = None, fresh: bool = False
          ) -> tuple[pl.DataFrame, dict[str, int]]:
    """Screen the whole space, replay the best ``top_k``; returns (ranked frame, counts).
    ``fresh``: delete what earlier runs kept in ``out_dir`` first (else they are resumed).
    ``chunk``: strategies per screening task (default ``screening_chunk`` of the local workers
    or the cluster's threads). The local pool, or the one client of the cluster, starts before
    the space is enumerated and serves both phases."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ConfigError(f"top_k is how many of the best to replay, 0 or more; got {top_k!r} "
                          "(a negative count had replayed all but that many)",
                          what=f"sweep of {study.name!r}")
    if chunk is not None and chunk < 1:
        raise ConfigError(f"chunk must be at least 1 strategy per task, not {chunk}",
                          what=f"sweep of {study.name!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with writing(out / "parts"):  # one run at a time writes a folder's parts
        if fresh:
            clear(out / "parts")
        claim(out / "parts", study)  # a re-run resumes its own study's parts, never another's
        return _sweep(study, out, top_k, scheduler, workers or min(2, os.cpu_count() or 1),
                      chunk, progress)


def _sweep(study: Study, out: Path, top_k: int, scheduler: str | None, workers: int,
           chunk: int | None, progress: Progress | None
           ) -> tuple[pl.DataFrame, dict[str, int]]:
    space = search_space(study)
    with contextlib.ExitStack() as stack:
        pool: cf.Executor | None = None
        if scheduler is not None:
            pool, workers = stack.enter_context(cluster_pool(scheduler))
        elif workers > 1:
            pool = stack.enter_context(local_pool(workers))
        valid, invalid = _enumerate(study, space, progress)
        by_id = {strategy_id(s): s for s in valid}
        screen = PartStore(out, "screen")
        done = screen.done_ids()
        todo = [s for i, s in by_id.items() if i not in done]
        size = chunk or screening_chunk(len(todo), workers)
        _run(study, todo, screen, replay_it=False, chunk=size, pool=pool, phase="screening",
             progress=progress)
        screened = rank(screen.read().unique("id", keep="first"), study.rank_by)
        fitted = recompute_to_fit(study, screened, by_id, top_k)
        if fitted:
            _run(study, [s for s in fitted if strategy_id(s) not in done], screen,
                 replay_it=False, chunk=size, pool=pool, phase="recomputing to fit",
                 progress=progress)
            screened = rank(screen.read().unique("id", keep="first"), study.rank_by)
        fits = screened.filter(pl.col("fits").fill_null(False))
        best_ids = fits.head(top_k)["id"].to_list()
        verify = PartStore(out, "replay")
        replayed_ids = verify.done_ids()
        todo = [by_id[i] for i in best_ids if i not in replayed_ids]
        _run(study, todo, verify, replay_it=True, chunk=1, pool=pool, phase="replaying",
             progress=progress)
    replayed = verify.read().unique("id", keep="first")
    merged = pl.concat([replayed, screened.drop("rank").filter(
        ~pl.col("id").is_in(replayed["id"].to_list()))], how="vertical_relaxed")
    final = rank(merged, study.rank_by, verified_first=True)
    _write_atomic(final, out)
    combinations = math.prod(len(v) for v in space.values())
    counts = {"enumerated": combinations, "invalid": invalid,
              # a switch where it does not apply, taken as off (``applicable``): another's twin
              "same_as_another": combinations - invalid - len(valid), "valid": len(valid),
              "recomputed_to_fit": len(fitted),
              "do_not_fit": int(screened.filter(~pl.col("fits").fill_null(False)).height),
              "screened": screened.height,
              "replayed": replayed.filter(pl.col("status") == "replayed").height}
    return final, counts


def recompute_to_fit(study: Study, screened: pl.DataFrame, by_id: dict[str, Strategy],
                     limit: int) -> list[Strategy]:
    """The least recompute that fits (``glance.fit_by_recompute``) of the fastest screened
    strategies that do not fit and step faster than the fastest that does — at most ``limit``
    of them (a recomputing variant is slower than its parent, so no slower parent can win):
    the layouts the space's coarse recompute values rule out although a few recomputed layers
    per chunk let them run. Each new strategy joins ``by_id``; the list holds them all, the
    ones screened before (a resumed sweep) too. On a ``[mixed]`` cluster each candidate is
    placed there to be costed (``mixed.study_cost``), as its row will be."""
    from analysis.glance import fit_by_recompute
    from analysis.mixed import study_cost

    cost = study_cost(study)

    fits = pl.col("fits").fill_null(False)
    # of the enumerated strategies only, so that a resumed sweep finds the same ones
    screened = screened.filter(pl.col("id").is_in(list(by_id)))
    best = screened.filter(fits)["step_time_s"].min()
    slow = screened.filter(~fits & pl.col("step_time_s").is_not_null())
    if best is not None:
        slow = slow.filter(pl.col("step_time_s") < best)
    out: list[Strategy] = []
    for sid in slow.sort("step_time_s").head(limit)["id"].to_list():
        parent = by_id.get(sid)
        try:
            got = None if parent is None else fit_by_recompute(study.model, parent,
                                                               study.system, cost=cost)
        except ConfigError:  # (a placement its recomputation refuses: the parent stays out)
            got = None
        if got is not None and strategy_id(got[0]) not in by_id:
            by_id[strategy_id(got[0])] = got[0]
            out.append(got[0])
    return out


def _write_atomic(frame: pl.DataFrame, out: Path) -> None:
    for name, writer in (("results.parquet", frame.write_parquet),
                         ("results.csv", frame.write_csv)):
        tmp = out / f".{name}.tmp"
        writer(tmp)
        os.replace(tmp, out / name)
