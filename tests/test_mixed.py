"""A pipeline over mixed GPU generations (``analysis.mixed``, ``estimate --stage-system``):
against replay with a ``[[gpu]]`` scenario on the same whole stages, each stage's memory
against its own GPU, and the option's errors."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.fastpath import estimate
from analysis.mixed import balanced_layout, layout_text, mixed_estimate, parse_stage_systems
from replay import get_system, replay
from tracegen import ConfigError, ModelSpec, Strategy, generate
from tracegen.layout import parse_layout

H100 = get_system("dgx-h100")
A100 = get_system("dgx-a100-80gb")
MODEL = ModelSpec(name="mx", num_layers=8, hidden_size=2048, num_attention_heads=16,
                  ffn_hidden_size=8192, vocab_size=32000, seq_len=2048, activation="swiglu")


@pytest.mark.parametrize("kw", [dict(tp=2, pp=2, dp=2), dict(tp=1, pp=4, dp=2),
                                dict(tp=1, pp=4, dp=1, vpp=2, schedule="interleaved_1f1b"),
                                dict(tp=2, pp=1, dp=4)])
def test_mixed_stages_against_replay_with_those_stages_on_the_other_gpu(
        tmp_path: Path, kw: dict) -> None:
    """Within 1% of replay (found within 0.1%: the schedule walked with the stages unequal;
    the pipeline bound it replaced had been up to 9% above for the first of four stages),
    and every stage on one system exactly that system's estimate. Replay's A100 ranks move
    their data over the A100 nodes' own links (``MixedNetwork``), as the estimate costs
    their stages' collectives on dgx-a100-80gb (before, replay swapped their compute only and
    this test gave the estimate A100 GPUs on H100 links)."""
    s = Strategy(micro_batch_size=1, global_batch_size=8 * kw["dp"],
                 sequence_parallel=kw["tp"] > 1, **kw)
    generate(MODEL, s, tmp_path, mode="representative")
    reps = sorted(int(p.name.split(".")[1]) for p in tmp_path.glob("*.et"))
    for stages in ({0}, {s.pp - 1}, set(range(s.pp // 2 or 1)), set(range(s.pp))):
        got = mixed_estimate(MODEL, s, H100, {j: A100 for j in stages})
        sc = tmp_path / "gpu.toml"
        sc.write_text(f'[[gpu]]\nranks = {[reps[j] for j in sorted(stages)]}\n'
                      'system = "dgx-a100-80gb"\n')
        ref = replay(tmp_path, H100, scenario=sc).step_time_s
        assert got.step_time_s == pytest.approx(ref, rel=0.01), stages
        if len(stages) == s.pp:
            assert got.step_time_s == estimate(MODEL, s, A100).step_time_s
        assert got.stage_systems == tuple("dgx-a100-80gb" if j in stages else "dgx-h100"
                                          for j in range(s.pp))


def test_each_stage_fits_or_not_on_its_own_gpu_and_mfu_is_against_the_mean_peak() -> None:
    s = Strategy(tp=1, pp=2, dp=4, micro_batch_size=1, global_batch_size=32)
    base = estimate(MODEL, s, H100)
    small = dataclasses.replace(A100, name="a100-tiny",
                                gpu=dataclasses.replace(A100.gpu, hbm_GiB=2.0))
    got = mixed_estimate(MODEL, s, H100, {1: small})
    assert got.stage_capacity_GiB == (80.0, 2.0)
    assert max(got.stage_memory_GiB) == pytest.approx(base.peak_memory_GiB, rel=1e-9)
    assert not got.fits and got.stage_memory_GiB[1] > 2.0
    same = mixed_estimate(MODEL, s, H100, {})
    mean_peak = (H100.gpu.peak_flop_per_s("bf16") + A100.gpu.peak_flop_per_s("bf16")) / 2
    assert got.mfu / same.mfu == pytest.approx(
        same.step_time_s / got.step_time_s * H100.gpu.peak_flop_per_s("bf16") / mean_peak,
        rel=1e-9)
    assert same.step_time_s == base.step_time_s and same.fits


@pytest.mark.parametrize(("items", "message"), [
    (["0-3"], "give STAGE=SYSTEM or FIRST-LAST=SYSTEM"),
    (["x=dgx-h100"], "give STAGE=SYSTEM"),
    (["2-5=dgx-h100"], "stages run from 0 to 3"),
    (["3-1=dgx-h100"], "first ≤ last"),
    (["0-1=dgx-h100", "1=dgx-b200"], "stage 1 is given two systems"),
])
def test_bad_stage_systems_are_named(items: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_stage_systems(items, 4)


def test_estimate_cli_prints_and_writes_the_mixed_cluster(tmp_path: Path) -> None:
    out = tmp_path / "e.json"
    r = subprocess.run([sys.executable, "-m", "analysis.cli", "estimate", "--model", "llama3-8b",
                        "--gpus", "32", "--tp", "2", "--pp", "4", "--sp", "--mbs", "1", "--gbs",
                        "64", "--system", "dgx-h100", "--stage-system", "0-1=dgx-a100-80gb",
                        "--json", str(out)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    mixed = json.loads(out.read_text())["mixed"]
    assert mixed["stage_systems"] == ["dgx-a100-80gb"] * 2 + ["dgx-h100"] * 2
    assert mixed["step_time_s"] > mixed["base_step_time_s"] and mixed["fits"]
    assert f"mixed cluster: step time {mixed['step_time_s']:.4f} s" in r.stdout
    balanced = mixed["balanced"]
    assert balanced["step_time_s"] < mixed["step_time_s"]
    assert f"--pipeline-layout '{balanced['pipeline_layout']}'" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "analysis.cli", "estimate", "--model",
                          "llama3-8b", "--gpus", "32", "--pp", "4", "--mbs", "1", "--gbs", "64",
                          "--system", "dgx-h100", "--stage-system", "0=dgx-z9"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "dgx-z9" in bad.stderr + bad.stdout
    assert "Traceback" not in bad.stderr


@pytest.mark.parametrize("kw", [{}, dict(vpp=2, schedule="interleaved_1f1b"),
                                dict(vpp=2, schedule="zb_v")])
def test_layers_split_by_the_stages_speeds_shorten_the_replayed_step(tmp_path: Path,
                                                                     kw: dict) -> None:
    """The slower GPUs' stages get fewer layers (Megatron-Core's pipeline layout; with
    interleaved chunks, spread over each stage's chunks, ZB-V's in their V): replay of that
    layout with the same stages on the A100s confirms the shorter step the estimate claims,
    within 1%."""
    model = dataclasses.replace(MODEL, num_layers=16)
    s = Strategy(tp=1, pp=4, dp=2, micro_batch_size=1, global_batch_size=64, **kw)
    slow = {0: A100, 1: A100}
    even = mixed_estimate(model, s, H100, slow)
    found = balanced_layout(model, s, H100, slow)
    assert found is not None
    bs, be = found
    chunks = parse_layout(bs.pipeline_layout)
    assert len(chunks) == 4 * s.vpp and sum(c.layers for c in chunks) == 16
    # stage j's chunks: j + 4c (interleaved), or j and 7 − j in ZB-V's V
    gcis = [[7 - j if c and s.schedule == "zb_v" else c * 4 + j for c in range(s.vpp)]
            for j in range(4)]
    layers = [sum(chunks[g].layers for g in gci) for gci in gcis]
    assert layers == [bs.stage_layers(16, j) for j in range(4)]
    assert layers[0] + layers[1] < layers[2] + layers[3]
    assert be.step_time_s < even.step_time_s * 0.9 and be.fits
    replayed = {}
    for name, strat in (("even", s), ("balanced", bs)):
        d = tmp_path / name
        generate(model, strat, d, mode="representative")
        reps = sorted(int(p.name.split(".")[1]) for p in d.glob("*.et"))
        sc = d / "gpu.toml"
        sc.write_text(f'[[gpu]]\nranks = {reps[:2]}\nsystem = "dgx-a100-80gb"\n')
        replayed[name] = replay(d, H100, scenario=sc).step_time_s
    assert replayed["balanced"] < replayed["even"] * 0.9
    assert be.step_time_s == pytest.approx(replayed["balanced"], rel=0.01)
    assert balanced_layout(model, dataclasses.replace(s, pp=1, dp=8, vpp=1, schedule="1f1b"),
                           H100, {}) is None
    assert layout_text([2, 3], mtp=1) == "Et*2|t*3mL"
    # stage 0: 1 + 2 (the chunk with the embedding takes less), stage 1: 3 + 2 (the loss's)
    assert layout_text([3, 5], vpp=2) == "Et|t*3|t*2|t*2L"
    assert layout_text([1, 1], vpp=2) == "E|t|t|L"  # one short: the end chunks, not empty
    assert layout_text([3, 5], vpp=2, v_shape=True) == "Et|t*3|t*2|t*2L"  # back to stage 0


def test_a_stage_system_named_as_the_base_one_is_still_its_own() -> None:
    """Estimates are kept per distinct system, by value: a copy of a preset's file keeps the
    preset's name, and had been costed as the preset (its stages' changes ignored)."""
    slow = dataclasses.replace(H100, gpu=dataclasses.replace(H100.gpu, peak_bf16_TFLOPs=300.0))
    s = Strategy(pp=2, dp=4, micro_batch_size=1, global_batch_size=32)
    assert slow.name == H100.name
    mixed = mixed_estimate(MODEL, s, H100, {0: slow})
    assert mixed.step_time_s > mixed.base_step_time_s * 1.3
    assert mixed.stage_time_s[0] > 2 * mixed.stage_time_s[1] * 0.9


def test_the_split_walk_takes_end_chunks_that_hold_no_layer_and_a_start_that_does_not_fit(
        ) -> None:
    """A layout whose first stage is the embedding alone (no layer: the per-layer time had
    divided by zero) and whose even split does not fit: the walk moves on while it does not
    fit (each move changes the stages' needs too) and keeps the layers' count."""
    s = Strategy(tp=1, pp=4, dp=2, micro_batch_size=1, global_batch_size=64,
                 pipeline_layout="E|t*4|t*4|L")
    slow = {1: A100}
    found = balanced_layout(MODEL, s, H100, slow)
    assert found is not None
    bs, be = found
    assert be.step_time_s < mixed_estimate(MODEL, s, H100, slow).step_time_s
    assert sum(c.layers for c in parse_layout(bs.pipeline_layout)) == MODEL.num_layers
    mtp_off_last = dataclasses.replace(s, pipeline_layout="E|t*4|t*4m|L")
    assert balanced_layout(dataclasses.replace(MODEL, mtp_layers=1), mtp_off_last, H100,
                           slow) is None


def test_a_mixed_clusters_transfers_move_over_each_systems_own_links() -> None:
    """A collective inside the A100 nodes on their links, one spanning both generations and a
    send between them at the slower end (the A100 nodes' 200 Gb/s NICs against 400)."""
    from replay.network import AlphaBetaNetwork
    from replay.scenario import MixedNetwork

    h, a = AlphaBetaNetwork(H100), AlphaBetaNetwork(A100)
    net = MixedNetwork(h, {r: a for r in range(16)})  # nodes 0 and 1 are A100 nodes
    size = 1 << 28
    inside = tuple(range(16))
    assert net.collective("ALL_REDUCE", size, inside) == a.collective("ALL_REDUCE", size, inside)
    across = tuple(range(8, 24))
    assert net.collective("ALL_REDUCE", size, across).total_ns == max(
        a.collective("ALL_REDUCE", size, across).total_ns,
        h.collective("ALL_REDUCE", size, across).total_ns)
    assert net.p2p(3, 17, size) == a.p2p(3, 17, size)
    assert a.p2p(3, 17, size).transfer_ns == pytest.approx(2 * h.p2p(3, 17, size).transfer_ns,
                                                            rel=0.05)
    assert net.p2p(17, 25, size) == h.p2p(17, 25, size)


def test_an_other_generation_stage_across_two_sites_pays_the_links_between_them(
        tmp_path: Path) -> None:
    """Sites are where the cluster's GPUs stand, by rank: an A100 stage straddling the base
    system's two sites (pp 3 of 16 GPUs, 24 a site: stage 1 is ranks 16–31) runs its
    data-parallel rings over the links between them (``hardware.on_sites_of``), in the fast
    path and in replay alike (within 1%; before, its own system had no sites, so it crossed
    for free) — slower than with an A100 system that says it stands on one site."""
    from replay.hardware import on_sites_of

    out = dataclasses.replace(H100.scaleout, site_gpus=24, site_Gbps_per_gpu=100.0,
                              site_latency_us=250.0)
    sites = dataclasses.replace(H100, name="two-sites", scaleout=out)
    s = Strategy(tp=2, pp=3, dp=8, micro_batch_size=1, global_batch_size=48,
                 sequence_parallel=True)
    model = dataclasses.replace(MODEL, num_layers=9)
    assert on_sites_of(A100, sites).scaleout.site_gpus == 24
    assert on_sites_of(A100, H100) is A100
    one_site = dataclasses.replace(A100, scaleout=dataclasses.replace(
        A100.scaleout, site_gpus=48, site_Gbps_per_gpu=200.0))
    assert on_sites_of(one_site, sites) is one_site
    got = mixed_estimate(model, s, sites, {1: A100}).step_time_s
    assert got > 1.02 * mixed_estimate(model, s, sites, {1: one_site}).step_time_s
    generate(model, s, tmp_path, mode="representative")
    reps = sorted(int(p.name.split(".")[1]) for p in tmp_path.glob("*.et"))
    sc = tmp_path / "gpu.toml"
    sc.write_text(f'[[gpu]]\nranks = [{reps[1]}]\nsystem = "dgx-a100-80gb"\n')
    assert got == pytest.approx(replay(tmp_path, sites, scenario=sc).step_time_s, rel=0.01)


@pytest.mark.parametrize("case", ["four-gpu-nodes", "param-gather"])
def test_a_stages_groups_and_gathers_are_its_own_systems(tmp_path: Path, case: str) -> None:
    """The cool-down walk shapes a stage's data-parallel groups on the stage's own system
    (nodes of four A100s: 16 ranks span four nodes, not two as on the base's; before, 18%
    below replay with the A100s on stage 0) and holds its first forward for its own
    parameter gathers (``overlap_param_gather``: before, the base's links and kernels, 0.5%
    below). Replay without link contention, the fast path's reference: within 0.1%."""
    from replay.hardware import system_toml

    other, kw = A100, dict(tp=1, pp=2, dp=16, global_batch_size=32)
    if case == "four-gpu-nodes":
        other = dataclasses.replace(A100, name="a100x4",
                                    node=dataclasses.replace(A100.node, gpus_per_node=4))
    else:
        kw = dict(tp=1, pp=2, dp=4, global_batch_size=16, zero_stage=1,
                  overlap_param_gather=True, overlap_grad_reduce=True)
    (tmp_path / "other.toml").write_text(system_toml(other))
    s = Strategy(micro_batch_size=1, **kw)
    generate(MODEL, s, tmp_path / "t", mode="representative")
    reps = sorted(int(p.name.split(".")[1]) for p in (tmp_path / "t").glob("*.et"))
    for st in (0, 1):
        got = mixed_estimate(MODEL, s, H100, {st: other}).step_time_s
        sc = tmp_path / "gpu.toml"
        sc.write_text(f'[[gpu]]\nranks = [{reps[st]}]\nsystem = "{tmp_path / "other.toml"}"\n')
        ref = replay(tmp_path / "t", H100, scenario=sc, contention=False).step_time_s
        assert got == pytest.approx(ref, rel=0.001), st
