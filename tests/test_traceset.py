"""Trace-set conventions (DESIGN.md) and cross-rank consistency, decoded with mlc-chakra."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
from chakra.schema.protobuf import et_def_pb2 as pb
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import attrs, read_et
from tracegen import ModelSpec, Strategy, generate, read_manifest

FORBIDDEN_COLL = {pb.BARRIER, pb.BROADCAST, pb.REDUCE, pb.GATHER, pb.SCATTER}

CASES = {
    "tp2-pp2-dp2-sp-zero1": dict(tp=2, pp=2, dp=2, sequence_parallel=True, zero_stage=1),
    "tp2-pp2-dp2-full-rc": dict(tp=2, pp=2, dp=2, recompute="full"),
    "pp4-interleaved": dict(pp=4, dp=2, vpp=2, schedule="interleaved_1f1b"),
    "tp2-dp4-zero3": dict(tp=2, dp=4, zero_stage=3),
    "cp2-tp2-pp2": dict(cp=2, tp=2, pp=2),
    "gpipe-pp4": dict(pp=4, schedule="gpipe"),
    "moe-ep2-tp2-pp2": dict(tp=2, pp=2, dp=4, ep=2, sequence_parallel=True, zero_stage=1),
    "zb-h1-tp2-pp4-dp2": dict(tp=2, pp=4, dp=2, sequence_parallel=True, zero_stage=1,
                              schedule="zb_h1"),
    "zb-v-tp2-pp4-dp2": dict(tp=2, pp=4, dp=2, vpp=2, sequence_parallel=True, zero_stage=1,
                             schedule="zb_v"),
}


def _gen(model: ModelSpec, tmp: Path, **kw: object) -> Path:
    dp = int(kw.get("dp", 1))  # type: ignore[call-overload]
    pp = int(kw.get("pp", 1))  # type: ignore[call-overload]
    s = Strategy(micro_batch_size=1, global_batch_size=4 * dp * pp, dp_bucket_params=20_000,
                 **kw)  # type: ignore[arg-type]
    generate(model, s, tmp, mode="full", name="t")
    return tmp


@pytest.fixture(params=list(CASES), ids=list(CASES))
def traceset(request: pytest.FixtureRequest, tmp_path: Path):
    model = request.getfixturevalue("tiny_moe" if "moe" in request.param else "tiny_gqa")
    out = _gen(model, tmp_path, **CASES[request.param])
    man = read_manifest(out)
    ets = {r: read_et(out / f"t.{r}.et") for r in man["ranks_written"]}
    return out, man, ets


def test_conventions(traceset) -> None:
    out, man, ets = traceset
    groups = json.loads((out / "comm_groups.json").read_text())
    assert all(int(k) > 0 for k in groups)
    assert sorted(ets) == list(range(man["world_size"]))
    for rank, (meta, nodes) in ets.items():
        assert meta.version == "0.0.4"
        assert nodes, f"rank {rank} has no node"
        for n in nodes:
            a = attrs(n)
            assert a["is_cpu_op"] == ("bool_val", False)
            assert n.type in (pb.COMP_NODE, pb.COMM_COLL_NODE, pb.COMM_SEND_NODE,
                              pb.COMM_RECV_NODE)
            if n.type == pb.COMP_NODE:
                assert a["num_ops"][0] == "int64_val" and a["tensor_size"][0] == "int64_val"
                assert a["op_type"][0] == "string_val"
            elif n.type == pb.COMM_COLL_NODE:
                assert a["comm_type"][0] == "int64_val" and a["comm_type"][1] not in FORBIDDEN_COLL
                assert a["comm_size"][0] == "int64_val" and a["comm_size"][1] > 0
                kind, pg = a["pg_name"]
                assert kind == "string_val" and rank in groups[pg]
            else:
                for key in ("comm_src", "comm_dst", "comm_size", "comm_tag"):
                    assert a[key][0] == "int64_val"


def test_dependencies_acyclic_and_local(traceset) -> None:
    _, _, ets = traceset
    for rank, (_, nodes) in ets.items():
        ids = [n.id for n in nodes]
        assert len(set(ids)) == len(ids), f"rank {rank}: duplicate ids"
        pos = {i: k for k, i in enumerate(ids)}
        for n in nodes:  # every dependency is an earlier node of the same file → acyclic
            for d in [*n.data_deps, *n.ctrl_deps]:
                assert d in pos and pos[d] < pos[n.id], f"rank {rank} node {n.name}: dep {d}"


def test_group_members_issue_same_collectives(traceset) -> None:
    out, _, ets = traceset
    groups = json.loads((out / "comm_groups.json").read_text())
    seq: dict[tuple[str, int], list[tuple[int, int]]] = defaultdict(list)
    for rank, (_, nodes) in ets.items():
        for n in nodes:
            if n.type == pb.COMM_COLL_NODE:
                a = attrs(n)
                seq[(a["pg_name"][1], rank)].append((a["comm_type"][1], a["comm_size"][1]))
    for gid, members in groups.items():
        issued = [seq[(gid, r)] for r in members]
        assert issued[0], f"group {gid} is never used"
        assert all(x == issued[0] for x in issued), f"group {gid} members disagree"


def test_sends_match_receives_one_to_one(traceset) -> None:
    _, _, ets = traceset
    sends, recvs = defaultdict(int), defaultdict(int)
    for _, (_, nodes) in ets.items():
        for n in nodes:
            if n.type in (pb.COMM_SEND_NODE, pb.COMM_RECV_NODE):
                a = attrs(n)
                key = (a["comm_src"][1], a["comm_dst"][1], a["comm_tag"][1], a["comm_size"][1])
                (sends if n.type == pb.COMM_SEND_NODE else recvs)[key] += 1
    assert sends == recvs
    assert all(v == 1 for v in sends.values())


def test_golden_regenerates_byte_identically(tmp_path: Path) -> None:
    from tests.golden_spec import GOLDEN_DIR, write

    write(tmp_path)
    committed = sorted(p.name for p in GOLDEN_DIR.iterdir())
    assert committed == sorted(p.name for p in tmp_path.iterdir())
    for name in committed:
        assert (tmp_path / name).read_bytes() == (GOLDEN_DIR / name).read_bytes(), name


def test_representative_is_subset_of_full(tiny_gqa: ModelSpec, tmp_path: Path) -> None:
    s = Strategy(tp=2, pp=2, dp=2, micro_batch_size=1, global_batch_size=8)
    generate(tiny_gqa, s, tmp_path / "full", mode="full", name="t")
    generate(tiny_gqa, s, tmp_path / "rep", mode="representative", name="t")
    man = read_manifest(tmp_path / "rep")
    assert man["ranks_written"] == [0, 4]
    assert man["multiplicity"] == {"0": 4, "4": 4}
    for r in man["ranks_written"]:
        rep = (tmp_path / "rep" / f"t.{r}.et").read_bytes()
        assert rep == (tmp_path / "full" / f"t.{r}.et").read_bytes()


def test_rewriting_a_folder_leaves_only_the_new_sets_rank_files(tiny_gqa: ModelSpec,
                                                                  tmp_path: Path) -> None:
    """A smaller set written over a larger one removes the ranks it does not write (Chakra tools
    read every NAME.<rank>.et of a folder); other workloads' files and the user's stay."""
    full = Strategy(tp=2, pp=2, dp=2, micro_batch_size=1, global_batch_size=8)
    generate(tiny_gqa, full, tmp_path, mode="full", name="t")
    generate(tiny_gqa, full, tmp_path, mode="full", name="other")
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "t.x.et").write_text("not a rank file")
    summary = generate(tiny_gqa, full, tmp_path, mode="representative", name="t")
    assert summary.stale_removed == 6
    man = read_manifest(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("t.*.et")) == sorted(
        [f"t.{r}.et" for r in man["ranks_written"]] + ["t.x.et"])
    assert len(list(tmp_path.glob("other.*.et"))) == 8
    assert (tmp_path / "notes.txt").read_text() == "mine"
    again = generate(tiny_gqa, full, tmp_path, mode="representative", name="t")
    assert again.stale_removed == 0


def test_a_set_larger_than_the_free_space_is_refused_before_a_file(
        tiny_gqa: ModelSpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The set's size (each stage's first rank file times its files) is checked against the
    folder's free space first: a set that does not fit writes nothing and leaves the earlier
    set whole; a write that fails anyway is named with how many files were written."""
    import shutil
    from collections import namedtuple

    from tracegen import ConfigError

    s = Strategy(tp=2, pp=2, dp=2, micro_batch_size=1, global_batch_size=8)
    generate(tiny_gqa, s, tmp_path, mode="representative", name="t")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    full_bytes = 4 * sum(len(before[f"t.{r}.et"]) for r in (0, 4))  # 4 ranks a stage
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**12, 0, full_bytes - 1))
    with pytest.raises(ConfigError, match=r"the set would write about .* GB .* representative"):
        generate(tiny_gqa, s, tmp_path, mode="full", name="t")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**12, 0, full_bytes))
    calls = []

    def fill(self: Path, data: bytes) -> int:
        calls.append(self)
        if len(calls) > 3:
            raise OSError(28, "No space left on device")
        return len(data)

    monkeypatch.setattr(Path, "write_bytes", fill)
    with pytest.raises(ConfigError, match=r"No space left on device; 3 of 8 rank files"):
        generate(tiny_gqa, s, tmp_path, mode="full", name="t")


@settings(max_examples=60, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), cp=st.sampled_from([1, 2, 3]),
       dp=st.sampled_from([1, 2, 4, 6]), pp=st.sampled_from([1, 2, 3]),
       ep=st.sampled_from([1, 2]))
def test_mesh_groups_are_the_ranks_that_differ_only_on_their_axis(
        tp: int, cp: int, dp: int, pp: int, ep: int) -> None:
    """Every axis's members, from Megatron's rank formula, are exactly the ranks whose other
    coordinates match (tp: same pp/dp/cp; dp: same pp/tp; ep: same dp block of ep; edp: same
    dp residue mod ep; embd: first and last stage), in ascending order."""
    from tracegen.mesh import Mesh

    if dp % ep:
        return
    s = Strategy(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, global_batch_size=dp)
    mesh = Mesh(s, embedding_stage=s.pp - 1, moe=True)
    coords = [mesh.coord(r) for r in range(s.world_size)]
    same = {
        "tp": lambda a, b: (a.pp, a.dp, a.cp) == (b.pp, b.dp, b.cp),
        "cp": lambda a, b: (a.pp, a.dp, a.tp) == (b.pp, b.dp, b.tp),
        "dp": lambda a, b: (a.pp, a.tp) == (b.pp, b.tp),
        "ep": lambda a, b: (a.pp, a.cp, a.tp, a.dp // ep) == (b.pp, b.cp, b.tp, b.dp // ep),
        "edp": lambda a, b: (a.pp, a.tp, a.dp % ep) == (b.pp, b.tp, b.dp % ep),
        "embd": lambda a, b: b.pp in (0, pp - 1) and (a.dp, a.cp, a.tp) == (b.dp, b.cp, b.tp),
    }
    for c in coords:
        for axis, match in same.items():
            want = tuple(b.rank for b in coords if match(c, b))
            assert mesh._members(axis, c) == want, (axis, c)
