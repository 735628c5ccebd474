"""A Hugging Face ``config.json`` as a trainsim model: the file a planner already has for the
model they mean to train (``--model path/to/config.json --seq-len 8192``).

A JSON model file with a ``model_type`` key is read as a transformers config (the key names of
the transformers library's config classes: ``LlamaConfig``, ``MixtralConfig``,
``Qwen2MoeConfig``, ``Qwen3MoeConfig``, ``DeepseekV2Config``, ``DeepseekV3Config``,
``Glm4MoeConfig``, ``GemmaConfig``, ``Gemma2Config``, ``Gemma3TextConfig``, ``Olmo2Config``,
``OlmoeConfig``, ``GptOssConfig``, ``Llama4TextConfig`` — or ``Llama4Config``'s
``text_config`` —, ``GPT2Config``, ``GPTNeoXConfig``, ``NemotronConfig``).
What maps:

- the shape: layers, width, heads, K/V heads, head width where the config decouples it, FFN
  width, vocabulary, tied embeddings, dropout (hidden, else attention; 0 where neither);
- the MLP: gated families (Llama, Mistral, Qwen, DeepSeek, GLM, OLMo, GPT-OSS) with SiLU are
  SwiGLU (GPT-OSS's clamped one the same GEMMs), Gemma's with GELU GeGLU; GPT-2 and GPT-NeoX
  GELU; Nemotron squared ReLU;
- mixture-of-experts: the routed experts, top-k, their width, shared experts (Qwen2-MoE's
  width; DeepSeek's and GLM's count × the expert width; Llama 4's one), which layers are MoE
  (leading dense ones: ``first_k_dense_replace``, Qwen's ``mlp_only_layers``; MoE every N-th
  layer: ``moe_layer_freq``, ``decoder_sparse_step``, ``interleave_moe_layer_step`` — a
  ``moe_layer_pattern``), group-limited
  routing (``n_group`` / ``topk_group``) and multi-token prediction modules
  (``num_nextn_predict_layers``);
- multi-head latent attention (DeepSeek-V2 and V3): the K/V and Q latents, the rotary and
  no-rope head widths (``qk_nope_head_dim`` is trainsim's ``head_dim`` there), V heads;
- sliding-window attention shorter than the sequence: the window and which layers use it
  (``layer_types``, else the family's rule: ``_window``); Llama 4's chunked attention on its
  RoPE layers (``_llama4``).

A config does not say the sequence length of training (``max_position_embeddings`` is the
longest the model supports, not what a run trains at), so it must be given (``--seq-len``, a
study's ``seq_len`` or ``FILE@seqN``). What trainsim cannot cost is refused with the reason:
another model type (Gemma 3's multimodal ``gemma3``: give its ``text_config`` as a
``gemma3_text`` config), a MoE config none of whose layers is MoE.
Biases and norms are not modelled for any model (DESIGN.md, "Models"); rotary and RoPE-scaling
settings change no cost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tracegen.errors import ConfigError
from tracegen.model import ModelSpec

GATED = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
         "deepseek_v2", "deepseek_v3", "glm4_moe", "gemma", "gemma2", "gemma3_text", "olmo2",
         "olmoe", "gpt_oss", "llama4_text")
# (Llama 4's multimodal config: its ``text_config`` is read, the vision tower not costed)
MODEL_TYPES = (*GATED, "llama4", "gpt2", "gpt_neox", "nemotron")
# transformers' own defaults where a config leaves the key out
TIED_DEFAULT = {"gpt2": True, "gemma": True, "gemma2": True, "gemma3_text": True}
ACT = {"gelu": "gelu", "gelu_new": "gelu", "gelu_fast": "gelu", "gelu_pytorch_tanh": "gelu",
       "relu": "relu", "relu2": "relu2"}
# a gated MLP's activation on its gate: SiLU (SwiGLU) or GELU, exact or tanh (GeGLU, Gemma's)
GATED_ACT = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_new": "geglu",
             "gelu_pytorch_tanh": "geglu"}


# transformers' config-class defaults that a family's published configs rely on, leaving the
# keys out (Gemma 3's ``text_config`` lists only what differs from ``Gemma3TextConfig``'s; a
# Gemma 2 or GPT-OSS config without ``sliding_window`` still has the class's window)
CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {"sliding_window": 4096},
    "gemma3_text": {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
                    "num_hidden_layers": 26, "num_attention_heads": 8,
                    "num_key_value_heads": 4, "head_dim": 256,
                    "hidden_activation": "gelu_pytorch_tanh", "sliding_window": 4096,
                    "sliding_window_pattern": 6},
    "gpt_oss": {"sliding_window": 128},
    # ``Llama4TextConfig``'s (Scout's shape): 8,192-token chunks in three layers of four
    "llama4_text": {"attention_chunk_size": 8192, "no_rope_layer_interval": 4,
                    "interleave_moe_layer_step": 1},
}


def is_hf_config(data: dict[str, Any]) -> bool:
    """A transformers config (its ``model_type``), not a trainsim model file."""
    return "model_type" in data


def from_hf_config(data: dict[str, Any], *, name: str, seq_len: int) -> ModelSpec:
    """``data`` (a parsed ``config.json``) as a ModelSpec trained at ``seq_len`` tokens a
    sequence, named ``NAME@seqN`` (the name resolves back to it: ``catalog.resolve_model``)."""
    kind = str(data.get("model_type"))
    what = f"Hugging Face config {name!r}"
    if kind not in MODEL_TYPES:
        hint = ("a multimodal Gemma 3: give its 'text_config' as a config file of its own "
                "(model_type gemma3_text)" if kind == "gemma3" else
                "write a trainsim model file instead (keys: `trainsim catalog` lists the "
                "presets' shapes)")
        raise ConfigError(f"model_type {kind!r} is not one trainsim reads (it reads "
                          f"{', '.join(MODEL_TYPES)}); {hint}", what=what)
    if seq_len <= 0:
        longest = data.get("max_position_embeddings", data.get("n_positions"))
        raise ConfigError("a config does not say the sequence length a run trains at"
                          + (f" (max_position_embeddings {longest} is the longest the model "
                             "supports)" if longest else "")
                          + ": give it with --seq-len N, a study's seq_len, or FILE@seqN",
                          what=what)
    if kind == "llama4":  # the text model of Llama 4's multimodal config
        text = data.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("a Llama 4 config holds its text model's keys in 'text_config' "
                              f"(a table), got {text!r}", what=what)
        data, kind = {**text, "model_type": "llama4_text"}, "llama4_text"
    data = {**CLASS_DEFAULTS.get(kind, {}), **data}
    get = _getter(data, what)
    fields = (_gpt2 if kind == "gpt2" else _common)(get, kind)
    fields |= _moe(get, kind, data) | _mla(get, kind)
    if kind == "llama4_text":
        fields |= _llama4(get, fields["num_layers"])
    else:
        fields |= _window(get, kind, data, fields["num_layers"], seq_len)
    if fields.get("head_dim") == fields["hidden_size"] // fields["num_attention_heads"]:
        fields["head_dim"] = 0  # (the default: as the presets write it)
    return ModelSpec.from_dict({**fields, "name": f"{name}@seq{seq_len}", "seq_len": seq_len})


def _getter(data: dict[str, Any], what: str) -> Callable[..., Any]:
    """``get(key, default, kind=int)``: the config's value as ``kind`` (int, float, bool, str
    or list), or a clear error for a required one missing (no default given) or one of
    another type (a whole number given as 32.5, ``true`` or ``"abc"``)."""
    def get(key: str, default: Any = ConfigError, kind: type = int) -> Any:
        value = data.get(key)
        if value is None:
            if default is ConfigError:
                raise ConfigError(f"{key!r} is missing (a {data.get('model_type')} config has "
                                  "it)", what=what)
            return default
        got = _typed(value, kind)
        if got is None:
            raise ConfigError(f"{key!r} must be {_KINDS[kind]}, got {value!r}", what=what)
        return got
    return get


_KINDS = {int: "a whole number", float: "a number", bool: "true or false", str: "a string",
          list: "a list of whole numbers"}


def _typed(value: Any, kind: type) -> Any:
    """``value`` as ``kind``, or None where it is not one (JSON gives a whole number as an int
    or an integral float; a bool is never a number)."""
    if kind in (int, float) and isinstance(value, bool):
        return None
    if kind is int:
        ok = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        return int(value) if ok else None
    if kind is float:
        return float(value) if isinstance(value, int | float) else None
    if kind is list:
        ok = isinstance(value, list) and all(_typed(v, int) is not None for v in value)
        return [int(v) for v in value] if ok else None
    return value if isinstance(value, kind) else None


def _activation(get: Callable[..., Any], kind: str) -> str:
    """The MLP's activation: Gemma's ``hidden_activation`` where given, else ``hidden_act``."""
    act = get("hidden_activation", None, str) or get("hidden_act", "silu" if kind in GATED
                                                     else "gelu", str)
    if kind in GATED:
        if act not in GATED_ACT:
            raise ConfigError(f"a gated MLP with {act!r} is not one trainsim costs (gates: "
                              f"{', '.join(GATED_ACT)})", what=f"model_type {kind!r}")
        return GATED_ACT[act]
    if act not in ACT:
        raise ConfigError(f"hidden_act {act!r} is not one trainsim costs ({', '.join(ACT)})",
                          what=f"model_type {kind!r}")
    return ACT[act]


def _dropout(get: Callable[..., Any], *keys: str, default: float = 0.0) -> float:
    return float(next((get(k, kind=float) for k in keys if get(k, None, float) is not None),
                      default))


def _common(get: Callable[..., Any], kind: str) -> dict[str, Any]:
    heads = get("num_attention_heads")
    return {"num_layers": get("num_hidden_layers"), "hidden_size": get("hidden_size"),
            "num_attention_heads": heads,
            "num_kv_heads": get("num_key_value_heads", heads),
            "head_dim": get("head_dim", 0),
            "ffn_hidden_size": get("intermediate_size"),
            "vocab_size": get("vocab_size"), "activation": _activation(get, kind),
            "tied_embeddings": get("tie_word_embeddings", TIED_DEFAULT.get(kind, False), bool),
            "dropout": _dropout(get, "hidden_dropout", "attention_dropout")}


def _gpt2(get: Callable[..., Any], kind: str) -> dict[str, Any]:
    hidden = get("n_embd")
    act = get("activation_function", "gelu_new", str)
    if act not in ACT:
        raise ConfigError(f"activation_function {act!r} is not one trainsim costs "
                          f"({', '.join(ACT)})", what="model_type 'gpt2'")
    return {"num_layers": get("n_layer"), "hidden_size": hidden,
            "num_attention_heads": get("n_head"),
            "ffn_hidden_size": get("n_inner", 4 * hidden),
            "vocab_size": get("vocab_size"),
            "activation": ACT[act], "tied_embeddings": get("tie_word_embeddings", True, bool),
            "dropout": _dropout(get, "resid_pdrop", "attn_pdrop", default=0.1)}


def _moe(get: Callable[..., Any], kind: str, data: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts keys of a MoE config (none for a dense one)."""
    if kind == "olmoe":  # (every layer MoE, its experts intermediate_size wide)
        return {"num_experts": get("num_experts"), "experts_per_token": get("num_experts_per_tok"),
                "moe_ffn_hidden_size": get("intermediate_size")}
    if kind in ("mixtral", "gpt_oss"):
        return {"num_experts": get("num_local_experts"),
                "experts_per_token": get("num_experts_per_tok"),
                "moe_ffn_hidden_size": get("intermediate_size")}
    if kind in ("qwen2_moe", "qwen3_moe"):
        return {"num_experts": get("num_experts"),
                "experts_per_token": get("num_experts_per_tok"),
                "moe_ffn_hidden_size": get("moe_intermediate_size"),
                "shared_expert_ffn_hidden_size": get("shared_expert_intermediate_size", 0),
                **_qwen_layers(get, data)}
    if kind in ("deepseek_v2", "deepseek_v3", "glm4_moe"):
        width = get("moe_intermediate_size")
        groups = get("n_group", 1)
        return {"num_experts": get("n_routed_experts"),
                "experts_per_token": get("num_experts_per_tok"),
                "moe_ffn_hidden_size": width,
                "shared_expert_ffn_hidden_size": get("n_shared_experts", 0) * width,
                **_deepseek_layers(get, data),
                "moe_router_num_groups": groups if groups > 1 else 0,
                "moe_router_group_topk": get("topk_group", 1) if groups > 1 else 0,
                "mtp_layers": get("num_nextn_predict_layers", 0)}
    return {}


def _llama4(get: Callable[..., Any], layers: int) -> dict[str, Any]:
    """Llama 4 (transformers' ``Llama4TextConfig``; Meta 2025): MoE layers — routed experts
    ``intermediate_size`` wide and one shared expert of that width beside them
    (``Llama4TextMoe``) — every ``interleave_moe_layer_step``-th layer (``moe_layers`` where
    listed): every layer in Scout, every other one in Maverick (``moe_layer_pattern`` "DM");
    the dense layers' MLP is ``intermediate_size_mlp`` wide. Attention: the layers that use
    RoPE attend within chunks of ``attention_chunk_size`` tokens (iRoPE), every
    ``no_rope_layer_interval``-th layer (NoPE) over the whole sequence — from
    ``no_rope_layers`` (1: RoPE, chunked) where the config lists them."""
    step = _step(get, "interleave_moe_layer_step")
    listed = get("moe_layers", None, list)
    moe = set(listed) if listed is not None else set(range(step - 1, layers, step))
    width = get("intermediate_size")
    out: dict[str, Any] = {**_moe_layout([i in moe for i in range(layers)],
                                         {"model_type": "llama4_text"}),
                           "ffn_hidden_size": get("intermediate_size_mlp"),
                           "num_experts": get("num_local_experts"),
                           "experts_per_token": get("num_experts_per_tok"),
                           "moe_ffn_hidden_size": width,
                           "shared_expert_ffn_hidden_size": width}
    chunk = get("attention_chunk_size", 0)  # (null: none; kept where the sequence is no longer:
    if not chunk:  # the model then attends causally over it all, ``ModelSpec.window``)
        return out
    rope = get("no_rope_layers", None, list)
    if rope is None:
        every = get("no_rope_layer_interval")
        if every < 1:
            raise ConfigError(f"'no_rope_layer_interval' must be ≥ 1 (every N-th layer NoPE), "
                              f"got {every}", what="model_type 'llama4_text'")
        rope = [int((i + 1) % every != 0) for i in range(layers)]
    if len(rope) != layers or set(rope) - {0, 1}:
        raise ConfigError(f"'no_rope_layers' must give 1 (RoPE, chunked attention) or 0 (NoPE, "
                          f"full attention) for each of the {layers} layers, got {rope!r}",
                          what="model_type 'llama4_text'")
    pattern = _period("".join("S" if r else "F" for r in rope))
    if "S" not in pattern:
        return out
    return out | {"attention_chunk": chunk, "window_pattern": "" if pattern == "S" else pattern}


def _qwen_layers(get: Callable[..., Any], data: dict[str, Any]) -> dict[str, Any]:
    """Qwen-MoE's MoE layers (transformers' ``Qwen2MoeDecoderLayer``): layer i is MoE where it
    is not in ``mlp_only_layers`` and (i + 1) is a multiple of ``decoder_sparse_step``."""
    layers, step = get("num_hidden_layers"), _step(get, "decoder_sparse_step")
    dense = set(get("mlp_only_layers", [], list))
    return _moe_layout([i not in dense and (i + 1) % step == 0 for i in range(layers)],
                       data)


def _deepseek_layers(get: Callable[..., Any], data: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek's and GLM's MoE layers (transformers' ``DeepseekV3DecoderLayer``): layer i is
    MoE from ``first_k_dense_replace`` on where i is a multiple of ``moe_layer_freq``."""
    layers, freq = get("num_hidden_layers"), _step(get, "moe_layer_freq")
    first = get("first_k_dense_replace", 0)
    return _moe_layout([i >= first and i % freq == 0 for i in range(layers)], data)


def _step(get: Callable[..., Any], key: str) -> int:
    step: int = get(key, 1)
    if step < 1:
        raise ConfigError(f"{key!r} must be ≥ 1 (every N-th layer MoE), got {step}",
                          what="Hugging Face config")
    return step


def _moe_layout(moe: list[bool], data: dict[str, Any]) -> dict[str, Any]:
    """Which layers are MoE (one flag a layer) as trainsim says it: leading dense layers then
    MoE in every one (``first_dense_layers``), else the repeating ``moe_layer_pattern``."""
    if not any(moe):
        raise ConfigError("no layer is mixture-of-experts in this layout: a dense model's "
                          "config (without experts) costs it", what=f"model_type "
                          f"{data.get('model_type')!r}")
    lead = moe.index(True)
    if all(moe[lead:]):
        return {"first_dense_layers": lead}
    # the shortest pattern (from layer 0) that the layers from the first MoE one repeat
    pattern = next(p for size in range(1, len(moe) + 1)
                   if (p := _repeated(moe, lead, size)) is not None)
    first = lead  # the leading dense layers the pattern does not already make dense
    while first and not pattern[(first - 1) % len(pattern)]:
        first -= 1
    return {"first_dense_layers": first,
            "moe_layer_pattern": "".join("M" if x else "D" for x in pattern)}


def _repeated(moe: list[bool], lead: int, size: int) -> list[bool] | None:
    """The pattern of ``size`` flags that layers ``lead``… repeat (counted from layer 0; a
    place only layers before ``lead`` fall on is dense), or None where they do not."""
    pattern: list[bool | None] = [None] * size
    for i in range(lead, len(moe)):
        if pattern[i % size] is None:
            pattern[i % size] = moe[i]
        elif pattern[i % size] != moe[i]:
            return None
    return [bool(x) for x in pattern]


def _mla(get: Callable[..., Any], kind: str) -> dict[str, Any]:
    """Multi-head latent attention (DeepSeek-V2, V3): the latents and head widths (V2-Lite:
    no Q latent, ``q_lora_rank`` null)."""
    if kind not in ("deepseek_v2", "deepseek_v3") or not get("kv_lora_rank", 0):
        return {}
    return {"kv_lora_rank": get("kv_lora_rank"), "q_lora_rank": get("q_lora_rank", 0),
            "qk_rope_head_dim": get("qk_rope_head_dim"),
            "head_dim": get("qk_nope_head_dim"), "v_head_dim": get("v_head_dim")}


# transformers' layer kinds (``layer_types``) as window_pattern letters
LAYER_TYPES = {"sliding_attention": "S", "full_attention": "F"}


def _window(get: Callable[..., Any], kind: str, data: dict[str, Any], layers: int,
            seq_len: int) -> dict[str, Any]:
    """Sliding-window attention (``ModelSpec.sliding_window``, ``window_pattern``) where the
    window is shorter than the sequence (a longer one is full causal attention): which layers
    attend within it from ``layer_types`` where the config lists them (transformers ≥ 4.53),
    else as each family's config class places them — Mistral and Mixtral every layer, Gemma 2
    and GPT-OSS every other one from the first (``is_sliding = not layer_idx % 2``), Gemma 3
    all but every ``sliding_window_pattern``-th, Qwen's from ``max_window_layers`` on where
    ``use_sliding_window``. (GPT-OSS's attention sinks, one learned logit a head, cost
    nothing measurable and are not modelled.)"""
    qwen = kind in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
    window = get("sliding_window", 0)  # (the class's where it has one: ``CLASS_DEFAULTS``)
    if not window or window >= seq_len or (qwen and not get("use_sliding_window", False, bool)):
        return {}
    pattern = _layer_types(data.get("layer_types"), layers)
    if pattern is None:
        if kind in ("gemma2", "gpt_oss"):
            pattern = "SF"
        elif kind == "gemma3_text":
            pattern = "S" * (get("sliding_window_pattern") - 1) + "F"
        elif qwen:
            full = min(get("max_window_layers", layers), layers)
            pattern = "F" * full + "S" * (layers - full)
        else:
            pattern = "S"
    pattern = _period(pattern)
    if "S" not in pattern:
        return {}
    return {"sliding_window": window, "window_pattern": "" if pattern == "S" else pattern}


def _layer_types(value: Any, layers: int) -> str | None:
    """``layer_types`` as a pattern of one letter a layer, or None where the config has none."""
    if value is None:
        return None
    if (not isinstance(value, list) or len(value) != layers
            or any(v not in LAYER_TYPES for v in value)):
        raise ConfigError(f"'layer_types' must list one of {', '.join(LAYER_TYPES)} for each of "
                          f"the {layers} layers, got {value!r}", what="Hugging Face config")
    return "".join(LAYER_TYPES[v] for v in value)


def _period(pattern: str) -> str:
    """The shortest prefix whose repetition gives ``pattern``."""
    return next(pattern[:k] for k in range(1, len(pattern) + 1)
                if all(c == pattern[i % k] for i, c in enumerate(pattern)))
