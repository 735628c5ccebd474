"""What is trained: a decoder-only transformer, dense or mixture-of-experts."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from tracegen._config import build, field_type_problems, load_mapping
from tracegen.documents import DocumentMask, document_mask
from tracegen.errors import ConfigError
from tracegen.routing import Route, route_problems

# swiglu and geglu: gated MLPs (a gate and a value projection, SiLU or GELU on the gate; Shazeer
# 2020, "GLU Variants Improve Transformer"): the same GEMMs and bytes, another elementwise op
Activation = Literal["gelu", "swiglu", "geglu", "relu2", "relu"]
ACTIVATIONS: tuple[str, ...] = ("gelu", "swiglu", "geglu", "relu2", "relu")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """Shape of a decoder-only transformer. Sizes are element counts; ``seq_len`` in tokens."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int
    seq_len: int
    num_kv_heads: int = 0  # 0 = same as num_attention_heads (multi-head attention)
    # Width of one attention head; 0 = hidden_size / num_attention_heads. Set where a model
    # decouples them (Qwen3: 64 heads of 128 on a 4,096-wide model; Gemma; Megatron's
    # --kv-channels): Q and the attention output are then heads × head_dim wide.
    head_dim: int = 0
    activation: Activation = "gelu"
    tied_embeddings: bool = False
    num_experts: int = 0  # 0 = dense
    experts_per_token: int = 0
    moe_ffn_hidden_size: int = 0
    # Dropout probability of hidden states and attention probabilities (Megatron
    # --hidden-dropout / --attention-dropout, both 0.1 by default). At 0 nothing keeps a dropout
    # mask: PyTorch's dropout returns its input unchanged when p = 0 (ATen ``_dropout_impl``).
    # Most models since 2023 train without it (Llama, Mixtral, Qwen3, Nemotron-4, MPT).
    dropout: float = 0.1
    # Megatron-Core --moe-shared-expert-intermediate-size: the FFN width of the shared experts
    # (all of them together) that every token passes through beside its routed experts
    # (DeepSeekMoE, Dai et al. 2024; Qwen2-MoE). 0 = none. MoE models only.
    shared_expert_ffn_hidden_size: int = 0
    # The first N layers of a MoE model are dense, an MLP of ffn_hidden_size (DeepSeek's and
    # GLM-4.5's first_k_dense_replace; Megatron-Core --moe-layer-freq [0]*N+[1]*rest). 0 = every
    # layer MoE.
    first_dense_layers: int = 0
    # MoE layers in a repeating pattern (Llama 4 Maverick's MoE in every other layer, "DM";
    # Megatron-Core --moe-layer-freq as a list; transformers' interleave_moe_layer_step,
    # decoder_sparse_step, moe_layer_freq): "M" a MoE layer, "D" a dense one (an MLP of
    # ffn_hidden_size), repeated over the layers from layer 0; the first_dense_layers are dense
    # whatever it says. "" = every layer MoE. MoE models only.
    moe_layer_pattern: str = ""
    # Multi-head latent attention (DeepSeek-V2/V3, Liu et al. 2024; Megatron-Core
    # --multi-latent-attention): K and V are up-projected per head from a compressed latent of
    # kv_lora_rank (0 = standard attention), Q from one of q_lora_rank (0 = directly from the
    # hidden state); head_dim is then the no-rope part of a Q/K head, qk_rope_head_dim the
    # decoupled rotary part, v_head_dim a V head (0 = head_dim).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # Group-limited routing (DeepSeek-V3 §2.1.2, "node-limited routing"; Megatron-Core
    # --moe-router-num-groups / --moe-router-group-topk): the experts form
    # moe_router_num_groups equal groups of consecutive experts, and each token picks its top-k
    # experts within the moe_router_group_topk groups it scores highest. 0, 0 = no limit. Only
    # a dispatcher that sends a token once per destination gains from it (DeepEP,
    # Strategy.moe_dispatcher): with groups on nodes, fewer nodes receive each token.
    moe_router_num_groups: int = 0
    moe_router_group_topk: int = 0
    # The busiest expert-parallel rank's load over the mean (≥ 1; 1 = balanced, as Megatron's
    # --moe-router-force-load-balancing benchmarks run). Dropless training routes unevenly, and
    # every dispatch and combine waits for the rank with the most tokens, so each MoE layer
    # runs at that rank's pace: its experts' GEMMs, activations and sorting passes, the tokens
    # it receives and the copies it keeps all scale by this factor (tracegen/ops.py
    # ``_moe_fwd``). An assumption the user states, not a fitted constant: NVIDIA's Qwen3-235B
    # long-context runs on H100 measured 295 TFLOP/s a GPU forced-balanced and 237 dropless
    # (Megatron-MoE-ModelZoo, best_practice/Qwen3).
    moe_load_imbalance: float = 1.0
    # Multi-token prediction (DeepSeek-V3 §2.2; Megatron-Core --mtp-num-layers,
    # ``MultiTokenPredictionLayer``): this many sequential modules after the last layer, each
    # RMS-norming the hidden state and the next token's embedding, projecting their
    # concatenation 2h → h, running one transformer layer of the last layer's kind and the
    # shared output head with its own loss. They run on the last pipeline stage, which then
    # also holds the embedding (shared with the first stage). 0 = none; not in num_params
    # (DeepSeek-V3's 671B leave its 14B MTP module out).
    mtp_layers: int = 0
    # Token dropping (Megatron-Core --moe-expert-capacity-factor; GShard §2.2, Switch
    # Transformer §2.2): each expert takes at most this many times its balanced share of the
    # tokens·k copies (``get_capacity``: ⌈tokens·k / experts · factor⌉), the rest are dropped;
    # 0 = dropless (Megatron's None). With moe_pad_to_capacity
    # (--moe-pad-expert-input-to-capacity) every expert's input is padded to that capacity, so
    # each runs exactly it. MoE models only.
    moe_capacity_factor: float = 0.0
    moe_pad_to_capacity: bool = False
    # Sliding-window attention (Beltagy et al. 2020, Longformer; Mistral 7B, Jiang et al. 2023
    # §2; Gemma 2, Gemma Team 2024 §2): each query attends to the sliding_window keys up to
    # and including itself (FlashAttention's window_size = (sliding_window − 1, 0)); 0 = full
    # causal attention. window_pattern says which layers: "S" windowed, "F" full, repeated over
    # the layers from layer 0 ("" = every layer windowed; Gemma 2 and GPT-OSS "SF", Gemma 3
    # "SSSSSF"). A window at least as long as the sequence is full causal attention.
    sliding_window: int = 0
    window_pattern: str = ""
    # Chunked attention (Llama 4's local layers, Meta 2025; transformers'
    # ``attention_chunk_size``): a query attends causally to the keys of its own chunk of
    # attention_chunk tokens only (a block-diagonal causal mask), on the layers window_pattern
    # marks S; 0 = none. Another local attention than a sliding window: set one of the two.
    attention_chunk: int = 0
    # Document masking (Llama 3, Dubey et al. 2024 §3.2; Megatron-Core's packed sequences, THD
    # with cu_seqlens): the training data's documents are concatenated and cut into sequences,
    # and each token attends causally within its own document only. document_mean_tokens is
    # the corpus' mean document length in tokens (0 = none: a sequence attends as one), and
    # document_length_sigma the σ of their log-normal lengths' logarithm (0 = all one length);
    # the user states both (tracegen/documents.py). Every layer; not with a window or chunks.
    document_mean_tokens: int = 0
    document_length_sigma: float = 0.0

    def __post_init__(self) -> None:
        problems = field_type_problems(self)
        if problems:
            raise ConfigError(problems, what=f"model {self.name!r}")
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_attention_heads)
        given = self.head_dim != 0
        if not given and self.num_attention_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        problems = _problems(self, head_dim_given=given)
        if problems:
            raise ConfigError(problems, what=f"model {self.name!r}")

    @property
    def q_size(self) -> int:
        """Width of Q (and of the attention output): heads × head dim (= hidden_size unless
        ``head_dim`` decouples them)."""
        return self.num_attention_heads * self.head_dim

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """A Q or K head's width: head_dim, plus the rotary part under MLA."""
        return self.head_dim + self.qk_rope_head_dim

    @property
    def v_dim(self) -> int:
        """A V head's width (and an attention output head's)."""
        return self.v_head_dim or self.head_dim

    def attention_params(self) -> int:
        """Weights of one layer's attention projections."""
        h = self.hidden_size
        if not self.is_mla:
            return h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        return self.mla_down_params() + self.mla_up_params()

    def mla_down_params(self) -> int:
        """MLA's down-projections (Q's, and K/V's with the shared rotary key): duplicated, not
        split, over tensor parallelism (Megatron-Core's TELinear "duplicated")."""
        h = self.hidden_size
        return h * (self.q_lora_rank + self.kv_lora_rank + self.qk_rope_head_dim)

    def mla_up_params(self) -> int:
        """MLA's up-projections and output projection (split over tensor parallelism)."""
        h, heads = self.hidden_size, self.num_attention_heads
        q_in = self.q_lora_rank or h
        return (q_in * heads * self.qk_head_dim
                + self.kv_lora_rank * heads * (self.head_dim + self.v_dim)
                + heads * self.v_dim * h)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def gated(self) -> bool:
        """SwiGLU and GeGLU use two up-projections (gate and value) (Shazeer 2020, GLU
        variants)."""
        return self.activation in ("swiglu", "geglu")

    @property
    def kv_size(self) -> int:
        """Width of K (or V): kv heads × head dim (Ainslie et al. 2023, GQA)."""
        return self.num_kv_heads * self.head_dim

    def layer_params(self) -> int:
        """Parameters of one transformer layer (weights only; biases and norms are ignored);
        of a MoE one where the first layers are dense (``dense_view`` for those)."""
        return self.attention_params() + self.mlp_params()

    def dense_view(self) -> ModelSpec:
        """The model as its dense first layers see it: an MLP of ffn_hidden_size, no experts."""
        return dataclasses.replace(self, num_experts=0, experts_per_token=0,
                                   moe_ffn_hidden_size=0, shared_expert_ffn_hidden_size=0,
                                   first_dense_layers=0, moe_layer_pattern="",
                                   moe_router_num_groups=0,
                                   moe_router_group_topk=0, moe_load_imbalance=1.0,
                                   mtp_layers=0, moe_capacity_factor=0.0,
                                   moe_pad_to_capacity=False)

    @property
    def window(self) -> int:
        """The span a local layer attends within — its sliding window or its chunk — where it
        is shorter than the sequence (0: every layer attends causally over the whole
        sequence)."""
        span = self.sliding_window or self.attention_chunk
        return span if 0 < span < self.seq_len else 0

    @property
    def chunked(self) -> bool:
        """Whether the local layers attend within chunks (``attention_chunk``) rather than a
        sliding window."""
        return bool(self.window and self.attention_chunk)

    def windowed(self, layer: int) -> bool:
        """Whether global layer ``layer`` attends within the window."""
        if not self.window:
            return False
        p = self.window_pattern
        return not p or p[layer % len(p)] == "S"

    @property
    def document_mask(self) -> DocumentMask | None:
        """A sequence's attention under the document mask (None without one)."""
        if not self.document_mean_tokens:
            return None
        return document_mask(self.seq_len, self.document_mean_tokens,
                             self.document_length_sigma)

    def document_summary(self) -> str:
        """The document mask in words ("documents of 2,000 tokens (σ 1.0): 40% of causal
        attention's pairs"; "" without one)."""
        mask = self.document_mask
        if mask is None:
            return ""
        return (f"documents of {self.document_mean_tokens:,} tokens on average (log-σ "
                f"{self.document_length_sigma:g}): {mask.share(self.seq_len):.0%} of causal "
                f"attention's pairs")

    def window_summary(self) -> str:
        """The window in words ("4,096 keys, 1 layer(s) in 2"; "" without one)."""
        if not self.window:
            return ""
        p = self.window_pattern
        span = f"{self.window:,}-token chunks" if self.chunked else f"{self.window:,} keys"
        return f"{span}, " + (f"{p.count('S')} layer(s) in {len(p)}" if p else "every layer")

    def windowed_layers_in(self, layers: range) -> int:
        return sum(self.windowed(i) for i in layers) if self.window else 0

    def window_view(self, windowed: bool) -> ModelSpec:
        """The model as one of its windowed layers (every layer windowed) or full ones (no
        window) sees it: what a layer's op lists are built from."""
        if windowed:
            return dataclasses.replace(self, window_pattern="") if self.window_pattern else self
        return dataclasses.replace(self, sliding_window=0, attention_chunk=0, window_pattern="")

    def dense_layers_in(self, layers: range) -> int:
        """How many of the global layers ``layers`` are a MoE model's dense ones."""
        if "D" not in self.moe_layer_pattern:  # (the first ones only)
            return max(0, min(layers.stop, self.first_dense_layers) - layers.start)
        return sum(map(self.is_dense_layer, layers))

    def is_dense_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` of a MoE model is a dense one (``first_dense_layers``,
        ``moe_layer_pattern``)."""
        p = self.moe_layer_pattern
        return layer < self.first_dense_layers or (bool(p) and p[layer % len(p)] == "D")

    @property
    def has_dense_layers(self) -> bool:
        """Whether a MoE model has dense layers among its MoE ones."""
        return bool(self.first_dense_layers) or "D" in self.moe_layer_pattern

    def mlp_params(self) -> int:
        up = 3 if self.gated else 2
        if self.is_moe:
            return (self.num_experts * up * self.hidden_size * self.moe_ffn_hidden_size
                    + self.hidden_size * self.num_experts
                    + up * self.hidden_size * self.shared_expert_ffn_hidden_size)
        return up * self.hidden_size * self.ffn_hidden_size

    @property
    def moe_busiest_load(self) -> float:
        """The busiest expert-parallel rank's load over the balanced one, as the layer runs it:
        the routing's imbalance, capped by the capacity where tokens are dropped (an upper
        bound: capacity caps each expert, and a rank's experts need not all overflow), or the
        capacity itself where every expert's input is padded to it."""
        if self.moe_pad_to_capacity:
            return self.moe_capacity_factor
        if self.moe_capacity_factor:
            return min(self.moe_load_imbalance, self.moe_capacity_factor)
        return self.moe_load_imbalance

    def mtp_params(self) -> int:
        """Weights of the multi-token-prediction modules: each a 2h → h projection and a layer
        of the last layer's kind (the embedding and output head are the model's, shared)."""
        h = self.hidden_size
        return self.mtp_layers * (2 * h * h + self.layer_params())

    def embedding_params(self) -> int:
        copies = 1 if self.tied_embeddings else 2
        return copies * self.vocab_size * self.hidden_size

    def num_params(self) -> int:
        dense = self.dense_layers_in(range(self.num_layers)) if self.is_moe else 0
        return ((self.num_layers - dense) * self.layer_params()
                + (dense * self.dense_view().layer_params() if dense else 0)
                + self.embedding_params())

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        data = dict(data)
        data.setdefault("name", "custom")
        return build(cls, data, what=f"model {data['name']!r}")

    @classmethod
    def from_file(cls, path: str | Path) -> ModelSpec:
        p = Path(path)
        data = load_mapping(p, what="model file")
        if "model_type" in data:  # (tracegen.hf_config reads it, given the sequence length)
            raise ConfigError(f"{p} is a Hugging Face config: read it with "
                              "tracegen.resolve_model(path, seq_len=N), or pass it to --model "
                              "with --seq-len N", what="model file")
        data.setdefault("name", p.stem)
        return cls.from_dict(data)


def _problems(m: ModelSpec, *, head_dim_given: bool = True) -> list[str]:
    out: list[str] = []
    for field in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                  "vocab_size", "seq_len", "num_kv_heads"):
        if getattr(m, field) <= 0:
            out.append(f"{field} must be positive, got {getattr(m, field)}")
    if out:
        return out
    if not 0 <= m.dropout < 1:
        out.append(f"dropout is a probability in [0, 1), got {m.dropout} (0 = no dropout)")
    if m.activation not in ACTIVATIONS:
        out.append(f"activation must be one of {', '.join(ACTIVATIONS)}; got {m.activation!r}")
    if m.mtp_layers < 0:
        out.append(f"mtp_layers must be ≥ 0 (0 = no multi-token prediction), got "
                   f"{m.mtp_layers}")
    if m.head_dim < 0:
        out.append(f"head_dim must be ≥ 0 (0 = hidden_size / num_attention_heads), got "
                   f"{m.head_dim}")
    elif not head_dim_given and m.hidden_size % m.num_attention_heads:
        out.append(
            f"hidden_size {m.hidden_size} is not divisible by num_attention_heads "
            f"{m.num_attention_heads}; choose heads that divide the hidden size"
        )
    out += _mla_problems(m)
    if m.num_attention_heads % m.num_kv_heads:
        out.append(
            f"num_attention_heads {m.num_attention_heads} is not a multiple of num_kv_heads "
            f"{m.num_kv_heads} (grouped-query attention needs equal-size groups)"
        )
    out += _moe_problems(m)
    return out + _window_problems(m) + _document_problems(m)


# A log-σ past this puts more than a thousandth of the corpus' documents beyond a thousand
# times the median: a typo (a length, not its logarithm's spread), not a corpus.
MAX_DOCUMENT_SIGMA = 5.0
MAX_DOCUMENT_TOKENS = 2**31  # (a count: the project's bound on counts, far past any corpus)


def _document_problems(m: ModelSpec) -> list[str]:
    if not 0 <= m.document_mean_tokens < MAX_DOCUMENT_TOKENS:
        return [f"document_mean_tokens is the mean document length in tokens, in [0, 2³¹) (0 "
                f"= no document mask), got {m.document_mean_tokens}"]
    if not 0 <= m.document_length_sigma <= MAX_DOCUMENT_SIGMA:
        return [f"document_length_sigma is the σ of the logarithm of the documents' lengths, in "
                f"[0, {MAX_DOCUMENT_SIGMA:g}] (0 = every document of the mean length), got"
                f" {m.document_length_sigma}"]
    if m.document_length_sigma and not m.document_mean_tokens:
        return ["document_length_sigma is set but document_mean_tokens is 0: give the mean "
                "document length in tokens, or drop the σ"]
    if m.document_mean_tokens and (m.sliding_window or m.attention_chunk):
        return ["a document mask beside a sliding window or chunked attention is not "
                "modelled: drop document_mean_tokens, or the window"]
    return []


def _window_problems(m: ModelSpec) -> list[str]:
    for field in ("sliding_window", "attention_chunk"):
        if getattr(m, field) < 0:
            return [f"{field} must be ≥ 0 (0 = full causal attention), got "
                    f"{getattr(m, field)}"]
    if m.sliding_window and m.attention_chunk:
        return ["sliding_window and attention_chunk are two kinds of local attention: set one "
                "(the layers window_pattern marks S attend within it)"]
    if m.chunked and m.seq_len % m.attention_chunk:
        return [f"seq_len {m.seq_len} is not a multiple of attention_chunk "
                f"{m.attention_chunk}: a last, shorter chunk is not modelled"]
    p = m.window_pattern
    if p and set(p) - {"S", "F"}:
        return [f"window_pattern is a string of S (a windowed layer) and F (a full one), "
                f"repeated over the layers; got {p!r}"]
    if p and not (m.sliding_window or m.attention_chunk):
        return [f"window_pattern {p!r} is set but sliding_window is 0: give the window's "
                f"length in tokens (or attention_chunk), or drop the pattern"]
    if p and "S" not in p:
        return [f"window_pattern {p!r} has no windowed layer (S): drop sliding_window and the "
                f"pattern for full attention"]
    return []


def _mla_problems(m: ModelSpec) -> list[str]:
    out = [f"{f} must be ≥ 0, got {getattr(m, f)}" for f in
           ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim")
           if getattr(m, f) < 0]
    if out:
        return out
    if not m.is_mla and (m.q_lora_rank or m.qk_rope_head_dim or m.v_head_dim):
        return ["q_lora_rank / qk_rope_head_dim / v_head_dim describe multi-head latent "
                "attention; set kv_lora_rank (its K/V latent) too, or drop them"]
    if m.is_mla and m.num_kv_heads != m.num_attention_heads:
        return [f"multi-head latent attention up-projects K and V for every head: num_kv_heads "
                f"must equal num_attention_heads ({m.num_attention_heads}), got "
                f"{m.num_kv_heads}"]
    return []


def _moe_problems(m: ModelSpec) -> list[str]:
    if m.num_experts < 0:
        return [f"num_experts must be ≥ 0 (0 = dense), got {m.num_experts}"]
    if m.num_experts == 0:
        if (m.experts_per_token or m.moe_ffn_hidden_size or m.shared_expert_ffn_hidden_size
                or m.first_dense_layers or m.moe_layer_pattern or m.moe_router_num_groups
                or m.moe_router_group_topk or m.moe_load_imbalance != 1
                or m.moe_capacity_factor or m.moe_pad_to_capacity):
            return ["experts_per_token / moe_ffn_hidden_size / shared_expert_ffn_hidden_size / "
                    "first_dense_layers / moe_layer_pattern / moe_router_num_groups / "
                    "moe_router_group_topk / "
                    "moe_load_imbalance / moe_capacity_factor / moe_pad_to_capacity are set but "
                    "num_experts is 0; set num_experts for a mixture-of-experts model or drop "
                    "them"]
        return []
    out = []
    if not 0 <= m.first_dense_layers < m.num_layers:
        out.append(f"first_dense_layers must be in 0..num_layers − 1 ({m.num_layers - 1}), got "
                   f"{m.first_dense_layers}")
    p = m.moe_layer_pattern
    if p and (set(p) - {"D", "M"} or "M" not in p):
        out.append(f"moe_layer_pattern is a string of M (a MoE layer) and D (a dense one), "
                   f"repeated over the layers, with at least one M; got {p!r}")
    elif p and m.dense_layers_in(range(max(0, m.num_layers))) >= m.num_layers:
        out.append(f"moe_layer_pattern {p!r} with first_dense_layers {m.first_dense_layers} "
                   f"leaves none of the {m.num_layers} layers MoE")
    if m.shared_expert_ffn_hidden_size < 0:
        out.append(f"shared_expert_ffn_hidden_size must be ≥ 0 (0 = no shared experts), got "
                   f"{m.shared_expert_ffn_hidden_size}")
    if not 1 <= m.experts_per_token <= m.num_experts:
        out.append(f"experts_per_token must be in 1..num_experts ({m.num_experts}), "
                   f"got {m.experts_per_token}")
    if m.moe_ffn_hidden_size <= 0:
        out.append(f"moe_ffn_hidden_size must be positive for an MoE model, got "
                   f"{m.moe_ffn_hidden_size}")
    if not m.moe_load_imbalance >= 1:
        out.append(f"moe_load_imbalance is the busiest rank's load over the mean, ≥ 1 (1 = "
                   f"balanced), got {m.moe_load_imbalance}")
    if not m.moe_capacity_factor >= 0:
        out.append(f"moe_capacity_factor must be ≥ 0 (0 = dropless), got "
                   f"{m.moe_capacity_factor}")
    elif m.moe_pad_to_capacity and not m.moe_capacity_factor:
        out.append("moe_pad_to_capacity pads each expert's input to its capacity: set "
                   "moe_capacity_factor > 0 with it (Megatron-Core needs "
                   "--moe-expert-capacity-factor for --moe-pad-expert-input-to-capacity)")
    if not out:
        out += [f"moe_router_num_groups / moe_router_group_topk: {p}" for p in route_problems(
            Route(m.experts_per_token, m.num_experts, m.moe_router_num_groups,
                  m.moe_router_group_topk))]
    return out
