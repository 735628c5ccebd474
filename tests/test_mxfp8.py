"""FP8's MXFP8 recipe against the pairs Megatron-Bridge 25.09 and 25.11 publish: each row of
their Blackwell tables gives its FP8-CS throughput and, in parentheses, its FP8-MX throughput
with the same recipe and layout (tests/data/megatron_bridge_{b200,gb200,gb300}_runs.csv, the
``notes`` column). One pair, the DGX-B200 Llama 3 8B row, sets the presets' one MXFP8 constant
(``gemm_efficiency_mxfp8``, replay/systems/README.md "MXFP8"); the other four check it."""

from __future__ import annotations

import csv
import re
from pathlib import Path

import pytest

from analysis.validate import validate
from replay import get_system
from tests.test_megatron_bridge_runs import STACK

DATA = Path(__file__).parent / "data"
FILES = {gpu: DATA / f"megatron_bridge_{gpu}_runs.csv" for gpu in ("b200", "gb200", "gb300")}
SETS = "mbridge2511-b200-llama3-8b"
# "(30624 (29521) tokens/s/GPU": the CS figure, then the MX one in parentheses
PAIR = re.compile(r"\((\d+) \((\d+)\) tokens/s/GPU")


def measured_pairs() -> dict[str, tuple[Path, float]]:
    """Every row whose notes give both figures: (its file, its MX step over its CS step, the
    inverse ratio of their tokens/s)."""
    out = {}
    for path in FILES.values():
        with path.open() as f:
            for row in csv.DictReader(f):
                got = PAIR.search(row["notes"])
                if got:
                    out[row["id"]] = (path, int(got[1]) / int(got[2]))
    return out


@pytest.fixture(scope="module")
def ratios() -> dict[str, tuple[float, float]]:
    """Each pair's (predicted, measured) MX/CS step ratio, the rows as the CS stack runs them."""
    pairs = measured_pairs()
    out = {}
    for path in {p for p, _ in pairs.values()}:
        cs = validate(path, fast=True, overrides=STACK)
        mx = validate(path, fast=True, overrides={**STACK, "strategy.fp8_recipe": "mxfp8"})
        steps = {r: (c, m) for r, c, m in zip(cs["id"], cs["predicted_iter_time_s"],
                                              mx["predicted_iter_time_s"], strict=True)}
        out |= {rid: (steps[rid][1] / steps[rid][0], measured)
                for rid, (p, measured) in pairs.items() if p == path}
    return out


def test_the_tables_give_five_pairs() -> None:
    """25.11's DGX-B200 8B and 405B, DGX-GB200 8B and DGX-GB300 8B rows, and 25.09's DGX-GB200
    8B row; every one measures MX slower, by 3.7-5.9%."""
    pairs = measured_pairs()
    assert set(pairs) == {SETS, "mbridge2511-b200-llama3.1-405b", "mbridge2511-gb200-llama3-8b",
                          "mbridge2509-gb200-llama3-8b", "mbridge2511-gb300-llama3-8b"}
    assert all(1.03 < ratio < 1.06 for _, ratio in pairs.values())


def test_the_b200_8b_pair_sets_the_mxfp8_efficiency(ratios: dict[str, tuple[float, float]]
                                                      ) -> None:
    """At the preset's 0.644 the model's MX/CS ratio of that row is the measured 1.0374 (to
    0.1%): 0.92 of FP8's 0.70, which had put MX 0.8% faster than CS. GB200 and GB300 borrow
    it; the Hopper presets have none (FP8's efficiency, and the recipe is refused there).
    (0.632 until the per-tensor casts stopped writing a transposed copy on Blackwell, later
    in the sixty-ninth session.)"""
    predicted, measured = ratios[SETS]
    assert predicted == pytest.approx(measured, rel=1e-3)
    b200 = get_system("dgx-b200").gpu
    assert b200.gemm_efficiency_mxfp8 == 0.644
    assert b200.gemm_efficiency_of("mxfp8") / b200.gemm_efficiency_of("fp8") == pytest.approx(
        0.920, abs=0.001)
    for name in ("gb200-nvl72", "gb300-nvl72"):
        assert get_system(name).gpu.gemm_efficiency_mxfp8 == b200.gemm_efficiency_mxfp8
    hopper = get_system("dgx-h100").gpu
    assert hopper.gemm_efficiency_mxfp8 == 0 and not hopper.block_scaled


def test_the_pairs_that_set_nothing_are_predicted_within_2_percent(
        ratios: dict[str, tuple[float, float]]) -> None:
    """B200 405B (tp 4 with SP, so MX's 16-bit gathers count too) 1.062 against 1.059, GB200
    8B 1.038 against 1.058 (25.11) and 1.048 (25.09), GB300 8B 1.035 against 1.040: each
    ordered right (MX slower), each ratio within 2% (1.9% the worst). Bound: the error
    reached."""
    checks = {rid: r for rid, r in ratios.items() if rid != SETS}
    assert len(checks) == 4
    for rid, (predicted, measured) in checks.items():
        assert predicted > 1, rid
        assert abs(predicted / measured - 1) < 0.02, (rid, predicted, measured)
