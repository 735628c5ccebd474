"""Chakra ET reader: any valid Chakra execution trace, ours or anyone's.

Framing is mlc-chakra's ``protolib``: each message is a varint length followed by the message;
the first is ``GlobalMetadata``, the rest are ``Node``. Nodes are decoded with the official schema
(``chakra.schema.protobuf.et_def_pb2``) and validated; every problem raises ``TraceFormatError``
naming the file, rank and node. Identical node messages (the same op on every rank of a stage)
are decoded once and shared.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from chakra.schema.protobuf import et_def_pb2 as pb
from google.protobuf.message import DecodeError

from tracegen.errors import TraceFormatError
from tracegen.routing import ROUTE_ATTRS, route_of, route_problems

NODE_TYPE_NAMES: dict[int, str] = {v.number: v.name for v in pb.NodeType.DESCRIPTOR.values}
COLL_TYPE_NAMES: dict[int, str] = {
    v.number: v.name for v in pb.CollectiveCommType.DESCRIPTOR.values
}
_INT_KINDS = frozenset({
    "int32_val", "int64_val", "uint32_val", "uint64_val", "sint32_val", "sint64_val",
    "fixed32_val", "fixed64_val", "sfixed32_val", "sfixed64_val",
})
# Required integer attributes per node type (ASTRA-sim's et_feeder reads these).
_REQUIRED: dict[int, tuple[str, ...]] = {
    pb.COMM_COLL_NODE: ("comm_type", "comm_size"),
    pb.COMM_SEND_NODE: ("comm_dst", "comm_size"),
    pb.COMM_RECV_NODE: ("comm_src", "comm_size"),
}
_INT_ATTRS = frozenset({"num_ops", "tensor_size", "comm_type", "comm_size", "comm_src", "comm_dst",
                        "comm_tag", "comm_priority", "gemm_m", "gemm_n", "gemm_k", "gemm_splits",
                        "gemm_groups", "dtype",
                        *ROUTE_ATTRS})
_BOOL_ATTRS = frozenset({"is_cpu_op", "attn_causal"})
_SIZE_ATTRS = frozenset({"comm_size", "num_ops", "tensor_size"})
_STR_ATTRS = frozenset({"pg_name", "op_type"})
_COUNT_ATTRS = ("gemm_splits", "gemm_groups")  # kernels a GEMM runs as; GEMMs of a group


class NodeRec(NamedTuple):
    """One decoded node. ``attrs`` maps attribute name to its Python value (shared, read-only)."""

    id: int
    name: str
    type: int
    ctrl_deps: tuple[int, ...]
    data_deps: tuple[int, ...]
    duration_micros: int
    attrs: dict[str, Any]

    @property
    def deps(self) -> tuple[int, ...]:
        return self.data_deps + self.ctrl_deps if self.ctrl_deps else self.data_deps


@dataclasses.dataclass(frozen=True, slots=True)
class RankTrace:
    rank: int
    path: Path
    version: str
    nodes: list[NodeRec]


def _varint(buf: bytes, pos: int, path: Path) -> tuple[int, int]:
    result = shift = 0
    end = len(buf)
    while True:
        if pos >= end:
            raise TraceFormatError(f"{path}: truncated: a length prefix runs past the end of the "
                                   f"file ({end} bytes); the file was cut short or is not an ET")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift >= 64:
            raise TraceFormatError(f"{path}: byte {pos}: malformed length prefix (over 10 bytes)")


def split_messages(buf: bytes, path: Path) -> list[tuple[int, bytes]]:
    """(byte offset, message bytes) of every length-prefixed message in ``buf``."""
    out: list[tuple[int, bytes]] = []
    pos, end = 0, len(buf)
    while pos < end:
        start = pos
        size, pos = _varint(buf, pos, path)
        if pos + size > end:
            raise TraceFormatError(
                f"{path}: truncated at byte {start}: a message of {size} bytes is declared but "
                f"only {end - pos} remain; the file was cut short or is not a Chakra ET")
        out.append((start, buf[pos:pos + size]))
        pos += size
    return out


# Top-level (field number → wire type) of GlobalMetadata: version (LEN), attr (LEN).
_META_FIELDS = {1: 2, 2: 2}


def _looks_like_metadata(msg: bytes) -> bool:
    """True when every top-level field of ``msg`` is a GlobalMetadata field of the right wire
    type. A Node starts with id (field 1, varint) or has type (field 3, varint)."""
    pos, end = 0, len(msg)
    try:
        while pos < end:
            key, pos = _varint(msg, pos, Path())
            field, wire = key >> 3, key & 7
            if _META_FIELDS.get(field) != wire:
                return False
            size, pos = _varint(msg, pos, Path())
            pos += size
        return pos == end
    except TraceFormatError:
        return False


def _attr_value(a: Any) -> tuple[str, Any]:
    kind = a.WhichOneof("value")
    if kind is None:
        return "", None
    value = getattr(a, kind)
    if kind.endswith("_list"):
        value = list(value.values)
    return kind, value


def _decode_node(msg: bytes, where: Callable[[], str],
                 attr_cache: dict[bytes, dict[str, Any]]) -> NodeRec:
    """Decode one Node: a direct scan of fields 1-7 (protobuf writes fields in number order, so
    the attributes, field 10, come last and repeat across nodes: their bytes are decoded once and
    cached). Anything unusual (fields 6, 8, 9, unpacked deps, other order) takes the protobuf
    path. ``where()`` names the message in an error (built only then: this runs per node)."""
    fast = _scan_head(msg)
    if fast is None:
        return _decode_node_pb(msg, where())
    node_id, name, type_, ctrl, data, dur, tail = fast
    attrs = attr_cache.get(tail)
    if attrs is None:
        holder = pb.Node()
        try:
            holder.ParseFromString(tail)
        except (DecodeError, ValueError, RuntimeError) as exc:
            raise TraceFormatError(f"{where()}: attributes cannot be decoded ({exc})") from None
        attrs = _attrs_of(holder, where(), node_id, name)
        attr_cache[tail] = attrs
    try:
        text = name.decode("utf-8")
    except UnicodeDecodeError:
        raise TraceFormatError(f"{where()}: node name is not valid UTF-8") from None
    return NodeRec(node_id, text, type_, ctrl, data, dur, attrs)


def _scan_head(msg: bytes) -> tuple[int, bytes, int, tuple[int, ...], tuple[int, ...], int,
                                    bytes] | None:
    """Fields 1-5 and 7 in increasing order (how protobuf serialises), then the attributes."""
    n = len(msg)
    pos = node_id = type_ = dur = 0
    name = b""
    ctrl: tuple[int, ...] = ()
    data: tuple[int, ...] = ()
    try:
        b = msg[0] if n else 0
        if b == 0x08:
            node_id = msg[1]
            if node_id < 0x80:
                pos = 2
            elif msg[2] < 0x80:  # two-byte ids (< 16384): the common case
                node_id, pos = (node_id & 0x7F) | (msg[2] << 7), 3
            elif msg[3] < 0x80:  # three bytes: stages of 16,384 to 2 M nodes
                node_id, pos = (node_id & 0x7F) | ((msg[2] & 0x7F) << 7) | (msg[3] << 14), 4
            else:
                node_id, pos = uvarint(msg, 1)
            b = msg[pos] if pos < n else 0
        if b == 0x12:
            size = msg[pos + 1]
            size, pos = (size, pos + 2) if size < 0x80 else uvarint(msg, pos + 1)
            name = msg[pos:pos + size]
            pos += size
            b = msg[pos] if pos < n else 0
        if b == 0x18:
            type_ = msg[pos + 1]
            type_, pos = (type_, pos + 2) if type_ < 0x80 else uvarint(msg, pos + 1)
            b = msg[pos] if pos < n else 0
        if b == 0x22:
            size, pos = uvarint(msg, pos + 1)
            ctrl = _packed(msg[pos:pos + size])
            pos += size
            b = msg[pos] if pos < n else 0
        if b == 0x2A:
            size, pos = uvarint(msg, pos + 1)
            data = _packed(msg[pos:pos + size])
            pos += size
            b = msg[pos] if pos < n else 0
        if b == 0x38:
            dur, pos = uvarint(msg, pos + 1)
            b = msg[pos] if pos < n else 0
    except IndexError:
        return None
    if pos > n or (pos < n and b != 0x52):
        return None  # another layout: the protobuf path decides
    return node_id, name, type_, ctrl, data, dur, msg[pos:]


def uvarint(buf: bytes, pos: int) -> tuple[int, int]:
    b = buf[pos]
    if b < 0x80:
        return b, pos + 1
    result, shift = b & 0x7F, 7
    while True:
        pos += 1
        b = buf[pos]
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result & 0xFFFFFFFFFFFFFFFF, pos + 1
        shift += 7
        if shift > 63:
            raise IndexError


def _packed(chunk: bytes) -> tuple[int, ...]:
    """Packed varints; one dependency of one or two bytes is the common case."""
    n = len(chunk)
    if n == 1 and chunk[0] < 0x80:
        return (chunk[0],)
    if n == 2 and chunk[0] >= 0x80 and chunk[1] < 0x80:
        return ((chunk[0] & 0x7F) | (chunk[1] << 7),)
    if n == 3 and chunk[0] >= 0x80 and chunk[1] >= 0x80 and chunk[2] < 0x80:
        return ((chunk[0] & 0x7F) | ((chunk[1] & 0x7F) << 7) | (chunk[2] << 14),)
    return _packed_slow(chunk)


def _packed_slow(chunk: bytes) -> tuple[int, ...]:
    out = []
    pos, end = 0, len(chunk)
    while pos < end:
        v, pos = uvarint(chunk, pos)
        out.append(v)
    if pos != end:
        raise IndexError
    return tuple(out)


def _decode_node_pb(msg: bytes, where: str) -> NodeRec:
    node = pb.Node()
    try:
        node.ParseFromString(msg)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise TraceFormatError(f"{where}: cannot be decoded as a Chakra Node ({exc})") from None
    attrs = _attrs_of(node, where, node.id, node.name.encode())
    return NodeRec(node.id, node.name, node.type, tuple(node.ctrl_deps), tuple(node.data_deps),
                   node.duration_micros, attrs)


def _attrs_of(node: Any, where: str, node_id: int, name: bytes) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    for a in node.attr:
        kind, value = _attr_value(a)
        _check_attr(a.name, kind, value, f"{where} (id {node_id}, {name!r})")
        attrs[a.name] = value
    if any(attrs.get(k, 0) < 0 for k in _SIZE_ATTRS):
        raise TraceFormatError(f"{where} (id {node_id}, {name!r}): negative size "
                               "(comm_size / num_ops / tensor_size)")
    for k in _COUNT_ATTRS:
        if attrs.get(k, 1) < 1:
            raise TraceFormatError(f"{where} (id {node_id}, {name!r}): {k} = {attrs[k]}: a "
                                   "count of kernels or GEMMs, at least 1 (leave it out for 1)")
    if "moe_topk" in attrs:
        _check_route(attrs, f"{where} (id {node_id}, {name!r})")
    return attrs


def _check_route(attrs: dict[str, Any], where: str) -> None:
    """A dispatch's routing attributes (tracegen/routing.py) describe a possible routing."""
    route = route_of(attrs)
    problems = route_problems(route) if route else []
    if problems:
        raise TraceFormatError(f"{where}: routing attributes {', '.join(ROUTE_ATTRS)}: "
                               f"{problems[0]}")


def _check_attr(name: str, kind: str, value: Any, where: str) -> None:
    expected = ("an integer" if name in _INT_ATTRS else "a bool" if name in _BOOL_ATTRS
                else "a string" if name in _STR_ATTRS else "")
    ok = (kind in _INT_KINDS if name in _INT_ATTRS else kind == "bool_val" if name in _BOOL_ATTRS
          else kind == "string_val" if name in _STR_ATTRS else True)
    if not ok:
        raise TraceFormatError(
            f"{where}: attribute {name!r} must be {expected}, got {kind or 'no value'} = {value!r}")


class ReadCache:
    """Decoded nodes and attribute blocks, keyed by their bytes, shared across the files of a set.
    Identical bytes decode to equal records, so sharing them is safe (records are immutable)."""

    def __init__(self) -> None:
        self.nodes: dict[bytes, NodeRec] = {}
        self.attrs: dict[bytes, dict[str, Any]] = {}


def read_et(path: str | Path, rank: int, cache: ReadCache | None = None) -> RankTrace:
    """Read and validate one ET file. ``cache`` shares decoded nodes between files."""
    return read_et_messages(path, rank, cache)[0]


def read_et_messages(path: str | Path, rank: int, cache: ReadCache | None = None
                     ) -> tuple[RankTrace, list[tuple[int, bytes]]]:
    """``read_et``, with the file's messages as ``split_messages`` gives them (a pass that
    rewrites the file reads it once)."""
    p = Path(path)
    try:
        buf = p.read_bytes()
    except OSError as exc:
        raise TraceFormatError(f"rank {rank}: cannot read {p}: {exc.strerror}") from None
    msgs = split_messages(buf, p)
    if not msgs:
        raise TraceFormatError(f"{p} (rank {rank}) is empty: a Chakra ET starts with "
                               "GlobalMetadata followed by at least one node")
    if not _looks_like_metadata(msgs[0][1]):
        raise TraceFormatError(
            f"{p} (rank {rank}): the first message is not GlobalMetadata (it looks like a Node); "
            "Chakra ETs start with GlobalMetadata — write it first (chakra's encodeMessage)")
    meta = pb.GlobalMetadata()
    try:
        meta.ParseFromString(msgs[0][1])
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise TraceFormatError(f"{p} (rank {rank}): bad GlobalMetadata ({exc})") from None
    cache = ReadCache() if cache is None else cache
    nodes: list[NodeRec] = []
    node_cache, attr_cache = cache.nodes, cache.attrs
    file_where = f"{p} (rank {rank})"
    for k, (offset, msg) in enumerate(msgs[1:], start=1):
        rec = node_cache.get(msg)
        if rec is None:
            rec = _decode_node(msg, functools.partial(_message_where, file_where, k, offset),
                               attr_cache)
            _check_node(rec, file_where)
            node_cache[msg] = rec
        nodes.append(rec)
    if not nodes:
        raise TraceFormatError(f"{p} (rank {rank}) has GlobalMetadata but no node")
    _check_graph(nodes, f"{p} (rank {rank})")
    return RankTrace(rank, p, meta.version, nodes), msgs


def _message_where(file_where: str, k: int, offset: int) -> str:
    return f"{file_where} message #{k} at byte {offset}"


def _check_node(n: NodeRec, where: str) -> None:
    if n.type == pb.COMP_NODE:
        return
    label = f"{where}: node {n.id} ({n.name!r})"
    if n.type not in NODE_TYPE_NAMES or n.type == pb.INVALID_NODE:
        raise TraceFormatError(f"{label}: unknown node type {n.type}; Chakra types are "
                               f"{', '.join(f'{k}={v}' for k, v in NODE_TYPE_NAMES.items())}")
    for req in _REQUIRED.get(n.type, ()):
        if req not in n.attrs:
            raise TraceFormatError(f"{label}: {NODE_TYPE_NAMES[n.type]} needs attribute {req!r}")
    if n.type == pb.COMM_COLL_NODE and n.attrs["comm_type"] not in COLL_TYPE_NAMES:
        raise TraceFormatError(f"{label}: unknown collective type {n.attrs['comm_type']}; known: "
                               f"{', '.join(f'{k}={v}' for k, v in COLL_TYPE_NAMES.items())}")


def _check_graph(nodes: list[NodeRec], where: str) -> None:
    ids: set[int] = set()
    for n in nodes:
        if n.id in ids:
            raise TraceFormatError(f"{where}: duplicate node id {n.id} ({n.name!r}); node ids must "
                                   "be unique within a rank's file")
        ids.add(n.id)
    for n in nodes:
        for d in n.deps:
            if d not in ids:
                raise TraceFormatError(f"{where}: node {n.id} ({n.name!r}) depends on node {d}, "
                                       "which is not in this file (dangling dependency)")
