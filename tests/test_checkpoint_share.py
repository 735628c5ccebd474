"""A checkpoint as the ranks hold it, how long one takes to persist, and where its snapshots
live: closed forms of the per-rank share, its conservation over the ranks, the persist window
against a Monte Carlo of the same process, and the interval floor it sets."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis import resilience as R
from analysis.checkpoint_share import checkpoint_share
from analysis.evaluate import resilience_frame, snapshot_line
from analysis.study import Study, study_from_dict
from replay.hardware import resolve_system
from tracegen import Strategy, memory
from tracegen.catalog import resolve_model
from tracegen.program import RoleProgram

CKPT = memory.WEIGHT_BYTES + memory.OPTIM_BYTES  # 14 bytes a parameter (resilience's)


@pytest.mark.parametrize(("zero", "offload"),  # (optimizer offloading needs ZeRO 1/2)
                         [(0, 0.0), (1, 0.0), (2, 0.0), (3, 0.0), (1, 0.5), (2, 0.5)])
def test_a_ranks_share_is_its_weights_and_state_as_the_strategy_shards_them(
        zero: int, offload: float) -> None:
    """Weights (2 bytes) over the data-parallel group only under ZeRO-3; the fp32 master and
    moments (12) under ZeRO ≥ 1; the offloaded optimizer share's state is in host memory."""
    s = Strategy(tp=2, pp=2, dp=8, micro_batch_size=1, global_batch_size=64, zero_stage=zero,
                 optimizer_offload_fraction=offload)
    p = 1_000_003
    on_gpu, on_host = memory.checkpoint_held_bytes(s, p)
    weights = -(-2 * p // 8) if zero == 3 else 2 * p
    state = -(-12 * p // 8) if zero else 12 * p
    assert on_host == round(state * offload)
    assert on_gpu + on_host == weights + state


def _world_sum(model_name: str, s: Strategy) -> int:
    m = resolve_model(model_name)
    ranks_per_stage = s.world_size // s.pp
    return sum(ranks_per_stage * sum(memory.checkpoint_held_bytes(
        s, sum(h.values()), h["edp"])) for h in (
        RoleProgram(m, s, stage).stage_params() for stage in range(s.pp)))


@settings(max_examples=25, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2, 4]),
       dp=st.sampled_from([2, 4, 8]))
def test_fully_sharded_shares_add_up_to_the_checkpoint(tp: int, pp: int, dp: int) -> None:
    """Under ZeRO-3 every byte of the checkpoint is held once: the ranks' shares add up to
    14 bytes a parameter, up to the rounding of each shard (a byte or so a rank and tensor)."""
    s = Strategy(tp=tp, pp=pp, dp=dp, micro_batch_size=1, global_batch_size=8 * dp,
                 zero_stage=3)
    params = resolve_model("llama3-8b").num_params()
    assert 0 <= _world_sum("llama3-8b", s) - CKPT * params <= 2 * s.world_size


@settings(max_examples=15, deadline=None)
@given(ep=st.sampled_from([1, 2, 4, 8]), pp=st.sampled_from([1, 2]))
def test_expert_shards_add_up_too(ep: int, pp: int) -> None:
    """Experts shard over their own data-parallel group (dp / ep ranks): still each byte once."""
    s = Strategy(tp=1, pp=pp, dp=8, ep=ep, micro_batch_size=1, global_batch_size=64,
                 zero_stage=3)
    params = resolve_model("mixtral-8x7b").num_params()
    assert 0 <= _world_sum("mixtral-8x7b", s) - CKPT * params <= 4 * s.world_size


def test_a_checkpoint_waits_for_the_busiest_stage() -> None:
    """The staged share is the most any rank holds: Llama 3 405B's embedding stage under ZeRO-1
    (weights replicated over dp, the fp32 state sharded)."""
    m = resolve_model("llama3.1-405b")
    s = Strategy(tp=8, pp=14, dp=8, micro_batch_size=1, global_batch_size=64, zero_stage=1)
    share = checkpoint_share(m, s, resolve_system("dgx-h100"))
    per_stage = [RoleProgram(m, s, x).stage_params()["dp"] for x in range(s.pp)]
    assert share.staged_bytes == 2 * max(per_stage) + -(-12 * max(per_stage) // 8)
    # a host's eight GPUs are all of one stage here: eight copies of that stage's share
    assert share.host_peak_GiB * 2**30 == pytest.approx(8 * share.staged_bytes)
    assert share.host_capacity_GiB == 2048 and share.host_peak_GiB < 2048


# ---- the persist window -------------------------------------------------------------------

@pytest.mark.parametrize(("mttf", "delta", "restart", "persist", "tau"), [
    (3600, 5, 300, 200, 400), (1800, 1, 120, 600, 600), (7200, 30, 600, 50, 900)])
def test_the_persist_window_is_dalys_form_with_it_added_to_the_restart(
        mttf: float, delta: float, restart: float, persist: float, tau: float) -> None:
    """A failure in the first W after a checkpoint rolls back one segment more: the closed
    form (R + W in Daly's) against the simulated process."""
    work = 60 * tau
    closed = tau / R.ettr_checkpoint_restart(tau, delta, restart, mttf, persist) * 60
    runs = 400
    sims = R.monte_carlo_wall_s(work, tau, delta, restart, mttf, runs=runs, seed=11,
                                persist_s=persist)
    se = sims.std(ddof=1) / math.sqrt(runs)
    assert abs(sims.mean() - closed) < 4 * se, (sims.mean(), closed, se)
    without = R.monte_carlo_wall_s(work, tau, delta, restart, mttf, runs=runs, seed=11)
    assert sims.mean() > without.mean()  # the window costs something


def test_the_monte_carlo_refuses_a_window_longer_than_a_segment() -> None:
    with pytest.raises(R.ConfigError, match="at least the persist time"):
        R.monte_carlo_wall_s(1000, 100, 1, 10, 3600, persist_s=500)


@settings(max_examples=60, deadline=None)
@given(delta=st.floats(0.01, 60), persist=st.floats(0.0, 5000), step=st.floats(0.5, 120),
       mttf_h=st.floats(0.5, 100))
def test_no_checkpoint_is_taken_before_the_last_has_persisted(
        delta: float, persist: float, step: float, mttf_h: float) -> None:
    """The interval is whole steps and at least the persist time — Daly's optimum where that
    allows it, the fewest steps that cover the persist time where it does not."""
    f = R.FailureModel(name="x", rate_per_gpu_hour=1 / (mttf_h * 1024))
    costs = {"global_restart": R.RecoveryCosts(checkpoint_s=delta, restart_s=300.0,
                                               persist_s=persist)}
    (row,) = R.policy_rows(failure=f, gpus=1024, work_s=1e6, costs=costs, step_s=step)
    tau = row["checkpoint_interval_s"]
    n = tau / step
    assert n == pytest.approx(round(n), abs=1e-6) and round(n) >= 1
    assert tau >= persist * (1 - 1e-9)
    if persist > R.daly_interval_s(delta, mttf_h * 3600) + step:
        assert tau < persist + step  # the floor, rounded up to a step
    assert row["persist_s"] == persist


def _study(**checkpoint: object) -> dict:
    return {"model": "llama3.1-405b", "system": "dgx-h100", "gpus": 16384,
            "global_batch_size": 2048, "tokens": 15.6e12,
            "strategies": [{"tp": 8, "pp": 16, "vpp": 8, "schedule": "interleaved_1f1b",
                            "micro_batch_size": 1, "sequence_parallel": True,
                            "zero_stage": 1, "account_for_embedding_in_pipeline_split": True,
                            "account_for_loss_in_pipeline_split": True}],
            "failures": {"preset": "llama3-16k-h100"}, "checkpoint": checkpoint}


def test_slow_storage_sets_the_interval_and_the_rollback() -> None:
    """Llama 3 405B on 16,384 H100s: its 5.67 TB checkpoint written at 5 GB/s takes 19 min
    to persist, longer than Daly's interval for a 0.1 s blocking copy; every storage policy
    then checkpoints no more often, and a failure loses that window more (R + W), while the
    in-memory policy, whose copy is safe once on a peer, keeps Daly's interval."""
    study = study_from_dict(_study(mode="async", storage_GBps=5.0))
    frame = resilience_frame(study, study.strategies[0])
    rows = {r["policy"]: r for r in frame.iter_rows(named=True)}
    size = R.checkpoint_bytes(study.model.num_params())
    g = rows["global_restart"]
    assert g["persist_s"] == pytest.approx(size / 5e9)
    assert g["checkpoint_interval_s"] >= g["persist_s"] > 10 * R.daly_interval_s(
        g["checkpoint_s"], g["job_mttf_s"])
    assert g["goodput"] == pytest.approx(R.ettr_checkpoint_restart(
        g["checkpoint_interval_s"], g["checkpoint_s"], g["restart_s"], g["job_mttf_s"],
        g["persist_s"]))
    mem = rows["in_memory"]
    assert mem["persist_s"] < 60 and mem["checkpoint_interval_s"] < g["persist_s"]
    fast = {r["policy"]: r for r in resilience_frame(
        study_from_dict(_study(mode="async", storage_GBps=2000.0)),
        study.strategies[0]).iter_rows(named=True)}
    assert fast["global_restart"]["goodput"] > g["goodput"]
    # a synchronous save has persisted when training resumes
    sync = resilience_frame(study_from_dict(_study(mode="sync", storage_GBps=5.0)),
                            study.strategies[0])
    assert sync.filter(sync["policy"] == "global_restart")["persist_s"][0] == 0


def _small_host_row(**checkpoint: object) -> tuple[Study, dict]:
    """Llama 3.1 405B at tp 8 × pp 9, ZeRO-0, dp 1 on DGX H100 hosts of 512 GiB: the study
    and its first resilience row."""
    study = study_from_dict({**_study(**checkpoint), "gpus": 72, "global_batch_size": 72,
                             "strategies": [{"tp": 8, "pp": 9, "micro_batch_size": 1}]})
    small = resolve_system("dgx-h100")
    small = dataclasses.replace(small, node=dataclasses.replace(small.node,
                                                                host_memory_GiB=512))
    return study, resilience_frame(dataclasses.replace(study, system=small),
                                   study.strategies[0]).row(0, named=True)


def test_snapshots_that_overfill_a_host_are_said_with_the_fix() -> None:
    """Async snapshots sit in pinned host memory: eight GPUs' shares of Llama 3.1 405B at
    tp 8 × pp 9 with ZeRO-0 (over 79 GB a GPU, 630 GB a host) overfill a host of 512 GiB."""
    study, row = _small_host_row(mode="async")
    assert row["staged_GiB"] * 8 == pytest.approx(row["snapshot_host_GiB"])
    assert row["snapshot_host_GiB"] > 512 == row["host_memory_GiB"]
    line = snapshot_line(row)
    assert line is not None and "overfill a host" in line and "zero_stage" in line
    big = resilience_frame(study, study.strategies[0]).row(0, named=True)
    assert big["host_memory_GiB"] == 2048 and snapshot_line(big) is None


def test_storage_too_slow_to_ever_recover_is_named_not_the_failure_rate(
        tmp_path: Path) -> None:
    """At 1 MB/s a restart loads the 405B checkpoint for two months: the policies that load
    from storage make no progress, and the line says the storage, not only the rate's unit
    (it had named the in-memory policy's 469 s restart as the recovery to beat)."""
    study = (Path(__file__).resolve().parent.parent / "analysis" / "studies" /
             "llama3-405b-failures.toml").read_text()
    f = tmp_path / "slow.toml"
    f.write_text(study.replace("storage_GBps = 2000.0", "storage_GBps = 0.001"))
    r = subprocess.run([sys.executable, "-m", "analysis.cli", "resilience", str(f)],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLUMNS": "300"})
    assert r.returncode == 0, r.stderr
    words = " ".join(r.stdout.split())
    assert "no progress under global_restart, hot_spares (goodput 0%)" in words
    assert "more than the MTTF by itself" in words and "[checkpoint] storage_GBps" in words


def test_checkpoints_kept_in_memory_hold_a_peers_snapshot_too() -> None:
    """mode = "in_memory": a host keeps its ranks' snapshots and a peer host's — twice the
    async snapshots' host memory (nothing offloaded here)."""
    base = {**_study(), "gpus": 72, "global_batch_size": 72,
            "strategies": [{"tp": 8, "pp": 9, "micro_batch_size": 1, "zero_stage": 1}]}
    rows = {}
    for mode in ("async", "in_memory"):
        study = study_from_dict({**base, "checkpoint": {"mode": mode}})
        rows[mode] = resilience_frame(study, study.strategies[0]).row(0, named=True)
    assert rows["in_memory"]["snapshot_host_GiB"] == pytest.approx(
        2 * rows["async"]["snapshot_host_GiB"])
    assert rows["in_memory"]["staged_GiB"] == rows["async"]["staged_GiB"]


def test_a_mixed_cluster_checks_each_systems_hosts_against_their_own_memory() -> None:
    """Stage 1 on DGX A100 40GB hosts (1 TiB) beside DGX H100 ones (2 TiB): the snapshots
    are held where they run, and the fuller hosts against their memory are the ones said."""
    m = resolve_model("llama3-8b")
    s = Strategy(tp=1, pp=2, dp=8, micro_batch_size=1, global_batch_size=64)
    h100, a100 = resolve_system("dgx-h100"), resolve_system("dgx-a100-40gb")
    alone = checkpoint_share(m, s, h100)
    mixed = checkpoint_share(m, s, h100, {1: a100})
    assert a100.node.host_memory_GiB == 1024 and mixed.host_capacity_GiB == 1024
    stage1 = RoleProgram(m, s, 1).stage_params()["dp"] * CKPT
    assert mixed.host_peak_GiB * 2**30 == pytest.approx(8 * stage1)
    assert mixed.staged_bytes == alone.staged_bytes  # what a GPU holds is the strategy's


# ---- a fully parallel save: each tensor written once ----------------------------------------

@pytest.mark.parametrize(("zero", "offload"), [(0, 0.0), (1, 0.0), (3, 0.0), (1, 0.5)])
def test_a_fully_parallel_save_spreads_every_tensor_over_its_holders(
        zero: int, offload: float) -> None:
    """Megatron-Core's fully parallel save: the weights and the optimizer state divide over
    dp·cp whatever the ZeRO stage — replicated tensors are written by one holder each."""
    s = Strategy(tp=2, pp=2, dp=4, cp=2, micro_batch_size=1, global_batch_size=64,
                 zero_stage=zero, optimizer_offload_fraction=offload)
    p = 1_000_003
    on_gpu, on_host = memory.checkpoint_written_bytes(s, p)
    state = -(-12 * p // 8)
    assert on_host == round(state * offload)
    assert on_gpu + on_host == -(-2 * p // 8) + state
    held = memory.checkpoint_held_bytes(s, p)
    assert on_gpu <= held[0] and on_host <= held[1]


def _written_world_sum(model_name: str, s: Strategy) -> int:
    m = resolve_model(model_name)
    return sum(s.world_size // s.pp * sum(memory.checkpoint_written_bytes(
        s, sum(h.values()), h["edp"])) for h in (
        RoleProgram(m, s, stage).stage_params() for stage in range(s.pp)))


@settings(max_examples=30, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2]),
       dp=st.sampled_from([2, 4, 8]), zero=st.sampled_from([0, 1, 3]))
def test_written_shares_add_up_to_the_checkpoint_under_any_sharding(
        tp: int, pp: int, dp: int, zero: int) -> None:
    """Whatever the ZeRO stage, the ranks of a fully parallel save write the checkpoint once:
    14 bytes a parameter over all ranks, up to each share's rounding."""
    s = Strategy(tp=tp, pp=pp, dp=dp, micro_batch_size=1, global_batch_size=8 * dp,
                 zero_stage=zero)
    params = resolve_model("llama3-8b").num_params()
    assert 0 <= _written_world_sum("llama3-8b", s) - CKPT * params <= 2 * s.world_size


@settings(max_examples=15, deadline=None)
@given(ep=st.sampled_from([1, 2, 4, 8]), zero=st.sampled_from([0, 1, 3]))
def test_written_expert_shares_add_up_too(ep: int, zero: int) -> None:
    """Experts are written over their own data-parallel group (dp / ep ranks). (At tp 1: the
    router is held whole by every tensor-parallel rank, a replica the sum would count.)"""
    s = Strategy(tp=1, pp=2, dp=8, ep=ep, micro_batch_size=1, global_batch_size=64,
                 zero_stage=zero)
    params = resolve_model("mixtral-8x7b").num_params()
    assert 0 <= _written_world_sum("mixtral-8x7b", s) - CKPT * params <= 4 * s.world_size


def test_fully_parallel_staging_blocks_less_and_loads_the_same() -> None:
    """Llama 3 405B under ZeRO-1 at dp 8: a GPU holds its stage's 16-bit weights whole, so a
    state-dict staging copies ~7x what a fully parallel save copies (2 + 12/8 bytes a parameter
    against 14/8); the restart loads what the GPU holds either way, and goodput can only gain."""
    study = study_from_dict({**_study(), "gpus": 1024, "global_batch_size": 512})
    s = study.strategies[0]
    rows = {}
    for staging in ("state_dict", "fully_parallel"):
        st_ = study_from_dict({**_study(), "gpus": 1024, "global_batch_size": 512,
                               "checkpoint": {"staging": staging}})
        rows[staging] = {r["policy"]: r for r in
                         resilience_frame(st_, s).iter_rows(named=True)}
    held = rows["state_dict"]["global_restart"]
    written = rows["fully_parallel"]["global_restart"]
    assert held["staged_GiB"] / written["staged_GiB"] == pytest.approx((2 + 12 / 8) / (14 / 8),
                                                                       rel=0.01)
    assert written["checkpoint_s"] == pytest.approx(
        held["checkpoint_s"] * written["staged_GiB"] / held["staged_GiB"])
    assert written["restart_s"] == held["restart_s"]
    for policy in rows["state_dict"]:
        assert rows["fully_parallel"][policy]["goodput"] >= rows["state_dict"][policy]["goodput"]
    assert written["checkpoint_staging"] == "fully_parallel"
    share = checkpoint_share(study.model, s, study.system, staging="fully_parallel")
    assert share.load_bytes == checkpoint_share(study.model, s, study.system).load_bytes


def test_an_unknown_staging_is_refused_when_the_study_loads() -> None:
    with pytest.raises(R.ConfigError, match="staging must be 'state_dict' or 'fully_parallel'"):
        study_from_dict(_study(staging="megatron"))


def test_the_overfill_fix_does_not_offer_the_staging_already_used() -> None:
    """At dp 1 a fully parallel save spreads nothing: the snapshots still overfill the small
    host, and the line offers only more GPUs or a synchronous save."""
    _, row = _small_host_row(mode="async", staging="fully_parallel")
    line = snapshot_line(row)
    assert line is not None and "more GPUs" in line
    assert "zero_stage" not in line and "staging" not in line


def test_a_saves_fixed_overhead_adds_to_every_policys_blocking_time() -> None:
    """[checkpoint] save_overhead_s: the same seconds on each policy's δ; Daly's interval
    (√(2δM) for δ ≪ M) grows with it and goodput falls."""
    rows = {}
    for overhead in (0.0, 0.78):
        study = study_from_dict(_study(staging="fully_parallel", save_overhead_s=overhead))
        rows[overhead] = {r["policy"]: r for r in
                          resilience_frame(study, study.strategies[0]).iter_rows(named=True)}
    for policy, base in rows[0.0].items():
        slow = rows[0.78][policy]
        assert slow["checkpoint_s"] == pytest.approx(base["checkpoint_s"] + 0.78)
        assert slow["goodput"] < base["goodput"]
    g = rows[0.78]["global_restart"]
    assert g["checkpoint_interval_s"] == pytest.approx(  # (whole steps)
        R.daly_interval_s(g["checkpoint_s"], g["job_mttf_s"]), abs=g["step_time_s"])
    with pytest.raises(R.ConfigError, match=r"\[checkpoint\] save_overhead_s must be a number"):
        study_from_dict(_study(save_overhead_s=-1))


@settings(max_examples=30, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2, 4]),
       zero=st.sampled_from([0, 1, 3]), mode=st.sampled_from(["async", "in_memory"]))
def test_copying_only_the_written_share_never_costs_goodput(
        tp: int, pp: int, zero: int, mode: str) -> None:
    """Over layouts of Llama 3 8B on 64 H100s: a fully parallel save copies no more than a
    state-dict one, a restart loads the same, and no policy's goodput falls."""
    base = {"model": "llama3-8b", "system": "dgx-h100", "gpus": 64, "global_batch_size": 256,
            "tokens": 1e11, "failures": {"preset": "llama3-16k-h100"},
            "strategies": [{"tp": tp, "pp": pp, "micro_batch_size": 1, "zero_stage": zero}]}
    rows = {}
    for staging in ("state_dict", "fully_parallel"):
        study = study_from_dict({**base, "checkpoint": {"mode": mode, "staging": staging}})
        rows[staging] = {r["policy"]: r for r in
                         resilience_frame(study, study.strategies[0]).iter_rows(named=True)}
    for policy, held in rows["state_dict"].items():
        written = rows["fully_parallel"][policy]
        assert written["staged_GiB"] <= held["staged_GiB"]
        assert written["checkpoint_s"] <= held["checkpoint_s"]
        assert written["restart_s"] == pytest.approx(held["restart_s"])
        assert written["goodput"] >= held["goodput"] - 1e-12


def test_a_restart_reads_at_the_read_rate_where_one_is_given() -> None:
    """[checkpoint] storage_read_GBps: the policies that load from storage restart faster by
    exactly the checkpoint over the difference of the rates; what a save blocks and when it
    persists stay the write rate's; the in-memory policy's peer load is untouched."""
    rows = {}
    for read in (None, 150.0):
        ck = {"mode": "async", "storage_GBps": 40.0}
        if read is not None:
            ck["storage_read_GBps"] = read
        study = study_from_dict(_study(**ck))
        rows[read] = {r["policy"]: r for r in
                      resilience_frame(study, study.strategies[0]).iter_rows(named=True)}
    size = R.checkpoint_bytes(resolve_model("llama3.1-405b").num_params())
    saved = size / 40e9 - size / 150e9
    for policy in ("global_restart", "hot_spares"):
        slow, fast = rows[None][policy], rows[150.0][policy]
        assert slow["restart_s"] - fast["restart_s"] == pytest.approx(saved)
        assert fast["persist_s"] == slow["persist_s"] == pytest.approx(size / 40e9)
        assert fast["checkpoint_s"] == slow["checkpoint_s"]
        assert fast["goodput"] > slow["goodput"]
    assert rows[150.0]["in_memory"]["restart_s"] == rows[None]["in_memory"]["restart_s"]
    with pytest.raises(R.ConfigError, match=r"storage_read_GBps must be a positive number"):
        study_from_dict(_study(storage_read_GBps=0))
