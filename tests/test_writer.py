"""The direct encoder is byte-identical to protobuf serialisation with mlc-chakra's schema."""

from __future__ import annotations

import io

from chakra.schema.protobuf import et_def_pb2 as pb
from chakra.src.third_party.utils.protolib import encodeMessage
from hypothesis import given, settings
from hypothesis import strategies as st

from tracegen import Strategy
from tracegen.mesh import Mesh
from tracegen.program import PNode, build_role
from tracegen.traceset import _Binder
from tracegen.writer import (
    RoleEncoding,
    encode_attr,
    encode_node_head,
    encode_with_protobuf,
    frame,
    global_metadata,
    varint,
)

u64 = st.integers(min_value=0, max_value=2**64 - 1)
i64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
i32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
u32 = st.integers(min_value=0, max_value=2**32 - 1)
names = st.text(max_size=12)
attr_value = st.one_of(
    st.tuples(st.just("int64"), i64),
    st.tuples(st.just("uint64"), u64),
    st.tuples(st.just("int32"), i32),
    st.tuples(st.just("uint32"), u32),
    st.tuples(st.just("bool"), st.booleans()),
    st.tuples(st.just("string"), st.text(max_size=20)),
    st.tuples(st.just("double"), st.floats(allow_nan=False)),
    st.tuples(st.just("bytes"), st.binary(max_size=8)),
)
node_st = st.fixed_dictionaries({
    "id": u64,
    "name": names,
    "type": st.sampled_from([0, 1, 4, 5, 6, 7]),
    "ctrl": st.lists(u64, max_size=4),
    "data": st.lists(u64, max_size=4),
    "duration": u64,
    "attrs": st.lists(st.tuples(names, attr_value), max_size=6),
})


def _pb_node(n: dict) -> pb.Node:
    msg = pb.Node(id=n["id"], name=n["name"], type=n["type"], duration_micros=n["duration"])
    msg.ctrl_deps.extend(n["ctrl"])
    msg.data_deps.extend(n["data"])
    for name, (kind, value) in n["attrs"]:
        msg.attr.append(pb.AttributeProto(name=name, **{f"{kind}_val": value}))
    return msg


@settings(max_examples=400, deadline=None)
@given(node_st)
def test_node_encoding_matches_protobuf(n: dict) -> None:
    ours = encode_node_head(n["id"], n["name"], n["type"], n["ctrl"], n["data"], n["duration"])
    ours += b"".join(encode_attr(name, kind, v) for name, (kind, v) in n["attrs"])
    assert ours == _pb_node(n).SerializeToString()


@given(u64)
def test_framing_matches_protolib(size: int) -> None:
    msg = pb.Node(id=size)
    out = io.BytesIO()
    encodeMessage(out, msg)
    assert frame(msg.SerializeToString()) == out.getvalue()
    if size:
        assert varint(size) == pb.Node(id=size).SerializeToString()[1:]


def test_global_metadata_matches_protolib() -> None:
    out = io.BytesIO()
    encodeMessage(out, pb.GlobalMetadata(version="0.0.4"))
    assert global_metadata() == out.getvalue()


@settings(max_examples=25, deadline=None)
@given(tp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2, 4]), dp=st.sampled_from([1, 2]),
       sp=st.booleans(), zero=st.sampled_from([0, 1, 3]),
       recompute=st.sampled_from(["none", "selective", "full"]), stage=st.integers(0, 3),
       rank_pick=st.integers(0, 63))
def test_role_encoding_matches_protobuf(tiny_gqa_model, tp, pp, dp, sp, zero, recompute, stage,
                                        rank_pick) -> None:
    """Whole ET files: the cached stage encoding + per-rank binding equals protobuf objects."""
    s = Strategy(tp=tp, pp=pp, dp=dp, sequence_parallel=sp and tp > 1, zero_stage=zero,
                 recompute=recompute, micro_batch_size=1, global_batch_size=2 * dp * pp,
                 dp_bucket_params=5000)
    stage %= pp
    nodes = build_role(tiny_gqa_model, s, stage)
    mesh = Mesh(s)
    ranks = [r for r in range(s.world_size) if mesh.coord(r).pp == stage]
    binder = _Binder(mesh, ranks[rank_pick % len(ranks)])
    ours = RoleEncoding(nodes).encode_rank(binder)
    ref = encode_with_protobuf((n, binder.attrs(n) if _bound(n) else []) for n in nodes)
    assert ours == ref


def _bound(n: PNode) -> bool:
    return n.type == pb.COMM_COLL_NODE or n.type in (pb.COMM_SEND_NODE, pb.COMM_RECV_NODE)


varint_edges = st.sampled_from([0, 1, 127, 128, 16383, 16384, 2**21 - 1, 2**21, 2**28]) | u64


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({"id": varint_edges, "ctrl": st.lists(varint_edges, max_size=3),
                              "data": st.lists(varint_edges, max_size=3)}))
def test_reader_fast_scan_decodes_what_protobuf_parses(n: dict) -> None:
    """replay/reader's direct scan (one-, two- and three-byte fast paths) against protobuf's
    parser, at the varint length boundaries."""
    from replay.reader import _decode_node

    msg = _pb_node({"name": "x", "type": 4, "duration": 0, "attrs": [], **n}).SerializeToString()
    rec = _decode_node(msg, lambda: "test", {})
    ref = pb.Node()
    ref.ParseFromString(msg)
    assert (rec.id, rec.ctrl_deps, rec.data_deps) == (ref.id, tuple(ref.ctrl_deps),
                                                      tuple(ref.data_deps))
