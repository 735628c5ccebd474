"""Vocabulary shared by tracegen and replay: Chakra node/collective type codes and attr names."""

from __future__ import annotations

from chakra.schema.protobuf import et_def_pb2 as pb

CHAKRA_SCHEMA_VERSION = "0.0.4"

COMP_NODE: int = pb.COMP_NODE
COMM_SEND_NODE: int = pb.COMM_SEND_NODE
COMM_RECV_NODE: int = pb.COMM_RECV_NODE
COMM_COLL_NODE: int = pb.COMM_COLL_NODE
METADATA_NODE: int = pb.METADATA_NODE
MEM_LOAD_NODE: int = pb.MEM_LOAD_NODE
MEM_STORE_NODE: int = pb.MEM_STORE_NODE

COLL_CODE: dict[str, int] = {
    "ALL_REDUCE": pb.ALL_REDUCE,
    "ALL_GATHER": pb.ALL_GATHER,
    "REDUCE_SCATTER": pb.REDUCE_SCATTER,
    "ALL_TO_ALL": pb.ALL_TO_ALL,
}
COLL_NAME: dict[int, str] = {v: k for k, v in COLL_CODE.items()}

# Op kinds written in the ``op_type`` string attribute of COMP nodes.
OP_KINDS: tuple[str, ...] = (
    "gemm", "attention", "norm", "elementwise", "embedding", "loss", "optimizer",
)
