"""Malformed input: each case raises TraceFormatError or ReplayError with the text it must show;
a fuzz test feeds thousands of mutated ET files to the reader."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from chakra.schema.protobuf import et_def_pb2 as pb
from chakra.src.third_party.utils.protolib import encodeMessage

from replay import replay
from replay.compute import ConstantCompute
from replay.network import ConstantNetwork
from replay.reader import read_et
from replay.sim import Simulator
from replay.traceset import load_trace_set
from tests.synth import SynthRank, write_set
from tracegen.errors import ReplayError, TraceFormatError

GOLDEN = Path(__file__).resolve().parent.parent / "traces" / "golden_tiny_tp2pp2dp2"


def _write(path: Path, *messages: object) -> Path:
    with open(path, "wb") as f:
        for m in messages:
            encodeMessage(f, m)
    return path


def _node(**kw: object) -> pb.Node:
    attrs = kw.pop("attrs", [])
    n = pb.Node(**kw)  # type: ignore[arg-type]
    n.attr.extend(attrs)  # type: ignore[arg-type]
    return n


META = pb.GlobalMetadata(version="0.0.4")
A = pb.AttributeProto

FORMAT_CASES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "truncated": (lambda p: (p.write_bytes(GOLDEN.joinpath("tiny.0.et").read_bytes()[:-7]), p)[1],
                  "truncated at byte"),
    "garbage": (lambda p: (p.write_bytes(b"\x05\xff\xfe\xfd\xfc\xfb" * 3), p)[1],
                "the first message is not GlobalMetadata"),
    "empty": (lambda p: (p.write_bytes(b""), p)[1], "is empty"),
    "node first": (lambda p: _write(p, _node(id=1, name="x", type=pb.COMP_NODE)),
                   "the first message is not GlobalMetadata"),
    "metadata only": (lambda p: _write(p, META), "has GlobalMetadata but no node"),
    "dangling dep": (lambda p: _write(p, META, _node(id=1, name="a", type=pb.COMP_NODE,
                                                     data_deps=[7])),
                     "node 1 ('a') depends on node 7, which is not in this file"),
    "duplicate id": (lambda p: _write(p, META, _node(id=3, name="a", type=pb.COMP_NODE),
                                      _node(id=3, name="b", type=pb.COMP_NODE)),
                     "duplicate node id 3 ('b')"),
    "unknown node type": (lambda p: _write(p, META, _node(id=1, name="a", type=42)),
                          "unknown node type 42"),
    "unknown collective": (lambda p: _write(p, META, _node(
        id=1, name="c", type=pb.COMM_COLL_NODE,
        attrs=[A(name="comm_type", int64_val=77), A(name="comm_size", int64_val=8)])),
        "unknown collective type 77"),
    "missing attribute": (lambda p: _write(p, META, _node(
        id=1, name="c", type=pb.COMM_COLL_NODE, attrs=[A(name="comm_type", int64_val=0)])),
        "COMM_COLL_NODE needs attribute 'comm_size'"),
    "wrong attribute type": (lambda p: _write(p, META, _node(
        id=1, name="c", type=pb.COMM_COLL_NODE,
        attrs=[A(name="comm_type", int64_val=0), A(name="comm_size", string_val="big")])),
        "attribute 'comm_size' must be an integer, got string_val = 'big'"),
    "zero gemm groups": (lambda p: _write(p, META, _node(
        id=1, name="g", type=pb.COMP_NODE,
        attrs=[A(name="num_ops", int64_val=8), A(name="gemm_groups", int64_val=0)])),
        "gemm_groups = 0: a count of kernels or GEMMs, at least 1"),
    "bad utf-8 name": (lambda p: (p.write_bytes(
        GOLDEN.joinpath("tiny.0.et").read_bytes().replace(b"F0.c0", b"F0\xff\xfe0", 1)), p)[1],
        "UTF-8"),
}


@pytest.mark.parametrize("case", list(FORMAT_CASES))
def test_malformed_file(tmp_path: Path, case: str) -> None:
    make, message = FORMAT_CASES[case]
    path = make(tmp_path / "bad.0.et")
    with pytest.raises(TraceFormatError) as info:
        read_et(path, 0)
    assert message in str(info.value)
    assert "bad.0.et" in str(info.value)


def test_missing_rank_file(tmp_path: Path) -> None:
    for r in (0, 1, 3):
        _write(tmp_path / f"w.{r}.et", META, _node(id=1, name="a", type=pb.COMP_NODE))
    with pytest.raises(TraceFormatError, match=r"rank file\(s\) missing for rank\(s\) 2 "
                                               r"\(1 of 4\)"):
        load_trace_set(tmp_path / "w")


def test_missing_rank_file_of_a_manifest_set(tmp_path: Path) -> None:
    import shutil

    shutil.copytree(GOLDEN, tmp_path / "g")
    (tmp_path / "g" / "tiny.5.et").unlink()
    written = len(json.loads((GOLDEN / "manifest.json").read_text())["ranks_written"])
    with pytest.raises(TraceFormatError, match=rf"missing for rank\(s\) 5 \(1 of {written}\)"):
        load_trace_set(tmp_path / "g")


@pytest.mark.parametrize(("edit", "message"), [
    (lambda m: m.pop("ranks_written"), "'ranks_written' is missing"),
    (lambda m: m.update(world_size="8"), "'world_size' must be a whole number ≥ 1, got '8'"),
    (lambda m: m.update(ranks_written=[0, 9]), "'ranks_written' must be a non-empty list of "
                                               "ranks in 0..7"),
    (lambda m: m.update(mode="half"), "'mode' must be 'full' or 'representative'"),
    (lambda m: m["groups"]["1"].pop("axis"), "'groups' must be an object of groups"),
    (lambda m: m["stages"][0].pop("memory"), "'stages' must be a list of stages"),
    (lambda m: m.update(coords=[[0, 0, 0]]), "'coords' must be a list of [rank, pp, dp, cp, tp]"),
])
def test_a_damaged_manifest_is_named_field_by_field(tmp_path: Path, edit: Callable[..., object],
                                                    message: str) -> None:
    """A hand-edited or damaged manifest.json (replay reads its ranks, groups, mesh, model and
    memory) fails with the field named and what to do, not a KeyError from inside replay."""
    import json
    import shutil

    shutil.copytree(GOLDEN, tmp_path / "g")
    path = tmp_path / "g" / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(TraceFormatError) as info:
        replay(tmp_path / "g", "dgx-h100")
    assert message in str(info.value) and "regenerate the set" in str(info.value)


def test_not_a_trace_set(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match=r"holds no NAME\.RANK\.et files"):
        load_trace_set(tmp_path)
    with pytest.raises(TraceFormatError, match="neither a trace-set directory nor a workload"):
        load_trace_set(tmp_path / "nope" / "x")
    with pytest.raises(TraceFormatError, match=r"x is not a trace-set directory, and .* holds no x\.<rank>\.et"):
        load_trace_set(tmp_path / "x")  # (a typo'd set name in an existing folder)


def test_bad_comm_groups_file(tmp_path: Path) -> None:
    r = SynthRank()
    r.coll("ar", pb.ALL_REDUCE, 8, pg="1")
    prefix = write_set(tmp_path, [r, r])
    bad = tmp_path / "g.json"
    bad.write_text('{"0": [0, 1]}')
    with pytest.raises(TraceFormatError, match="key '0' is not a positive integer"):
        load_trace_set(prefix, comm_groups=bad)
    bad.write_text('{"1": [0, 9]}')
    with pytest.raises(TraceFormatError, match=r"names ranks \[9\] outside the world of 2"):
        load_trace_set(prefix, comm_groups=bad)
    for text, message in (('{"1": [0, 1]', "cannot read JSON"),
                          ('[[0, 1]]', "expected an object"),
                          ('{"1": []}', "group 1 must be a non-empty list of ranks"),
                          ('{"1": [0, "1"]}', "group 1 must be a non-empty list of ranks")):
        bad.write_text(text)
        with pytest.raises(TraceFormatError, match=message):
            load_trace_set(prefix, comm_groups=bad)
    with pytest.raises(TraceFormatError, match="cannot read JSON"):
        load_trace_set(prefix, comm_groups=tmp_path / "missing.json")


def _run(prefix: Path, **kw: object) -> int:
    ts = load_trace_set(prefix, **kw)  # type: ignore[arg-type]
    return Simulator(ts, ConstantCompute(10), ConstantNetwork(10)).run()


def test_cycle_is_reported_not_hung(tmp_path: Path) -> None:
    r = SynthRank()
    r.comp("a", deps=(1,))
    r.comp("b", deps=(0,))
    with pytest.raises(ReplayError) as info:
        _run(write_set(tmp_path, [r]))
    text = str(info.value)
    assert "2 of 2 nodes never ran" in text and "rank 0" in text and "'a'" in text


def test_collective_never_issued_by_a_member(tmp_path: Path) -> None:
    a, b = SynthRank(), SynthRank()
    a.coll("ar", pb.ALL_REDUCE, 64)
    b.comp("only compute")
    with pytest.raises(ReplayError, match=r"ranks \[0\] wait for ranks \[1\] that never issue it"):
        _run(write_set(tmp_path, [a, b]))


def test_receive_without_send(tmp_path: Path) -> None:
    a, b = SynthRank(), SynthRank()
    a.comp("a")
    b.p2p("r", send=False, peer=0, me=1, size=8, tag=5)
    with pytest.raises(ReplayError, match=r"rank 1 waits to receive from rank 0 \(tag 5"):
        _run(write_set(tmp_path, [a, b]))


def test_mismatched_collective(tmp_path: Path) -> None:
    a, b = SynthRank(), SynthRank()
    a.coll("ar", pb.ALL_REDUCE, 64)
    b.coll("ag", pb.ALL_GATHER, 64)
    with pytest.raises(ReplayError, match="every member must issue a group's collectives in the "
                                          "same order"):
        _run(write_set(tmp_path, [a, b]))


def test_unknown_pg_name(tmp_path: Path) -> None:
    a = SynthRank()
    a.coll("ar", pb.ALL_REDUCE, 64, pg="9")
    prefix = write_set(tmp_path, [a, a], groups={"1": [0, 1]})
    with pytest.raises(ReplayError, match="uses pg_name '9', which no comm group defines"):
        _run(prefix, comm_groups=tmp_path / "groups.json")


def test_unknown_system_is_a_config_error() -> None:
    from tracegen.errors import ConfigError

    with pytest.raises(ConfigError, match="no preset system named 'dgx-z9'"):
        replay(GOLDEN, "dgx-z9")


@pytest.mark.parametrize(("override", "message"), [
    ({"gpu.hbm_GBps": float("nan")}, "hbm_GBps must be a finite number, got nan"),
    ({"scaleout.oversubscription": float("inf")}, "oversubscription must be a finite number, "
                                                  "got inf"),
    ({"gpu.memory_efficiency": 1e-300}, "memory_efficiency = 1e-300 is no hardware figure"),
    ({"gpu.peak_bf16_TFLOPs": 1e30}, "peak_bf16_TFLOPs = 1e+30 is no hardware figure"),
])
def test_a_system_value_no_hardware_has_is_refused(override: dict[str, float],
                                                   message: str) -> None:
    """TOML's nan and inf (refused for every config's numbers, tracegen/_config.py) and values
    far outside any hardware's range are named when the system is read: before, they turned
    into infinite or NaN durations inside the models and raised OverflowError / ValueError
    there (found by fuzzing system files)."""
    from replay import get_system
    from tracegen.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        get_system("dgx-h100").with_overrides(override)


def test_a_bad_system_file_is_named_beside_the_name_inside_it(tmp_path: Path) -> None:
    """A copy of a preset's file keeps the preset's name: the error names the file too (it had
    said only "system 'dgx-h100'", which is not the file being edited)."""
    from replay import resolve_system
    from tracegen.errors import ConfigError

    src = Path(__file__).resolve().parents[1] / "replay" / "systems" / "dgx-h100.toml"
    f = tmp_path / "mine.toml"
    f.write_text(src.read_text().replace("hbm_GiB = 80", "hbm_GiB = 85899345920"))
    with pytest.raises(ConfigError, match=re.escape(f"invalid system 'dgx-h100' (from {f}): "
                                                    "hbm_GiB = 85899345920 is no hardware")):
        resolve_system(f)


def _mutate(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.random()
        i = rng.randrange(len(b)) if b else 0
        if op < 0.5 and b:
            b[i] = rng.randrange(256)
        elif op < 0.7:
            del b[i:i + rng.randint(1, 16)]
        elif op < 0.85:
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        else:
            b = b[: rng.randrange(len(b) + 1)]
    return bytes(b)


def _first_messages(data: bytes, k: int) -> bytes:
    from replay.reader import split_messages

    msgs = split_messages(data, Path("seed"))
    return data[:msgs[k][0]]  # up to the start of message k: k whole messages


def test_fuzz_reader_reads_or_raises_trace_format_error(tmp_path: Path) -> None:
    rng = random.Random(20261130)
    seeds = [_first_messages(GOLDEN.joinpath(f"tiny.{r}.et").read_bytes(), 40) for r in (0, 5)]
    for seed in seeds:  # the seeds themselves are valid, whole traces
        path = tmp_path / "seed.0.et"
        path.write_bytes(seed)
        assert len(read_et(path, 0).nodes) == 39
    path = tmp_path / "fuzz.0.et"
    outcomes = {"read": 0, "error": 0}
    for i in range(3000):
        path.write_bytes(_mutate(seeds[i % 2], rng))
        try:
            read_et(path, 0)
            outcomes["read"] += 1
        except TraceFormatError:
            outcomes["error"] += 1
    assert outcomes["error"] > 100 and outcomes["read"] > 100


def test_a_collective_on_a_group_without_its_rank(tmp_path: Path) -> None:
    a, b = SynthRank(), SynthRank()
    a.coll("ar", pb.ALL_REDUCE, 64, pg="1")
    b.coll("ar", pb.ALL_REDUCE, 64, pg="1")
    prefix = write_set(tmp_path, [a, b, a], groups={"1": [0, 1]})
    with pytest.raises(ReplayError, match=r"rank 2: node 0 \('ar'\) issues a collective on "
                                          r"group 1 = \[0, 1\], which does not contain it"):
        _run(prefix, comm_groups=tmp_path / "groups.json")


def test_a_deadlock_report_names_unmatched_sends_and_missing_groups(tmp_path: Path) -> None:
    """Rank 0 sends with tag 1 and then joins a collective on process group 1; rank 1 waits
    for tag 2: the report names the receive that waits, the send nobody receives, and — the
    traces naming process groups while none were given — the --comm-groups hint."""
    a, b = SynthRank(), SynthRank()
    a.p2p("s", send=True, peer=1, me=0, size=8, tag=1)
    a.coll("ar", pb.ALL_REDUCE, 64, pg="1", deps=(0,))
    b.p2p("r", send=False, peer=0, me=1, size=8, tag=2)
    b.coll("ar", pb.ALL_REDUCE, 64, pg="1", deps=(0,))
    with pytest.raises(ReplayError) as info:
        _run(write_set(tmp_path, [a, b]))
    text = str(info.value)
    assert "rank 1 waits to receive from rank 0 (tag 2" in text
    assert "rank 0 sends to rank 1 (tag 1) but no matching receive was posted" in text
    assert "pass --comm-groups" in text
