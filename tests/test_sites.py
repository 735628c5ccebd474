"""A job over several sites (``ScaleOutSpec.site_gpus``): groups that span sites move at the
sites' links' share a GPU and pay their latency per crossing; groups inside a site are as
before; links as fast as the NICs and no latency change nothing; the fast path agrees with
replay; and a pipeline split at the sites beats gradient rings across slow links."""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from analysis.fastpath import estimate
from replay import SystemSpec, get_system, replay
from replay.network import AlphaBetaNetwork, group_shape
from tracegen import ConfigError, ModelSpec, Strategy, generate, get_model

H100 = get_system("dgx-h100")
MODEL = ModelSpec(name="sites", num_layers=8, hidden_size=1024, num_attention_heads=16,
                  num_kv_heads=4, ffn_hidden_size=4096, vocab_size=8192, seq_len=1024,
                  activation="swiglu")


def sited(system: SystemSpec, site_gpus: int, gbps: float, latency_us: float = 0.0,
          window_MiB: float = 0.0) -> SystemSpec:
    return dataclasses.replace(system, scaleout=dataclasses.replace(
        system.scaleout, site_gpus=site_gpus, site_Gbps_per_gpu=gbps,
        site_latency_us=latency_us, site_window_MiB=window_MiB))


@pytest.mark.parametrize(("kw", "says"), [
    (dict(site_gpus=12, site_Gbps_per_gpu=50.0), "whole number of nodes"),
    (dict(site_gpus=16), "needs site_Gbps_per_gpu"),
    (dict(site_Gbps_per_gpu=50.0), "site_Gbps_per_gpu needs site_gpus"),
    (dict(site_latency_us=100.0), "site_latency_us needs site_gpus"),
    (dict(site_window_MiB=8.0), "site_window_MiB needs site_gpus"),
    (dict(site_gpus=16, site_Gbps_per_gpu=50.0, site_window_MiB=8.0),
     "site_window_MiB needs site_latency_us"),
    (dict(site_gpus=16, site_Gbps_per_gpu=50.0, site_latency_us=100.0, site_window_MiB=-1.0),
     "site_window_MiB must be ≥ 0"),
])
def test_bad_sites_are_refused_with_the_fix(kw: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        SystemSpec.from_dict({**dataclasses.asdict(H100),
                              "scaleout": {**dataclasses.asdict(H100.scaleout), **kw}})


def _slow_nic(gbps: float) -> SystemSpec:
    return dataclasses.replace(H100, scaleout=dataclasses.replace(H100.scaleout,
                                                                  nic_Gbps_per_gpu=gbps))


def test_a_group_spanning_sites_runs_at_their_links_and_pays_their_latency() -> None:
    """Sites of 4 nodes, 50 Gb/s a GPU between them (a pool of 32 × 50 each way). A
    reduce-scatter over 8 ranks on 8 nodes (one a node): its ring leaves a site once each way,
    one NIC flow a group, and the site holds 8 such groups, so the flow gets 4 GPUs' shares,
    200 Gb/s — as if the NICs were that slow — and one crossing's latency more (NCCL counts a
    node crossing). Its optimizer-instance form, a rank a site, gets one GPU's share; an
    all-to-all over the 8, whose every GPU sends across, a GPU's share too. Inside a site
    nothing changes; a send between sites pays a GPU's share and the latency."""
    ranks = tuple(range(0, 64, 8))
    two = sited(H100, 32, 50.0, 500.0)
    assert group_shape(ranks, 8, 32)[4] == 2 and group_shape(ranks[:4], 8, 32)[4] == 1
    size = 1 << 30
    net = AlphaBetaNetwork(two)
    got = net.collective("REDUCE_SCATTER", size, ranks)
    ref = AlphaBetaNetwork(_slow_nic(200.0)).collective("REDUCE_SCATTER", size, ranks)
    assert got.transfer_ns == ref.transfer_ns
    assert got.latency_ns - ref.latency_ns == 500_000
    pair = (0, 32)
    assert (net.collective("ALL_REDUCE", size, pair).transfer_ns
            == AlphaBetaNetwork(_slow_nic(50.0)).collective("ALL_REDUCE", size, pair).transfer_ns)
    assert (net.collective("ALL_TO_ALL", size, ranks).transfer_ns
            == AlphaBetaNetwork(_slow_nic(50.0)).collective("ALL_TO_ALL", size, ranks).transfer_ns)
    inside = ranks[:4]
    assert net.collective("REDUCE_SCATTER", size, inside) == AlphaBetaNetwork(H100).collective(
        "REDUCE_SCATTER", size, inside)
    send = net.p2p(0, 32, size)
    nic = AlphaBetaNetwork(H100).nic
    assert send.latency_ns == round((nic.alpha_s + 500e-6) * 1e9)
    assert send.transfer_ns == round(size / (50e9 / 8 * H100.scaleout.nic_efficiency) * 1e9)


def test_a_ring_over_more_nodes_crosses_at_its_nics_rate() -> None:
    """The pool split among the flows that cross: a ring of 2n nodes over two sites gets n
    GPUs' shares a flow, so the more nodes a data-parallel ring spans, the less the links
    between the sites slow it, until its NICs bind (here from 8 nodes a site at 50 Gb/s a
    GPU): a closed form, and monotone."""
    two = sited(H100, 64, 50.0)
    size = 1 << 30
    prev = None
    for n in (1, 2, 4, 8):
        ranks = tuple(range(0, 128, 64 // n))  # n nodes a site, one rank a node
        net = AlphaBetaNetwork(two)
        got = net.collective("ALL_REDUCE", size, ranks).transfer_ns
        ref = AlphaBetaNetwork(_slow_nic(min(400.0, 50.0 * n))).collective(
            "ALL_REDUCE", size, ranks).transfer_ns
        assert got == ref
        assert net.crossing_Bps(group_shape(ranks, 8, 64), "ALL_REDUCE") == pytest.approx(
            min(400.0, 50.0 * n) / 8 * 1e9 * H100.scaleout.nic_efficiency)
        assert prev is None or got <= prev
        prev = got


def test_a_window_caps_each_crossing_flow_at_its_size_over_the_round_trip() -> None:
    """8 MiB in flight (NCCL's 4 MiB buffer on two channels) between sites 2.5 ms apart
    (~500 km of fibre): a crossing flow moves at most 8 MiB over the 5 ms round trip (plus the
    NICs' 2 × 3 µs), ~1.7 GB/s, where the links and the NIC would give 48 — the same as a NIC
    that slow; inside a site nothing changes, and a larger window is never slower."""
    two = sited(H100, 32, 400.0, 2500.0, window_MiB=8.0)
    net = AlphaBetaNetwork(two)
    rtt_s = 2 * (H100.scaleout.latency_us + 2500.0) * 1e-6
    cap = 8 * 2**20 / rtt_s
    size = 1 << 30
    send = net.p2p(0, 32, size)
    assert send.transfer_ns == round(size / cap * 1e9)
    ranks = tuple(range(0, 64, 8))  # one rank a node, four nodes a site
    assert net.crossing_Bps(group_shape(ranks, 8, 32), "REDUCE_SCATTER") == pytest.approx(cap)
    slow = _slow_nic(cap * 8 / 1e9 / H100.scaleout.nic_efficiency)
    assert net.collective("REDUCE_SCATTER", size, ranks).transfer_ns == pytest.approx(
        AlphaBetaNetwork(slow).collective("REDUCE_SCATTER", size, ranks).transfer_ns, abs=2)
    inside = ranks[:4]
    assert net.collective("REDUCE_SCATTER", size, inside) == AlphaBetaNetwork(H100).collective(
        "REDUCE_SCATTER", size, inside)
    times = [AlphaBetaNetwork(sited(H100, 32, 400.0, 2500.0, window_MiB=w)).p2p(
        0, 32, size).transfer_ns for w in (1.0, 8.0, 64.0, 1024.0, 0.0)]
    assert times == sorted(times, reverse=True)  # (0: no window, the links' own rate)
    assert times[-1] == round(size / min(net.nic.bytes_per_s, net.site_Bps) * 1e9)


def test_links_as_fast_as_the_nics_change_nothing() -> None:
    """Sites whose links give a GPU its NIC's bandwidth and no latency are one site."""
    s = Strategy(tp=2, pp=2, dp=8, global_batch_size=64, zero_stage=1, sequence_parallel=True)
    same = sited(H100, 16, H100.scaleout.nic_Gbps_per_gpu)
    assert estimate(MODEL, s, same).step_time_s == estimate(MODEL, s, H100).step_time_s


def test_a_pipeline_split_at_the_sites_beats_gradient_rings_across_slow_links() -> None:
    """Two sites of 16 GPUs with 5 Gb/s a GPU between them and 1 ms of latency: splitting the
    pipeline at the sites sends only activations across, while pp 1 runs every gradient ring
    across — the split is faster there, and slower than pp 1 on one site (its bubble)."""
    two = sited(H100, 16, 5.0, 1000.0)
    across = Strategy(tp=2, dp=16, global_batch_size=64, zero_stage=1, sequence_parallel=True)
    split = Strategy(tp=2, pp=2, dp=8, global_batch_size=64, zero_stage=1,
                     sequence_parallel=True)
    assert estimate(MODEL, split, two).step_time_s < estimate(MODEL, across, two).step_time_s
    assert estimate(MODEL, split, H100).step_time_s > estimate(MODEL, across, H100).step_time_s


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2, 4]), dp=st.sampled_from([2, 4, 8]),
       zero=st.sampled_from([0, 1, 3]), nodes=st.sampled_from([1, 2, 4]),
       gbps=st.sampled_from([5.0, 50.0, 400.0]), latency=st.sampled_from([0.0, 30.0, 2000.0]),
       gpn=st.sampled_from([8, 4, 2]), vpp=st.booleans(), per_microbatch=st.booleans(),
       window=st.sampled_from([0.0, 4.0]))
def test_fast_path_within_2_percent_of_replay(tp, pp, dp, zero, nodes, gbps, latency, gpn, vpp,
                                              per_microbatch, window) -> None:
    """Sites of ``nodes`` nodes of ``gpn`` GPUs under every layout: the fast path (each stage
    costed on its own, its sends by whether they leave the site) against replay; with or
    without a window on the crossing flows."""
    hw = dataclasses.replace(H100, node=dataclasses.replace(H100.node, gpus_per_node=gpn))
    hw = sited(hw, nodes * gpn, gbps, latency, window if latency else 0.0)
    try:
        s = Strategy(tp=tp, pp=pp, dp=dp, zero_stage=zero, vpp=2 if vpp and pp > 1 else 1,
                     schedule="interleaved_1f1b" if vpp and pp > 1 else "1f1b",
                     sequence_parallel=tp > 1, global_batch_size=dp * 2 * pp,
                     grad_reduce_per_microbatch=per_microbatch and zero < 3)
        fast = estimate(MODEL, s, hw)
    except ConfigError:
        assume(False)
        raise
    assume(s.world_size > nodes * gpn)  # (a job on one site is the one-site model's)
    with tempfile.TemporaryDirectory() as tmp:
        generate(MODEL, s, tmp, mode="representative")
        ref = replay(tmp, hw, contention=False).step_time_s
    assert fast.step_time_s == pytest.approx(ref, rel=0.02)


@pytest.mark.parametrize(("pp", "groups", "hops"), [(1, ["dp"], 0), (2, [], 1), (4, [], 1)])
def test_estimate_says_what_crosses_between_sites(tmp_path, pp: int, groups: list[str],
                                                  hops: int) -> None:
    """Llama 3 70B on the example two-site system (tests/data): pp 1 runs its gradient rings
    across the sites, pp 2 and 4 keep every group inside one and send across once — said, and
    in the JSON."""
    import json

    from tests.test_cli import run

    system = Path(__file__).parent / "data" / "two-sites-h100.toml"
    out = tmp_path / "e.json"
    r = run("estimate", "--model", "llama3-70b", "--gpus", "8192", "--tp", "8", "--pp", str(pp),
            "--sp", "--mbs", "1", "--gbs", "2048", "--zero", "1", "--recompute", "selective",
            "--system", str(system), "--json", str(out))
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    # each crossing flow's rate (network.crossing_Bps): pp 1's rings at their NICs' 400 Gb/s
    # (× the NIC efficiency 0.96), the links' pool far from full; a send the pool over the
    # 8,192 / pp GPUs of a stage: 2 Gb/s a GPU (× 0.96) times the stages a site holds
    stage = 8192 // pp
    rates = {"dp": pytest.approx(400 * 0.96)} if pp == 1 else {
        "send": pytest.approx(2 * 0.96 * 4096 / stage)}
    assert got["sites"] == {"sites": 2, "groups_spanning_sites": groups,
                            "pipeline_hops_between_sites": hops,
                            "crossing_Gbps_per_flow": rates}
    text = " ".join(r.stdout.split())
    assert "2 sites of 4,096 GPUs (2 Gb/s a GPU between them, 250 µs)" in text
    assert ("crossing at dp 384 Gb/s a flow (its NICs')" in text) is (pp == 1)
    one_site = estimate(get_model("llama3-70b"), Strategy.from_dict(got["strategy_fields"]),
                        H100).step_time_s
    # pp 1's rings cross with a NIC flow each, at their NICs' rate (the links' pool, 8.2 Tb/s,
    # is far from full): only the latency; the split sends activations across at 2 Gb/s a GPU
    assert 1.0 < got["step_time_s"] / one_site < (1.02 if pp == 1 else 1.1)


def test_estimate_names_the_window_where_it_binds(tmp_path) -> None:
    """The example's sites with 8 MiB in flight a flow: pp 1's rings cross at the window over
    the 506 µs round trip (~133 Gb/s), said as what sets the rate and in the JSON."""
    import json

    from tests.test_cli import run

    text = (Path(__file__).parent / "data" / "two-sites-h100.toml").read_text()
    system = tmp_path / "w8.toml"
    system.write_text(text.replace("site_latency_us = 250.0",
                                   "site_latency_us = 250.0\nsite_window_MiB = 8"))
    out = tmp_path / "e.json"
    r = run("estimate", "--model", "llama3-70b", "--gpus", "8192", "--tp", "8", "--sp",
            "--mbs", "1", "--gbs", "2048", "--zero", "1", "--system", str(system),
            "--json", str(out))
    assert r.returncode == 0, r.stderr
    cap_gbps = 8 * 2**20 / (2 * (3.0 + 250.0) * 1e-6) * 8 / 1e9
    assert json.loads(out.read_text())["sites"]["crossing_Gbps_per_flow"] == {
        "dp": pytest.approx(cap_gbps)}
    said = " ".join(r.stdout.split())
    assert "250 µs, 8 MiB in flight a flow)" in said
    assert f"dp {cap_gbps:,.0f} Gb/s a flow (its window over the round trip)" in said


def test_a_site_boundary_inside_a_stage_is_said() -> None:
    """1,600 GPUs a stage on sites of 4,096: the boundary cuts stage 2, whose data-parallel
    group then spans both sites, and the note says how its sends are costed."""
    from tests.test_cli import run

    r = run("estimate", "--model", "llama3-70b", "--gpus", "8000", "--tp", "8", "--pp", "5",
            "--sp", "--mbs", "1", "--gbs", "2000", "--zero", "1", "--system",
            str(Path(__file__).parent / "data" / "two-sites-h100.toml"))
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "dp spanning sites, 2 pipeline hops between them" in text
    assert "note: a site boundary falls inside a pipeline stage (1,600 GPUs a stage" in text


def test_a_study_on_several_sites_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """compare, sweep and resilience open with the sites a study's GPUs span (none for a
    study inside one site)."""
    from analysis.cli_study import _print_cluster
    from analysis.study import study_from_dict

    system = str(Path(__file__).parent / "data" / "two-sites-h100.toml")
    for gpus, said in ((8192, True), (4096, False)):
        _print_cluster(study_from_dict({"model": "llama3-8b", "system": system, "gpus": gpus,
                                        "global_batch_size": 4096}, name="s"))
        text = " ".join(capsys.readouterr().out.split())
        assert ("2 sites of 4,096 GPUs (2 Gb/s a GPU between them, 250 µs)" in text) is said
