"""Per-micro-batch operators of one rank: FLOPs, bytes moved, GEMM shapes, and the collectives
that tensor, context and expert parallelism insert.

Conventions and sources:

* A GEMM (m×k)·(k×n) costs 2·m·n·k FLOPs and moves (m·k + k·n + m·n) elements
  (Narayanan et al. 2021, §5.1 and Appendix; Kaplan et al. 2020, Table 1). Its backward is two
  GEMMs of the same FLOPs: data gradient (m×n)·(n×k) and weight gradient (k×m)·(m×n).
* Megatron tensor parallelism splits QKV and FC1 by columns and the output projection and FC2 by
  rows, with one all-reduce after each row-parallel GEMM in forward and one after each
  column-parallel GEMM in backward (Shoeybi et al. 2019, §3 and Fig. 3). With sequence parallelism
  each all-reduce becomes a reduce-scatter / all-gather pair and norms and dropout run on s/t
  tokens (Korthikanti et al. 2022, §4.2.2).
* Backward of a column-parallel GEMM as Megatron runs it (``LinearWithGradAccumulationAnd
  AsyncCommunication``): with sequence parallelism the input is all-gathered again (only its
  shard was kept) while the data-gradient GEMM runs, then the data gradient is reduce-scattered
  while the weight-gradient GEMM runs (Korthikanti et al. 2022, §4.2.2: "an extra all-gather in
  the backward pass, overlapped"); without it, the input-gradient all-reduce runs alongside the
  weight-gradient GEMM.
* ``tp_comm_overlap`` (Megatron ``--tp-comm-overlap``, Transformer Engine userbuffers) also
  overlaps the forward all-gather and reduce-scatter with their GEMMs and the backward all-gather
  of the output gradient with the row-parallel data-gradient GEMM, by splitting them into chunks
  (Wang et al. 2023, "Overlap communication with dependent computation via decomposition",
  ASPLOS). We model the pair as max(GEMM, collective): the first chunk's exposure is ignored.
* Causal flash attention forward: 4·b·s_q·s_k·d·heads / 2 FLOPs; its backward recomputes the
  scores and costs 2.5× the forward (Dao 2023, FlashAttention-2, §4 benchmark FLOP count).
* Memory-bound ops (norms, rotary, activation, dropout+residual, loss, optimizer) carry element
  counts × bytes; their FLOPs are small per-element counts given next to each.
* Activations are 16-bit (2 bytes) in every precision: FP8 training keeps activations in BF16
  and quantises only GEMM operands (Micikevicius et al. 2022, "FP8 formats", §4). That
  quantisation is memory-bound work of its own: before each FP8 GEMM of a layer the 16-bit input
  is cast to FP8 together with the transposed copy the weight-gradient GEMM needs (Transformer
  Engine's fused cast-transpose: read 2 bytes, write 1 + 1 per element), and in backward the
  output gradient likewise. Weights are cast once per step (cached across micro-batches) and not
  counted.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from tracegen.documents import busiest_rank_factor
from tracegen.model import ModelSpec
from tracegen.routing import Route, expected_units
from tracegen.strategy import Strategy
from tracegen.units import DTYPE_BYTES, LOW_PRECISION_GEMMS
from tracegen.window import CpWindow, cp_window

OpKind = Literal["gemm", "attention", "norm", "elementwise", "embedding", "loss", "optimizer"]
CollType = Literal["ALL_REDUCE", "ALL_GATHER", "REDUCE_SCATTER", "ALL_TO_ALL"]
ACT_BYTES = 2  # 16-bit activations (see module docstring)
# Megatron's vocab-parallel cross-entropy, unfused (its default; tensor_parallel/cross_entropy.py,
# as mpu/cross_entropy.py in 2021), in bytes of HBM traffic per logit. Forward: the 16-bit
# logits cast to fp32 (2 + 4), the max (4), subtracting it in place (4 + 4), exp in place
# (4 + 4), the sum (4) and the division into the softmax saved for backward (4 + 4) = 38.
# Backward: scaling the saved softmax by the loss gradient in place (4 + 4) and autograd's cast
# of the fp32 gradient back to the logits' 16 bits (4 + 2) = 14. (Was 8 and 8: two fp32 passes.)
CE_FWD_BYTES = 38
CE_BWD_BYTES = 14
# (forward, backward) bytes per logit of each ``Strategy.cross_entropy_fusion``. "none": the
# eager ops above. "native": Megatron-Core's ``fused_vocab_parallel_cross_entropy``, each step
# under its jit fuser: the cast and the max in one kernel (read 2, write 4), exp(x − max) in
# place (4 + 4), the row sum (4), the division in place with the loss (4 + 4) = 26; backward
# the in-place scaling (4 + 4) and the cast back to 16 bits (4 + 2) = 14, as unfused.
# "te": Transformer Engine's Triton cross-entropy (``pytorch/triton/cross_entropy.py``): the
# forward's online-softmax pass reads the 16-bit logits once (2; the loss kernel reads only
# the per-row max, sum and target logit), the backward reads them again and writes the
# gradient in their place (2 + 2) = 4.
CE_BYTES = {"none": (CE_FWD_BYTES, CE_BWD_BYTES), "native": (26, 14), "te": (2, 4)}
GRAD_REDUCE_BYTES = 4  # Megatron sets accumulate_allreduce_grads_in_fp32 for bf16 (arguments.py)
GRAD_REDUCE_BYTES_16 = 2  # ... unless --grad-reduce-in-bf16 (``Strategy.grad_reduce_in_bf16``)
PARAM_BYTES = 2  # 16-bit model weights
# ... that the distributed optimizer (after the step) and Megatron-FSDP (ZeRO-3, before each
# forward and backward) all-gather in 1 byte with --fp8-param-gather
# (``Strategy.fp8_param_gather``; ``param_gather_bytes``)
FP8_PARAM_BYTES = 1
# The optimizer step of mixed-precision training touches per parameter (Megatron-LM
# megatron/core/optimizer/optimizer.py, MixedPrecisionOptimizer.step; the fp32 state is the 16
# bytes of Rajbhandari et al. 2020, ZeRO §3): the gradient-norm pass of clip_grad_norm (read the
# fp32 grad, 4), fused Adam (read grad 4 + master, m, v 12; write master, m, v 12) and the copy of
# the fp32 master into the 16-bit model weight (read 4, write 2) = 38 bytes. Not counted: the
# grad-clipping rescale (only when the norm exceeds the threshold), fp16 loss-scale unscaling
# and zeroing the gradient buffer (framework-dependent; PyTorch's set_to_none writes nothing).
# FLOPs: ~12 per parameter.
ADAM_BYTES_PER_PARAM = 38
# With Adam's moments in 16 or 8 bits (``Strategy.adam_moments_dtype``; Megatron-Core's
# precision-aware optimizer over Transformer Engine's FusedAdam, whose exp_avg / exp_avg_sq may
# be fp16, bf16 or FP8 — torch.uint8 — each with one fp32 scale a tensor) m and v are each read
# and written in their own width: 38 − 4·(4 − w), 30 for 2-byte moments, 26 for FP8.
MOMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
ADAM_FLOP_PER_PARAM = 12
# Optimizer offloading (``Strategy.optimizer_offload_fraction``; Megatron-Core's
# HybridDeviceOptimizer with param_update_in_fp32): per offloaded parameter the GPU still runs the
# gradient-norm pass (read the fp32 grad, 4) and the copy of the fp32 master into the 16-bit
# weight (read 4, write 2) = 10 bytes; the fp32 gradient goes to host memory and the updated fp32
# master comes back (4 bytes each way); PyTorch's fused CPU AdamW reads grad, master, m, v and
# writes master, m, v: 28 bytes of host memory.
OFFLOADED_GPU_BYTES_PER_PARAM = 10
OFFLOAD_COPY_BYTES_PER_PARAM = 4
CPU_ADAM_BYTES_PER_PARAM = 28


@dataclasses.dataclass(frozen=True, slots=True)
class Op:
    """One compute operator on one rank for one micro-batch."""

    name: str
    kind: OpKind
    flop: int
    bytes: int
    m: int = 0
    n: int = 0
    k: int = 0
    dtype: str = "bf16"
    # A GEMM run as this many kernels of m/splits rows each: Transformer Engine's
    # communication overlap splits it so each chunk's transfer hides behind another's GEMM.
    splits: int = 1
    # A grouped GEMM: this many independent GEMMs of shape m×n×k (one per local expert; m or,
    # for a weight gradient, k the expert's share of the tokens), run one after another. ``flop``
    # and ``bytes`` are the group's total (``grouped_gemm``).
    groups: int = 1
    # Attention without the causal mask: each of the m queries attends all n keys (a context-
    # parallel ring's later steps; trace attribute ``attn_causal`` false).
    causal: bool = True


@dataclasses.dataclass(frozen=True, slots=True)
class Comm:
    """A collective on one axis. ``size_bytes`` has ASTRA-sim's meaning: all-reduce and
    reduce-scatter the full buffer, all-gather the per-rank shard, all-to-all the per-rank
    buffer."""

    name: str
    axis: str
    coll: CollType
    size_bytes: int
    # Runs alongside the next item of its list (a GEMM); the item after that waits for both.
    overlapped: bool = False
    # A MoE dispatch or combine whose dispatcher sends a token once per destination (DeepEP):
    # the layer's routing, from which the network finds the destinations (tracegen/routing.py).
    route: Route | None = None


Item = Op | Comm


@dataclasses.dataclass(frozen=True, slots=True)
class Dims:
    """Per-rank tensor dimensions of one micro-batch."""

    b: int  # micro-batch size (sequences)
    s: int  # tokens of a sequence on this rank (seq_len / cp)
    s_kv: int  # keys each query block attends to (full sequence)
    h: int
    t: int  # tp degree
    sp: bool
    dtype: str  # the linear layers' GEMMs': the precision, "mxfp8" under FP8's MXFP8 recipe
    overlap: bool = False  # tp_comm_overlap
    fp8_recipe: str = "delayed"  # Strategy.fp8_recipe (read where dtype is "fp8")

    @property
    def amax_first(self) -> bool:
        """FP8 current scaling: a cast reads its input for the amax first."""
        return self.dtype == "fp8" and self.fp8_recipe == "tensorwise"

    @property
    def per_tensor_fp8(self) -> bool:
        """An FP8 recipe with one scale a tensor (delayed or current scaling), whose GEMM
        inputs Transformer Engine gathers already quantized (``_fp8_gathers``); MXFP8's
        (dtype "mxfp8") are not."""
        return self.dtype == "fp8"

    @property
    def tokens(self) -> int:
        return self.b * self.s

    @property
    def dtype16(self) -> str:
        """The dtype of what an FP8 (or NVFP4) recipe keeps in 16 bits: the core attention and
        the output head. Transformer Engine's recipes cast only the linear layers (FP8 attention
        is the opt-in ``fp8_dpa``); DeepSeek-V3 (2024, §3.3.2) keeps embedding, output head,
        norms and attention in BF16; Megatron's output layer is not a Transformer Engine
        module."""
        return "bf16" if self.dtype in LOW_PRECISION_GEMMS else self.dtype

    @property
    def tokens_sp(self) -> int:
        """Tokens that norms and dropout see: split across TP with sequence parallelism."""
        return self.tokens // self.t if self.sp else self.tokens


# Chakra ETs carry an op's FLOPs and a collective's bytes as int64 attributes (et_def.proto:
# num_ops, comm_size); so do trainsim's op tables
COUNT_MAX = 2**63 - 1


def largest_count(m: ModelSpec, st: Strategy) -> tuple[str, int]:
    """The largest FLOP or byte count one op or collective of a micro-batch carries on a rank
    (a layer's forward and backward, the head's), with its name."""
    best = ("", 0)
    for it in (*layer_fwd(m, st), *layer_bwd(m, st), *head_fwd(m, st), *head_bwd(m, st)):
        for n in ((it.flop, it.bytes) if isinstance(it, Op) else (it.size_bytes,)):
            if n > best[1]:
                best = (it.name, n)
    return best


def adam_bytes_per_param(s: Strategy) -> int:
    """Bytes the optimizer step moves per local parameter (``ADAM_BYTES_PER_PARAM``, less the
    narrower moments' reads and writes: ``MOMENT_BYTES``)."""
    return ADAM_BYTES_PER_PARAM - 4 * (4 - MOMENT_BYTES[s.adam_moments_dtype])


def param_gather_bytes(s: Strategy) -> int:
    """Bytes per parameter in the distributed optimizer's parameter all-gathers (ZeRO 1/2),
    and in ZeRO-3's of a layer (``dp_comm.zero3_gather_bytes``). With ``fp8_param_gather`` the
    distributed optimizer's buckets are counted at 1 byte a parameter, the embedding and norm
    weights Megatron keeps in 16 bits too (its buckets span blocks; DESIGN.md); ZeRO-3, which
    gathers block by block, keeps the embedding and head at 2."""
    return FP8_PARAM_BYTES if s.fp8_param_gather else PARAM_BYTES


def grad_reduce_bytes(s: Strategy) -> int:
    """Bytes per gradient element in the data-parallel buffer and its collectives."""
    return GRAD_REDUCE_BYTES_16 if s.grad_reduce_in_bf16 else GRAD_REDUCE_BYTES


def op_key(s: Strategy) -> tuple[object, ...]:
    """Every strategy field the op lists of this module read (directly or through ``dims``):
    two strategies with the same key get the same op lists. Keep it in step with the code.
    (Recompute picks which lists run again, not what they hold, so it is not here.)"""
    return (s.micro_batch_size, s.cp, s.tp, s.sequence_parallel, s.precision, s.tp_comm_overlap,
            s.ep, s.cp_comm_type, s.expert_tp, s.moe_dispatcher, s.moe_shared_expert_overlap,
            s.zb_w_regather, s.cross_entropy_fusion, s.cp_balance, s.fp8_recipe)


def dims(m: ModelSpec, s: Strategy) -> Dims:
    mx = s.precision == "fp8" and s.fp8_recipe == "mxfp8"
    return Dims(b=s.micro_batch_size, s=m.seq_len // s.cp, s_kv=m.seq_len, h=m.hidden_size,
                t=s.tp, sp=s.sequence_parallel, dtype="mxfp8" if mx else s.precision,
                overlap=s.tp_comm_overlap, fp8_recipe=s.fp8_recipe)


def gemm(name: str, m: int, n: int, k: int, dtype: str) -> Op:
    e = DTYPE_BYTES[dtype]
    return Op(name, "gemm", 2 * m * n * k, int((m * k + k * n) * e) + m * n * ACT_BYTES, m, n, k,
              dtype)


def gemm_bwd(name: str, m: int, n: int, k: int, dtype: str) -> list[Op]:
    """Data gradient dX = dY·Wᵀ (m×n·n×k) and weight gradient dW = Xᵀ·dY (k×m·m×n)."""
    return [gemm(f"{name}_dgrad", m, k, n, dtype), gemm(f"{name}_wgrad", k, n, m, dtype)]


def grouped_gemm(name: str, rows: int, n: int, k: int, dtype: str, groups: int) -> Op:
    """``rows`` tokens through ``groups`` experts' own n×k weights, ``rows/groups`` each
    (balanced): Megatron-Core's grouped MLP (``TEGroupedMLP``: Transformer Engine's
    ``GroupedLinear``, one GEMM per local expert) — the FLOPs of one rows×n×k GEMM, but each
    expert's GEMM only as tall as its share and every expert's weights read."""
    if groups <= 1:
        return gemm(name, rows, n, k, dtype)
    e = DTYPE_BYTES[dtype]
    return Op(name, "gemm", 2 * rows * n * k, int(rows * k * e + groups * k * n * e)
              + rows * n * ACT_BYTES, -(-rows // groups), n, k, dtype, groups=groups)


def grouped_gemm_bwd(op: Op) -> list[Op]:
    """A grouped GEMM's data gradient (grouped like it) and weight gradient: each expert's
    dW = X_eᵀ·dY_e reduces over that expert's tokens only, ``rows/groups`` long."""
    rows, n, k, g = op.flop // (2 * op.n * op.k), op.n, op.k, op.groups
    e = DTYPE_BYTES[op.dtype]
    wgrad = Op(f"{op.name}_wgrad", "gemm", op.flop, int(rows * (k + n) * e) + g * k * n * ACT_BYTES,
               k, n, -(-rows // g), op.dtype, groups=g)
    return [grouped_gemm(f"{op.name}_dgrad", rows, k, n, op.dtype, g), wgrad]


def eltwise(name: str, elems: int, *, reads: int, writes: int, flop_per_elem: int,
            kind: OpKind = "elementwise") -> Op:
    return Op(name, kind, flop_per_elem * elems, (reads + writes) * elems * ACT_BYTES)


def _tp_comm(d: Dims, name: str, *, gather: bool) -> list[Item]:
    """Megatron's f/g operators: with SP an all-gather (gather=True) or reduce-scatter; without SP
    the all-reduce sits where the reduce-scatter would and the all-gather is an identity."""
    if d.t == 1:
        return []
    full = d.tokens * d.h * ACT_BYTES
    if d.sp:
        return [Comm(name, "tp", "ALL_GATHER", full // d.t) if gather
                else Comm(name, "tp", "REDUCE_SCATTER", full)]
    return [] if gather else [Comm(name, "tp", "ALL_REDUCE", full)]


# Per-element FLOPs of the memory-bound ops (counted as in Korthikanti et al. 2022 Table 2
# activation inventory; the FLOPs are a few per element and matter only for MFU bookkeeping).
NORM_FLOP, ROPE_FLOP, ACT_FLOP, RESID_FLOP = 4, 3, 4, 2
MERGE_FLOP = 4  # a context-parallel step's output correction: exp, two multiplies, an add


def attention_block_fwd(m: ModelSpec, st: Strategy, d: Dims) -> list[Item]:
    if m.is_mla:
        return _mla_block_fwd(m, st, d)
    t, h, n_tok = d.t, d.h, d.tokens
    q = m.q_size  # = h unless the model sets its own head_dim
    qkv_n = (q + 2 * m.kv_size) // t
    heads = m.num_attention_heads // t
    items: list[Item] = [eltwise("ln1", d.tokens_sp * h, reads=1, writes=1, flop_per_elem=NORM_FLOP,
                                 kind="norm")]
    items += _tp_comm(d, "ln1_ag", gather=True)
    items.append(gemm("qkv", n_tok, qkv_n, h, d.dtype))
    if m.gated or m.num_kv_heads != m.num_attention_heads:
        # Llama-family (and Gemma) models use rotary position embeddings (Su et al. 2021) on q
        # and k.
        items.append(eltwise("rope", n_tok * (q + m.kv_size) // t, reads=1, writes=1,
                             flop_per_elem=ROPE_FLOP))
    items += _core_attention(m, st, d, heads)
    items.append(gemm("attn_out", n_tok, h, q // t, d.dtype))
    items += _tp_comm(d, "attn_out_rs", gather=False)
    items.append(eltwise("resid1", d.tokens_sp * h, reads=2, writes=1, flop_per_elem=RESID_FLOP))
    return items


def mla_latent_width(m: ModelSpec) -> int:
    """What MLA's up-projections take per token: the Q latent (the hidden state without one),
    the K/V latent and the shared rotary key."""
    return (m.q_lora_rank or m.hidden_size) + m.kv_lora_rank + m.qk_rope_head_dim


def _mla_block_fwd(m: ModelSpec, st: Strategy, d: Dims) -> list[Item]:
    """Multi-head latent attention as Megatron-Core's MLASelfAttention runs it (DeepSeek-V2
    §2.1, Liu et al. 2024): the down-projections, duplicated over TP, on each rank's own tokens
    (its sequence-parallel share), their latents normed; with SP the latents — not the hidden
    states — all-gathered for the column-parallel up-projections; the rotary part of Q and of
    the shared key; attention with Q/K heads of head_dim + qk_rope_head_dim and V heads of
    v_head_dim; the row-parallel output projection."""
    t, h, n_tok, local = d.t, d.h, d.tokens, d.tokens_sp
    heads = m.num_attention_heads // t
    items: list[Item] = [eltwise("ln1", local * h, reads=1, writes=1, flop_per_elem=NORM_FLOP,
                                 kind="norm")]
    if m.q_lora_rank:
        items += [gemm("q_down", local, m.q_lora_rank, h, d.dtype),
                  eltwise("q_norm", local * m.q_lora_rank, reads=1, writes=1,
                          flop_per_elem=NORM_FLOP, kind="norm")]
    items += [gemm("kv_down", local, m.kv_lora_rank + m.qk_rope_head_dim, h, d.dtype),
              eltwise("kv_norm", local * m.kv_lora_rank, reads=1, writes=1,
                      flop_per_elem=NORM_FLOP, kind="norm")]
    if d.sp and t > 1:
        items.append(Comm("mla_latent_ag", "tp", "ALL_GATHER",
                          n_tok * mla_latent_width(m) * ACT_BYTES // t))
    items += [gemm("q_up", n_tok, heads * m.qk_head_dim, m.q_lora_rank or h, d.dtype),
              gemm("kv_up", n_tok, heads * (m.head_dim + m.v_dim), m.kv_lora_rank, d.dtype),
              eltwise("rope", n_tok * (heads + 1) * m.qk_rope_head_dim, reads=1, writes=1,
                      flop_per_elem=ROPE_FLOP)]
    items.append(attention_fwd(m, d, heads))
    items.append(gemm("attn_out", n_tok, h, heads * m.v_dim, d.dtype))
    items += _tp_comm(d, "attn_out_rs", gather=False)
    items.append(eltwise("resid1", d.tokens_sp * h, reads=2, writes=1, flop_per_elem=RESID_FLOP))
    return items


def _mla_bwd(items: list[Item], m: ModelSpec, d: Dims) -> list[Item]:
    """MLA's backward TP collectives around its column-parallel up-projections: with SP the
    saved latents gathered again beside their data gradients (the reduce-scatter of the latent
    gradients is the forward gather's conjugate); without SP the latent gradients all-reduced
    before the norms' backward (Megatron's f operator on the up-projections' input)."""
    if d.t == 1:
        return items
    names = [it.name for it in items]
    latent = d.tokens * mla_latent_width(m) * ACT_BYTES
    if d.sp:
        i = names.index("kv_up_dgrad")
        return [*items[:i], Comm("mla_latent_in_ag", "tp", "ALL_GATHER", latent // d.t, True),
                *items[i:]]
    i = names.index("kv_norm_bwd")
    return [*items[:i], Comm("mla_latent_grad_ar", "tp", "ALL_REDUCE", latent), *items[i:]]


def _core_attention(m: ModelSpec, st: Strategy, d: Dims, heads: int) -> list[Item]:
    """The attention, with context parallelism's K/V movement (``Strategy.cp_comm_type``)."""
    attn = attention_fwd(m, d, heads)
    if st.cp == 1:
        return [attn]
    mask = m.document_mask
    if mask is not None and st.cp_balance == "sequence":
        # the whole sequence split: the busiest rank's pairs, its pieces whole up to a chunk
        # (s/2cp tokens: a document shorter than a chunk stays on one rank)
        length = max(1, min(mask.length, d.s // 2))
        attn = dataclasses.replace(attn, flop=round(attn.flop * busiest_rank_factor(
            m.seq_len, m.document_mean_tokens, m.document_length_sigma, st.cp, d.b)),
            m=length, n=length)
    kv_shard = d.tokens * 2 * m.kv_size // d.t * ACT_BYTES  # the K/V this rank holds
    if m.window:
        return _windowed_cp(st, d, attn, heads, cp_window(d.s_kv, st.cp, m.window,
                                                         st.cp_comm_type), kv_shard)
    if st.cp_comm_type == "all_gather":  # the whole sequence's K/V first (Llama 3 §3.3.2)
        return [Comm("cp_kv_ag", "cp", "ALL_GATHER", kv_shard), attn]
    # The ring: attention over the K/V chunk a rank holds while the next one arrives, cp steps
    # of equal work (load-balanced causal chunks) and cp − 1 passes. The first step waits for
    # nothing; the other cp − 1 run alongside the passes (recorded as an all-gather's bytes).
    # The first step is causal over the rank's own chunk pair (s/cp tokens). Each later step
    # is a call without the mask (Transformer Engine's ``AttnFuncWithCPAndKVP2P``: a step i ≤
    # rank runs the pair's queries against the other rank's first chunk, a later one the
    # second chunk's queries against both of its chunks — half a pair of queries or keys, all
    # pairs computed): one op of the cp − 1 calls, as the second kind (s/2cp queries, s/cp
    # keys; the first kind measured within 3% of it on an H200, bench/device run 4).
    # Under a document mask every document is split so (Transformer Engine's THD format,
    # ``thd_get_partitioned_indices``: each rank holds chunks r and 2·cp − 1 − r of every
    # document; ``Strategy.cp_balance``): a step's calls keep the pieces' length (above).
    key_len = attn.n if mask else d.s
    first = dataclasses.replace(attn, name="flash_attn_c0", flop=attn.flop // st.cp,
                                bytes=attn.bytes // st.cp, n=key_len)
    rest = dataclasses.replace(attn, flop=attn.flop - first.flop, bytes=attn.bytes - first.bytes,
                               n=key_len)
    if not mask:  # (a document's pieces: their partial tiles unmodelled, unmeasured as such)
        rest = dataclasses.replace(rest, m=max(1, d.s // 2), causal=False)
    # Each step's output joins the result by its softmax statistics (out += out_i ·
    # exp(lse_i − lse): Transformer Engine's fused ``flash_attn_fwd_out_correction``, one pass
    # per step reading the step's output and the running one, writing it back); its backward
    # stands for the per-step dq and dk/dv accumulation (``_bwd_item``: 1.5× the bytes).
    merge = eltwise("cp_out_merge", st.cp * d.tokens * heads * m.head_dim, reads=2, writes=1,
                    flop_per_elem=MERGE_FLOP)
    return [first, Comm("cp_kv_ring", "cp", "ALL_GATHER", kv_shard, overlapped=True), rest,
            merge]


def _windowed_cp(st: Strategy, d: Dims, attn: Op, heads: int, plan: CpWindow, kv_shard: int
                 ) -> list[Item]:
    """A sliding window under context parallelism (``tracegen.window``): the busiest rank's
    pairs over its two chunks (FLOPs 4·b·pairs·d·heads, key length 2·pairs/s_local), after the
    halo of K/V its chunks' windows reach back into (recorded as an all-gather that moves
    those bytes into each rank; its backward returns their gradients), or, where TE gathers
    K/V instead, after that gather."""
    op = dataclasses.replace(attn, flop=4 * d.b * plan.pairs * attn.k * heads,
                             n=-(-2 * plan.pairs // d.s))
    if not plan.halo_tokens:
        return [Comm("cp_kv_ag", "cp", "ALL_GATHER", kv_shard), op]
    halo = d.b * plan.halo_tokens * (kv_shard // d.tokens)
    return [Comm("cp_kv_halo", "cp", "ALL_GATHER", -(-halo // (st.cp - 1))), op]


def attention_fwd(m: ModelSpec, d: Dims, heads: int) -> Op:
    """Causal flash attention: 4·b·s_q·s_kv·d·heads/2 FLOPs (Dao 2023); under MLA QKᵀ with
    Q/K heads of qk_head_dim and attention·V with V heads of v_dim, i.e. d their mean. Within a
    sliding window of w (``ModelSpec.window``, a windowed layer's view) a query attends to
    min(i + 1, w) keys: s·w − w²/2 pairs a sequence where causal attention has s²/2, so
    4·b·(s·w − w²/2)·d·heads FLOPs; its key length is then 2·pairs/s (≈ 2w), the causal length
    whose queries attend to as many keys on average, which the compute model reads its
    efficiency curve at (replay/compute.py). Chunked (``ModelSpec.chunked``): causal attention
    over each chunk, recorded as s/w causal sequences of w tokens (the kernel runs them so, in
    one call). Under a document mask (``ModelSpec.document_mask``) each document's piece is a
    causal call of its own (FlashAttention's varlen kernel runs them in one launch): the
    expected pairs P (``tracegen.documents``), recorded as s/n calls of the equivalent length
    n = 2P/s; under context parallelism a rank's share of every document (P/cp, calls of
    n/cp). K and V are read whole either way."""
    qk, v = (m.qk_head_dim, m.v_dim) if m.is_mla else (m.head_dim, m.head_dim)
    hd = (qk + v) // 2
    kv_heads = m.num_kv_heads // d.t
    io = (d.tokens * heads * (qk + v) + d.b * d.s_kv * kv_heads * (qk + v)) * ACT_BYTES
    w = m.window
    mask = m.document_mask
    if mask is not None:  # each document piece its own causal call: s/n calls of n (documents)
        flop = round(4 * d.b * mask.pairs * d.s // d.s_kv * hd * heads)
        n = max(1, mask.length * d.s // d.s_kv)
        return Op("flash_attn", "attention", flop, io, n, n, hd, d.dtype16)
    if w and m.chunked:  # causal attention over each chunk: s/w sequences of w tokens
        flop = 4 * d.b * (d.s // w) * w * w * hd * heads // 2
        return Op("flash_attn", "attention", flop, io, w, w, hd, d.dtype16)
    if w and d.s == d.s_kv:  # (under context parallelism: ``_windowed_cp``)
        pairs2 = 2 * d.s * w - w * w  # twice the band's pairs (exact in integers)
        flop = 2 * d.b * pairs2 * hd * heads
        return Op("flash_attn", "attention", flop, io, d.s, -(-pairs2 // d.s), hd, d.dtype16)
    flop = 4 * d.b * d.s * d.s_kv * hd * heads // 2
    return Op("flash_attn", "attention", flop, io, d.s, d.s_kv, hd, d.dtype16)


def mlp_block_fwd(m: ModelSpec, st: Strategy, d: Dims) -> list[Item]:
    t, h, n_tok = d.t, d.h, d.tokens
    items: list[Item] = [eltwise("ln2", d.tokens_sp * h, reads=1, writes=1, flop_per_elem=NORM_FLOP,
                                 kind="norm")]
    if m.is_moe and st.moe_folded:  # each rank routes its own tokens: no TP collectives
        return items + _moe_fwd(m, st, d) + [
            eltwise("resid2", d.tokens_sp * h, reads=2, writes=1, flop_per_elem=RESID_FLOP)]
    items += _tp_comm(d, "ln2_ag", gather=True)
    if m.is_moe:
        items += _moe_fwd(m, st, d)
    else:
        up = 2 if m.gated else 1
        f = m.ffn_hidden_size // t
        items.append(gemm("fc1", n_tok, up * f, h, d.dtype))
        items.append(eltwise("act", n_tok * f, reads=up, writes=1, flop_per_elem=ACT_FLOP))
        items.append(gemm("fc2", n_tok, h, f, d.dtype))
    items += _tp_comm(d, "fc2_rs", gather=False)
    items.append(eltwise("resid2", d.tokens_sp * h, reads=2, writes=1, flop_per_elem=RESID_FLOP))
    return items


def _moe_fwd(m: ModelSpec, st: Strategy, d: Dims) -> list[Item]:
    """Top-k routing with balanced load: each rank's experts process tokens·k routed tokens
    (Lepikhin et al. 2021, GShard §2; Megatron-Core MoE all-to-all token dispatcher). Folded
    (``Strategy.expert_tp`` 1), a rank routes its sequence-parallel share of the tokens to whole
    experts; otherwise every TP rank routes all of them to its slice of each expert. Under
    uneven routing every rank is taken at the busiest one's load (the dispatch and combine
    wait for it), its received copies and expert work scaled alike; with a capacity factor at
    most that capacity (tokens dropped), or exactly it (padded). The
    dispatch and combine carry one copy per (token, expert) as Megatron-Core's all-to-all
    dispatcher sends them; under DeepEP (``Strategy.moe_dispatcher``) they also carry the
    routing, and the network sends a token once per destination (replay/network.py). Around
    them the token permutations (``_permutations``)."""
    h, k = d.h, m.experts_per_token
    tokens = d.tokens_sp if st.moe_folded else d.tokens
    # what the busiest rank receives and computes: the routing's imbalance, or the experts'
    # capacity where tokens are dropped or padded (``ModelSpec.moe_busiest_load``)
    routed = round(tokens * k * m.moe_busiest_load)
    f = m.moe_ffn_hidden_size // st.etp
    up = 2 if m.gated else 1
    items: list[Item] = [gemm("router", tokens, m.num_experts, h, "fp32")]
    route = (Route(k, m.num_experts, m.moe_router_num_groups, m.moe_router_group_topk)
             if st.moe_dispatcher == "deepep" else None)
    before, after, restore, unpermute = _permutations(m, st, tokens, routed, h, route)
    # (the permutations of the rank's own tokens move balanced copies: tokens · k)
    items += before
    if st.ep > 1:
        items.append(Comm("moe_dispatch", "ep", "ALL_TO_ALL", routed * h * ACT_BYTES,
                          route=route))
    items += after
    local = m.num_experts // st.ep  # the rank's experts, one GEMM each
    items.append(grouped_gemm("expert_fc1", routed, up * f, h, d.dtype, local))
    items.append(eltwise("expert_act", routed * f, reads=up, writes=1, flop_per_elem=ACT_FLOP))
    items.append(grouped_gemm("expert_fc2", routed, h, f, d.dtype, local))
    items += restore
    if st.ep > 1:
        items.append(Comm("moe_combine", "ep", "ALL_TO_ALL", routed * h * ACT_BYTES,
                          route=route))
    items += unpermute
    if m.shared_expert_ffn_hidden_size:
        # every token through the shared experts, TP-split like a dense MLP, after the routed
        # ones (Megatron-Core MoELayer without --moe-shared-expert-overlap); folded, the routed
        # path has no TP collectives, so the shared experts gather their input and
        # reduce-scatter their output themselves (Megatron-Core's SharedExpertMLP is a
        # tensor-parallel MLP)
        fs = m.shared_expert_ffn_hidden_size // st.tp
        folded = st.moe_folded
        shared = [*(_tp_comm(d, "shared_ag", gather=True) if folded else ()),
                  gemm("shared_fc1", d.tokens, up * fs, h, d.dtype),
                  eltwise("shared_act", d.tokens * fs, reads=up, writes=1, flop_per_elem=ACT_FLOP),
                  gemm("shared_fc2", d.tokens, h, fs, d.dtype),
                  *(_tp_comm(d, "shared_rs", gather=False) if folded else ())]
        items = (_shared_beside_dispatch(items, shared)
                 if st.moe_shared_expert_overlap and st.ep > 1 else items + shared)
    return items


def _shared_beside_dispatch(items: list[Item], shared: list[Item]) -> list[Item]:
    """Megatron-Core's --moe-shared-expert-overlap: the shared experts run on a stream of their
    own beside the token dispatcher's all-to-alls (``SharedExpertMLP`` with
    ``moe_shared_expert_overlap``: its input gathered before the dispatch, FC1 and the
    activation during it, FC2 during the combine, its output reduced after): the dispatch runs
    alongside FC1, the combine alongside FC2. ``layer_bwd`` pairs their backward alike."""
    names = [it.name for it in items]
    i, j = names.index("moe_dispatch"), names.index("moe_combine")
    at = {it.name: it for it in shared}
    gather = [it for it in shared if it.name == "shared_ag"]
    scatter = [it for it in shared if it.name == "shared_rs"]
    dispatch, combine = items[i], items[j]
    assert isinstance(dispatch, Comm) and isinstance(combine, Comm)
    return [*items[:i], *gather, dataclasses.replace(dispatch, overlapped=True),
            at["shared_fc1"], at["shared_act"], *items[i + 1:j],
            dataclasses.replace(combine, overlapped=True), at["shared_fc2"], *scatter,
            *items[j + 1:]]


def _shared_beside_dispatch_bwd(items: list[Item]) -> list[Item]:
    """The backward of ``_shared_beside_dispatch``: the combine's backward alongside the shared
    FC2's data gradient, the dispatch's alongside the shared FC1's (autograd runs a backward
    op on its forward op's stream, so the shared experts' backward keeps its own stream)."""
    out = list(items)
    for comm, gemm_ in (("moe_combine_bwd", "shared_fc2_dgrad"),
                        ("moe_dispatch_bwd", "shared_fc1_dgrad")):
        names = [it.name for it in out]
        c = out.pop(names.index(comm))
        assert isinstance(c, Comm)
        out.insert([it.name for it in out].index(gemm_),
                   dataclasses.replace(c, overlapped=True))
    return out


# Memory-bound token moves of a MoE layer; their backward moves the gradients back, the same
# bytes (``_bwd_item``).
PERMUTATIONS = frozenset({"moe_permute", "moe_sort", "moe_unsort", "moe_unpermute"})


def _permutations(m: ModelSpec, st: Strategy, tokens: int, routed: int, h: int,
                  route: Route | None) -> tuple[list[Op], list[Op], list[Op], list[Op]]:
    """The token permutations around a MoE layer's dispatch and combine, as Megatron-Core's
    dispatchers run them (``token_dispatcher.py``): (before the dispatch, after it, before the
    combine, after it). The all-to-all dispatcher permutes the rank's tokens into one copy per
    (token, expert), grouped by destination ("permutation 1"), and after the all-to-all sorts
    what arrived by local expert where a rank holds more than one ("permutation 2"); the
    combine undoes both, the last one summing each token's copies weighted by their router
    probabilities. The flex dispatcher on DeepEP receives each token once per destination GPU
    and permutes those into per-expert copies after the dispatch, and sums them back before
    the combine. Each pass reads and writes its rows (2 bytes per element); the weighted sum
    reads the copies and writes the tokens. ``routed``: the copies the (busiest) rank
    receives; its own tokens' copies are tokens · k."""
    own = tokens * m.experts_per_token
    moved = 2 * routed * h * ACT_BYTES

    def move(name: str, nbytes: int, flop: int = 0) -> Op:
        return Op(name, "elementwise", flop, nbytes)

    if route is not None:  # DeepEP: tokens arrive once per destination GPU
        arrived = round(tokens * expected_units(route, st.ep) * m.moe_busiest_load)
        return ([], [move("moe_permute", moved)],
                [move("moe_unpermute", (routed + arrived) * h * ACT_BYTES, 2 * routed * h)], [])
    local = m.num_experts // st.ep > 1
    sort: list[Op] = [move("moe_sort", moved)] if local else []
    unsort: list[Op] = [move("moe_unsort", moved)] if local else []
    return ([move("moe_permute", 2 * own * h * ACT_BYTES)], sort, unsort,
            [move("moe_unpermute", (own + tokens) * h * ACT_BYTES, 2 * own * h)])


def layer_fwd(m: ModelSpec, st: Strategy) -> list[Item]:
    d = dims(m, st)
    return _fp8_layer(_overlap_fwd(attention_block_fwd(m, st, d) + mlp_block_fwd(m, st, d), d), d)


FP8_CAST_BYTES_PER_ELEM = 4  # cast-transpose: read 16-bit, write FP8 and its transpose
# (On a GPU whose FP8 GEMMs take any layout — Blackwell: TE's ``is_non_tn_fp8_gemm_supported``
# — the per-tensor quantizer writes no transposed copy, ``Float8Quantizer::create_tensor``'s
# ``create_transpose = columnwise_usage && !nvte_is_non_tn_fp8_gemm_supported()``: the cast op
# carries dtype "fp8" and its element count as ``flop``, and the compute model drops that one
# byte an element there, ``replay.compute``. MXFP8's and NVFP4's casts keep both copies: their
# scales run one way.)
# NVFP4 (Transformer Engine's NVFP4BlockScaling; NVIDIA, "Pretraining LLMs with NVFP4", 2025):
# the tensor's amax first (its FP32 second-level scale must be known before any block is cast;
# one read, the pre- and post-Hadamard amax together), then one read writing the row-wise copy
# and the column-wise one (the weight gradient's, random-Hadamard-transformed in the same
# kernel), each 0.5625 bytes an element: 2 + 2 + 2 · 0.5625 = 5.125.
NVFP4_CAST_BYTES_PER_8_ELEMS = 41


# FP8 current scaling (Transformer Engine's Float8CurrentScalingQuantizer::quantize_impl:
# nvte_compute_amax, then the scale, then the cast) reads the 16-bit tensor once more for its
# amax, except where the norm before the GEMM computed the amax while writing its output (the
# quantizer passed to the norm: Megatron-Core's TELayerNormColumnParallelLinear, the QKV and a
# dense FC1, and MLA's up-projections behind their latents' norms) — 2 more bytes an element.
AMAX_READ_BYTES_PER_ELEM = ACT_BYTES
NORM_FED_GEMMS = frozenset({"qkv", "fc1", "q_up", "kv_up"})


# MXFP8 (Transformer Engine's MXFP8BlockScaling, the OCP Microscaling format: an E8M0 scale a
# block of 32 elements; Blackwell's block-scaled tensor cores): no amax pass (each block's
# scale is its own maximum, found in the cast), one read writing the row-wise copy and the
# column-wise one, each 1 + 1/32 bytes an element: 2 + 2 · 33/32 = 4.0625.
MXFP8_CAST_BYTES_PER_16_ELEMS = 65


def _cast_bytes(dtype: str, elems: int) -> int:
    if dtype == "nvfp4":
        return NVFP4_CAST_BYTES_PER_8_ELEMS * elems // 8
    if dtype == "mxfp8":
        return MXFP8_CAST_BYTES_PER_16_ELEMS * elems // 16
    return FP8_CAST_BYTES_PER_ELEM * elems


# Transformer Engine quantizes a sequence-parallel GEMM input before it gathers it, so an FP8
# per-tensor recipe all-gathers 1-byte elements: LayerNormLinear's norm writes its output as FP8
# and gathers that (TE 1.x ``layernorm_linear.py``: ``ln_out`` allocated as uint8, then
# ``gather_along_first_dim(ln_out, tp_group)``), Linear casts before its gather, the backward
# re-gathers the saved FP8 input, and ``grad_output_preprocess`` quantizes a row-parallel
# layer's output gradient before gathering it (TE 2.x: the quantizer passed to
# ``gather_along_first_dim`` or to the userbuffers copy; userbuffers' all-gather buffers are
# FP8, ``initialize_ub``'s ``fp8_buf``). Reduce-scatters stay 16-bit (GEMM outputs), and so do
# the gathers Megatron's MoE layers make around their router and dispatcher (not a TE GEMM's
# input). MXFP8 gathers in 16 bits: its quantizer does not take the norm's output under an
# input all-gather (TE 2.x LayerNormLinear: ``with_quantized_norm = False`` for an
# MXFP8Quantizer with ``with_input_all_gather``), and its per-block scales run along the
# gathered dimension. NVFP4's gathers are kept at 16 bits (not checked against its code).
FP8_GATHER_BYTES_PER_ELEM = 1
# Under current scaling each of those quantizations first all-reduces its amax over the TP
# group, so that every shard is cast with one scale (TE 2.x ``_customize_quantizers_float8_
# current_scaling``: ``with_amax_reduction`` with ``amax_reduction_group = tp_group`` for a
# column-parallel input and a row-parallel output gradient under SP): one FP32 a collective,
# ahead of the cast. A re-gather of the saved input quantizes nothing and needs none.
AMAX_BYTES = 4


def _fp8_layer(items: list[Item], d: Dims) -> list[Item]:
    """A layer's list as an FP8 or NVFP4 recipe runs it: its GEMM inputs' gathers
    (``_fp8_gathers``), then the casts (``_fp8_casts``)."""
    return _fp8_casts(_fp8_gathers(items, d), d)


def _fp8_gathers(items: list[Item], d: Dims) -> list[Item]:
    """Each TP all-gather that feeds an FP8 GEMM at ``FP8_GATHER_BYTES_PER_ELEM``, after the
    amax all-reduce that current scaling (``d.amax_first``) runs before quantizing."""
    if not d.per_tensor_fp8 or not d.sp or d.t == 1:
        return items
    out: list[Item] = []
    for it, nxt in zip(items, [*items[1:], None], strict=True):
        if (isinstance(it, Comm) and _is_tp(it, "ALL_GATHER") and isinstance(nxt, Op)
                and nxt.kind == "gemm" and nxt.dtype == "fp8"):
            if d.amax_first and not it.name.endswith("_in_ag"):
                out.append(Comm(f"{it.name}_amax_ar", "tp", "ALL_REDUCE", AMAX_BYTES))
            it = dataclasses.replace(
                it, size_bytes=it.size_bytes * FP8_GATHER_BYTES_PER_ELEM // ACT_BYTES)
        out.append(it)
    return out


def _fp8_casts(items: list[Item], d: Dims) -> list[Item]:
    """A cast before every FP8 (or NVFP4) GEMM of a layer: of its input in forward (m·k
    elements), of the output gradient before the data-gradient GEMM in backward (m·k of that
    GEMM). ``amax_first`` (FP8 current scaling): each cast but a norm-fed GEMM's forward one
    reads its input for the amax first (``AMAX_READ_BYTES_PER_ELEM``)."""
    out: list[Item] = []
    for it in items:
        if (isinstance(it, Op) and it.kind == "gemm" and it.dtype in LOW_PRECISION_GEMMS
                and not it.name.endswith("_wgrad")):
            elems = it.flop // (2 * it.n)  # its input, m·k (the whole group's)
            amax = d.amax_first and it.dtype == "fp8" and it.name not in NORM_FED_GEMMS
            cast = Op(f"{it.name}_{it.dtype}_cast", "elementwise", elems,
                      _cast_bytes(it.dtype, elems)
                      + (AMAX_READ_BYTES_PER_ELEM * elems if amax else 0),
                      dtype=it.dtype)  # (fp8: Blackwell drops its transposed byte, above)
            # before a collective that runs alongside the GEMM, so the pair stays together
            paired = out and isinstance(out[-1], Comm) and out[-1].overlapped
            out.insert(len(out) - 1 if paired else len(out), cast)
        out.append(it)
    return out


# Transformer Engine's default split of a GEMM whose output is reduce-scattered alongside it
# (``initialize_ub``: method "pipeline", num_splits 4); an all-gather feeding a GEMM runs as a
# ring exchange of tp chunks, one GEMM per chunk (method "ring_exchange", num_splits = tp).
PIPELINE_RS_SPLITS = 4
# The layers Transformer Engine overlaps that way (``initialize_ub``: qkv, proj, fc1, fc2); a
# MoE router or expert GEMM beside a TP collective is not one of them and runs whole.
UB_GEMMS = frozenset({"qkv", "attn_out", "fc1", "fc2"})


def _overlap_fwd(items: list[Item], d: Dims) -> list[Item]:
    """With tp_comm_overlap: each sequence-parallel all-gather runs alongside the GEMM after it,
    each reduce-scatter alongside the GEMM before it (moved ahead of it, so the list reads
    'collective, then the GEMM it overlaps'); the GEMM runs in chunks as Transformer Engine's
    userbuffers split it (tp for a ring exchange, ``PIPELINE_RS_SPLITS`` for a pipelined
    reduce-scatter)."""
    if not d.overlap:
        return items
    out: list[Item] = []
    ring = False  # the GEMM after an overlapped all-gather: a ring exchange
    for it, nxt in zip(items, [*items[1:], None], strict=True):
        if ring and isinstance(it, Op):
            out.append(dataclasses.replace(it, splits=d.t) if it.name in UB_GEMMS else it)
            ring = False
        elif not isinstance(it, Comm):
            out.append(it)
        elif _is_tp(it, "ALL_GATHER") and isinstance(nxt, Op) and nxt.kind == "gemm":
            out.append(dataclasses.replace(it, overlapped=True))
            ring = True
        elif (_is_tp(it, "REDUCE_SCATTER") and out and isinstance(out[-1], Op)
              and out[-1].kind == "gemm"):
            gemm = out[-1]
            if gemm.name in UB_GEMMS:
                gemm = dataclasses.replace(gemm, splits=PIPELINE_RS_SPLITS)
            out[-1:] = [dataclasses.replace(it, overlapped=True), gemm]
        else:
            out.append(it)
    return out


def _is_tp(it: Item, coll: str) -> bool:
    return isinstance(it, Comm) and it.axis == "tp" and it.coll == coll


def backward_of(items: list[Item], d: Dims) -> list[Item]:
    """The backward pass of a forward list: reversed, GEMMs split into dgrad+wgrad, each TP
    collective replaced by its conjugate (all-reduce ↔ identity/all-gather ↔ reduce-scatter)."""
    out: list[Item] = []
    after: list[Item] = []  # what follows the next item's backward
    for it in reversed(items):
        bwd = _bwd_item(it, d)
        if isinstance(it, Comm) and it.overlapped and it.axis == "cp" and out:
            # the ring runs alongside the attention backward, so it goes before it; after the
            # backward of the ring's first step (the last one computed), the gradient chunks
            # take one more hop home
            out[-1:-1] = bwd
            after = [_dkv_return(it, d)]
        else:
            out += bwd + after
            after = []
    return out


def split_weight_grads(items: list[Item], *, regather: bool = False
                       ) -> tuple[list[Item], list[Item]]:
    """A backward list as ZB-H1's B and W passes (Qi et al. 2024 §2: the backward of a linear
    layer is the input gradient, which the layer below waits for, and the weight gradient,
    which nothing in the pass needs): (the list without its weight-gradient GEMMs, those
    GEMMs in order). A collective that ran beside a weight-gradient GEMM has nothing to run
    beside in B and blocks there (its result is the next op's input). The norms' weight
    gradients stay in their fused backward kernels and the embedding's backward in B (a
    scatter-add on the first stage, whose B is last in its pipeline anyway). ``regather``
    (``Strategy.zb_w_regather``, under SP): a column-parallel GEMM's input all-gather, which
    ran beside its data-gradient GEMM only to have the input ready for the weight gradient,
    moves to the W pass, blocking before that GEMM."""
    b: list[Item] = []
    w: list[Item] = []
    wgrads = {it.name.removesuffix("_wgrad") for it in items if it.name.endswith("_wgrad")}
    moved: dict[str, Comm] = {}
    for it in items:
        if regather and isinstance(it, Comm) and it.name.endswith("_in_ag") and (
                it.name.removesuffix("_in_ag") in wgrads):
            moved[it.name.removesuffix("_in_ag")] = dataclasses.replace(it, overlapped=False)
        elif isinstance(it, Op) and it.name.endswith("_wgrad"):
            if b and isinstance(b[-1], Comm) and b[-1].overlapped:
                b[-1] = dataclasses.replace(b[-1], overlapped=False)
            gather = moved.pop(it.name.removesuffix("_wgrad"), None)
            w += [gather, it] if gather else [it]
        else:
            b.append(it)
    return b, w


def weight_grad_operand_bytes(items: list[Item]) -> int:
    """What a deferred W pass of ``items`` (its weight-gradient GEMMs) keeps until it runs: each
    GEMM's two operands, dW = Xᵀ·dY, the input X as the GEMM reads it (gathered over the
    sequence under SP) and the output gradient dY — the tensors the ZB implementations'
    weight-gradient queue holds (``WeightGradStore.put(total_input, grad_output, …)``): a
    GEMM's bytes less the weight gradient it writes. A GEMM whose input the W pass gathers
    again (``split_weight_grads``' ``regather``) keeps its shard: the gather's bytes."""
    out, gather = 0, 0
    for it in items:
        if isinstance(it, Comm):
            gather = it.size_bytes if it.coll == "ALL_GATHER" else 0
            continue
        out += it.bytes - it.groups * it.m * it.n * ACT_BYTES
        if gather:  # (the input Xᵀ is the GEMM's m × k operand)
            out += gather - int(it.m * it.k * DTYPE_BYTES[it.dtype])
        gather = 0
    return out


def _dkv_return(ring: Comm, d: Dims) -> Comm:
    """The ring's last hop in backward: each rank's dK/dV chunk, accumulated around the ring,
    goes back to the rank that owns K and V (Transformer Engine's ``AttnFuncWithCPAndKVP2P``
    waits for it after its last step), before the QKV projection's backward needs it. One pass
    of the shard: the ring's all-gather bytes over its cp − 1 passes (the latency of the whole
    ring stays, a few µs too many beyond cp 2)."""
    cp = d.s_kv // d.s
    return Comm("cp_dkv_return", "cp", "ALL_GATHER", ring.size_bytes // (cp - 1))


def _bwd_item(it: Item, d: Dims) -> list[Item]:
    if isinstance(it, Comm):
        return _bwd_comm(it, d)
    if it.name in PERMUTATIONS:
        return [Op(f"{it.name}_bwd", it.kind, it.flop, it.bytes)]
    if it.kind == "gemm" and it.groups > 1:
        return list(grouped_gemm_bwd(it))
    if it.kind == "gemm":
        return list(gemm_bwd(it.name, it.m, it.n, it.k, it.dtype))
    if it.kind == "attention":
        return [Op(f"{it.name}_bwd", "attention", it.flop * 5 // 2, it.bytes * 2, it.m, it.n, it.k,
                   it.dtype, causal=it.causal)]
    # Elementwise backward reads the saved input and the output gradient, writes the input grad.
    return [Op(f"{it.name}_bwd", it.kind, it.flop * 2, it.bytes * 3 // 2)]


def _bwd_comm(c: Comm, d: Dims) -> list[Item]:
    if c.axis == "ep":  # all-to-all is its own conjugate
        return [Comm(f"{c.name}_bwd", "ep", "ALL_TO_ALL", c.size_bytes, route=c.route)]
    if c.axis == "cp" and c.overlapped:  # the ring again, with K/V and their gradients
        return [Comm(f"{c.name}_bwd", "cp", "ALL_GATHER", 2 * c.size_bytes, overlapped=True)]
    if c.axis == "cp":  # gradients of K, V are reduce-scattered back to their owners
        cp = d.s_kv // d.s  # the gathered K/V span cp ranks' shards
        return [Comm(f"{c.name}_bwd", "cp", "REDUCE_SCATTER", c.size_bytes * cp)]
    if c.coll == "ALL_GATHER":
        return [Comm(f"{c.name}_bwd", c.axis, "REDUCE_SCATTER", c.size_bytes * d.t)]
    if c.coll == "REDUCE_SCATTER":
        return [Comm(f"{c.name}_bwd", c.axis, "ALL_GATHER", c.size_bytes // d.t)]
    return []  # forward all-reduce (g) → identity in backward


def tp_input_grad_allreduce(d: Dims, name: str) -> list[Item]:
    """Without SP, the backward of Megatron's f operator (identity forward) is an all-reduce of the
    input gradient after each column-parallel GEMM (Shoeybi et al. 2019, Fig. 3)."""
    if d.t == 1 or d.sp:
        return []
    return [Comm(name, "tp", "ALL_REDUCE", d.tokens * d.h * ACT_BYTES)]


def layer_bwd(m: ModelSpec, st: Strategy) -> list[Item]:
    d = dims(m, st)
    mlp = _column_parallel_bwd(backward_of(mlp_block_fwd(m, st, d), d), d, "fc1", "ln2")
    if st.moe_shared_expert_overlap and m.shared_expert_ffn_hidden_size and st.ep > 1:
        mlp = _shared_beside_dispatch_bwd(mlp)
    attn = backward_of(attention_block_fwd(m, st, d), d)
    attn = _mla_bwd(attn, m, d) if m.is_mla else _column_parallel_bwd(attn, d, "qkv", "ln1")
    return _fp8_layer(_overlap_row_parallel_bwd(mlp + attn, d), d)


def _column_parallel_bwd(items: list[Item], d: Dims, gemm: str, norm: str) -> list[Item]:
    """Megatron's backward of a column-parallel GEMM: with SP, [input all-gather ‖ dgrad,
    reduce-scatter of the input gradient ‖ wgrad]; without SP, [dgrad, all-reduce ‖ wgrad].
    Blocks without that GEMM (MoE MLPs) keep the input-gradient reduction before the norm."""
    if d.t == 1:
        return items
    names = [it.name for it in items]
    if f"{gemm}_dgrad" not in names:
        return _insert_after_norm_bwd(items, norm, d)
    i = names.index(f"{gemm}_dgrad")
    dgrad, wgrad = items[i], items[i + 1]
    full = d.tokens * d.h * ACT_BYTES
    if d.sp:
        rest = [it for it in items[i + 2:] if it.name != f"{norm}_ag_bwd"]
        return [*items[:i], Comm(f"{gemm}_in_ag", "tp", "ALL_GATHER", full // d.t, True), dgrad,
                Comm(f"{norm}_ag_bwd", "tp", "REDUCE_SCATTER", full, True), wgrad, *rest]
    reduce = [dataclasses.replace(c, overlapped=True)
              for c in tp_input_grad_allreduce(d, f"{norm}_in_grad_ar") if isinstance(c, Comm)]
    return [*items[:i], dgrad, *reduce, wgrad, *items[i + 2:]]


def _overlap_row_parallel_bwd(items: list[Item], d: Dims) -> list[Item]:
    """With tp_comm_overlap the all-gather of the output gradient runs alongside the
    row-parallel data-gradient GEMM after it, which runs in tp chunks (a ring exchange; the
    bulk overlaps of the column-parallel backward keep their GEMMs whole)."""
    if not d.overlap:
        return items
    out: list[Item] = []
    ring = False  # the data-gradient GEMM after it runs as a ring exchange of tp chunks
    for it, nxt in zip(items, [*items[1:], None], strict=True):
        if ring and isinstance(it, Op):
            if it.name.removesuffix("_dgrad") in UB_GEMMS:
                it = dataclasses.replace(it, splits=d.t)
            ring = False
        elif (isinstance(it, Comm) and _is_tp(it, "ALL_GATHER") and not it.overlapped
                and isinstance(nxt, Op) and nxt.kind == "gemm"):
            it, ring = dataclasses.replace(it, overlapped=True), True
        out.append(it)
    return out


def _insert_after_norm_bwd(items: list[Item], norm: str, d: Dims) -> list[Item]:
    """Place the input-gradient all-reduce just before the norm backward (non-SP TP)."""
    out: list[Item] = []
    for it in items:
        if isinstance(it, Op) and it.name == f"{norm}_bwd":
            out += tp_input_grad_allreduce(d, f"{norm}_in_grad_ar")
        out.append(it)
    return out


def selective_recompute(m: ModelSpec, st: Strategy, modules: tuple[str, ...] = ("core_attn",),
                        layer: list[Item] | None = None) -> list[Item]:
    """What selective recompute runs again before a layer's backward, module by module
    (Megatron-Core ``--recompute-modules``; ``layer``: the layer's forward, ``layer_fwd``):

    * core_attn: the core attention (Korthikanti et al. 2022, §4.3); with context parallelism
      as the forward ran it, its K/V movement included (Transformer Engine's attention
      function holds the ring or the all-gather, so the checkpointed call runs them again);
    * layernorm: the two norms (their outputs are dropped and rebuilt);
    * mla_up_proj: multi-head latent attention's Q and K/V up-projections and rotary
      embedding, from the latents the checkpoint keeps (sequence-parallel: gathered again by
      the up-projections, Megatron-Core MLASelfAttention's CheckpointWithoutOutput, whose Q, K
      and V are freed after the core attention and rebuilt before its backward);
    * mlp: the dense MLP as the forward ran it from its input — the sequence-parallel gather,
      FC1, activation, FC2 and the reduce-scatter (all-reduce without SP), FP8 casts and TP
      overlap included (the checkpointed module holds its TP collectives);
    * moe: a MoE layer's MLP side as the forward ran it from its input — router, permutations,
      dispatch, experts, combine and shared experts, with their collectives (Megatron-Core's
      MoELayer checkpoints its whole forward when ``moe`` is named);
    * moe_act: the experts' activation (part of ``moe`` where both are named);
    * shared_experts: a MoE layer's shared experts from their input, with their own TP
      collectives where the experts are folded (part of ``moe`` where both are named)."""
    d = dims(m, st)
    fwd = layer if layer is not None else layer_fwd(m, st)
    out: list[Item] = []
    for module in modules:
        if module == "core_attn":
            out += _core_attention(m, st, d, m.num_attention_heads // d.t)
        elif module == "layernorm":
            out += [it for it in fwd if it.name in ("ln1", "ln2")]
        elif module == "mla_up_proj":
            out += [it for it in fwd if it.name in ("mla_latent_ag", "q_up", "kv_up", "rope")]
        elif (module == "mlp" and not m.is_moe) or (module == "moe" and m.is_moe):
            # a dense layer's MLP (a MoE model's first ones), a MoE layer's MLP side
            names = [it.name for it in fwd]
            out += fwd[names.index("ln2") + 1:names.index("resid2")]
        elif module == "moe_act" and "moe" not in modules:
            out += [it for it in fwd if it.name == "expert_act"]
        elif module == "shared_experts" and "moe" not in modules:
            out += [it for it in fwd if it.name.startswith("shared_")]
    return out


def _mtp_input_fwd(d: Dims) -> list[Item]:
    """What a multi-token-prediction module runs before its layer (Megatron-Core
    ``MultiTokenPredictionLayer``): the next tokens' embedding (the shared, vocab-parallel one),
    an RMSNorm of it and of the hidden state, their concatenation projected 2h → h by a
    column-parallel GEMM (its input gathered over the sequence shards under SP), whose output
    is gathered over TP (``all_gather_last_dim_from_tensor_parallel_region``) and sliced back
    to the sequence shards."""
    norm = d.tokens_sp * d.h
    items: list[Item] = [eltwise("mtp_embedding", d.tokens * d.h, reads=1, writes=1,
                                 flop_per_elem=0, kind="embedding")]
    items += _tp_comm(d, "mtp_embedding_rs", gather=False)
    items += [eltwise(f"mtp_{x}norm", norm, reads=1, writes=1, flop_per_elem=NORM_FLOP,
                      kind="norm") for x in "eh"]
    if d.t > 1 and d.sp:
        items.append(Comm("mtp_eh_ag", "tp", "ALL_GATHER", d.tokens * 2 * d.h * ACT_BYTES // d.t))
    items.append(gemm("mtp_eh_proj", d.tokens, d.h // d.t, 2 * d.h, d.dtype))
    if d.t > 1:
        items.append(Comm("mtp_eh_gather", "tp", "ALL_GATHER", d.tokens * d.h // d.t * ACT_BYTES))
    return items


def _mtp_input_bwd(d: Dims) -> list[Item]:
    """The backward of ``_mtp_input_fwd``: under SP the slice's gradient gathered over the
    sequence, the output gather's gradient reduce-scattered (``_reduce_scatter_along_last_dim``),
    the projection's input gathered again for its weight gradient and its gradient
    reduce-scattered back to the shards (without SP all-reduced); the norms' and the embedding's
    backward."""
    full, wide = d.tokens * d.h * ACT_BYTES, d.tokens * 2 * d.h * ACT_BYTES
    items: list[Item] = []
    if d.t > 1:
        if d.sp:
            items.append(Comm("mtp_eh_slice_bwd", "tp", "ALL_GATHER", full // d.t))
        items.append(Comm("mtp_eh_gather_bwd", "tp", "REDUCE_SCATTER", full))
        if d.sp:
            items.append(Comm("mtp_eh_in_ag", "tp", "ALL_GATHER", wide // d.t))
    items += gemm_bwd("mtp_eh_proj", d.tokens, d.h // d.t, 2 * d.h, d.dtype)
    if d.t > 1:
        items.append(Comm("mtp_eh_ag_bwd", "tp", "REDUCE_SCATTER", wide) if d.sp
                     else Comm("mtp_eh_in_grad_ar", "tp", "ALL_REDUCE", wide))
    items += [eltwise(f"mtp_{x}norm_bwd", d.tokens_sp * d.h, reads=2, writes=1,
                      flop_per_elem=2 * NORM_FLOP, kind="norm") for x in "he"]
    items += _tp_comm(d, "mtp_embedding_bwd_ag", gather=True)
    items.append(eltwise("mtp_embedding_bwd", d.tokens * d.h, reads=2, writes=1,
                         flop_per_elem=1, kind="embedding"))
    return items


def mtp_fwd(m: ModelSpec, st: Strategy) -> list[Item]:
    """One multi-token-prediction module (DeepSeek-V3 §2.2): its input (``_mtp_input_fwd``) and
    a transformer layer of the last layer's kind. Its pass of the shared output head runs with
    the model's: Megatron-Core concatenates the main and MTP hidden states along the sequence
    and runs the head and the losses over all of them (``head_fwd``)."""
    d = dims(m, st)
    return _fp8_layer(_mtp_input_fwd(d), d) + layer_fwd(m, st)


def mtp_bwd(m: ModelSpec, st: Strategy) -> list[Item]:
    d = dims(m, st)
    return layer_bwd(m, st) + _fp8_layer(_mtp_input_bwd(d), d)


def embedding_fwd(m: ModelSpec, st: Strategy) -> list[Item]:
    """Vocab-parallel embedding lookup + TP reduction (Shoeybi et al. 2019, §3)."""
    d = dims(m, st)
    items: list[Item] = [eltwise("embedding", d.tokens * d.h, reads=1, writes=1, flop_per_elem=0,
                                 kind="embedding")]
    items += _tp_comm(d, "embedding_rs", gather=False)
    return items


def embedding_bwd(m: ModelSpec, st: Strategy) -> list[Item]:
    d = dims(m, st)
    return [*_tp_comm(d, "embedding_bwd_ag", gather=True),
            eltwise("embedding_bwd", d.tokens * d.h, reads=2, writes=1, flop_per_elem=1,
                    kind="embedding")]


def _head_dims(m: ModelSpec, st: Strategy) -> Dims:
    """The output head's rows: the micro-batch's tokens, once more per multi-token-prediction
    module (Megatron-Core concatenates their hidden states with the model's along the
    sequence before the output layer; each module's final norm is counted here too)."""
    d = dims(m, st)
    return dataclasses.replace(d, b=d.b * (1 + m.mtp_layers)) if m.mtp_layers else d


def head_fwd(m: ModelSpec, st: Strategy) -> list[Item]:
    """Final norm, vocab-parallel LM head and cross-entropy. Megatron's vocab-parallel loss does
    three all-reduces of b·s fp32 values (max, target logit, sum of exps), counted as one."""
    d = _head_dims(m, st)
    v = m.vocab_size // d.t
    items: list[Item] = [eltwise("final_norm", d.tokens_sp * d.h, reads=1, writes=1,
                                 flop_per_elem=NORM_FLOP, kind="norm")]
    items += _tp_comm(d, "final_norm_ag", gather=True)
    items.append(gemm("lm_head", d.tokens, v, d.h, d.dtype16))
    fwd_bytes = CE_BYTES[st.cross_entropy_fusion][0]
    items.append(Op("cross_entropy", "loss", 5 * d.tokens * v, fwd_bytes * d.tokens * v))
    if d.t > 1:
        items.append(Comm("loss_ar", "tp", "ALL_REDUCE", 3 * d.tokens * 4))
    return items


def head_bwd(m: ModelSpec, st: Strategy) -> list[Item]:
    d = _head_dims(m, st)
    v = m.vocab_size // d.t
    bwd_bytes = CE_BYTES[st.cross_entropy_fusion][1]
    items: list[Item] = [Op("cross_entropy_bwd", "loss", 2 * d.tokens * v,
                            bwd_bytes * d.tokens * v)]
    items += gemm_bwd("lm_head", d.tokens, v, d.h, d.dtype16)
    items += tp_input_grad_allreduce(d, "lm_head_in_grad_ar")
    if d.sp:  # the backward of the final norm's all-gather: a reduce-scatter of the gradient
        items += _bwd_comm(Comm("final_norm_ag", "tp", "ALL_GATHER",
                                d.tokens * d.h * ACT_BYTES // d.t), d)
    items.append(eltwise("final_norm_bwd", d.tokens_sp * d.h, reads=2, writes=1,
                         flop_per_elem=2 * NORM_FLOP, kind="norm"))
    return items


def optimizer_step(params_local: int, bytes_per_param: int = ADAM_BYTES_PER_PARAM) -> Op:
    """Mixed-precision Adam over this rank's parameter shard (memory-bound);
    ``bytes_per_param``: ``adam_bytes_per_param`` of the strategy."""
    return Op("adam_step", "optimizer", ADAM_FLOP_PER_PARAM * params_local,
              bytes_per_param * params_local)


def offloaded_shares(s: Strategy, params_local: int) -> tuple[int, int]:
    """(parameters the GPU's Adam updates, parameters the CPU's does) of a rank's shard of
    ``params_local`` under ``optimizer_offload_fraction`` (HybridDeviceOptimizer offloads
    tensors until the fraction is reached; counted here as the fraction itself)."""
    on_cpu = round(params_local * s.optimizer_offload_fraction)
    return params_local - on_cpu, on_cpu


def gpu_optimizer_step(s: Strategy, params_local: int) -> Op:
    """The GPU's optimizer step over a rank's shard: Adam over the share it keeps, the norm
    pass and master-to-weight copy over the share the CPU updates."""
    on_gpu, on_cpu = offloaded_shares(s, params_local)
    return Op("adam_step", "optimizer", ADAM_FLOP_PER_PARAM * on_gpu,
              adam_bytes_per_param(s) * on_gpu + OFFLOADED_GPU_BYTES_PER_PARAM * on_cpu)


def cpu_optimizer_step(params: int) -> Op:
    """PyTorch's CPU AdamW over ``params`` offloaded parameters (a host op, timed by the
    host's memory rate, ``NodeSpec.host_cpu_GBps``)."""
    return Op("cpu_adam_step", "optimizer", ADAM_FLOP_PER_PARAM * params,
              CPU_ADAM_BYTES_PER_PARAM * params, dtype="fp32")
