"""Model FLOPs of a training step, independent of the parallel strategy (for MFU / HFU).

Megatron-LM's FLOP count (Narayanan et al. 2021 §5.1, generalised to GQA and gated MLPs as in
Megatron-LM's ``num_floating_point_operations``): per step of B sequences of s tokens,

    F = 12·B·s·l·h² · ((1 + kv/heads + s/h)·q/h + g·ffn/h + V/(2·l·h)),  g = 1.5 gated, 1 else

(forward + backward = 3 × forward; attention counted as full, not causal; q = heads × head dim,
h unless the model decouples them — Megatron's query_projection_to_hidden_size_ratio). For GPT
shapes this is 72·B·s·l·h²·(1 + s/6h + V/12lh). MoE layers count the top-k experts per token
and the shared experts (Megatron-LM: ``moe_ffn_hidden_size·topk + shared_expert_ffn_hidden_size``),
a MoE model's dense first layers their own ffn (ffn above is then the layers' mean). Multi-token
prediction adds, per module, one layer of the last layer's kind, its 2h → h projection and
norms (3·2·(3h + 2h²) per token) and one more pass of the output head (Megatron-LM
``num_floating_point_operations``: num_layers + mtp_num_layers, logits × (mtp_num_layers + 1)).
Under
multi-head latent attention the attention terms are its projections' weights (2 FLOPs each per
token) and QKᵀ / attention·V over its Q/K and V head widths.
A layer with sliding-window attention counts its band as the full count counts a causal layer:
2·s·w − w² query-key pairs where a full layer counts s² (both twice the pairs attended, so that
a window as long as the sequence counts as a full layer); a chunked layer counts s·c (twice
its s·c/2 pairs); under a document mask, twice the expected pairs the mask leaves
(``tracegen.documents``: useful work only, as for a window); ``attention_len``.
HFU adds the recomputed forward: full recompute one more forward of every layer (and of every
multi-token-prediction module's layer), selective the
attention scores and values (Korthikanti et al. 2022, §6) and, where its modules name the MLP,
the MLP's GEMMs (the norms and activations it may also rebuild are not matrix FLOPs).
"""

from __future__ import annotations

import dataclasses

from tracegen.model import ModelSpec


def model_flop_per_step(m: ModelSpec, global_batch: int) -> int:
    if not m.mtp_layers:
        return _main_flop(m, global_batch)
    b, s, h, v = global_batch, m.seq_len, m.hidden_size, m.vocab_size
    # one layer of the last layer's kind (a MoE model's last layer is a MoE one)
    last = dataclasses.replace(m.window_view(m.windowed(m.num_layers - 1)), num_layers=1,
                               first_dense_layers=0, moe_layer_pattern="", mtp_layers=0)
    layer = _main_flop(last, b) - 6 * b * s * h * v
    per_module = layer + 6 * b * s * (3 * h + 2 * h * h) + 6 * b * s * h * v
    return _main_flop(m, b) + m.mtp_layers * per_module


def attention_len(m: ModelSpec) -> float:
    """The length s' whose b·s·s' the count's attention terms take, averaged over the layers:
    s for a full layer, (2·s·w − w²)/s for a windowed one (the band's pairs, doubled as the
    full count doubles a causal layer's s²/2), c for a chunked one (its s·c/2 pairs, doubled),
    2P/s under a document mask (the expected pairs P, doubled)."""
    s, w = m.seq_len, m.window
    mask = m.document_mask
    if mask is not None:  # the masked pairs P (tracegen/documents.py), doubled: 2P/s
        return 2 * mask.pairs / s
    if not w:
        return float(s)
    windowed = m.windowed_layers_in(range(m.num_layers))
    local = w if m.chunked else 2 * w - w * w / s  # (a chunked layer: twice its s·w/2 pairs)
    return (s * (m.num_layers - windowed) + local * windowed) / m.num_layers


def _main_flop(m: ModelSpec, global_batch: int) -> int:
    b, s, n_l, h, v = global_batch, m.seq_len, m.num_layers, m.hidden_size, m.vocab_size
    ffn: float = (m.moe_ffn_hidden_size * m.experts_per_token + m.shared_expert_ffn_hidden_size
                  if m.is_moe else m.ffn_hidden_size)
    dense = m.dense_layers_in(range(n_l)) if m.is_moe else 0
    if dense:  # the layers' mean MLP width (Megatron-LM: per layer kind)
        ffn = (ffn * (n_l - dense) + m.ffn_hidden_size * dense) / n_l
    g = 1.5 if m.gated else 1.0
    if m.is_mla:
        # the same count with MLA's projections (their weights, twice per token) and
        # attention over Q/K heads of qk_head_dim and V heads of v_dim (Megatron-LM's MLA term)
        heads = m.num_attention_heads
        per_token = (2 * m.attention_params()
                     + 2 * attention_len(m) * heads * (m.qk_head_dim + m.v_dim)
                     + 4 * (1.5 if m.gated else 1.0) * h * ffn)
        return round(3 * b * s * n_l * per_token + 6 * b * s * h * v)
    kv = m.num_kv_heads / m.num_attention_heads
    q = m.q_size / h
    return round(12 * b * s * n_l * h * h * ((1 + kv + attention_len(m) / h) * q + g * ffn / h
                                             + v / (2 * n_l * h)))


def recompute_flop_per_step(m: ModelSpec, global_batch: int, recompute: str,
                            recomputed_layers: int | None = None,
                            modules: tuple[str, ...] = ("core_attn",)) -> int:
    """Extra forward FLOPs that recomputation executes (hardware FLOPs − model FLOPs); under
    full recompute of ``recomputed_layers`` of the layers (``Strategy.recomputed_layers``),
    their share by count (a MoE model's dense first layers weighed as its mean layer); under
    selective, of its ``modules`` (``Strategy.selective_modules``)."""
    if recompute == "none":
        return 0
    if m.mtp_layers:  # the MTP modules again, each as a layer of the last kind, all of them
        last = dataclasses.replace(m.window_view(m.windowed(m.num_layers - 1)),
                                   num_layers=m.mtp_layers, first_dense_layers=0,
                                   moe_layer_pattern="", mtp_layers=0)
        return (recompute_flop_per_step(dataclasses.replace(m, mtp_layers=0), global_batch,
                                        recompute, recomputed_layers, modules)
                + recompute_flop_per_step(last, global_batch, recompute, None, modules))
    b, s, n_l, h = global_batch, m.seq_len, m.num_layers, m.hidden_size
    # QKᵀ and attention·V, full (Megatron); MLA's Q/K and V heads differ
    s_att = (round(s * attention_len(m)) if m.window or m.document_mean_tokens
             else s * s)  # (exact where no window)
    attention = (2 * b * s_att * m.num_attention_heads * (m.qk_head_dim + m.v_dim) * n_l
                 if m.is_mla else 4 * b * s_att * m.q_size * n_l)
    if recompute == "selective":
        # a dense MLP's forward: 4·g·B·s·l·h·ffn, a third of its term in the formula above
        # (a MoE model's dense first layers only)
        dense = m.dense_layers_in(range(n_l)) if m.is_moe else n_l
        mlp = 4 * b * s * dense * h * m.ffn_hidden_size * (3 if m.gated else 2) // 2
        # MLA's up-projections: Q's from its latent (or the hidden state), K/V's from theirs
        up = (2 * b * s * n_l * m.num_attention_heads
              * ((m.q_lora_rank or h) * m.qk_head_dim
                 + m.kv_lora_rank * (m.head_dim + m.v_dim))) if m.is_mla else 0
        # a MoE layer's experts (top-k of them), shared experts and router, its MoE layers
        g = 3 if m.gated else 2
        moe = (2 * b * s * (n_l - dense) * h
               * (g * (m.experts_per_token * m.moe_ffn_hidden_size
                       + m.shared_expert_ffn_hidden_size) + m.num_experts)) if m.is_moe else 0
        shared = (2 * b * s * (n_l - dense) * h * g
                  * m.shared_expert_ffn_hidden_size) if m.is_moe else 0
        return ((attention if "core_attn" in modules else 0) + (mlp if "mlp" in modules else 0)
                + (up if "mla_up_proj" in modules else 0) + (moe if "moe" in modules else 0)
                + (shared if "shared_experts" in modules and "moe" not in modules else 0))
    logits = 2 * b * s * h * m.vocab_size
    layers = (_main_flop(m, global_batch) - 3 * logits) // 3
    return layers if recomputed_layers is None else layers * recomputed_layers // n_l


def attention_share(m: ModelSpec, global_batch: int) -> float:
    """The share of ``model_flop_per_step`` in QKᵀ and attention·V — counted full, as the count
    does: three times a forward's (``recompute_flop_per_step``'s selective core attention, the
    same terms); a causal layer computes half of it."""
    forward = recompute_flop_per_step(m, global_batch, "selective", modules=("core_attn",))
    return 3 * forward / model_flop_per_step(m, global_batch)


def step_rates(m: ModelSpec, global_batch: int, recompute: str, *, step_s: float, gpus: int,
               peak_flop_per_s: float, recomputed_layers: int | None = None,
               modules: tuple[str, ...] = ("core_attn",)) -> dict[str, float]:
    """Tokens/s, MFU and HFU of a step of ``step_s`` seconds on ``gpus`` GPUs of
    ``peak_flop_per_s`` each (the one place replay, the fast path and validate derive them)."""
    model_flop = model_flop_per_step(m, global_batch)
    hw_flop = model_flop + recompute_flop_per_step(m, global_batch, recompute,
                                                   recomputed_layers, modules)
    peak = peak_flop_per_s * gpus
    return {"tokens_per_s": global_batch * m.seq_len / step_s,
            "mfu": model_flop / (step_s * peak), "hfu": hw_flop / (step_s * peak)}
