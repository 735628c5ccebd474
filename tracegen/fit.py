"""Whether a strategy can run a model: every way it cannot, named with its fix
(``check_fits_model``), and the layer splits Megatron-Core would make of it. The strategy's
own problems, which need no model, are ``tracegen.strategy``'s."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tracegen.errors import ConfigError
from tracegen.layout import parse_layout
from tracegen.model import ModelSpec
from tracegen.strategy import (
    Strategy,
    accounted_split_problems,
    divisors,
    moe_instance_problems,
)


def check_fits_model(s: Strategy, m: ModelSpec, *, gpus: int | None = None) -> None:
    """Raise ConfigError naming every way ``s`` cannot run ``m`` (on ``gpus`` GPUs)."""
    out: list[str] = []
    if gpus is not None and gpus != s.world_size:
        out.append(f"world size tp·cp·dp·pp = {s.tp}·{s.cp}·{s.dp}·{s.pp} = {s.world_size} "
                   f"differs from the GPU count {gpus}")
    if m.num_attention_heads % s.tp:
        out.append(f"num_attention_heads {m.num_attention_heads} is not divisible by tp {s.tp}; "
                   f"choose tp among {divisors(m.num_attention_heads)}")
    if m.num_kv_heads % s.tp:
        out.append(f"num_kv_heads {m.num_kv_heads} is not divisible by tp {s.tp}; choose tp among "
                   f"{divisors(m.num_kv_heads)}")
    if m.ffn_hidden_size % s.tp:
        out.append(f"ffn_hidden_size {m.ffn_hidden_size} is not divisible by tp {s.tp}")
    if m.vocab_size % s.tp:
        out.append(f"vocab_size {m.vocab_size} is not divisible by tp {s.tp}; pad the vocabulary "
                   "to a multiple of tp")
    out += _layer_split_problems(s, m)
    if m.seq_len % (s.cp * (2 if s.cp > 1 else 1)):
        out.append(f"seq_len {m.seq_len} is not divisible by 2·cp = {2 * s.cp} (context "
                   "parallelism splits the sequence into 2·cp chunks for load balance)")
    if s.sequence_parallel and m.seq_len // s.cp % s.tp:
        out.append(f"sequence_parallel needs seq_len / cp ({m.seq_len // s.cp}) divisible by tp "
                   f"({s.tp})")
    out += _moe_fit_problems(s, m)
    if s.recompute_modules != "core_attn":
        out += _module_fit_problems(s, m)
    if s.moe_dispatcher != "alltoall" and not (m.is_moe and s.ep > 1):
        out.append(f"moe_dispatcher {s.moe_dispatcher!r} dispatches a mixture-of-experts "
                   "model's tokens over expert parallelism; it needs num_experts and ep > 1 "
                   "(leave it 'alltoall' otherwise)")
    if m.moe_pad_to_capacity and s.moe_dispatcher == "deepep":
        out.append("moe_pad_to_capacity with moe_dispatcher 'deepep': Megatron-Core's flex "
                   "dispatcher does not pad expert inputs to capacity; drop tokens without "
                   "padding (moe_pad_to_capacity false) or use the 'alltoall' dispatcher")
    if s.moe_shared_expert_overlap and not (m.shared_expert_ffn_hidden_size and s.ep > 1
                                            and s.moe_dispatcher == "alltoall"):
        out.append("moe_shared_expert_overlap runs a MoE model's shared experts beside the "
                   "all-to-all dispatcher's dispatch and combine: it needs shared experts, ep > 1 "
                   "and moe_dispatcher 'alltoall' (beside DeepEP it is not modelled)")
    if s.overlap_moe_ep_comm and not m.is_moe:
        out.append("overlap_moe_ep_comm overlaps a mixture-of-experts model's all-to-alls: "
                   f"{m.name!r} has no experts; set overlap_moe_ep_comm = false")
    if s.overlap_moe_ep_comm and m.mtp_layers > 1:  # (Megatron-Core's TransformerConfig)
        out.append(f"overlap_moe_ep_comm runs at most one multi-token-prediction module, "
                   f"{m.name!r} has {m.mtp_layers}; set mtp_layers 1 or overlap_moe_ep_comm "
                   "= false")
    if m.is_mla and (s.cp > 1 or s.tp_comm_overlap):
        out.append("multi-head latent attention with context parallelism or TP communication "
                   "overlap is not modelled; use cp 1 and no tp_comm_overlap")
    if s.cpu_offload_layers >= m.num_layers:
        out.append(f"cpu_offload_layers {s.cpu_offload_layers} must be below the model's "
                   f"{m.num_layers} layers (Megatron-Core offloads layers less than num_layers); "
                   f"choose 1-{m.num_layers - 1}")
    if m.chunked and s.cp > 1:
        out.append(f"context parallelism with chunked attention ({m.attention_chunk}-token "
                   "chunks) is not modelled; use cp 1")
    if not out:  # (counting ops needs a strategy that fits the model otherwise)
        out += _count_problems(s, m)
    if out:
        raise ConfigError(out, what=f"strategy {s.label()} for model {m.name!r}")


def _count_problems(s: Strategy, m: ModelSpec) -> list[str]:
    """An op or collective whose FLOPs or bytes on a rank outgrow the 64-bit counts a Chakra
    trace carries (``tracegen.ops.COUNT_MAX``). Counted exactly only where a bound says it
    could (this check runs for every strategy a sweep screens): no op of a micro-batch counts
    more than 16 · tokens · w · max(seq_len, w), w the widest of the model's dimensions
    (attention ~10·b·s²·heads·d on a rank, a GEMM 6·tokens·k·n)."""
    from tracegen.ops import COUNT_MAX, largest_count  # (ops builds on tracegen.strategy)

    tokens = s.micro_batch_size * m.seq_len
    heads_width = m.num_attention_heads * (max(m.head_dim, m.hidden_size // m.num_attention_heads)
                                           + m.qk_rope_head_dim + m.v_head_dim)
    w = max(m.hidden_size, m.ffn_hidden_size, m.vocab_size, heads_width,
            m.moe_ffn_hidden_size * max(m.experts_per_token, 1) + m.shared_expert_ffn_hidden_size)
    if 16 * tokens * w * max(m.seq_len, w) <= COUNT_MAX:
        return []
    name, count = largest_count(m, s)
    if count <= COUNT_MAX:
        return []
    return [f"{name} counts {count:.3g} FLOPs or bytes on a rank, beyond the 64-bit counts a "
            f"Chakra trace carries (num_ops, comm_size): seq_len {m.seq_len:,} at "
            f"micro_batch_size {s.micro_batch_size} is too long for one rank; split the "
            "sequence with cp, or check --seq-len"]


# What each recompute module needs of the model, and what to say where it is missing.
_MODULE_NEEDS: tuple[tuple[str, Callable[[ModelSpec], bool], str], ...] = (
    ("mlp", lambda m: not m.is_moe or m.has_dense_layers,
     "recompute module 'mlp' recomputes a dense MLP, and every layer of this model is "
     "mixture-of-experts; recompute the experts' activation with 'moe_act' instead"),
    ("mla_up_proj", lambda m: m.is_mla,
     "recompute module 'mla_up_proj' recomputes multi-head latent attention's up-projections; "
     "this model has none (set kv_lora_rank for MLA)"),
    ("moe", lambda m: m.is_moe,
     "recompute module 'moe' recomputes a mixture-of-experts layer; this model is dense: "
     "recompute its MLP with 'mlp'"),
    ("shared_experts", lambda m: bool(m.shared_expert_ffn_hidden_size),
     "recompute module 'shared_experts' recomputes a MoE layer's shared experts; this model "
     "has none (shared_expert_ffn_hidden_size is 0)"),
    ("moe_act", lambda m: m.is_moe,
     "recompute module 'moe_act' needs a mixture-of-experts model; recompute a dense MLP with "
     "'mlp'"),
)


def _module_fit_problems(s: Strategy, m: ModelSpec) -> list[str]:
    mods = s.selective_modules
    return [why for name, fits, why in _MODULE_NEEDS if name in mods and not fits(m)]


def with_shorter_end_chunks(s: Strategy, num_layers: int) -> Strategy:
    """``s`` with an uneven split where pp · vpp does not divide the layers (and none is set):
    the first and last model chunks give up what is missing and the others hold
    ⌈layers / (pp · vpp)⌉, as Llama 3 did (126 layers on pp 16: 7, 8 × 14, 7; Dubey et al. 2024,
    §3.3.2) and as Megatron lays out an interleaved pipeline that counts the embedding and the
    loss as layers (126 on pp 8 × vpp 8: 1, 2 × 62, 1). Where that empties an end chunk (the
    others holding one layer: 126 on pp 16 × vpp 8, Llama 3's own layout), the same split as
    Megatron-Core's account-for-embedding/loss flags, which allow empty end chunks. Unchanged
    where the end chunks would give up more than one layer each (the strategy check then says
    what is wrong)."""
    chunks = s.pp * s.vpp
    if s.pp == 1 or num_layers % chunks == 0 or s.uneven:
        return s
    per = -(-num_layers // chunks)
    short = per * chunks - num_layers  # layers the two end chunks give up
    first, last = per - short // 2, per - (short - short // 2)
    if first >= 1 and last >= 1:
        return dataclasses.replace(s, first_stage_layers=first, last_stage_layers=last)
    if short > 2:
        return s
    return dataclasses.replace(s, account_for_embedding_in_pipeline_split=short == 2,
                               account_for_loss_in_pipeline_split=True)


def _layer_split_problems(s: Strategy, m: ModelSpec) -> list[str]:
    if s.pipeline_layout:
        return _layout_fit_problems(s, m)
    chunks = s.pp * s.vpp
    if not (s.first_stage_layers or s.last_stage_layers  # ``uneven``, inline: checked per
            or s.account_for_embedding_in_pipeline_split  # screened strategy
            or s.account_for_loss_in_pipeline_split):
        if m.num_layers % chunks:
            return [f"num_layers {m.num_layers} is not divisible by pp · vpp = {s.pp} · {s.vpp} = "
                    f"{chunks}; choose pp·vpp among {divisors(m.num_layers)}, or set "
                    "first_stage_layers / last_stage_layers (or count the embedding and loss "
                    "as layers: account_for_embedding/loss_in_pipeline_split) for an uneven "
                    "pipeline"]
        return []
    if s.pp < 2:
        return ["first_stage_layers / last_stage_layers and the account_for_*_in_pipeline_split "
                "flags need pp ≥ 2"]
    if s.account_for_embedding_in_pipeline_split or s.account_for_loss_in_pipeline_split:
        return accounted_split_problems(s, m.num_layers)
    if s.first_stage_layers < 0 or s.last_stage_layers < 0:
        return ["first_stage_layers / last_stage_layers must be ≥ 0"]
    n_chunks = s.pp * s.vpp
    # ``chunk_layers``' sizes in closed form (checked per screened strategy): the end chunks,
    # and n − 2 middle ones of ⌊rest / (n − 2)⌋ layers each
    head, tail = s._edge_layers(m.num_layers)
    middle = (m.num_layers - head - tail) // (n_chunks - 2) if n_chunks > 2 else head
    if head + tail + (middle * (n_chunks - 2) if n_chunks > 2 else 0) != m.num_layers or min(
            head, tail, middle) < 1:
        return [_edge_split_message(s, m.num_layers)]
    return []


def _edge_split_message(s: Strategy, num_layers: int) -> str:
    """Why the end-chunk sizes given do not split ``num_layers`` (every chunk at least one
    layer, the middle ones equal), with the nearest sizes that do."""
    n = s.pp * s.vpp
    first, last = s.first_stage_layers, s.last_stage_layers
    what = "stages" if s.vpp == 1 else "model chunks"
    on = f"{num_layers} layers on pp · vpp = {s.pp} · {s.vpp}"
    both = bool(first and last)
    if both:
        given, others, rest = (f"first_stage_layers {first} and last_stage_layers {last}",
                               n - 2, num_layers - first - last)
    else:
        edge = "first" if first else "last"
        given, others, rest = f"{edge}_stage_layers {first or last}", n - 1, num_layers - (
            first or last)
    if rest < 0 or others == 0:
        why = (f"{given} add up to {num_layers - rest}, " if both else f"{given} is ") + (
            "more than" if rest < 0 else "not") + f" the model's {num_layers} layers"
    else:
        verb = "leave" if both else "leaves"
        why = f"{given} {verb} {rest} layer{'s' if rest != 1 else ''}" + (
            f" for the other {others} {what}, which need at least one each" if rest < others
            else f", not a multiple of the other {others} {what}")
    if both:
        pairs = _nearest_edge_splits(num_layers, n, first, last)
        fits = ", ".join(f"{f}/{lst}" for f, lst in pairs)
        hint = f"first/last sizes that split it: {fits}" if fits else ""
    else:
        sizes = [e for e in range(1, num_layers) if (num_layers - e) % (n - 1) == 0
                 and num_layers - e >= n - 1]
        near = sorted(sizes, key=lambda e: abs(e - (first or last)))[:4]
        hint = (f"{'first' if first else 'last'}_stage_layers that split it (the other "
                f"{what} equal): {', '.join(map(str, near))}") if near else ""
    return f"{why} ({on}); " + (hint or "no end sizes split it: choose another pp · vpp")


def _nearest_edge_splits(num_layers: int, n: int, first: int, last: int,
                         limit: int = 4) -> list[tuple[int, int]]:
    """Up to ``limit`` (first, last) end-chunk sizes that split ``num_layers`` over ``n`` chunks
    with equal middle ones of at least one layer, nearest the sizes given first."""
    out = []
    for f in range(1, num_layers):
        for lst in range(1, num_layers - f + 1):
            rest = num_layers - f - lst
            if (n == 2 and rest == 0) or (n > 2 and rest >= n - 2 and rest % (n - 2) == 0):
                out.append((abs(f - first) + abs(lst - last), f, lst))
    return [(f, lst) for _, f, lst in sorted(out)[:limit]]


def _layout_fit_problems(s: Strategy, m: ModelSpec) -> list[str]:
    """A layout's layers (t) are the model's and its MTP modules (m) too."""
    chunks = parse_layout(s.pipeline_layout)
    layers, mtp = sum(c.layers for c in chunks), sum(c.mtp for c in chunks)
    out = []
    if layers != m.num_layers:
        out.append(f"pipeline_layout places {layers} layers (t), the model has {m.num_layers}")
    if mtp != m.mtp_layers:
        out.append(f"pipeline_layout places {mtp} MTP modules (m), the model has "
                   f"{m.mtp_layers} (ModelSpec.mtp_layers)")
    if m.tied_embeddings and mtp and s.chunk_stage(s.mtp_chunk) != s.head_stage:
        out.append("a tied output head with MTP modules off the last stage is not modelled "
                   "(the embedding would live on three stages); put m on the last stage")
    return out


def _moe_fit_problems(s: Strategy, m: ModelSpec) -> list[str]:
    if s.dist_opt_instances > 1 and m.is_moe:
        return moe_instance_problems(s)
    if not m.is_moe:
        return [f"ep = {s.ep} needs a mixture-of-experts model; {m.name!r} is dense"] if (
            s.ep > 1) else []
    if m.num_experts % s.ep:
        return [f"num_experts {m.num_experts} is not divisible by ep {s.ep}; choose ep among "
                f"{divisors(m.num_experts)}"]
    if m.shared_expert_ffn_hidden_size % s.tp:
        return [f"shared_expert_ffn_hidden_size {m.shared_expert_ffn_hidden_size} is not "
                f"divisible by tp {s.tp}"]
    if m.moe_ffn_hidden_size % s.etp:
        return [f"moe_ffn_hidden_size {m.moe_ffn_hidden_size} is not divisible by tp {s.tp}"]
    return []
