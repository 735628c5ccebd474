"""The node program of one pipeline-stage role: every compute op, collective, send and receive of
one training step, with dependencies, before rank-specific bindings (group ids, peers).

Dependencies (Megatron's behaviour):

* The compute stream is one chain: each op depends on the previous one. Tensor-, context- and
  expert-parallel collectives and the ZeRO-3 parameter gathers sit in that chain (blocking).
* Data-parallel gradient reduction runs in buckets on the last backward of each model chunk,
  each bucket depending only on the op that finished its last gradient, so it overlaps the rest
  of the backward (Megatron DDP ``overlap_grad_reduce``); with overlap off, after the backward.
* Every collective also has a ctrl dep on the previous collective of its group, so all members
  issue a group's collectives in one order.
* Sends depend on the op that produced the tensor; receives have no dependency (posted early);
  the first op that consumes a received tensor depends on the receive.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from tracegen import ops as O
from tracegen.dp_comm import (
    bucket_comms,
    bucket_plan,
    dp_group_size,
    gather_pieces,
    outer_gather_comm,
    outer_grad_comm,
    shard_axis,
    sharded_params,
    zero3_gather_bytes,
)
from tracegen.merged_plan import (
    defers_wgrads,
    delayed_wgrads,
    ep_pieces,
    merged_issues,
    merged_plan,
)
from tracegen.mesh import embedding_partner
from tracegen.model import ModelSpec
from tracegen.routing import Route, route_attrs
from tracegen.schedule import Step, combined, stage_order
from tracegen.strategy import Strategy
from tracegen.units import DTYPE_CODE
from tracegen.vocab import (
    COLL_CODE,
    COMM_COLL_NODE,
    COMM_RECV_NODE,
    COMM_SEND_NODE,
    COMP_NODE,
    MEM_LOAD_NODE,
    MEM_STORE_NODE,
)

Attr = tuple[str, str, Any]  # (name, protobuf oneof kind, value)


Tagged = tuple[O.Item, str, str]  # an item with its node-name prefix and phase


@dataclasses.dataclass(slots=True)
class PNode:
    """A node of a role program. ``axis`` / ``peer`` are bound per rank by the writer."""

    id: int
    name: str
    type: int
    data_deps: list[int]
    ctrl_deps: list[int]
    attrs: list[Attr]
    axis: str = ""  # COMM_COLL_NODE: group axis → pg_name
    peer: int = 0  # SEND/RECV: pipeline-stage offset of the peer
    flop: int = 0
    phase: str = ""  # "fwd", "bwd", "recompute", "optimizer" (compute) — for summaries
    comm_bytes: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class ParamBlock:
    """Parameters this rank holds for one layer / embedding / head, split by reduction axis."""

    # "layer", "dense_layer" (a MoE model's dense first layers), "window_layer" and
    # "window_dense_layer" (their sliding-window kinds: the same parameters, another
    # attention), "embedding", "lm_head", "mtp" (a multi-token-prediction module),
    # "mtp_embedding" (the copy of the embedding it reads)
    name: str
    dense: int
    expert: int = 0
    label: str = ""  # e.g. "L12" (global layer index), "emb", "head"
    stored: bool = False  # a layer that keeps its activations (``recompute_num_layers``)
    offloaded: bool = False  # a layer whose activations go to host memory (cpu_offload_layers)

    @property
    def is_layer(self) -> bool:
        return self.name in LAYER_BLOCKS

    @property
    def recomputes(self) -> bool:
        """Whether recomputation applies to it (unless it keeps its activations, ``stored``):
        the layers, and an MTP module, whose layer is a transformer layer of the model's
        config (Megatron-Core's selective modules apply to it; under full recompute
        ``MultiTokenPredictionLayer`` checkpoints the whole module)."""
        return self.name in RECOMPUTED_BLOCKS and not self.stored


LAYER_BLOCKS = ("layer", "dense_layer", "window_layer", "window_dense_layer")
RECOMPUTED_BLOCKS = (*LAYER_BLOCKS, "mtp")


def layer_name(dense: bool, windowed: bool) -> str:
    """The block name of a layer of a kind (``LAYER_BLOCKS``)."""
    return ("window_" if windowed else "") + ("dense_layer" if dense else "layer")


def layer_model(m: ModelSpec, name: str) -> ModelSpec:
    """The model as a layer block named ``name`` sees it: a MoE model's dense first layers
    without experts, a windowed layer's attention within the window, a full one without."""
    if name.endswith("dense_layer"):
        m = m.dense_view()
    return m.window_view(name.startswith("window_")) if m.window else m


class RoleProgram:
    """Builds the node program of pipeline stage ``stage``."""

    def __init__(self, model: ModelSpec, strategy: Strategy, stage: int) -> None:
        self.m, self.s, self.stage = model, strategy, stage
        self.nodes: list[PNode] = []
        self.tail: int | None = None  # last node of the compute chain
        self._alongside: list[int] = []  # overlapped collectives issued for the next chain node
        self._waiting: list[int] = []  # ... and those the chain node after it waits for
        self.last_coll: dict[str, int] = {}
        self.pending_dp: list[int] = []
        self._last_rs: dict[str, int] = {}  # ZeRO-3: each group's latest gradient scatter
        self._last_ar: int | None = None  # optimizer instances: the latest cross-instance one
        self.deferred_dp: list[O.Comm] = []  # buckets issued after the backward (no overlap)
        # overlap_param_gather: (micro-batch, chunk, block) → the gathers its forward waits for
        self.gather_waits: dict[tuple[int, int, int], list[int]] = {}
        self.buckets: dict[str, int] = {"dp": 0, "edp": 0}
        self._attr_cache: dict[O.Op, list[Attr]] = {}
        self._coll_attrs: dict[tuple[str, int, Route | None], list[Attr]] = {}
        # ZB-H1, ZB-V: B and W items
        self._splits: dict[str, tuple[list[O.Item], list[O.Item]]] = {}
        self.n_chunks = strategy.pp * strategy.vpp
        self.m_mb = strategy.num_microbatches
        # activation offloading: (micro-batch, layer label) → its store; the last store and load
        self._stores: dict[tuple[int, str], int] = {}
        self._last_mem: dict[int, int] = {}
        self._mem_bytes: dict[str, int] = {}  # a layer kind's stored activations
        self._last_host: int | None = None  # optimizer offloading: the latest CPU op

    # ---- node factories -------------------------------------------------------------------
    def _new(self, name: str, type_: int, attrs: list[Attr], **kw: Any) -> PNode:
        node = PNode(len(self.nodes), name, type_, [], [], attrs, **kw)
        self.nodes.append(node)
        return node

    def _op_attrs(self, op: O.Op) -> list[Attr]:
        """Attributes of an op; one shared list per distinct op (the writer caches by identity)."""
        attrs = self._attr_cache.get(op)
        if attrs is None:
            attrs = [
                ("is_cpu_op", "bool", False),
                ("num_ops", "int64", op.flop),
                ("tensor_size", "int64", op.bytes),
                ("op_type", "string", op.kind),
            ]
            if op.m:
                attrs += [("gemm_m", "int64", op.m), ("gemm_n", "int64", op.n),
                          ("gemm_k", "int64", op.k)]
            if op.splits > 1:  # kernels it runs as (Transformer Engine's overlap chunks)
                attrs.append(("gemm_splits", "int64", op.splits))
            if op.groups > 1:  # GEMMs of that shape it runs side by side (one per local expert)
                attrs.append(("gemm_groups", "int64", op.groups))
            if not op.causal:  # attention of every query with every key (a ring's later steps)
                attrs.append(("attn_causal", "bool", False))
            attrs.append(("dtype", "int64", DTYPE_CODE[op.dtype]))
            self._attr_cache[op] = attrs
        return attrs

    def op(self, op: O.Op, prefix: str, phase: str, extra_deps: tuple[int, ...] = ()) -> int:
        attrs = self._op_attrs(op)
        node = self._new(f"{prefix}.{op.name}", COMP_NODE, attrs, flop=op.flop, phase=phase)
        self._chain(node, extra_deps)
        return node.id

    def coll(self, c: O.Comm, prefix: str, *, blocking: bool, deps: tuple[int, ...] = ()) -> int:
        key = (c.coll, c.size_bytes, c.route)
        attrs = self._coll_attrs.get(key)
        if attrs is None:  # one shared list per distinct collective, as for ops
            attrs = self._coll_attrs[key] = [
                ("is_cpu_op", "bool", False),
                ("comm_type", "int64", COLL_CODE[c.coll]),
                ("comm_size", "int64", c.size_bytes),
                *(route_attrs(c.route) if c.route else ()),
            ]
        node = self._new(f"{prefix}.{c.name}", COMM_COLL_NODE, attrs, axis=c.axis,
                         comm_bytes=c.size_bytes)
        prev = self.last_coll.get(c.axis)
        self.last_coll[c.axis] = node.id
        if blocking:
            self._chain(node, deps)
        else:
            node.data_deps.extend(deps)
        if prev is not None and prev not in node.data_deps:
            node.ctrl_deps.append(prev)
        return node.id

    def p2p(self, send: bool, size: int, tag: int, offset: int, name: str,
            deps: tuple[int, ...] = ()) -> int:
        attrs: list[Attr] = [
            ("is_cpu_op", "bool", False),
            ("comm_size", "int64", size),
            ("comm_tag", "int64", tag),
        ]
        node = self._new(name, COMM_SEND_NODE if send else COMM_RECV_NODE, attrs, peer=offset,
                         comm_bytes=size)
        node.data_deps.extend(deps)
        return node.id

    def mem(self, store: bool, block: ParamBlock, prefix: str, deps: tuple[int, ...]) -> int:
        """An offloaded layer's activations copied to host memory after its forward (a
        MEM_STORE_NODE) or back before its backward (MEM_LOAD_NODE); ``tensor_size``: the
        layer's stored activations (as a fused-attention stack keeps them,
        ``memory.activation_bytes_per_layer``)."""
        from tracegen.memory import activation_bytes_per_layer  # (it imports this module)

        size = self._mem_bytes.get(block.name)
        if size is None:
            size = self._mem_bytes[block.name] = activation_bytes_per_layer(
                layer_model(self.m, block.name), self.s)
        return self.copy(store, size, f"{prefix}.{block.label}."
                         f"{'offload' if store else 'reload'}", deps)

    def copy(self, store: bool, size: int, name: str, deps: tuple[int, ...]) -> int:
        """A copy of ``size`` bytes to host memory (MEM_STORE_NODE) or back (MEM_LOAD_NODE),
        each kind on its own copy stream in issue order."""
        type_ = MEM_STORE_NODE if store else MEM_LOAD_NODE
        attrs: list[Attr] = [("is_cpu_op", "bool", False), ("tensor_size", "int64", size)]
        node = self._new(name, type_, attrs, comm_bytes=size)
        node.data_deps.extend(deps)
        prev = self._last_mem.get(type_)
        if prev is not None and prev not in deps:
            node.ctrl_deps.append(prev)
        self._last_mem[type_] = node.id
        return node.id

    def host_op(self, op: O.Op, name: str, deps: tuple[int, ...]) -> int:
        """An op the host's CPU runs (a COMP_NODE marked ``is_cpu_op``: Chakra's flag for it),
        in issue order on the rank's CPU."""
        attrs: list[Attr] = [("is_cpu_op", "bool", True), ("num_ops", "int64", op.flop),
                             ("tensor_size", "int64", op.bytes), ("op_type", "string", op.kind),
                             ("dtype", "int64", DTYPE_CODE[op.dtype])]
        node = self._new(name, COMP_NODE, attrs, flop=op.flop, phase="optimizer")
        node.data_deps.extend(deps)
        if self._last_host is not None:
            node.ctrl_deps.append(self._last_host)
        self._last_host = node.id
        return node.id

    def _chain(self, node: PNode, extra: tuple[int, ...]) -> None:
        deps, tail = node.data_deps, self.tail
        if tail is not None:
            deps.append(tail)
        if extra:
            deps.extend([d for d in extra if d != tail])
        # Collectives that ran alongside the previous chain node must be done before this one.
        if self._waiting or self._alongside:
            deps.extend(self._waiting)
            self._waiting, self._alongside = self._alongside, []
        self.tail = node.id

    def items(self, items: list[O.Item], prefix: str, phase: str,
              first_deps: tuple[int, ...] = ()) -> None:
        for it in items:
            if isinstance(it, O.Comm) and it.overlapped:
                # Runs alongside the next chain node, from the same starting point: after the
                # tail and after what that node itself waits for (the collectives that ran
                # alongside the tail), so back-to-back pairs do not start early.
                deps = (*(() if self.tail is None else (self.tail,)), *first_deps,
                        *self._waiting)
                self._alongside.append(self.coll(it, prefix, blocking=False, deps=deps))
                continue
            if isinstance(it, O.Comm):
                self.coll(it, prefix, blocking=True, deps=first_deps)
            else:
                self.op(it, prefix, phase, first_deps)
            first_deps = ()

    # ---- parameter blocks -----------------------------------------------------------------
    def layer_block(self, dense: bool = False, windowed: bool = False) -> ParamBlock:
        """A layer's parameters; ``dense``: one of a MoE model's dense first layers;
        ``windowed``: one attending within a sliding window (the same parameters)."""
        block = self._layer_params(dense)
        return dataclasses.replace(block, name=layer_name(dense, True)) if windowed else block

    def _layer_params(self, dense: bool) -> ParamBlock:
        m, s = (self.m.dense_view(), self.s) if dense else (self.m, self.s)
        h = m.hidden_size
        # MLA's down-projections are duplicated over TP, the rest split
        attn = (m.mla_down_params() + m.mla_up_params() // s.tp if m.is_mla
                else m.attention_params() // s.tp)
        if dense:
            return ParamBlock("dense_layer", attn + m.mlp_params() // s.tp)
        if m.is_moe:
            up = 3 if m.gated else 2
            expert = m.num_experts // s.ep * up * h * m.moe_ffn_hidden_size // s.etp
            # the router and the shared experts are dense (TP-split, reduced over dp)
            shared = up * h * m.shared_expert_ffn_hidden_size // s.tp
            return ParamBlock("layer", attn + h * m.num_experts + shared, expert)
        return ParamBlock("layer", attn + m.mlp_params() // s.tp)

    def vocab_block(self, name: str, label: str) -> ParamBlock:
        return ParamBlock(name, self.m.vocab_size * self.m.hidden_size // self.s.tp, label=label)

    def chunk_runs(self, gci: int) -> list[tuple[ParamBlock, int]]:
        """Parameter blocks of global model chunk ``gci`` in forward order, as (block, count)
        runs: the layers of a chunk are one run of a shared, unlabelled block."""
        out = []
        if gci == 0:
            out.append((self.vocab_block("embedding", "emb"), 1))
        layers = self.s.chunk_layers(self.m.num_layers, gci)
        out += self._layer_runs(layers)
        if self.m.mtp_layers and gci == self.s.mtp_chunk:
            if self._mtp_embedding_copy:
                out.append((self.vocab_block("mtp_embedding", "mtp_emb"), 1))
            out.append((self.mtp_block(), self.m.mtp_layers))
        if gci == self.n_chunks - 1:
            head = self.vocab_block("lm_head", "head")
            if self.m.tied_embeddings and self.s.head_stage == 0:
                # the same weight as the embedding, on its stage (one stage, or a V)
                head = dataclasses.replace(head, dense=0)
            out.append((head, 1))
        return out

    def _layer_runs(self, layers: range) -> list[tuple[ParamBlock, int]]:
        """The layers ``layers`` as runs of equal blocks: a MoE model's dense first layers
        first, windowed and full layers in their pattern; under full recompute of the first
        recompute_num_layers the rest keep their activations (``stored``); the first
        cpu_offload_layers send theirs to host memory (``offloaded``)."""
        m, s = self.m, self.s
        if not (m.has_dense_layers or s.recompute_num_layers or m.window
                or s.cpu_offload_layers):
            return [(self.layer_block(), len(layers))] if len(layers) else []
        n_rc = s.recompute_num_layers or len(layers)
        kinds = [(m.is_dense_layer(i), m.windowed(i), j >= n_rc, j < s.cpu_offload_layers)
                 for j, i in enumerate(layers)]
        out: list[tuple[ParamBlock, int]] = []
        j = 0
        while j < len(kinds):
            n = 1
            while j + n < len(kinds) and kinds[j + n] == kinds[j]:
                n += 1
            dense, windowed, stored, offloaded = kinds[j]
            block = self.layer_block(dense and m.is_moe, windowed)
            if stored or offloaded:
                block = dataclasses.replace(block, stored=stored, offloaded=offloaded)
            out.append((block, n))
            j += n
        return out

    @property
    def _mtp_embedding_copy(self) -> bool:
        """Whether the MTP modules' stage holds its own copy of the embedding they read (the
        first stage's, shared: Megatron builds it where ``pre_process or mtp_process``): off
        the first stage, unless a tied head there already is that weight."""
        return not self.m.tied_embeddings and embedding_partner(self.m, self.s) is not None

    def mtp_block(self) -> ParamBlock:
        """One multi-token-prediction module's parameters: its 2h → h projection (column-
        parallel) and a layer of the last layer's kind."""
        layer, h = self._layer_params(False), self.m.hidden_size
        return ParamBlock("mtp", layer.dense + 2 * h * h // self.s.tp, layer.expert)

    def blocks_of_chunk(self, gci: int, *, labels: bool = True) -> list[ParamBlock]:
        """Parameter blocks of global model chunk ``gci`` in forward order. Without ``labels``
        the layers share one block object (cheaper, for cost models that need no names)."""
        out: list[ParamBlock] = []
        first = self.s.chunk_layers(self.m.num_layers, gci).start  # the next layer's index
        for block, count in self.chunk_runs(gci):
            if labels and block.is_layer:
                out += [dataclasses.replace(block, label=f"L{first + i}") for i in range(count)]
                first += count
            elif labels and block.name == "mtp":
                out += [dataclasses.replace(block, label=f"mtp{i}") for i in range(count)]
            else:
                out += [block] * count
        return out

    # ---- ZeRO-3 parameter gathers and gradient scatters ------------------------------------
    def _zero3_gather(self, block: ParamBlock, prefix: str, *,
                      prefetch_deps: tuple[int, ...] | None = None,
                      after: tuple[int, ...] = (), outer: bool = False) -> tuple[int, ...]:
        """The block's parameter all-gathers: in the compute chain (the first also after the
        nodes ``after``), or (``prefetch_deps``) alongside it, issued once those nodes are
        done; returns their node ids. ``outer`` (HFSDP, a chunk's first forward): first the
        all-gather across the instances that returns the instance's shard the previous step
        updated, which the inner gathers wait for (``outer_gather_comm``)."""
        ids = []
        if outer and block.dense:
            c = outer_gather_comm(self.s, block.name, block.dense)
            if prefetch_deps is not None:
                ids.append(self.coll(c, prefix, blocking=False, deps=prefetch_deps))
                prefetch_deps = (*prefetch_deps, ids[-1])
            else:
                ids.append(self.coll(c, prefix, blocking=True, deps=after))
                after = ()
        for axis, n in (("dp", block.dense), ("edp", block.expert)):
            axis = shard_axis(self.s, axis)
            size = dp_group_size(self.s, axis)
            if not n or size < 2:
                continue
            pieces = gather_pieces(n, self.s.zero3_gather_bucket_params)
            for i, piece in enumerate(pieces):
                name = f"{block.name}_param_ag" + (f"{i}" if len(pieces) > 1 else "")
                shard = -(-piece // size) * zero3_gather_bytes(self.s, block.name)
                c = O.Comm(name, axis, "ALL_GATHER", shard)
                if prefetch_deps is not None:
                    ids.append(self.coll(c, prefix, blocking=False, deps=prefetch_deps))
                else:
                    ids.append(self.coll(c, prefix, blocking=True, deps=after))
                    after = ()
        return tuple(ids)

    def _zero3_gathers(self, blocks: list[ParamBlock], order: list[int], j: int, prefix: str,
                       first: tuple[int, ...], ahead: tuple[int, ...], *, outer: bool = False
                       ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """ZeRO-3 gathers around the ``j``-th block of ``order``: (what its compute must also
        wait for, the prefetched gathers of the block after it). Without prefetch the block's
        own gathers block the chain. With it only a pass's first block's do — after the
        previous pass's reduce-scatters on every group's stream — and the next block's are
        issued as this one starts (after the chain, ``first`` and this block's gathers: FSDP's
        limit of two blocks gathered). ``outer``: each block's gathers begin with HFSDP's
        cross-instance one (``_zero3_gather``)."""
        i = order[j]
        label = f"{prefix}.{blocks[i].label}"
        if not self.s.zero3_prefetch:
            self._zero3_gather(blocks[i], label, outer=outer)
            return (), ()
        if j == 0:  # the pass starts once every group's stream has drained
            self._zero3_gather(blocks[i], label, after=tuple(self._last_rs.values()),
                               outer=outer)
            self._last_rs = {}
            waits: tuple[int, ...] = ()
        else:
            waits = ahead
        if j + 1 == len(order):
            return waits, ()
        nxt = blocks[order[j + 1]]
        deps = (*(() if self.tail is None else (self.tail,)), *first, *waits)
        return waits, self._zero3_gather(nxt, f"{prefix}.{nxt.label}", prefetch_deps=deps,
                                         outer=outer)

    def _grad_reduce(self, block: ParamBlock, prefix: str, *, last: bool) -> None:
        """ZeRO-3: reduce-scatter this block's gradients now (every micro-batch, as FSDP does).
        With several instances (HSDP) the scatter is inside the instance, and on a chunk's
        last backward (``last``) its shard is then all-reduced across the instances on that
        group's own stream (Megatron-FSDP ``_post_backward``: ``outer_fsdp_group_grad_reduce``
        only on the last micro-batch, on ``outer_fsdp_group_grad_reduce_stream``)."""
        ids = []
        for axis, n in (("dp", block.dense), ("edp", block.expert)):
            group = shard_axis(self.s, axis)
            size = dp_group_size(self.s, group)
            if not n or dp_group_size(self.s, axis) < 2:
                continue
            full = -(-n // size) * size * O.grad_reduce_bytes(self.s)
            after = self._tail()
            if size > 1:  # (an instance of one rank scatters nothing)
                c = O.Comm(f"{block.name}_grad_rs", group, "REDUCE_SCATTER", full)
                ids.append(self.coll(c, prefix, blocking=False, deps=(after,)))
                self._last_rs[axis] = after = ids[-1]
            if last and group != axis:
                c = outer_grad_comm(self.s, block.name, n, axis)
                ids.append(self.coll(c, prefix, blocking=False, deps=(after,)))
                # dense and expert shards on one stream (Megatron-FSDP's
                # ``outer_fsdp_group_grad_reduce_stream``), each after the one before
                if self._last_ar is not None:
                    self.nodes[ids[-1]].ctrl_deps.append(self._last_ar)
                self._last_ar = ids[-1]
        self.pending_dp += ids

    def _tail(self) -> int:
        if self.tail is None:  # pragma: no cover - every phase starts with an op
            raise RuntimeError("empty chain")
        return self.tail

    # ---- DP buckets (ZeRO 0-2) -------------------------------------------------------------
    def _bucket_add(self, block: ParamBlock, prefix: str, *, flush: bool,
                    last: bool = True) -> None:
        """Add a block's gradients to the open buckets, issuing each that fills (or all at
        ``flush``, the chunk's first block). ``last``: the chunk's last backward, after which
        the parameters are gathered (not so for the earlier micro-batches' reductions of
        ``grad_reduce_per_microbatch``)."""
        self.buckets["dp"] += block.dense
        self.buckets["edp"] += block.expert
        for axis in ("dp", "edp"):
            if self.buckets[axis] and (flush or self.buckets[axis] >= self.s.dp_bucket_params):
                self._emit_bucket(axis, prefix, last=last)

    def _emit_bucket(self, axis: str, prefix: str, *, last: bool = True) -> None:
        n, size = self.buckets[axis], dp_group_size(self.s, axis)
        self.buckets[axis] = 0
        if size < 2:
            return
        comms = bucket_comms(self.s, axis, n)
        if not last:  # an earlier micro-batch's: inside the instance only, the shard across
            comms = [c for c in comms  # them once a step (Megatron-FSDP)
                     if c.axis not in ("dpr", "edpr")]
        if not comms:
            return
        if not self.s.overlap_grad_reduce and self.s.grad_reduce_per_microbatch:
            for c in comms:  # DeepSpeed without overlap_comm: the hook reduces in the chain
                self.pending_dp.append(self.coll(c, prefix, blocking=True))
        elif not self.s.overlap_grad_reduce:  # Megatron's finalize_model_grads: after the
            self.deferred_dp += comms  # last backward and its send
        else:
            ids: list[int] = []
            for c in comms:  # each after the one before it (the first after the backward)
                deps = (ids[-1],) if ids else (self._tail(),)
                ids.append(self.coll(c, prefix, blocking=False, deps=deps))
            if len(ids) == 2 or (last and self.s.dist_opt_instances > 1):
                # reduce-scatter (none in an instance of one rank), then the cross-instance
                # all-reduce: one stream for every bucket group, dense and expert, so after
                # the previous bucket's (``start_grad_sync``)
                if self._last_ar is not None:
                    self.nodes[ids[0]].ctrl_deps.append(self._last_ar)
                self._last_ar = ids[-1]
            elif not last and self._last_ar is not None:  # an earlier micro-batch's scatter
                self.nodes[ids[0]].ctrl_deps.append(self._last_ar)  # on that one stream too
            self.pending_dp.append(ids[-1])
        if self.s.zero_stage >= 1 and last:  # the bucket padded to its shard group, gathered
            group = shard_axis(self.s, axis)
            shards = dp_group_size(self.s, group)
            self.param_gathers.append((group, -(-n // shards) * shards))

    # ---- phases ---------------------------------------------------------------------------
    def forward(self, mb: int, chunk: int) -> None:
        gci = self.s.gci(self.stage, chunk)
        prefix = f"F{mb}.c{gci}"
        first: tuple[int, ...] = ()
        if gci > 0 and self._hop(gci - 1):
            first = (self._recv(mb, gci, grad=False),)
        blocks = self.blocks_of_chunk(gci)
        order = list(range(len(blocks)))
        ahead: tuple[int, ...] = ()
        # HFSDP: the chunk's first forward gathers each block across the instances first (the
        # pieces the previous step's optimizer updated: Megatron-FSDP's outer gather runs only
        # while ``microbatch_count == 0``)
        outer = self.s.hfsdp and mb == 0
        stored: tuple[int, ...] = ()  # the store the next layer's forward waits for
        last_store: int | None = None
        for i, block in enumerate(blocks):
            if self.s.zero_stage == 3:  # the first gather does not wait for the received input
                own, ahead = self._zero3_gathers(blocks, order, i, prefix, first, ahead,
                                                 outer=outer)
                first = (*first, *own)
            waits = self.gather_waits.get((mb, gci, i))
            if waits:
                first = (*first, *waits)
            first = (*first, *stored)
            items = self._fwd_items(block)
            if items:  # (a block that runs nothing passes what the next must wait for on)
                self.items(items, f"{prefix}.{block.label}", "fwd", first)
                first = ()
            stored = ()
            if block.offloaded:  # (Transformer Engine's double buffer: ``_offload``)
                stored = () if last_store is None else (last_store,)
                last_store = self._offload(mb, block, prefix)
        if gci < self.n_chunks - 1 and self._hop(gci + 1):
            self._send(mb, gci + 1, grad=False)

    def backward(self, mb: int, chunk: int, *, last: bool) -> None:
        gci = self.s.gci(self.stage, chunk)
        prefix = f"B{mb}.c{gci}"
        first: tuple[int, ...] = ()
        if gci < self.n_chunks - 1 and self._hop(gci + 1):
            first = (self._recv(mb, gci, grad=True),)
        blocks = self.blocks_of_chunk(gci)
        order = list(reversed(range(len(blocks))))
        ahead: tuple[int, ...] = ()
        loaded: dict[int, int] = {}  # block index → its reload
        for j, i in enumerate(order):
            block, name = blocks[i], f"{prefix}.{blocks[i].label}"
            if self.s.zero_stage == 3:
                own, ahead = self._zero3_gathers(blocks, order, j, prefix, first, ahead)
                first = (*first, *own)
            if i in loaded:
                first = (*first, loaded[i])
            if i > 0 and blocks[i - 1].offloaded:  # prefetched while this block runs backward
                at = first if self.tail is None else (self.tail, *first)
                loaded[i - 1] = self.mem(False, blocks[i - 1], prefix,
                                         (*at, self._stores.pop((mb, blocks[i - 1].label))))
            self.items(self._recompute_items(block), f"{name}.rc", "recompute", first)
            if self._recompute_items(block):
                first = ()
            items = self._b_items(block) if self.split_w else self._bwd_items(block)
            if items:
                self.items(items, name, "bwd", first)
                first = ()
            if self.s.zero_stage == 3:
                self._grad_reduce(block, name, last=last)
            elif last or self.s.grad_reduce_per_microbatch:
                self._bucket_add(block, name, flush=i == 0, last=last)
        if gci > 0 and self._hop(gci - 1):
            self._send(mb, gci - 1, grad=True)

    def _offload(self, mb: int, block: ParamBlock, prefix: str) -> int:
        """After an offloaded layer's forward: its store. Transformer Engine's double-buffered
        handler makes the compute stream wait for the copy stream at each offloaded layer's
        commit before issuing its copy, so the next layer's forward waits for the store of the
        layer before this one (``forward``)."""
        assert self.tail is not None
        node = self._stores[(mb, block.label)] = self.mem(True, block, prefix, (self.tail,))
        return node

    def weight(self, mb: int, chunk: int, *, last: bool) -> None:
        """A W pass (ZB-H1, ZB-V): the weight-gradient GEMMs the B pass left (``_w_items``),
        block by block in backward order; on the last micro-batch each block's gradients are
        then complete and go to the buckets (the grad-ready hooks fire on the weight
        gradient)."""
        gci = self.s.gci(self.stage, chunk)
        blocks = self.blocks_of_chunk(gci)
        for i in reversed(range(len(blocks))):
            name = f"W{mb}.c{gci}.{blocks[i].label}"
            self.items(self._w_items(blocks[i]), name, "bwd")
            if last:
                self._bucket_add(blocks[i], name, flush=i == 0)

    @property
    def split_w(self) -> bool:
        """Whether backward passes leave their weight gradients to W passes (ZB-H1, ZB-V)."""
        return self.s.split_w

    def _b_items(self, block: ParamBlock) -> list[O.Item]:
        """A block's backward without its weight-gradient GEMMs (ZB-H1's B pass)."""
        return self._split(block)[0]

    def _w_items(self, block: ParamBlock) -> list[O.Item]:
        """A block's weight-gradient GEMMs (ZB-H1's W pass)."""
        return self._split(block)[1]

    def _split(self, block: ParamBlock) -> tuple[list[O.Item], list[O.Item]]:
        got = self._splits.get(block.name)
        if got is None:
            got = self._splits[block.name] = O.split_weight_grads(
                self._bwd_items(block), regather=self.s.zb_w_regather)
        return got

    @functools.cached_property
    def _lists(self) -> dict[str, list[O.Item]]:
        """Op lists of the non-layer blocks, built once."""
        m, s = self.m, self.s
        lists = {"embedding_fwd": O.embedding_fwd(m, s), "embedding_bwd": O.embedding_bwd(m, s),
                 "lm_head_fwd": O.head_fwd(m, s), "lm_head_bwd": O.head_bwd(m, s), "none": []}
        if m.mtp_layers:  # (the embedding's copy runs nothing: the lookup is the module's)
            last = m.window_view(m.windowed(m.num_layers - 1)) if m.window else m
            lists.update(mtp_fwd=O.mtp_fwd(last, s), mtp_bwd=O.mtp_bwd(last, s),
                         mtp_embedding_fwd=[], mtp_embedding_bwd=[])
        return lists

    @functools.cached_property
    def _selective(self) -> dict[tuple[str, ...], list[O.Item]]:
        return {}

    def selective_items(self, modules: tuple[str, ...], block: str = "layer") -> list[O.Item]:
        """What selective recompute of ``modules`` runs again before a layer's backward (built
        once per module set and layer kind: the fast path asks a shared program for other
        strategies' sets)."""
        got = self._selective.get((block, *modules))
        if got is None:
            got = self._selective[(block, *modules)] = O.selective_recompute(
                layer_model(self.m, block), self.s, modules, self._layer_list(block, "fwd"))
        return got

    def _layer_list(self, name: str, which: str) -> list[O.Item]:
        """A layer block's forward ("fwd") or backward ("bwd") op list, built once per kind."""
        got = self._layer_lists.get((name, which))
        if got is None:
            build = O.layer_fwd if which == "fwd" else O.layer_bwd
            got = self._layer_lists[name, which] = build(layer_model(self.m, name), self.s)
        return got

    @functools.cached_property
    def _layer_lists(self) -> dict[tuple[str, str], list[O.Item]]:
        return {}

    def block_items(self, block: ParamBlock, which: str) -> list[O.Item]:
        """A block's forward (``which`` = "fwd") or backward ("bwd") op list for one
        micro-batch, as the program issues it (the backward without what recompute runs
        again before it: ``_recompute_items``); ZB-H1's B and W parts of the backward: "b",
        "w"."""
        if which == "fwd":
            return self._fwd_items(block)
        if which == "b":
            return self._b_items(block)
        return self._w_items(block) if which == "w" else self._bwd_items(block)

    def _fwd_items(self, block: ParamBlock) -> list[O.Item]:
        if block.is_layer:
            return self._layer_list(block.name, "fwd")
        return self._lists[f"{block.name}_fwd"]

    def _bwd_items(self, block: ParamBlock) -> list[O.Item]:
        if block.is_layer:
            return self._layer_list(block.name, "bwd")
        return self._lists[f"{block.name}_bwd"]

    def step_op_count(self) -> int:
        """Ops and collectives of one step over every model chunk, each micro-batch's forward,
        recomputation and backward: about how many nodes a representative trace set holds (the
        pipeline sends, gradient buckets and optimizer add few). Sizes a trace before it is
        built."""
        per_mb = 0
        for gci in range(self.n_chunks):
            for block, count in self.chunk_runs(gci):
                per_mb += count * (len(self._fwd_items(block)) + len(self._bwd_items(block))
                                   + len(self._recompute_items(block)))
        return per_mb * self.m_mb

    def _recompute_items(self, block: ParamBlock) -> list[O.Item]:
        if not block.recomputes or self.s.recompute == "none":
            return self._lists["none"]
        if self.s.recompute == "full":
            return self._fwd_items(block)
        return self.selective_items(self.s.selective_modules, block.name)

    def _tag(self, mb: int, gci_recv: int, grad: bool) -> int:
        return 1 + 2 * (gci_recv * self.m_mb + mb) + int(grad)

    def _p2p_bytes(self) -> int:
        tokens = self.s.micro_batch_size * self.m.seq_len // self.s.cp
        if self.s.sequence_parallel:
            tokens //= self.s.tp
        return tokens * self.m.hidden_size * O.ACT_BYTES

    def _hop(self, gci: int) -> int:
        """The pipeline-stage offset from this stage to the one running chunk ``gci`` (0: this
        stage, where a V turns round: the pass hands its tensor on in place, no send)."""
        return self.s.chunk_stage(gci) - self.stage

    def _recv(self, mb: int, gci: int, *, grad: bool) -> int:
        kind = "recv_grad" if grad else "recv_act"
        src = self._hop(gci + 1 if grad else gci - 1)
        return self.p2p(False, self._p2p_bytes(), self._tag(mb, gci, grad), src,
                        f"{'B' if grad else 'F'}{mb}.c{gci}.{kind}")

    def _send(self, mb: int, gci_dst: int, *, grad: bool) -> None:
        kind = "send_grad" if grad else "send_act"
        self.p2p(True, self._p2p_bytes(), self._tag(mb, gci_dst, grad), self._hop(gci_dst),
                 f"{'B' if grad else 'F'}{mb}.c{gci_dst}.{kind}", deps=(self._tail(),))

    # ---- whole step -----------------------------------------------------------------------
    def build(self) -> list[PNode]:
        self.param_gathers: list[tuple[str, int]] = []
        s = self.s
        order = stage_order(s.order_id, m=self.m_mb, p=s.pp, v=s.vpp, stage=self.stage)
        grads = "W" if self.split_w else "B"  # the pass whose last one completes the gradients
        last = {c: max(j for ph, j, cc in order if ph == grads and cc == c) for c in range(s.vpp)}
        if self.param_gather_overlapped:
            self._early_param_gathers(order)
        units = (combined(s.order_id, m=self.m_mb, p=s.pp, v=s.vpp, stage=self.stage)
                 if s.overlap_moe_ep_comm else [(step,) for step in order])
        for unit in units:
            phase, mb, chunk = unit[0]
            if len(unit) == 2:  # combined 1F1B: a forward beside a backward
                assert unit[1][1] != last[unit[1][2]]  # (never a chunk's last: no buckets)
                self.merged(unit[0], unit[1])
            elif phase == "F":
                self.forward(mb, chunk)
            elif phase == "B":
                self.backward(mb, chunk, last=grads == "B" and mb == last[chunk])
            else:
                self.weight(mb, chunk, last=mb == last[chunk])
        self._finish()
        return self.nodes

    def merged(self, f: Step, b: Step) -> None:
        """Combined 1F1B (``Strategy.overlap_moe_ep_comm``; Megatron-Core's
        ``combined_forward_backward_step``): forward step ``f`` and backward step ``b`` (of
        another micro-batch; on an interleaved pipeline, of any of the stage's chunks) as one
        pass on the one compute stream. Both wait for their received tensors first (the
        ``pre_forward`` and ``pre_backward`` syncs); the forward's leading blocks (the
        embedding) run, then the backward's trailing ones (the head and loss, in reverse),
        then layer k's forward beside the backward's k-th layer from the end, the layers one
        pass has more after them alone (the backward's first), then the sends (the forward's
        output, the backward's input gradient), then the forward's trailing blocks and the
        backward's leading ones (``TransformerModelChunkSchedulePlan.run``). Within a pair
        each pass is cut at its expert-parallel all-to-alls and the pieces alternate, the
        backward's first — B0 (its combine issued after it), F0 (the attention; its dispatch
        after it), B1 (the experts' backward), F1 (the experts), B2 (the attention's
        backward), F2 — so that each all-to-all runs beside the other pass's compute
        (DeepSeek-V3 §3.2.1, Figure 4: attention beside the other's combine, MLP beside its
        dispatch). Never a chunk's last backward, so no gradient buckets; never a chunk's
        first forward (the warm-up holds them), so no parameter-gather waits; not with
        ZeRO-3 (``Strategy`` refuses it). With --delay-wgrad-compute the backward's layers'
        weight gradients run after its next all-to-all is issued (``merged_issues``)."""
        (_, f_mb, f_ch), (_, b_mb, b_ch) = f, b
        f_gci, b_gci = self.s.gci(self.stage, f_ch), self.s.gci(self.stage, b_ch)
        assert not any(k[:2] == (f_mb, f_gci) for k in self.gather_waits)  # (see above)
        prefix = {"F": f"F{f_mb}.c{f_gci}", "B": f"B{b_mb}.c{b_gci}"}
        waits: dict[str, tuple[int, ...]] = {"F": (), "B": ()}  # what each pass waits for next
        if f_gci > 0 and self._hop(f_gci - 1):
            waits["F"] = (self._recv(f_mb, f_gci, grad=False),)
        if b_gci < self.n_chunks - 1 and self._hop(b_gci + 1):
            waits["B"] = (self._recv(b_mb, b_gci, grad=True),)
        plan = merged_plan(self.blocks_of_chunk(f_gci), self.blocks_of_chunk(b_gci))
        cut = [[(name, self._delay_pieces(name, block, prefix[name])) for name, block in group]
               for group in plan.groups]
        for name, run, a2a in merged_issues(cut, plan.sends_at):
            if name == "S":  # after the layers: the forward's output, the gradient
                self._merged_sends(f_mb, f_gci, b_mb, b_gci)
            elif name == "W":  # deferred weight gradients: on the compute stream only
                assert run is not None
                self._emit_run(run, ())
            else:
                assert run is not None
                waits[name] = self._emit_run(run, waits[name])
                if a2a is not None:  # off the compute chain, before the pass's next item,
                    # after the collectives still running beside the piece's last node (TP
                    # overlap's all-gather beside the router: the tokens it dispatches)
                    item, a2a_prefix, _ = a2a
                    assert isinstance(item, O.Comm)
                    beside = tuple(self._waiting) if run else ()
                    waits[name] = (self.coll(item, a2a_prefix, blocking=False,
                                             deps=(*waits[name], *beside)),)

    def _delay_pieces(self, name: str, block: ParamBlock, prefix: str
                      ) -> list[tuple[list[Tagged], list[Tagged] | None, Tagged | None]]:
        """A block's pass cut at its all-to-alls (``ep_pieces``), each piece's deferred weight
        gradients apart where --delay-wgrad-compute defers them (``delayed_wgrads``)."""
        delay = defers_wgrads(self.s, name, block)
        out: list[tuple[list[Tagged], list[Tagged] | None, Tagged | None]] = []
        for run, a2a in ep_pieces(self.pass_chain(name, block, prefix)):
            kept, later = delayed_wgrads(run) if delay else (run, [])
            out.append((kept, later or None, a2a))
        return out

    def _merged_sends(self, f_mb: int, f_gci: int, b_mb: int, b_gci: int) -> None:
        """A merged pass's sends, after its layers: the forward's output to the next chunk,
        the backward's input gradient to the one before (where they are on other stages)."""
        if f_gci < self.n_chunks - 1 and self._hop(f_gci + 1):
            self._send(f_mb, f_gci + 1, grad=False)
        if b_gci > 0 and self._hop(b_gci - 1):
            self._send(b_mb, b_gci - 1, grad=True)

    def pass_chain(self, name: str, block: ParamBlock, prefix: str = ""
                   ) -> list[Tagged]:
        """A block's items in a forward ("F") or backward ("B", what recompute runs again
        first) pass, each with its node-name prefix and phase."""
        label = f"{prefix}.{block.label}"
        if name == "F":
            return [(it, label, "fwd") for it in self._fwd_items(block)]
        return ([(it, f"{label}.rc", "recompute") for it in self._recompute_items(block)]
                + [(it, label, "bwd") for it in self._bwd_items(block)])

    def _emit_run(self, run: list[Tagged], waits: tuple[int, ...]
                  ) -> tuple[int, ...]:
        """One piece on the compute chain, its first item after ``waits``; returns what the
        pass's next item waits for (its last node, or ``waits`` if the piece is empty)."""
        i = 0
        while i < len(run):
            _, prefix, phase = run[i]
            j = i
            while j < len(run) and run[j][1:] == (prefix, phase):
                j += 1
            self.items([it for it, _, _ in run[i:j]], prefix, phase, waits)
            waits, i = (), j
        return waits if not run or self.tail is None else (self.tail,)

    @property
    def param_gather_overlapped(self) -> bool:
        return self.s.overlap_param_gather and self.s.zero_stage in (1, 2)

    def _early_param_gathers(self, order: list[Step]) -> None:
        """Megatron ``--overlap-param-gather``: the all-gathers of the parameters the previous
        step updated, bucket by bucket in forward order on the data-parallel stream from the
        start of the step; the first forward of a bucket's first block waits for it (in a steady
        state this is the same as issuing them after the previous optimizer step)."""
        # the micro-batch of each chunk's first forward in this stage's order
        first_f = {c: min(j for ph, j, cc in order if ph == "F" and cc == c)
                   for c in range(self.s.vpp)}
        for c in range(self.s.vpp):
            gci = self.s.gci(self.stage, c)
            blocks = self.blocks_of_chunk(gci, labels=False)
            for axis in ("dp", "edp"):
                group = shard_axis(self.s, axis)
                size = dp_group_size(self.s, group)
                if dp_group_size(self.s, axis) < 2 or size < 2:
                    continue
                for first, n in reversed(bucket_plan(blocks, axis, self.s.dp_bucket_params)):
                    shard = -(-n // size) * O.param_gather_bytes(self.s)
                    comm = O.Comm("param_all_gather", group, "ALL_GATHER", shard)
                    node = self.coll(comm, f"step.c{gci}", blocking=False)
                    self.gather_waits.setdefault((first_f[c], gci, first), []).append(node)

    def _finish(self) -> None:
        s, m = self.s, self.m
        partner = embedding_partner(m, s)
        if partner is not None and self.stage in (0, partner):
            size = m.vocab_size * m.hidden_size // s.tp * O.grad_reduce_bytes(s)
            self.coll(O.Comm("embedding_grad_ar", "embd", "ALL_REDUCE", size), "step",
                      blocking=True)
        for c in self.deferred_dp:
            self.pending_dp.append(self.coll(c, "step", blocking=True))
        params = self._local_params()
        if s.optimizer_offload_fraction:  # (the copies wait for what the GPU's step waits for)
            ready = (*(() if self.tail is None else (self.tail,)), *self.pending_dp)
            self.op(O.gpu_optimizer_step(s, params), "step", "optimizer", tuple(self.pending_dp))
            waits = self._offloaded_step(O.offloaded_shares(s, params)[1], ready)
        else:
            self.op(O.optimizer_step(params, O.adam_bytes_per_param(s)), "step", "optimizer",
                    tuple(self.pending_dp))
            waits = ()
        if self.param_gather_overlapped:  # they open the next step (``_early_param_gathers``)
            return
        for axis, padded in self.param_gathers:
            if dp_group_size(self.s, axis) < 2:
                continue
            shard = padded // dp_group_size(self.s, axis) * O.param_gather_bytes(self.s)
            self.coll(O.Comm("param_all_gather", axis, "ALL_GATHER", shard), "step",
                      blocking=True, deps=waits)
            waits = ()

    def _offloaded_step(self, on_cpu: int, ready: tuple[int, ...]) -> tuple[int, ...]:
        """Optimizer offloading: the CPU's share of the step in ``offload_pieces`` equal
        pieces, each its fp32 gradients copied to host memory, the CPU's AdamW over them and the
        updated fp32 master copied back — HybridDeviceOptimizer steps one parameter tensor at a
        time, so one piece's copies overlap another's CPU step. Returns the last copy back."""
        n = offload_pieces(self.s, self.m, self.stage)
        piece, extra = divmod(on_cpu, n)
        first, last = ready, ready
        for i in range(n):
            size = piece + (i < extra)
            d2h = self.copy(True, size * O.OFFLOAD_COPY_BYTES_PER_PARAM,
                            f"step.opt{i}.grad_offload", first)
            cpu = self.host_op(O.cpu_optimizer_step(size), f"step.opt{i}.cpu_adam", (d2h,))
            last = (self.copy(False, size * O.OFFLOAD_COPY_BYTES_PER_PARAM,
                              f"step.opt{i}.master_reload", (cpu,)),)
            first = ()
        return last

    def stage_params(self) -> dict[str, int]:
        """Parameters this rank holds (before ZeRO sharding), by gradient-reduction axis."""
        return self.params_of_stage(self.stage)

    def params_of_stage(self, stage: int) -> dict[str, int]:
        total = {"dp": 0, "edp": 0}
        for c in range(self.s.vpp):
            for b in self.blocks_of_chunk(self.s.gci(stage, c), labels=False):
                total["dp"] += b.dense
                total["edp"] += b.expert
        return total

    def _local_params(self) -> int:
        """Parameters whose optimizer state this rank updates (sharded by ZeRO ≥ 1)."""
        return sharded_params(self.s, self.stage_params())


def offload_pieces(s: Strategy, m: ModelSpec, stage: int) -> int:
    """The pieces the CPU's share of an offloaded optimizer step runs in (``_offloaded_step``):
    one a transformer layer of the stage — the parameter tensors HybridDeviceOptimizer steps one
    by one, grouped by layer — so the first piece's copy to host memory and the last one's back
    are what the CPU's AdamW does not hide."""
    return max(1, s.stage_layers(m.num_layers, stage))


def build_role(model: ModelSpec, strategy: Strategy, stage: int) -> list[PNode]:
    """The node program of pipeline stage ``stage`` (shared by every rank of that stage)."""
    return RoleProgram(model, strategy, stage).build()
