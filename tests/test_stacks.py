"""``trainsim validate --stack``: a framework's settings beyond the schema, by name, as the
reference sets are validated with them (``analysis.stacks``, which those sets' tests read)."""

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
