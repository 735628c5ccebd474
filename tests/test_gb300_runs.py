"""The GB300 NVL72 preset (replay/systems/gb300-nvl72.toml) against NVIDIA's DGX-GB300 runs:
Megatron-Bridge's 25.11 pre-training table's three dense rows and the 26.02 archive's two
(tests/data/megatron_bridge_gb300_runs.csv). As for GB200, the 25.11 Llama 3 8B row with its
twin on the other rack sets the preset's one constant of its own, the sustained clock; the
70B and 405B rows set nothing and check it."""

from __future__ import annotations

from pathlib import Path

import pytest

from replay import get_system
from replay.network import AlphaBetaNetwork
from tests.test_gb200_runs import GB200_RUNS, offloaded_layers, same_recipe_ratios, validated_rows

GB300_RUNS = Path(__file__).parent / "data" / "megatron_bridge_gb300_runs.csv"


@pytest.fixture(scope="module")
def gb300() -> dict[str, dict[str, float]]:
    return validated_rows(GB300_RUNS)


def test_the_sustained_clock_reproduces_the_same_recipe_on_both_racks() -> None:
    """The same Llama 3 8B recipe (8 GPUs, FP8, mbs 2) ran 1.192 times as fast a GPU on GB300
    as on GB200 (37,556 against 31,508 tokens/s) where the two racks' BF16 and FP8 peaks are
    the same: the preset's clock ratio is the one at which the model's own ratio of the two
    predicted steps is the measured one (the step's memory-bound ops, 15% of it on the same
    8 TB/s, do not speed up, so the ratio of throughputs alone, GB200's 0.758 × 1.192 = 0.904,
    would leave the model 3.1% short). It carries whatever Blackwell Ultra changed for this
    recipe — its clock at 1.4 kW, and its doubled exponent rate, which attention (a quarter of
    this step) may use — as one constant: trainsim does not model the exponent units apart."""
    ours, measured = same_recipe_ratios((GB200_RUNS, "mbridge2511-gb200-llama3-8b"),
                                        (GB300_RUNS, "mbridge2511-gb300-llama3-8b"))
    assert measured == pytest.approx(1.192, abs=0.001)
    assert ours == pytest.approx(measured, rel=0.002)
    gpu, gb200_gpu = get_system("gb300-nvl72").gpu, get_system("gb200-nvl72").gpu
    assert (gpu.peak_bf16_TFLOPs, gpu.peak_fp8_TFLOPs) == (
        gb200_gpu.peak_bf16_TFLOPs, gb200_gpu.peak_fp8_TFLOPs)
    assert gpu.sustained_clock_ratio > gb200_gpu.sustained_clock_ratio * measured


def test_the_rows_that_set_nothing_are_predicted_within_the_error_reached(
        gb300: dict[str, dict[str, float]]) -> None:
    """25.11: Llama 3.1 405B at tp 2, pp 8, cp 2, vpp 4 on 256 GPUs (four 64-GPU segments)
    4.2% too fast — the GB200 table's 405B row 4.1%; Llama 3 70B under Megatron-FSDP on 64
    GPUs, its recipe's first 20 layers' activations offloaded, 13.1% too fast: that release
    measured it only 1.048 times its GB200 twin where the 8B measured 1.192. The 26.02 archive
    ran the same 70B layout 1.238 times its GB200 twin (5,003 against 4,040 tokens/s): −3.9%;
    and its 405B at tp 4, pp 8, vpp 4 (the later recipe's layout) −4.2%. The sixty-ninth
    session moved them twice: FP8 per-tensor recipes' sequence-parallel gathers in 1 byte
    (26.02 405B −2.9 → −3.5%, 25.11 405B −3.7 → −3.8%), then FP8 casts without a transposed
    copy on Blackwell, with the clock re-derived from its pair (0.939 → 0.937): 8B −2.9 →
    −3.9%, 70B −12.6 → −13.1% and −3.3 → −3.9%, 405B −3.8 → −4.2% and −3.5 → −4.2%. With
    GB200's clock
    unchanged the 25.11 rows come out +15.7% (8B), +3.3% (70B) and +16.8% (405B) (before the
    sixty-ninth session). Median
    |error| of the four rows that set nothing 4.2% (3.7% before the casts; 3.5% before the
    1-byte gathers; 4.3% before FP8 current scaling's amax
    reads, sixty-seventh session, with the clock then set at 0.935). With the recipes' 16-bit
    gradient reduction (seventieth session; the pair's ratio moves 0.04%, the clock stands):
    8B −4.1%, 70B −14.2% and −5.0%, 405B −4.4% and −4.2%; median 4.7%. Bounds are the errors
    reached."""
    err = {rid: r["error_pct"] for rid, r in gb300.items()}
    reached = {"mbridge2511-gb300-llama3-8b": -4.08, "mbridge2511-gb300-llama3-70b": -14.16,
               "mbridge2511-gb300-llama3.1-405b": -4.35, "mbridge2602-gb300-llama3-70b": -4.99,
               "mbridge2602-gb300-llama3.1-405b": -4.22}
    assert set(err) == set(reached)
    for rid, e in reached.items():
        assert err[rid] == pytest.approx(e, abs=0.3), rid
    checks = sorted(abs(e) for rid, e in err.items() if rid != "mbridge2511-gb300-llama3-8b")
    assert (checks[1] + checks[2]) / 2 == pytest.approx(4.67, abs=0.3)


def test_memory_says_what_the_recipes_did_beyond_the_model(
        gb300: dict[str, dict[str, float]]) -> None:
    """279 GiB a GPU. The 8B fits (119 GiB). The 70B recipe offloads 20 layers' activations
    (GB200's: 40, in 186 GB): predicted 279.2 GiB, 0.1% over where it ran (283, 1.6% over,
    with 32-bit gradients) — the Megatron-FSDP over-count the GB200 row shows too. The 405B
    at tp 2, cp 2 fits with the recipe's 16-bit gradients (264 GiB; 314, 12.6% over, before
    the stack took them, seventieth session); 26.02's 405B at tp 4, cp 1 fits (215 GiB)."""
    assert get_system("gb300-nvl72").gpu.hbm_GiB == 279
    assert gb300["mbridge2511-gb300-llama3-8b"]["fits"]
    assert offloaded_layers(GB300_RUNS, "mbridge2511-gb300-llama3-70b") == 20
    over70 = gb300["mbridge2511-gb300-llama3-70b"]["predicted_peak_memory_GiB"] / 279
    assert 1.0 < over70 < 1.01
    over = gb300["mbridge2511-gb300-llama3.1-405b"]["predicted_peak_memory_GiB"] / 279
    assert 0.93 < over < 0.96 and gb300["mbridge2511-gb300-llama3.1-405b"]["fits"]
    # 26.02's 405B at tp 4, cp 1: 215 GiB, fits
    assert gb300["mbridge2602-gb300-llama3.1-405b"]["fits"]


def test_the_rack_leaves_through_800_gigabit_nics() -> None:
    """One ConnectX-8 a GPU at 800 Gb/s: a data-parallel all-reduce across two racks' same-
    rail GPUs moves its bytes twice as fast as GB200's 400 Gb/s ConnectX-7 (same borrowed
    efficiency), its latency terms alike."""
    size, ranks = 1 << 30, (0, 72)
    got = {name: AlphaBetaNetwork(get_system(name)).collective("ALL_REDUCE", size, ranks)
           for name in ("gb200-nvl72", "gb300-nvl72")}
    assert get_system("gb300-nvl72").scaleout.nic_Gbps_per_gpu == 800
    assert got["gb200-nvl72"].total_ns / got["gb300-nvl72"].total_ns == pytest.approx(2.0,
                                                                                    rel=0.01)
