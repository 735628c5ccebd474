"""The ``trainsim`` command line, run as a user would (a subprocess)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import read_et
from tracegen import read_manifest


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "analysis.cli", *args], capture_output=True,
                          text=True, timeout=120, env={"COLUMNS": "200", "PATH": "/usr/bin"})


def test_tracegen_writes_a_set_and_prints_a_summary(tmp_path: Path) -> None:
    out = tmp_path / "set"
    r = run("tracegen", "--model", "gpt-1.7b", "--gpus", "8", "--tp", "2", "--pp", "2", "--sp",
            "--mbs", "1", "--gbs", "8", "--zero", "1", "--mode", "full", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "full trace set, world size 8, 8 rank file(s)" in r.stdout
    assert "memory GiB" in r.stdout
    man = read_manifest(out)
    assert man["strategy"]["dp"] == 2 and len(man["ranks_written"]) == 8


def test_tracegen_model_file(tmp_path: Path) -> None:
    f = tmp_path / "m.toml"
    f.write_text("num_layers = 2\nhidden_size = 64\nnum_attention_heads = 4\n"
                 "ffn_hidden_size = 128\nvocab_size = 128\nseq_len = 16\n")
    r = run("tracegen", "--model", str(f), "--gpus", "2", "--mbs", "1", "--gbs", "2",
            "-o", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr


def test_overlap_param_gather_is_recorded_and_flagged_where_it_does_nothing(tmp_path: Path
                                                                            ) -> None:
    f = tmp_path / "m.toml"
    f.write_text("num_layers = 2\nhidden_size = 64\nnum_attention_heads = 4\n"
                 "ffn_hidden_size = 128\nvocab_size = 128\nseq_len = 16\n")
    common = ("tracegen", "--model", str(f), "--gpus", "2", "--mbs", "1", "--gbs", "2",
              "--overlap-param-gather")
    r = run(*common, "--zero", "1", "-o", str(tmp_path / "z1"))
    assert r.returncode == 0, r.stderr
    assert read_manifest(tmp_path / "z1")["strategy"]["overlap_param_gather"] is True
    assert "changes nothing" not in r.stdout
    r = run(*common, "--zero", "0", "-o", str(tmp_path / "z0"))
    assert r.returncode == 0, r.stderr
    assert "--overlap-param-gather changes nothing at --zero 0" in r.stdout


@pytest.mark.parametrize(("zero", "gbs", "said"), [
    (2, "8", True),  # 4 micro-batches a replica accumulate: the note
    (2, "2", False),  # one micro-batch: one reduce-scatter either way
    (1, "8", False),  # Megatron's distributed optimizer: what is costed
])
def test_zero2_says_how_its_gradients_are_reduced(zero: int, gbs: str, said: bool) -> None:
    """ZeRO-2 is costed with one reduce-scatter a step and the gradient shard in memory; where
    micro-batches accumulate, estimate says that frameworks freeing the gradients reduce every
    micro-batch (and how many reduce-scatters that is)."""
    r = run("estimate", "--model", "gpt-1.7b", "--gpus", "2", "--mbs", "1", "--gbs", gbs,
            "--zero", str(zero), "--system", "dgx-h100")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert ("ZeRO-2 is costed with one gradient reduce-scatter a step" in text) is said
    if said:
        assert "reduce every micro-batch's gradients to free them, 4 reduce-scatters" in text
        # and what that costs them: the step with --grad-reduce-per-microbatch, as estimated
        got = re.search(r"here: ([\d.]+) s a step that way \(\+([\d.]+)%; "
                        r"--grad-reduce-per-microbatch\)", text)
        assert got, text
        theirs = run("estimate", "--model", "gpt-1.7b", "--gpus", "2", "--mbs", "1", "--gbs",
                     gbs, "--zero", "2", "--system", "dgx-h100", "--grad-reduce-per-microbatch")
        step = re.search(r"step time ([\d.]+) s", " ".join(theirs.stdout.split()))
        assert step and step.group(1) == got.group(1)
        assert float(got.group(2)) > 0
        assert "ZeRO-2 is costed" not in theirs.stdout


def test_estimate_says_how_every_micro_batch_s_reductions_weigh(tmp_path: Path) -> None:
    """With --grad-reduce-per-microbatch, estimate prints one micro-batch's reductions against
    its compute and how long the step waits for them, and writes the same to the JSON."""
    out = tmp_path / "e.json"
    r = run("estimate", "--model", "gpt-1.7b", "--gpus", "16", "--mbs", "1", "--gbs", "64",
            "--zero", "2", "--system", "dgx-h100", "--grad-reduce-per-microbatch",
            "--json", str(out))
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    got = json.loads(out.read_text())["grad_stream"]
    assert (f"gradients reduced in every micro-batch: "
            f"{got['reduce_s_per_microbatch'] * 1e3:,.1f} ms of collectives a micro-batch on "
            f"stage 0's data-parallel stream against {got['compute_s_per_microbatch'] * 1e3:,.1f}"
            " ms of its compute") in text
    assert got["reduce_s_per_microbatch"] > 0 and got["wait_after_last_backward_s"] >= 0


def test_a_study_with_zero2_says_it_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                         ) -> None:
    """``compare`` (its strategies) and ``sweep`` / ``scale`` (the ZeRO stages searched): the
    ZeRO-2 note once where any strategy is ZeRO-2, nothing where none is."""
    import dataclasses

    from analysis.cli_common import note_zero2_study
    from analysis.cli_study import _note_space
    from analysis.study import load_study
    from tests.studies import write_study

    note_zero2_study(iter([1, 2, 2]))
    assert capsys.readouterr().out.count("note: ZeRO-2 is costed") == 1
    note_zero2_study([0, 1, 3])
    assert capsys.readouterr().out == ""
    study = load_study(write_study(tmp_path / "s", strategies=False, failures=False,
                                   search=True))
    _note_space(dataclasses.replace(study, search={**study.search, "zero_stage": [1, 2]}))
    assert capsys.readouterr().out.count("note: ZeRO-2 is costed") == 1
    _note_space(dataclasses.replace(study, search={**study.search, "zero_stage": [0, 1]}))
    assert capsys.readouterr().out == ""


def test_bad_input_is_one_plain_line_not_a_traceback(tmp_path: Path) -> None:
    r = run("tracegen", "--model", "llama3-8b", "--gpus", "8", "--tp", "3", "--mbs", "1",
            "--gbs", "8", "-o", str(tmp_path))
    assert r.returncode == 2
    assert "ConfigError: invalid strategy: --gpus 8 is not divisible by tp·pp·cp" in r.stderr
    assert "Traceback" not in r.stderr
    r = run("tracegen", "--model", "llama3-8b", "--gpus", "12", "--tp", "3", "--mbs", "1",
            "--gbs", "8", "-o", str(tmp_path))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "num_attention_heads 32 is not divisible by tp 3" in r.stderr
    r = run("tracegen", "--model", "llama3-8b", "--gpus", "8", "--tp", "0", "--mbs", "1",
            "--gbs", "8", "-o", str(tmp_path))  # was "not divisible by ... = 0"
    assert r.returncode == 2 and "invalid strategy: --tp must be ≥ 1, got 0" in r.stderr



def test_a_value_without_its_option_is_named_with_the_option_it_reads_as(tmp_path: Path
                                                                         ) -> None:
    """``trainsim estimate llama3-8b dgx-h100 …``: the names read as the options they fit
    and the command's required options are listed (click alone said "Missing option
    '--model'" though a model was typed); a value that fits none is named alone."""
    r = run("estimate", "llama3-8b", "dgx-h100@flashattention-2", "--gpus", "8")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert ("'llama3-8b', 'dgx-h100@flashattention-2': `trainsim estimate` takes every input "
            "as an option, e.g. --model llama3-8b --system dgx-h100@flashattention-2 (it "
            "needs --model, --gpus, --mbs, --gbs, --system)") in r.stderr
    r = run("tracegen", "--model", "llama3-8b", "--gpus", "8", "--sp", "8", "--mbs", "1",
            "--gbs", "8", "-o", str(tmp_path))  # (--sp is a flag: the 8 is stray)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "'8': `trainsim tracegen` takes every input as an option (it needs" in r.stderr
    assert not list(tmp_path.iterdir())  # refused before any work


def test_an_output_path_that_cannot_be_written_is_refused_before_any_work(tmp_path: Path
                                                                          ) -> None:
    """A plot format matplotlib cannot write, a folder where a file goes, a file where a folder
    goes: one line naming the option, before minutes of simulation (these were tracebacks from
    polars and matplotlib at the end); a missing folder is created."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    est = ("estimate", "--model", "llama3-8b", "--gpus", "8", "--tp", "8", "--mbs", "1",
           "--gbs", "8", "--system", "dgx-h100")
    cases = [
        (("validate", "runs.csv", "--plot", str(tmp_path / "v.txt")),
         "invalid --plot: 'v.txt': a plot needs one of the endings"),
        (("validate", "runs.csv", "--out", str(tmp_path)),
         f"invalid --out: {tmp_path} is a folder; give a file name"),
        ((*est, "--json", str(blocker / "e.json")),
         f"invalid --json: {blocker} is a file, not a folder"),
        (("tracegen", *est[1:-2], "-o", str(blocker)),
         f"invalid --out: {blocker} is a file, not a folder"),
        (("report", str(tmp_path), "-o", str(blocker / "r")),
         f"invalid --out: {blocker} is a file, not a folder"),
    ]
    for args, message in cases:
        r = run(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr)
        assert message in r.stderr, (args, r.stderr)
    r = run(*est, "--json", str(tmp_path / "new" / "deeper" / "e.json"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "new" / "deeper" / "e.json").read_text().startswith("{")

def _table_rows(text: str) -> dict[str, list[str]]:
    """A rich table's rows by their first cell, each cell's wrapped lines joined."""
    rows: dict[str, list[str]] = {}
    last: list[str] = []
    for line in text.splitlines():
        if line.count("│") <= 2:
            continue
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if cells[0]:
            last = rows[cells[0]] = cells
        elif last:
            last[:] = [f"{a} {b}".strip() for a, b in zip(last, cells, strict=False)]
    return rows


def test_catalog_lists_presets() -> None:
    r = run("catalog")
    assert r.returncode == 0
    assert "llama3.1-405b" in r.stdout and "405.8" in r.stdout
    rows = _table_rows(r.stdout)
    assert rows["gpt3-175b"][9] == "0.1" and rows["llama3.1-405b"][9] == "0"  # dropout
    assert "160×1536 top-8" in rows["glm4.5-355b-a32b"][6] and "first 3 dense" in r.stdout
    assert "256×2048 top-8 in 4 of" in rows["deepseek-v3"][6]  # its groups, then shared experts
    assert ("Sliding-window attention: mistral-7b 4,096 keys, every layer; gemma2-9b 4,096 "
            "keys, 1 layer(s) in 2; gemma3-27b 1,024 keys, 5 layer(s) in 6") in " ".join(
                r.stdout.split())


GOLDEN = Path(__file__).resolve().parent.parent / "traces" / "golden_tiny_tp2pp2dp2"


def test_replay_writes_summary_and_perfetto_timeline(tmp_path: Path) -> None:
    import json

    summary, timeline = tmp_path / "s.json", tmp_path / "t.json"
    r = run("replay", str(GOLDEN), "--system", "dgx-h100", "--summary", str(summary),
            "--timeline", str(timeline), "--no-fold")
    assert r.returncode == 0, r.stderr
    assert "step time" in r.stdout and "Per-rank breakdown" in r.stdout
    s = json.loads(summary.read_text())
    for key in ("step_time_s", "ranks", "nodes", "tokens_per_s", "mfu"):
        assert key in s
    nodes = sum(len(read_et(f)[1]) for f in GOLDEN.glob("*.et"))  # decoded by mlc-chakra
    assert s["ranks"] == 8 and s["nodes"] == nodes > 2000
    events = json.loads(timeline.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == set(range(8))
    threads = {(e["pid"], e["args"]["name"]) for e in events if e.get("name") == "thread_name"}
    assert (0, "compute") in threads and (0, "p2p") in threads
    assert all(e["dur"] >= 0 for e in events if e["ph"] == "X")


def test_replay_summary_to_stdout_keeps_stdout_data_only(tmp_path: Path) -> None:
    """``--summary -``: stdout is the metrics JSON alone, the same as written to a file; the
    printed step and breakdown go to stderr."""
    r = run("replay", str(GOLDEN), "--system", "dgx-h100", "--summary", "-")
    assert r.returncode == 0, r.stderr
    assert "step time" in r.stderr and "Per-rank breakdown" in r.stderr
    kept = tmp_path / "s.json"
    assert run("replay", str(GOLDEN), "--system", "dgx-h100", "--summary",
               str(kept)).returncode == 0
    assert json.loads(r.stdout) == json.loads(kept.read_text())


def test_replay_writes_the_timeline_and_breakdown_as_tables(tmp_path: Path) -> None:
    """--timeline FILE.parquet is the timeline frame (a row per node of every simulated rank,
    as decoded from the .et files), --breakdown FILE.csv the per-rank breakdown, whose ranks end
    by the step's end; any other ending is refused before the replay."""
    import json

    import polars as pl

    summary, timeline, breakdown = tmp_path / "s.json", tmp_path / "t.parquet", tmp_path / "b.csv"
    r = run("replay", str(GOLDEN), "--system", "dgx-h100", "--summary", str(summary),
            "--timeline", str(timeline), "--breakdown", str(breakdown), "--no-fold")
    assert r.returncode == 0, r.stderr
    s = json.loads(summary.read_text())
    frame, per_rank = pl.read_parquet(timeline), pl.read_csv(breakdown)
    assert frame.height == s["nodes"] == sum(len(read_et(f)[1]) for f in GOLDEN.glob("*.et"))
    assert sorted(per_rank["rank"]) == sorted(frame["rank"].unique()) == list(range(8))
    assert per_rank["end_s"].max() == pytest.approx(s["step_time_s"], rel=1e-9)
    assert frame["end_s"].max() == pytest.approx(s["step_time_s"], rel=1e-9)
    bad = run("replay", str(GOLDEN), "--system", "dgx-h100", "--breakdown", str(tmp_path / "b.txt"))
    assert bad.returncode != 0 and "the breakdown is written as .csv or .parquet" in bad.stdout + \
        bad.stderr and "Traceback" not in bad.stderr


def test_replay_workload_prefix_and_bad_system(tmp_path: Path) -> None:
    r = run("replay", str(GOLDEN / "tiny"), "--system", "dgx-a100-80gb")
    assert r.returncode == 0, r.stderr
    assert "folded: every rank provably runs its pipeline stage's program" in r.stdout
    r = run("replay", str(GOLDEN), "--system", "nope")
    assert r.returncode == 2 and "ConfigError: invalid system: no preset system named 'nope'" in (
        r.stderr.replace("\n", " "))
    r = run("replay", str(tmp_path), "--system", "dgx-h100")
    assert r.returncode == 2 and "TraceFormatError" in r.stderr and "Traceback" not in r.stderr


def test_memory_that_does_not_fit_is_flagged(tmp_path: Path) -> None:
    out = tmp_path / "big"
    r = run("tracegen", "--model", "llama3-70b", "--gpus", "8", "--tp", "8", "--mbs", "1",
            "--gbs", "8", "--system", "dgx-h100", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "does not fit: stage(s) [0] need more than 80 GiB per GPU" in r.stdout
    r = run("replay", str(out), "--system", "dgx-h100")
    assert r.returncode == 0 and "DOES NOT FIT" in r.stdout


def test_a_precision_the_gpu_has_no_tensor_cores_for_is_noted() -> None:
    """fp8 on an A100 or V100 and bf16 on a V100 are costed at the rate the GPU has; the user
    is told so (validate refuses such a row as a data error instead). Hopper's fp8 is not."""
    est = ("estimate", "--model", "llama3-8b", "--gpus", "8", "--tp", "8", "--mbs", "1",
           "--gbs", "8", "--system")
    notes = {}
    for system, precision in (("dgx-a100-80gb", "fp8"), ("dgx1-v100", "bf16"),
                              ("dgx-h100", "fp8"), ("dgx1-v100", "fp16")):
        r = run(*est, system, "--precision", precision)
        assert r.returncode == 0, r.stderr
        notes[system, precision] = [x for x in r.stdout.splitlines() if x.startswith("note:")
                                    and not x.startswith("note: the loss")]  # (its own test)
    assert notes["dgx-a100-80gb", "fp8"] == [
        "note: dgx-a100-80gb has no FP8 tensor cores (FP8 training needs Hopper or later); fp8 "
        "GEMMs are costed at its 16-bit rate"]
    assert "has no bf16 tensor cores (Volta)" in notes["dgx1-v100", "bf16"][0]
    assert notes["dgx-h100", "fp8"] == notes["dgx1-v100", "fp16"] == []


def test_systems_lists_every_preset_with_its_nvls_bandwidth() -> None:
    from replay import system_names

    r = run("systems")
    assert r.returncode == 0, r.stderr
    for name in system_names():
        assert name in r.stdout
    h100 = next(line for line in r.stdout.splitlines() if "dgx-h100" in line)
    assert "480" in h100  # NVLS all-reduce bus bandwidth (ANCHORS)
    a100 = next(line for line in r.stdout.splitlines() if "dgx-a100-80gb" in line)
    assert "—" in a100  # no NVLink SHARP before Hopper
    # a large GEMM as trainsim costs it: MAMF at the sustained clock, 312 · 0.869 · 0.926
    assert "│ 251 " in a100
    gb200 = next(line for line in r.stdout.splitlines() if "gb200-nvl72" in line)
    cells = [c.strip() for c in gb200.split("│")]
    assert cells[7] == "72" and cells[-4] == "256"  # the rack's domain; its NVLink-C2C
    assert cells[-3] == "18"  # the host CPU rate it borrows (dgx-h100.toml's evidence)
    assert cells[-2] == "894 (4)"  # a compute tray's two Graces' memory, for its 4 GPUs
    # each row one line; the descriptions below the table, each whole on its own line
    from replay import get_system

    rows = [line for line in r.stdout.splitlines() if line.startswith("│")]
    assert len(rows) == len(system_names())
    for name in system_names():
        assert f"{name}: {get_system(name).description}" in r.stdout


def test_validate_help_names_every_attention_kernel() -> None:
    from replay.attention_kernels import KERNELS

    r = run("validate", "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.replace("│", " ").split())
    for kernel in KERNELS:
        assert f"{kernel} " in text or f"{kernel}," in text, kernel


def test_worker_and_job_counts_below_their_least_are_refused(tmp_path: Path) -> None:
    """--workers 0 or --jobs -1 had silently run serially; now typer's usage error names the
    bound."""
    for args, name, least in ((("compare", "default", "-o", str(tmp_path), "--workers", "0"),
                               "--workers", 1),
                              (("sweep", "default", "-o", str(tmp_path), "--workers", "-2"),
                               "--workers", 1),
                              (("validate", "runs.csv", "--jobs", "-1"), "--jobs", 0)):
        r = run(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"Invalid value for '{name}'" in r.stderr, r.stderr
        assert f"greater than or equal to {least}" in r.stderr, r.stderr


def test_no_help_text_loses_square_brackets_to_rich_markup() -> None:
    """Typer renders help through Rich, which takes ``[word]`` as a style tag and drops it;
    a literal bracket must be written ``\\[``."""
    import re

    import typer.main

    from analysis.cli import app

    group = typer.main.get_command(app)
    texts = [group.help or ""]
    for command in group.commands.values():  # type: ignore[attr-defined]
        texts.append(command.help or "")
        texts += [getattr(p, "help", None) or "" for p in command.params]
    swallowed = [t for t in texts if re.search(r"(?<!\\)\[[a-z]", t)]
    assert not swallowed, swallowed


def test_out_of_memory_is_told_not_traced(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A command that runs out of memory (a full-mode replay of thousands of ranks) ends with
    what to do instead — representative mode, fewer GPUs, the fast path — and exit code 3, not
    a traceback."""
    import analysis.cli as cli

    def exhausted() -> None:
        raise MemoryError

    monkeypatch.setattr(cli, "app", exhausted)
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == 3
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("MemoryError: this machine ran out of memory")
    assert "--mode representative" in err and "trainsim estimate" in err
    assert "Traceback" not in err


def test_compute_trace_says_which_nodes_had_no_duration(tmp_path: Path) -> None:
    """trainsim's own traces carry shapes, not durations: timed 'by the trace', every compute
    node falls back to the GPU model, and the output says so (the two step times agree)."""
    from chakra.schema.protobuf import et_def_pb2 as pb

    comp = sum(n.type == pb.COMP_NODE for f in GOLDEN.glob("*.et") for n in read_et(f)[1])
    r = run("replay", str(GOLDEN), "--system", "dgx-h100", "--compute", "trace", "--no-fold")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert f"{comp:,} of {comp:,} compute nodes carry no duration_micros" in text
    model = run("replay", str(GOLDEN), "--system", "dgx-h100", "--no-fold")
    assert "duration_micros" not in model.stdout
    step = [line for line in model.stdout.splitlines() if line.startswith("step time")]
    assert step and step[0] in r.stdout


@pytest.mark.parametrize(("ep", "said"), [("2", True), ("8", False)])
def test_estimate_says_when_local_experts_get_few_tokens(ep: str, said: bool,
                                                        tmp_path: Path) -> None:
    """Qwen3-30B-A3B on 64 H100s: at ep 2 each rank's 64 experts get 512 tokens a micro-batch
    and their GEMMs, one after another, take about twice one GEMM of their FLOPs (as measured on
    an H200): estimate says so and what gives each expert more; at ep 8 (16 experts of 2,048)
    it stays quiet. The printed ratio is the compute model's for the layer's fc1 group."""
    from replay import get_system
    from replay.compute import RooflineCompute
    from tracegen import Strategy, get_model
    from tracegen import ops as O

    out = tmp_path / "e.json"
    r = run("estimate", "--model", "qwen3-30b-a3b", "--gpus", "64", "--ep", ep, "--mbs", "1",
            "--gbs", "512", "--zero", "1", "--system", "dgx-h100", "--json", str(out))
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert ("local experts runs" in text) is said
    group = json.loads(out.read_text())["expert_group"]  # in the JSON whether said or not
    assert group["local_experts"] == 128 // int(ep)
    # a rank's 4,096 tokens, each to 8 experts: 32,768 rows over its experts, whatever ep
    assert group["tokens_per_expert"] * group["local_experts"] == 4096 * 8
    if said:
        s = Strategy(dp=64, ep=int(ep), micro_batch_size=1, global_batch_size=512, zero_stage=1)
        fc1 = next(it for it in O.layer_fwd(get_model("qwen3-30b-a3b"), s)
                   if isinstance(it, O.Op) and it.name == "expert_fc1")
        c = RooflineCompute(get_system("dgx-h100").gpu)
        ratio = c.op_time_ns(fc1) / c.op_time_ns(O.gemm("o", 64 * fc1.m, fc1.n, fc1.k,
                                                         fc1.dtype))
        assert 1.8 < ratio < 2.4
        assert (f"each of a rank's 64 local experts runs {fc1.m:,} tokens a micro-batch: their "
                f"GEMMs, one after another, take {ratio:.2f}x one GEMM") in text
        assert "a larger --ep" in text
        assert group["fc1_over_one_gemm"] == pytest.approx(ratio)


def test_estimate_says_which_layers_attend_within_a_window() -> None:
    r = run("estimate", "--model", "gemma2-9b", "--gpus", "8", "--mbs", "1", "--gbs", "8",
            "--zero", "3", "--recompute", "full", "--system", "dgx-h100")
    assert r.returncode == 0, r.stderr
    assert ("sliding-window attention: 4,096 keys, 1 layer(s) in 2 (the others attend over "
            "the whole 8,192-token sequence)") in " ".join(r.stdout.split())


def test_an_op_too_large_to_count_is_refused_not_a_traceback() -> None:
    """A sequence whose attention counts more FLOPs on a rank than a 64-bit count holds (the
    Chakra trace's int64 num_ops; the op table's too) is refused by estimate and tracegen,
    naming the op and what to change; one just inside the bound runs. A writer handed such a
    count refuses it rather than wrapping it."""
    import dataclasses

    import pytest

    from tracegen import Strategy, resolve_model
    from tracegen.errors import TraceFormatError
    from tracegen.ops import COUNT_MAX, largest_count
    from tracegen.writer import encode_attr

    base = ("--model", "llama3-8b", "--gpus", "8", "--mbs", "1", "--gbs", "8")
    for cmd in (("estimate", *base, "--system", "dgx-h100"), ("tracegen", *base, "-o",
                                                              "/nonexistent/x")):
        r = run(*cmd, "--seq-len", "100000000")
        said = r.stdout + r.stderr
        assert r.returncode != 0 and "Traceback" not in said, said
        assert "flash_attn_bwd counts 2.05e+20" in said and "split the sequence with cp" in said
    m = dataclasses.replace(resolve_model("llama3-8b"), seq_len=10_000_000)
    name, count = largest_count(m, Strategy(dp=8, global_batch_size=8))
    assert name == "flash_attn_bwd" and count < COUNT_MAX  # (2.05e18: estimate prints it)
    with pytest.raises(TraceFormatError, match="does not fit a Chakra integer attribute"):
        encode_attr("num_ops", "int64", 1 << 64)


@pytest.mark.parametrize("command", ["estimate", "tracegen"])
def test_every_option_of_a_strategy_command_sits_in_a_help_panel(command: str) -> None:
    """``estimate --help`` and ``tracegen --help`` list some seventy options; each sits in a
    named panel (model and cluster, parallelism, memory, communication, precision, MoE,
    output), so an option added without one would land alone under "Options"."""
    import typer.main

    from analysis.cli import app

    cmd = typer.main.get_command(app).commands[command]  # type: ignore[attr-defined]
    loose = [p.name for p in cmd.params if not getattr(p, "rich_help_panel", None)]
    assert loose == [], loose
    r = run(command, "--help")
    assert r.returncode == 0 and "Parallelism and pipeline" in r.stdout


def test_estimate_json_to_stdout_keeps_stdout_data_only(tmp_path: Path) -> None:
    """``--json -``: stdout is the JSON alone (a pipe to jq reads it), everything printed —
    the estimate, the op table, the schedules — goes to stderr; the same JSON as to a file."""
    args = ("estimate", "--model", "llama3-8b", "--system", "dgx-h100", "--gpus", "16",
            "--tp", "2", "--pp", "2", "--mbs", "1", "--gbs", "64", "--schedules", "--ops", "1")
    r = run(*args, "--json", "-")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert {"step_time_s", "ops", "schedules", "strategy_fields"} <= set(got)
    assert "step time" in r.stderr and "each pipeline schedule" in r.stderr
    assert got["step_time_s"] > 0 and all(op["stage"] == 1 for op in got["ops"])
    assert run(*args, "--json", str(tmp_path / "e.json")).returncode == 0
    assert json.loads((tmp_path / "e.json").read_text()) == got
