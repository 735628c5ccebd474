"""Several distributed-optimizer instances (Megatron-Core --num-distributed-optimizer-instances):
the groups, the collectives a gradient bucket becomes, the memory they save, the fast path
against replay, and the clear refusals."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.fastpath import estimate
from replay import get_system, replay
from tests.conftest import read_et
from tracegen import ConfigError, ModelSpec, Strategy, generate
from tracegen import ops as O
from tracegen.fit import check_fits_model
from tracegen.memory import OPTIM_BYTES
from tracegen.memory import estimate as memory_estimate
from tracegen.mesh import Mesh
from tracegen.program import RoleProgram

MODEL = ModelSpec(name="doi", num_layers=8, hidden_size=256, num_attention_heads=8,
                  num_kv_heads=4, ffn_hidden_size=512, vocab_size=1024, seq_len=256,
                  activation="swiglu")
MOE = dataclasses.replace(MODEL, name="doimoe", num_experts=4, experts_per_token=2,
                          moe_ffn_hidden_size=256)


def _strategy(**kw: object) -> Strategy:
    base: dict[str, object] = dict(tp=1, pp=1, dp=8, zero_stage=1, global_batch_size=16,
                                   dist_opt_instances=2, dp_bucket_params=200_000)
    return Strategy(**{**base, **kw})  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(tp=st.sampled_from([1, 2]), cp=st.sampled_from([1, 2]), dp=st.sampled_from([2, 4, 8]),
       pp=st.sampled_from([1, 2]), r=st.sampled_from([2, 4, 8, 16]))
def test_instances_split_each_data_parallel_group_into_a_grid(tp, cp, dp, pp, r) -> None:
    """An instance ("dps") is dp·cp / R consecutive members of a "dp" group, the cross group
    ("dpr") one member of each instance at the same position: every dp group is their grid,
    each rank in exactly one of each, the two meeting only in it."""
    if (dp * cp) % r or r == dp * cp:
        return
    s = Strategy(tp=tp, cp=cp, dp=dp, pp=pp, zero_stage=1, dist_opt_instances=r,
                 global_batch_size=dp)
    mesh = Mesh(s)
    dp_groups = [g.ranks for g in mesh.groups.values() if g.axis == "dp"]
    for axis, size in (("dps", dp * cp // r), ("dpr", r)):
        groups = [g.ranks for g in mesh.groups.values() if g.axis == axis]
        assert all(len(g) == size == mesh.group_size(axis) for g in groups)
        assert sorted(x for g in groups for x in g) == list(range(s.world_size))
    for group in dp_groups:
        shard = dp * cp // r
        for i, rank in enumerate(group):
            c = mesh.coord(rank)
            inst = set(mesh._members("dps", c))
            cross = set(mesh._members("dpr", c))
            assert inst == set(group[i - i % shard: i - i % shard + shard])
            assert cross == set(group[i % shard::shard])
            assert inst & cross == {rank}


def _colls(tmp: Path, s: Strategy) -> dict[str, list[tuple[int, int, list[int], list[int]]]]:
    """Rank 0's data-parallel collectives by name: (node id, bytes, data deps, ctrl deps)."""
    generate(MODEL, s, tmp, mode="representative", name="t")
    _, nodes = read_et(tmp / "t.0.et")
    out: dict[str, list[tuple[int, int, list[int], list[int]]]] = defaultdict(list)
    for n in nodes:
        for key in ("grad_reduce_scatter", "grad_instance_all_reduce", "param_all_gather"):
            if n.name.endswith(key):
                size = next(a.int64_val for a in n.attr if a.name == "comm_size")
                out[key].append((n.id, size, list(n.data_deps), list(n.ctrl_deps)))
    return out


@pytest.mark.parametrize("r", [2, 4])
def test_a_bucket_is_scattered_in_its_instance_then_all_reduced_across(tmp_path: Path,
                                                                       r: int) -> None:
    """Each bucket: a reduce-scatter of the bucket over the instance, then an all-reduce of
    its 1/(dp/R) shard across the R instances, on one stream (the next reduce-scatter after
    the previous all-reduce); the updated parameters are gathered inside the instance. The
    bytes reduce-scattered are those of one instance (the R = 1 run's buckets, padded to the
    instance size)."""
    one = _colls(tmp_path / "one", _strategy(dist_opt_instances=1))
    got = _colls(tmp_path / "r", _strategy(dist_opt_instances=r))
    shard = 8 // r
    rs, ar, ag = got["grad_reduce_scatter"], got["grad_instance_all_reduce"], got["param_all_gather"]
    assert len(rs) == len(ar) == len(ag) == len(one["grad_reduce_scatter"]) >= 2
    assert "grad_instance_all_reduce" not in one
    grad_bytes = O.grad_reduce_bytes(_strategy())
    for (rs_id, rs_b, _, _), (_, ar_b, ar_deps, _), (_, ag_b, _, _), (_, b1, _, _) in zip(
            rs, ar, ag, one["grad_reduce_scatter"], strict=True):
        params = b1 // grad_bytes  # padded to 8 ranks: a multiple of the instance too
        assert rs_b == params * grad_bytes
        assert ar_b == rs_b // shard and ar_deps == [rs_id]
        assert ag_b == params // shard * O.param_gather_bytes(_strategy())
    for (_, _, _, ctrl), (prev_ar, _, _, _) in zip(rs[1:], ar, strict=False):
        assert prev_ar in ctrl


def test_optimizer_state_shards_over_one_instance() -> None:
    """Optimizer bytes: params · 12 / (dp·cp / R) (Megatron's distributed optimizer over an
    instance); R = dp·cp holds it whole, as ZeRO 0 does; ZeRO-2's gradients shard the same."""
    params = RoleProgram(MODEL, _strategy(), 0).stage_params()["dp"]
    for r in (1, 2, 4, 8):
        for zero in (1, 2):
            s = _strategy(dist_opt_instances=r, zero_stage=zero)
            mem = memory_estimate(MODEL, s, 0, params)
            assert mem.optimizer_bytes == -(-params * OPTIM_BYTES // (8 // r))
            whole = mem.gradients_bytes * (8 // r if zero == 2 else 1)
            assert whole == pytest.approx(params * O.grad_reduce_bytes(s), abs=8)
    zero0 = memory_estimate(MODEL, _strategy(dist_opt_instances=1, zero_stage=0), 0, params)
    whole = memory_estimate(MODEL, _strategy(dist_opt_instances=8), 0, params)
    assert whole.optimizer_bytes == zero0.optimizer_bytes


def _replayed_s(model: ModelSpec, s: Strategy, hw) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        generate(model, s, tmp, mode="representative")
        return replay(tmp, hw, contention=False).step_time_s


@pytest.mark.parametrize(("gpn", "pp", "dp", "cp", "r", "dp_overlap", "schedule", "zero"), [
    (8, 1, 8, 1, 2, "grad", "1f1b", 1),
    (2, 2, 4, 2, 4, "both", "interleaved_1f1b", 2),
    (8, 2, 8, 1, 8, "none", "1f1b", 1),
    (2, 2, 8, 1, 4, "grad", "1f1b", 2),
    (8, 2, 4, 2, 2, "both", "1f1b", 1),
])
def test_fast_path_agrees_with_replay(gpn, pp, dp, cp, r, dp_overlap, schedule, zero) -> None:
    """The fast path drains a bucket's two collectives as one transfer on the stream, which
    is what replay's two streams do when each waits for the other (0.11% apart at worst over
    288 such strategies when this was built; the 2% property draws them too)."""
    hw = get_system("dgx-h100")
    hw = dataclasses.replace(hw, node=dataclasses.replace(hw.node, gpus_per_node=gpn))
    s = _strategy(pp=pp, dp=dp, cp=cp, dist_opt_instances=r, zero_stage=zero,
                  global_batch_size=dp * 4 * pp, schedule=schedule,
                  vpp=2 if schedule != "1f1b" else 1,
                  overlap_grad_reduce=dp_overlap != "none",
                  overlap_param_gather=dp_overlap == "both")
    assert estimate(MODEL, s, hw).step_time_s == pytest.approx(_replayed_s(MODEL, s, hw),
                                                               rel=0.005)


def test_instances_change_the_step_where_the_reduction_is_exposed() -> None:
    """Without overlap the buckets are all exposed: the step differs from one instance's by
    exactly what the two-level reduction costs more or less (the network's own collective
    costs), so the field reaches the timing."""
    hw = get_system("dgx-h100")
    plain = _strategy(dist_opt_instances=1, overlap_grad_reduce=False)
    base = estimate(MODEL, plain, hw).step_time_s
    for r in (2, 8):
        s = _strategy(dist_opt_instances=r, overlap_grad_reduce=False)
        assert estimate(MODEL, s, hw).step_time_s != pytest.approx(base, rel=1e-6)
        assert estimate(MODEL, s, hw).step_time_s == pytest.approx(_replayed_s(MODEL, s, hw),
                                                                   rel=0.005)


@pytest.mark.parametrize(("kw", "words"), [
    ({"zero_stage": 0}, "needs zero_stage 1 or 2"),
    ({"dist_opt_instances": 3}, "choose among [2, 4, 8]"),
    ({"dist_opt_instances": 0}, "must be ≥ 1"),
    ({"dp": 1, "global_batch_size": 2}, "one instance: use dist_opt_instances 1"),
])
def test_impossible_instances_are_refused_with_the_fix(kw: dict[str, object], words: str
                                                       ) -> None:
    with pytest.raises(ConfigError, match="dist_opt_instances") as err:
        _strategy(**kw)
    assert words in str(err.value)


def test_a_mixture_of_experts_model_takes_instances_and_hsdp_but_not_hfsdp() -> None:
    """Megatron-Core splits the expert-data-parallel group into instances as the dense one
    (asserting it divisible); ZeRO-3 with instances (HSDP) too; sharding the experts'
    optimizer across the instances (HFSDP) is not modelled."""
    check_fits_model(_strategy(), MOE)
    check_fits_model(_strategy(), MODEL)
    check_fits_model(_strategy(zero_stage=3), MOE)
    with pytest.raises(ConfigError, match=r"HFSDP.*mixture-of-experts model"):
        check_fits_model(_strategy(zero_stage=3, outer_dp_sharding_strategy="optim"), MOE)
    with pytest.raises(ConfigError, match="expert-data-parallel group's 2 ranks too"):
        check_fits_model(_strategy(ep=4, dist_opt_instances=4), MOE)


def test_cli_estimate_takes_instances_and_refuses_bad_ones() -> None:
    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "analysis.cli", "estimate", "--model", "llama3-8b",
             "--mbs", "1", "--system", "dgx-h100", *extra],
            capture_output=True, text=True, timeout=120, env={"COLUMNS": "200",
                                                              "PATH": "/usr/bin"})
    ok = run("--gpus", "64", "--gbs", "256", "--zero", "1", "--dist-opt-instances", "8")
    assert ok.returncode == 0, ok.stderr
    assert "8 optimizer instances of 8 ranks" in ok.stdout and "-doi8" in ok.stdout
    big = run("--zero", "1", "--gpus", "8192", "--gbs", "8192", "--recompute", "full")
    assert big.returncode == 0, big.stderr
    assert "distributed-optimizer instances (--dist-opt-instances 256)" in big.stdout
    bad = run("--gpus", "64", "--gbs", "256", "--zero", "1", "--dist-opt-instances", "5")
    assert bad.returncode != 0 and "Traceback" not in bad.stdout + bad.stderr
    assert "must divide the data-parallel group" in bad.stdout + bad.stderr


def test_estimate_suggests_the_fastest_instances_that_fit() -> None:
    """At 8,192-way data parallelism each bucket's reduce-scatter is a ring of 8,191 latency
    steps: the fastest fitting divisor of dp·cp is ≥ 2% shorter than one instance's, and the
    hint is the one needing least memory among those within 1% of it (every one checked here
    against the fast path); at dp 32 on 1,024 GPUs none gains 2% and nothing is suggested,
    nor for ZeRO 0 or a MoE model under ZeRO-3 (its HSDP is not modelled)."""
    from analysis.glance import INSTANCES_GAIN, INSTANCES_NEAR, glance, instances_hint
    from tracegen import get_model

    model, hw = get_model("llama3-8b"), get_system("dgx-h100")
    s = Strategy(dp=8192, zero_stage=1, global_batch_size=8192, recompute="full")
    g = glance(model, s, hw)
    hint = g.instances_hint
    assert hint is not None and 8192 % hint["dist_opt_instances"] == 0
    steps = {r: estimate(model, dataclasses.replace(s, dist_opt_instances=r), hw)
             for r in (2**k for k in range(1, 14))}
    fitting = {r: e.step_time_s for r, e in steps.items() if e.fits}
    near = {r for r, t in fitting.items() if t <= min(fitting.values()) * (1 + INSTANCES_NEAR)}
    assert hint["dist_opt_instances"] in near and fitting[hint["dist_opt_instances"]] == hint[
        "step_time_s"]
    assert hint["peak_memory_GiB"] == min(steps[r].peak_memory_GiB for r in near)
    assert hint["dist_opt_instances"] != max(near)  # (the fastest is not the leanest here)
    assert min(fitting.values()) < g.step_time_s * (1 - INSTANCES_GAIN)
    dense = get_model("llama3-70b")
    mid = Strategy(tp=8, pp=4, dp=32, sequence_parallel=True, zero_stage=1,
                   global_batch_size=512)
    assert glance(dense, mid, hw).instances_hint is None
    # (however long the step: instances need ZeRO ≥ 1, and no HFSDP for a MoE model)
    assert instances_hint(model, dataclasses.replace(s, zero_stage=0), hw, 1e9) is None
    mixtral = get_model("mixtral-8x7b")
    moe = Strategy(tp=2, dp=512, ep=8, zero_stage=3, global_batch_size=512,
                   sequence_parallel=True, recompute="full")
    assert instances_hint(mixtral, moe, hw, 1e9) is not None  # (HSDP of experts)
    assert instances_hint(mixtral, dataclasses.replace(
        moe, dist_opt_instances=2, outer_dp_sharding_strategy="optim"), hw, 1e9) is None
    moe1 = dataclasses.replace(moe, zero_stage=1)  # Mixtral on 1,024 H100s: 32 instances
    got = glance(mixtral, moe1, hw).instances_hint  # (edp = 512 / 8 = 64 expert ranks)
    assert got is not None and 64 % got["dist_opt_instances"] == 0
    assert got["step_time_s"] < estimate(mixtral, moe1, hw).step_time_s * (1 - INSTANCES_GAIN)
    assert instances_hint(model, dataclasses.replace(s, dp=64, global_batch_size=64), hw,
                          1e9) is not None
