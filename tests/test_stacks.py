"""``trainsim validate --stack`` and ``estimate --stack``: a framework's settings beyond the
schema, by name, as the reference sets are validated with them (``analysis.stacks``, which
those sets' tests read), and one strategy run as that framework's recipes run it."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from analysis.cli import app
from analysis.stacks import STACKS, get_stack, with_stack
from analysis.validate import validate
from tracegen import ConfigError

DATA = Path(__file__).resolve().parent / "data"


def test_each_stack_applies_as_validate_reads_it() -> None:
    """Every stack's overrides parse as ``--set`` values do (a misspelt field would be refused
    by the first row), and each names its evidence."""
    for name, stack in STACKS.items():
        assert stack.name == name and stack.evidence and stack.describes
        got = validate(DATA / "nemo2407_runs.csv", fast=True, overrides=dict(stack.overrides),
                       attention=stack.attention)
        assert (got["status"] == "ok").all(), (name, got["status"].to_list())


def test_the_caller_wins_over_the_stack() -> None:
    stack = get_stack("megatron-bridge")
    overrides, attention = with_stack("megatron-bridge",
                                      {"strategy.tp_comm_overlap": False}, "cudnn")
    assert overrides["strategy.tp_comm_overlap"] is False
    assert overrides["strategy.grad_reduce_in_bf16"] is True  # the stack's, kept
    assert attention == "cudnn" and stack.attention is None
    assert with_stack("nemo-24.07", {}, None)[1] == "cudnn"
    assert with_stack(None, {"a.b": 1}, None) == ({"a.b": 1}, None)


def test_an_unknown_stack_is_refused_with_the_near_name() -> None:
    with pytest.raises(ConfigError, match=r"no stack named 'nemo-2407'; did you mean "
                                          r"'nemo-24\.07'\? known: megatron-bridge"):
        get_stack("nemo-2407")


def test_the_cli_stack_gives_the_reference_sets_errors(tmp_path: Path) -> None:
    """``validate --stack nemo-24.07`` on NeMo 24.07's runs gives the errors that set's test
    holds (its overrides and cuDNN kernel from the stack), and a ``--set`` beside it wins."""
    from tests.test_cli import run
    from tests.test_nemo_runs import NEMO, STACK

    out, plain = tmp_path / "s.csv", tmp_path / "p.csv"
    ran = CliRunner().invoke(app, ["validate", str(NEMO), "--fast", "--stack", "nemo-24.07",
                                   "--out", str(out)])
    assert ran.exit_code == 0, ran.output
    want = validate(NEMO, fast=True, overrides=STACK, attention="cudnn")
    got = pl.read_csv(out)
    assert got["error_pct"].to_list() == pytest.approx(want["error_pct"].to_list(), abs=1e-9)
    off = CliRunner().invoke(app, ["validate", str(NEMO), "--fast", "--stack", "nemo-24.07",
                                   "--set", "strategy.tp_comm_overlap=false", "--out",
                                   str(plain)])
    assert off.exit_code == 0, off.output
    assert pl.read_csv(plain)["predicted_iter_time_s"].to_list() != got[
        "predicted_iter_time_s"].to_list()
    bad = run("validate", str(NEMO), "--fast", "--stack", "nemo")  # (the entry point's
    said = bad.stdout + bad.stderr  # handling: a message, no traceback)
    assert bad.returncode != 0 and "no stack named 'nemo'" in said
    assert "Traceback" not in said


def _estimate(tmp_path: Path, name: str, *args: str) -> dict[str, object]:
    """``trainsim estimate`` through the CLI (in process), its JSON read back."""
    import json

    out = tmp_path / f"{name}.json"
    ran = CliRunner().invoke(app, ["estimate", *args, "--json", str(out)])
    assert ran.exit_code == 0, ran.output
    return dict(json.loads(out.read_text()), printed=ran.output)


LLAMA_FP8 = ("--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--pp", "2", "--sp",
             "--mbs", "1", "--gbs", "64", "--zero", "1", "--precision", "fp8")


def test_estimate_with_a_stack_is_the_estimate_with_its_options(tmp_path: Path) -> None:
    """``estimate --stack megatron-bridge`` is ``estimate`` with the options the stack stands
    for, field for field and second for second: Llama 3 70B in FP8 at tp 8 with SP and ZeRO 1
    takes every value but the ZeRO-3 prefetch, which it says it left out."""
    stacked = _estimate(tmp_path, "stacked", *LLAMA_FP8, "--system", "dgx-h100",
                        "--stack", "megatron-bridge")
    spelled = _estimate(tmp_path, "spelled", *LLAMA_FP8, "--system", "dgx-h100",
                        "--tp-comm-overlap", "--overlap-param-gather", "--fp8-param-gather",
                        "--cross-entropy-fusion", "native", "--fp8-recipe", "tensorwise",
                        "--grad-reduce-bf16")
    assert stacked["strategy_fields"] == spelled["strategy_fields"]
    assert stacked["step_time_s"] == spelled["step_time_s"]
    assert stacked["step_time_s"] != _estimate(tmp_path, "plain", *LLAMA_FP8, "--system",
                                               "dgx-h100")["step_time_s"]
    said = stacked["stack"]
    assert isinstance(said, dict) and said["name"] == "megatron-bridge"
    assert said["said"][1:] == ["zero3_prefetch not applied at zero_stage 1 (no ZeRO-3 "
                                "gathers)"]


def test_an_option_given_wins_over_the_stack(tmp_path: Path) -> None:
    """An option on the command line (here the unfused loss) is kept and the stack's value
    named as not applied; a value the layout cannot use (TP overlap without SP, FP8 gathers
    and recipe on a BF16 run, the parameter gather at ZeRO 0) is left out, saying why."""
    got = _estimate(tmp_path, "given", "--model", "llama3-8b", "--gpus", "8", "--tp", "2",
                    "--mbs", "1", "--gbs", "8", "--system", "dgx-h100", "--stack",
                    "megatron-bridge", "--cross-entropy-fusion", "none")
    fields = got["strategy_fields"]
    assert isinstance(fields, dict)
    assert fields["cross_entropy_fusion"] == "none" and fields["grad_reduce_in_bf16"] is True
    assert not fields["tp_comm_overlap"] and not fields["fp8_param_gather"]
    assert fields["fp8_recipe"] == "delayed"
    said = " | ".join(got["stack"]["said"])  # type: ignore[index]
    for words in ("cross_entropy_fusion = 'native' not applied (--cross-entropy-fusion given)",
                  "tp_comm_overlap not applied without sequence parallelism",
                  "fp8_recipe not applied (a BF16 run", "overlap_param_gather not applied at "
                  "zero_stage 0", "fp8_param_gather not applied"):
        assert words in said, words


def test_a_stacks_attention_kernel_unless_system_names_one(tmp_path: Path) -> None:
    """NeMo 24.07's stack runs cuDNN's attention of 2024: the step is the one on
    ``dgx-h100@cudnn``; a kernel named on ``--system`` wins (the step on that kernel, the
    stack's named as not applied). Nothing else of the stack applies at tp 1, ZeRO 0, BF16."""
    base = ("--model", "llama3-8b", "--gpus", "8", "--mbs", "1", "--gbs", "8")
    stacked = _estimate(tmp_path, "cudnn", *base, "--system", "dgx-h100", "--stack",
                        "nemo-24.07")
    assert stacked["step_time_s"] == _estimate(tmp_path, "at", *base, "--system",
                                               "dgx-h100@cudnn")["step_time_s"]
    assert stacked["step_time_s"] != _estimate(tmp_path, "bare", *base, "--system",
                                               "dgx-h100")["step_time_s"]
    named = _estimate(tmp_path, "fa2", *base, "--system", "dgx-h100@flashattention-2",
                      "--stack", "nemo-24.07")
    assert named["step_time_s"] == _estimate(tmp_path, "fa2only", *base, "--system",
                                             "dgx-h100@flashattention-2")["step_time_s"]
    assert ("attention kernel cudnn not applied (--system names one)"
            in named["stack"]["said"])  # type: ignore[index]


def test_estimate_refuses_a_bad_stack_or_a_kernel_stack_on_a_mixed_cluster() -> None:
    """An unknown name is refused with the near one; a stack that sets the GPUs' attention
    with a mixed cluster is refused, saying what to do (no traceback either way)."""
    from tests.test_cli import run

    base = ("estimate", "--model", "llama3-8b", "--gpus", "16", "--pp", "2", "--mbs", "1",
            "--gbs", "16", "--system", "dgx-h100")
    bad = run(*base, "--stack", "nemo-2407")
    said = bad.stdout + bad.stderr
    assert bad.returncode != 0 and "no stack named 'nemo-2407'; did you mean" in said
    mixed = run(*base, "--stack", "nemo-24.07", "--stage-system", "1=dgx-a100-80gb")
    said = mixed.stdout + mixed.stderr
    assert mixed.returncode != 0 and "sets the GPUs' attention" in said
    assert "Traceback" not in said


@pytest.mark.parametrize(("field", "value", "layout", "why"), [
    ("tp_comm_overlap", True, (1, False, 1, "bf16", False), "at tp 1"),
    ("tp_comm_overlap", True, (8, False, 1, "bf16", False), "without sequence parallelism"),
    ("tp_comm_overlap", True, (8, True, 1, "bf16", False), None),
    ("zero3_prefetch", True, (1, False, 3, "bf16", False), None),
    ("zero3_prefetch", True, (1, False, 1, "bf16", False), "no ZeRO-3 gathers"),
    ("moe_dispatcher", "deepep", (1, False, 1, "bf16", False), "no expert-parallel"),
    ("moe_dispatcher", "deepep", (1, False, 1, "bf16", True), None),
    ("fp8_param_gather", True, (1, False, 0, "fp8", False), "needs an FP8 run on ZeRO"),
    ("fp8_param_gather", True, (1, False, 3, "fp8", False), None),
    ("fp8_recipe", "mxfp8", (1, False, 1, "bf16", False), "a BF16 run"),
    ("fp8_recipe", "mxfp8", (1, False, 1, "fp8", False), None),
    ("overlap_param_gather", True, (1, False, 3, "bf16", False), "only ZeRO 1 and 2"),
    ("overlap_param_gather", True, (1, False, 2, "bf16", False), None),
    ("grad_reduce_in_bf16", True, (1, False, 0, "bf16", False), None),
])
def test_what_a_layout_has_no_use_for(field: str, value: object,
                                      layout: tuple[int, bool, int, str, bool],
                                      why: str | None) -> None:
    """The one rule ``validate`` (per row) and ``estimate --stack`` both leave values out by."""
    from analysis.stacks import Layout, inapplicable

    got = inapplicable(field, value, Layout(*layout))
    assert (got is None) if why is None else (got is not None and why in got)


def _study(**extra: object) -> object:
    from analysis.study import study_from_dict

    data = {"model": "llama3-8b", "system": "dgx-h100", "gpus": 16, "global_batch_size": 64,
            **extra}
    return study_from_dict(data, name="t")


def test_a_studys_stack_fills_what_each_strategy_leaves() -> None:
    """``stack = "megatron-bridge"`` in a study: each listed strategy takes the stack's values
    it leaves out and can use (TP overlap with SP only, FP8 gathers on FP8 only); one that sets
    a field keeps its own."""
    from analysis.study import Study

    st = _study(stack="megatron-bridge", strategies=[
        {"tp": 2, "sequence_parallel": True, "zero_stage": 1, "precision": "fp8"},
        {"tp": 2, "zero_stage": 1},
        {"tp": 2, "sequence_parallel": True, "zero_stage": 1, "tp_comm_overlap": False}])
    assert isinstance(st, Study) and st.stack == "megatron-bridge"
    fp8, bf16, own = st.strategies
    assert fp8.tp_comm_overlap and fp8.fp8_param_gather and fp8.fp8_recipe == "tensorwise"
    assert fp8.grad_reduce_in_bf16 and fp8.cross_entropy_fusion == "native"
    assert not bf16.tp_comm_overlap and not bf16.fp8_param_gather  # (no SP; BF16)
    assert bf16.grad_reduce_in_bf16 and bf16.overlap_param_gather
    assert not own.tp_comm_overlap and own.grad_reduce_in_bf16


def test_a_studys_stack_sets_its_kernel_and_never_invalidates_a_strategy() -> None:
    """NeMo 24.07's stack gives the study's system cuDNN's attention (``dgx-h100@cudnn``'s);
    over the default search space no combination the stack touches turns invalid, every one
    with SP at tp > 1 overlaps its TP communication, none without."""
    from analysis.study import Study
    from analysis.sweep import enumerate_space
    from replay import resolve_system

    plain, stacked = _study(), _study(stack="nemo-24.07")
    assert isinstance(plain, Study) and isinstance(stacked, Study)
    assert stacked.system.gpu == resolve_system("dgx-h100@cudnn").gpu != plain.system.gpu
    (bare, bad_bare), (mine, bad_mine) = enumerate_space(plain), enumerate_space(stacked)
    assert len(mine) == len(bare) and bad_mine == bad_bare and len(mine) > 50
    assert all(s.tp_comm_overlap == (s.tp > 1 and s.sequence_parallel) for s in mine)


def test_a_bad_stack_in_a_study_is_refused() -> None:
    with pytest.raises(ConfigError, match="no stack named 'megatron'"):
        _study(stack="megatron")
    with pytest.raises(ConfigError, match="stack must be a stack's name"):
        _study(stack=1)


def test_the_best_strategys_command_carries_the_stack() -> None:
    """The "#1 alone" command of a study under a stack: the stack's kernel on the system (its
    flags already spell each strategy field), and ``--stack`` only for a stack that sets no
    strategy field (llm-foundry's dropout; Megatron-LM 2022's unfused attention, where a kernel
    the system names wins), so the command costs what the study did."""
    from analysis.strategy_row import estimate_command

    assert "--system dgx-h100@cudnn --tp 2" in estimate_command("llama3-8b", "dgx-h100",
                                                                "--tp 2", "nemo-24.07")
    assert "@" not in estimate_command("llama3-8b", "dgx-h100", "--tp 2", "megatron-bridge")
    assert estimate_command("x", "dgx-a100-80gb", "--tp 2", "llm-foundry").endswith(
        "--tp 2 --stack llm-foundry")
    named = estimate_command("x", "dgx-a100-80gb@flashattention-2", "", "megatron-lm-2022")
    assert "--system dgx-a100-80gb@flashattention-2 " in named  # (a kernel named wins)
    assert named.endswith("--stack megatron-lm-2022")


def test_sweep_takes_a_stack_for_a_job_not_beside_a_study(tmp_path: Path) -> None:
    """``sweep --stack`` with the job's options ranks the space under it (its strategies'
    labels carry the stack's switches); beside a study file it is refused (the file says
    ``stack = NAME``)."""
    got = CliRunner().invoke(app, ["sweep", "-o", str(tmp_path / "o"), "--model", "llama3-8b",
                                   "--system", "dgx-h100", "--gpus", "16", "--gbs", "64",
                                   "--stack", "megatron-bridge", "--top-k", "1", "--workers",
                                   "1"], env={"COLUMNS": "250"})
    assert got.exit_code == 0, got.output
    assert "stack megatron-bridge" in got.output and "-cenative-" in got.output
    import json
    import shlex

    best = pl.read_parquet(tmp_path / "o" / "results.parquet").row(0, named=True)
    said = " ".join(got.output.split())
    command = said[said.index("#1 alone: trainsim estimate ") + len("#1 alone: trainsim "):]
    again = CliRunner().invoke(app, [*shlex.split(command), "--json", str(tmp_path / "e.json")])
    assert again.exit_code == 0, again.output  # the command costs #1 as the sweep did
    estimated = json.loads((tmp_path / "e.json").read_text())["step_time_s"]
    assert estimated == pytest.approx(best["fast_step_time_s"], rel=1e-12)
    both = CliRunner().invoke(app, ["sweep", str(tmp_path / "s.toml"), "-o",
                                    str(tmp_path / "p"), "--stack", "megatron-bridge"])
    assert both.exit_code != 0 and "not both" in str(both.exception)


def test_a_stack_is_part_of_what_a_resumed_run_must_match() -> None:
    """A folder a run without the stack wrote is not resumed by one with it (the stack's
    strategy values change every strategy it touches); one without keeps the older record."""
    import dataclasses

    from analysis.resume import fingerprint
    from analysis.study import Study

    plain = _study()
    assert isinstance(plain, Study)
    stacked = dataclasses.replace(plain, stack="megatron-bridge")
    assert "stack" not in fingerprint(plain)
    assert fingerprint(stacked) != fingerprint(plain)


def test_scale_says_the_stack_it_runs(tmp_path: Path) -> None:
    """``scale --stack`` names the stack before its counts, as ``sweep`` does, and every
    count's best strategy carries the stack's switches where its layout uses them."""
    got = CliRunner().invoke(app, ["scale", "--model", "llama3-8b", "--system", "dgx-h100",
                                   "--gbs", "64", "--gpus", "8,16", "--stack", "nemo-24.07",
                                   "-o", str(tmp_path / "o"), "--workers", "1"],
                             env={"COLUMNS": "250"})
    assert got.exit_code == 0, got.output
    assert got.output.lstrip().startswith("stack nemo-24.07 (NVIDIA NeMo 2.0")
    import re

    labels = re.findall(r"tp(\d+)-pp\d+-dp\d+\S*", got.output)
    full = re.findall(r"tp\d+-pp\d+-dp\d+\S*", got.output)
    assert len(full) == 2  # one best strategy a count
    for tp, label in zip(labels, full, strict=True):
        assert ("-tpo" in label) == (int(tp) > 1 and "-sp" in label), label
