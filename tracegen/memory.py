"""Per-rank memory estimate: weights, gradients, optimizer state, activations, logits, and the
transient working set (ZeRO-3 gathered parameters, the layer a full recompute rebuilds).

Activation bytes per token of one layer follow Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", §4, eqs. 1-5): with TP degree t and no recompute
``s·b·h·(10 + 24/t + 5·a·s/(h·t))``, with sequence parallelism ``s·b·h·(34/t + 5·a·s/(h·t))``,
selective recompute drops the ``5·a·s/h`` term, full recompute keeps only the ``2·s·b·h`` layer
input. The 34 is generalised here to GQA and gated MLPs term by term (see ``_layer_terms``), and
with flash attention the ``5·a·s/h`` softmax/dropout term is not stored (Dao et al. 2022).
A model trained without dropout (``ModelSpec.dropout`` 0) keeps none of the three dropout masks
nor the attention-dropout output of those equations: ``10 → 8`` and ``5·a·s/h → 2·a·s/h``.

Transient working set (``transient_bytes``), at the backward peak:

* full recompute rebuilds one layer's activations from its checkpoint before that layer's backward,
  so one layer of one micro-batch is held in full besides every checkpoint (Chen et al. 2016,
  "Training Deep Nets with Sublinear Memory Cost", §3: checkpoints plus one segment); selective
  recompute of modules beyond the core attention likewise holds what they rebuild for one layer;
* ZeRO-3 / FSDP holds the unsharded 16-bit parameters of the unit it computes and of the next one,
  whose all-gather is prefetched ("the next all-gather's output tensor must be allocated while the
  current one is still in use", PyTorch FSDP notes, "FSDP Prefetch Nuances"), plus the unit's
  unsharded gradient until it is reduce-scattered. The unit is sized as the largest single weight
  (``unit_params``): a lower bound, since FSDP wrapped per layer holds a whole layer.

State under ZeRO-3 is FSDP's: the sharded parameters stay in fp32 and serve as the optimizer's
master copy ("outside forward and backward, the sharded parameters are kept in full precision",
PyTorch ``MixedPrecision`` docs), so 4 (parameter) + 4 (gradient) + 8 (Adam m, v) = 16 bytes per
parameter, against Megatron's 2 + 4 + 12 = 18 with ZeRO 0-2. HFSDP (ZeRO-3 with the optimizer
also sharded across the instances, ``Strategy.hfsdp``) keeps Megatron-FSDP's two weight buffers:
16-bit weights sharded in the instance, fp32 master weights with the moments over dp·cp (its
``main_weight`` placement sharded on both data-parallel dimensions, ``weight`` on the inner
one).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from tracegen import ops as O
from tracegen.deepep_buffers import buffer_bytes as deepep_buffer_bytes
from tracegen.dp_comm import dp_group_size, shard_axis
from tracegen.mesh import embedding_partner
from tracegen.model import ModelSpec
from tracegen.ops import ACT_BYTES, MOMENT_BYTES, grad_reduce_bytes
from tracegen.program import RoleProgram
from tracegen.schedule import stage_order
from tracegen.strategy import Strategy
from tracegen.units import DTYPE_BYTES, LOW_PRECISION_GEMMS, GiB

# Mixed-precision Adam: fp32 master weight, momentum and variance (Rajbhandari et al. 2020, ZeRO
# §3: K = 12 bytes of optimizer state per parameter), fp32 main gradients (Megatron DDP grad buffer;
# 16-bit with --grad-reduce-in-bf16: ``grad_reduce_bytes``) and 16-bit weights.
WEIGHT_BYTES, OPTIM_BYTES = 2, 12
# Adam's moments in 16 or 8 bits (``Strategy.adam_moments_dtype``, Megatron-Core's precision-
# aware optimizer): m and v take 2 bytes each (bf16, fp16) or 1 (FP8), the fp32 master copy
# stays — 4 or 6 fewer per parameter (``precision_aware_saved_bytes``; the per-tensor fp32
# scales of narrow moments are a few bytes a tensor, not counted). With BF16 parameters the
# master copy itself shrinks to the 16-bit remainder below them: 2 more (``master_remainders``).
MASTER_REMAINDER_SAVED_BYTES = 2
# Optimizer offloading (``Strategy.optimizer_offload_fraction``): Megatron-Core's
# HybridDeviceOptimizer clones the offloaded share's fp32 master weights to host memory and keeps
# Adam's m and v there, while the distributed optimizer still holds its fp32 master shard on the
# GPU (it copies it into the 16-bit weights after each step): 8 of the 12 bytes leave the GPU.
# Megatron-Bridge measured 3.8 GB freed per quarter of Qwen3-30B-A3B's shard at tp 2, pp 2, ep 4
# on 16 H100s, 15.3 GB at all of it: 8 bytes × its 1.91 B-parameter shard (tests/test_optimizer_
# offload.py).
OFFLOADED_OPTIM_BYTES = 8
# What the offloaded share takes in host memory: HybridDeviceOptimizer
# (megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py) pins a host copy of each offloaded
# fp32 master parameter (``param.detach().cpu().pin_memory()``), a pinned buffer its fp32
# gradient is copied into before each step (``cpu_copy_map_grad``), and its CPU AdamW keeps m and
# v beside them: 4 + 4 + 4 + 4 bytes a parameter.
HOST_OPTIM_BYTES = 16
# FSDP (ZeRO-3): fp32 sharded parameter (the master copy), fp32 gradient shard, Adam m and v.
ZERO3_PARAM_BYTES, ZERO3_OPTIM_BYTES = 4, 8
# FP8 without FP8 parameters: Transformer Engine keeps each GEMM weight's quantized copies across
# a step's micro-batches — a row-wise one for the forward GEMM and a column-wise (transposed) one
# for the backward's dgrad (``get_weight_workspace(cache_name="weight")``, which Megatron-Core's
# TE layers request by passing ``is_first_microbatch`` unless ``disable_parameter_transpose_cache``
# is set): 1 + 1 bytes a parameter beside the 16-bit weight. With ``fp8_param_gather`` the FP8
# weight (and its transpose) is the parameter itself, the 2 bytes of WEIGHT_BYTES. NVFP4 keeps the
# same two copies at 0.5625 bytes each (Megatron-Bridge's NVFP4 recipe gathers 16-bit parameters).
FP8_WEIGHT_CACHE_BYTES = 2
NVFP4_WEIGHT_CACHE_BYTES = 2 * DTYPE_BYTES["nvfp4"]
# MXFP8 (``fp8_recipe = "mxfp8"``): an E8M0 scale byte a block of 32 beside each FP8 copy, in
# the cached weights and the inputs kept for the weight gradients (TE's MXFP8Tensor keeps its
# row- and column-wise scales with the data).
MXFP8_ELEMENT_BYTES = DTYPE_BYTES["mxfp8"]
# Runtime allowances: the CUDA context, cuBLAS/cuDNN and NCCL take ~1-2 GiB per process in
# PyTorch jobs (NCCL's default NCCL_BUFFSIZE is 4 MiB per channel and peer); the caching
# allocator's fragmentation is taken as 5% of the tensors it holds. Measured on an H200
# (bench/device/measure_memory.py, 2026-12-04; tests/test_memory_evidence.py): outside the
# allocator the context took 0.51 GiB, cuBLAS, cuBLASLt and cuDNN 0.17 more, a one-rank NCCL
# group 0.54 more — 1.23 GiB before any peer's channel buffers, which 1.5 GiB leaves ~0.27 for;
# a plain training loop's peak reserved was 3.5% above its peak allocated (0.7% with
# expandable_segments). 5% is kept: FSDP's per-layer gathers and frees fragment more than that
# loop, and MosaicML's automatically sized micro-batches land at 94-96% of memory with it.
RUNTIME_BYTES = 3 * 2**29  # 1.5 GiB
FRAGMENTATION = 0.05
LOGIT_BYTES, LOGIT_BYTES_TE = 4, 2  # a logit the loss keeps: fp32; with TE's cross-entropy 16-bit
# TP communication overlap (``Strategy.tp_comm_overlap``): Transformer Engine's userbuffers, as
# Megatron initialises them (``_initialize_tp_communicators``: ``initialize_ub`` with shape
# (seq·mbs / cp, hidden)). TE 2.x registers one communicator per overlapped GEMM of a layer —
# 4 ring-exchange all-gathers (qkv_fprop, fc1_fprop, proj_dgrad, fc2_dgrad), 2 pipelined
# reduce-scatters (proj_fprop, fc2_fprop), 4 bulk (the qkv and fc1 dgrad and wgrad), 2 external
# (proj_wgrad, fc2_wgrad) — each with a buffer of that whole shape, shared by every layer; under
# FP8 the 8 of ``layers_all_gather_overlap`` hold 1-byte elements (``fp8_buf``), the rest 16-bit.
# Registered communication memory, outside the caching allocator. (TE 1.x had the first 10.)
UB_BUFFERS, UB_FP8_BUFFERS = 12, 8


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryEstimate:
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    logits_bytes: int
    transient_bytes: int = 0  # ZeRO-3 gathered units, the layer a full recompute rebuilds
    runtime_bytes: int = 0  # CUDA context, workspaces, communication buffers (DeepEP's too)
    fragmentation_bytes: int = 0  # allocator allowance
    # host memory, not the GPU's (not in ``total_bytes``): what offloading keeps there
    host_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.gradients_bytes + self.optimizer_bytes
                + self.activations_bytes + self.logits_bytes + self.transient_bytes
                + self.runtime_bytes + self.fragmentation_bytes)

    def to_dict(self) -> dict[str, float]:
        d = {k.removesuffix("_bytes") + "_GiB": v / GiB
             for k, v in dataclasses.asdict(self).items()}
        d["total_GiB"] = self.total_bytes / GiB
        return d


def saved_gemm_input_bytes(s: Strategy) -> float:
    """Bytes an element of a linear layer's input that it keeps for its weight gradient: the
    quantized column-wise copy under FP8 (1) or NVFP4 (``DTYPE_BYTES``: 0.5625, the
    Hadamard-transformed copy Transformer Engine's NVFP4 recipe casts for the weight gradient),
    else the 16-bit input; MXFP8's with its block scales (``MXFP8_ELEMENT_BYTES``)."""
    if s.precision == "fp8" and s.fp8_recipe == "mxfp8":
        return MXFP8_ELEMENT_BYTES
    return DTYPE_BYTES[s.precision] if s.precision in LOW_PRECISION_GEMMS else 2


def _layer_terms(m: ModelSpec, gemm_in: float = 2) -> tuple[float, float]:
    """(replicated, tp-split) activation bytes per token per layer without recompute, before the
    attention-score term. For GPT shapes these are Korthikanti's 10 and 24 (times h); without
    dropout (``m.dropout`` 0) the two 1-byte dropout masks go, 8 and 24.

    Under FP8 a linear layer keeps the FP8 copy of its input for the weight gradient, 1 byte per
    element, instead of the 16-bit input (Transformer Engine: ``Linear`` saves the quantized
    input, ``LayerNormLinear`` its quantized ``ln_out``, column-wise usage only): the inputs of
    QKV, FC1 and FC2 shrink to 1 byte; the output projection's input is also the attention's
    output, which the attention keeps in 16 bits for its own backward, so its FP8 copy adds 1.
    NVFP4 the same at 0.5625 bytes (``gemm_in``: ``saved_gemm_input_bytes``)."""
    h, kv, q = m.hidden_size, m.kv_size, m.q_size
    # a MoE layer's experts: the busiest rank's copies (``ModelSpec.moe_busiest_load``)
    f = (m.moe_ffn_hidden_size * m.experts_per_token * m.moe_busiest_load if m.is_moe
         else m.ffn_hidden_size)
    up = 2 if m.gated else 1
    masks = 2 * h if m.dropout else 0  # after attention and after the MLP, 1 byte each
    # LN1 in 2h, QKV in, LN2 in 2h, FC1 in, and the dropout masks.
    replicated = 2 * h + gemm_in * h + 2 * h + gemm_in * h + masks
    # Q 2q, K 2kv, V 2kv, attention out 2q (+ its FP8 copy), FC1 out 2·up·f, activation out
    # (q = h unless the model sets its own head_dim).
    out_proj_in = 2 * q + (q * gemm_in if gemm_in < 2 else 0)
    split = 2 * q + 4 * kv + out_proj_in + 2 * up * f + gemm_in * f
    if m.kv_lora_rank:  # MLA: the attention's terms as it keeps them (``_mla_terms``)
        rep_attn, split_attn = _mla_terms(m, gemm_in)
        replicated += rep_attn
        split += split_attn - (2 * q + 4 * kv + out_proj_in)
    fs = m.shared_expert_ffn_hidden_size  # the shared experts' FC1 and activation outputs
    return replicated, split + (2 * up * fs + gemm_in * fs if fs else 0)


def _mla_terms(m: ModelSpec, gemm_in: float) -> tuple[float, float]:
    """MLA's attention activations per token (replicated, tp-split) beyond LN1's input and the
    down-projections' (the QKV input of ``_layer_terms``): the latents' norm inputs (2 bytes
    each) and outputs, which the up-projections keep for their weight gradients (gemm_in), and
    the rotary key (2·rope) — on each rank's own tokens, so split only with SP; then Q and K
    (2·qk_head_dim per head each), V and the attention output (2·v_dim each, the output's FP8
    copy too), split over TP."""
    lat = m.q_lora_rank + m.kv_lora_rank
    replicated = (2 + gemm_in) * lat + 2 * m.qk_rope_head_dim
    heads, qk, v = m.num_attention_heads, m.qk_head_dim, m.v_dim
    split = heads * (4 * qk + 4 * v + (v * gemm_in if gemm_in < 2 else 0))
    return replicated, split


def activation_bytes_per_layer(m: ModelSpec, s: Strategy, *, flash_attention: bool = True) -> int:
    """Stored activation bytes of one layer for one micro-batch on one rank."""
    return _layer_activation_bytes(m, s, s.recompute, flash_attention)


def _layer_activation_bytes(m: ModelSpec, s: Strategy, recompute: str, flash_attention: bool
                            ) -> int:
    t, sp = s.tp, s.sequence_parallel
    tokens = s.micro_batch_size * m.seq_len // s.cp
    if recompute == "full":
        return 2 * tokens * m.hidden_size // (t if sp else 1)
    replicated, split = _layer_terms(m, saved_gemm_input_bytes(s))
    modules = s.recompute_modules if recompute == "selective" else ""  # names, comma-separated
    if modules and modules != "core_attn":
        replicated, split = _recomputed_terms(m, s, s.selective_modules, replicated, split)
    per_token = (replicated + split) / t if sp else replicated + split / t
    if m.is_moe and "moe" not in modules.split(","):
        per_token += _permuted_tokens_bytes(m, s)
    if not flash_attention and "core_attn" not in modules:
        # softmax out 2as, and with dropout its mask as and output 2as (Korthikanti §4.1)
        a, seq = m.num_attention_heads, m.seq_len
        per_token += (5 if m.dropout else 2) * a * seq / t
    return int(tokens * per_token)


def _recomputed_terms(m: ModelSpec, s: Strategy, modules: tuple[str, ...], replicated: float,
                      split: float) -> tuple[float, float]:
    """``_layer_terms`` less what the recomputed modules rebuild instead of keeping (Megatron-
    Core ``--recompute-modules``): layernorm the two norm outputs (the QKV and FC1 inputs), mlp
    FC1's output and the activation's (its input, the FC1 input, is the checkpoint), moe_act
    the experts' activation output, mla_up_proj MLA's Q, K and V (2·qk_head_dim per head for
    Q and for K, 2·v_dim for V: the attention output stays). core_attn keeps no term with
    flash attention and the score term without (``_layer_activation_bytes``). moe a MoE layer's
    whole MLP side but its input: the experts' FC1 and activation outputs, the shared experts'
    (the dispatched copies, ``_permuted_tokens_bytes``, go too); shared_experts the shared
    experts' FC1 and activation outputs."""
    gemm_in = saved_gemm_input_bytes(s)
    h = m.hidden_size
    f = (m.moe_ffn_hidden_size * m.experts_per_token * m.moe_busiest_load if m.is_moe
         else m.ffn_hidden_size)
    mlp = "mlp" in modules and not m.is_moe  # a dense layer's MLP (a MoE model's first ones)
    if "layernorm" in modules:
        replicated -= 2 * gemm_in * h
    if "mla_up_proj" in modules and m.is_mla:
        split -= m.num_attention_heads * (4 * m.qk_head_dim + 2 * m.v_dim)
    moe = "moe" in modules and m.is_moe
    if mlp or moe or ("moe_act" in modules and m.is_moe):
        split -= gemm_in * f
    if mlp or moe:
        split -= 2 * (2 if m.gated else 1) * f
    shared = moe or "shared_experts" in modules
    if shared and (fs := m.shared_expert_ffn_hidden_size):
        split -= 2 * (2 if m.gated else 1) * fs + gemm_in * fs
    return replicated, split


def _permuted_tokens_bytes(m: ModelSpec, s: Strategy) -> float:
    """Per token of the micro-batch: the dispatched copies of a MoE layer's input that its
    experts keep for their first GEMM's weight gradient, top-k of them (Megatron-Core's token
    dispatcher permutes the tokens, and the grouped expert GEMM saves its input like any
    linear layer: 1 byte under FP8, 0.5625 under NVFP4). Every TP rank dispatches all tokens
    to its slice of each expert; folded (``expert_tp`` 1), a rank dispatches its
    sequence-parallel share."""
    copies = (m.experts_per_token * m.moe_busiest_load * m.hidden_size
              * saved_gemm_input_bytes(s))
    return copies / s.tp if s.moe_folded else copies


def inflight_microbatches(s: Strategy, stage: int) -> float:
    """Micro-batches whose activations a stage holds at its peak, in units of the stage's layers.

    1F1B: stage i holds min(p - i, m) (Narayanan et al. 2021 §2.2.1). Interleaved: the warm-up
    count of virtual micro-batches + 1, each 1/v of the stage (Megatron schedules.py), with a
    micro-batch group of N (pp unless set) (p − i − 1)·2 + (v − 1)·N of them. GPipe: m.
    ZB-H1: min(p, m) on every stage (``schedule.zb_h1``: stage i's 1F1B count and the i
    micro-batches whose W it defers); the memory model charges the deferred ones what their W
    passes keep instead (``w_hold_bytes``, ``_peak_chunk_load``). ZB-V, DualPipe-V: the peak
    of its order's chunk passes between F and W, each half the stage.
    """
    m, p, v = s.num_microbatches, s.pp, s.vpp
    if s.schedule == "gpipe":
        return float(m)
    if s.schedule == "1f1b":
        return float(min(p - stage, m))
    if s.schedule == "zb_h1":
        return float(min(p, m))
    if s.split_w and v > 1:  # chunk passes from F to W at the peak of the order
        return _peak_chunk_load(s.order_id, m, p, v, stage, (1,) * v, (1,) * v) / v
    warm = min((p - stage - 1) * 2 + (v - 1) * (s.schedule_group or p) + 1, m * v)
    return warm / v


def _merges(s: Strategy, stage: int) -> bool:
    """Whether a stage runs any merged pass under combined 1F1B: at pp 1 with two or more
    micro-batches; interleaved, where its warm-up (one forward more than the interleaved
    one's) leaves some of the m·v virtual micro-batches for the steady state."""
    m, p, v = s.num_microbatches, s.pp, s.vpp
    if p == 1:
        return m > 1
    if s.schedule == "dualpipe_v":  # (every stage pairs at least one F1 with a B0)
        return True
    return (p - stage - 1) * 2 + (v - 1) * (s.schedule_group or p) + 1 < m * v


def _holds_dense(m: ModelSpec, s: Strategy, stage: int) -> bool:
    """Whether a stage holds any of a MoE model's dense first layers."""
    return any(m.dense_layers_in(s.chunk_layers(m.num_layers, s.gci(stage, ch)))
               for ch in range(s.vpp))


def _vocab_copies(m: ModelSpec, s: Strategy, stage: int) -> int:
    """Embedding-sized weights a stage holds (``RoleProgram.chunk_runs``): the embedding on the
    first chunk, the output head on the last (the embedding itself where tied on one chunk),
    the MTP modules' copy of the embedding off the first stage (untied)."""
    n_chunks = s.pp * s.vpp
    out = 0
    for ch in range(s.vpp):
        gci = s.gci(stage, ch)
        out += (gci == 0) + (gci == n_chunks - 1 and not (m.tied_embeddings
                                                         and s.head_stage == 0))
        if m.mtp_layers and gci == s.mtp_chunk and not m.tied_embeddings and (
                embedding_partner(m, s) is not None):
            out += 1
    return out


def fp8_weight_cache_bytes(m: ModelSpec, s: Strategy, stage: int, params_local: int,
                           fp8_any_layout: bool = False) -> int:
    """Transformer Engine's cached FP8 (or NVFP4) copies of a stage's GEMM weights
    (``FP8_WEIGHT_CACHE_BYTES``, ``NVFP4_WEIGHT_CACHE_BYTES`` a parameter): runs without FP8
    parameters, below ZeRO-3 (FSDP frees each gathered weight; the cache is not modelled
    there). The embedding and output head are not TE GEMMs (Megatron runs them in 16 bits);
    the router and the norms, a few parameters in a thousand, are counted with the GEMMs.
    ``fp8_any_layout`` (a GPU whose FP8 GEMMs take any layout, Blackwell: ``GPUSpec``): a
    per-tensor FP8 weight keeps no transposed copy, 1 byte a parameter (the quantizer's
    ``create_transpose``, ``tracegen.ops.FP8_CAST_BYTES_PER_ELEM``); a trace set's own
    estimate, which does not know its GPU, keeps Hopper's 2 and its manifest names the
    difference (``fp8_transpose_GiB``), which a replay on Blackwell takes off."""
    if s.precision not in LOW_PRECISION_GEMMS or s.fp8_param_gather or s.zero_stage >= 3:
        return 0
    gemm = params_local - _vocab_copies(m, s, stage) * (m.vocab_size * m.hidden_size // s.tp)
    if s.precision == "nvfp4":
        return int(NVFP4_WEIGHT_CACHE_BYTES * gemm)
    if s.fp8_recipe == "mxfp8":
        return int(2 * MXFP8_ELEMENT_BYTES * gemm)
    return (1 if fp8_any_layout else FP8_WEIGHT_CACHE_BYTES) * gemm


def _holds_moe(m: ModelSpec, s: Strategy, stage: int) -> bool:
    """Whether a stage runs any MoE layer: one past the dense first layers in a chunk, or the
    MTP modules (a layer of the last layer's kind)."""
    if m.mtp_layers and stage == s.chunk_stage(s.mtp_chunk):
        return True
    for ch in range(s.vpp):
        layers = s.chunk_layers(m.num_layers, s.gci(stage, ch))
        if len(layers) > m.dense_layers_in(layers):
            return True
    return False


def precision_aware_saved_bytes(s: Strategy) -> int:
    """Optimizer-state bytes a parameter that the precision-aware optimizer saves: 2 × (4 −
    width) for narrower Adam moments, and 2 more where it keeps the fp32 master weight as the
    16-bit remainder beside the BF16 parameter (``master_remainders``)."""
    saved = 2 * (4 - MOMENT_BYTES[s.adam_moments_dtype])
    return saved + MASTER_REMAINDER_SAVED_BYTES if master_remainders(s) else saved


def master_remainders(s: Strategy) -> bool:
    """Whether Megatron's distributed optimizer stores each fp32 master weight as the 16 bits
    its BF16 parameter lacks (``OptimizerConfig.store_param_remainders``, on by default, with
    Transformer Engine's FusedAdam ≥ 2.1): under the precision-aware optimizer (here: Adam's
    moments narrowed), BF16 parameters (not fp16, not FP8 parameters) and ZeRO 1 or 2
    (``DistributedOptimizer`` allocates the ``master_param`` shard as int16 when
    ``store_param_remainders and bf16``; Megatron-FSDP keeps its own fp32 main weights)."""
    return (s.adam_moments_dtype != "fp32" and s.zero_stage in (1, 2)
            and s.precision != "fp16" and not s.fp8_param_gather)


def runtime_bytes(m: ModelSpec, s: Strategy, stage: int) -> int:
    """Memory outside the caching allocator: the runtime allowance, TP communication overlap's
    userbuffers (``tp_overlap_buffer_bytes``), and on a stage that runs MoE layers through
    DeepEP the ``deep_ep.Buffer`` of its expert group (tracegen/deepep_buffers)."""
    out = RUNTIME_BYTES + tp_overlap_buffer_bytes(m, s)
    if s.moe_dispatcher != "deepep" or not m.is_moe or not _holds_moe(m, s, stage):
        return out
    return out + deepep_buffer_bytes(m.hidden_size, s.etp * s.ep)


def tp_overlap_buffer_bytes(m: ModelSpec, s: Strategy) -> int:
    """Transformer Engine's userbuffers for TP communication overlap (``UB_BUFFERS``): 0 without
    it (or at tp 1, where nothing is overlapped)."""
    if not s.tp_comm_overlap or s.tp == 1:
        return 0
    elems = s.micro_batch_size * m.seq_len // s.cp * m.hidden_size
    if s.precision == "fp8":
        return elems * (UB_FP8_BUFFERS + 2 * (UB_BUFFERS - UB_FP8_BUFFERS))
    return elems * 2 * UB_BUFFERS


def _chunk_activations(m: ModelSpec, s: Strategy, stage: int, act: int,
                       flash_attention: bool, hold_bytes: tuple[int, ...] | None = None) -> int:
    """Activations of a stage whose chunks hold unequal bytes: an interleaved end stage whose
    end chunk holds another number of layers than its other chunks (Llama 3's embedding-only
    first chunk), any stage of a pipeline layout, the stage with the MTP modules, or a stage
    holding a MoE model's dense first layers (``act`` is a MoE layer's). The peak over the
    schedule of Σ over chunks of micro-batches in flight × that chunk's bytes. Counting
    whole-stage units (``inflight_microbatches``) would charge the in-flight passes of a short
    chunk as if they held the stage's average, where the warm-up runs more passes through some
    chunks than others (N of each, then the next group's first chunk)."""
    n = s.recompute_num_layers
    kinds = {False: m, True: m.dense_view()} if m.has_dense_layers else {False: m}
    # per kind (dense?): (bytes of a layer recomputed as the strategy says, of one stored)
    per_layer = {}
    for dense, mk in kinds.items():
        rc = act if not dense else _layer_activation_bytes(mk, s, s.recompute, flash_attention)
        per_layer[dense] = (rc, _layer_activation_bytes(mk, s, "none", flash_attention)
                            if n else rc)
    per_chunk = []
    for ch in range(s.vpp):
        layers = s.chunk_layers(m.num_layers, s.gci(stage, ch))
        total = 0
        for i, layer in enumerate(layers):
            rc, kept = per_layer[m.has_dense_layers and m.is_dense_layer(layer)]
            total += kept if n and i >= n else rc
        per_chunk.append(total)
    if m.mtp_layers and stage == s.chunk_stage(s.mtp_chunk):  # the chunk with the MTP modules
        per_chunk[s.mtp_chunk // s.pp] += mtp_activation_bytes(m, s, flash_attention)
    hold = _w_hold(m, s, stage, hold_bytes) if s.split_w else ()
    return int(_peak_chunk_load(s.order_id, s.num_microbatches, s.pp, s.vpp, stage,
                                tuple(per_chunk), hold))


def offloaded_bytes(m: ModelSpec, s: Strategy, act: int, flash_attention: bool = True) -> int:
    """Activations activation offloading keeps off the GPU at the peak (the end of a forward,
    pp 1): the first ``cpu_offload_layers`` layers' but one, the copy Transformer Engine's
    double-buffered handler may still hold in flight (``act``: a layer's bytes; a MoE model's
    dense first layers keep their own)."""
    sizes = _offload_sizes(m, s, act, flash_attention)
    return sum(sizes) - max(sizes) if sizes else 0


def _offload_sizes(m: ModelSpec, s: Strategy, act: int, flash_attention: bool) -> list[int]:
    """The bytes of each layer activation offloading copies to host memory, a micro-batch."""
    n = s.cpu_offload_layers
    if not (m.is_moe and m.dense_layers_in(range(n))):
        return [act] * n
    dense_act = _layer_activation_bytes(m.dense_view(), s, s.recompute, flash_attention)
    return [dense_act if m.is_dense_layer(i) else act for i in range(n)]


def host_bytes(m: ModelSpec, s: Strategy, params_local: int, act: int, *,
               expert_params: int = 0, flash_attention: bool = True) -> int:
    """What one rank keeps in host memory at its peak (``MemoryEstimate.host_bytes``): the
    offloaded share of its optimizer shard at ``HOST_OPTIM_BYTES`` a parameter, and every
    offloaded layer's activations of the one micro-batch in flight (Transformer Engine's
    offload handler copies each into a host tensor of its own and frees it on the reload in
    the backward, so at the forward's end all are there at once)."""
    out = 0
    if s.optimizer_offload_fraction:  # (ZeRO 1/2, fp32 moments: ``Strategy``)
        shard = _sharded_bytes(s, params_local - expert_params, expert_params, OPTIM_BYTES)
        out += round(shard * s.optimizer_offload_fraction * HOST_OPTIM_BYTES / OPTIM_BYTES)
    if s.cpu_offload_layers:
        out += sum(_offload_sizes(m, s, act, flash_attention))
    return out


def host_peak_bytes(per_stage: Sequence[float], s: Strategy, host_gpus: int) -> float:
    """The most one host's ranks keep in host memory together: ``per_stage``, what a rank of
    each pipeline stage keeps (``host_bytes``); ranks in Megatron's order, a stage's tp·cp·dp
    ranks consecutive (``tracegen.mesh``), and ``host_gpus`` consecutive ranks a host."""
    per = s.world_size // s.pp
    if per % host_gpus == 0:  # each host within one stage
        return max(per_stage) * host_gpus
    best = 0.0
    for start in range(0, s.world_size, host_gpus):  # hosts across stage boundaries
        end, r, total = min(start + host_gpus, s.world_size), start, 0.0
        while r < end:
            nxt = min(end, (r // per + 1) * per)
            total += (nxt - r) * per_stage[r // per]
            r = nxt
        best = max(best, total)
    return best


def mtp_activation_bytes(m: ModelSpec, s: Strategy, flash_attention: bool = True) -> int:
    """What the multi-token-prediction modules keep for their backward, per micro-batch: each a
    layer of the last layer's kind under the strategy's recompute (``ParamBlock.recomputes``)
    and its input — the next tokens' embedding, the two normed halves the projection reads and
    the projection's output, 16-bit, on the sequence shards (Korthikanti et al.'s accounting
    of a layer's inputs); under full recompute only the module's input (the hidden state), as
    Megatron-Core checkpoints the whole module. Their logits count with the head's
    (``_parts``)."""
    layer = _layer_activation_bytes(m, s, s.recompute, flash_attention)
    if s.recompute == "full":
        return m.mtp_layers * layer
    tokens = s.micro_batch_size * m.seq_len // s.cp
    shards = s.tp if s.sequence_parallel else 1
    inputs = 4 * tokens * m.hidden_size * ACT_BYTES // shards
    return m.mtp_layers * (layer + inputs)


@functools.lru_cache(maxsize=4096)
def _peak_chunk_load(order_id: str, m: int, p: int, v: int, stage: int,
                     per_chunk: tuple[int, ...], hold: tuple[int, ...] = ()) -> int:
    """The largest Σ in-flight micro-batches × ``per_chunk`` bytes over the stage's schedule
    (``schedule.stage_order``): activations are held from a forward to its backward; under
    ZB-H1 and ZB-V a B pass frees them but for its W pass's operands, ``hold`` (per chunk),
    which the W frees. GPipe holds every micro-batch at its peak; the other schedules reach
    theirs in the warm-up and first steady rounds, after which the load repeats round by
    round, so a long run is walked as its first ``peak_walk_count`` micro-batches (a test
    holds the two equal past the cap; a run of 10⁸ micro-batches had walked every pass)."""
    if order_id == "gpipe" and len(per_chunk) == 1 and not hold:
        return m * per_chunk[0]
    return _walk_peak(order_id, peak_walk_count(order_id, m, p, v), p, v, stage, per_chunk,
                      hold)


def peak_walk_count(order_id: str, m: int, p: int, v: int) -> int:
    """The micro-batches ``_peak_chunk_load`` walks for a run of ``m``: all of them up to a
    cap of several warm-ups (4·v·(p + N) + 8, N the micro-batch group: the period of an
    interleaved order, else 1), past it the cap plus the remainder of m over the period, so
    that the last, partial group keeps its shape."""
    group = order_id.partition("+")[0].partition("/")[2]
    period = (int(group) if group else p) if order_id.startswith("interleaved") else 1
    cap = -(-(4 * v * (p + period) + 8) // period) * period
    return m if m <= cap else cap + (m - cap) % period


def _walk_peak(order_id: str, m: int, p: int, v: int, stage: int,
               per_chunk: tuple[int, ...], hold: tuple[int, ...] = ()) -> int:
    """``_peak_chunk_load``'s walk over every pass of the stage's order."""
    peak = load = 0
    for phase, _, ch in stage_order(order_id, m=m, p=p, v=v, stage=stage):
        if phase == "F":
            load += per_chunk[ch]
        elif phase == "B":
            load += (hold[ch] if hold else 0) - per_chunk[ch]
        else:
            load -= hold[ch]
        peak = max(peak, load)
    return peak


def estimate(m: ModelSpec, s: Strategy, stage: int, params_local: int,
             *, flash_attention: bool = True, act_per_layer: int | None = None,
             expert_params: int = 0, fp8_any_layout: bool = False) -> MemoryEstimate:
    """``act_per_layer``: ``activation_bytes_per_layer(m, s)`` where the caller has it.
    ``expert_params``: the part of ``params_local`` in MoE experts (sharded over the expert-
    data-parallel group, not the data-parallel one). ``flash_attention``, ``fp8_any_layout``:
    the GPU's, where the caller knows it."""
    if act_per_layer is None:
        act_per_layer = activation_bytes_per_layer(m, s, flash_attention=flash_attention)
    host = host_bytes(m, s, params_local, act_per_layer, expert_params=expert_params,
                      flash_attention=flash_attention)
    return MemoryEstimate(*_parts(m, s, stage, params_local, act_per_layer,
                                  flash_attention=flash_attention, expert_params=expert_params,
                                  fp8_any_layout=fp8_any_layout),
                          host_bytes=host)


def total_bytes(m: ModelSpec, s: Strategy, stage: int, params_local: int, *, act_per_layer: int,
                flash_attention: bool = True, layers: int | None = None,
                expert_params: int = 0, hold_bytes: tuple[int, ...] | None = None,
                fp8_any_layout: bool = False) -> int:
    """``estimate(...).total_bytes`` without building the breakdown (screening many).
    ``layers``: the stage's layer count where the caller has it; ``hold_bytes`` (ZB-H1, ZB-V:
    per chunk) too."""
    return sum(_parts(m, s, stage, params_local, act_per_layer, flash_attention=flash_attention,
                      layers=layers, expert_params=expert_params, hold_bytes=hold_bytes,
                      fp8_any_layout=fp8_any_layout))


def _sharded_bytes(s: Strategy, dense: int, expert: int, per_param: int) -> int:
    """``per_param`` bytes of state per parameter, each group's share: dense parameters over
    dp·cp, expert ones over the expert-data-parallel group (Megatron's distributed optimizer
    and FSDP shard each over the ranks that reduce its gradient: ``dp_group_size``) — over an
    optimizer instance of each where there are several (``shard_axis``)."""
    out = -(-dense * per_param // dp_group_size(s, shard_axis(s, "dp")))
    if expert:
        out += -(-expert * per_param // dp_group_size(s, shard_axis(s, "edp")))
    return out


def checkpoint_held_bytes(s: Strategy, params_local: int, expert_params: int = 0
                          ) -> tuple[int, int]:
    """What one rank holds of a checkpoint (``WEIGHT_BYTES`` + ``OPTIM_BYTES`` a parameter:
    the 16-bit weights, the fp32 master weights and Adam's two moments; Rajbhandari et al.
    2020 §3), as (on the GPU, in host memory): each part sharded as the strategy keeps it —
    the weights over the data-parallel group only under ZeRO-3, the fp32 state under ZeRO ≥ 1
    (Megatron's distributed optimizer, FSDP; experts over their own group,
    ``_sharded_bytes``) — and the offloaded optimizer share's state already in host memory.
    ``params_local``: the rank's stage's parameters before sharding."""
    dense = params_local - expert_params
    weights = (_sharded_bytes(s, dense, expert_params, WEIGHT_BYTES) if s.zero_stage >= 3
               else params_local * WEIGHT_BYTES)
    state = (_sharded_bytes(s, dense, expert_params, OPTIM_BYTES) if s.zero_stage
             else params_local * OPTIM_BYTES)
    return _on_gpu_and_host(s, weights, state)


def checkpoint_written_bytes(s: Strategy, params_local: int, expert_params: int = 0
                             ) -> tuple[int, int]:
    """What one rank writes of a checkpoint under a fully parallel save, as (on the GPU, in
    host memory) like ``checkpoint_held_bytes``: each tensor is written once, by one of the
    ranks that hold a copy, the writes spread evenly over them (Megatron-Core's default
    ``--ckpt-fully-parallel-save``: ``FullyParallelSaveStrategyWrapper`` over the data-parallel
    group with context parallelism, ``distribute_shards_to_ranks`` giving each shard to the
    least loaded of its holders; its async writer stages only those items,
    ``FileSystemWriterAsync.prepare_write_data``). So the stage's weights and optimizer state
    divide over dp·cp whatever the ZeRO stage (experts over their expert-data-parallel group),
    every rank writing the same share up to one tensor (the greedy's granularity, not
    modelled)."""
    dense = params_local - expert_params

    def spread(per_param: int) -> int:
        out = -(-dense * per_param // dp_group_size(s, "dp"))
        return out + (-(-expert_params * per_param // dp_group_size(s, "edp"))
                      if expert_params else 0)

    return _on_gpu_and_host(s, spread(WEIGHT_BYTES), spread(OPTIM_BYTES))


def _on_gpu_and_host(s: Strategy, weights: int, state: int) -> tuple[int, int]:
    """A checkpoint share's bytes split by where they live: the offloaded optimizer share's
    state is already in host memory (``optimizer_offload_fraction``), the rest on the GPU."""
    on_host = round(state * s.optimizer_offload_fraction)
    return weights + state - on_host, on_host


def unit_params(m: ModelSpec, s: Strategy, stage: int) -> int:
    """Parameters on one rank of the largest weight ZeRO-3 gathers whole on ``stage``: the QKV,
    output, or (fused) MLP projection — a MoE layer's local experts together — or the embedding /
    LM head (or the MTP modules' copy of the embedding) where the stage holds them. One weight,
    not one layer: the finest granularity a ZeRO-3 implementation gathers at (DeepSpeed
    partitions and gathers parameter by parameter; FSDP units are at least one module), so the
    transient it sizes is a lower bound (DESIGN.md)."""
    h, f = m.hidden_size, m.moe_ffn_hidden_size if m.is_moe else m.ffn_hidden_size
    up = 2 if m.gated else 1
    experts = m.num_experts // s.ep if m.is_moe else 1
    attn = (max(m.mla_up_params() // s.tp, m.mla_down_params()) if m.kv_lora_rank
            else h * (m.q_size + 2 * m.kv_size) // s.tp)
    unit = max(attn, experts * up * h * f // (s.etp if m.is_moe else s.tp))
    if stage in (0, s.head_stage) or stage == embedding_partner(m, s):  # (the MTP modules')
        unit = max(unit, m.vocab_size * h // s.tp)
    return unit


def transient_bytes(m: ModelSpec, s: Strategy, stage: int, *, flash_attention: bool = True
                    ) -> int:
    """The working set at the backward peak (module docstring)."""
    out = 0
    if s.recompute == "full":
        out += _layer_activation_bytes(m, s, "none", flash_attention)
    elif s.recompute_modules != "core_attn" and s.recompute == "selective":
        # what the modules rebuild, held for one layer of one micro-batch (as full recompute's
        # one layer)
        out += (_layer_activation_bytes(m, s, "none", flash_attention)
                - _layer_activation_bytes(m, s, "selective", flash_attention))
    if s.zero_stage >= 3 and s.dp * s.cp // s.dist_opt_instances > 1:
        # the gathered unit and its gradient before the reduce-scatter (in the reduce dtype)
        out += unit_params(m, s, stage) * (2 * WEIGHT_BYTES + grad_reduce_bytes(s))
    return out


def w_hold_bytes(m: ModelSpec, s: Strategy, stage: int) -> tuple[int, ...]:
    """ZB-H1, ZB-V: what one micro-batch's deferred W pass keeps on ``stage`` after its B pass
    frees the rest, per chunk (``ops.weight_grad_operand_bytes`` over the chunk's blocks)."""
    prog = RoleProgram(m, s, stage)
    return tuple(sum(count * O.weight_grad_operand_bytes(prog.block_items(block, "w"))
                     for block, count in prog.chunk_runs(s.gci(stage, ch)))
                 for ch in range(s.vpp))


def _w_hold(m: ModelSpec, s: Strategy, stage: int, given: tuple[int, ...] | None
            ) -> tuple[int, ...]:
    return w_hold_bytes(m, s, stage) if given is None else given


def _parts(m: ModelSpec, s: Strategy, stage: int, params_local: int, act: int, *,
           flash_attention: bool, layers: int | None = None, expert_params: int = 0,
           hold_bytes: tuple[int, ...] | None = None, fp8_any_layout: bool = False
           ) -> tuple[int, int, int, int, int, int, int, int]:
    """The fields of ``MemoryEstimate`` in order. ``hold_bytes``: ``w_hold_bytes`` where the
    caller has it (read only under ZB-H1 and ZB-V); ``fp8_any_layout``: the GPU's
    (``fp8_weight_cache_bytes``)."""
    weights, grads, optim = _state_bytes(m, s, stage, params_local, expert_params,
                                         fp8_any_layout)
    activations = _activation_bytes(m, s, stage, act, flash_attention, layers, hold_bytes)
    logits = _logit_bytes(m, s) if stage == s.head_stage else 0
    transient = transient_bytes(m, s, stage, flash_attention=flash_attention)
    tensors = weights + grads + optim + activations + logits + transient
    runtime = (RUNTIME_BYTES if s.moe_dispatcher == "alltoall" and not s.tp_comm_overlap
               else runtime_bytes(m, s, stage))
    return (weights, grads, optim, activations, logits, transient, runtime,
            int(tensors * FRAGMENTATION))


def _state_bytes(m: ModelSpec, s: Strategy, stage: int, params_local: int,
                 expert_params: int, fp8_any_layout: bool) -> tuple[int, int, int]:
    """A stage's weights, gradients and optimizer state on a rank, each as its ZeRO stage
    shards it (expert parameters over their own data-parallel group: ``_sharded_bytes``), less
    the optimizer state offloaded to the host."""
    grads = params_local * grad_reduce_bytes(s)
    optim = params_local * OPTIM_BYTES
    weights = params_local * WEIGHT_BYTES
    if s.precision in LOW_PRECISION_GEMMS:
        weights += fp8_weight_cache_bytes(m, s, stage, params_local, fp8_any_layout)
    if s.zero_stage:
        # (narrow moments need ZeRO ≥ 1: ``Strategy``; fp32 ones save nothing, the common
        # case a screen meets, so it is tested inline)
        # (FSDP's fp32 parameter shard is the master copy; HFSDP keeps its own, in OPTIM_BYTES)
        optim_per_param = ((ZERO3_OPTIM_BYTES if s.zero_stage == 3 and not s.hfsdp
                            else OPTIM_BYTES)
                           - (precision_aware_saved_bytes(s)
                              if s.adam_moments_dtype != "fp32" else 0))
    if s.zero_stage and expert_params:
        dense = params_local - expert_params
        optim = _sharded_bytes(s, dense, expert_params, optim_per_param)
        if s.zero_stage >= 2:
            grads = _sharded_bytes(s, dense, expert_params, grad_reduce_bytes(s))
        if s.zero_stage >= 3:
            weights = _sharded_bytes(s, dense, expert_params, ZERO3_PARAM_BYTES)
    elif s.zero_stage:  # dense parameters only: one group, dp·cp (the screening common case)
        dp_shard = s.dp * s.cp // s.dist_opt_instances  # (an instance of the optimizer)
        optim = -(-params_local * optim_per_param // dp_shard)
        if s.zero_stage >= 2:
            grads = -(-grads // dp_shard)
        if s.zero_stage >= 3 and s.hfsdp:
            # 16-bit weights in the instance, fp32 master weights and moments over dp·cp
            optim = -(-params_local * optim_per_param // (s.dp * s.cp))
            weights = -(-params_local * WEIGHT_BYTES // dp_shard)
        elif s.zero_stage >= 3:
            weights = -(-params_local * ZERO3_PARAM_BYTES // dp_shard)
    if s.optimizer_offload_fraction:  # (ZeRO 1/2, fp32 moments: ``Strategy``)
        optim -= round(optim * s.optimizer_offload_fraction * OFFLOADED_OPTIM_BYTES
                       / OPTIM_BYTES)
    return weights, grads, optim


def _activation_bytes(m: ModelSpec, s: Strategy, stage: int, act: int, flash_attention: bool,
                      layers: int | None, hold_bytes: tuple[int, ...] | None) -> int:
    """The activations a stage holds at its peak: ``act`` a layer and micro-batch times the
    micro-batches the schedule keeps in flight — walked chunk by chunk where its chunks
    differ (``_chunk_activations``) — less what is offloaded, plus combined 1F1B's layer."""
    if (s.vpp > 1 and (s.split_w or (s.uneven and stage in (0, s.pp - 1)))) or (
            s.pipeline_layout) or (
            m.has_dense_layers and _holds_dense(m, s, stage)) or (
            m.mtp_layers and stage == s.chunk_stage(s.mtp_chunk)):
        activations = _chunk_activations(m, s, stage, act, flash_attention, hold_bytes)
    else:
        if layers is None:
            layers = s.stage_layers(m.num_layers, stage)
        # In-flight micro-batches are counted in units of the whole stage (all its chunks);
        # under full recompute of the first recompute_num_layers of each chunk the rest keep
        # everything.
        per_mb = act * layers
        if s.recompute_num_layers:
            stored = s.stored_layers(m.num_layers, stage)
            per_mb += stored * (_layer_activation_bytes(m, s, "none", flash_attention) - act)
        activations = int(per_mb * inflight_microbatches(s, stage))
        if s.schedule == "zb_h1":  # deferred W passes keep their operands (ZB-V: above)
            activations = _peak_chunk_load(s.order_id, s.num_microbatches, s.pp, 1, stage,
                                           (per_mb,), _w_hold(m, s, stage, hold_bytes))
    if s.cpu_offload_layers:  # (pp 1: the one micro-batch in flight)
        activations -= offloaded_bytes(m, s, act, flash_attention)
    if s.overlap_moe_ep_comm and _merges(s, stage):
        # combined 1F1B: at layer pair k the forward holds its chunk's layers 0..k and the
        # backward still its 0..L−1−k — one layer more than the chunk the backward frees
        # (``merged_plan.merged_plan``): 1F1B's one micro-batch at pp 1; interleaved, the warm-up
        # holds one virtual micro-batch more (``schedule.combined``), the same count as the
        # interleaved peak's, so again one layer more
        activations += act
    return activations


def _logit_bytes(m: ModelSpec, s: Strategy) -> int:
    """The logits the loss keeps for its backward on the head's stage, of the model's head and
    of each MTP module's pass of it: an fp32 softmax (unfused and Megatron's native fusion),
    or Transformer Engine's kernel's 16-bit logits, its gradient written in their place."""
    tokens = s.micro_batch_size * m.seq_len // s.cp
    width = LOGIT_BYTES_TE if s.cross_entropy_fusion == "te" else LOGIT_BYTES
    return tokens * m.vocab_size // s.tp * width * (1 + m.mtp_layers)
