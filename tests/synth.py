"""Build small Chakra trace sets by hand, with mlc-chakra's protobuf classes and protolib framing
(as other tools write them), for replay tests."""

from __future__ import annotations

import json
from pathlib import Path

from chakra.schema.protobuf import et_def_pb2 as pb
from chakra.src.third_party.utils.protolib import encodeMessage


class SynthRank:
    def __init__(self) -> None:
        self.nodes: list[pb.Node] = []

    def _node(self, name: str, type_: int, deps: tuple[int, ...], ctrl: tuple[int, ...]) -> pb.Node:
        n = pb.Node(id=len(self.nodes), name=name, type=type_)
        n.data_deps.extend(deps)
        n.ctrl_deps.extend(ctrl)
        n.attr.append(pb.AttributeProto(name="is_cpu_op", bool_val=False))
        self.nodes.append(n)
        return n

    def comp(self, name: str, *, us: int = 0, flop: int = 0, nbytes: int = 0,
             deps: tuple[int, ...] = (), ctrl: tuple[int, ...] = ()) -> int:
        n = self._node(name, pb.COMP_NODE, deps, ctrl)
        if us:
            n.duration_micros = us
        if flop or nbytes:
            n.attr.append(pb.AttributeProto(name="num_ops", int64_val=flop))
            n.attr.append(pb.AttributeProto(name="tensor_size", int64_val=nbytes))
        return n.id

    def coll(self, name: str, comm_type: int, size: int, *, pg: str | None = None,
             deps: tuple[int, ...] = (), ctrl: tuple[int, ...] = ()) -> int:
        n = self._node(name, pb.COMM_COLL_NODE, deps, ctrl)
        n.attr.append(pb.AttributeProto(name="comm_type", int64_val=comm_type))
        n.attr.append(pb.AttributeProto(name="comm_size", int64_val=size))
        if pg is not None:
            n.attr.append(pb.AttributeProto(name="pg_name", string_val=pg))
        return n.id

    def p2p(self, name: str, *, send: bool, peer: int, me: int, size: int, tag: int,
            deps: tuple[int, ...] = ()) -> int:
        n = self._node(name, pb.COMM_SEND_NODE if send else pb.COMM_RECV_NODE, deps, ())
        src, dst = (me, peer) if send else (peer, me)
        for k, v in (("comm_src", src), ("comm_dst", dst), ("comm_size", size), ("comm_tag", tag)):
            n.attr.append(pb.AttributeProto(name=k, int64_val=v))
        return n.id


def write_set(directory: Path, ranks: list[SynthRank], *, name: str = "synth",
              groups: dict[str, list[int]] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for r, rank in enumerate(ranks):
        with open(directory / f"{name}.{r}.et", "wb") as f:
            encodeMessage(f, pb.GlobalMetadata(version="0.0.4"))
            for n in rank.nodes:
                encodeMessage(f, n)
    if groups is not None:
        (directory / "groups.json").write_text(json.dumps(groups))
    return directory / name
