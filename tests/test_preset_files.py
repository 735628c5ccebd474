"""``trainsim catalog NAME`` and ``trainsim systems NAME``: a preset printed as the file to edit
for another model or cluster reads back as that preset, every field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from typer.testing import CliRunner

from analysis.cli import app
from replay import get_system, resolve_system, system_names
from tracegen import ConfigError, get_model, model_names, resolve_model
from tracegen.catalog import model_toml


@pytest.mark.parametrize("name", model_names())
def test_a_preset_model_printed_reads_back_as_itself(tmp_path: Path, name: str) -> None:
    f = tmp_path / "model.toml"
    f.write_text(model_toml(name), encoding="utf-8")
    assert resolve_model(f) == get_model(name)


@pytest.mark.parametrize("name", system_names())
def test_a_preset_system_printed_reads_back_as_itself(tmp_path: Path, name: str) -> None:
    got = CliRunner().invoke(app, ["systems", name])
    assert got.exit_code == 0, got.output
    assert "# " in got.output  # (its evidence comments kept)
    f = tmp_path / "mine.toml"
    f.write_text(got.output, encoding="utf-8")
    assert dataclasses.replace(resolve_system(f), name=name) == get_system(name)


def test_the_cli_prints_a_model_and_names_an_unknown_preset() -> None:
    got = CliRunner().invoke(app, ["catalog", "llama3-8b"])
    assert got.exit_code == 0 and got.output == model_toml("llama3-8b")
    assert got.output.startswith("# llama3-8b: Dubey et al. 2024")
    with pytest.raises(ConfigError, match=r"no preset model named 'nope'; presets: gpt-1\.7b"):
        model_toml("nope")

    from tests.test_cli import run

    bad = run("systems", "nope")
    assert bad.returncode != 0 and "no preset system named 'nope'" in bad.stderr + bad.stdout


def test_a_misspelt_preset_is_named_with_the_nearest_one() -> None:
    """A name one edit from a preset says which it likely meant, before the whole list; a name
    near none says only the list."""
    from replay import get_system
    from tracegen import get_model

    with pytest.raises(ConfigError, match=r"'llama3-70'; did you mean 'llama3-70b'\? presets: "):
        get_model("llama3-70")
    with pytest.raises(ConfigError, match=r"'gb300'; did you mean 'gb300-nvl72'\? presets: "):
        get_system("gb300")
    with pytest.raises(ConfigError) as far:
        get_system("tpu-v9")
    assert "did you mean" not in str(far.value)
