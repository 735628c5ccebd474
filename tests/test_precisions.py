"""``trainsim estimate --precisions`` (``analysis/precisions.py``): one strategy in every
precision and FP8 recipe, each row the fast path's estimate of its own strategy, the ones the
GPU cannot run named with what it lacks."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from analysis.fastpath import estimate
from analysis.precisions import precision_rows
from replay import get_system
from tests.test_cli import run
from tracegen import Strategy, get_model

MODEL = get_model("llama3-8b")
BASE = Strategy(tp=2, dp=4, sequence_parallel=True, micro_batch_size=1, global_batch_size=64,
                zero_stage=1)
ALL = {"bf16", "fp8 delayed", "fp8 tensorwise", "fp8 mxfp8", "nvfp4"}


def test_on_blackwell_every_precision_runs_each_row_its_own_estimate() -> None:
    """On a B200 all five run, fastest first; each row is its strategy's own estimate (the
    precision and recipe changed, the rest kept), tokens/s the batch over it, the given
    strategy marked. NVFP4 is fastest and BF16 slowest; MXFP8 below both per-tensor recipes."""
    system = get_system("dgx-b200")
    rows = precision_rows(MODEL, BASE, system)
    assert {r.name for r in rows} == ALL and not any(r.refused for r in rows)
    steps = [r.step_time_s for r in rows]
    assert steps == sorted(steps)
    for r in rows:
        assert r.strategy is not None
        assert r.step_time_s == estimate(MODEL, r.strategy, system).step_time_s
        assert r.tokens_per_s == pytest.approx(64 * MODEL.seq_len / r.step_time_s)
        assert dataclasses.replace(r.strategy, precision=BASE.precision,
                                   fp8_recipe="delayed") == BASE
    order = [r.name for r in rows]
    assert order[0] == "nvfp4" and order[-1] == "bf16"
    assert order.index("fp8 mxfp8") > max(order.index("fp8 delayed"),
                                          order.index("fp8 tensorwise"))
    assert [r.name for r in rows if r.current] == ["bf16"]


def test_a_gpu_names_what_it_lacks() -> None:
    """H100: MXFP8 and NVFP4 refused (Blackwell's block-scaled and FP4 tensor cores); A100:
    every FP8 row too (no FP8 tensor cores); V100: FP16 stands for BF16."""
    h100 = {r.name: r.refused for r in precision_rows(MODEL, BASE, get_system("dgx-h100"))}
    assert "block-scaled" in h100["fp8 mxfp8"] and "FP4" in h100["nvfp4"]
    assert not h100["bf16"] and not h100["fp8 delayed"] and not h100["fp8 tensorwise"]
    a100 = {r.name: r.refused for r in precision_rows(MODEL, BASE,
                                                        get_system("dgx-a100-80gb"))}
    assert all("no FP8 tensor cores" in a100[n] for n in ("fp8 delayed", "fp8 tensorwise",
                                                           "fp8 mxfp8"))
    small = get_model("gpt-1.7b")
    v100 = [r.name for r in precision_rows(small, BASE, get_system("dgx1-v100"))
            if not r.refused]
    assert v100 == ["fp16"]


def test_fp8_parameter_gathers_stay_with_the_fp8_rows() -> None:
    """An FP8 strategy with FP8 parameter gathers: the FP8 rows keep them (the given one is
    marked), the 16-bit and NVFP4 rows drop them (they need FP8)."""
    fp8 = dataclasses.replace(BASE, precision="fp8", fp8_param_gather=True)
    rows = {r.name: r for r in precision_rows(MODEL, fp8, get_system("dgx-b200"))}
    assert all(rows[n].strategy.fp8_param_gather  # type: ignore[union-attr]
               for n in ("fp8 delayed", "fp8 tensorwise", "fp8 mxfp8"))
    assert not rows["bf16"].strategy.fp8_param_gather  # type: ignore[union-attr]
    assert not rows["nvfp4"].strategy.fp8_param_gather  # type: ignore[union-attr]
    assert [n for n, r in rows.items() if r.current] == ["fp8 delayed"]


def test_the_cli_prints_the_table_and_writes_it_to_json(tmp_path: Path) -> None:
    out = tmp_path / "e.json"
    r = run("estimate", "--model", "llama3-8b", "--gpus", "8", "--tp", "2", "--sp", "--mbs",
            "1", "--gbs", "64", "--zero", "1", "--system", "dgx-h100", "--precisions",
            "--json", str(out))
    assert r.returncode == 0, r.stderr
    words = " ".join(r.stdout.split())
    assert "This strategy in each precision on dgx-h100" in words
    assert "fp8 mxfp8: cannot run here: no block-scaled tensor cores" in words
    assert "read its row as optimistic" not in words  # (no NVFP4 row on an H100)
    got = json.loads(out.read_text())["precisions"]
    assert {row["precision"] for row in got} == ALL
    assert [row["precision"] for row in got if row["current"]] == ["bf16"]
    bad = run("estimate", "--model", "llama3-8b", "--gpus", "8", "--tp", "2", "--pp", "2",
              "--mbs", "1", "--gbs", "64", "--system", "dgx-h100", "--precisions",
              "--stage-system", "0=dgx-a100-80gb")
    assert bad.returncode != 0 and "--precisions costs the strategy on one system" in bad.stderr


def test_a_recipe_beside_a_16_bit_precision_is_said_to_be_ignored() -> None:
    """``--fp8-recipe`` without ``--precision fp8`` changes nothing (the strategy is BF16's):
    ``estimate`` says so rather than leave the user thinking a recipe was costed."""
    r = run("estimate", "--model", "llama3-8b", "--gpus", "8", "--mbs", "1", "--gbs", "8",
            "--system", "dgx-h100", "--fp8-recipe", "mxfp8")
    assert r.returncode == 0, r.stderr
    assert "applies to FP8 runs only (--precision fp8); bf16 ignores it" in " ".join(
        r.stdout.split())
    fp8 = run("estimate", "--model", "llama3-8b", "--gpus", "8", "--mbs", "1", "--gbs", "8",
              "--system", "dgx-h100", "--precision", "fp8", "--fp8-recipe", "tensorwise")
    assert fp8.returncode == 0 and "ignores it" not in fp8.stdout
    assert "ZeRO 0, fp8 (current scaling))" in " ".join(fp8.stdout.split())  # the header


def test_the_nvfp4_row_is_said_to_be_optimistic() -> None:
    """Where NVFP4 runs (Blackwell) the table says its efficiency is an inference bench's."""
    r = run("estimate", "--model", "llama3-8b", "--gpus", "8", "--mbs", "1", "--gbs", "8",
            "--system", "dgx-b200", "--precisions")
    assert r.returncode == 0, r.stderr
    assert "nvfp4: its GEMM efficiency is an inference bench's" in " ".join(r.stdout.split())


def test_a_sweep_leaves_out_what_its_gpus_cannot_run() -> None:
    """A search space's narrow precisions and FP8 recipes the GPU lacks tensor cores for are
    invalid combinations, with the reason (an H100: MXFP8 and NVFP4); on a B200 they are
    candidates. BF16 stays everywhere (Volta costs it as FP16)."""
    from analysis.study import study_from_dict
    from analysis.sweep import enumerate_space, invalid_reasons

    def space(system: str) -> tuple[set[tuple[str, str]], list[tuple[str, int]]]:
        study = study_from_dict({"model": "gpt-1.7b", "system": system, "gpus": 8,
                                 "global_batch_size": 8,
                                 "search": {"tp": [1], "pp": [1], "micro_batch_size": [1],
                                            "precision": ["bf16", "fp8", "nvfp4"],
                                            "fp8_recipe": ["delayed", "mxfp8"]}})
        valid, _ = enumerate_space(study)
        return {(s.precision, s.fp8_recipe) for s in valid}, invalid_reasons(study)[0]

    h100, why = space("dgx-h100")
    assert h100 == {("bf16", "delayed"), ("fp8", "delayed")}
    reasons = " ".join(r for r, _ in why)
    assert "precision fp8 (mxfp8) on dgx-h100: it has no block-scaled tensor cores" in reasons
    assert "precision nvfp4 on dgx-h100: it has no FP4 tensor cores" in reasons
    b200, _ = space("dgx-b200")
    assert b200 == {("bf16", "delayed"), ("fp8", "delayed"), ("fp8", "mxfp8"),
                    ("nvfp4", "delayed")}
