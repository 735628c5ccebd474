"""ZeRO-3 with the optimizer also sharded across the instances: HFSDP (Megatron-FSDP's
``outer_dp_sharding_strategy optim``). Weights and gradients stay sharded inside an instance of
dp·cp / R ranks; the fp32 master weights and Adam's moments are sharded over all dp·cp. On the
last micro-batch each block's shard is reduce-scattered across the R instances (not all-reduced),
the optimizer updates 1/R of it, and the updated pieces are all-gathered back across the
instances in the next step's first forward, each block's before its gather in the instance. The written traces, the memory, the fast path against replay, the
refusals."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from analysis.fastpath import estimate
from analysis.fastpath_costs import Costs
from replay import get_system
from tests.conftest import read_et
from tests.test_hsdp import LAYOUT_FIELDS, LAYOUTS, MODEL, _replayed_s, _strategy
from tracegen import ConfigError, Strategy, generate, get_model
from tracegen import ops as O
from tracegen.dp_comm import outer_gather_comm, outer_shard, sharded_params
from tracegen.memory import OPTIM_BYTES, WEIGHT_BYTES
from tracegen.memory import estimate as memory_estimate
from tracegen.mesh import Mesh
from tracegen.program import RoleProgram
from tracegen.vocab import COLL_CODE

CODES = {code: name for name, code in COLL_CODE.items()}


def _hfsdp(**kw: object) -> Strategy:
    return _strategy(outer_dp_sharding_strategy="optim", **kw)


def _colls(tmp: Path, s: Strategy) -> tuple[list[tuple[str, int, str, list[int], list[int]]],
                                             dict[str, int]]:
    """Rank 0's collectives in trace order, (name, bytes, collective, group's ranks, data
    deps), and each node's id by name."""
    generate(MODEL, s, tmp, mode="full", name="t")
    groups = json.loads((tmp / "comm_groups.json").read_text())
    _, nodes = read_et(tmp / "t.0.et")
    out = []
    for n in nodes:
        attrs = {a.name: a for a in n.attr}
        if "pg_name" in attrs:
            kind = CODES[attrs["comm_type"].int64_val]
            out.append((n.name, attrs["comm_size"].int64_val, kind,
                        sorted(groups[attrs["pg_name"].string_val]), list(n.data_deps)))
    return out, {n.name: n.id for n in nodes}


@pytest.mark.parametrize("r", [2, 4, 8])
def test_last_backward_scatters_across_instances_and_the_first_forward_gathers_back(
        tmp_path: Path, r: int) -> None:
    """Each block's inner reduce-scatter is the HSDP run's; on the last micro-batch it is
    followed, depending on it, by a reduce-scatter over the R ranks at rank 0's place in every
    instance of the same bytes HSDP all-reduces there (padded to R pieces), never by an
    all-reduce; the step's first forward (Megatron-FSDP's ``microbatch_count == 0``) begins
    each block's gathers with one over those ranks that puts the updated 16-bit piece back
    (bytes · R = what was scattered, in 2-byte parameters), which the block's gather inside the
    instance waits for; nothing is gathered after the optimizer step."""
    s = _hfsdp(dist_opt_instances=r)
    got, ids = _colls(tmp_path / "f", s)
    hsdp, _ = _colls(tmp_path / "h", _strategy(dist_opt_instances=r))
    mesh = Mesh(s)
    cross = sorted(mesh._members("dpr", mesh.coord(0)))
    assert not [c for c in got if c[0].endswith("_grad_ar")]
    assert [c[:3] for c in got if c[0].endswith("_grad_rs")] == [
        c[:3] for c in hsdp if c[0].endswith("_grad_rs")]
    outer = [c for c in got if c[0].endswith("_grad_rs_outer")]
    ar = [c for c in hsdp if c[0].endswith("_grad_ar")]
    assert len(outer) == len(ar) >= 3
    grad = O.grad_reduce_bytes(s)
    for (name, size, kind, group, deps), (_, ar_size, _, _, _) in zip(outer, ar, strict=True):
        assert kind == "REDUCE_SCATTER" and group == cross
        assert size % (r * grad) == 0 and ar_size <= size < ar_size + r * grad
        if r < 8:  # (an instance of one rank scatters nothing inside: it follows the block)
            assert deps == [ids[name.replace("_grad_rs_outer", "_grad_rs")]]
    gathers = [c for c in got if c[0].endswith("_param_all_gather_outer")]
    # in the first forward, block by block in forward order: the scatters' blocks reversed
    assert [g[0].split(".")[-1].removesuffix("_param_all_gather_outer") for g in gathers] == [
        o[0].split(".")[-1].removesuffix("_grad_rs_outer") for o in outer][::-1]
    for (name, size, kind, group, _), (_, scattered, _, _, _) in zip(
            gathers, outer[::-1], strict=True):
        assert name.startswith("F0.") and kind == "ALL_GATHER" and group == cross
        assert size * r // O.PARAM_BYTES == scattered // grad
        inner = name.replace("_param_all_gather_outer", "_param_ag")
        if r < 8:  # the block's inner gather waits for it (an instance of one has none)
            assert ids[name] in next(c[4] for c in got if c[0] == inner)
    assert not [c for c in got if c[0].startswith("step.") and c[2] == "ALL_GATHER"]


def test_memory_shards_the_optimizer_over_every_rank() -> None:
    """16-bit weights and gradients over the instance (dp·cp / R), the fp32 master weights and
    both moments (12 bytes a parameter, Rajbhandari et al. 2020's K) over all dp·cp: at R = 2
    on dp 8, 12/8 against HSDP's 4 + 8 over 4; the gradients equal HSDP's."""
    params = RoleProgram(MODEL, _strategy(), 0).stage_params()["dp"]
    for r in (2, 4, 8):
        mem = memory_estimate(MODEL, _hfsdp(dist_opt_instances=r), 0, params)
        hsdp = memory_estimate(MODEL, _strategy(dist_opt_instances=r), 0, params)
        shard = 8 // r
        assert mem.weights_bytes == -(-params * WEIGHT_BYTES // shard)
        assert mem.optimizer_bytes == -(-params * OPTIM_BYTES // 8)
        assert mem.gradients_bytes == hsdp.gradients_bytes
        assert mem.weights_bytes + mem.optimizer_bytes < hsdp.weights_bytes + hsdp.optimizer_bytes


def test_the_optimizer_steps_one_piece_of_the_instance_shard() -> None:
    """The optimizer op updates ⌈⌈P / (dp·cp/R)⌉ / R⌉ parameters: the instance's shard cut in
    R (HSDP's step is R times that, rounding aside)."""
    s = _hfsdp(dist_opt_instances=4)
    params = RoleProgram(MODEL, s, 0).stage_params()
    local = sharded_params(s, params)
    inner = -(-params["dp"] // 2)  # dp 8 over 4 instances of 2
    assert local == outer_shard(s, params["dp"]) == -(-inner // 4)
    hsdp = sharded_params(_strategy(dist_opt_instances=4), params)
    assert hsdp <= 4 * local < hsdp + 4


@pytest.mark.parametrize(LAYOUT_FIELDS, LAYOUTS)
def test_fast_path_agrees_with_replay(gpn, pp, dp, cp, r, schedule, prefetch) -> None:
    """The fast path walks each chunk's last backward with the cross-instance reduce-scatters
    on their own stream (``fastpath_stages._outer_pass``) and each chunk's first forward with
    its cross-instance gathers (``Stage.first_f``: blocking the chain, or prefetched on their
    own stream); replay runs the trace (0.10% apart at worst since the thirty-sixth session,
    0.50% before: ``fastpath._drained``)."""
    hw = get_system("dgx-h100")
    hw = dataclasses.replace(hw, node=dataclasses.replace(hw.node, gpus_per_node=gpn))
    s = _hfsdp(pp=pp, dp=dp, cp=cp, dist_opt_instances=r, global_batch_size=dp * 4 * pp,
               schedule=schedule, vpp=2 if schedule == "interleaved_1f1b" else 1,
               zero3_prefetch=prefetch)
    assert estimate(MODEL, s, hw).step_time_s == pytest.approx(_replayed_s(MODEL, s, hw),
                                                               rel=0.003)


@pytest.mark.parametrize("r", [2, 4, 8])
def test_first_forward_carries_the_outer_gathers(r: int) -> None:
    """One stage, one chunk: without prefetch each block's gather across the instances blocks
    the chain of the step's first forward, so the pipeline is HSDP's plus their sum as replay's
    network model prices them (the backward's collectives are the same but for the last one's
    outer stream, which the pipeline's end does not wait for); with prefetch each but the first
    block's hides behind the block before it, so the pipeline grows by less than the sum and
    by no less than the first block's."""
    hw = get_system("dgx-h100")
    hw = dataclasses.replace(hw, node=dataclasses.replace(hw.node, gpus_per_node=2))
    for prefetch in (False, True):
        hsdp = _strategy(dist_opt_instances=r, zero3_prefetch=prefetch)
        s = dataclasses.replace(hsdp, outer_dp_sharding_strategy="optim")
        costs = Costs(MODEL, s, hw)
        shape = costs.shape("dpr", 0)
        each = [costs.net.shape_ns("ALL_GATHER", outer_gather_comm(s, b.name, b.dense).size_bytes,
                                   shape)
                for b in RoleProgram(MODEL, s, 0).blocks_of_chunk(0)]
        grown_ns = (estimate(MODEL, s, hw).pipeline_s
                    - estimate(MODEL, hsdp, hw).pipeline_s) * 1e9
        if not prefetch:
            assert grown_ns == pytest.approx(sum(each), abs=2)
        else:
            assert each[0] - 2 <= grown_ns < sum(each)


def test_hfsdp_fits_where_hsdp_does_not() -> None:
    """Llama 3 70B under FSDP on 1,024 H100s with one replica a node: HSDP keeps 16 bytes a
    parameter over 8 GPUs (no fit); HFSDP keeps 2 + 4 over 8 and 12 over 1,024 and fits. Its
    pipeline is longer (the first forward also gathers across the nodes) but its step shorter:
    after the backward it reduce-scatters across the instances where HSDP all-reduces (half
    the traffic), and its optimizer steps 1/128 of the shard."""
    model, hw = get_model("llama3-70b"), get_system("dgx-h100")
    s = Strategy(dp=1024, zero_stage=3, global_batch_size=1024, recompute="full",
                 zero3_prefetch=True, dist_opt_instances=128)
    hsdp = estimate(model, s, hw)
    hfsdp = estimate(model, dataclasses.replace(s, outer_dp_sharding_strategy="optim"), hw)
    assert not hsdp.fits and hfsdp.fits
    assert hsdp.pipeline_s < hfsdp.pipeline_s < hsdp.pipeline_s * 1.05
    assert hfsdp.step_time_s < hsdp.step_time_s


def test_refusals_name_the_fix() -> None:
    with pytest.raises(ConfigError, match="zero_stage 3 and dist_opt_instances ≥ 2"):
        _hfsdp(zero_stage=1)
    with pytest.raises(ConfigError, match="zero_stage 3 and dist_opt_instances ≥ 2"):
        _hfsdp(dist_opt_instances=1)
    with pytest.raises(ConfigError, match="one of no_shard, optim"):
        _strategy(outer_dp_sharding_strategy="full")


def test_a_sweep_searches_the_outer_sharding(tmp_path: Path) -> None:
    """``outer_dp_sharding_strategy`` is a search dimension: "optim" survives only where a
    strategy is ZeRO-3 with several instances, and each survivor is its own strategy beside
    its HSDP twin."""
    from analysis.runner import strategy_id
    from analysis.study import load_study
    from analysis.sweep import enumerate_space
    from tests.studies import write_study

    study = dataclasses.replace(load_study(write_study(tmp_path / "s", strategies=False,
                                                       failures=False, search=True)), search={
        "tp": [1], "pp": [1], "vpp": [1], "micro_batch_size": [1], "recompute": ["full"],
        "sequence_parallel": [False], "zero_stage": [1, 3], "dist_opt_instances": [1, 2],
        "outer_dp_sharding_strategy": ["no_shard", "optim"]})
    valid, invalid = enumerate_space(study)
    hf = [s for s in valid if s.hfsdp]
    assert [(s.zero_stage, s.dist_opt_instances) for s in hf] == [(3, 2)]
    assert len(valid) == 5 and invalid == 0  # optim below ZeRO 3 or without instances: off
    assert len({strategy_id(s) for s in valid}) == len(valid)
    assert "-hfsdp" in hf[0].label()
