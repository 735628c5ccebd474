"""MoE parallel folding (``Strategy.expert_tp`` 1; Liu et al. 2025, Megatron-Core): expert
parallelism spans a stage's tp·cp·dp ranks, experts are whole on each rank."""

from __future__ import annotations

import csv
import dataclasses
import tempfile
from pathlib import Path

import pytest

from analysis.fastpath import estimate
from analysis.validate import RunInputs, load_runs, row_inputs
from replay import get_system, replay
from tracegen import ConfigError, ModelSpec, Strategy, generate
from tracegen import ops as O
from tracegen.dp_comm import dp_group_size
from tracegen.mesh import Mesh
from tracegen.program import RoleProgram

MOE = ModelSpec(name="fold", num_layers=8, hidden_size=512, num_attention_heads=8,
                num_kv_heads=4, ffn_hidden_size=1024, vocab_size=2048, seq_len=512,
                activation="swiglu", num_experts=16, experts_per_token=4, moe_ffn_hidden_size=256)
FOLDED = Strategy(tp=2, pp=2, dp=4, ep=8, expert_tp=1, sequence_parallel=True,
                  micro_batch_size=1, global_batch_size=16)


def test_expert_groups_are_consecutive_ranks_of_a_stage() -> None:
    """ep 8 over a stage's 2·4 = 8 ranks: one EP group per stage, ranks in order; the
    expert-data-parallel group has one member (every 8th rank of the stage)."""
    mesh = Mesh(FOLDED, moe=True)
    ep = sorted(g.ranks for g in mesh.groups.values() if g.axis == "ep")
    assert ep == [tuple(range(0, 8)), tuple(range(8, 16))]
    assert not [g for g in mesh.groups.values() if g.axis == "edp"]
    assert mesh.group_size("edp") == dp_group_size(FOLDED, "edp") == 1
    half = dataclasses.replace(FOLDED, ep=4)
    mesh = Mesh(half, moe=True)
    groups = {g.axis: [] for g in mesh.groups.values()}
    for g in mesh.groups.values():
        groups[g.axis].append(g.ranks)
    assert sorted(groups["ep"]) == [tuple(range(b, b + 4)) for b in (0, 4, 8, 12)]
    assert sorted(groups["edp"]) == [(b, b + 4) for b in (0, 1, 2, 3, 8, 9, 10, 11)]
    assert mesh.group_size("edp") == dp_group_size(half, "edp") == 2


def _ops(s: Strategy) -> list[O.Item]:
    return O.layer_fwd(MOE, s)


def test_a_folded_layer_routes_its_own_tokens_to_whole_experts() -> None:
    """Against Megatron's default (experts TP-split, every TP rank routing all tokens): no TP
    collectives around the experts, the same expert FLOPs per rank (tokens/tp · k routed tokens
    through whole experts instead of all tokens · k through 1/tp of each), and dispatch /
    combine carry tokens/tp · k rows of h."""
    split = dataclasses.replace(FOLDED, ep=2, expert_tp=0)
    folded, default = _ops(FOLDED), _ops(split)
    names = [it.name for it in folded]
    assert "ln2_ag" not in names and "fc2_rs" not in names
    assert "ln2_ag" in [it.name for it in default]

    def expert_flop(items: list[O.Item]) -> int:
        return sum(it.flop for it in items if isinstance(it, O.Op)
                   and it.name.startswith("expert_"))

    assert expert_flop(folded) == expert_flop(default)
    tokens = FOLDED.micro_batch_size * MOE.seq_len // FOLDED.tp
    a2a = [it for it in folded if isinstance(it, O.Comm) and it.coll == "ALL_TO_ALL"]
    assert [c.size_bytes for c in a2a] == [tokens * 4 * 512 * 2] * 2
    assert {c.axis for c in a2a} == {"ep"}


def test_experts_are_whole_on_each_rank() -> None:
    """Per rank: E/ep whole experts (3·h·f each for a gated MLP) folded, E/ep of them split
    over tp otherwise."""
    block = RoleProgram(MOE, FOLDED, 0).layer_block()
    assert block.expert == 16 // 8 * 3 * 512 * 256
    split = RoleProgram(MOE, dataclasses.replace(FOLDED, ep=2, expert_tp=0), 0).layer_block()
    assert split.expert == 16 // 2 * 3 * 512 * 256 // 2


@pytest.mark.parametrize("zero", [0, 1, 3])
@pytest.mark.parametrize("ep", [4, 8])
def test_fast_path_matches_replay(zero: int, ep: int) -> None:
    s = dataclasses.replace(FOLDED, ep=ep, zero_stage=zero)
    system = get_system("dgx-h100")
    fast = estimate(MOE, s, system)
    with tempfile.TemporaryDirectory() as tmp:
        generate(MOE, s, tmp, mode="representative")
        ref = replay(tmp, system, contention=False)
    assert fast.step_time_s == pytest.approx(ref.step_time_s, rel=0.02)


@pytest.mark.parametrize(("kw", "message"), [
    ({"ep": 16}, r"ep 16 must divide tp·cp·dp = 8"),
    ({"sequence_parallel": False}, "expert_tp 1 with tp > 1 needs sequence_parallel"),
    ({"expert_tp": 3}, "expert_tp 3: 0 .* or 1"),
    ({"expert_tp": 0}, "or fold it over tp·cp·dp with expert_tp = 1"),
])
def test_impossible_folds_say_what_is_wrong(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(FOLDED, **kw)


def test_a_fold_without_tp_or_cp_is_the_ordinary_layout() -> None:
    """At tp = cp = 1 the EP groups are consecutive data-parallel ranks either way."""
    s = Strategy(dp=8, ep=4, expert_tp=1, global_batch_size=8)
    assert not s.moe_folded and s.etp == 1
    plain = dataclasses.replace(s, expert_tp=0)
    assert Mesh(s, moe=True).groups == Mesh(plain, moe=True).groups


# One MoE run in the public-runs schema (the layout of ``FOLDED`` on a 16-GPU H100 system).
ROW = dict(id="q", arch="moe", num_layers=8, hidden_size=512, num_attention_heads=8,
           num_kv_heads=4, ffn_hidden_size=1024, vocab_size=2048, seq_len=512,
           activation="swiglu", num_experts=16, experts_per_token=4, moe_ffn_hidden_size=256,
           global_batch_size=16, micro_batch_size=1, num_gpus=16, tp=2, pp=2, dp=4, cp=1, ep=8,
           sequence_parallel="true", virtual_pp=1, recompute="none", zero_stage=1,
           precision="bf16", gpu="h100-sxm", gpus_per_node=8, scaleout_gbps_per_gpu=400,
           measured_iter_time_s=1.0)


def _row_inputs(tmp_path: Path, **cells: object) -> RunInputs | str:
    """``ROW`` with ``cells`` replaced (or added), written as a runs file and read as validate
    reads it."""
    path = tmp_path / "runs.csv"
    row = {**ROW, **cells}
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(row))
        w.writeheader()
        w.writerow(row)
    return row_inputs(load_runs(path).row(0, named=True))


def test_validate_folds_an_ep_that_dp_cannot_hold(tmp_path: Path) -> None:
    """A MoE row with ep ∤ dp but ep | tp·cp·dp ran Megatron-Core's parallel folding (no other
    layout runs it): validate sets expert_tp 1 and says so; an ep that not even tp·cp·dp holds
    is skipped naming both ways."""
    got = _row_inputs(tmp_path, ep=8)
    assert isinstance(got, RunInputs) and got.strategy.moe_folded
    assert "expert_tp = 1 implied (ep 8 does not divide dp 4" in got.assumptions
    got = _row_inputs(tmp_path, ep=16)
    assert isinstance(got, str) and "ep 16 must divide dp 4" in got


def test_columns_beyond_the_schema_are_read_when_present(tmp_path: Path) -> None:
    """A runs file may say what the schema cannot: ``head_dim`` (heads wider than hidden /
    heads) and ``expert_tp`` (an explicit 0 keeps Megatron's default layout, so an ep that dp
    cannot hold is then refused rather than folded)."""
    got = _row_inputs(tmp_path, head_dim=128, expert_tp=1)
    assert isinstance(got, RunInputs)
    assert got.model.head_dim == 128 and got.model.q_size == 1024 and got.strategy.moe_folded
    assert "implied" not in got.assumptions  # stated by the file, not inferred
    default = _row_inputs(tmp_path, head_dim="", expert_tp=0)
    assert isinstance(default, str) and "ep 8 must divide dp 4" in default
    plain = _row_inputs(tmp_path, head_dim="", expert_tp="")
    assert isinstance(plain, RunInputs) and plain.model.head_dim == 64


@pytest.mark.parametrize(("zero", "state_bytes"), [(1, 12), (3, 4 + 8)])
def test_expert_state_shards_over_the_expert_data_parallel_group(zero: int,
                                                                 state_bytes: int) -> None:
    """Megatron's distributed optimizer (and FSDP) shard each parameter's state over the ranks
    that reduce its gradient: dense ones over dp·cp, experts over the expert-data-parallel group
    — 1 rank when ep 8 folds over a stage's 8 ranks, so the experts' state is not divided at
    all. With 2-byte weights at ZeRO 1 and FSDP's fp32 copy + Adam at ZeRO 3."""
    from tracegen.memory import estimate as memory_estimate

    s = dataclasses.replace(FOLDED, zero_stage=zero)
    held = RoleProgram(MOE, s, 0).stage_params()
    dense, expert = held["dp"], held["edp"]
    got = memory_estimate(MOE, s, 0, dense + expert, expert_params=expert)
    assert dp_group_size(s, "edp") == 1 and dp_group_size(s, "dp") == 4
    state = got.optimizer_bytes + (got.weights_bytes if zero == 3 else 0)
    assert state == -(-dense * state_bytes // 4) + expert * state_bytes
    lumped = memory_estimate(MOE, s, 0, dense + expert)  # as if experts sharded over dp
    assert got.total_bytes > lumped.total_bytes


def test_moe_layers_keep_their_dispatched_tokens() -> None:
    """A MoE layer stores top-k dispatched copies of its input for the experts' first weight
    gradient: k·h·2 bytes per token on every TP rank, or per sequence-parallel share (/tp)
    when folded."""
    from tracegen.memory import activation_bytes_per_layer

    dense = dataclasses.replace(MOE, name="d", num_experts=0, experts_per_token=0,
                                moe_ffn_hidden_size=0, ffn_hidden_size=256 * 4)
    tokens, k, h = MOE.seq_len, MOE.experts_per_token, MOE.hidden_size
    folded = activation_bytes_per_layer(MOE, FOLDED)
    split = activation_bytes_per_layer(MOE, dataclasses.replace(FOLDED, ep=2, expert_tp=0))
    assert split - folded == tokens * k * h * 2 - tokens * k * h * 2 // 2
    # against a dense layer with the same routed MLP width (moe_ffn · k): just the copies
    same = activation_bytes_per_layer(dense, dataclasses.replace(FOLDED, ep=1, expert_tp=0))
    assert split - same == tokens * k * h * 2
