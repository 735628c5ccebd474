"""DeepEP's dispatch (``Strategy.moe_dispatcher = "deepep"``) and group-limited routing
(``ModelSpec.moe_router_num_groups`` / ``moe_router_group_topk``): where one token's experts
fall (against sampling), the network's cost of a deduplicated dispatch against its closed form,
the trace's routing attributes, the fast path against replay, and the messages for bad input."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from analysis.fastpath import estimate
from replay import get_system, replay
from replay.network import AlphaBetaNetwork
from tests.conftest import attrs, read_et, replayed
from tests.studies import enumerated
from tests.test_cli import run
from tracegen import ConfigError, ModelSpec, Strategy, generate, get_model
from tracegen.errors import TraceFormatError
from tracegen.routing import Route, expected_units, route_problems

MOE = ModelSpec(name="dep", num_layers=4, hidden_size=1024, num_attention_heads=8,
                num_kv_heads=4, ffn_hidden_size=2048, vocab_size=4096, seq_len=1024,
                activation="swiglu", num_experts=64, experts_per_token=8,
                moe_ffn_hidden_size=512, moe_router_num_groups=8, moe_router_group_topk=4)
H100 = get_system("dgx-h100")


def _sampled(route: Route, units: int, n: int = 30_000, seed: int = 7) -> float:
    """Mean distinct units hit, by drawing routings as the router makes them: groups first
    (uniformly, the balanced limit), then top-k experts among theirs."""
    rng = random.Random(seed)
    e, per_unit = route.experts, route.experts // units
    total = 0
    for _ in range(n):
        if route.groups:
            per_group = e // route.groups
            groups = rng.sample(range(route.groups), route.group_topk)
            pool: list[int] | range = [g * per_group + i for g in groups
                                       for i in range(per_group)]
        else:
            pool = range(e)
        total += len({x // per_unit for x in rng.sample(pool, route.topk)})
    return total / n


@pytest.mark.parametrize(("route", "units"), [
    (Route(8, 256, 8, 4), 8),    # DeepSeek-V3 on 8 nodes: a group per node
    (Route(8, 256, 8, 4), 64),   # ... its 64 GPUs: 8 per group
    (Route(8, 256, 8, 4), 4),    # two groups per node
    (Route(8, 256), 8),          # no group limit
    (Route(8, 256), 64),
    (Route(2, 8), 4),            # Mixtral-like
    (Route(8, 160, 8, 3), 8),
])
def test_expected_destinations_match_sampled_routings(route: Route, units: int) -> None:
    """The closed form (hypergeometric over groups, then over experts) agrees with 30,000
    sampled routings within 1% (the sampling error is ~0.3%)."""
    assert expected_units(route, units) == pytest.approx(_sampled(route, units), rel=0.01)


def test_expected_destinations_limits() -> None:
    """One expert reaches one unit; one unit is always reached; with a unit per expert every
    expert is its own destination; a group limit of M whole-group nodes reaches at most M."""
    assert expected_units(Route(1, 64), 16) == pytest.approx(1.0)
    assert expected_units(Route(8, 64), 1) == 1.0
    assert expected_units(Route(8, 64), 64) == pytest.approx(8.0)
    assert expected_units(Route(8, 256, 8, 4), 8) < 4 < expected_units(Route(8, 256), 8)


@settings(max_examples=300, deadline=None)
@given(experts=st.sampled_from([4, 8, 16, 60, 64, 128, 160, 256, 384]), k=st.integers(1, 12),
       groups=st.sampled_from([0, 1, 2, 4, 8, 16, 32]), m=st.integers(1, 32),
       units=st.integers(1, 80))
def test_a_token_reaches_at_least_one_and_at_most_k_destinations(experts: int, k: int,
                                                                 groups: int, m: int,
                                                                 units: int) -> None:
    """For any routing the router accepts and any split of the experts (also unequal ones, as
    on nodes an expert-parallel group fills unevenly): 1 ≤ D ≤ min(k, units)."""
    route = Route(min(k, experts), experts, groups, min(m, groups) if groups else 0)
    assume(not route_problems(route))
    assert 1 - 1e-9 <= expected_units(route, units) <= min(route.topk, units) + 1e-9


def test_deepep_cost_is_its_closed_form() -> None:
    """DeepSeek-V3's dispatch over 8 DGX H100 nodes: the NICs carry u · D_n · 7/8 bytes, NVLink
    u · D_g · 7/8, the slower binds; the flat all-to-all's NIC share is k · 7/8 copies."""
    net = AlphaBetaNetwork(H100)
    route = Route(8, 256, 8, 4)
    size = 2048 * 8 * 7168 * 2  # 2,048 tokens × top-8 × hidden × 2 bytes
    shape = (64, 8, 8, True, 1)
    lat, xfer, uses = net.shape_cost("ALL_TO_ALL", size, shape, route)
    u = size / 8
    nic = u * expected_units(route, 8) * 7 / 8 / net.nic.bytes_per_s
    nvl = u * expected_units(route, 64) * 7 / 8 / net.nvl.bytes_per_s
    assert xfer == pytest.approx(max(nic, nvl)) and nic > nvl
    assert lat == pytest.approx(7 * net.nic.alpha_s + 7 * net.nvl.alpha_s)
    assert uses == ("nvl", "nic")
    _, flat, _ = net.shape_cost("ALL_TO_ALL", size, shape)
    assert flat == pytest.approx(8 * u * 7 / 8 / net.nic.bytes_per_s)
    assert xfer / flat == pytest.approx(expected_units(route, 8) / 8)  # 3.63 of 8 copies


def test_deepep_inside_a_node_sends_a_token_once_per_gpu() -> None:
    net = AlphaBetaNetwork(H100)
    route = Route(8, 64)
    size = 4096 * 8 * 1024 * 2
    _, xfer, _ = net.shape_cost("ALL_TO_ALL", size, (8, 1, 8, True, 1), route)
    assert xfer == pytest.approx(size / 8 * expected_units(route, 8) * 7 / 8
                                 / net.nvl.bytes_per_s)


def test_astra_compatible_mode_reads_a_routed_dispatch_as_the_flat_one() -> None:
    net = AlphaBetaNetwork(H100, astra_compat=True)
    size, shape = 1 << 24, (16, 2, 8, True, 1)
    assert net.shape_cost("ALL_TO_ALL", size, shape, Route(8, 64)) == net.shape_cost(
        "ALL_TO_ALL", size, shape)


def _strategy(disp: str, **kw: object) -> Strategy:
    base: dict[str, object] = dict(tp=1, pp=2, dp=32, ep=32, micro_batch_size=1,
                                   global_batch_size=128, zero_stage=1, moe_dispatcher=disp)
    return Strategy(**{**base, **kw})  # type: ignore[arg-type]


def test_the_trace_carries_the_routing_only_under_deepep(tmp_path: Path) -> None:
    for disp in ("alltoall", "deepep"):
        out = tmp_path / disp
        generate(MOE, _strategy(disp), out, mode="representative")
        _, nodes = read_et(next(out.glob("*.0.et")))
        a2a = [n for n in nodes if "moe_dispatch" in n.name or "moe_combine" in n.name]
        # 4 micro-batches × 2 layers of the stage × dispatch and combine × forward and backward
        assert len(a2a) == 4 * 2 * 2 * 2
        for n in a2a:
            got = attrs(n)
            if disp == "alltoall":
                assert "moe_topk" not in got
            else:
                assert {k: got[k][1] for k in ("moe_topk", "moe_experts", "moe_router_groups",
                                               "moe_router_group_topk")} == {
                    "moe_topk": 8, "moe_experts": 64, "moe_router_groups": 8,
                    "moe_router_group_topk": 4}
            assert got["comm_size"][1] == 1024 * 8 * 1024 * 2  # the flat buffer either way


@pytest.mark.parametrize(("ep", "tp", "etp"), [(32, 1, 0), (8, 1, 0), (16, 2, 1), (4, 1, 0)])
def test_fast_path_matches_replay_under_deepep(ep: int, tp: int, etp: int) -> None:
    """Across nodes (ep 32 over 4 nodes; folded ep 16 over tp 2), inside one (ep 8, 4)."""
    s = _strategy("deepep", tp=tp, dp=32 // tp, ep=ep, expert_tp=etp, sequence_parallel=tp > 1)
    ref = replayed(MOE, s, H100).step_time_s
    assert estimate(MOE, s, H100).step_time_s == pytest.approx(ref, rel=1e-6)


def test_deepep_shortens_a_cross_node_step_and_the_group_limit_more() -> None:
    """Fewer bytes cross the NICs: DeepEP beats the flat all-to-all across nodes, and the
    group limit (fewer destination nodes) beats DeepEP without it."""
    flat = estimate(MOE, _strategy("alltoall"), H100).step_time_s
    dedup = estimate(MOE, _strategy("deepep"), H100).step_time_s
    free = dataclasses.replace(MOE, moe_router_num_groups=0, moe_router_group_topk=0)
    unlimited = estimate(free, _strategy("deepep"), H100).step_time_s
    assert dedup < unlimited < flat
    assert estimate(free, _strategy("alltoall"), H100).step_time_s == pytest.approx(flat)


def test_deepseek_v3_preset_routes_within_four_of_eight_groups() -> None:
    m = get_model("deepseek-v3")
    assert (m.moe_router_num_groups, m.moe_router_group_topk) == (8, 4)


def test_bad_dispatchers_and_groups_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="moe_dispatcher must be one of alltoall, deepep"):
        _strategy("nccl")
    dense = get_model("llama3-8b")
    with pytest.raises(ConfigError, match="needs num_experts and ep > 1"):
        estimate(dense, Strategy(dp=8, global_batch_size=8, moe_dispatcher="deepep"), H100)
    with pytest.raises(ConfigError, match="needs num_experts and ep > 1"):
        estimate(MOE, _strategy("deepep", ep=1), H100)
    for groups, topk, words in ((6, 2, "must divide the experts"),
                                (8, 0, "set both or neither"),
                                (8, 9, r"group top-k 9 be in 1\.\.8"),
                                (32, 2, "top-k 8 exceeds the 4 experts")):
        with pytest.raises(ConfigError, match=words):
            dataclasses.replace(MOE, moe_router_num_groups=groups, moe_router_group_topk=topk)
    with pytest.raises(ConfigError, match="num_experts is 0"):
        dataclasses.replace(dense, moe_router_num_groups=8, moe_router_group_topk=4)


def test_a_trace_with_impossible_routing_is_refused(tmp_path: Path) -> None:
    """A trace whose dispatch claims top-9 of 8 experts: a message naming the attributes, not
    a division by zero deep in the network model."""
    from tracegen.writer import encode_attr

    generate(MOE, _strategy("deepep", ep=8), tmp_path, mode="representative")
    good = encode_attr("moe_experts", "int64", 64)
    bad = encode_attr("moe_experts", "int64", 4)
    for et in tmp_path.glob("*.et"):
        data = et.read_bytes()
        assert good in data
        et.write_bytes(data.replace(good, bad))
    with pytest.raises(TraceFormatError, match=r"routing attributes moe_topk.*top-k 8 must be "
                                               r"in 1\.\.experts \(4\)"):
        replay(tmp_path, H100)


def test_a_sweep_searches_the_dispatcher(tmp_path: Path) -> None:
    """The dispatcher is a search dimension; DeepEP pairs only with expert parallelism."""
    valid, invalid = enumerated(
        tmp_path, 'model = "mixtral-8x7b"\nsystem = "dgx-h100"\ngpus = 64\n'
        'global_batch_size = 256\n[search]\ntp = [2]\npp = [4]\nvpp = [1]\n'
        'micro_batch_size = [1]\nrecompute = ["full"]\nzero_stage = [1]\n'
        'sequence_parallel = [true]\nep = [1, 8]\nmoe_dispatcher = ["alltoall", "deepep"]\n')
    assert sorted((s.ep, s.moe_dispatcher) for s in valid) == [
        (1, "alltoall"), (8, "alltoall"), (8, "deepep")]
    assert invalid == 0  # DeepEP without expert parallelism does not apply: the all-to-all
    assert [s.label() for s in valid if s.moe_dispatcher == "deepep"] == [
        "tp2-pp4-dp8-ep8-deepep-mbs1"]


def test_estimate_takes_the_dispatcher_from_the_command_line() -> None:
    from typer.testing import CliRunner

    from analysis.cli import app

    args = ["estimate", "--model", "deepseek-v3", "--gpus", "1024", "--tp", "2", "--pp", "8",
            "--ep", "64", "--expert-tp", "1", "--sp", "--mbs", "1", "--gbs", "8192",
            "--zero", "1", "--precision", "fp8", "--system", "dgx-h100",
            "--first-stage-layers", "4", "--last-stage-layers", "3"]
    runner = CliRunner()
    flat = runner.invoke(app, args)
    dedup = runner.invoke(app, [*args, "--moe-dispatcher", "deepep"])
    assert flat.exit_code == dedup.exit_code == 0, flat.output + dedup.output
    assert "ep64-etp1-deepep-mbs1" in dedup.output and "deepep" not in flat.output

    def step(out: str) -> float:
        return float(out.split("step time ")[1].split(" s")[0])

    assert step(dedup.output) < 0.8 * step(flat.output)
    bad = run(*args, "--moe-dispatcher", "nccl")  # the installed command: message, no traceback
    assert bad.returncode == 2 and (
        "ConfigError: invalid strategy: moe_dispatcher must be one of alltoall, deepep; got "
        "'nccl'") in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("named", ["hybridep", "HybridEP", "flex"])
def test_hybridep_is_refused_with_the_nearest_dispatcher(named: str) -> None:
    """A dispatcher a framework names that trainsim does not model (HybridEP, or the flex
    dispatcher that runs it) is refused naming 'deepep' as the nearest, not a bare list."""
    with pytest.raises(ConfigError, match="is the nearest"):
        Strategy(dp=64, ep=8, global_batch_size=64, moe_dispatcher=named)  # type: ignore[arg-type]
