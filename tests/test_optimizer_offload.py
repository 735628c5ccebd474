"""Optimizer offloading (``Strategy.optimizer_offload_fraction``, Megatron-Core
--optimizer-cpu-offload --optimizer-offload-fraction): its rules, the memory it frees against
Megatron-Bridge's measurement, the copies and CPU op the trace carries, their replay (a closed
form), the host CPU rate against its evidence, and the fast path against replay."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.fastpath import estimate
from analysis.glance import fit_hint, fit_hint_words
from replay import get_system, replay
from replay.hardware import SystemSpec
from replay.traceset import load_trace_set
from tests.test_cli import run
from tracegen import ConfigError, ModelSpec, Strategy, generate, resolve_model
from tracegen import memory as M
from tracegen import ops as O
from tracegen.dp_comm import sharded_params
from tracegen.errors import ReplayError
from tracegen.program import RoleProgram, offload_pieces
from tracegen.vocab import COMP_NODE, MEM_LOAD_NODE, MEM_STORE_NODE

MODEL = ModelSpec(name="tiny", num_layers=6, hidden_size=1024, num_attention_heads=16,
                  ffn_hidden_size=4096, vocab_size=8192, seq_len=2048, activation="gelu")
MOE = ModelSpec(name="tiny-moe", num_layers=4, hidden_size=1024, num_attention_heads=16,
                ffn_hidden_size=4096, vocab_size=8192, seq_len=1024, activation="swiglu",
                num_experts=8, experts_per_token=2, moe_ffn_hidden_size=1024)
# Qwen3-0.6B (Hugging Face config Qwen/Qwen3-0.6B: 28 layers of 1,024, 16 query and 8 KV heads
# of 128, SwiGLU 3,072, 151,936 tied tokens): 596 M parameters
QWEN3_06B = ModelSpec(name="qwen3-0.6b", num_layers=28, hidden_size=1024,
                      num_attention_heads=16, num_kv_heads=8, head_dim=128,
                      ffn_hidden_size=3072, vocab_size=151936, seq_len=4096,
                      activation="swiglu", tied_embeddings=True)


def _s(f: float, **kw: object) -> Strategy:
    base: dict[str, object] = {"tp": 2, "dp": 2, "micro_batch_size": 1, "global_batch_size": 8,
                               "sequence_parallel": True, "zero_stage": 1,
                               "optimizer_offload_fraction": f}
    base.update(kw)
    return Strategy(**base)  # type: ignore[arg-type]


def _node(system: str, **kw: float) -> SystemSpec:
    spec = get_system(system)
    return dataclasses.replace(spec, node=dataclasses.replace(spec.node, **kw))


def test_its_rules_are_said_with_their_fix() -> None:
    with pytest.raises(ConfigError, match=r"needs the distributed optimizer, zero_stage 1 or 2"):
        _s(0.5, zero_stage=0)
    with pytest.raises(ConfigError, match=r"ZeRO-3's offload is not modelled"):
        _s(0.5, zero_stage=3)
    with pytest.raises(ConfigError, match=r"in \(0, 1\], got 1.5; 0 turns it off"):
        _s(1.5)
    with pytest.raises(ConfigError, match=r"in \(0, 1\], got -0.2"):
        _s(-0.2)
    with pytest.raises(ConfigError, match=r"set adam_moments_dtype 'fp32'"):
        _s(0.5, adam_moments_dtype="bf16")
    with pytest.raises(ConfigError, match=r"host_cpu_GBps 0 \(set both"):
        estimate(MODEL, _s(0.5), _node("dgx-h100", host_cpu_GBps=0.0))
    assert _s(0.25).label().endswith("-optoff0.25-mbs1") and "optoff" not in _s(0).label()


def _optimizer_bytes(m: ModelSpec, s: Strategy, stage: int) -> int:
    held = RoleProgram(m, s, stage).stage_params()
    return M.estimate(m, s, stage, sum(held.values()), expert_params=held["edp"]).optimizer_bytes


def test_the_freed_memory_is_megatron_bridges() -> None:
    """Megatron-Bridge's CPU-offloading guide (docs/training/cpu-offloading.md) measured
    Qwen3-30B-A3B at tp 2, pp 2, ep 4 on 16 H100s: 3.8 GB freed per quarter of the optimizer
    state offloaded, 15.3 GB at all of it — Adam's m and v, 8 bytes a parameter of the rank's
    1.91 B-parameter shard (the fp32 master stays on the GPU)."""
    m = resolve_model("qwen3-30b-a3b@seq4096")
    s = Strategy(tp=2, pp=2, ep=4, dp=4, micro_batch_size=1, global_batch_size=8,
                 sequence_parallel=True, zero_stage=1)
    base = _optimizer_bytes(m, s, 0)
    freed = {f: base - _optimizer_bytes(m, dataclasses.replace(
        s, optimizer_offload_fraction=f), 0) for f in (0.25, 0.5, 1.0)}
    assert freed[1.0] == pytest.approx(15.3e9, rel=0.01)
    assert freed[0.25] == pytest.approx(3.8e9, rel=0.01)
    assert freed[0.5] == pytest.approx(2 * freed[0.25], rel=1e-6)
    assert base - freed[1.0] == pytest.approx(base / 3, rel=1e-6)  # the 4 master bytes of 12


def test_the_trace_carries_the_cpus_share_in_pieces(tmp_path: Path) -> None:
    """Per layer of the stage one piece: its fp32 gradients to host memory (MEM_STORE), the
    CPU's AdamW over them (a COMP_NODE marked is_cpu_op, 28 bytes a parameter), the fp32 master
    back (MEM_LOAD); the first copy waits for the backward, each CPU op for its copy, each copy
    back for its CPU op, and the parameter gather for the last copy back."""
    s = _s(0.5)
    generate(MODEL, s, tmp_path, mode="representative", gpus=4)
    rank = load_trace_set(tmp_path).ranks[0]
    by_id = {n.id: n for n in rank.nodes}
    stores = [n for n in rank.nodes if n.type == MEM_STORE_NODE]
    loads = [n for n in rank.nodes if n.type == MEM_LOAD_NODE]
    cpus = [n for n in rank.nodes if n.type == COMP_NODE and n.attrs.get("is_cpu_op")]
    k = offload_pieces(s, MODEL, 0)
    assert k == 6 and len(stores) == len(loads) == len(cpus) == k
    shard = sharded_params(s, RoleProgram(MODEL, s, 0).stage_params())
    on_cpu = O.offloaded_shares(s, shard)[1]
    assert on_cpu == round(shard * 0.5)
    assert sum(n.attrs["tensor_size"] for n in stores) == 4 * on_cpu
    assert sum(n.attrs["tensor_size"] for n in loads) == 4 * on_cpu
    assert sum(n.attrs["tensor_size"] for n in cpus) == O.CPU_ADAM_BYTES_PER_PARAM * on_cpu
    for store, cpu, load in zip(stores, cpus, loads, strict=True):
        assert store.id in cpu.data_deps and cpu.id in load.data_deps
    assert any(by_id[d].name.endswith("_bwd") or by_id[d].type != COMP_NODE
               for d in stores[0].data_deps)
    # the copies wait for exactly what the GPU's share of the step waits for
    gpu_step = next(n for n in rank.nodes if n.name == "step.adam_step")
    assert set(stores[0].data_deps) == set(gpu_step.data_deps) != set()
    gather = next(n for n in rank.nodes if n.name.endswith("param_all_gather"))
    assert loads[-1].id in gather.data_deps


def test_replay_runs_the_pieces_as_a_flow_shop(tmp_path: Path) -> None:
    """One GPU, full offload: the step grows by the CPU's share run as k pieces through three
    stations (copy out, CPU AdamW, copy back) less the GPU's Adam it replaces — the CPU the
    slowest station, T = Σ CPU + (copy out + copy back) of one piece, to the nanosecond."""
    system = get_system("dgx-h100")
    s0 = Strategy(micro_batch_size=1, global_batch_size=1, zero_stage=1)
    s1 = dataclasses.replace(s0, optimizer_offload_fraction=1.0)
    times = []
    for s in (s0, s1):
        out = tmp_path / s.label()
        generate(MODEL, s, out, mode="full", gpus=1)
        times.append(replay(out, system).metrics["step_time_s"])
    shard = sharded_params(s0, RoleProgram(MODEL, s0, 0).stage_params())
    k = offload_pieces(s1, MODEL, 0)
    piece = shard / k
    link, cpu = system.node.host_link_GBps, system.node.host_cpu_GBps
    flow_ns = shard * O.CPU_ADAM_BYTES_PER_PARAM / cpu + 2 * piece * 4 / link
    from replay.compute import RooflineCompute
    gpu = RooflineCompute(system.gpu)
    old = gpu.op_time_ns(O.optimizer_step(shard))
    new = gpu.op_time_ns(O.gpu_optimizer_step(s1, shard))
    assert flow_ns > new
    assert (times[1] - times[0]) * 1e9 == pytest.approx(flow_ns - old, abs=k + 2)


def test_replay_refuses_a_cpu_op_without_a_host_rate(tmp_path: Path) -> None:
    generate(MODEL, _s(1.0, dp=1, tp=1, sequence_parallel=False), tmp_path, mode="full", gpus=1)
    with pytest.raises(ReplayError, match=r"is a CPU op.*set host_cpu_GBps"):
        replay(tmp_path, _node("dgx-h100", host_cpu_GBps=0.0))


def test_the_host_rate_reproduces_its_evidence() -> None:
    """The evidence behind ``host_cpu_GBps`` = 18 (replay/systems/dgx-h100.toml): NeMo-RL PR
    3628 measured Qwen3-0.6B on one H100 under Megatron-Core's HybridDeviceOptimizer, 0.752 s a
    step without offloading and 1.678 s with all of it offloaded and the copies overlapped:
    0.926 s for the CPU's AdamW over 596 M parameters. The model's difference (the batch, not
    published, does not enter it: only the optimizer step changes) within 1%."""
    assert QWEN3_06B.num_params() == pytest.approx(596e6, rel=0.002)
    s = Strategy(micro_batch_size=1, global_batch_size=1, zero_stage=1)
    system = get_system("dgx-h100")
    base = estimate(QWEN3_06B, s, system).step_time_s
    full = estimate(QWEN3_06B, dataclasses.replace(s, optimizer_offload_fraction=1.0),
                    system).step_time_s
    assert full - base == pytest.approx(1.678 - 0.752, rel=0.01)


@settings(max_examples=14, deadline=None)
@given(moe=st.booleans(), zero=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2]),
       f=st.sampled_from([0.1, 0.37, 0.5, 1.0]), cpu=st.sampled_from([0.5, 18.0, 2000.0]),
       link=st.sampled_from([1.0, 55.0]))
def test_fast_path_agrees_with_replay(tmp_path_factory: pytest.TempPathFactory, moe: bool,
                                      zero: int, pp: int, f: float, cpu: float,
                                      link: float) -> None:
    """Within 2% of replay, from a CPU so fast the GPU's share decides to one 36× slower than
    measured, over host links from 1 to 55 GB/s, dense and MoE, ZeRO 1 and 2, one or two
    pipeline stages."""
    m = MOE if moe else MODEL
    s = _s(f, zero_stage=zero, pp=pp, ep=2 if moe else 1, dp=2)
    system = _node("dgx-h100", host_cpu_GBps=cpu, host_link_GBps=link)
    out = tmp_path_factory.mktemp("opt")
    generate(m, s, out, mode="representative", gpus=s.world_size)
    simulated = replay(out, system).metrics["step_time_s"]
    assert estimate(m, s, system).step_time_s == pytest.approx(simulated, rel=0.02)


def test_estimate_says_what_it_frees_and_costs(tmp_path: Path) -> None:
    js = tmp_path / "e.json"
    res = run("estimate", "--model", "gpt3-175b", "--gpus", "64", "--tp", "8", "--pp", "8",
              "--mbs", "1", "--gbs", "64", "--system", "dgx-h100", "--sp", "--zero", "1",
              "--optimizer-offload-fraction", "0.5", "--json", str(js))
    assert res.returncode == 0, res.stderr
    assert "optimizer offloading: 50% of a rank's optimizer shard" in res.stdout
    data = json.loads(js.read_text())
    off = data["optimizer_offload"]
    assert off["fraction"] == 0.5 and off["freed_GiB"] > 0
    assert data["step_time_s"] > off["step_time_s_without"]
    assert data["strategy_fields"]["optimizer_offload_fraction"] == 0.5


def test_the_fit_hint_offers_the_least_quarter_that_fits() -> None:
    """Llama 3 70B at tp 8 on 32 H100s with full recompute needs 81.2 GiB: a quarter of the
    optimizer state on the CPU fits (its AdamW beside a 171 s step costs under 1%), ahead of
    the recomputations, and the hint says it as a flag and a study field; a strategy whose
    optimizer cannot be offloaded (ZeRO 0) is not offered it."""
    m = resolve_model("llama3-70b")
    s = Strategy(tp=8, dp=4, sequence_parallel=True, micro_batch_size=1,
                 global_batch_size=512, zero_stage=1, recompute="full")
    system = get_system("dgx-h100")
    assert not estimate(m, s, system).fits
    hint = fit_hint(m, s, system)
    assert hint is not None and hint["optimizer_offload_fraction"] == 0.25
    assert hint["peak_memory_GiB"] <= 80 and hint["step_time_s"] < 1.01 * estimate(
        m, s, system).step_time_s
    words = fit_hint_words(hint)
    assert words[0] == "25% of the optimizer state offloaded to the CPU"
    assert words[1:] == ("--optimizer-offload-fraction 0.25", "optimizer_offload_fraction = 0.25")
    zero0 = fit_hint(m, dataclasses.replace(s, zero_stage=0), system)
    assert zero0 is None or not zero0.get("optimizer_offload_fraction")
