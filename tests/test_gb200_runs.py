"""The GB200 NVL72 preset (replay/systems/gb200-nvl72.toml) against NVIDIA's DGX-GB200 runs:
Megatron-Bridge's 25.11 pre-training table (tests/data/megatron_bridge_gb200_runs.csv, its three
dense rows). The Llama 3 8B row and its DGX-B200 twin set the preset's one constant of its own,
the sustained clock; the 70B and 405B rows set nothing and check it."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from analysis.validate import load_runs, row_inputs, validate
from replay import get_system
from replay.network import AlphaBetaNetwork, flat_cost
from tests.test_megatron_bridge_runs import B200_RUNS, STACK

GB200_RUNS = Path(__file__).parent / "data" / "megatron_bridge_gb200_runs.csv"


def _measured(path: Path, rid: str, column: str) -> float:
    with path.open() as f:
        return next(float(r[column]) for r in csv.DictReader(f) if r["id"] == rid)


def same_recipe_ratios(slower: tuple[Path, str], faster: tuple[Path, str]) -> tuple[float, float]:
    """One recipe's row on two systems (each a runs file and a row id): the model's ratio of
    the slower system's predicted step to the faster's, and the measured ratio of their
    tokens/s a GPU."""
    steps = [dict(zip(got["id"], got["predicted_iter_time_s"], strict=True))[rid]
             for path, rid in (slower, faster)
             for got in [validate(path, fast=True, overrides=STACK)]]
    rates = [_measured(path, rid, "measured_tokens_per_s_per_gpu") for path, rid in (slower, faster)]
    return steps[0] / steps[1], rates[1] / rates[0]


def validated_rows(path: Path) -> dict[str, dict[str, float]]:
    """A runs file validated under the recipes' stack, every row predicted, by id."""
    got = validate(path, fast=True, overrides=STACK)
    assert (got["status"] == "ok").all()
    return {r["id"]: r for r in got.iter_rows(named=True)}


def offloaded_layers(path: Path, rid: str) -> int:
    """The layers whose activations a runs file's row offloads (its ``cpu_offload_layers``)."""
    rows = {r["id"]: row_inputs(r) for r in load_runs(path).iter_rows(named=True)}
    return rows[rid].strategy.cpu_offload_layers  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def gb200() -> dict[str, dict[str, float]]:
    return validated_rows(GB200_RUNS)


def test_the_sustained_clock_is_the_same_recipe_on_both_blackwells() -> None:
    """The same Llama 3 8B recipe ran 1.029 times as fast a GPU on GB200 as on B200 (31,508
    against 30,624 tokens/s), where the datasheet peaks say 1.111: the preset's clock ratio
    (B200's × 2250/2500 × 1.029) carries that, and the model's own ratio of the two predicted
    steps comes within 0.5% of the measured one (the step's memory-bound share, on the same
    8 TB/s HBM, holds it a little under)."""
    ours, measured = same_recipe_ratios((B200_RUNS, "mbridge2511-b200-llama3-8b"),
                                        (GB200_RUNS, "mbridge2511-gb200-llama3-8b"))
    assert measured == pytest.approx(1.029, abs=0.001)
    assert ours == pytest.approx(measured, rel=0.005)
    gpu = get_system("gb200-nvl72").gpu
    assert gpu.sustained_clock_ratio == pytest.approx(
        get_system("dgx-b200").gpu.sustained_clock_ratio * 2250 / 2500 * measured, abs=0.001)


def test_the_rows_that_set_nothing_are_predicted_within_the_error_reached(
        gb200: dict[str, dict[str, float]]) -> None:
    """25.11: Llama 3 70B under Megatron-FSDP on 64 GPUs (one rack), its first 40 layers'
    activations offloaded to the Grace CPUs' memory as its recipe does, 0.8% too fast (0.3%
    before FP8's casts stopped writing a transposed copy on Blackwell, sixty-ninth session;
    1.3% before FP8 current scaling's amax reads, sixty-seventh session; 3.4%
    without the offloading: its copies cost 2.2% where a layer's copy takes about as long as
    its forward beside the prefetched gathers); Llama 3.1 405B at tp 4, pp 16, vpp 4 on 256
    GPUs (four 64-GPU segments) 4.1% too fast (3.4% before the casts; 3.0% before FP8
    per-tensor recipes gathered sequence-parallel GEMM inputs in 1 byte, sixty-ninth session;
    3.9% before the amax reads; 3.1% before its
    split GEMMs' chunks shared the SMs on Transformer Engine's three streams, sixty-fifth
    session) — where the same constants' 8B row is 3.9% too fast (2.9% before the casts; 4.7%
    before the amax reads) and B200's own 8B row 3.8%. With the B200's clock ratio borrowed
    unchanged, all
    three were 11-12.5% too fast; with no interference (Blackwell's κ 0 until the fifty-eighth
    session), 4.9, 3.8 and 5.5%. The same layouts in the 26.02 and 25.09 tables (the archive):
    26.02 measured 70B 6.7% and 405B 2.5% slower than 25.11 on the same layouts (−7.1%,
    −6.4%; −6.6 and −5.8% before the casts, −5.4% for the 405B before the 1-byte gathers),
    25.09's 8B −4.4%, its 70B at one micro-batch a step (GBS 128) −8.3% and its 405B
    under Megatron-FSDP at tp 2 with 92 layers offloaded −11.8%: FSDP runs whose steps are one
    micro-batch come out fastest. Median |error| of the seven rows that set nothing 6.4% (5.8%
    before the casts; 5.4% before the 1-byte gathers; 6.2% before the amax reads; 5.5% before
    the streams; 7.8% with κ 0). With the recipes' 16-bit gradient reduction (seventieth
    session; every model's common config sets ``grad_reduce_in_fp32 = False``): 8B −3.9 →
    −4.0%, 70B −0.8 → −1.8% (26.02 −7.1 → −8.0%, 25.09 −8.3 → −9.2%), 405B −4.1% (26.02
    −6.4%), 25.09's FSDP 405B −11.8 → −13.9%; median of the seven 6.4%. Bounds are the errors
    reached."""
    err = {rid: r["error_pct"] for rid, r in gb200.items()}
    reached = {"mbridge2511-gb200-llama3-8b": -4.04, "mbridge2511-gb200-llama3-70b": -1.81,
               "mbridge2511-gb200-llama3.1-405b": -4.08, "mbridge2602-gb200-llama3-70b": -8.01,
               "mbridge2602-gb200-llama3.1-405b": -6.44, "mbridge2509-gb200-llama3-8b": -4.50,
               "mbridge2509-gb200-llama3-70b": -9.16,
               "mbridge2509-gb200-llama3.1-405b": -13.93}
    assert set(err) == set(reached)
    for rid, e in reached.items():
        assert err[rid] == pytest.approx(e, abs=0.3), rid
    checks = sorted(abs(e) for rid, e in err.items() if rid != "mbridge2511-gb200-llama3-8b")
    assert checks[len(checks) // 2] == pytest.approx(6.44, abs=0.3)


def test_memory_says_what_the_recipes_did_beyond_the_model(
        gb200: dict[str, dict[str, float]]) -> None:
    """The 8B run fits (119 GiB of 186). The 70B run's recipe offloads 40 of its 80 layers'
    activations to the Grace CPUs' memory (``cpu_offloading_num_layers=40``, the file's
    ``cpu_offload_layers`` column): 198 GiB predicted where it ran in 186 GB — 6.3% over (202,
    8.6%, with 32-bit gradients), and 356 GiB without the offloading (tp 1 at 2 × 8,192
    tokens). The 405B run is predicted 5.5% over (196 GiB; 209, 12% over, before the stack took
    its recipe's 16-bit gradient reduction, ``grad_reduce_in_fp32 = False``, seventieth
    session) — the rest is not explained here."""
    assert gb200["mbridge2511-gb200-llama3-8b"]["fits"]
    assert gb200["mbridge2511-gb200-llama3-8b"]["predicted_peak_memory_GiB"] < 125
    assert offloaded_layers(GB200_RUNS, "mbridge2511-gb200-llama3-70b") == 40
    over70 = gb200["mbridge2511-gb200-llama3-70b"]["predicted_peak_memory_GiB"] / 186
    assert 1.05 < over70 < 1.08
    over = gb200["mbridge2511-gb200-llama3.1-405b"]["predicted_peak_memory_GiB"] / 186
    assert 1.04 < over < 1.07
    # 25.09's 405B under FSDP at tp 2, 92 of its 126 layers offloaded: 131 GiB, fits
    assert gb200["mbridge2509-gb200-llama3.1-405b"]["fits"]


def test_a_64_way_all_to_all_stays_on_the_rack_nvlink() -> None:
    """Expert parallelism of 64 inside one NVL72 domain: the all-to-all is NVLink's flat
    (p − 1)·α + (p − 1)/p · bytes / 640 GB/s, the NVL72 all-to-all busbw of the ANCHORS slides
    (the all-reduce tier's 900 GB/s × 0.756 until the sixty-fifth session) — on DGX B200 the
    same 64 ranks span eight nodes and their NICs."""
    size, p = 256 * 2**20, 64
    nvl72 = AlphaBetaNetwork(get_system("gb200-nvl72"))
    got = nvl72.collective("ALL_TO_ALL", size, tuple(range(p)))
    lat_s, xfer_s = flat_cost("ALL_TO_ALL", size, p, nvl72.a2a)
    assert nvl72.nvl.bytes_per_s == pytest.approx(900e9 * 0.756)
    assert nvl72.a2a.bytes_per_s == pytest.approx(640e9)
    assert got.total_ns == pytest.approx((lat_s + xfer_s) * 1e9, abs=2)
    assert {link for link, _ in got.links} == {"nvl"}
    dgx = AlphaBetaNetwork(get_system("dgx-b200")).collective("ALL_TO_ALL", size,
                                                              tuple(range(p)))
    assert dgx.total_ns > 5 * got.total_ns


def test_estimate_says_where_the_gpus_leave_a_rack_part_filled() -> None:
    """256 GPUs on 72-GPU racks: three full and 40 GPUs of a fourth, said with how to describe
    a job placed in smaller blocks; 288 (four whole racks) says nothing."""
    from tests.test_cli import run

    base = ("estimate", "--model", "llama3-8b", "--tp", "2", "--mbs", "1", "--zero", "1",
            "--system", "gb200-nvl72")
    r = run(*base, "--gpus", "256", "--gbs", "256")
    assert r.returncode == 0, r.stderr
    words = " ".join(r.stdout.split())
    assert "256 GPUs fill 3 NVLink domains of 72 and 40 GPUs of another" in words
    assert "gpus_per_node in a copy of the system file" in words
    whole = run(*base, "--gpus", "288", "--gbs", "288")
    assert whole.returncode == 0 and "NVLink domains of" not in whole.stdout


def test_a_scenarios_node_on_gb200_is_a_compute_tray(tmp_path: Path) -> None:
    """A straggler ``nodes = [1]`` on the rack slows the second 4-GPU tray (ranks 4-7), not
    GPUs 72-143: a scenario's node is a host, as a failure's is."""
    from replay import replay
    from tracegen import Strategy, generate, get_model

    scen = tmp_path / "slow.toml"
    scen.write_text("[[straggler]]\nnodes = [1]\nslowdown = 2.0\n")
    generate(get_model("gpt-1.7b"), Strategy(dp=8, micro_batch_size=1, global_batch_size=8),
             tmp_path / "set", mode="full", gpus=8)
    res = replay(tmp_path / "set", "gb200-nvl72", scenario=scen)
    compute = dict(zip(res.breakdown["rank"], res.breakdown["compute_s"], strict=True))
    slow = {r for r, c in compute.items() if c > 1.5 * min(compute.values())}
    assert slow == {4, 5, 6, 7}


def test_the_405b_mxfp8_recipe_on_one_rack_holds_its_published_memory() -> None:
    """Megatron-Bridge's Llama 3.1 405B MXFP8 recipe on 64 GB200s (its API docs,
    ``bridge.recipes.llama.gb200.llama3.llama31_405b_pretrain_64gpu_gb200_fp8mx_config``,
    validated in NeMo 26.10.rc10): tp 8, pp 8, vpp 8 with SP, dp 1, 1,536 micro-batches of
    one 8,192-token sequence, TP overlap, no recompute, MXFP8 parameter gathers, BF16
    gradient accumulation, fp32 master weights and moments — 154.6 GiB peak allocated and
    289 s an update. The tensors the allocator holds at the busiest stage's peak (the
    breakdown less its runtime and fragmentation allowances, which ``max_memory_allocated``
    does not see) come to 154.7 GiB, within 1% (154.3 GiB before MXFP8's block scales were
    counted beside its FP8 copies, sixty-ninth session); stated as the recipe states it, not
    fitted. The step, 267.0 s, is 7.6% fast (254.0 s, 12.1%, with FP8's GEMM efficiency for
    its MXFP8 GEMMs, before the sixty-ninth session's ``gemm_efficiency_mxfp8``; as per-tensor
    FP8 with its 1-byte gathers and its casts writing no transposed copy on Blackwell,
    242.9 s)."""
    from analysis.glance import glance
    from tracegen import Strategy, get_model
    from tracegen.units import GiB

    s = Strategy(tp=8, pp=8, vpp=8, schedule="interleaved_1f1b", sequence_parallel=True,
                 micro_batch_size=1, global_batch_size=1536, precision="fp8",
                 fp8_recipe="mxfp8", zero_stage=1,
                 tp_comm_overlap=True, fp8_param_gather=True, grad_reduce_in_bf16=True,
                 account_for_embedding_in_pipeline_split=True,
                 account_for_loss_in_pipeline_split=True)
    g = glance(get_model("llama3.1-405b"), s, "gb200-nvl72")
    held = max((st.memory.total_bytes - st.memory.runtime_bytes
                - st.memory.fragmentation_bytes) / GiB for st in g.stages)
    assert held == pytest.approx(154.6, rel=0.01)
    assert g.fits and g.step_time_s / 289 - 1 == pytest.approx(-0.076, abs=0.005)
