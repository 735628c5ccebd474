"""Per-rank memory estimate: weights, gradients, optimizer state, activations, logits.

Activation bytes per token of one layer follow Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", §4, eqs. 1-5): with TP degree t and no recompute
``s·b·h·(10 + 24/t + 5·a·s/(h·t))``, with sequence parallelism ``s·b·h·(34/t + 5·a·s/(h·t))``,
selective recompute drops the ``5·a·s/h`` term, full recompute keeps only the ``2·s·b·h`` layer
input. The 34 is generalised here to GQA and gated MLPs term by term (see ``_layer_terms``), and
with flash attention the ``5·a·s/h`` softmax/dropout term is not stored (Dao et al. 2022).
"""

from __future__ import annotations

import dataclasses

from tracegen.model import ModelSpec
from tracegen.strategy import Strategy
from tracegen.units import GiB

# Mixed-precision Adam: fp32 master weight, momentum and variance (Rajbhandari et al. 2020, ZeRO
# §3: K = 12 bytes of optimizer state per parameter), fp32 main gradients (Megatron DDP grad buffer)
# and 16-bit weights.
WEIGHT_BYTES, GRAD_BYTES, OPTIM_BYTES = 2, 4, 12
# Runtime allowances — assumptions until measured on a device (bench/device): the CUDA context,
# cuBLAS workspaces and NCCL channel buffers take ~1-2 GiB per process in PyTorch jobs (NCCL's
# default NCCL_BUFFSIZE is 4 MiB per channel and peer); the caching allocator's fragmentation is
# taken as 5% of the tensors it holds.
RUNTIME_BYTES = 3 * 2**29  # 1.5 GiB
FRAGMENTATION = 0.05


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryEstimate:
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int
    logits_bytes: int
    runtime_bytes: int = 0  # CUDA context, workspaces, communication buffers
    fragmentation_bytes: int = 0  # allocator allowance

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.gradients_bytes + self.optimizer_bytes
                + self.activations_bytes + self.logits_bytes + self.runtime_bytes
                + self.fragmentation_bytes)

    def to_dict(self) -> dict[str, float]:
        d = {k.removesuffix("_bytes") + "_GiB": v / GiB
             for k, v in dataclasses.asdict(self).items()}
        d["total_GiB"] = self.total_bytes / GiB
        return d


def _layer_terms(m: ModelSpec) -> tuple[float, float]:
    """(replicated, tp-split) activation bytes per token per layer without recompute, before the
    attention-score term. For GPT shapes these are Korthikanti's 10 and 24 (times h)."""
    h, kv = m.hidden_size, m.kv_size
    f = m.moe_ffn_hidden_size * m.experts_per_token if m.is_moe else m.ffn_hidden_size
    up = 2 if m.gated else 1
    # LN1 in 2h, QKV in 2h, attn dropout mask h, LN2 in 2h, FC1 in 2h, MLP dropout mask h.
    replicated = 10 * h
    # Q 2h, K 2kv, V 2kv, out-proj in 2h, FC1 out 2·up·f, activation out 2f.
    split = 2 * h + 4 * kv + 2 * h + 2 * up * f + 2 * f
    return replicated, split


def activation_bytes_per_layer(m: ModelSpec, s: Strategy, *, flash_attention: bool = True) -> int:
    """Stored activation bytes of one layer for one micro-batch on one rank."""
    t, sp = s.tp, s.sequence_parallel
    tokens = s.micro_batch_size * m.seq_len // s.cp
    if s.recompute == "full":
        return 2 * tokens * m.hidden_size // (t if sp else 1)
    replicated, split = _layer_terms(m)
    per_token = (replicated + split) / t if sp else replicated + split / t
    if s.recompute == "none" and not flash_attention:
        a, seq = m.num_attention_heads, m.seq_len
        per_token += 5 * a * seq / t  # softmax out 2as, dropout mask as, dropout out 2as
    return int(tokens * per_token)


def inflight_microbatches(s: Strategy, stage: int) -> float:
    """Micro-batches whose activations a stage holds at its peak, in units of the stage's layers.

    1F1B: stage i holds min(p - i, m) (Narayanan et al. 2021 §2.2.1). Interleaved: the warm-up
    count of virtual micro-batches + 1, each 1/v of the stage (Megatron schedules.py). GPipe: m.
    """
    m, p, v = s.num_microbatches, s.pp, s.vpp
    if s.schedule == "gpipe":
        return float(m)
    if s.schedule == "1f1b":
        return float(min(p - stage, m))
    warm = min((p - stage - 1) * 2 + (v - 1) * p + 1, m * v)
    return warm / v


def estimate(m: ModelSpec, s: Strategy, stage: int, params_local: int,
             *, flash_attention: bool = True, act_per_layer: int | None = None
             ) -> MemoryEstimate:
    """``act_per_layer``: ``activation_bytes_per_layer(m, s)`` where the caller has it."""
    if act_per_layer is None:
        act_per_layer = activation_bytes_per_layer(m, s, flash_attention=flash_attention)
    return MemoryEstimate(*_parts(m, s, stage, params_local, act_per_layer))


def total_bytes(m: ModelSpec, s: Strategy, stage: int, params_local: int, *, act_per_layer: int
                ) -> int:
    """``estimate(...).total_bytes`` without building the breakdown (screening many)."""
    return sum(_parts(m, s, stage, params_local, act_per_layer))


def _parts(m: ModelSpec, s: Strategy, stage: int, params_local: int, act: int
           ) -> tuple[int, int, int, int, int, int, int]:
    """The fields of ``MemoryEstimate`` in order."""
    dp_shard = s.dp * s.cp
    grads = params_local * GRAD_BYTES
    optim = params_local * OPTIM_BYTES
    weights = params_local * WEIGHT_BYTES
    if s.zero_stage >= 1:
        optim = -(-optim // dp_shard)
    if s.zero_stage >= 2:
        grads = -(-grads // dp_shard)
    if s.zero_stage >= 3:
        weights = -(-weights // dp_shard)
    if s.vpp == 1:
        layers = len(s.chunk_layers(m.num_layers, stage))
    else:
        layers = sum(len(s.chunk_layers(m.num_layers, c * s.pp + stage)) for c in range(s.vpp))
    # In-flight micro-batches are counted in units of the whole stage (all its chunks).
    activations = int(act * layers * inflight_microbatches(s, stage))
    logits = 0
    if stage == s.pp - 1:
        tokens = s.micro_batch_size * m.seq_len // s.cp
        logits = tokens * m.vocab_size // s.tp * 4  # fp32 logits for the loss
    tensors = weights + grads + optim + activations + logits
    return (weights, grads, optim, activations, logits, RUNTIME_BYTES,
            int(tensors * FRAGMENTATION))
