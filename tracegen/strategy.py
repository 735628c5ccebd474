"""How a model is parallelised: degrees, batch split, schedule, recompute and sharding."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from tracegen._config import build, field_type_problems, load_mapping
from tracegen.errors import ConfigError, did_you_mean
from tracegen.layout import chunk_count_problem, parse_layout

Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v", "dualpipe_v",
                   "interleaved_zb"]
Recompute = Literal["none", "selective", "full"]
Precision = Literal["bf16", "fp16", "fp8", "nvfp4"]
CpCommType = Literal["p2p", "all_gather"]
CP_COMM_TYPES: tuple[str, ...] = ("p2p", "all_gather")
CpBalance = Literal["document", "sequence"]
CP_BALANCES: tuple[str, ...] = ("document", "sequence")
AdamMomentsDtype = Literal["fp32", "bf16", "fp16", "fp8"]
ADAM_MOMENTS_DTYPES: tuple[str, ...] = ("fp32", "bf16", "fp16", "fp8")
MoeDispatcher = Literal["alltoall", "deepep"]
MOE_DISPATCHERS: tuple[str, ...] = ("alltoall", "deepep")
OuterDpSharding = Literal["no_shard", "optim"]
CeFusion = Literal["none", "native", "te"]
Fp8Recipe = Literal["delayed", "tensorwise", "mxfp8"]
FP8_RECIPES: tuple[str, ...] = ("delayed", "tensorwise", "mxfp8")
CE_FUSIONS: tuple[str, ...] = ("none", "native", "te")
OUTER_DP_SHARDINGS: tuple[str, ...] = ("no_shard", "optim")
SCHEDULES: tuple[str, ...] = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v",
                               "dualpipe_v", "interleaved_zb")
# The schedules that run several model chunks a stage (``vpp`` > 1)
CHUNKED_SCHEDULES: tuple[str, ...] = ("interleaved_1f1b", "zb_v", "dualpipe_v",
                                      "interleaved_zb")
# The schedules that place two model chunks a stage in a V (``Strategy.v_shape``)
V_SCHEDULES: tuple[str, ...] = ("zb_v", "dualpipe_v")
RECOMPUTES: tuple[str, ...] = ("none", "selective", "full")
PRECISIONS: tuple[str, ...] = ("bf16", "fp16", "fp8", "nvfp4")
# Megatron-Core's --recompute-modules for selective recompute, in the order a layer runs them:
# the two norms, multi-head latent attention's up-projections, the core attention (the default),
# the dense MLP, the whole MoE layer, the MoE experts' activation, the shared experts.
RECOMPUTE_MODULES: tuple[str, ...] = ("layernorm", "mla_up_proj", "core_attn", "mlp", "moe",
                                      "moe_act", "shared_experts")
_CORE_ATTN = ("core_attn",)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Strategy:
    """Parallel layout of one training job. ``world_size = tp · cp · dp · pp``.

    Expert parallelism (``ep``) is carved out of data parallelism, as Megatron does — or, with
    ``expert_tp = 1``, folded over a stage's tp · cp · dp ranks (Megatron-Core MoE parallel
    folding).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    vpp: int = 1
    sequence_parallel: bool = False
    micro_batch_size: int = 1
    global_batch_size: int = 1
    schedule: Schedule = "1f1b"
    recompute: Recompute = "none"
    zero_stage: int = 0
    precision: Precision = "bf16"
    overlap_grad_reduce: bool = True
    # Megatron --tp-comm-overlap (Transformer Engine userbuffers): TP collectives of sequence
    # parallelism run alongside their GEMMs (tracegen/ops.py). Needs sequence_parallel.
    tp_comm_overlap: bool = False
    # Megatron --overlap-param-gather (distributed optimizer): the ZeRO-1/2 parameter all-gathers
    # of the update run during the next step's forward, each bucket's before its first layer,
    # instead of after the optimizer (tracegen/program.py). No effect at ZeRO 0 or 3.
    overlap_param_gather: bool = False
    # Uneven pipelines: layers of the first and last model chunk (= stage when vpp is 1), the
    # other chunks sharing the rest evenly (Megatron's --decoder-first/last-pipeline-num-layers;
    # with interleaving, its account-for-embedding/loss split). 0 = even split.
    first_stage_layers: int = 0
    last_stage_layers: int = 0
    dp_bucket_params: int = 40_000_000  # Megatron DDP default bucket (40M params)
    # ZeRO-3 parameter all-gathers in pieces of at most this many parameters; 0 = one gather per
    # block (a layer, the embedding, the head: PyTorch FSDP wrapped per layer). DESIGN.md.
    zero3_gather_bucket_params: int = 0
    # Megatron --grad-reduce-in-bf16: the data-parallel gradient buffer and its reduction in 16
    # bits instead of fp32 (Megatron's default for bf16 training, arguments.py), halving the
    # gradient collectives' bytes and the buffer's memory (tracegen/ops.py ``grad_reduce_bytes``).
    grad_reduce_in_bf16: bool = False
    # How context parallelism moves K and V (Megatron --cp-comm-type): "p2p", the ring that
    # passes each rank's K/V chunk on while attention runs on the one it holds (Megatron-Core's
    # default; Liu et al. 2023, ring attention), or "all_gather", K/V of the whole sequence
    # gathered before attention, its latency exposed (Llama 3, Dubey et al. 2024 §3.3.2).
    cp_comm_type: CpCommType = "p2p"
    # How context parallelism splits a packed sequence under a document mask
    # (``ModelSpec.document_mean_tokens``): "document", every document into 2·cp chunks, rank r
    # holding chunks r and 2·cp − 1 − r of each (Transformer Engine's THD format: balanced), or
    # "sequence", the packed sequence split so whole (Llama 3's context parallelism, Dubey et
    # al. 2024 §3.3.2): the ranks' shares then differ and each layer waits for the busiest
    # (WLB-LLM, Wang et al. OSDI 2025, its context-level imbalance; tracegen/documents.py
    # ``busiest_rank_factor``). No effect without a mask or at cp 1.
    cp_balance: CpBalance = "document"
    # Megatron --expert-tensor-parallel-size. 0 = tp (Megatron's default: experts TP-split like
    # the dense MLP, ep carved out of dp). 1 with tp·cp > 1 folds expert parallelism over the
    # stage's tp·cp·dp ranks instead (MoE Parallel Folding, Liu et al. 2025, arXiv:2504.14960,
    # Megatron-Core ≥ 0.10): whole experts per rank, EP groups of consecutive ranks, each rank
    # routing its own sequence-parallel tokens, no TP collectives around the MoE layer.
    expert_tp: int = 0
    # ZeRO-3 parameter prefetch (PyTorch FSDP's forward/backward prefetch, Megatron-FSDP): the
    # all-gathers of the next block are issued as the current block starts and run alongside
    # its compute (at most two blocks gathered); off, each block's gathers block the compute
    # chain (tracegen/program.py; DESIGN.md, "ZeRO-3 gathers block the compute chain").
    zero3_prefetch: bool = False
    # ZB-H1 / ZB-V with sequence parallelism: each W pass gathers the column-parallel GEMMs' inputs
    # again over the TP group instead of keeping them gathered from B (less memory, one more
    # all-gather per GEMM on the W pass's critical path)
    zb_w_regather: bool = False
    # Megatron-Core's --account-for-embedding-in-pipeline-split / --account-for-loss-in-
    # pipeline-split: the embedding (the loss) counts as one layer where the layers are split
    # over the pp · vpp model chunks, so the first (last) chunk holds one layer fewer than the
    # others — none where the others hold one: Llama 3 405B's 126 layers on pp 16 with an
    # interleaved schedule, "the first model chunk on the first stage has only the embedding,
    # and the last model chunk on the last stage has only output projection and loss
    # calculation" (Dubey et al. 2024 §3.3.2), i.e. vpp 8 with both set.
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False
    # Megatron-Core's microbatch_group_size_per_vp_stage (interleaved schedules): how many
    # micro-batches run through a chunk before the next chunk, N in [pp, m]; the last group
    # holds the rest, which must be 0 or at least pp. 0 = pp (the default). A group other than
    # pp lets m be any count a group fits (Llama 3's "tunable" N, Dubey et al. 2024 §3.3.2) and
    # holds (v − 1)·(N − pp) more virtual micro-batches in the warm-up (tracegen/schedule.py).
    microbatch_group_size: int = 0
    # Megatron --recompute-granularity full --recompute-method block --recompute-num-layers N:
    # in each model chunk (a stage, or a virtual stage when interleaved) the first N layers
    # recompute their forward in the backward and the others keep their activations (Megatron-
    # LM's TransformerBlock checkpoints layers below N; Korthikanti et al. 2022 §5 weigh the
    # trade). 0 = every layer (needs recompute "full" otherwise).
    recompute_num_layers: int = 0
    # Megatron-Core --cpu-offloading --cpu-offloading-num-layers N (Transformer Engine's CPU
    # offload context, activations only): the first N layers' saved activations go to host
    # memory after each layer's forward and come back ahead of its backward, on copy streams
    # over the GPU's host link (``NodeSpec.host_link_GBps``); Transformer Engine's double-
    # buffered handler lets a layer's forward run only once the copy of the layer before the
    # previous one is done, and prefetches a layer's reload during the backward of the layer
    # above. Megatron-Core's TransformerConfig allows it only with pp 1, no recomputation and
    # N below the layer count. 0 = none.
    cpu_offload_layers: int = 0
    # Megatron-Core --optimizer-cpu-offload --optimizer-offload-fraction F
    # --overlap-cpu-optimizer-d2h-h2d (``HybridDeviceOptimizer``, which needs the distributed
    # optimizer): the first F of the rank's optimizer shard is updated on the CPU — its fp32
    # gradients copied to host memory, PyTorch's CPU AdamW run there, the updated fp32 master
    # weights copied back, one parameter tensor after another so the copies and the CPU steps
    # pipeline — while the GPU's Adam updates the rest. Adam's moments of that share live in
    # host memory; the fp32 master stays on the GPU (the optimizer's CPU copy is a clone).
    # 0 = none.
    optimizer_offload_fraction: float = 0.0
    # Megatron-Core --recompute-granularity selective --recompute-modules: what selective
    # recompute runs again in the backward instead of keeping its activations, comma-separated
    # from RECOMPUTE_MODULES — "core_attn" (the default; Korthikanti et al. 2022 §4.3), "mlp"
    # (a dense MLP's FC1, activation and FC2 with their TP collectives, from its input),
    # "layernorm" (the two norms' outputs), "mla_up_proj" (multi-head latent attention's Q and
    # K/V up-projections with their rotary embedding, from the latents), "moe" (a MoE layer's
    # whole MLP side from its input: router, dispatch, experts, combine, shared experts),
    # "moe_act" (the experts' activation), "shared_experts" (a MoE layer's shared experts).
    # Kept in that order.
    recompute_modules: str = "core_attn"
    # How MoE tokens reach their experts' ranks: "alltoall", Megatron-Core's all-to-all token
    # dispatcher (the default; one copy per (token, expert) pair, over the flat all-to-all), or
    # "deepep", its flex dispatcher on DeepEP (--moe-token-dispatcher-type flex
    # --moe-enable-deepep; deepseek-ai/DeepEP): a token crosses the NICs once per destination
    # node and NVLink once per destination GPU (replay/network.py ``_deepep``).
    moe_dispatcher: MoeDispatcher = "alltoall"
    # Megatron-Core --moe-shared-expert-overlap: a MoE layer's shared experts run beside the
    # all-to-all dispatcher's dispatch (FC1, activation) and combine (FC2) instead of after the
    # routed experts (tracegen/ops.py ``_shared_beside_dispatch``). Needs shared experts,
    # expert parallelism and the all-to-all dispatcher.
    moe_shared_expert_overlap: bool = False
    # Megatron-Core --overlap-moe-expert-parallel-comm ("combined 1F1B", EP A2A overlap): in
    # the steady state one micro-batch's forward and the previous one's backward run as one
    # merged pass, layer by layer, each one's dispatch and combine all-to-alls beside the
    # other's compute (tracegen/program.py ``merged``; DeepSeek-V3 §3.2.1, Figure 4, pairs
    # the chunks the same way). Modelled without a pipeline (pp 1: Megatron's
    # combined_1f1b_schedule_for_no_pipelining) and on an interleaved one
    # (combined_1f1b_schedule_for_interleaved_pipelining); in BF16/FP16 or FP8. With schedule
    # dualpipe_v: torchtitan's DualPipeV overlap (its --parallelism.pipeline_parallel_expert_
    # parallel_overlap), each OVERLAP_F_B pair merged the same way.
    overlap_moe_ep_comm: bool = False
    # Megatron-Core --delay-wgrad-compute (with the above): inside a merged pass the layers'
    # weight-gradient GEMMs (attention's, the MLP's or experts', MTP's; not the router's) run
    # after the backward's next all-to-all is issued, so that all-to-all waits for the data
    # gradients only and runs beside them (``TransformerLayerSchedulePlan.run``: mlp.backward,
    # mlp.backward_dw, then moe_dispatch.backward; attn.backward_dw after the pair).
    delay_wgrad_compute: bool = False
    # Megatron-Core --pipeline-model-parallel-layout: what each model chunk holds, in its
    # syntax ("Et*3|(tt|)*29,m|L": DeepSeek-V3's embedding and 3 layers, 29 chunks of 2, its MTP
    # module alone, the loss alone; tracegen/layout.py). "" = split by the fields above. Lists
    # pp · vpp chunks; excludes first/last_stage_layers and the account_for_* flags.
    pipeline_layout: str = ""
    # Adam's moments (m and v) in "fp32" (the default), "bf16", "fp16" or "fp8": Megatron-Core's
    # precision-aware optimizer (--use-precision-aware-optimizer --exp-avg-dtype X
    # --exp-avg-sq-dtype X; OptimizerConfig.exp_avg_dtype / exp_avg_sq_dtype, Transformer
    # Engine's FusedAdam, FP8 as torch.uint8 with a scale a tensor), the fp32 master weights
    # kept: 4 (16-bit) or 6 (FP8) fewer bytes of state per parameter and 8 or 12 fewer moved by
    # the step (tracegen/memory.py, tracegen/ops.py ``adam_bytes_per_param``). It runs in the
    # distributed optimizer or Megatron-FSDP: needs zero_stage ≥ 1.
    adam_moments_dtype: AdamMomentsDtype = "fp32"
    # Megatron --fp8-param-gather: FP8 runs keep their GEMM weights as FP8 tensors and the
    # distributed optimizer all-gathers the updated parameters in 1 byte instead of 2 (Megatron-
    # Bridge's FP8 current-scaling recipe sets it: ``bf16_with_fp8_current_scaling_mixed``);
    # without it the 16-bit weights hold Transformer Engine's cached FP8 copies beside them
    # (tracegen/memory.py ``fp8_weight_cache_bytes``). Under ZeRO-3 (Megatron-FSDP, whose FP8
    # parameter groups live in 1-byte weight buffers: ``ddp_config.fp8_param_gather``) the
    # forward's and backward's gathers move 1 byte a parameter too. Needs precision "fp8" and
    # ZeRO ≥ 1.
    fp8_param_gather: bool = False
    # Megatron-Core --num-distributed-optimizer-instances R (the distributed optimizer's hybrid
    # sharding, as PyTorch HSDP does for the optimizer): the optimizer state (and ZeRO-2's
    # gradients) sharded over dp·cp / R ranks of the data-parallel group, replicated R times.
    # Each gradient bucket is reduce-scattered inside its instance, then its shard all-reduced
    # across the R instances, both on one communication stream (Megatron-Core
    # ``_ParamAndGradBucketGroup.start_grad_sync``); the parameters are all-gathered inside the
    # instance (tracegen/program.py ``_emit_bucket``). Under ZeRO-3 this is hybrid sharding
    # (HSDP; Megatron-FSDP --num-distributed-optimizer-instances with
    # --outer-dp-sharding-strategy no_shard): parameters, gradients and optimizer sharded over
    # the instance, each block's gradients reduce-scattered there every micro-batch and, on the
    # last micro-batch only, its shard all-reduced across the instances on a stream of its own
    # (``RoleProgram._grad_reduce``). Needs ZeRO ≥ 1 and no expert parallelism (Megatron-Core
    # asserts ep 1); 1 = one instance over the whole group.
    dist_opt_instances: int = 1
    # Megatron-FSDP --outer-dp-sharding-strategy (ZeRO-3 with several instances): "no_shard"
    # replicates parameters, gradients and optimizer across the instances (HSDP, above);
    # "optim" also shards the optimizer state across them (HFSDP, "fully-sharded optimizer
    # state": Megatron-FSDP's ``main_weight`` placement SHARD on the outer dimension, weights
    # and gradients still sharded over the instance alone), so on the last micro-batch each
    # block's shard is reduce-scattered across the instances instead of all-reduced, the
    # optimizer steps 1/instances of it, and each chunk's first forward of the next step
    # all-gathers the updated pieces across the instances before each block's inner gather
    # (``RoleProgram._zero3_gather``). Megatron-FSDP requires inner
    # optim_grads_params and more than one instance for it.
    outer_dp_sharding_strategy: OuterDpSharding = "no_shard"
    # ZeRO 0-2 gradients reduced in every micro-batch's backward, not once a step after the
    # last (Megatron's DDP and distributed optimizer). DeepSpeed's ZeRO-2 reduces each bucket as
    # it fills in every backward (``stage_1_and_2.py``: the gradient hooks, created where
    # ``partition_gradients or overlap_comm`` — stage 2, or stage 1 with overlap_comm — call
    # ``reduce_ipg_grads`` whatever the accumulation step: the partition kept is the
    # accumulator), PyTorch FSDP's SHARD_GRAD_OP and DDP outside ``no_sync`` do likewise: the
    # sharded gradient the memory model charges for ZeRO-2 is only consistent with it. With
    # overlap_grad_reduce each bucket goes on the data-parallel stream as it fills (DeepSpeed
    # ``overlap_comm``), without it each blocks the backward where it fills. The parameters are
    # still gathered once a step. With several optimizer instances each micro-batch's buckets
    # are reduce-scattered inside the instance and the shard all-reduced across them on the
    # last only (Megatron-FSDP's optim_grads under HSDP, as its ZeRO-3 does). Modelled without
    # overlap_param_gather and with the 1F1B, interleaved and GPipe schedules
    # (analysis/grad_stream.py walks it).
    grad_reduce_per_microbatch: bool = False
    # The cross-entropy's implementation (Megatron-Core --cross-entropy-loss-fusion and
    # --cross-entropy-fusion-impl): "none", the vocab-parallel loss of eager PyTorch ops
    # (Megatron-LM's default); "native", the same steps under its jit fuser
    # (``fusions/fused_cross_entropy.py``; Megatron-Bridge's and NeMo 2's GPT configs turn
    # the fusion on by default); "te", Transformer Engine's Triton kernels, which read the
    # 16-bit logits once forward and once backward, writing the gradient in their place (no
    # fp32 copy kept). Bytes and memory in ``tracegen/ops.py`` (``CE_BYTES``) and
    # ``tracegen/memory.py``.
    cross_entropy_fusion: CeFusion = "none"
    # FP8's scaling (Transformer Engine recipes; precision "fp8" only): "delayed" takes each
    # tensor's scale from its amax history (DelayedScaling, Megatron-LM's default); "tensorwise"
    # (Float8CurrentScaling, Megatron-Bridge's "FP8-CS" runs) computes the amax of the tensor
    # being cast first — a read of its 16 bits before the cast, except where a norm kernel
    # computed it while writing the norm's output (the QKV and FC1 inputs); both gather a
    # sequence-parallel GEMM input already in FP8, current scaling after an amax all-reduce
    # over TP. "mxfp8" (MXFP8BlockScaling, Megatron-Bridge's "FP8-MX"; Blackwell) scales each
    # block of 32 elements: no amax pass, 1/32 byte of scale an element, 16-bit gathers.
    # tracegen/ops.py.
    fp8_recipe: Fp8Recipe = "delayed"

    def __post_init__(self) -> None:
        problems = field_type_problems(self) or _degree_problems(self)
        if problems:
            raise ConfigError(problems, what="strategy")
        if self.recompute_modules != "core_attn":
            names = {x.strip() for x in self.recompute_modules.split(",")}
            canonical = ",".join(x for x in RECOMPUTE_MODULES if x in names)
            object.__setattr__(self, "recompute_modules", canonical)

    @property
    def selective_modules(self) -> tuple[str, ...]:
        """The modules selective recompute runs again (none without selective recompute)."""
        if self.recompute != "selective":
            return ()
        mods = self.recompute_modules
        return _CORE_ATTN if mods == "core_attn" else tuple(mods.split(","))

    @property
    def hfsdp(self) -> bool:
        """ZeRO-3 whose optimizer state is also sharded across the instances (HFSDP)."""
        return self.outer_dp_sharding_strategy == "optim"

    @property
    def moe_folded(self) -> bool:
        """Expert parallelism folded over tp·cp·dp (``expert_tp`` 1 where tp·cp > 1)."""
        return self.expert_tp == 1 and self.tp * self.cp > 1

    @property
    def edp(self) -> int:
        """Ranks that reduce an expert's gradient (the expert-data-parallel group): dp / ep × cp,
        or tp·cp·dp / ep with expert parallelism folded."""
        return (self.tp * self.cp * self.dp // self.ep if self.moe_folded
                else self.dp // self.ep * self.cp)

    @property
    def etp(self) -> int:
        """The tensor-parallel degree of the expert GEMMs."""
        return 1 if self.moe_folded else self.tp

    @property
    def uneven(self) -> bool:
        """The first or last model chunk holds another number of layers than the rest (or a
        layout says what each holds)."""
        return bool(self.first_stage_layers or self.last_stage_layers
                    or self.account_for_embedding_in_pipeline_split
                    or self.account_for_loss_in_pipeline_split or self.pipeline_layout)

    @property
    def mtp_chunk(self) -> int:
        """The global model chunk that runs the multi-token-prediction modules: the layout's
        ``m`` chunk, else the last (with the output head)."""
        if self.pipeline_layout:
            for gci, chunk in enumerate(parse_layout(self.pipeline_layout)):
                if chunk.mtp:
                    return gci
        return self.pp * self.vpp - 1

    @property
    def schedule_group(self) -> int:
        """The interleaved schedule's micro-batch group where it is not pp, else 0."""
        n = self.microbatch_group_size
        return 0 if n in (0, self.pp) else n

    @property
    def order_id(self) -> str:
        """What fixes each stage's order of passes with the counts: the schedule, ``/N`` for a
        micro-batch group N other than pp, and ``+a2a`` for combined 1F1B's extra warm-up
        forward on an interleaved pipeline, or DualPipe-V's merged pairs
        (``tracegen.schedule.stage_order``)."""
        group = self.schedule_group
        out = f"{self.schedule}/{group}" if group else self.schedule
        merged = self.overlap_moe_ep_comm and self.schedule in ("interleaved_1f1b",
                                                               "dualpipe_v")
        return out + "+a2a" if merged else out

    @property
    def v_shape(self) -> bool:
        """Whether the model chunks are placed in a V (ZB-V, DualPipe-V: stage i holds chunks
        i and 2p − 1 − i, so stage 0 holds the embedding and the output head)."""
        return self.schedule in V_SCHEDULES

    @property
    def split_w(self) -> bool:
        """Whether backward passes leave their weight-gradient GEMMs to W passes (ZB-H1, ZB-V,
        DualPipe-V — its full backwards are a B with its W at once —, interleaved ZB)."""
        return self.schedule in ("zb_h1", "interleaved_zb", *V_SCHEDULES)

    def gci(self, stage: int, chunk: int) -> int:
        """The global model chunk that ``stage`` runs as its local ``chunk``: chunk · pp + stage
        (Megatron's interleaving), or in a V the second chunk on the way back."""
        if self.v_shape and chunk:
            return 2 * self.pp - 1 - stage
        return chunk * self.pp + stage

    def chunk_stage(self, gci: int) -> int:
        """The pipeline stage that runs global model chunk ``gci`` (``gci``'s inverse)."""
        if self.v_shape and gci >= self.pp:
            return 2 * self.pp - 1 - gci
        return gci % self.pp

    @property
    def head_stage(self) -> int:
        """The stage with the last model chunk (the output head and the loss): ``chunk_stage``
        of it, spelled out (the memory model reads it per stage of every strategy)."""
        return 0 if self.v_shape else self.pp - 1

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per pipeline per step: global batch / (micro batch · dp)."""
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def chunk_layers(self, num_layers: int, gci: int) -> range:
        """Global layer indices of global model chunk ``gci`` (= chunk · pp + stage)."""
        n_chunks = self.pp * self.vpp
        if self.pipeline_layout:
            chunks = parse_layout(self.pipeline_layout)
            start = sum(c.layers for c in chunks[:gci])
            return range(start, start + chunks[gci].layers)
        if not self.uneven or n_chunks == 1:
            per = num_layers // n_chunks
            return range(gci * per, (gci + 1) * per)
        first, last = self._edge_layers(num_layers)
        middle = (num_layers - first - last) // max(n_chunks - 2, 1)
        if gci == 0:
            return range(0, first)
        if gci == n_chunks - 1:
            return range(num_layers - last, num_layers)
        start = first + (gci - 1) * middle
        return range(start, start + middle)

    def stage_layers(self, num_layers: int, stage: int) -> int:
        """Layers pipeline stage ``stage`` holds, over all its model chunks."""
        return sum(len(self.chunk_layers(num_layers, self.gci(stage, ch)))
                   for ch in range(self.vpp))

    def stored_layers(self, num_layers: int, stage: int) -> int:
        """Layers of pipeline stage ``stage`` that keep their activations under full recompute
        of the first ``recompute_num_layers`` of each chunk (0 without it)."""
        n = self.recompute_num_layers
        if not n:
            return 0
        return sum(max(0, len(self.chunk_layers(num_layers, self.gci(stage, ch))) - n)
                   for ch in range(self.vpp))

    def recomputed_layers(self, num_layers: int) -> int:
        """Layers whose forward full recompute runs again (all but the stored ones)."""
        if not self.recompute_num_layers:
            return num_layers
        return num_layers - sum(self.stored_layers(num_layers, st) for st in range(self.pp))

    def _edge_layers(self, num_layers: int) -> tuple[int, int]:
        emb = int(self.account_for_embedding_in_pipeline_split)
        loss = int(self.account_for_loss_in_pipeline_split)
        if emb or loss:  # Megatron-Core: the embedding / loss as one layer each in the split
            per = (num_layers + emb + loss) // (self.pp * self.vpp)
            return per - emb, per - loss
        rest = self.pp * self.vpp - 2
        first, last = self.first_stage_layers, self.last_stage_layers
        if first and last:
            return first, last
        if rest == 0:
            return (first, num_layers - first) if first else (num_layers - last, last)
        # Only one edge given: the other stages share the rest evenly with the other edge.
        given = first or last
        per = (num_layers - given) // (rest + 1)
        return (first, per) if first else (per, last)

    def label(self) -> str:
        s = f"tp{self.tp}-pp{self.pp}-dp{self.dp}"
        if self.cp > 1:
            s += f"-cp{self.cp}"
        if self.ep > 1:
            s += (f"-ep{self.ep}" + ("-etp1" if self.moe_folded else "")
                  + ("-deepep" if self.moe_dispatcher == "deepep" else "")
                  + ("-a2ao" if self.overlap_moe_ep_comm else "")
                  + ("-dw" if self.delay_wgrad_compute else ""))
        if self.vpp > 1:
            s += f"-vpp{self.vpp}"
        if self.schedule_group:
            s += f"-g{self.schedule_group}"
        if self.dist_opt_instances > 1:
            s += f"-doi{self.dist_opt_instances}"
        if self.hfsdp:
            s += "-hfsdp"
        if self.cross_entropy_fusion != "none":
            s += f"-ce{self.cross_entropy_fusion}"
        if self.precision == "fp8" and self.fp8_recipe != "delayed":
            s += f"-{self.fp8_recipe}"
        if self.cpu_offload_layers:
            s += f"-off{self.cpu_offload_layers}"
        if self.optimizer_offload_fraction:
            s += f"-optoff{self.optimizer_offload_fraction:g}"
        return s + f"-mbs{self.micro_batch_size}"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Strategy:
        return build(cls, dict(data), what="strategy")

    @classmethod
    def from_file(cls, path: str | Path) -> Strategy:
        return cls.from_dict(load_mapping(Path(path), what="strategy file"))


# The text fields a strategy picks from a list (a misspelt one is named with the nearest)
_CHOICES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("schedule", SCHEDULES), ("recompute", RECOMPUTES), ("precision", PRECISIONS),
    ("cp_comm_type", CP_COMM_TYPES), ("cp_balance", CP_BALANCES),
    ("moe_dispatcher", MOE_DISPATCHERS), ("adam_moments_dtype", ADAM_MOMENTS_DTYPES),
    ("fp8_recipe", FP8_RECIPES), ("cross_entropy_fusion", CE_FUSIONS))
_CHOICE_NOTES = {"fp8_recipe": "Transformer Engine's delayed or current per-tensor scaling, "
                                "or MXFP8 block scaling (Blackwell)",
                 "cross_entropy_fusion": "unfused, Megatron-Core's fused loss, Transformer "
                                         "Engine's"}
# Values a framework names that trainsim does not model, with the nearest it does
_CHOICE_NEAREST = {("moe_dispatcher", "hybridep"): "NVIDIA's HybridEP (the flex dispatcher's "
                   "other backend) is not modelled; 'deepep', hierarchical as it is (once per "
                   "destination node over the NICs, then NVLink), is the nearest",
                   ("moe_dispatcher", "flex"): "Megatron-Core's flex dispatcher runs DeepEP "
                   "or HybridEP: give 'deepep' (HybridEP is not modelled; DeepEP is the "
                   "nearest)",
                   # NVIDIA's cuBLAS 12.9 post (2025): block-scaled FP8 on Hopper 1.75× BF16
                   # on large matmuls; ANCHORS' MAMFs: FP8 1402.6 / BF16 794.5 = 1.77
                   ("fp8_recipe", "blockwise"): "Transformer Engine's Float8BlockScaling, "
                   "DeepSeek-V3's 1×128 activation and 128×128 weight scales, is not "
                   "modelled; 'delayed' is the nearest on Hopper: cuBLAS 12.9's block-scaled "
                   "FP8 GEMMs run 1.75× BF16 on large matmuls, as per-tensor FP8's best does "
                   "(1.77×), and a blockwise cast moves 4.06 bytes an element to delayed's 4"}


def _degree_problems(s: Strategy) -> list[str]:
    out: list[str] = []
    for name in ("tp", "pp", "dp", "cp", "ep", "vpp", "micro_batch_size", "global_batch_size",
                 "dp_bucket_params"):
        if getattr(s, name) < 1:
            out.append(f"{name} must be ≥ 1, got {getattr(s, name)}")
    for name, allowed in _CHOICES:
        value = getattr(s, name)
        if value not in allowed:
            what = f" ({_CHOICE_NOTES[name]})" if name in _CHOICE_NOTES else ""
            near = _CHOICE_NEAREST.get((name, str(value).lower()),
                                       did_you_mean(str(value), allowed).strip())
            out.append(f"{name} must be one of {', '.join(allowed)}{what}; got {value!r}"
                       + (f" ({near})" if near else ""))
    if s.adam_moments_dtype in ADAM_MOMENTS_DTYPES and s.adam_moments_dtype != "fp32" and (
            s.zero_stage == 0):
        out.append(f"adam_moments_dtype {s.adam_moments_dtype!r} (Megatron-Core's precision-"
                   "aware optimizer) runs in the distributed optimizer or Megatron-FSDP: set "
                   "zero_stage ≥ 1, or keep the moments in 'fp32'")
    if s.fp8_param_gather and not (s.precision == "fp8" and s.zero_stage >= 1):
        out.append("fp8_param_gather (Megatron --fp8-param-gather) all-gathers an FP8 run's "
                   "parameters in 1 byte (the distributed optimizer's or Megatron-FSDP's "
                   "gathers): it needs precision 'fp8' and zero_stage 1, 2 or 3 (got "
                   f"{s.precision!r}, ZeRO {s.zero_stage})")
    if s.zero_stage not in (0, 1, 2, 3):
        out.append(f"zero_stage must be 0, 1, 2 or 3; got {s.zero_stage}")
    if s.dist_opt_instances != 1:
        out += _instance_problems(s)
    if s.outer_dp_sharding_strategy not in OUTER_DP_SHARDINGS:
        out.append("outer_dp_sharding_strategy must be one of "
                   f"{', '.join(OUTER_DP_SHARDINGS)}; got {s.outer_dp_sharding_strategy!r}")
    elif s.hfsdp and (s.zero_stage != 3 or s.dist_opt_instances < 2):
        out.append("outer_dp_sharding_strategy 'optim' (HFSDP) shards the optimizer across "
                   "the replicas of hybrid sharding: it needs zero_stage 3 and "
                   "dist_opt_instances ≥ 2 (Megatron-FSDP's optim_grads_params with several "
                   f"instances); got ZeRO {s.zero_stage} with {s.dist_opt_instances} "
                   "instance(s) — set both, or use 'no_shard'")
    if s.zero3_gather_bucket_params < 0:
        out.append("zero3_gather_bucket_params must be ≥ 0 (0: one gather per block), got "
                   f"{s.zero3_gather_bucket_params}")
    if out:
        return out
    return _batch_problems(s) + _schedule_problems(s) + _layout_problems(s)


def _layout_problems(s: Strategy) -> list[str]:
    """A pipeline layout parses, lists pp · vpp chunks and is the only split given."""
    if not s.pipeline_layout:
        return []
    try:
        chunks = parse_layout(s.pipeline_layout)
    except ConfigError as exc:
        return list(exc.problems)
    out = []
    count = chunk_count_problem(chunks, s.pp, s.vpp)
    if count:
        out.append(count)
    if (s.first_stage_layers or s.last_stage_layers or s.account_for_embedding_in_pipeline_split
            or s.account_for_loss_in_pipeline_split):
        out.append("set pipeline_layout or first_stage_layers / last_stage_layers / the "
                   "account_for_*_in_pipeline_split flags, not both (each decides the split)")
    return out


def ruled_out(*, tp: int, pp: int, dp: int, vpp: int, micro_batch_size: int,
              global_batch_size: int, sequence_parallel: bool, tp_comm_overlap: bool,
              schedule: str) -> bool:
    """Whether these fields break one of the rules below that rule out most combinations of a
    sweep's space (batch split, interleaving, sequence parallelism, ZB-H1's and ZB-V's
    pipelines and chunks) —
    checked on plain values, so an enumeration skips them without building a ``Strategy`` and
    its error message. True
    only where ``Strategy`` would raise (a property test holds that); False says nothing."""
    per_step = micro_batch_size * dp
    if global_batch_size % per_step or (sequence_parallel and tp == 1) or (
            tp_comm_overlap and not sequence_parallel) or (
            vpp > 1 and schedule not in CHUNKED_SCHEDULES):
        return True
    if schedule == "zb_h1":
        return pp < 2 or tp_comm_overlap
    if schedule in V_SCHEDULES:
        return pp < 2 or vpp != 2 or tp_comm_overlap or (
            schedule == "dualpipe_v" and global_batch_size // per_step < 2 * pp)
    if schedule == "interleaved_zb":
        m = global_batch_size // per_step
        return pp < 2 or vpp < 2 or tp_comm_overlap or m % max(1, m // pp) != 0
    return schedule == "interleaved_1f1b" and (
        pp < 2 or vpp < 2 or (global_batch_size // per_step) % pp != 0)


# No training recipe found runs near this many micro-batches a step on one pipeline (NeMo's
# Llama 3.1 405B on one GB200 rack: 1,536; most run tens to hundreds): past it a global
# batch given in tokens rather than sequences is the likely slip, and the walks of the
# grouped and merged schedules, linear in the count, would take minutes to hours.
MAX_MICROBATCHES = 100_000


def _batch_problems(s: Strategy) -> list[str]:
    per_step = s.micro_batch_size * s.dp
    if s.global_batch_size // per_step > MAX_MICROBATCHES:
        return [f"global_batch_size {s.global_batch_size:,} makes "
                f"{s.global_batch_size // per_step:,} micro-batches a step on each pipeline, "
                f"more than {MAX_MICROBATCHES:,}: global_batch_size counts sequences, not "
                "tokens (divide a token count by the sequence length)"]
    if s.global_batch_size % per_step:
        lo = (s.global_batch_size // per_step) * per_step
        nearest = f"{lo} or {lo + per_step}" if lo else f"{per_step}"
        return [
            f"global_batch_size {s.global_batch_size} is not divisible by micro_batch_size · dp "
            f"= {s.micro_batch_size} · {s.dp} = {per_step}; use a multiple of {per_step} "
            f"(e.g. {nearest})"
        ]
    return []


def moe_instance_problems(s: Strategy) -> list[str]:
    """Several distributed-optimizer instances on a MoE model: the expert gradients split as
    the dense ones (Megatron-Core's intra- and inter-partial expert data-parallel groups,
    which assert the expert-data-parallel size divisible by the instances); under ZeRO-3 HSDP
    (each instance's expert shard all-reduced across them), not HFSDP."""
    r, edp = s.dist_opt_instances, s.edp
    out = []
    if s.zero_stage == 3 and s.hfsdp:
        out.append(f"dist_opt_instances {r} with outer_dp_sharding_strategy 'optim' (HFSDP) "
                   "and a mixture-of-experts model: sharding the experts' optimizer across "
                   "instances is not modelled; use outer_dp_sharding_strategy 'no_shard' "
                   "(HSDP)")
    if edp % r:
        fits = [d for d in divisors(edp) if d > 1 and (s.dp * s.cp) % d == 0]
        out.append(f"dist_opt_instances {r} must divide the expert-data-parallel group's "
                   f"{edp} ranks too (Megatron-Core asserts it)"
                   + (f"; choose among {fits}" if fits else "; use dist_opt_instances 1"))
    return out


def _instance_problems(s: Strategy) -> list[str]:
    """Megatron-Core's conditions on distributed-optimizer instances (``dist_opt_instances``)."""
    r = s.dist_opt_instances
    if r < 1:
        return [f"dist_opt_instances must be ≥ 1 (1: one optimizer instance over the whole "
                f"data-parallel group), got {r}"]
    out = []
    if s.zero_stage == 0:
        out.append(f"dist_opt_instances {r} shards the optimizer over part of the data-parallel "
                   "group: it needs zero_stage 1 or 2 (Megatron-Core's distributed optimizer) "
                   "or 3 (hybrid sharding, HSDP), not 0")
    ranks = s.dp * s.cp
    if ranks % r:
        fits = [d for d in divisors(ranks) if d > 1]
        out.append(f"dist_opt_instances {r} must divide the data-parallel group's dp·cp = "
                   f"{ranks} ranks (each instance shards over dp·cp / instances); "
                   + (f"choose among {fits}" if fits else "with dp·cp = 1 there is one "
                      "instance: use dist_opt_instances 1"))
    return out


def _group_problems(s: Strategy) -> list[str]:
    """Megatron-Core's checks on the interleaved schedule's micro-batch group (schedules.py,
    ``forward_backward_pipelining_with_interleaving``), each naming groups that would do."""
    m, p, n = s.num_microbatches, s.pp, s.microbatch_group_size
    if not n:
        if m % p:
            return [f"interleaved_1f1b needs the number of micro-batches ({m}) to be a "
                    f"multiple of pp ({p}) (Megatron's interleaved schedule); change "
                    "global_batch_size or micro_batch_size" + (
                        ", or set microbatch_group_size (Megatron-Core's microbatch_group_size_"
                        "per_vp_stage) to a group of micro-batches that leaves a last group of 0 "
                        f"or at least pp{_groups_that_fit(m, p)}" if m > p else "")]
        return []
    if m < p:
        return [f"microbatch_group_size needs at least pp ({p}) micro-batches, got {m}; "
                "raise global_batch_size or lower micro_batch_size"]
    if not p <= n <= m:
        return [f"microbatch_group_size {n} must lie in [pp, micro-batches] = [{p}, {m}] "
                f"(Megatron-Core's range for microbatch_group_size_per_vp_stage)"
                f"{_groups_that_fit(m, p)}"]
    if 0 < m % n < p:
        left = m % n
        return [f"microbatch_group_size {n} leaves a last group of {left} "
                f"micro-batch{'es' if left > 1 else ''} of {m}, fewer than pp ({p}), which "
                f"Megatron-Core refuses (the pipeline would stall){_groups_that_fit(m, p)}"]
    return []


def _groups_that_fit(m: int, p: int) -> str:
    """The hint of ``_group_problems``: the micro-batch groups Megatron-Core accepts."""
    fits = [g for g in range(p, m + 1) if not 0 < m % g < p]
    return f"; groups that fit: {', '.join(map(str, fits[:4]))}" + (
        f" … {fits[-1]}" if len(fits) > 4 else "")


def _zb_problems(s: Strategy) -> list[str]:
    """What ZB-H1, ZB-V and DualPipe-V (``tracegen.schedule.zb_h1``, ``zb_v``,
    ``dualpipe_v``) are modelled with: a pipeline (for ZB-V and DualPipe-V of two chunks a
    stage; DualPipe-V of at least 2p micro-batches, as PyTorch requires), and gradients that
    stay on their rank until the last W pass (ZeRO 0–2; ZeRO-3 reduce-scatters each block's
    gradients in every backward)."""
    out, name = [], s.schedule
    if s.pp < 2:
        out.append(f"{name} needs pp ≥ 2 (it fills pipeline bubbles), got pp={s.pp}; use "
                   "schedule '1f1b'")
    if name in V_SCHEDULES and s.vpp != 2:
        out.append(f"{name} runs two model chunks on each stage, placed in a V: set vpp = 2, "
                   f"got vpp={s.vpp}")
    elif name == "interleaved_zb":
        out += _interleaved_zb_problems(s)
    elif name == "dualpipe_v" and s.dp and s.micro_batch_size and (
            s.global_batch_size % (s.micro_batch_size * s.dp) == 0) and (
            s.num_microbatches < 2 * s.pp):
        out.append(f"dualpipe_v needs at least 2·pp = {2 * s.pp} micro-batches a step (PyTorch's "
                   f"ScheduleDualPipeV: as many as stages), got {s.num_microbatches}; raise the "
                   f"global batch to {2 * s.pp * s.micro_batch_size * s.dp} or more, or use "
                   "schedule 'zb_v'")
    if s.zero_stage == 3:
        out.append(f"{name} is modelled with ZeRO 0-2 (ZeRO-3 reduce-scatters each block's "
                   "gradients in every backward, before a deferred W pass has made them); set "
                   "zero_stage ≤ 2 or use schedule '1f1b'. FSDP under PyTorch's pipelining "
                   "(torchtitan) gathers each stage's parameters once a step and "
                   "reduce-scatters its gradients after its last backward (the runtime's "
                   "UNSHARD and REDUCE_GRAD actions): zero_stage 1 with overlap_param_gather "
                   "runs that pattern")
    if s.zb_w_regather and not s.sequence_parallel:
        out.append("zb_w_regather needs sequence_parallel = true (without it a GEMM's input is "
                   "whole on every TP rank: nothing to gather again); set it to false")
    if s.tp_comm_overlap:
        out.append(f"{name} is modelled without tp_comm_overlap (Transformer Engine overlaps "
                   "the backward's reduce-scatter with the weight-gradient GEMM that the "
                   "schedule defers); set tp_comm_overlap = false")
    return out


def _interleaved_zb_problems(s: Strategy) -> list[str]:
    """PyTorch's ScheduleInterleavedZeroBubble: chunks (vpp ≥ 2), and micro-batches in rounds
    of m // max(1, m // pp) that divide m ("Zero bubble requires the number of microbatches
    to be a multiple of the number of rounds")."""
    if s.vpp < 2:
        return [f"interleaved_zb runs several model chunks on each stage: set vpp ≥ 2, got "
                f"vpp={s.vpp} (or use schedule 'zb_h1')"]
    if not (s.dp and s.micro_batch_size) or s.global_batch_size % (s.micro_batch_size * s.dp):
        return []
    m = s.num_microbatches
    rounds = max(1, m // s.pp)
    if m % rounds:
        fits = [x for x in range(max(1, m - 2 * s.pp), m + 2 * s.pp + 1)
                if x % max(1, x // s.pp) == 0]
        return [f"interleaved_zb runs the micro-batches in {rounds} rounds of {m // rounds} "
                f"(PyTorch: a multiple of the number of rounds), and {m} does not split so; "
                f"micro-batch counts near it that do: {', '.join(map(str, fits[:6]))}"]
    return []


def _ep_overlap_problems(s: Strategy) -> list[str]:
    """What Megatron-Core's combined 1F1B (``overlap_moe_ep_comm``) is modelled with: expert
    parallelism, no pipeline or an interleaved one, what Megatron-Core's TransformerConfig
    asserts beside it (no shared-expert overlap, no "moe" recompute module; no full recompute,
    as it asserted until 2026; its "bf16 or fp16" is the parameters' dtype, under which FP8
    runs too), and no ZeRO-3 (not modelled with it here)."""
    out = []
    if s.ep < 2:
        out.append("overlap_moe_ep_comm overlaps expert-parallel all-to-alls: it needs ep > 1, "
                   f"got ep={s.ep}; raise ep or set overlap_moe_ep_comm = false")
    if s.schedule == "dualpipe_v":  # (torchtitan's DualPipeV overlap: ``dualpipe_v_units``)
        if s.delay_wgrad_compute:
            out.append("delay_wgrad_compute is Megatron-Core's combined 1F1B's; dualpipe_v's "
                       "paired passes run full backwards (torchtitan's overlap): set "
                       "delay_wgrad_compute = false")
    elif s.pp > 1 and s.schedule != "interleaved_1f1b":
        out.append(f"overlap_moe_ep_comm on a pipeline (pp={s.pp}) needs schedule "
                   f"'interleaved_1f1b' with vpp > 1 (Megatron-Core runs combined 1F1B on a "
                   f"pipeline only interleaved), got {s.schedule!r}; set vpp and the schedule, "
                   "use pp 1, or set overlap_moe_ep_comm = false")
    if s.pp == 1 and s.schedule != "1f1b":
        out.append(f"overlap_moe_ep_comm without a pipeline merges Megatron-Core's no-pipelining "
                   f"order (F, B, F, B, …): it needs schedule '1f1b', got {s.schedule!r}")
    # (Megatron-Core's TransformerConfig asserts no shared-expert overlap and no "moe" among
    # the recompute modules beside it — recomputing the MoE layer would run its dispatch
    # again —, and until 2026 no full recompute; its newer whole-chunk recompute path is not
    # modelled)
    moe_recompute = s.recompute == "selective" and "moe" in [
        x.strip() for x in s.recompute_modules.split(",")]
    for bad, what in ((s.recompute == "full", "full recompute (Megatron-Core refused it until "
                       "2026; its newer recompute of a whole model chunk, all-to-alls exposed, "
                       "is not modelled)"),
                      (moe_recompute, "recompute module 'moe' (Megatron-Core refuses it: the "
                       "recomputed MoE layer would dispatch again; recompute 'moe_act' instead)"),
                      (s.moe_shared_expert_overlap, "moe_shared_expert_overlap (Megatron-Core "
                       "refuses it)"),
                      (s.zero_stage == 3, "ZeRO-3 (not modelled with it)")):
        if bad:
            out.append(f"overlap_moe_ep_comm does not run with {what}; drop one of the two")
    return out


def _schedule_problems(s: Strategy) -> list[str]:
    out: list[str] = []
    if s.sequence_parallel and s.tp == 1:
        out.append("sequence_parallel needs tp > 1 (it splits norms and dropout across the TP "
                   "group); set tp > 1 or sequence_parallel = false")
    if s.tp_comm_overlap and not s.sequence_parallel:
        out.append("tp_comm_overlap needs sequence_parallel = true (Megatron overlaps the "
                   "sequence-parallel all-gather / reduce-scatter with the GEMMs); enable it or "
                   "set tp_comm_overlap = false")
    if s.vpp > 1 and s.schedule not in CHUNKED_SCHEDULES:
        out.append(f"vpp = {s.vpp} needs schedule 'interleaved_1f1b' or 'interleaved_zb' (or "
                   f"'zb_v' or 'dualpipe_v' with vpp 2), got {s.schedule!r}")
    if s.schedule == "interleaved_1f1b":
        if s.pp < 2 or s.vpp < 2:
            out.append(f"interleaved_1f1b needs pp ≥ 2 and vpp ≥ 2, got pp={s.pp} vpp={s.vpp}; "
                       "use schedule '1f1b' otherwise")
        elif s.global_batch_size % (s.micro_batch_size * s.dp) == 0:
            out += _group_problems(s)
    elif s.split_w:
        out += _zb_problems(s)
    if s.overlap_moe_ep_comm:
        out += _ep_overlap_problems(s)
    elif s.delay_wgrad_compute:  # (Megatron-Core's TransformerConfig asserts it)
        out.append("delay_wgrad_compute defers weight gradients inside combined 1F1B's merged "
                   "passes: it needs overlap_moe_ep_comm = true; set it or drop "
                   "delay_wgrad_compute")
    if s.zb_w_regather and not s.split_w:
        out.append(f"zb_w_regather needs schedule 'zb_h1', 'zb_v', 'dualpipe_v' or "
                   f"'interleaved_zb' (it is where their W "
                   f"passes get their inputs), got {s.schedule!r}; set it to false")
    if s.schedule != "interleaved_1f1b" and s.microbatch_group_size:
        out.append(f"microbatch_group_size needs schedule 'interleaved_1f1b' (it groups the "
                   f"micro-batches of an interleaved schedule), got {s.schedule!r}; set it "
                   "to 0")
    out += _module_problems(s)
    if s.recompute_num_layers < 0 or (s.recompute_num_layers and s.recompute != "full"):
        out.append(f"recompute_num_layers {s.recompute_num_layers} needs recompute 'full' and a "
                   "count ≥ 1 (the first that many layers of each model chunk recompute, as "
                   "Megatron's --recompute-method block does); set it to 0 for every layer, "
                   f"got recompute {s.recompute!r}")
    if s.grad_reduce_per_microbatch:
        out += _per_microbatch_problems(s)
    if s.cpu_offload_layers:
        out += _offload_problems(s)
    if s.optimizer_offload_fraction:
        out += _optimizer_offload_problems(s)
    if s.zero3_prefetch and s.zero_stage != 3:
        out.append(f"zero3_prefetch needs zero_stage 3 (it prefetches ZeRO-3's parameter "
                   f"gathers), got zero_stage {s.zero_stage}")
    return out + _expert_problems(s)


def _optimizer_offload_problems(s: Strategy) -> list[str]:
    """What optimizer offloading (``optimizer_offload_fraction``) needs, each with its fix."""
    f = s.optimizer_offload_fraction
    if not 0.0 < f <= 1.0:
        return [f"optimizer_offload_fraction is the share of the optimizer state on the CPU, "
                f"in (0, 1], got {f:g}; 0 turns it off"]
    out: list[str] = []
    if s.zero_stage not in (1, 2):
        out.append(f"optimizer_offload_fraction needs the distributed optimizer, zero_stage 1 or "
                   f"2 (Megatron-Core's --optimizer-cpu-offload requires "
                   f"--use-distributed-optimizer; ZeRO-3's offload is not modelled), got "
                   f"zero_stage {s.zero_stage}")
    if s.adam_moments_dtype != "fp32":
        out.append(f"optimizer_offload_fraction keeps the offloaded moments in fp32 (Megatron-"
                   f"Core's HybridDeviceOptimizer updates in fp32); with adam_moments_dtype "
                   f"{s.adam_moments_dtype!r} it is not modelled: set adam_moments_dtype 'fp32'")
    return out


def _per_microbatch_problems(s: Strategy) -> list[str]:
    """What reducing gradients every micro-batch (``grad_reduce_per_microbatch``) is modelled
    with: ZeRO 0-2 (ZeRO-3 always does), the parameters gathered after the step, no deferred W
    passes nor merged ones."""
    what = "grad_reduce_per_microbatch"
    out = []
    if s.zero_stage == 3:
        out.append(f"{what}: ZeRO-3 reduce-scatters each block's gradients in every backward "
                   "already; set it to false")
    if s.overlap_param_gather and s.zero_stage in (1, 2):
        out.append(f"{what} is modelled without overlap_param_gather (Megatron's; DeepSpeed "
                   "and FSDP gather the updated parameters after the step); drop one of the two")
    for bad, name in ((s.split_w, f"schedule {s.schedule!r}"),
                      (s.overlap_moe_ep_comm, "overlap_moe_ep_comm")):
        if bad:
            out.append(f"{what} is modelled with the 1f1b, interleaved_1f1b and gpipe "
                       f"schedules, not with {name}; drop one of the two")
    return out


def _expert_problems(s: Strategy) -> list[str]:
    if s.expert_tp not in (0, 1, s.tp):
        return [f"expert_tp {s.expert_tp}: 0 (= tp, Megatron's default) or 1 (whole experts, "
                f"expert parallelism folded over tp·cp·dp); other degrees are not modelled"]
    if not s.moe_folded:
        return [f"ep {s.ep} must divide dp {s.dp} (expert parallelism is carved out of data "
                "parallelism); or fold it over tp·cp·dp with expert_tp = 1 (Megatron-Core MoE "
                "parallel folding)"] if s.dp % s.ep else []
    ranks = s.tp * s.cp * s.dp
    out = [f"ep {s.ep} must divide tp·cp·dp = {ranks} (expert parallelism folded over a "
           "stage's ranks, expert_tp 1)"] if ranks % s.ep else []
    if s.tp > 1 and not s.sequence_parallel:
        out.append("expert_tp 1 with tp > 1 needs sequence_parallel: each TP rank routes its "
                   "own share of the tokens (Megatron requires sequence parallelism for MoE "
                   "with tensor parallelism)")
    return out


def accounted_split_problems(s: Strategy, num_layers: int) -> list[str]:
    """Megatron-Core's account-for-embedding/loss split: the layers plus the embedding and/or
    loss counted as layers must split evenly over pp · vpp chunks, and the explicit end-chunk
    sizes cannot be given beside it."""
    if s.first_stage_layers or s.last_stage_layers:
        return ["set first_stage_layers / last_stage_layers or the account_for_*_in_pipeline_"
                "split flags, not both (each decides the end chunks' layers)"]
    extra = int(s.account_for_embedding_in_pipeline_split) + int(
        s.account_for_loss_in_pipeline_split)
    total, chunks = num_layers + extra, s.pp * s.vpp
    if total % chunks:
        return [f"num_layers {num_layers} + {extra} (the embedding / loss counted as layers) = "
                f"{total} is not divisible by pp · vpp = {s.pp} · {s.vpp} = {chunks}; choose "
                f"pp·vpp among {divisors(total)}"]
    return []


def _module_problems(s: Strategy) -> list[str]:
    if s.recompute_modules == "core_attn":
        return []
    names = [x.strip() for x in s.recompute_modules.split(",")]
    unknown = [x for x in names if x not in RECOMPUTE_MODULES]
    if unknown:
        return [f"recompute_modules {s.recompute_modules!r}: name modules among "
                f"{', '.join(RECOMPUTE_MODULES)}, comma-separated (unknown: "
                f"{', '.join(map(repr, unknown))})"]
    if s.recompute != "selective":
        return [f"recompute_modules {s.recompute_modules!r} needs recompute 'selective' (they "
                f"are what selective recompute runs again); got recompute {s.recompute!r}"]
    return []


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _offload_problems(s: Strategy) -> list[str]:
    """Megatron-Core's TransformerConfig checks for activation offloading (``--cpu-offloading``),
    each with its fix."""
    out: list[str] = []
    if s.cpu_offload_layers < 0:
        out.append(f"cpu_offload_layers must be ≥ 0, got {s.cpu_offload_layers}")
    if s.pp > 1:
        out.append(f"cpu_offload_layers needs pp 1 (Megatron-Core: 'no support for Pipeline "
                   f"parallelism with CPU offloading'), got pp {s.pp}; set pp 1 or "
                   "cpu_offload_layers 0")
    if s.recompute != "none":
        out.append(f"cpu_offload_layers does not work with activation recomputation "
                   f"(Megatron-Core), got recompute {s.recompute!r}; set recompute 'none' or "
                   "cpu_offload_layers 0")
    if s.split_w or s.overlap_moe_ep_comm:
        out.append("cpu_offload_layers with split weight-gradient passes or combined 1F1B is "
                   "not modelled; use schedule '1f1b' without overlap_moe_ep_comm")
    if s.cpu_offload_layers and s.schedule == "gpipe" and s.dp and s.micro_batch_size and (
            s.num_microbatches > 1):
        out.append(f"cpu_offload_layers with schedule 'gpipe' holds all {s.num_microbatches} "
                   "micro-batches' activations at once, where Megatron-Core's pp-1 schedule "
                   "(the one offloading runs under) runs each micro-batch's forward and "
                   "backward in turn; use schedule '1f1b'")
    return out
