"""Distributed-optimizer instances on a mixture-of-experts model (Megatron-Core's intra- and
inter-partial expert data-parallel groups): the expert groups, the collectives an expert
bucket becomes, the one stream every bucket group shares, the memory, and the fast path
against replay; under ZeRO-3 (HSDP) the expert shard's all-reduce across instances."""

from __future__ import annotations

import dataclasses
import itertools
import tempfile
from pathlib import Path

import pytest

from analysis.fastpath import estimate
from replay import get_system, replay
from tracegen import ModelSpec, Strategy, generate
from tracegen.memory import estimate as memory_estimate
from tracegen.mesh import Mesh

H100 = get_system("dgx-h100")
MOE = ModelSpec(name="moei", num_layers=8, hidden_size=2048, num_attention_heads=16,
                ffn_hidden_size=8192, vocab_size=32000, seq_len=2048, activation="swiglu",
                num_experts=8, experts_per_token=2, moe_ffn_hidden_size=2048, dropout=0.0)


def test_the_expert_groups_split_as_the_dense_ones() -> None:
    """dp 16, ep 4: the expert-data-parallel group of a rank (every 4th data-parallel rank,
    4 of them) splits into 2 instances of 2 consecutive members ("edps") and the pairs at one
    position in each ("edpr"); the dense group into 2 of 8 ("dps") and pairs ("dpr")."""
    s = Strategy(dp=16, ep=4, zero_stage=1, dist_opt_instances=2, global_batch_size=16)
    mesh = Mesh(s, moe=True)
    c = mesh.coord(5)
    edp = mesh._members("edp", c)
    assert edp == (1, 5, 9, 13)
    assert mesh._members("edps", c) == (1, 5) and mesh._members("edpr", c) == (5, 13)
    assert mesh._members("dps", c) == tuple(range(8))
    assert mesh._members("dpr", c) == (5, 13)
    assert (mesh.group_size("edps"), mesh.group_size("edpr")) == (2, 2)


def test_expert_buckets_scatter_in_their_instance_and_share_the_dense_ones_stream(
        tmp_path: Path) -> None:
    """Every bucket, dense or expert, is a reduce-scatter in its instance then an all-reduce
    across instances (none inside an instance of one rank), each bucket's first collective
    after the previous bucket's last: one communication stream (Megatron-Core
    ``start_grad_sync``)."""
    import json

    s = Strategy(dp=16, ep=4, zero_stage=1, dist_opt_instances=2, global_batch_size=32,
                 micro_batch_size=1, overlap_grad_reduce=True)
    generate(MOE, s, tmp_path, mode="representative")
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    axes = {g["axis"] for g in manifest["groups"].values()} if isinstance(
        manifest["groups"], dict) else {g["axis"] for g in manifest["groups"]}
    assert {"dps", "dpr", "edps", "edpr"} <= axes
    res = replay(tmp_path, H100, contention=False)
    import polars as pl

    tl = res.timeline.filter(pl.col("rank") == 0).filter(
        pl.col("name").str.contains("grad_reduce_scatter|grad_instance_all_reduce")).sort(
        "start_s")
    starts, ends = tl["start_s"].to_list(), tl["end_s"].to_list()
    assert len(starts) >= 4 and all(b >= a - 1e-12 for a, b in zip(ends[:-1], starts[1:], strict=True))


@pytest.mark.parametrize("kw", [
    dict(tp=1, pp=1, dp=16, ep=4, dist_opt_instances=2),
    dict(tp=2, pp=2, dp=8, ep=2, dist_opt_instances=2, sequence_parallel=True),
    dict(tp=2, pp=2, dp=8, ep=4, expert_tp=1, zero_stage=2, dist_opt_instances=4,
         sequence_parallel=True),
    dict(tp=1, pp=4, dp=8, ep=2, vpp=2, schedule="interleaved_1f1b", dist_opt_instances=2),
    dict(tp=1, pp=2, dp=16, ep=8, dist_opt_instances=2, overlap_param_gather=True),
    dict(tp=1, pp=2, dp=16, ep=4, dist_opt_instances=4, grad_reduce_per_microbatch=True),
], ids=["pp1", "tp2-pp2", "folded-zero2", "interleaved", "param-gather", "per-microbatch"])
def test_the_fast_path_is_replays(kw: dict) -> None:
    """Against contention-free replay of the representative traces: within 0.2% (found within
    0.03%), expert instances of one rank (the all-reduce alone) among them."""
    s = Strategy(micro_batch_size=1, global_batch_size=kw["dp"] * 4,
                 **{"zero_stage": 1, "overlap_grad_reduce": True, **kw})
    with tempfile.TemporaryDirectory() as tmp:
        generate(MOE, s, tmp, mode="representative")
        ref = replay(tmp, H100, contention=False).step_time_s
    assert estimate(MOE, s, H100).step_time_s == pytest.approx(ref, rel=0.002)


def test_the_expert_optimizer_state_is_sharded_over_an_instance() -> None:
    """ZeRO-1: with 2 instances each group's optimizer state is split over half as many ranks
    (dense over dp / 2, experts over edp / 2): twice the bytes, the expert part alone too; 4
    instances of a 4-rank expert group leave its state unsharded, as ZeRO 0 keeps it."""
    s1 = Strategy(dp=16, ep=4, zero_stage=1, global_batch_size=16)
    dense, expert = 160_000_000, 40_000_000
    one, two, four = (memory_estimate(MOE, dataclasses.replace(s1, dist_opt_instances=r), 0,
                                      dense + expert, expert_params=expert).optimizer_bytes
                      for r in (1, 2, 4))
    assert two == 2 * one
    only = [memory_estimate(MOE, dataclasses.replace(s1, dist_opt_instances=r), 0, expert,
                            expert_params=expert).optimizer_bytes for r in (1, 2, 4)]
    assert only[1] == 2 * only[0] and only[2] == 4 * only[0]
    zero0 = memory_estimate(MOE, dataclasses.replace(s1, zero_stage=0), 0, expert,
                            expert_params=expert).optimizer_bytes
    assert only[2] == zero0 and four > two


HSDP = [  # (strategy, tolerance against replay)
    (dict(tp=2, pp=2, dp=8, ep=4, dist_opt_instances=2), 0.002),
    (dict(tp=2, pp=2, dp=8, ep=4, dist_opt_instances=2, zero3_prefetch=True), 0.002),
    (dict(tp=1, pp=1, dp=16, ep=8, dist_opt_instances=2, zero3_prefetch=True), 0.002),
    # interleaved: −0.9%, as the dense model's HSDP on the same layout (−1.1%): the fast
    # path's cross-instance lane over two chunks a stage, not the experts
    (dict(tp=2, pp=4, dp=8, ep=2, dist_opt_instances=4, vpp=2, schedule="interleaved_1f1b"),
     0.015),
    (dict(tp=1, pp=2, dp=16, ep=4, dist_opt_instances=4, zero3_gather_bucket_params=5_000_000),
     0.002),
]


@pytest.mark.parametrize(("kw", "rel"), HSDP, ids=["tp2-pp2", "prefetch", "pp1-ep8",
                                                   "interleaved", "pieces"])
def test_hsdp_of_experts_the_fast_path_is_replays(kw: dict, rel: float) -> None:
    """ZeRO-3 with optimizer instances (HSDP) on a MoE model: gathers and scatters of each
    group inside its instance, the expert shard all-reduced across instances after the dense
    one on one stream; against contention-free replay."""
    s = Strategy(micro_batch_size=1, global_batch_size=kw["dp"] * 4, zero_stage=3, **kw)
    with tempfile.TemporaryDirectory() as tmp:
        generate(MOE, s, tmp, mode="representative")
        ref = replay(tmp, H100, contention=False).step_time_s
    assert estimate(MOE, s, H100).step_time_s == pytest.approx(ref, rel=rel)


def test_hsdp_all_reduces_each_expert_shard_across_the_instances_on_the_dense_stream() -> None:
    """dp 8, ep 4, 2 instances: an expert block's gradients reduce-scatter over its instance
    ("edps", edp / 2 = 1 rank: nothing to scatter) and its shard, all of it, is all-reduced
    across the instances ("edpr"), chained after the dense shard's all-reduce: one stream
    (Megatron-FSDP's ``outer_fsdp_group_grad_reduce_stream``)."""
    from tracegen.program import RoleProgram

    s = Strategy(dp=8, ep=4, zero_stage=3, dist_opt_instances=2, global_batch_size=8)
    prog = RoleProgram(MOE, s, 0)
    prog.build()
    outer = [n for n in prog.nodes if n.name.endswith("grad_ar")]
    expert = [n for n in outer if "expert" in n.name]
    block = prog.layer_block()
    assert len(expert) == MOE.num_layers and {n.axis for n in expert} == {"edpr"}
    assert {n.comm_bytes for n in expert} == {block.expert * 4}  # fp32 gradients
    ids = [n.id for n in outer]
    assert all(prev in prog.nodes[i].ctrl_deps or prev in prog.nodes[i].data_deps
               for prev, i in itertools.pairwise(ids))


def test_hfsdp_of_experts_is_refused() -> None:
    from tracegen import ConfigError

    s = Strategy(dp=8, ep=4, zero_stage=3, dist_opt_instances=2, global_batch_size=8,
                 outer_dp_sharding_strategy="optim")
    with pytest.raises(ConfigError, match=r"outer_dp_sharding_strategy 'optim' .* mixture-of-"
                                          r"experts model: .* use outer_dp_sharding_strategy "
                                          r"'no_shard'"):
        estimate(MOE, s, H100)
