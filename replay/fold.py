"""Symmetry folding of full-mode trace sets.

In a healthy, homogeneous step every rank of a pipeline stage runs the same program: its file
equals the stage representative's except for the rank-bound attributes (``pg_name`` naming its own
group on the same axis, ``comm_src``/``comm_dst`` naming its own neighbours). Such a set replays
exactly like its representative-mode twin, in a fraction of the time. This module proves the
equivalence file by file before folding: unchanged stretches are compared as bytes, each
rank-bound node must equal the representative's up to the attributes this rank's coordinates
predict. Any difference (another writer's layout, an edited file) means no folding for that set.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chakra.schema.protobuf import et_def_pb2 as pb

from replay.reader import RankTrace, split_messages
from tracegen.writer import encode_attr, varint

_BOUND = (pb.COMM_COLL_NODE, pb.COMM_SEND_NODE, pb.COMM_RECV_NODE)


class NotFoldable(Exception):
    """The set is not provably symmetric; replay it rank by rank."""


class _Mesh:
    """Coordinates and groups from a manifest."""

    def __init__(self, manifest: dict[str, Any]) -> None:
        self.coord = {c[0]: tuple(c[1:]) for c in manifest["coords"]}  # rank → (pp, dp, cp, tp)
        self.rank_at = {v: r for r, v in self.coord.items()}
        self.axis = {gid: g["axis"] for gid, g in manifest["groups"].items()}
        self.gid: dict[tuple[str, int], str] = {}
        for gid, g in manifest["groups"].items():
            for r in g["ranks"]:
                self.gid[(g["axis"], r)] = gid

    def peer_like(self, rep_peer: int, rank: int) -> int:
        """The rank at the representative's peer's stage with ``rank``'s other coordinates."""
        pp = self.coord[rep_peer][0]
        _, dp, cp, tp = self.coord[rank]
        return int(self.rank_at[(pp, dp, cp, tp)])


class Template:
    """A representative's file split into byte runs and rank-bound nodes."""

    def __init__(self, rep: RankTrace, mesh: _Mesh) -> None:
        buf = rep.path.read_bytes()
        msgs = split_messages(buf, rep.path)
        self.rep, self.mesh = rep, mesh
        # The file as pieces: bytes copied from the representative, and keys standing for what
        # depends on the rank: ("t", ...) a bound-attribute tail, ("l", n, tail key) the length
        # prefix of a node whose head has n bytes.
        self.pieces: list[bytes | tuple[Any, ...]] = []
        self.keys: dict[tuple[Any, ...], Any] = {}
        self.lengths: set[tuple[Any, ...]] = set()
        run_start = 0
        for (offset, msg), node in zip(msgs[1:], rep.nodes, strict=True):
            if node.type not in _BOUND:
                continue
            tail = self._tail(node, rep.rank)
            if not msg.endswith(tail):
                raise NotFoldable(f"{rep.path}: rank-bound attributes are not last in node "
                                  f"{node.id}")
            head = msg[: len(msg) - len(tail)]
            a = node.attrs
            key = ("t", node.type, id(a)) if node.type == pb.COMM_COLL_NODE else (
                "t", node.type, a.get("comm_src", -1), a.get("comm_dst", -1))
            self.keys.setdefault(key, node)
            length = ("l", len(head), key)
            self.lengths.add(length)
            self.pieces += [buf[run_start:offset], length, head, key]
            run_start = offset + len(varint(len(msg))) + len(msg)
        self.pieces.append(buf[run_start:])
        # Where the rank-dependent pieces sit: ``matches`` copies the list and fills only these.
        self.slots: list[tuple[int, tuple[Any, ...]]] = [
            (i, p) for i, p in enumerate(self.pieces) if not isinstance(p, bytes)]

    def _tail(self, node: Any, rank: int) -> bytes:
        a = node.attrs
        if node.type == pb.COMM_COLL_NODE:
            pg = a.get("pg_name")
            if pg is None or pg not in self.mesh.axis:
                raise NotFoldable(f"node {node.id} has no known pg_name")
            if rank == self.rep.rank:
                return encode_attr("pg_name", "string", pg)
            gid = self.mesh.gid.get((self.mesh.axis[pg], rank))
            if gid is None:
                raise NotFoldable(f"rank {rank} has no {self.mesh.axis[pg]} group")
            return encode_attr("pg_name", "string", gid)
        mine = node.type == pb.COMM_SEND_NODE
        rep_peer = a["comm_dst"] if mine else a["comm_src"]
        peer = rep_peer if rank == self.rep.rank else self.mesh.peer_like(rep_peer, rank)
        src, dst = (rank, peer) if mine else (peer, rank)
        return encode_attr("comm_src", "int64", src) + encode_attr("comm_dst", "int64", dst)

    def matches(self, path: Path, rank: int) -> bool:
        """True when ``path`` is this program for ``rank``: the file this rank would have, built
        from the representative's bytes and this rank's bound attributes, equals it byte for
        byte."""
        table: dict[tuple[Any, ...], bytes] = {}
        for key, node in self.keys.items():
            table[key] = self._tail(node, rank)
        for lp in self.lengths:
            table[lp] = varint(lp[1] + len(table[lp[2]]))
        parts = self.pieces.copy()
        for i, key in self.slots:
            parts[i] = table[key]
        return b"".join(parts) == path.read_bytes()  # type: ignore[arg-type]
