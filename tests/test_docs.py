"""The README's numbers are the tool's current numbers: its `make demo` table (replayed step
times of the default study) against the fast path, which tracks replay within 0.6% on these four
layouts. A physics change that moves a step by more than 1% fails here until the README is
updated (smaller drifts need a replay to see: `make demo`)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from analysis.cli import app
from analysis.compare import strategy_label
from analysis.fastpath import estimate
from analysis.study import load_study

ROOT = Path(__file__).resolve().parents[1]
ROW = re.compile(r"^\| (\d) \| (\S+) \| ([\d.]+) \| ([\d,]+) \|", re.MULTILINE)


def _readme_rows() -> dict[str, tuple[float, float]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return {m[2]: (float(m[3]), float(m[4].replace(",", ""))) for m in ROW.finditer(text)}


def test_readme_demo_table_matches_the_default_study() -> None:
    rows = _readme_rows()
    study = load_study(ROOT / "analysis" / "studies" / "default.toml")
    assert len(rows) == len(study.strategies) == 4
    tokens_per_step = study.global_batch_size * study.model.seq_len
    for s in study.strategies:
        label = strategy_label(s)
        assert label in rows, f"README lacks {label}"
        step_s, tokens_per_s = rows[label]
        assert estimate(study.model, s, study.system).step_time_s == pytest.approx(step_s,
                                                                                  rel=0.01)
        assert tokens_per_step / step_s == pytest.approx(tokens_per_s, rel=0.001)


# The README's `trainsim estimate` examples: each command (continued lines joined, optional
# `[...]` parts left out) with the comment lines under it. The comment's first "N s" is the
# step time and its first "N GiB" the peak memory, as that command prints them now (with
# --stage-system: the mixed step first, the split by the stages' speeds last).
_EXAMPLE = re.compile(r"^trainsim estimate (?P<cmd>(?:.*\\\n)*.*)\n(?P<notes>(?:[ \t]+#.*\n)*)",
                      re.MULTILINE)
_SECONDS = re.compile(r"(?<![\w.,])(\d+\.\d+) s\b")
_GIB = re.compile(r"(?<![\w.,])(\d+\.\d+) GiB\b")


def _readme_examples() -> list[tuple[str, str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    out = []
    for m in _EXAMPLE.finditer(text):
        lines = [line.split("#", 1)[0] for line in m["cmd"].split("\\\n")]
        cmd = re.sub(r"\[[^\]]*\]", " ", " ".join(lines))
        notes = " ".join(line.split("#", 1)[1] for line in m["notes"].splitlines())
        if _SECONDS.search(notes) or _GIB.search(notes):
            out.append((cmd, notes))
    return out


def _agrees(printed: str, value: float) -> bool:
    """Whether a README figure is the value as printed: within one unit of its last digit
    (rounding either way), so a change of the tool's answer by more shows."""
    unit = 10.0 ** -len(printed.partition(".")[2])
    return abs(float(printed) - value) <= unit


def test_readme_finds_its_estimate_examples() -> None:
    cmds = [cmd for cmd, _ in _readme_examples()]
    assert len(cmds) >= 7
    assert any("--dist-opt-instances 128 --outer-dp-sharding optim" in c for c in cmds)


@pytest.mark.parametrize("example", _readme_examples(), ids=lambda e: e[0][:60])
def test_readme_estimate_examples_print_the_readme_figures(example: tuple[str, str],
                                                            tmp_path: Path) -> None:
    """Each README estimate example's step time and memory are the tool's current ones (the
    HFSDP example said 8.37 s for two sessions after the fast path gave 8.33)."""
    cmd, notes = example
    out = tmp_path / "e.json"
    result = CliRunner().invoke(app, ["estimate", *shlex.split(cmd), "--json", str(out)])
    assert result.exit_code == 0, result.output
    got = json.loads(out.read_text(encoding="utf-8"))
    if "--stage-system" in cmd:  # a mixed cluster: its step, then the balanced split's
        secs = _SECONDS.findall(notes)
        mixed = got["mixed"]
        assert _agrees(secs[0], mixed["step_time_s"]), (cmd, secs[0], mixed["step_time_s"])
        assert _agrees(secs[-1], mixed["balanced"]["step_time_s"]), (cmd, secs[-1])
        return
    if (sec := _SECONDS.search(notes)) is not None:
        assert _agrees(sec[1], got["step_time_s"]), (cmd, sec[1], got["step_time_s"])
    if (gib := _GIB.search(notes)) is not None:
        assert _agrees(gib[1], got["peak_memory_GiB"]), (cmd, gib[1], got["peak_memory_GiB"])


@pytest.mark.skipif(not (ROOT.parent / "shared" / "validation" / "public_runs.csv").is_file(),
                    reason="the public set lies beside the checkout")
def test_the_reference_bench_gives_the_public_figures_the_readme_states() -> None:
    """``bench/reference_sets.py`` (every reference set with its test's stack, one table) gives
    the public set the median, p90 and max the README's Fidelity section states."""
    import subprocess
    import sys

    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    said = re.search(r"median \|error\| \*\*([0-9.]+)%\*\*, p90 ([0-9.]+)%, max ([0-9.]+)%",
                     text)
    assert said is not None
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "reference_sets.py"), "--set",
                        "public"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert r.returncode == 0, r.stderr
    row = next(line for line in r.stdout.splitlines() if line.startswith("public"))
    rows, median, p90, worst = row.split()[4:8]
    assert rows == "14" and (median, p90, worst) == said.groups(), (row, said.groups())


def test_readme_counts_the_runs_files_extension_columns() -> None:
    """The README's count of the columns a runs file may carry beyond the schema is
    ``validate``'s (it had fallen behind once)."""
    from analysis import validate as V

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    words = {"twenty-five": 25, "twenty-six": 26, "twenty-seven": 27, "twenty-eight": 28,
             "twenty-nine": 29, "thirty": 30, "thirty-one": 31, "thirty-two": 32}
    said = re.search(r"may carry ([a-z-]+) columns beyond the schema", text)
    assert said is not None
    count = (len(V.EXTENSION_INT_COLUMNS) + len(V.EXTENSION_FLOAT_COLUMNS)
             + len(V.EXTENSION_TEXT_COLUMNS) + len(V.EXTENSION_BOOL_COLUMNS))
    assert words.get(said.group(1)) == count, (said.group(1), count)
    for column in (*V.EXTENSION_INT_COLUMNS, *V.EXTENSION_FLOAT_COLUMNS,
                   *V.EXTENSION_TEXT_COLUMNS, *V.EXTENSION_BOOL_COLUMNS):
        assert f"`{column}`" in text, column
