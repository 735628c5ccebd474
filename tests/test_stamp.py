"""``trainsim stamp``: the GPU model's times written into a trace set's ``duration_micros``
(replay/stamp.py) — conserved per stream, readable by mlc-chakra, and replayed by the trace's
times as the model replays the unstamped set."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from chakra.schema.protobuf import et_def_pb2 as pb
from hypothesis import given, settings
from hypothesis import strategies as st

from replay import replay, resolve_system
from replay.compute import RooflineCompute
from replay.reader import read_et as read_rank
from replay.stamp import STAMP_FILE, cumulative_us, stamp_trace_set, with_duration
from tests.conftest import read_et
from tests.synth import SynthRank, write_set
from tests.test_cli import GOLDEN, run
from tracegen.errors import ConfigError

H100 = resolve_system("dgx-h100")


@given(st.lists(st.integers(0, 5_000_000), max_size=60))
def test_cumulative_rounding_conserves_the_total(durations_ns: list[int]) -> None:
    """Every node ≥ 1 µs; the stamped total is never below the rounded model total, and exceeds
    it by at most 1 µs for each node under 1 µs (the floor's excess)."""
    us = cumulative_us(durations_ns)
    assert len(us) == len(durations_ns) and all(u >= 1 for u in us)
    total = sum(durations_ns)
    short = sum(d < 1000 for d in durations_ns)
    assert -500 <= sum(us) * 1000 - total <= 500 + 1000 * short


@given(st.lists(st.integers(1000, 5_000_000), max_size=60))
def test_cumulative_rounding_tracks_every_prefix(durations_ns: list[int]) -> None:
    """Where no node is under 1 µs, every running total is the model's rounded: a stream's
    nodes start within 0.5 µs of where the model starts them."""
    us = cumulative_us(durations_ns)
    total_ns = total_us = 0
    for d, u in zip(durations_ns, us, strict=True):
        total_ns, total_us = total_ns + d, total_us + u
        assert abs(total_us * 1000 - total_ns) <= 500


_attrs = st.lists(st.tuples(st.sampled_from(["num_ops", "tensor_size", "gemm_m", "x"]),
                            st.integers(0, 2**40)), max_size=4)


@settings(max_examples=60)
@given(st.integers(0, 2**32), st.text(max_size=12), st.lists(st.integers(0, 2**20), max_size=5),
       st.lists(st.integers(0, 2**20), max_size=5), st.integers(0, 2**33), _attrs,
       st.integers(1, 2**40))
def test_with_duration_is_protobufs_own_encoding(node_id: int, name: str, data: list[int],
                                                 ctrl: list[int], before_us: int,
                                                 attrs: list[tuple[str, int]], us: int) -> None:
    """The spliced node is what protobuf serializes for the node with that duration: the same
    fields, in field order, whatever duration it carried."""
    n = pb.Node(id=node_id, name=name, type=pb.COMP_NODE, duration_micros=before_us)
    n.data_deps.extend(data)
    n.ctrl_deps.extend(ctrl)
    for k, v in attrs:
        n.attr.append(pb.AttributeProto(name=k, int64_val=v))
    spliced = with_duration(n.SerializeToString(), us)
    n.duration_micros = us
    assert spliced == n.SerializeToString()


def test_with_duration_replaces_a_field_out_of_order() -> None:
    """A writer that put duration_micros after the attributes (or twice): one field, in order."""
    n = pb.Node(id=3, name="mm", type=pb.COMP_NODE)
    n.attr.append(pb.AttributeProto(name="num_ops", int64_val=7))
    late = n.SerializeToString() + b"\x38\x05" + b"\x38\x09"
    out = with_duration(late, 42)
    n.duration_micros = 42
    assert out == n.SerializeToString()


@pytest.fixture(scope="module")
def stamped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stamped") / "set"
    stamp_trace_set(GOLDEN, H100, out)
    return out


def test_stamped_files_decode_with_mlc_chakra_and_change_only_durations(stamped: Path) -> None:
    """Every compute node carries the model's time (≥ 1 µs; within 1 µs of it); every other
    node and every other field is as it was."""
    model = RooflineCompute(H100.gpu)
    for f in sorted(GOLDEN.glob("*.et")):
        meta, before = read_et(f)
        meta2, after = read_et(stamped / f.name)
        assert meta2 == meta and len(after) == len(before)
        for a, b in zip(before, after, strict=True):
            if b.type != pb.COMP_NODE:
                assert a == b
                continue
            assert b.duration_micros >= 1
            b.duration_micros = 0
            assert a == b
        rank = read_rank(stamped / f.name, int(f.name.split(".")[-2]))
        for node in rank.nodes:
            if node.type == pb.COMP_NODE:
                assert abs(node.duration_micros * 1000 - model.duration_ns(node)) < 1000


def test_stamped_totals_are_the_models(stamped: Path) -> None:
    """The record beside the set: each rank's compute total within 0.5 µs of the model's."""
    rec = json.loads((stamped / STAMP_FILE).read_text())
    model = RooflineCompute(H100.gpu)
    want = sum(model.duration_ns(n) for f in GOLDEN.glob("*.et")
               for n in read_rank(f, int(f.name.split(".")[-2])).nodes if n.type == pb.COMP_NODE)
    assert rec["system"] == "dgx-h100" and rec["model_ns"] == want
    assert rec["max_drift_ns"] <= 500 and abs(rec["stamped_us"] * 1000 - want) <= 500 * 8
    assert (stamped / "manifest.json").read_bytes() == (GOLDEN / "manifest.json").read_bytes()


@pytest.mark.parametrize("astra", [False, True])
def test_replay_by_the_stamped_times_is_replay_by_the_model(stamped: Path, astra: bool) -> None:
    """What a simulator that reads only duration_micros gets: the model's step (to the µs
    rounding), in trainsim's network and in its ASTRA-sim-compatible one."""
    by_model = replay(GOLDEN, H100, astra_compat=astra, fold=False)
    by_trace = replay(stamped, H100, compute="trace", astra_compat=astra, fold=False)
    step, got = by_model.metrics["step_time_s"], by_trace.metrics["step_time_s"]
    assert got == pytest.approx(step, abs=5e-6)
    if not astra:  # a stage's ranks still carry the same bytes: the stamped set folds
        folded = replay(stamped, H100, compute="trace")
        assert folded.metrics["folded"] and folded.metrics["step_time_s"] == got


def _foreign(tmp_path: Path) -> Path:
    """A profiled-looking set: measured durations, a shaped node, one with nothing, a host op."""
    r = SynthRank()
    a = r.comp("measured", us=250)
    b = r.comp("shaped", flop=2 * 4096**3, nbytes=3 * 2 * 4096**2, deps=(a,))
    c = r.comp("bare", deps=(b,))
    host = r.comp("host_adam", nbytes=10**9, deps=(c,))
    r.nodes[host].attr[0].bool_val = True  # is_cpu_op
    profiled = r.comp("host_loader", us=40, deps=(host,))
    r.nodes[profiled].attr[0].bool_val = True  # a profiled host op: its own time, kept
    r.coll("ar", pb.ALL_REDUCE, 1 << 20, pg="1", deps=(profiled,))
    out = write_set(tmp_path / "foreign", [r, r]).parent
    (out / "comm_groups.json").write_text(json.dumps({"1": [0, 1]}))
    return out


def _durations(path: Path) -> dict[str, int]:
    return {n.name: n.duration_micros for n in read_et(path)[1]}


def test_a_foreign_set_is_stamped_where_the_model_can_time_it(tmp_path: Path) -> None:
    src = _foreign(tmp_path)
    out = tmp_path / "out"
    s = stamp_trace_set(src, H100, out)
    got = _durations(out / "synth.0.et")
    model = RooflineCompute(H100.gpu)
    node = read_rank(src / "synth.0.et", 0).nodes[1]
    assert got["shaped"] == round(model.duration_ns(node) / 1000)
    assert got["measured"] == 250  # nothing to model it by: its own time, stamped again
    assert got["bare"] == 0 and got["ar"] == 0
    assert got["host_adam"] == round(10**9 / (H100.node.host_cpu_GBps * 1e9) * 1e6)
    assert got["host_loader"] == 40
    assert (s.stamped, s.untimed, s.kept, s.replaced_us) == (8, 2, 0, 580)
    assert (out / "comm_groups.json").is_file() and not (out / "manifest.json").exists()


def test_only_missing_keeps_measured_times(tmp_path: Path) -> None:
    src = _foreign(tmp_path)
    r = SynthRank()
    r.comp("measured", us=250, flop=2 * 4096**3, nbytes=1)
    write_set(tmp_path / "m", [r])
    s = stamp_trace_set(tmp_path / "m", H100, tmp_path / "kept", only_missing=True)
    assert _durations(tmp_path / "kept" / "synth.0.et")["measured"] == 250 and s.kept == 1
    s = stamp_trace_set(tmp_path / "m", H100, tmp_path / "redone")
    assert _durations(tmp_path / "redone" / "synth.0.et")["measured"] != 250
    assert s.replaced_us == 250
    no_host = dataclasses.replace(H100, node=dataclasses.replace(H100.node, host_cpu_GBps=0.0))
    s = stamp_trace_set(src, no_host, tmp_path / "nohost")
    assert _durations(tmp_path / "nohost" / "synth.0.et")["host_adam"] == 0 and s.untimed == 4


def test_in_place_rewrites_the_set(tmp_path: Path) -> None:
    src = _foreign(tmp_path)
    stamp_trace_set(src, "dgx-h100")  # (a preset's name, as replay takes it)
    assert _durations(src / "synth.1.et")["shaped"] > 0
    assert not list(src.glob("*.tmp")) and (src / STAMP_FILE).is_file()


def test_destination_errors(tmp_path: Path) -> None:
    src = _foreign(tmp_path)
    with pytest.raises(ConfigError, match="own folder"):
        stamp_trace_set(src, H100, src)
    stamp_trace_set(src, H100, tmp_path / "once")
    with pytest.raises(ConfigError, match="already holds trace files"):
        stamp_trace_set(src, H100, tmp_path / "once")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        stamp_trace_set(src, H100, tmp_path / "file")


def test_cli_stamp_and_tracegen_stamp(tmp_path: Path) -> None:
    r = run("stamp", str(GOLDEN), "--system", "dgx-b200", "-o", str(tmp_path / "b200"))
    assert r.returncode == 0, r.stderr
    assert "stamped" in r.stdout and "dgx-b200" in r.stdout
    both = run("stamp", str(GOLDEN), "--system", "dgx-b200")
    assert both.returncode == 2 and "--in-place" in both.stderr and "Traceback" not in both.stderr
    bare = run("tracegen", "--model", "gpt-1.7b", "--gpus", "2", "--mbs", "1", "--gbs", "2",
               "--stamp", "-o", str(tmp_path / "t"))
    assert bare.returncode == 2 and "--system" in bare.stderr
    gen = run("tracegen", "--model", "gpt-1.7b", "--gpus", "2", "--mbs", "1", "--gbs", "2",
              "--stamp", "--system", "dgx-h100", "-o", str(tmp_path / "t"))
    assert gen.returncode == 0, gen.stderr
    nodes = read_et(tmp_path / "t" / "trainsim.0.et")[1]
    assert all(n.duration_micros >= 1 for n in nodes if n.type == pb.COMP_NODE)
    note = run("replay", str(tmp_path / "t"), "--system", "dgx-h100", "--compute", "trace")
    assert note.returncode == 0 and "duration_micros" not in note.stdout


def test_replay_by_times_stamped_for_another_system_says_so(stamped: Path) -> None:
    other = run("replay", str(stamped), "--system", "dgx-b200", "--compute", "trace")
    assert other.returncode == 0, other.stderr
    assert "stamped with dgx-h100's GPU model" in " ".join(other.stdout.split())
    same = run("replay", str(stamped), "--system", "dgx-h100", "--compute", "trace")
    assert same.returncode == 0 and "stamped with" not in same.stdout


def test_chakras_own_jsonizer_reads_the_stamped_durations(stamped: Path, tmp_path: Path) -> None:
    """mlc-chakra's `chakra_jsonizer` (the Chakra tools' reader) on a stamped file: every
    compute node shows the duration the protobuf decoder reads, and nothing else does."""
    import subprocess
    import sys

    f = sorted(stamped.glob("*.et"))[0]
    out = tmp_path / "et.json"
    tool = Path(sys.executable).parent / "chakra_jsonizer"
    done = subprocess.run([str(tool), "--input_filename", str(f), "--output_filename", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    text, pos, objects = out.read_text(), 0, []
    decoder = json.JSONDecoder()
    while pos < len(text):
        obj, pos = decoder.raw_decode(text, pos)
        objects.append(obj)
        while pos < len(text) and text[pos].isspace():
            pos += 1
    nodes = objects[1:]
    want = [n.duration_micros for n in read_et(f)[1]]
    assert [int(n.get("durationMicros", 0)) for n in nodes] == want
    assert all(("durationMicros" in n) == (n["type"] == "COMP_NODE") for n in nodes)


def test_stamping_fp8_on_a_gpu_without_it_says_so(tmp_path: Path) -> None:
    gen = run("tracegen", "--model", "gpt-1.7b", "--gpus", "2", "--mbs", "1", "--gbs", "2",
              "--precision", "fp8", "-o", str(tmp_path / "a"))
    assert gen.returncode == 0, gen.stderr
    r = run("stamp", str(tmp_path / "a"), "--system", "dgx-a100-80gb", "-o", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    assert "no FP8 tensor cores" in " ".join(r.stdout.split())
