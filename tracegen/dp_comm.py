"""Data-parallel traffic: the groups a gradient is reduced over (with distributed-optimizer
instances and expert parallelism), the buckets and collectives that reduce it, the shards ZeRO
keeps, ZeRO-3's parameter gathers and HSDP's collectives across instances. The trace
(``tracegen.program``), the memory model and the fast path read the same functions."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tracegen import ops as O
from tracegen.strategy import Strategy

if TYPE_CHECKING:
    from tracegen.program import ParamBlock


def dp_group_size(s: Strategy, axis: str) -> int:
    """Ranks that reduce a gradient: dp × cp for dense weights ("dp"), dp / ep × cp for experts
    ("edp"; tp·cp·dp / ep with expert parallelism folded); with distributed-optimizer
    instances, dp·cp / instances in one ("dps"; experts: "edps", edp / instances) and the
    instances ("dpr", "edpr")."""
    if axis == "dp":
        return s.dp * s.cp
    if axis == "edp":
        return s.edp
    if axis == "edps":
        return dp_group_size(s, "edp") // s.dist_opt_instances
    return s.dp * s.cp // s.dist_opt_instances if axis == "dps" else s.dist_opt_instances


def shard_axis(s: Strategy, axis: str) -> str:
    """The group ZeRO ≥ 1 shards ``axis``'s optimizer state (and gathers its parameters) over:
    an instance ("dps", experts "edps") where the optimizer has several
    (``dist_opt_instances``), else the reduction group itself."""
    if s.dist_opt_instances == 1 or axis not in ("dp", "edp"):
        return axis
    return "dps" if axis == "dp" else "edps"


def instance_axis(axis: str) -> str:
    """The group across optimizer instances of a reduction group: "dpr" ("dp"), "edpr"."""
    return "edpr" if axis == "edp" else "dpr"


def bucket_comms(s: Strategy, axis: str, params: int) -> list[O.Comm]:
    """The collectives that reduce one gradient bucket of ``params`` on ``axis``, in order:
    an all-reduce (ZeRO 0) or a reduce-scatter (ZeRO ≥ 1) over the group, the bucket padded to
    a multiple of its size; with several optimizer instances the reduce-scatter inside the
    instance, then the instance's shard all-reduced across instances (Megatron-Core
    ``_ParamAndGradBucketGroup.start_grad_sync``)."""
    grad_bytes = O.grad_reduce_bytes(s)
    group = shard_axis(s, axis)
    size = dp_group_size(s, group)
    padded = -(-params // size) * size
    if s.zero_stage == 0:
        return [O.Comm("grad_all_reduce", axis, "ALL_REDUCE", padded * grad_bytes)]
    out = [O.Comm("grad_reduce_scatter", group, "REDUCE_SCATTER", padded * grad_bytes)
           ] if size > 1 else []  # (an instance of one rank: the all-reduce alone)
    if group != axis:
        out.append(O.Comm("grad_instance_all_reduce", instance_axis(axis), "ALL_REDUCE",
                          padded // size * grad_bytes))
    return out


# Blocks whose weights are no Transformer Engine GEMM: Megatron keeps them in 16 bits when the
# GEMM weights are FP8 parameters (the embedding, the output head's ColumnParallelLinear, the MTP
# modules' copy of the embedding)
VOCAB_BLOCKS = ("embedding", "lm_head", "mtp_embedding")


def zero3_gather_bytes(s: Strategy, block_name: str) -> int:
    """Bytes a parameter in a ZeRO-3 gather of a block: 2, or 1 for FP8 parameters
    (``fp8_param_gather``: Megatron-FSDP gathers each dtype's parameter groups from their own
    buffer) except in the 16-bit embedding and head (``VOCAB_BLOCKS``). The norms inside a layer,
    a few parameters in ten thousand, go with its GEMM weights."""
    return O.PARAM_BYTES if block_name in VOCAB_BLOCKS else O.param_gather_bytes(s)


def gather_pieces(params: int, bucket: int) -> list[int]:
    """ZeRO-3: the parameter counts of the all-gathers that move a block of ``params``, in
    buckets of at most ``bucket`` (0: the whole block at once)."""
    if bucket <= 0 or params <= bucket:
        return [params]
    full, rest = divmod(params, bucket)
    return [bucket] * full + ([rest] if rest else [])


def bucket_plan(blocks: list[ParamBlock], axis: str, bucket: int) -> list[tuple[int, int]]:
    """Megatron DDP gradient buckets of one model chunk on ``axis`` ("dp": dense, "edp": expert
    parameters) as (index of the bucket's first block in forward order, parameters), in the order
    the backward closes them: parameters accumulate from the last block to the first and a bucket
    closes once it holds ≥ ``bucket`` or at the chunk's first block. ``_bucket_add`` issues the
    same buckets as the backward runs (a test holds them equal)."""
    out, acc = [], 0
    for i in reversed(range(len(blocks))):
        acc += blocks[i].dense if axis == "dp" else blocks[i].expert
        if acc and (acc >= bucket or i == 0):
            out.append((i, acc))
            acc = 0
    return out


def sharded_params(s: Strategy, params: dict[str, int]) -> int:
    """Parameters whose optimizer state one rank updates: all of them without ZeRO, its shard of
    each reduction group with ZeRO ≥ 1 (Rajbhandari et al. 2020)."""
    if s.zero_stage == 0:
        return params["dp"] + params["edp"]
    if s.zero_stage == 3 and s.hfsdp:  # (dense models only: instances refuse experts)
        return outer_shard(s, params["dp"])
    return sum(-(-n // dp_group_size(s, shard_axis(s, axis))) for axis, n in params.items())


def outer_shard(s: Strategy, params: int) -> int:
    """HFSDP: a rank's piece of a block's ``params``: its shard in the instance, cut in as many
    pieces as there are instances (rounded up: the reduce-scatter across them pads to that)."""
    inner = -(-params // dp_group_size(s, "dps"))
    return -(-inner // s.dist_opt_instances)


def outer_grad_comm(s: Strategy, block_name: str, params: int, axis: str = "dp") -> O.Comm:
    """ZeRO-3 with several instances: the collective across them that follows a block's
    reduce-scatter in its instance on the last micro-batch — HSDP all-reduces the instance's
    shard of its ``params`` gradients (``axis`` "dp": dense, across "dpr"; "edp": expert,
    across "edpr"), HFSDP (dense models) reduce-scatters it, padded to a piece per instance
    (``RoleProgram._grad_reduce``; the fast path costs the same collective)."""
    grad_bytes = O.grad_reduce_bytes(s)
    if s.hfsdp:
        return O.Comm(f"{block_name}_grad_rs_outer", "dpr", "REDUCE_SCATTER",
                      outer_shard(s, params) * s.dist_opt_instances * grad_bytes)
    shard = -(-params // dp_group_size(s, shard_axis(s, axis)))
    return O.Comm(f"{block_name}_{'expert_' if axis == 'edp' else ''}grad_ar",
                  instance_axis(axis), "ALL_REDUCE", shard * grad_bytes)


def outer_gather_comm(s: Strategy, block_name: str, params: int) -> O.Comm:
    """HFSDP: the all-gather across the instances that returns each rank's piece of a block
    (``outer_shard``) the optimizer step updated, in the bytes its gathers use; in each chunk's
    first forward of the next step, before the block's inner gathers (``_zero3_gather``)."""
    return O.Comm(f"{block_name}_param_all_gather_outer", "dpr", "ALL_GATHER",
                  outer_shard(s, params) * zero3_gather_bytes(s, block_name))
