"""Sweeps: enumeration counts, a real Dask LocalCluster agreeing with the local pool, and a sweep
killed midway that resumes with exactly one row per strategy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.study import load_study
from analysis.sweep import PartStore, enumerate_space, screening_chunk, sweep
from tests.studies import write_study
from tracegen import ConfigError, TrainsimError

COMPARED = ["id", "strategy", "status", "step_time_s", "fast_step_time_s", "peak_memory_GiB",
            "fits"]


@pytest.fixture
def study_path(tmp_path: Path) -> Path:
    return write_study(tmp_path / "study", strategies=False, failures=False, search=True)


def test_enumeration_counts(study_path: Path) -> None:
    """Every combination of the space is counted once: invalid, a strategy of its own, or the
    same strategy as another (a switch where it does not apply, taken as off)."""
    study = load_study(study_path)
    valid, invalid = enumerate_space(study)
    combos = 3 * 3 * 2 * 2 * 2 * 2 * 2
    assert len(valid) + invalid < combos  # SP at tp 1 and vpp 2 at pp 1 are others' twins
    assert len({(s.tp, s.pp, s.vpp, s.micro_batch_size, s.recompute, s.zero_stage,
                 s.sequence_parallel) for s in valid}) == len(valid)
    assert all(s.world_size == 8 for s in valid)
    assert any(s.tp == 1 for s in valid) and any(s.pp == 1 for s in valid)


def _every_combination(study: Any, space: dict[str, list[Any]]) -> tuple[set[str], int]:
    """The enumeration by its definition: every combination of the product, folded, built."""
    import itertools

    from analysis.runner import strategy_id
    from analysis.sweep import _strategy, applicable

    keys, ids, invalid = sorted(space), set(), 0
    for values in itertools.product(*(space[k] for k in keys)):
        s = _strategy(study, applicable(dict(zip(keys, values, strict=True))))
        if s is None:
            invalid += 1
        else:
            ids.add(strategy_id(s))
    return ids, invalid


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_enumeration_by_layout_is_the_whole_product(data: st.DataObject) -> None:
    """Layouts ``ruled_out`` rejects are counted without building their other dimensions, and
    a folded twin is counted as its first: the same strategies and invalid count as building
    every combination of the product; the progress reaches every layout."""
    from analysis.runner import strategy_id
    from analysis.study import study_from_dict
    from analysis.sweep import _enumerate, search_space

    space = {k: data.draw(st.lists(st.sampled_from(v), min_size=1, max_size=3, unique=True))
             for k, v in {**SWITCHES, "tp": [1, 2, 4, 8], "pp": [1, 2, 4], "cp": [1, 2],
                          "micro_batch_size": [1, 2]}.items()}
    study = study_from_dict({"model": "llama3-8b", "system": "dgx-h100",
                             "gpus": data.draw(st.sampled_from([16, 32, 48])),
                             "global_batch_size": data.draw(st.sampled_from([32, 48, 64])),
                             "search": space})
    seen: list[tuple[str, int, int]] = []
    valid, invalid = _enumerate(study, search_space(study),
                                lambda phase, i, n: seen.append((phase, i, n)))
    ids = [strategy_id(s) for s in valid]
    assert len(set(ids)) == len(ids)
    assert (set(ids), invalid) == _every_combination(study, search_space(study))
    assert seen[-1][0] == "enumerating" and seen[-1][1] == seen[-1][2] > 0


SWITCHES = {"tp": [1, 2], "pp": [1, 2], "vpp": [1, 2], "sequence_parallel": [False, True],
            "tp_comm_overlap": [False, True], "schedule": ["1f1b", "interleaved_1f1b", "zb_h1",
                                                           "zb_v", "gpipe"],
            "zero_stage": [0, 1, 3], "zero3_prefetch": [False, True],
            "recompute": ["none", "selective", "full"], "recompute_num_layers": [0, 2],
            "recompute_modules": ["core_attn", "mlp"], "dist_opt_instances": [1, 2],
            "outer_dp_sharding_strategy": ["no_shard", "optim"],
            "adam_moments_dtype": ["fp32", "bf16"], "precision": ["bf16", "fp8"],
            "fp8_param_gather": [False, True], "micro_batch_size": [1], "ep": [1, 2],
            "moe_dispatcher": ["alltoall", "deepep"], "moe_shared_expert_overlap": [False, True],
            "overlap_moe_ep_comm": [False, True]}


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({k: st.sampled_from(v) for k, v in SWITCHES.items()}),
       st.sampled_from(["llama3-8b", "qwen3-30b-a3b"]))
def test_a_switch_is_turned_off_only_where_it_makes_the_combination_invalid(
        combo: dict[str, Any], model: str) -> None:
    """``applicable`` changes a combination only where the strategy check refuses it as given,
    and what it gives is refused for no reason of those switches (Megatron's own rules: SP
    needs tp > 1, interleaving pp > 1, prefetching ZeRO-3, …)."""
    from analysis.study import study_from_dict
    from analysis.sweep import _build, applicable

    study = study_from_dict({"model": model, "system": "dgx-h100", "gpus": 16,
                             "global_batch_size": 64})
    folded = applicable(combo)
    if folded != combo:
        with pytest.raises(ConfigError):
            _build(study, combo)
    if study.model.is_moe:  # (the MoE model's own limits, e.g. no instances with it, aside)
        return
    try:
        _build(study, folded)
    except ConfigError as exc:  # still invalid: for a reason no switch rule covers
        reason = exc.problems[0]
        assert not reason.startswith(("sequence_parallel needs tp > 1",
                                      "zero3_prefetch needs", "recompute_num_layers",
                                      "recompute_modules", "adam_moments_dtype",
                                      "fp8_param_gather", "moe_dispatcher 'deepep'",
                                      "overlap_moe_ep_comm overlaps expert-parallel")), reason
        assert "shards the optimizer over part of the data-parallel group" not in reason


def test_dask_cluster_matches_local_pool(study_path: Path, tmp_path: Path) -> None:
    from distributed import LocalCluster

    study = load_study(study_path)
    local, counts = sweep(study, tmp_path / "local", top_k=2, workers=2, chunk=16)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster:
        remote, counts2 = sweep(study, tmp_path / "dask", top_k=2, chunk=16,
                                scheduler=cluster.scheduler_address)
        # without --chunk, tasks are sized to the cluster's two worker threads
        sweep(study, tmp_path / "sized", top_k=0, scheduler=cluster.scheduler_address)
    parts = list((tmp_path / "sized" / "parts" / "screen").glob("part-*.parquet"))
    assert len(parts) == -(-counts2["valid"] // screening_chunk(counts2["valid"], 2))
    assert counts == counts2
    a = local.select(COMPARED).sort("id")
    b = remote.select(COMPARED).sort("id")
    assert a.equals(b)
    assert counts["replayed"] == 2 and counts["valid"] == local.height


def test_killed_sweep_resumes_without_duplicates(study_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "analysis.cli", "sweep", str(study_path), "-o", str(out),
           "--top-k", "1", "--workers", "1", "--chunk", "4"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    parts = out / "parts" / "screen"
    deadline = time.time() + 120
    while time.time() < deadline and len(list(parts.glob("part-*.parquet"))) < 3:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    written = len(list(parts.glob("part-*.parquet")))
    assert written >= 3
    assert not (out / "results.parquet").exists()  # it died before finishing
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    study = load_study(study_path)
    valid, _ = enumerate_space(study)
    final = pl.read_parquet(out / "results.parquet")
    assert final.height == len(valid)
    assert final["id"].n_unique() == final.height
    screened = PartStore(out, "screen").read()
    assert screened["id"].n_unique() == screened.height == len(valid)  # no duplicated work


def test_replayed_strategies_rank_first(study_path: Path, tmp_path: Path) -> None:
    study = load_study(study_path)
    final, counts = sweep(study, tmp_path / "r", top_k=3, workers=1)
    assert final.head(counts["replayed"])["status"].to_list() == ["replayed"] * 3
    fits = final.filter(pl.col("fits"))
    assert fits.height and final.head(fits.height)["fits"].all()


def test_tp_comm_overlap_is_a_search_dimension(study_path: Path) -> None:
    """Asking for both settings yields both strategies (none deduplicated away), labelled apart."""
    import dataclasses

    from analysis.compare import strategy_label

    study = dataclasses.replace(load_study(study_path), search={
        "tp": [2], "pp": [1], "vpp": [1], "micro_batch_size": [1], "recompute": ["full"],
        "zero_stage": [1], "sequence_parallel": [True], "tp_comm_overlap": [False, True]})
    valid, _ = enumerate_space(study)
    assert sorted(s.tp_comm_overlap for s in valid) == [False, True]
    labels = {strategy_label(s) for s in valid}
    assert len(labels) == 2 and any(lab.endswith("-tpo") for lab in labels)
    study = dataclasses.replace(study, search={**study.search, "tp_comm_overlap": [False],
                                               "overlap_param_gather": [False, True]})
    valid, _ = enumerate_space(study)
    assert sorted(s.overlap_param_gather for s in valid) == [False, True]
    assert any(strategy_label(s).endswith("-opg") for s in valid)


def test_sweep_keeps_pipelines_whose_depth_does_not_divide_the_layers(tmp_path: Path) -> None:
    """Llama 3.1 405B has 126 layers: pp 16 runs with 7-layer end stages (Llama 3's layout), so
    the sweep must not drop it as invalid."""
    from analysis.study import study_from_dict

    study = study_from_dict({"model": "llama3.1-405b", "system": "dgx-h100", "gpus": 16384,
                             "global_batch_size": 2048,
                             "search": {"tp": [8], "pp": [8, 16], "vpp": [1],
                                        "micro_batch_size": [1], "recompute": ["none"],
                                        "zero_stage": [1], "sequence_parallel": [True]}})
    valid, invalid = enumerate_space(study)
    assert invalid == 0
    by_pp = {s.pp: s for s in valid}
    assert (by_pp[16].first_stage_layers, by_pp[16].last_stage_layers) == (7, 7)
    assert [len(by_pp[8].chunk_layers(126, g)) for g in range(8)] == [15] + [16] * 6 + [15]


def test_a_swept_uneven_split_is_in_the_label_and_the_label_reproduces_it() -> None:
    """The sweep picks the split of 126 layers itself, so the label it reports must say it:
    each label read back as the CLI's flags (``-firstN``, ``-lastN``, ``-embl``, ``-lossl``)
    builds the strategy the sweep screened. Llama 3's own layout (pp 16 × vpp 8) has empty end
    chunks, Megatron's embedding and loss counted as layers."""
    import dataclasses
    import re

    from analysis.compare import strategy_label
    from analysis.study import study_from_dict

    study = study_from_dict({"model": "llama3.1-405b", "system": "dgx-h100", "gpus": 16384,
                             "global_batch_size": 2048,
                             "search": {"tp": [8], "pp": [4, 8, 16], "vpp": [1, 2, 8],
                                        "micro_batch_size": [1], "recompute": ["none"],
                                        "zero_stage": [1], "sequence_parallel": [True]}})
    valid, _ = enumerate_space(study)
    labels = {strategy_label(s): s for s in valid}
    assert len(labels) == len(valid) >= 6
    for label, s in labels.items():
        first = re.search(r"-first(\d+)", label)
        last = re.search(r"-last(\d+)", label)
        read = dataclasses.replace(
            s, first_stage_layers=int(first[1]) if first else 0,
            last_stage_layers=int(last[1]) if last else 0,
            account_for_embedding_in_pipeline_split=label.endswith(("-embl", "-embl-lossl")),
            account_for_loss_in_pipeline_split=label.endswith("-lossl"))
        assert read == s, label
    by_shape = {(s.pp, s.vpp): label for label, s in labels.items()}
    assert by_shape[16, 1].endswith("-first7-last7")
    assert by_shape[16, 8].endswith("-embl-lossl")
    assert by_shape[8, 1].endswith("-first15-last15")


@pytest.mark.parametrize(("search", "message"), [
    ({"tp": 4}, "search dimension(s) ['tp'] must each be a non-empty list of values"),
    ({"pp": []}, "search dimension(s) ['pp'] must each be a non-empty list"),
    ({"recompute": [["full"]]}, "search dimension(s) ['recompute'] must each be"),
    ({"tpp": [1]}, "unknown search dimension(s) ['tpp']"),
    # values of the wrong kind or out of range (a zero had raised ZeroDivisionError, a string
    # ValueError, from inside the enumeration)
    ({"tp": [0, 1]}, "search tp must hold whole numbers ≥ 1, got [0]"),
    ({"micro_batch_size": [0]}, "search micro_batch_size must hold whole numbers ≥ 1, got [0]"),
    ({"micro_batch_size": ["x"]}, "search micro_batch_size must hold whole numbers ≥ 1"),
    ({"sequence_parallel": [1]}, "search sequence_parallel must hold true or false, got [1]"),
    ({"recompute": [1]}, "search recompute must hold strings, got [1]"),
])
def test_a_bad_search_space_is_named(search: dict, message: str) -> None:
    """A scalar where a list belongs had raised TypeError from inside the enumeration (found
    by fuzzing studies); a misspelt dimension is named with the known ones."""
    from analysis.study import study_from_dict

    study = study_from_dict({"model": "gpt-1.7b", "system": "dgx-h100", "gpus": 8,
                             "global_batch_size": 8, "search": search})
    with pytest.raises(ConfigError) as info:
        enumerate_space(study)
    assert message in str(info.value)


def test_screening_tasks_are_sized_to_the_workers(tmp_path: Path) -> None:
    """A local pool screens in about eight tasks per worker of 64–4,096 strategies each, one
    part file a task (a part per 64 strategies had cost more to write than to screen); a
    chunk below one strategy is named."""
    from analysis.study import study_from_dict

    assert [screening_chunk(n, 2) for n in (100, 8592, 10**6)] == [64, 537, 4096]
    study = study_from_dict({"model": "gpt-1.7b", "system": "dgx-h100", "gpus": 512,
                             "global_batch_size": 2048,
                             "search": {"zero_stage": [0, 1, 2, 3],
                                        "micro_batch_size": [1, 2, 4, 8]}})
    _, counts = sweep(study, tmp_path / "o", top_k=0, workers=2)
    size = screening_chunk(counts["valid"], 2)
    assert size > 64
    parts = list((tmp_path / "o" / "parts" / "screen").glob("part-*.parquet"))
    assert len(parts) == -(-counts["valid"] // size)
    with pytest.raises(ConfigError, match="chunk must be at least 1 strategy"):
        sweep(study, tmp_path / "p", chunk=0)


def test_an_unreachable_scheduler_is_a_clear_error(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong --scheduler address, or one nothing listens on, says so and how to go on —
    distributed's OSError / ValueError had escaped with its traceback."""
    from analysis import runner
    from analysis.study import study_from_dict

    monkeypatch.setattr(runner, "SCHEDULER_TIMEOUT_S", 1)
    study = study_from_dict({"model": "gpt-1.7b", "system": "dgx-h100", "gpus": 8,
                             "global_batch_size": 8, "search": {"tp": [1], "pp": [1]}})
    for address in ("not an address", "tcp://127.0.0.1:9"):
        with pytest.raises(TrainsimError, match="cannot reach the Dask scheduler"):
            sweep(study, tmp_path / "o", scheduler=address)

    # a scheduler that is up but has no workers had taken the tasks and run none, for ever
    from distributed import LocalCluster

    monkeypatch.setattr(runner, "WORKER_WAIT_S", 2.0)
    with LocalCluster(n_workers=0, processes=True, dashboard_address=":0") as empty, \
            pytest.raises(TrainsimError, match=r"has no workers \(none joined in 2 s\): start "
                                               r"one with `dask worker tcp://"):
        sweep(study, tmp_path / "q", scheduler=empty.scheduler_address)


def test_strategy_ids_do_not_change_between_versions() -> None:
    """A sweep resumes by strategy id: the key is every field (the original ones as
    ``dataclasses.astuple`` gave them, fields added since only where set) and the id of a fixed
    strategy is the one earlier versions wrote to disk."""
    import dataclasses

    from analysis.runner import _ID_FIELDS, strategy_id, strategy_key
    from tracegen import Strategy

    s = Strategy(tp=8, pp=8, dp=16, vpp=3, schedule="interleaved_1f1b", micro_batch_size=1,
                 global_batch_size=1536, recompute="selective", sequence_parallel=True,
                 zero_stage=1)
    first = dataclasses.astuple(s)[:len(_ID_FIELDS)]
    assert strategy_key(s) == first
    assert strategy_id(s) == "17e9ef7662b60f35"
    # a later field changes the id only when it is used, and then always
    bf16 = dataclasses.replace(s, grad_reduce_in_bf16=True)
    assert strategy_key(bf16) == (*first, ("grad_reduce_in_bf16", True))
    assert strategy_id(bf16) != strategy_id(s)
    assert [f.name for f in dataclasses.fields(Strategy)][:len(_ID_FIELDS)] == list(_ID_FIELDS)


def test_the_loss_fusion_and_the_context_parallel_split_are_search_dimensions(
        study_path: Path) -> None:
    """Each value asked for yields its own strategy, carrying it and labelled apart (the loss
    fusion had been accepted as a dimension but every value built the unfused loss); the
    context-parallel comm type and split fold away at cp 1."""
    import dataclasses

    from analysis.compare import strategy_label

    base = {"tp": [2], "pp": [1], "vpp": [1], "micro_batch_size": [1], "recompute": ["full"],
            "zero_stage": [1], "sequence_parallel": [True]}
    study = dataclasses.replace(load_study(study_path), search={
        **base, "cross_entropy_fusion": ["none", "native", "te"]})
    valid, _ = enumerate_space(study)
    assert sorted(s.cross_entropy_fusion for s in valid) == ["native", "none", "te"]
    assert len({strategy_label(s) for s in valid}) == 3
    study = dataclasses.replace(study, search={
        **base, "cp": [1, 2], "cp_comm_type": ["p2p", "all_gather"],
        "cp_balance": ["document", "sequence"]})
    valid, _ = enumerate_space(study)
    at = sorted((s.cp, s.cp_comm_type, s.cp_balance) for s in valid)
    assert at == [(1, "p2p", "document"), (2, "all_gather", "document"),
                  (2, "all_gather", "sequence"), (2, "p2p", "document"), (2, "p2p", "sequence")]
    assert len({strategy_label(s) for s in valid}) == 5


def test_expert_parallel_folding_is_a_search_dimension(tmp_path: Path) -> None:
    """On a MoE model, ``expert_tp: [0, 1]`` adds the folded layouts, including the ep that only
    tp·dp holds (tp 2, dp 4, ep 8 on 8 GPUs), labelled apart."""
    import dataclasses

    from analysis.compare import strategy_label
    from tracegen import get_model

    study = dataclasses.replace(
        load_study(write_study(tmp_path / "s", strategies=False, failures=False, search=True)),
        model=get_model("mixtral-8x7b"), search={
            "tp": [2], "pp": [1], "vpp": [1], "micro_batch_size": [1], "recompute": ["full"],
            "zero_stage": [1], "sequence_parallel": [True], "ep": [2, 4, 8],
            "expert_tp": [0, 1]})
    valid, _ = enumerate_space(study)
    got = sorted((s.ep, s.moe_folded) for s in valid)
    assert got == [(2, False), (2, True), (4, False), (4, True), (8, True)]
    assert all(strategy_label(s).endswith("-etp1-mbs1-rcf-z1-sp")
               for s in valid if s.moe_folded)


def test_zero3_prefetch_is_a_search_dimension_labelled_apart(study_path: Path) -> None:
    import dataclasses

    from analysis.compare import strategy_label

    study = dataclasses.replace(load_study(study_path), search={
        "tp": [1], "pp": [1], "vpp": [1], "micro_batch_size": [1], "recompute": ["none"],
        "zero_stage": [1, 3], "sequence_parallel": [False], "zero3_prefetch": [False, True]})
    valid, invalid = enumerate_space(study)
    got = sorted((s.zero_stage, s.zero3_prefetch) for s in valid)
    assert got == [(1, False), (3, False), (3, True)] and invalid == 0  # ZeRO 1 prefetching:
    # not a strategy of its own; prefetch taken as off, the same as ZeRO 1 without
    labels = [strategy_label(s) for s in valid]
    assert len(set(labels)) == 3 and sum(lab.endswith("-z3pf") for lab in labels) == 1


def test_a_sweep_recomputes_just_enough_to_fit(tmp_path: Path) -> None:
    """Layouts that do not fit without recompute but step faster than every one that fits get
    the least recompute that fits (``recompute_to_fit``): full recompute of the first N layers
    of each stage, which the space's none / full values cannot say. On Llama 3 70B on 1,024
    H100s such a layout then steps faster than any layout with every layer recomputed (it was
    tp 4 · pp 2 with 32 of each stage's 40 layers when written). A resumed sweep finds the
    same and screens nothing twice."""
    from analysis.study import study_from_dict

    study = study_from_dict({
        "model": "llama3-70b", "system": "dgx-h100", "gpus": 1024, "global_batch_size": 1024,
        "search": {"tp": [4, 8], "pp": [2, 4], "vpp": [1], "micro_batch_size": [2],
                   "recompute": ["none", "full"], "zero_stage": [1],
                   "sequence_parallel": [True]}}, name="fit")
    final, counts = sweep(study, tmp_path / "s", top_k=1, workers=1)
    assert counts["recomputed_to_fit"] >= 1
    assert final.height == counts["valid"] + counts["recomputed_to_fit"]
    partial = final.filter(pl.col("strategy").str.contains(r"-rcf\d+-"))
    assert partial.height == counts["recomputed_to_fit"] and partial["fits"].all()
    row = partial.row(0, named=True)
    layout = row["strategy"].split("-rcf")[0]
    same = final.filter(pl.col("strategy").str.starts_with(layout + "-rc"))
    none = same.filter(pl.col("strategy").str.contains("-rcn-")).row(0, named=True)
    full = same.filter(pl.col("strategy").str.contains("-rcf-")).row(0, named=True)
    assert not none["fits"] and full["fits"]
    assert none["step_time_s"] < row["fast_step_time_s"] < full["fast_step_time_s"]
    fitting_full = final.filter(pl.col("fits") & pl.col("strategy").str.contains("-rcf-"))
    assert row["fast_step_time_s"] < fitting_full["fast_step_time_s"].min()
    again, counts2 = sweep(study, tmp_path / "s", top_k=1, workers=1)
    assert counts2 == counts and again.sort("id").select(COMPARED).equals(
        final.sort("id").select(COMPARED))
    screened = PartStore(tmp_path / "s", "screen").read()
    assert screened["id"].n_unique() == screened.height


def test_why_a_space_is_invalid_is_told(tmp_path: Path) -> None:
    """Every invalid combination is counted under the reason the strategy check gives for it
    (the counts add up to the space's invalid count), and a sweep whose space holds no valid
    strategy says why instead of ending in an empty table."""
    from typer.testing import CliRunner

    from analysis.cli import app
    from analysis.study import study_from_dict
    from analysis.sweep import invalid_reasons

    space = {"tp": [1, 2, 16], "pp": [1, 3], "vpp": [1, 2], "micro_batch_size": [1],
             "recompute": ["full"], "zero_stage": [1], "sequence_parallel": [False, True]}
    study = study_from_dict({"model": "llama3-8b", "system": "dgx-h100", "gpus": 96,
                             "global_batch_size": 96, "search": space})
    _, invalid = enumerate_space(study)
    reasons, seen = invalid_reasons(study, limit=100)
    assert seen == invalid == sum(n for _, n in reasons) > 0
    text = " | ".join(r for r, _ in reasons)
    assert "num_kv_heads 8 is not divisible by tp 16" in text
    # a switch where it does not apply is off, not a reason (``applicable``)
    assert "sequence_parallel needs tp > 1" not in text
    assert "interleaved_1f1b needs pp ≥ 2 and vpp ≥ 2" not in text
    assert [r.split(";")[0] for r, _ in reasons] == ["num_kv_heads 8 is not divisible by tp 16"]
    # one rule, once, whatever its numbers, examples or advice: GPT-3's default space has two
    default = load_study(Path(__file__).parents[1] / "analysis" / "studies" / "default.toml")
    rules, seen = invalid_reasons(default, limit=100, sample=10**6)
    assert sorted(r.split(" ")[0] for r, _ in rules) == ["global_batch_size", "interleaved_1f1b"]
    assert sum(n for _, n in rules) == seen == enumerate_space(default)[1]
    few, looked = invalid_reasons(study, limit=1, sample=3)
    assert looked == 3 and len(few) == 1 and few[0][1] <= 3

    f = tmp_path / "none.toml"
    f.write_text('model = "llama3-70b"\nsystem = "dgx-h100"\ngpus = 64\n'
                 'global_batch_size = 64\n[search]\ntp = [16]\npp = [2, 4]\nvpp = [1]\n'
                 'micro_batch_size = [1]\nrecompute = ["full"]\nzero_stage = [1]\n'
                 'sequence_parallel = [true]\n')
    got = CliRunner().invoke(app, ["sweep", str(f), "-o", str(tmp_path / "o"), "--workers",
                                   "1"])
    assert got.exit_code == 0, got.output
    assert "valid: 0" in got.output and "why invalid:" in got.output
    assert "2 × num_kv_heads 8 is not divisible by tp 16" in got.output
    assert "nothing to rank: every strategy of the space is invalid" in got.output
    assert "best of 0" not in got.output  # (no empty table)
    from analysis.report import NOTHING_RANKED, build_report

    html = build_report(tmp_path / "o", tmp_path / "r")  # its report says so, no empty figures
    assert NOTHING_RANKED in (tmp_path / "r" / "report.md").read_text()
    assert NOTHING_RANKED in html.read_text() and "<img" not in html.read_text()


def test_a_sweep_report_accounts_for_every_combination(study_path: Path, tmp_path: Path) -> None:
    """The counts a sweep prints and its report states add up to the space's combinations
    (invalid, the same strategy as another, valid), in words, not the JSON's keys."""
    import json

    from typer.testing import CliRunner

    from analysis.cli import app

    out, rep = tmp_path / "o", tmp_path / "rep"
    run = CliRunner().invoke(app, ["sweep", str(study_path), "-o", str(out), "--workers", "1",
                                   "--top-k", "1"])
    assert run.exit_code == 0, run.output
    counts = json.loads((out / "study.json").read_text())["counts"]
    assert counts["enumerated"] == 3 * 3 * 2 * 2 * 2 * 2 * 2
    assert counts["invalid"] + counts["same_as_another"] + counts["valid"] == \
        counts["enumerated"] and counts["same_as_another"] > 0
    assert f"same as another: {counts['same_as_another']:,}" in run.output
    report = CliRunner().invoke(app, ["report", str(out), "-o", str(rep)])
    assert report.exit_code == 0, report.output
    md = (rep / "report.md").read_text()
    assert f"enumerated: {counts['enumerated']:,} · invalid: {counts['invalid']:,}" in md
    assert "same as another" in md and "same_as_another" not in md


def test_a_folder_resumes_only_its_own_study(study_path: Path, tmp_path: Path) -> None:
    """A strategy's id names its layout, not the system or model it was costed on: a re-run
    into the same folder with another system had ranked the first run's rows as its own. It is
    refused before any work, naming what differs; the same study over a wider space resumes,
    re-costing nothing it already has."""
    import dataclasses

    from replay import get_system

    small = {"tp": [1, 2], "pp": [1], "vpp": [1], "micro_batch_size": [1],
             "recompute": ["full"], "zero_stage": [1], "sequence_parallel": [False]}
    study = dataclasses.replace(load_study(study_path), search=small)
    out = tmp_path / "o"
    sweep(study, out, top_k=1, workers=1)
    screened = PartStore(out, "screen").read()
    other = dataclasses.replace(study, system=get_system("dgx-a100-80gb"))
    with pytest.raises(ConfigError, match="holds results of another study "
                                          r"\(system dgx-h100 → dgx-a100-80gb\)"):
        sweep(other, out, top_k=1, workers=1)
    h100 = study.system
    edited = dataclasses.replace(study, system=dataclasses.replace(
        h100, gpu=dataclasses.replace(h100.gpu, hbm_GiB=141.0)))
    with pytest.raises(ConfigError, match=r"system dgx-h100: gpu changed"):
        sweep(edited, out, top_k=1, workers=1)
    with pytest.raises(ConfigError, match=r"global_batch_size 32 → 64"):
        sweep(dataclasses.replace(study, global_batch_size=64), out, top_k=1, workers=1)
    assert PartStore(out, "screen").read().equals(screened)  # nothing was added
    wider = dataclasses.replace(study, name="renamed", search={**small, "pp": [1, 2]})
    _, counts = sweep(wider, out, top_k=1, workers=1)
    again = PartStore(out, "screen").read()
    assert again.height == counts["valid"] > screened.height
    assert again.head(screened.height).equals(screened)  # the first run's rows, kept as they were
    (out / "parts" / "study.json").unlink()  # parts an earlier trainsim wrote: no record
    with pytest.raises(ConfigError, match="no record of the study they belong to"):
        sweep(study, out, top_k=1, workers=1)


def test_fresh_rebuilds_a_folder_another_study_holds(study_path: Path, tmp_path: Path) -> None:
    """A refused folder names the way out (``--fresh``), and taking it replaces the earlier
    study's results instead of mixing them in: afterwards the folder holds exactly what a run
    into an empty folder holds (the same rows, the new study's record), for a sweep and for a
    comparison (whose kept timelines go too). ``make demo`` runs with it, so that a demo folder
    an earlier trainsim wrote (with other GPU constants) is rebuilt, not refused."""
    import dataclasses
    import json

    from typer.testing import CliRunner

    from analysis.cli import app
    from analysis.resume import LOCK, fingerprint
    from replay import get_system

    small = {"tp": [1, 2], "pp": [1], "vpp": [1], "micro_batch_size": [1],
             "recompute": ["full"], "zero_stage": [1], "sequence_parallel": [False]}
    study = dataclasses.replace(load_study(study_path), search=small)
    other = dataclasses.replace(study, system=get_system("dgx-a100-80gb"))
    out, clean = tmp_path / "o", tmp_path / "clean"
    sweep(study, out, top_k=1, workers=1)
    with pytest.raises(ConfigError, match="run again with --fresh"):
        sweep(other, out, top_k=1, workers=1)
    got, _ = sweep(other, out, top_k=1, workers=1, fresh=True)
    want, _ = sweep(other, clean, top_k=1, workers=1)
    assert got.drop("id").equals(want.drop("id")) and got["id"].equals(want["id"])
    for phase in ("screen", "replay"):
        assert PartStore(out, phase).read().sort("id").equals(
            PartStore(clean, phase).read().sort("id"))
    record = json.loads((out / "parts" / "study.json").read_text())
    assert record == json.loads(json.dumps(fingerprint(other), sort_keys=True))
    assert not (out / "parts" / LOCK).exists()

    listed = write_study(tmp_path / "listed", failures=False)  # a comparison
    cmp_out = tmp_path / "cmp"
    first = CliRunner().invoke(app, ["compare", str(listed), "-o", str(cmp_out),
                                     "--workers", "1"])
    assert first.exit_code == 0, first.output
    timelines = sorted((cmp_out / "parts" / "timelines").iterdir())
    assert timelines
    stale = cmp_out / "parts" / "timelines" / "stale.parquet"
    stale.write_bytes(timelines[0].read_bytes())
    again = CliRunner().invoke(app, ["compare", str(listed), "-o", str(cmp_out),
                                     "--workers", "1"])
    assert again.exit_code == 0 and "kept from an earlier run" in again.output
    parts = len(list((cmp_out / "parts" / "compare").glob("part-*.parquet")))
    assert parts == len(load_study(listed).strategies)  # one part a replayed strategy
    fresh = CliRunner().invoke(app, ["compare", str(listed), "-o", str(cmp_out),
                                     "--workers", "1", "--fresh"])
    assert fresh.exit_code == 0, fresh.output
    assert "kept from an earlier run" not in fresh.output and not stale.exists()
    assert f"--fresh: deleting {parts} part files an earlier run left under" in " ".join(
        fresh.output.split())
    assert sorted((cmp_out / "parts" / "timelines").iterdir()) == timelines


def test_a_sweep_where_nothing_fits_says_so(tmp_path: Path) -> None:
    """Llama 3.1 405B on one node: every layout needs far more than 80 GiB; the sweep says that
    nothing fits and names the least memory any strategy needs (a table of rows that all say
    False reads too easily as a ranking)."""
    import json

    from typer.testing import CliRunner

    from analysis.cli import app

    f = tmp_path / "s.toml"
    f.write_text('model = "llama3.1-405b"\nsystem = "dgx-h100"\ngpus = 8\n'
                 'global_batch_size = 64\n[search]\ntp = [4, 8]\npp = [1, 2]\nvpp = [1]\n'
                 'micro_batch_size = [1]\nrecompute = ["full"]\nzero_stage = [1]\n'
                 'sequence_parallel = [true]\n')
    out = tmp_path / "o"
    got = CliRunner().invoke(app, ["sweep", str(f), "-o", str(out), "--workers", "1"],
                             env={"COLUMNS": "300"})
    assert got.exit_code == 0, got.output
    least = pl.read_parquet(out / "results.parquet")["peak_memory_GiB"].min()
    assert least > 80
    text = " ".join(got.output.split())
    assert f"nothing fits: the least memory any strategy needs is {least:.1f} GiB a GPU of 80" \
        in text
    assert json.loads((out / "study.json").read_text())["counts"]["valid"] == 3  # tp8·pp2 > 8


def test_a_negative_top_k_is_refused(study_path: Path, tmp_path: Path) -> None:
    """polars' head(-1) is all rows but one: --top-k -1 had replayed nearly the whole space."""
    with pytest.raises(ConfigError, match="top_k is how many of the best to replay"):
        sweep(load_study(study_path), tmp_path / "o", top_k=-1, workers=1)
    assert not (tmp_path / "o").exists()


def test_a_sweep_says_the_space_it_searched_and_names_strategies_in_full(
        tmp_path: Path) -> None:
    """Dimensions a study leaves out are searched over their defaults: the sweep says which
    (a space of tp and pp alone had also swept vpp, micro-batches, recompute, ZeRO and SP
    without a word). The ranking folds a long strategy name rather than cut it short."""
    from typer.testing import CliRunner

    from analysis.cli import app
    from analysis.report import _fmt

    f = write_study(tmp_path / "s", strategies=False, failures=False)
    f.write_text(f.read_text() + "\n[search]\ntp = [1, 2]\npp = [1, 2]\n")
    got = CliRunner().invoke(app, ["sweep", str(f), "-o", str(tmp_path / "o"), "--workers",
                                   "1", "--top-k", "1"])
    assert got.exit_code == 0, got.output
    space = " ".join(got.output.split("search space: ")[1].split("\n\n")[0].split())
    assert space.startswith("tp = [1, 2] · pp = [1, 2] · vpp = [1, 2] (default) · "
                            "micro_batch_size = [1, 2, 4] (default) · ")
    assert 'recompute = ["none", "selective", "full"] (default)' in space
    assert "sequence_parallel = [false, true] (default)" in space
    assert "…" not in got.output
    assert _fmt("peak_memory_GiB", 72.0423) == "72.0" and _fmt("step_time_s", 1.23456) == "1.235"
    rep = CliRunner().invoke(app, ["report", str(tmp_path / "o"), "-o", str(tmp_path / "r")])
    assert rep.exit_code == 0, rep.output
    md = (tmp_path / "r" / "report.md").read_text()
    assert f"search space: {space}\n" in md  # the report says the space too


def test_one_run_at_a_time_writes_a_results_folder(study_path: Path, tmp_path: Path) -> None:
    """Two runs into one folder had numbered their parts from the same highest one, the later
    rename replacing the earlier part. A running run's lock refuses a second (on this host, by
    its live process; on another host, where that cannot be seen); a lock whose process is
    gone, or that cannot be read, is taken over; the lock goes when the run ends."""
    import json
    import socket
    import subprocess

    from analysis.compare import compare
    from analysis.resume import LOCK

    study = load_study(study_path)
    out = tmp_path / "o"
    lock = out / "parts" / LOCK
    lock.parent.mkdir(parents=True)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    for pid, host, refused in ((os.getpid(), socket.gethostname(), "process"),
                               (1, "other-host", "process 1 on other-host")):
        lock.write_text(json.dumps({"pid": pid, "host": host, "started": 0}))
        with pytest.raises(ConfigError, match=f"another trainsim run \\({refused}"):
            sweep(study, out, top_k=0, workers=1)
        with pytest.raises(ConfigError, match="is writing to"):
            compare(study, out_dir=out)
    for stale in (json.dumps({"pid": int(gone.stdout), "host": socket.gethostname(),
                              "started": 0}), "not json"):
        lock.write_text(stale)
        final, _ = sweep(study, out, top_k=0, workers=1)
        assert final.height and not lock.exists()


def test_every_search_dimension_reaches_the_strategy() -> None:
    """Each optional dimension is read where a combination is built (``sweep._build``): one
    left out is accepted, enumerated and folded onto the default (as the loss fusion was)."""
    import inspect

    from analysis import sweep as S

    source = inspect.getsource(S._build)
    missing = [d for d in (*S.DEFAULT_SPACE, *S.OPTIONAL_DIMENSIONS)
               if f'd["{d}"]' not in source and f'd.get("{d}"' not in source]
    assert not missing, missing


def test_a_worker_that_dies_is_said_with_what_to_do(tmp_path: Path) -> None:
    """A sweep on two local workers from a script piped to Python: the spawned workers cannot
    import a main module read from stdin and die at start. Python said only "A process in the
    process pool was terminated abruptly"; trainsim names the likely causes (memory, an
    unimportable script) and the fixes, and that the finished chunks are kept."""
    script = (
        "from analysis.study import study_from_dict\n"
        "from analysis.sweep import sweep\n"
        "study = study_from_dict({'model': 'llama3-8b', 'system': 'dgx-h100', 'gpus': 16,\n"
        "    'global_batch_size': 64, 'search': {'tp': [1, 2, 4, 8], 'pp': [1, 2],\n"
        "    'zero_stage': [1], 'micro_batch_size': [1, 2]}})\n"
        f"sweep(study, {str(tmp_path / 'out')!r}, top_k=1, workers=2)\n")
    r = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True,
                       timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("tracegen.errors.TrainsimError: a worker process stopped"), last
    for part in ("ran out of memory (use fewer workers: --workers 1 / workers=1)",
                 "one read from stdin or a pipe", "the same run again resumes from them"):
        assert part in last


def test_a_dead_worker_of_any_local_pool_is_said() -> None:
    """The same words wherever a local pool runs (``validate --jobs`` too), on a real spawned
    worker that exits mid-task."""
    import concurrent.futures as cf
    import multiprocessing

    from analysis.runner import worker_deaths_said

    with pytest.raises(TrainsimError, match=r"use fewer workers: --jobs 1 / jobs=1\)"), \
            cf.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool, \
            worker_deaths_said("--jobs 1 / jobs=1"):
        pool.submit(os._exit, 3).result(timeout=120)
