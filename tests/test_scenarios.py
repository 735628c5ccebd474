"""Inside-a-step scenarios: stragglers in a TP group and in a DP replica, a degraded NIC, mixed
GPU types, fault events in the Perfetto export, and clear errors for bad scenario files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import polars as pl
import pytest

from replay import get_system, replay
from replay.hardware import resolve_system, system_names, system_toml
from replay.traceset import load_trace_set
from tracegen import ConfigError, ModelSpec, Strategy, generate

MODEL = ModelSpec(name="scen", num_layers=4, hidden_size=512, num_attention_heads=8,
                  ffn_hidden_size=2048, vocab_size=2048, seq_len=512, activation="gelu")
H100 = get_system("dgx-h100")
# Two GPUs per node, so a data-parallel group of 2 crosses the NICs while TP pairs stay inside.
TWO_PER_NODE = dataclasses.replace(H100, node=dataclasses.replace(H100.node, gpus_per_node=2))


def _set(tmp: Path, **kw: int) -> Path:
    s = Strategy(micro_batch_size=1, global_batch_size=4 * kw.get("dp", 1), **kw)
    generate(MODEL, s, tmp, mode="full")
    return tmp


def _scenario(tmp: Path, text: str) -> Path:
    f = tmp / "scenario.toml"
    f.write_text(text)
    return f


def test_slow_gpu_in_a_tp_group_slows_the_whole_step(tmp_path: Path) -> None:
    d = _set(tmp_path / "t", tp=2)
    healthy = replay(d, H100)
    slow = replay(d, H100, scenario=_scenario(tmp_path, "[[straggler]]\nranks = [1]\n"
                                                        "slowdown = 2.0\n"))
    compute = healthy.breakdown.filter(pl.col("rank") == 1)["compute_s"].item()
    # Every TP collective waits for rank 1, so the step grows by its extra compute time — less
    # what hides under the input-gradient all-reduces that run alongside rank 1's weight-gradient
    # GEMMs (Megatron's asynchronous backward).
    # (the healthy set is symmetric and folded to rank 0, whose program rank 1 shares)
    tl = healthy.timeline.filter(pl.col("name").str.contains(r"L\d+\.ln\d_in_grad_ar"))
    alongside = float((tl["end_s"] - tl["start_s"]).sum())
    assert alongside > 0
    growth = slow.step_time_s - healthy.step_time_s
    assert compute - alongside <= growth <= compute * (1 + 1e-9)
    assert set(slow.waits["last_rank"].unique()) == {1}


def test_slow_gpu_in_one_dp_replica_stalls_everyone_at_gradient_sync(tmp_path: Path) -> None:
    d = _set(tmp_path / "d", dp=2)
    healthy = replay(d, H100)
    slow = replay(d, H100, scenario=_scenario(tmp_path, "[[straggler]]\nranks = [1]\n"
                                                        "slowdown = 2.0\n"))
    b = slow.breakdown
    compute0 = b.filter(pl.col("rank") == 0)["compute_s"].item()
    compute1 = b.filter(pl.col("rank") == 1)["compute_s"].item()
    assert compute1 == pytest.approx(2 * compute0, rel=0.01)
    # Rank 0 computes at full speed, then waits at the gradient all-reduce for rank 1.
    wait0 = b.filter(pl.col("rank") == 0)["collective_wait_s"].item()
    assert wait0 >= 0.9 * (compute1 - compute0) * 0.5
    colls = slow.timeline.filter(pl.col("kind") == "COMM_COLL_NODE")
    last = colls.group_by("rank").agg(pl.col("end_s").max())["end_s"].to_list()
    assert last[0] == pytest.approx(last[1])  # the gradient sync ends together on both
    assert set(slow.waits["last_rank"].unique()) == {1}
    assert slow.step_time_s > healthy.step_time_s + 0.9 * (compute1 - compute0) * 0.5


def test_degraded_nic_slows_exactly_the_collectives_that_cross_it(tmp_path: Path) -> None:
    d = _set(tmp_path / "n", tp=2, dp=2)  # ranks 0,1 on node 0; 2,3 on node 1
    healthy = replay(d, TWO_PER_NODE)
    degraded = replay(d, TWO_PER_NODE, scenario=_scenario(
        tmp_path, "[[link]]\nnodes = [1]\ntier = \"nic\"\nbandwidth_factor = 0.25\n"))

    def durations(res):  # type: ignore[no-untyped-def]
        t = res.timeline.filter(pl.col("kind") == "COMM_COLL_NODE")
        return t.with_columns((pl.col("end_s") - pl.col("start_s")).alias("d")).select(
            ["rank", "name", "stream", "d"])

    h, g = durations(healthy), durations(degraded)
    both = h.join(g, on=["rank", "name", "stream"], suffix="_deg")
    axis = {f"comm:{k}": v for k, v in load_trace_set(d).group_axis.items()}
    both = both.with_columns(pl.col("stream").replace_strict(axis).alias("axis"))
    tp = both.filter(pl.col("axis") == "tp")
    dp = both.filter(pl.col("axis") == "dp")
    assert tp.height and dp.height
    assert (tp["d_deg"] - tp["d"]).abs().max() < 1e-9  # NVLink-only collectives untouched
    assert (dp["d_deg"] > dp["d"] * 1.5).all()  # every cross-node collective slowed


def test_half_a100_half_h100(tmp_path: Path) -> None:
    """Each rank computes at its own GPU's speed: the A100 rank as in an all-A100 run, the H100
    rank as in an all-H100 run (within 5%: interference follows the collectives' timing), and
    the A100 one clearly slower (this small model's GEMMs: ~1.25×)."""
    d = _set(tmp_path / "h", dp=2)
    res = replay(d, H100, scenario=_scenario(
        tmp_path, "[[gpu]]\nranks = [1]\nsystem = \"dgx-a100-80gb\"\n"))
    b = res.breakdown
    mixed = [b.filter(pl.col("rank") == r)["compute_s"].item() for r in (0, 1)]
    alone = [replay(d, get_system(n)).breakdown.filter(pl.col("rank") == r)["compute_s"].item()
             for r, n in ((0, "dgx-h100"), (1, "dgx-a100-80gb"))]
    assert mixed == pytest.approx(alone, rel=0.05)
    assert mixed[1] > 1.2 * mixed[0]
    assert res.metrics["scenario"] == "scenario"


def test_fault_events_have_their_own_perfetto_track(tmp_path: Path) -> None:
    d = _set(tmp_path / "p", tp=2)
    res = replay(d, H100, scenario=_scenario(
        tmp_path, "[[straggler]]\nranks = [0]\nslowdown = 1.5\nstart_s = 0.0\nend_s = 0.001\n"))
    res.to_perfetto(tmp_path / "t.json")
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    faults = [e for e in events if e.get("cat") == "fault"]
    assert faults and all(e["pid"] == -1 for e in faults)
    assert any(e.get("args", {}).get("name") == "faults" for e in events if e["ph"] == "M")


@pytest.mark.parametrize(("text", "message"), [
    ("[[straggler]]\nranks = [9]\nslowdown = 2.0\n", r"rank\(s\) \[9\] not in the world of 2"),
    ("[[straggler]]\nranks = [0]\nslowdown = 0.5\n", "slowdown 0.5 < 1 would make the rank faster"),
    ("[[link]]\nranks = [0]\nbandwidth_factor = 1.5\n", r"bandwidth_factor is a fraction"),
    ("[[link]]\nranks = [0]\ntier = \"pcie\"\nbandwidth_factor = 0.5\n", "tier must be 'nic', 'nvlink' or 'switch'"),
    ("[[straggler]]\nranks = [0]\nslowdown = 2.0\nspeed = 3\n", r"\[\[straggler\]\]: unknown key 'speed' "
                                                               r"\(known keys: "),
    ("[[straggler]]\nranks = [0]\nslowdwn = 2.0\n", r"unknown key 'slowdwn' \(did you mean 'slowdown'\?"),
    ("[[stragglers]]\nranks = [0]\n", r"unknown section\(s\) \['stragglers'\]"),
    ("[[gpu]]\nranks = [0]\nsystem = \"tpu-v9\"\n", "no preset system named 'tpu-v9'"),
    ("[[straggler]]\nnodes = [0]\nranks = [0]\nslowdown = 2.0\n", "exactly one of ranks"),
    # found by fuzzing: each had raised from inside (TypeError, OverflowError)
    ("[[straggler]]\nranks = 1\nslowdown = 2.0\n", r"ranks must be a list of whole numbers"),
    ("[[link]]\nnodes = [0]\ntier = [\"nic\"]\nfailed = true\n", "tier must be 'nic'"),
    ("[[straggler]]\nranks = [0]\nslowdown = 1e300\n", r"slowdown = 1e\+300 is beyond any step"),
    ("[[straggler]]\nranks = [0]\nslowdown = 2.0\nend_s = inf\n", "end_s = inf is beyond"),
])
def test_bad_scenario_files(tmp_path: Path, text: str, message: str) -> None:
    d = _set(tmp_path / "b", tp=2)
    with pytest.raises(ConfigError, match=message):
        replay(d, H100, scenario=_scenario(tmp_path, text))


def test_random_stragglers_are_reproducible_and_fail_slow_windows_apply_only_inside(
        tmp_path: Path) -> None:
    from replay.scenario import scenario_from_dict

    def draw(seed: int):  # type: ignore[no-untyped-def]
        return scenario_from_dict({"random_stragglers": [{"fraction": 0.5, "seed": seed}]},
                                  name="r", world_size=8, gpus_per_node=8,
                                  simulated=set(range(8)))

    assert draw(3) == draw(3)
    assert len(draw(3).episodes) == 4 and all(1 <= e.slowdown <= 2 for e in draw(3).episodes)
    window = scenario_from_dict({"straggler": [{"ranks": [2], "slowdown": 3.0, "start_s": 1.0,
                                                "end_s": 2.0}]}, name="w", world_size=8,
                                gpus_per_node=8, simulated=set(range(8)))
    assert window.slowdown(2, 999_999_999) == 1.0
    assert window.slowdown(2, 1_500_000_000) == 3.0
    assert window.slowdown(2, 2_000_000_000) == 1.0
    assert window.slowdown(1, 1_500_000_000) == 1.0


def test_failed_link_uses_the_surviving_path(tmp_path: Path) -> None:
    from replay.scenario import scenario_from_dict

    s = scenario_from_dict({"link": [{"nodes": [1], "tier": "nic", "failed": True}]},
                           name="f", world_size=16, gpus_per_node=8, simulated=set(range(16)))
    assert {lf.rank for lf in s.links} == set(range(8, 16))
    assert all(lf.factor == 0.5 and lf.tier == "nic" for lf in s.links)
    d = _set(tmp_path / "f", tp=2, dp=2)
    failed = replay(d, TWO_PER_NODE, scenario=_scenario(
        tmp_path, "[[link]]\nnodes = [1]\ntier = \"nic\"\nfailed = true\n"))
    healthy = replay(d, TWO_PER_NODE)
    assert failed.step_time_s > healthy.step_time_s


def test_a_rank_on_another_gpu_takes_that_gpus_interference(tmp_path: Path) -> None:
    """Interference is per GPU: a rank moved to an MI300X (no measurement, κ 0) loses no
    compute to the collectives beside it, while its H100 peers (κ 0.189) do."""
    d = _set(tmp_path / "k", tp=2)
    res = replay(d, H100, scenario=_scenario(
        tmp_path, "[[gpu]]\nranks = [1]\nsystem = \"mi300x\"\n"))
    lost = dict(zip(res.breakdown["rank"], res.breakdown["interference_s"], strict=True))
    assert lost[0] > 0 and lost[1] == 0


@pytest.mark.parametrize("section", ["[[straggler]]\nslowdown = 1.5",
                                     '[[gpu]]\nsystem = "dgx-a100-80gb"'])
def test_a_representative_set_takes_whole_stages_by_node_or_refuses(tmp_path: Path,
                                                                     section: str) -> None:
    """One rank stands for its stage in a representative-mode set. Nodes holding a whole stage
    perturb it exactly as the full-mode set with the same nodes replays (every rank); nodes
    holding part of a stage are refused (they had perturbed the whole stage, or, holding no
    representative, nothing at all: a slow node had cost nothing)."""
    s = Strategy(tp=2, pp=2, dp=2, micro_batch_size=1, global_batch_size=8)
    generate(MODEL, s, tmp_path / "rep", mode="representative")
    generate(MODEL, s, tmp_path / "full", mode="full")
    whole = _scenario(tmp_path, f"{section}\nnodes = [2, 3]\n")  # stage 1: ranks 4–7
    rep = replay(tmp_path / "rep", TWO_PER_NODE, scenario=whole).metrics
    full = replay(tmp_path / "full", TWO_PER_NODE, scenario=whole).metrics
    healthy = replay(tmp_path / "rep", TWO_PER_NODE).metrics["step_time_s"]
    assert rep["step_time_s"] == pytest.approx(full["step_time_s"], rel=1e-9)
    assert rep["step_time_s"] > healthy * 1.05
    # a representative counts as its whole stage in the cluster's GPU mix (and MFU's peak)
    assert rep.get("gpu_mix") == full.get("gpu_mix")
    assert rep["mfu"] == pytest.approx(full["mfu"], rel=1e-9)
    for nodes in ("[2]", "[3]"):  # half of stage 1: node 3 holds no representative
        part = _scenario(tmp_path, f"{section}\nnodes = {nodes}\n")
        with pytest.raises(ConfigError, match=r"hold 2 of the 4 ranks \(4–7, nodes 2–3\)"):
            replay(tmp_path / "rep", TWO_PER_NODE, scenario=part)
        assert replay(tmp_path / "full", TWO_PER_NODE, scenario=part).metrics[
            "step_time_s"] > healthy * 1.02  # the full-mode set perturbs just those ranks
    drawn = _scenario(tmp_path, "[[random_stragglers]]\nfraction = 0.25\n")
    with pytest.raises(ConfigError, match="draws individual ranks"):
        replay(tmp_path / "rep", TWO_PER_NODE, scenario=drawn)


def test_a_mixed_cluster_fits_only_where_each_ranks_own_gpu_holds_its_stage(
        tmp_path: Path) -> None:
    """Memory is checked per rank against the GPU that rank runs on (a stage that fits in an
    H100's 80 GiB may not fit a smaller GPU), and MFU is against the cluster's mean peak."""
    s = Strategy(pp=2, micro_batch_size=1, global_batch_size=4)
    d = tmp_path / "p"
    generate(MODEL, s, d, mode="full")
    need = {st["stage"]: st["memory"]["total_GiB"]
            for st in json.loads((d / "manifest.json").read_text())["stages"]}
    small = tmp_path / "small.toml"  # an H100 with memory between the two stages' needs
    cap = (need[0] + need[1]) / 2
    small.write_text((Path(__file__).parents[1] / "replay/systems/dgx-h100.toml").read_text()
                     .replace("hbm_GiB = 80", f"hbm_GiB = {cap}"))
    big_stage = max(need, key=need.__getitem__)
    healthy = replay(d, H100).metrics
    on = {}
    for stage in (0, 1):
        sc = _scenario(tmp_path, f'[[gpu]]\nranks = [{stage}]\nsystem = "{small}"\n')
        on[stage] = replay(d, H100, scenario=sc).metrics
    assert healthy["fits"] and "memory_short" not in healthy
    assert not on[big_stage]["fits"] and on[1 - big_stage]["fits"]
    short = on[big_stage]["memory_short"]
    assert short == [{"system": str(small), "hbm_GiB": cap, "ranks": 1,
                      "need_GiB": need[big_stage]}]
    assert on[big_stage]["gpu_mix"] == {str(small): 1, "dgx-h100": 1}
    # the same peak on both GPU types: MFU is unchanged; on an A100 half the cluster's peak
    # is 312/989 of the H100's, so MFU rises by the mean peak's ratio at the same step time
    a100 = replay(d, H100, scenario=_scenario(
        tmp_path, '[[gpu]]\nranks = [0]\nsystem = "dgx-a100-80gb"\n')).metrics
    mean = (get_system("dgx-a100-80gb").gpu.peak_flop_per_s("bf16")
            + H100.gpu.peak_flop_per_s("bf16")) / 2
    assert a100["mfu"] == pytest.approx(
        a100["tokens_per_s"] / healthy["tokens_per_s"] * healthy["mfu"]
        * H100.gpu.peak_flop_per_s("bf16") / mean, rel=1e-12)


def test_a_slow_nic_on_a_mixed_cluster_slows_its_own_systems_link() -> None:
    """Ranks 0-7 on an H100 node (400 Gb/s NICs), 8-15 on an A100 node (200 Gb/s). A send
    across moves at the slower end: healthy the A100's; with rank 0's NIC at a quarter
    (100 Gb/s) the H100's slowed; with rank 8's at a quarter (50 Gb/s) the A100's slowed, and
    an all-reduce among the A100 ranks too, while one among the H100 ranks is untouched."""
    from replay.network import AlphaBetaNetwork
    from replay.scenario import DegradedNetwork, LinkFault, MixedNetwork, tiers_slowed

    h100, a100 = get_system("dgx-h100"), get_system("dgx-a100-80gb")
    a100_net = AlphaBetaNetwork(a100)
    mixed = MixedNetwork(AlphaBetaNetwork(h100), dict.fromkeys(range(8, 16), a100_net))
    size = 64 << 20
    assert mixed.p2p(0, 8, size) == a100_net.p2p(0, 8, size)

    def slowed(rank: int) -> DegradedNetwork:
        return DegradedNetwork(mixed, (LinkFault(rank, "nic", 0.25, 0),))

    slow_h100 = AlphaBetaNetwork(tiers_slowed(h100, 0.25, 1.0))
    slow_a100 = AlphaBetaNetwork(tiers_slowed(a100, 0.25, 1.0))
    assert slowed(0).p2p(0, 8, size).transfer_ns == slow_h100.p2p(0, 8, size).transfer_ns
    assert slowed(8).p2p(0, 8, size).transfer_ns == slow_a100.p2p(0, 8, size).transfer_ns
    assert slow_a100.p2p(0, 8, size).transfer_ns > slow_h100.p2p(0, 8, size).transfer_ns
    a100_ring = tuple(range(8, 16))
    assert slowed(8).collective("ALL_REDUCE", size, a100_ring).transfer_ns == \
        mixed.collective("ALL_REDUCE", size, a100_ring).transfer_ns  # inside a node: no NIC
    across = (0, 8)
    assert slowed(8).collective("ALL_REDUCE", size, across).transfer_ns == \
        slow_a100.collective("ALL_REDUCE", size, across).transfer_ns


@pytest.mark.parametrize("name", [
    *system_names(),
    "dgx-h100@flashattention-2"])
def test_a_system_written_as_a_file_reads_back_equal(tmp_path: Path, name: str) -> None:
    """``system_toml``: what a mixed study's replay writes beside its traces for the other
    system (a Dask worker elsewhere cannot see the study's own file). Every preset, a system
    with an earlier attention kernel, and one with overrides and a quote in its text."""
    spec = resolve_system(name)
    odd = spec.with_overrides({"scaleout.nic_Gbps_per_gpu": 123.5, "gpu.launch_overhead_us": 1e-3})
    for s in (spec, dataclasses.replace(odd, description='a "quoted"\nline — ünïcode')):
        path = tmp_path / "sys.toml"
        path.write_text(system_toml(s), encoding="utf-8")
        assert resolve_system(path) == s
