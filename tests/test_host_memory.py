"""Host memory (``NodeSpec.host_memory_GiB``): what offloading keeps there per rank
(``tracegen.memory.host_bytes``) against Megatron-Core's HybridDeviceOptimizer and Transformer
Engine's offload handler, a host's ranks summed in Megatron's rank order, the verdict in the
fast path, in replay and in ``trainsim estimate``, and the fit hints that offload less where a
host is short."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.fastpath import estimate
from analysis.glance import fit_hint, glance
from replay import get_system, replay
from replay.hardware import SystemSpec, resolve_system
from tests.test_cli import run
from tracegen import ConfigError, ModelSpec, Strategy, generate, resolve_model
from tracegen import memory as M
from tracegen.catalog import get_model
from tracegen.mesh import Mesh
from tracegen.units import GiB

MODEL = ModelSpec(name="tiny", num_layers=6, hidden_size=1024, num_attention_heads=16,
                  ffn_hidden_size=4096, vocab_size=8192, seq_len=2048, activation="gelu")
# Llama 3 70B under FSDP on GB200 at 2 × 8,192 tokens a micro-batch (tests/test_cpu_offload.py)
LLAMA = dataclasses.replace(get_model("llama3-70b"), seq_len=8192)
FSDP = Strategy(dp=64, micro_batch_size=2, global_batch_size=256, zero_stage=3,
                zero3_prefetch=True, precision="fp8")


def _node(system: str, **kw: float) -> SystemSpec:
    spec = get_system(system)
    return dataclasses.replace(spec, node=dataclasses.replace(spec.node, **kw))


def test_the_offloaded_optimizer_takes_16_bytes_a_parameter_on_the_host() -> None:
    """HybridDeviceOptimizer pins a host copy of each offloaded fp32 master parameter and a
    buffer for its fp32 gradient, and its CPU AdamW keeps m and v: 16 bytes a parameter of the
    shard's offloaded share, twice the 8 the GPU frees (Megatron-Bridge's 15.3 GB for
    Qwen3-30B-A3B's 1.91 B-parameter shard at tp 2, pp 2, ep 4: tests/test_optimizer_offload.py)."""
    m = resolve_model("qwen3-30b-a3b@seq4096")
    s = Strategy(tp=2, pp=2, ep=4, dp=4, micro_batch_size=1, global_batch_size=8,
                 sequence_parallel=True, zero_stage=1)
    g = {f: glance(m, dataclasses.replace(s, optimizer_offload_fraction=f), "dgx-h100")
         for f in (0.0, 0.25, 1.0)}
    host = {f: [x.memory.host_bytes for x in g[f].stages] for f in g}
    freed = [a.memory.optimizer_bytes - b.memory.optimizer_bytes
             for a, b in zip(g[0.0].stages, g[1.0].stages, strict=True)]
    assert host[0.0] == [0, 0]
    assert host[1.0] == [pytest.approx(2 * f, rel=1e-6) for f in freed]
    assert max(host[1.0]) == pytest.approx(2 * 15.3e9, rel=0.01)
    assert host[0.25] == [pytest.approx(h / 4, rel=1e-6) for h in host[1.0]]
    # eight ranks a DGX, all of one stage (tp·dp·... = 16 ranks a stage): 8 × the busier one
    assert g[1.0].peak_host_memory_GiB == pytest.approx(8 * max(host[1.0]) / GiB, rel=1e-9)
    assert g[1.0].host_capacity_GiB == 2048 and g[1.0].fits


@pytest.mark.parametrize("n", [1, 3, 5])
def test_every_offloaded_layer_sits_on_the_host_at_the_forwards_end(n: int) -> None:
    """Transformer Engine copies each offloaded activation into a host tensor of its own and
    frees it on the reload: at the forward's end all N layers are there, the GPU short of all
    but the one still in flight (N − 1 layers: ``offloaded_bytes``)."""
    s = Strategy(tp=2, dp=2, micro_batch_size=1, global_batch_size=6, sequence_parallel=True,
                 cpu_offload_layers=n)
    act = M.activation_bytes_per_layer(MODEL, s)
    got = M.estimate(MODEL, s, 0, 10**8, act_per_layer=act)
    assert got.host_bytes == n * act == M.offloaded_bytes(MODEL, s, act) + act
    assert got.to_dict()["host_GiB"] == n * act / GiB
    gpu = {k: v for k, v in dataclasses.asdict(got).items() if k != "host_bytes"}
    assert got.total_bytes == sum(gpu.values())  # (the host's is not the GPU's)


@settings(max_examples=60, deadline=None)
@given(tp=st.sampled_from([1, 2, 4, 8]), cp=st.sampled_from([1, 2]),
       dp=st.sampled_from([1, 2, 3, 4]), pp=st.sampled_from([1, 2, 3, 4]),
       host=st.sampled_from([1, 2, 4, 8, 16]),
       per_stage=st.lists(st.integers(0, 10**12), min_size=4, max_size=4))
def test_a_hosts_ranks_are_summed_in_megatrons_rank_order(
        tp: int, cp: int, dp: int, pp: int, host: int, per_stage: list[int]) -> None:
    """The most any host holds equals a rank-by-rank count: each rank's stage from the mesh
    (``Mesh.coord``), ``host`` consecutive ranks a host (the last one partly filled)."""
    s = Strategy(tp=tp, cp=cp, dp=dp, pp=pp, micro_batch_size=1, global_batch_size=dp * pp)
    mesh = Mesh(s)
    totals: dict[int, int] = {}
    for r in range(s.world_size):
        totals[r // host] = totals.get(r // host, 0) + per_stage[mesh.coord(r).pp]
    assert M.host_peak_bytes(per_stage[:pp], s, host) == max(totals.values())


def test_full_offload_of_llama3_70b_overfills_a_gb200_tray() -> None:
    """Offloading 79 of Llama 3 70B's layers at 2 × 8,192 tokens frees the GPU (43 GiB of
    186) but puts 79 layers' 3.6 GiB on the host for each of a tray's four GPUs — more than
    its two Graces' 894 GiB: no fit, and the hint offloads the least count the GPU holds
    (what it offers from no offloading at all), which the host holds too."""
    system = get_system("gb200-nvl72")
    s = dataclasses.replace(FSDP, cpu_offload_layers=79)
    act = M.activation_bytes_per_layer(LLAMA, s)
    est, g = estimate(LLAMA, s, system), glance(LLAMA, s, system)
    assert est.peak_memory_GiB < 186 and not est.fits and est.host_short
    assert g.peak_host_memory_GiB == pytest.approx(4 * 79 * act / GiB, rel=1e-9)
    assert g.peak_host_memory_GiB > 894
    hint = fit_hint(LLAMA, s, system)
    assert hint is not None and hint == fit_hint(LLAMA, FSDP, system)
    k = hint["cpu_offload_layers"]
    assert 4 * k * act / GiB <= 894 and estimate(
        LLAMA, dataclasses.replace(FSDP, cpu_offload_layers=k), system).fits
    unsaid = _node("gb200-nvl72", host_memory_GiB=0.0)  # a system that does not say: no check
    assert estimate(LLAMA, s, unsaid).fits


def test_the_optimizer_hint_offloads_less_where_the_host_is_short() -> None:
    """Optimizer offloading at all of the shard on a host too small for it: the hint
    offers the least quarter the GPU needs, where the host holds it."""
    s = Strategy(tp=8, dp=4, sequence_parallel=True, micro_batch_size=1, global_batch_size=32,
                 zero_stage=1, recompute="full")
    model = resolve_model("llama3-70b")
    need = {f: glance(model, dataclasses.replace(s, optimizer_offload_fraction=f),
                      "dgx-h100").peak_host_memory_GiB for f in (0.25, 1.0)}
    small = _node("dgx-h100", host_memory_GiB=(need[0.25] + need[1.0]) / 2)
    full = dataclasses.replace(s, optimizer_offload_fraction=1.0)
    assert estimate(model, full, "dgx-h100").fits
    assert not estimate(model, full, small).fits and estimate(model, full, small).host_short
    hint = fit_hint(model, full, small)
    assert hint is not None and hint["optimizer_offload_fraction"] == 0.25
    assert hint == fit_hint(model, s, small)  # (the GPU needs a quarter: the fifty-ninth's)


def test_replay_gives_the_fast_paths_host_verdict(tmp_path: Path) -> None:
    """A pipeline of two stages on one host: replay sums both stages' ranks from the trace
    set's manifest (its ``host_GiB`` a stage) as the fast path does, and says no fit where the
    host holds less."""
    s = Strategy(dp=2, pp=2, micro_batch_size=1, global_batch_size=4, zero_stage=1,
                 optimizer_offload_fraction=0.5)
    generate(MODEL, s, tmp_path, mode="representative", gpus=4)
    g = glance(MODEL, s, "dgx-h100")
    stages = json.loads((tmp_path / "manifest.json").read_text())["stages"]
    per = [st_["memory"]["host_GiB"] for st_ in stages]
    assert per == pytest.approx([x.memory.host_bytes / GiB for x in g.stages], rel=1e-12)
    got = replay(tmp_path, "dgx-h100").metrics
    assert got["peak_host_memory_GiB"] == pytest.approx(2 * sum(per), rel=1e-12)
    assert got["peak_host_memory_GiB"] == pytest.approx(g.peak_host_memory_GiB, rel=1e-12)
    assert got["fits"] and g.fits
    small = _node("dgx-h100", host_memory_GiB=got["peak_host_memory_GiB"] * 0.99)
    assert not replay(tmp_path, small).metrics["fits"]
    assert not estimate(MODEL, s, small).fits


def test_estimate_says_what_a_host_holds(tmp_path: Path) -> None:
    r = run("estimate", "--model", "llama3-70b@seq8192", "--system", "gb200-nvl72",
            "--gpus", "64", "--mbs", "2", "--gbs", "256", "--zero", "3", "--zero3-prefetch",
            "--precision", "fp8", "--cpu-offload-layers", "79", "--json",
            str(tmp_path / "e.json"))
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "e.json").read_text())
    assert not out["fits"] and out["host_capacity_GiB"] == 894
    assert out["peak_host_memory_GiB"] > 894 and out["fit_hint"]["cpu_offload_layers"] < 79
    text = " ".join(r.stdout.split())
    assert "fits in 186 GiB" in text  # the GPU's own memory holds it
    assert "DOES NOT FIT in 894 GiB" in text and "--cpu-offload-layers" in text


def test_a_bad_host_memory_is_said_with_its_fix(tmp_path: Path) -> None:
    text = (Path(__file__).parents[1] / "replay/systems/dgx-h100.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("host_memory_GiB = 2048", "host_memory_GiB = -1"))
    with pytest.raises(ConfigError, match=r"host_memory_GiB must be ≥ 0 \(0: absent"):
        resolve_system(bad)


def test_a_sweep_row_says_the_host_is_what_is_short() -> None:
    """A study's row for a strategy whose offloading overfills a host: no fit, and its status
    says why (its GPU memory is under the GPU's, so the peak alone would not)."""
    from analysis.compare import evaluate_strategy
    from analysis.study import study_from_dict

    study = study_from_dict({"model": "llama3-70b@seq8192", "system": "gb200-nvl72",
                             "gpus": 64, "global_batch_size": 256})
    row = evaluate_strategy(study, dataclasses.replace(FSDP, cpu_offload_layers=79),
                            replay_it=False)
    assert not row["fits"] and row["peak_memory_GiB"] < 186
    assert row["status"] == "does not fit: offloading overfills a host's memory"
    row = evaluate_strategy(study, dataclasses.replace(FSDP, cpu_offload_layers=42),
                            replay_it=False)
    assert row["fits"] and row["status"] == "screened"


def test_on_a_mixed_cluster_each_systems_hosts_hold_its_own_stages() -> None:
    """Stage 1 on another system: its ranks fill that system's hosts and only theirs, so a
    small host there fails the fit whatever the base hosts hold, and the base system's hosts
    are checked on stage 0's ranks alone."""
    from analysis.fastpath import estimate_stages

    s = Strategy(tp=2, dp=4, pp=2, micro_batch_size=1, global_batch_size=8, zero_stage=1,
                 optimizer_offload_fraction=1.0)
    g = glance(MODEL, s, "dgx-h100")
    per = [x.memory.host_bytes / GiB for x in g.stages]  # 8 ranks a stage: one host each
    roomy = _node("dgx-h100", host_memory_GiB=8 * max(per) * 1.01)
    tight = _node("dgx-h100", host_memory_GiB=8 * per[1] * 0.99)
    assert estimate_stages(MODEL, s, roomy, {1: roomy}).fits
    short = estimate_stages(MODEL, s, roomy, {1: tight})
    assert not short.fits and short.host_short
    assert not estimate_stages(MODEL, s, tight, {1: roomy}).fits  # (stage 0 on the base)
    only_stage1 = _node("dgx-h100", host_memory_GiB=8 * per[0] * 1.01)
    assert estimate_stages(MODEL, s, only_stage1, {1: roomy}).fits
