"""Replay properties over random valid strategies (hypothesis): bounds, determinism, and full mode
agreeing with representative mode on healthy symmetric sets."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from chakra.schema.protobuf import et_def_pb2 as pb
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from polars.testing import assert_frame_equal

from replay import get_system, replay
from replay.compute import RooflineCompute
from replay.network import AlphaBetaNetwork
from replay.reader import COLL_TYPE_NAMES
from replay.traceset import TraceSet, load_trace_set
from tracegen import ConfigError, ModelSpec, Strategy, generate

MODEL = ModelSpec(name="prop", num_layers=8, hidden_size=256, num_attention_heads=8,
                  num_kv_heads=4, ffn_hidden_size=512, vocab_size=1024, seq_len=256,
                  activation="swiglu")
SYSTEM = get_system("dgx-h100")

strategies = st.builds(
    dict, tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2, 4]),
    dp=st.sampled_from([1, 2, 4]), sp=st.booleans(), zero=st.sampled_from([0, 1, 3]),
    recompute=st.sampled_from(["none", "selective", "full"]), mb=st.sampled_from([1, 2, 4]),
    schedule=st.sampled_from(["gpipe", "1f1b"]))


def _strategy(d: dict) -> Strategy:
    try:
        return Strategy(tp=d["tp"], pp=d["pp"], dp=d["dp"], sequence_parallel=d["sp"] and d["tp"] > 1,
                        zero_stage=d["zero"], recompute=d["recompute"], micro_batch_size=1,
                        global_batch_size=d["mb"] * d["dp"] * d["pp"], schedule=d["schedule"],
                        dp_bucket_params=200_000)
    except ConfigError:
        assume(False)
        raise


def _node_costs(ts: TraceSet) -> dict[int, list[int]]:
    compute = RooflineCompute(SYSTEM.gpu)
    net = AlphaBetaNetwork(SYSTEM)
    out: dict[int, list[int]] = {}
    for rt in ts.ranks:
        costs = []
        for n in rt.nodes:
            a = n.attrs
            if n.type == pb.COMP_NODE:
                costs.append(compute.duration_ns(n))
            elif n.type == pb.COMM_COLL_NODE:
                members = ts.groups[a["pg_name"]]
                costs.append(net.collective(COLL_TYPE_NAMES[a["comm_type"]], a["comm_size"],
                                            members).total_ns)
            else:
                src = rt.rank if n.type == pb.COMM_SEND_NODE else a["comm_src"]
                dst = a["comm_dst"] if n.type == pb.COMM_SEND_NODE else rt.rank
                costs.append(net.p2p(src, dst, a["comm_size"]).total_ns)
        out[rt.rank] = costs
    return out


def _critical_path(ts: TraceSet, costs: dict[int, list[int]]) -> int:
    best = 0
    for rt in ts.ranks:
        pos = {n.id: i for i, n in enumerate(rt.nodes)}
        finish = [0] * len(rt.nodes)
        for i, n in enumerate(rt.nodes):  # our files list dependencies before dependents
            start = max((finish[pos[d]] for d in n.deps), default=0)
            finish[i] = start + costs[rt.rank][i]
        best = max(best, max(finish))
    return best


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(strategies)
def test_step_time_between_critical_path_and_serial_sum(d: dict) -> None:
    s = _strategy(d)
    with tempfile.TemporaryDirectory() as tmp:
        generate(MODEL, s, tmp, mode="full")
        ts = load_trace_set(tmp, fold=False)
        res = replay(ts, SYSTEM)
    assert not ts.folded
    costs = _node_costs(ts)
    step_ns = res.step_time_s * 1e9
    assert step_ns >= _critical_path(ts, costs) - 1
    assert step_ns <= sum(sum(c) for c in costs.values()) + 1


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(strategies)
def test_full_and_representative_agree(d: dict) -> None:
    s = _strategy(d)
    with tempfile.TemporaryDirectory() as tmp:
        generate(MODEL, s, Path(tmp) / "f", mode="full")
        generate(MODEL, s, Path(tmp) / "r", mode="representative")
        full = replay(Path(tmp) / "f", SYSTEM, fold=False)
        rep = replay(Path(tmp) / "r", SYSTEM)
    assert rep.step_time_s == pytest.approx(full.step_time_s, rel=1e-9)
    assert rep.metrics["mfu"] == pytest.approx(full.metrics["mfu"], rel=1e-9)
    reps = rep.breakdown["rank"].to_list()
    assert_frame_equal(full.breakdown.filter(full.breakdown["rank"].is_in(reps)), rep.breakdown)


def test_replay_is_deterministic(tmp_path: Path) -> None:
    s = Strategy(tp=2, pp=2, dp=2, micro_batch_size=1, global_batch_size=8, zero_stage=1,
                 sequence_parallel=True)
    generate(MODEL, s, tmp_path, mode="full")
    a, b = replay(tmp_path, SYSTEM), replay(tmp_path, SYSTEM)
    assert_frame_equal(a.timeline, b.timeline)
    assert_frame_equal(a.breakdown, b.breakdown)
    assert a.metrics == b.metrics


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(strategies)
def test_folding_is_exact(d: dict) -> None:
    """A full-mode set replayed by its stage representatives equals the rank-by-rank replay."""
    s = _strategy(d)
    with tempfile.TemporaryDirectory() as tmp:
        generate(MODEL, s, tmp, mode="full")
        folded = replay(tmp, SYSTEM)
        every = replay(tmp, SYSTEM, fold=False)
    assert folded.metrics["folded"] and not every.metrics["folded"]
    assert folded.metrics["nodes"] == every.metrics["nodes"]
    assert folded.step_time_s == every.step_time_s
    assert_frame_equal(folded.breakdown, every.breakdown)


def test_an_edited_rank_is_not_folded(tmp_path: Path) -> None:
    s = Strategy(tp=2, pp=2, dp=2, micro_batch_size=1, global_batch_size=8)
    generate(MODEL, s, tmp_path, mode="full")
    f = tmp_path / "trainsim.3.et"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01  # perturb one byte of the last node of rank 3
    f.write_bytes(bytes(data))
    ts = load_trace_set(tmp_path)
    assert not ts.folded and len(ts.ranks) == 8
