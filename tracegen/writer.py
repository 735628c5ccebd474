"""Chakra ET encoding: a direct protobuf wire-format encoder, byte-identical to
``Message.SerializeToString`` of ``chakra.schema.protobuf.et_def_pb2`` (a hypothesis test proves
it), framed as Chakra's ``protolib.encodeMessage`` does (varint length, then the message).

Why not protobuf message objects: building a ``Node`` per op and serialising it runs at ~90 k
nodes/s here; the trace of a 16K-GPU job has hundreds of millions. Ranks of one pipeline stage
share their program, so each stage is encoded once and only the rank-bound attributes (``pg_name``,
``comm_src``/``comm_dst``) are encoded per rank.

Wire format (https://protobuf.dev/programming-guides/encoding/): tag = field << 3 | wire type;
varints little-endian base-128; proto3 scalars equal to their default are not written, but a set
``oneof`` member always is; repeated scalars (``ctrl_deps``, ``data_deps``) are packed.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any

from tracegen.errors import TraceFormatError
from tracegen.program import Attr, PNode
from tracegen.vocab import CHAKRA_SCHEMA_VERSION, COMM_COLL_NODE

_MASK64 = (1 << 64) - 1
_SMALL = [bytes([i]) for i in range(128)] + [bytes([(i & 0x7F) | 0x80, i >> 7])
                                               for i in range(128, 1 << 14)]


def varint(value: int) -> bytes:
    """Base-128 varint; negative values as 64-bit two's complement (protobuf int32/int64)."""
    if 0 <= value < 16384:
        return _SMALL[value]
    if 0 < value < 1 << 21:  # node ids and dependencies of large stages: three bytes
        return bytes(((value & 0x7F) | 0x80, ((value >> 7) & 0x7F) | 0x80, value >> 14))
    value &= _MASK64
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _len_delimited(tag: bytes, payload: bytes) -> bytes:
    return tag + varint(len(payload)) + payload


# AttributeProto oneof members: kind → (tag bytes, encoder of the value).
def _enc_varint(v: Any) -> bytes:
    n = int(v)
    if not -(1 << 63) <= n <= _MASK64:  # (varint would wrap it silently)
        raise TraceFormatError(f"{n} does not fit a Chakra integer attribute (64 bits)")
    return varint(n)


def _enc_bytes(v: Any) -> bytes:
    return varint(len(v)) + bytes(v)


def _enc_string(v: Any) -> bytes:
    b: bytes = str(v).encode("utf-8")
    return varint(len(b)) + b


_ATTR_VALUE: dict[str, tuple[bytes, Any]] = {
    "double": (varint(3 << 3 | 1), lambda v: struct.pack("<d", v)),
    "float": (varint(5 << 3 | 5), lambda v: struct.pack("<f", v)),
    "int32": (varint(7 << 3), _enc_varint),
    "int64": (varint(9 << 3), _enc_varint),
    "uint32": (varint(11 << 3), _enc_varint),
    "uint64": (varint(13 << 3), _enc_varint),
    "bool": (varint(27 << 3), lambda v: b"\x01" if v else b"\x00"),
    "string": (varint(29 << 3 | 2), _enc_string),
    "bytes": (varint(31 << 3 | 2), _enc_bytes),
}
ATTR_KINDS: tuple[str, ...] = tuple(_ATTR_VALUE)


def encode_attr(name: str, kind: str, value: Any) -> bytes:
    """One ``AttributeProto`` as a ``Node.attr`` field (field 10, length-delimited)."""
    tag, enc = _ATTR_VALUE[kind]
    value_bytes: bytes = enc(value)
    body = (_len_delimited(b"\x0a", name.encode("utf-8")) if name else b"") + tag + value_bytes
    return _len_delimited(b"\x52", body)


def encode_attrs(attrs: Iterable[Attr]) -> bytes:
    return b"".join(encode_attr(n, k, v) for n, k, v in attrs)


def encode_node_head(node_id: int, name: str, type_: int, ctrl_deps: Sequence[int],
                     data_deps: Sequence[int], duration_micros: int = 0) -> bytes:
    """Fields 1-7 of a ``Node`` (attributes, field 10, follow). Written out field by field: it
    runs once per node of every distinct stage program."""
    out = b"\x08" + varint(node_id) if node_id else b""
    if name:
        raw = name.encode("utf-8")
        out += b"\x12" + varint(len(raw)) + raw
    if type_:
        out += b"\x18" + varint(type_)
    if ctrl_deps:
        packed = b"".join(map(varint, ctrl_deps))
        out += b"\x22" + varint(len(packed)) + packed
    if data_deps:
        packed = varint(data_deps[0]) if len(data_deps) == 1 else b"".join(map(varint, data_deps))
        out += b"\x2a" + varint(len(packed)) + packed
    if duration_micros:
        out += b"\x38" + varint(duration_micros)
    return out


def frame(message: bytes) -> bytes:
    """Chakra's length-prefixed framing (protolib.encodeMessage)."""
    return varint(len(message)) + message


def global_metadata(version: str = CHAKRA_SCHEMA_VERSION) -> bytes:
    """A framed ``GlobalMetadata`` message: the first record of every ET file."""
    return frame(_len_delimited(b"\x0a", version.encode("utf-8")))


class RoleEncoding:
    """A stage program encoded once: static nodes as bytes, rank-bound nodes as heads to finish.

    ``segments`` alternates merged bytes of static nodes and indices into ``holes``; a hole is
    ``(encoded head + static attrs, node)`` whose remaining attributes depend on the rank.
    """

    def __init__(self, nodes: list[PNode]) -> None:
        self.segments: list[bytes | int] = []
        self.holes: list[tuple[bytes, PNode]] = []
        self.num_nodes = len(nodes)
        run: list[bytes] = [global_metadata()]
        attr_bytes: dict[int, bytes] = {}  # programs share one attrs list per distinct op
        for n in nodes:
            head = encode_node_head(n.id, n.name, n.type, n.ctrl_deps, n.data_deps)
            enc = attr_bytes.get(id(n.attrs))
            if enc is None:
                enc = attr_bytes[id(n.attrs)] = encode_attrs(n.attrs)
            body = head + enc
            if n.type == COMM_COLL_NODE or n.peer:
                self.segments.append(b"".join(run))
                run = []
                self.segments.append(len(self.holes))
                self.holes.append((body, n))
            else:
                run.append(frame(body))
        self.segments.append(b"".join(run))

    def encode_rank(self, bind: Any) -> bytes:
        """The whole ET file of one rank; ``bind(node)`` returns its rank-bound attrs bytes."""
        holes = self.holes
        parts: list[bytes] = []
        for seg in self.segments:
            if isinstance(seg, bytes):
                parts.append(seg)
            else:
                body, node = holes[seg]
                tail = bind(node)
                parts.append(varint(len(body) + len(tail)))
                parts.append(body)
                parts.append(tail)
        return b"".join(parts)


# ---- reference path: protobuf message objects (slow; used by tests and the benchmark) --------

def encode_with_protobuf(nodes: Iterable[tuple[PNode, list[Attr]]]) -> bytes:
    """Encode with ``et_def_pb2`` messages and protolib framing; ``nodes`` pairs a node with its
    rank-bound attributes."""
    import io

    from chakra.schema.protobuf import et_def_pb2 as pb
    from chakra.src.third_party.utils.protolib import encodeMessage

    out = io.BytesIO()
    encodeMessage(out, pb.GlobalMetadata(version=CHAKRA_SCHEMA_VERSION))
    for n, extra in nodes:
        msg = pb.Node(id=n.id, name=n.name, type=n.type)
        msg.ctrl_deps.extend(n.ctrl_deps)
        msg.data_deps.extend(n.data_deps)
        for name, kind, value in [*n.attrs, *extra]:
            msg.attr.append(pb.AttributeProto(name=name, **{f"{kind}_val": value}))
        encodeMessage(out, msg)
    return out.getvalue()
