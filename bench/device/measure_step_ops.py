"""Measure, on one NVIDIA GPU (PyTorch), the memory-bound work a training step does outside the
layers' kernels, against the bytes the trainsim compute model charges for it:

- ``optimizer``: the mixed-precision optimizer step over a shard of fp32 master weights —
  the gradient norm of clip_grad_norm (``torch._foreach_norm``, as apex's / Transformer
  Engine's ``multi_tensor_l2norm``), fused AdamW (``torch.optim.AdamW(fused=True)``, one
  multi-tensor kernel as Transformer Engine's ``FusedAdam``) and the copy of the master
  weights into the 16-bit model weights (``torch._foreach_copy_``) — per parameter against
  ``ADAM_BYTES_PER_PARAM`` (4 + 28 + 6 = 38 bytes, ``tracegen/ops.py``); a foreach (unfused)
  AdamW for comparison. Shards: Llama 3 8B's layer tensors (whole layers, as a model-parallel
  rank without the distributed optimizer holds them) and flat slices (the distributed
  optimizer's shard of its contiguous buffer), 0.1–0.9 G parameters;
- ``cross_entropy``: Megatron-Core's vocab-parallel cross-entropy as eager PyTorch runs it
  (``tensor_parallel/cross_entropy.py``: the cast of the logits to fp32, max, subtract, exp,
  sum, the target logit, divide; backward the in-place scaling and autograd's cast back to
  16 bits), the all-reduces left out (one GPU), for the tokens × vocabulary slices of the
  validation rows, against ``CE_FWD_BYTES`` / ``CE_BWD_BYTES`` (38 / 14 bytes a logit).

Output conventions as ``measure_hopper.py`` (``--out`` JSON rewritten after each section).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_hopper import Row, _time_ms, env_info, script_main

ADAM_BYTES = {"grad_norm": 4, "adam_fused": 28, "adam_foreach": 28, "master_to_bf16": 6}
CE_FWD_BYTES, CE_BWD_BYTES = 38, 14
# (tokens, local vocabulary): Llama 3 at tp 1 and 8, GPT-3's padded 51,200 at tp 1 and 8, MPT's
# 50,368 at 16K tokens
CE_SHAPES = [(8192, 128256), (8192, 16032), (2048, 51200), (2048, 6400), (16384, 50368)]
DEVICE = "cuda"  # a CPU dry run of the logic may set "cpu"

# Llama 3 8B's tensors of one layer (h 4096, ffn 14336, GQA 8 of 32 heads): qkv, proj, fc1
# (gate and up), fc2, the two norms' weights
L8B_LAYER = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (4096,), (4096,)]


def _shard(kind: str, params: int) -> list[tuple[int, ...]]:
    """Tensor shapes of a shard of about ``params`` parameters: whole Llama 3 8B layers, or
    flat slices of at most 2^28 elements (the distributed optimizer's buffer)."""
    if kind == "layers":
        per_layer = sum(math.prod(s) for s in L8B_LAYER)
        return L8B_LAYER * max(1, round(params / per_layer))
    return [(min(1 << 28, params - i),) for i in range(0, params, 1 << 28)]


def _adam_cases(shapes: list[tuple[int, ...]]) -> dict[str, Callable[[], object]]:
    import torch

    def fp32() -> list[Any]:
        return [torch.randn(s, device=DEVICE) * 0.02 for s in shapes]

    params = [torch.nn.Parameter(t) for t in fp32()]
    grads = fp32()
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    bf16 = [torch.empty(s, device=DEVICE, dtype=torch.bfloat16) for s in shapes]
    fused = torch.optim.AdamW(params, lr=1e-4, fused=True)
    foreach = torch.optim.AdamW([torch.nn.Parameter(t) for t in fp32()], lr=1e-4, foreach=True)
    for p, g in zip(foreach.param_groups[0]["params"], grads, strict=True):
        p.grad = g
    fused.step()  # the moments exist from the first step on
    foreach.step()
    return {
        "grad_norm": lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))),
        "adam_fused": fused.step, "adam_foreach": foreach.step,
        "master_to_bf16": lambda: torch._foreach_copy_(bf16, [p.detach() for p in params])}


def optimizer(args: argparse.Namespace) -> list[Row]:
    """Milliseconds and bytes a second of each optimizer pass over shards of 0.11-0.87 G
    parameters (the fused AdamW, norm and copy measured; the foreach AdamW for comparison)."""
    import torch

    out: list[Row] = []
    for kind, params in (("layers", 218_112_000), ("layers", 872_448_000),
                         ("flat", 100_000_000), ("flat", 800_000_000)):
        shapes = _shard(kind, params)
        n = sum(int(torch.Size(s).numel()) for s in shapes)
        with torch.no_grad():
            cases = _adam_cases(shapes)
            total_ms = 0.0
            for name, fn in cases.items():
                ms = _time_ms(fn, warmup=2, reps=5, batches=3)
                gbps = ADAM_BYTES[name] * n / ms / 1e6
                if name != "adam_foreach":
                    total_ms += ms
                out.append({"shard": kind, "params": n, "tensors": len(shapes), "pass": name,
                            "ms": ms, "GBps": gbps, "efficiency": gbps / args.hbm_gbps})
        model_ms = 38 * n / (args.hbm_gbps * 0.84) / 1e6
        out.append({"shard": kind, "params": n, "tensors": len(shapes), "pass": "step",
                    "ms": total_ms, "GBps": 38 * n / total_ms / 1e6,
                    "efficiency": 38 * n / total_ms / 1e6 / args.hbm_gbps,
                    "model_ms_38B_at_0.84": model_ms})
        del cases
        torch.cuda.empty_cache()
    return out


def _ce_forward(logits: Any, target: Any) -> tuple[Any, Any, Any]:
    """Megatron-Core's _VocabParallelCrossEntropy.forward on one rank (vocab start 0)."""
    import torch

    x = logits.float()
    logits_max = torch.max(x, dim=-1)[0]
    x -= logits_max.unsqueeze(-1)
    arange = torch.arange(x.shape[0], device=x.device)
    predicted = x[arange, target].clone()
    torch.exp(x, out=x)
    sum_exp = x.sum(dim=-1)
    loss = torch.log(sum_exp) - predicted
    x.div_(sum_exp.unsqueeze(-1))
    return loss, x, arange


def _ce_backward(softmax: Any, target: Any, arange: Any, grad_out: Any) -> Any:
    """Its backward: the target's one subtracted, the gradient scaled in place, autograd's cast
    back to the logits' 16 bits."""
    import torch

    softmax[arange, target] -= 1.0
    softmax.mul_(grad_out.unsqueeze(-1))
    return softmax.to(torch.bfloat16)


def _ce_times(tokens: int, vocab: int) -> tuple[float, float]:
    """Forward and backward milliseconds over tokens × vocab logits (the backward's restoring
    copy of the saved softmax timed apart and subtracted)."""
    import torch

    logits = torch.randn(tokens, vocab, device=DEVICE, dtype=torch.bfloat16)
    target = torch.randint(0, vocab, (tokens,), device=DEVICE)
    grad_out = torch.full((tokens,), 1.0 / tokens, device=DEVICE)
    _, softmax, arange = _ce_forward(logits, target)
    keep = softmax.clone()

    def bwd() -> object:
        softmax.copy_(keep)
        return _ce_backward(softmax, target, arange, grad_out)

    fwd_ms = _time_ms(lambda: _ce_forward(logits, target), warmup=2, reps=5, batches=3)
    bwd_ms = (_time_ms(bwd, warmup=2, reps=5, batches=3)
              - _time_ms(lambda: softmax.copy_(keep), warmup=2, reps=5, batches=3))
    return fwd_ms, bwd_ms


def cross_entropy(args: argparse.Namespace) -> list[Row]:
    """Forward and backward milliseconds of the cross-entropy over tokens × local vocabulary
    logits (``CE_SHAPES``)."""
    import torch

    out: list[Row] = []
    for tokens, vocab in CE_SHAPES:
        fwd_ms, bwd_ms = _ce_times(tokens, vocab)
        torch.cuda.empty_cache()
        n = tokens * vocab
        for name, ms, nbytes in (("forward", fwd_ms, CE_FWD_BYTES),
                                 ("backward", bwd_ms, CE_BWD_BYTES)):
            gbps = nbytes * n / ms / 1e6
            out.append({"tokens": tokens, "vocab": vocab, "pass": name, "ms": ms, "GBps": gbps,
                        "efficiency": gbps / args.hbm_gbps,
                        "model_ms_at_0.84": nbytes * n / (args.hbm_gbps * 0.84) / 1e6})
    return out


# (tokens, experts a token, hidden): Mixtral (top-2), Qwen3-235B (top-8) at 4K and 16K tokens,
# DeepSeek-V3 (top-8, hidden 7,168)
MOE_SHAPES = [(4096, 2, 4096), (4096, 8, 4096), (16384, 8, 4096), (4096, 8, 7168)]


def _time_cases(cases: dict[str, tuple[Callable[[], object], int]], args: argparse.Namespace,
                **tags: Any) -> list[Row]:
    """Milliseconds, GB/s and efficiency of each (call, bytes) case, tagged with ``tags``; a
    case that fails (a compile error surfaces at the first call) records its error."""
    out: list[Row] = []
    for name, (fn, nbytes) in cases.items():
        try:
            ms = _time_ms(fn, warmup=2, reps=5, batches=3)
        except Exception as e:
            out.append({**tags, "pass": name, "error": str(e).splitlines()[0][:120]})
            continue
        gbps = nbytes / ms / 1e6
        out.append({**tags, "pass": name, "ms": ms, "GBps": gbps,
                    "efficiency": gbps / args.hbm_gbps})
    return out


def _unpermute(copies: Any, probs: Any, index: Any, tokens: int) -> Any:
    """Megatron-Core's unfused unpermute (``moe_utils.unpermute``): each copy scaled by its
    router probability, then scatter-added back to its token."""
    import torch

    out = torch.zeros(tokens, copies.shape[1], device=copies.device, dtype=copies.dtype)
    return out.scatter_add_(0, index.unsqueeze(1).expand(-1, copies.shape[1]),
                            copies * probs.unsqueeze(-1))


def _moe_cases(tokens: int, k: int, h: int) -> dict[str, tuple[Callable[[], object], int]]:
    """(call, bytes the model charges for it) of each permutation pass on one rank's tokens:
    ``tracegen.ops._permutations``' counts (2 bytes an element)."""
    import torch

    x = torch.randn(tokens, h, device=DEVICE, dtype=torch.bfloat16)
    index = torch.randint(0, tokens, (tokens * k,), device=DEVICE).sort().values
    copies = x.index_select(0, index)
    probs = torch.rand(tokens * k, device=DEVICE, dtype=torch.bfloat16)
    sizes = torch.randint(1, 1000, (64,)).tolist()
    bounds = [round(tokens * k * sum(sizes[:i]) / sum(sizes)) for i in range(65)]
    chunks = [copies[bounds[i]:bounds[i + 1]] for i in range(64)]
    order = torch.randperm(64).tolist()
    moved, combined = 2 * tokens * k * h * 2, (tokens * k + tokens) * h * 2
    cases = {"permute": ((lambda: x.index_select(0, index)), moved),
             "sort_chunks": ((lambda: torch.cat([chunks[i] for i in order])), moved),
             "unpermute": ((lambda: _unpermute(copies, probs, index, tokens)), combined)}
    try:
        fused = torch.compile(_unpermute)
        cases["compiled_unpermute"] = ((lambda: fused(copies, probs, index, tokens)), combined)
    except Exception:  # torch.compile may be unavailable; the eager rows still count
        pass
    return cases


def moe_permutes(args: argparse.Namespace) -> list[Row]:
    """The MoE token permutations Megatron-Core runs around its all-to-all (index_select of
    each token's copies, the sort of what arrived into per-expert chunks, the weighted
    scatter-add back), eager and the last compiled, against the bytes trainsim charges."""
    return [row for tokens, k, h in MOE_SHAPES
            for row in _time_cases(_moe_cases(tokens, k, h), args, tokens=tokens, k=k, hidden=h)]


def _combine(permuted: Any, inverse: Any, probs: Any, k: int) -> Any:
    """A gather-based combine, as Transformer Engine's fused ``moe_unpermute`` runs it (each
    token reads its k copies through a row map and sums them weighted; no atomics)."""
    import torch

    tokens, h = permuted.shape[0] // k, permuted.shape[1]
    rows = permuted.index_select(0, inverse).view(tokens, k, h).float()
    return (rows * probs.view(tokens, k, 1)).sum(1).to(torch.bfloat16)


def _fused_cases(tokens: int, k: int, h: int) -> dict[str, tuple[Callable[[], object], int]]:
    """(call, bytes the model charges) of the gather into expert order and the gather-based
    combine back, for tokens routed to k distinct of 128 experts."""
    import torch

    x = torch.randn(tokens, h, device=DEVICE, dtype=torch.bfloat16)
    experts = torch.rand(tokens, 128, device=DEVICE).topk(k, dim=1).indices.flatten()
    order = experts.argsort(stable=True)  # permuted position -> copy (token-major)
    inverse = order.argsort()  # copy -> permuted position
    probs = torch.rand(tokens * k, device=DEVICE)
    source = order // k
    permuted = x.index_select(0, source)
    moved, combined = 2 * tokens * k * h * 2, (tokens * k + tokens) * h * 2
    cases: dict[str, tuple[Callable[[], object], int]] = {
        "permute_by_expert": ((lambda: x.index_select(0, source)), moved),
        "combine_gather": ((lambda: _combine(permuted, inverse, probs, k)), combined)}
    try:
        fused = torch.compile(_combine)
        cases["compiled_combine_gather"] = ((lambda: fused(permuted, inverse, probs, k)),
                                            combined)
    except Exception:  # torch.compile may be unavailable; the eager rows still count
        pass
    return cases


def moe_fused(args: argparse.Namespace) -> list[Row]:
    """The permutations in the order Megatron-Core's permute makes (copies grouped by expert,
    128 experts, top-k distinct a token): the gather into that order, and the gather-based
    combine back, eager and compiled (the compiled one a stand-in for Transformer Engine's
    fused kernel, which ``--moe-permute-fusion`` runs; TE cannot run here)."""
    return [row for tokens, k, h in MOE_SHAPES
            for row in _time_cases(_fused_cases(tokens, k, h), args, tokens=tokens, k=k,
                                   hidden=h)]


def _rope(x: Any, cos: Any, sin: Any) -> Any:
    """Megatron-Core's unfused rotary embedding (``_apply_rotary_pos_emb_bshd``)."""
    import torch

    x1, x2 = torch.chunk(x, 2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_embedding(args: argparse.Namespace) -> list[Row]:
    """Rotary embedding of Q and K ([s, b, heads, 128], eager and compiled) and the embedding
    lookup (Llama 3's 128,256 × 4,096 table), against read-once write-once bytes."""
    import torch
    import torch.nn.functional as F

    s, heads, d = 8192, 40, 128  # Llama 3 8B: 32 query + 8 key heads
    x = torch.randn(s, 1, heads, d, device=DEVICE, dtype=torch.bfloat16)
    cos = torch.randn(s, 1, 1, d, device=DEVICE, dtype=torch.bfloat16)
    sin = torch.randn(s, 1, 1, d, device=DEVICE, dtype=torch.bfloat16)
    table = torch.randn(128256, 4096, device=DEVICE, dtype=torch.bfloat16)
    ids = torch.randint(0, 128256, (8192,), device=DEVICE)
    cases: dict[str, tuple[Callable[[], object], int]] = {
        "rope": ((lambda: _rope(x, cos, sin)), 2 * x.numel() * 2),
        "embedding": ((lambda: F.embedding(ids, table)), 2 * 8192 * 4096 * 2)}
    try:
        fused = torch.compile(_rope)
        cases["compiled_rope"] = ((lambda: fused(x, cos, sin)), 2 * x.numel() * 2)
    except Exception:
        pass
    return _time_cases(cases, args)


def _native_steps() -> tuple[Callable[..., Any], ...]:
    """Megatron-Core's fused cross-entropy's vocab-sized steps, each compiled on its own as its
    jit fuser compiles them (``fusions/fused_cross_entropy.py``): the cast with the max, exp
    in place, the division in place; backward the scaling in place."""
    import torch

    def logits_max(x: Any) -> Any:
        x = x.float()
        return x, x.max(dim=-1)[0]

    def exp_inplace(x: Any, mx: Any) -> None:
        x.sub_(mx.unsqueeze(-1)).exp_()

    def div_inplace(x: Any, total: Any) -> None:
        x.div_(total.unsqueeze(-1))

    def scale_inplace(x: Any, g: Any) -> None:
        x.mul_(g.unsqueeze(-1))

    return tuple(torch.compile(f) for f in (logits_max, exp_inplace, div_inplace, scale_inplace))


def _native_times(tokens: int, vocab: int) -> tuple[float, float]:
    """Forward and backward milliseconds of the native fused loss (eager gather, sum, scatter
    and the final cast between its compiled steps)."""
    import torch

    logits_max, exp_inplace, div_inplace, scale_inplace = _native_steps()
    logits = torch.randn(tokens, vocab, device=DEVICE, dtype=torch.bfloat16)
    target = torch.randint(0, vocab, (tokens,), device=DEVICE)
    grad_out = torch.full((tokens,), 1.0 / tokens, device=DEVICE)
    arange = torch.arange(tokens, device=DEVICE)

    def fwd() -> Any:
        x, mx = logits_max(logits)
        predicted = x[arange, target] - mx
        exp_inplace(x, mx)
        total = x.sum(dim=-1)
        div_inplace(x, total)
        return x, torch.log(total) - predicted

    softmax, _ = fwd()
    keep = softmax.clone()

    def bwd() -> Any:
        softmax.copy_(keep)
        softmax[arange, target] -= 1.0
        scale_inplace(softmax, grad_out)
        return softmax.to(torch.bfloat16)

    fwd_ms = _time_ms(fwd, warmup=2, reps=5, batches=3)
    bwd_ms = (_time_ms(bwd, warmup=2, reps=5, batches=3)
              - _time_ms(lambda: softmax.copy_(keep), warmup=2, reps=5, batches=3))
    return fwd_ms, bwd_ms


TRITON_CE = r"""
import triton
import triton.language as tl


@triton.jit
def ce_fwd(X, Y, M, D, stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    X += row * stride
    m = float("-inf")
    d = 0.0
    for i in range(0, n_cols, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    tl.store(M + row, m)
    tl.store(D + row, d)


@triton.jit
def ce_bwd(X, Y, M, D, G, stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    X += row * stride
    m = tl.load(M + row)
    d = tl.load(D + row)
    g = tl.load(G + row)
    y = tl.load(Y + row)
    x_y = tl.load(X + y).to(tl.float32)
    for i in range(0, n_cols, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < n_cols, other=0.0).to(tl.float32)
        tl.store(X + offs, (tl.exp(x - m) / d * g).to(tl.bfloat16), mask=offs < n_cols)
    tl.debug_barrier()
    tl.store(X + y, ((tl.exp(x_y - m) / d - 1.0) * g).to(tl.bfloat16))
"""


def _triton_times(tokens: int, vocab: int) -> tuple[float, float]:
    """Forward and backward milliseconds of a Triton cross-entropy shaped as Transformer
    Engine's (``pytorch/triton/cross_entropy.py``: an online-softmax pass over the 16-bit
    logits forward, the gradient written over them backward, 32 warps a row)."""
    import importlib.util
    import tempfile

    import torch

    path = Path(tempfile.mkdtemp()) / "te_like_ce.py"  # Triton compiles from a source file
    path.write_text(TRITON_CE, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("te_like_ce", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    import triton

    logits = torch.randn(tokens, vocab, device=DEVICE, dtype=torch.bfloat16)
    target = torch.randint(0, vocab, (tokens,), device=DEVICE)
    m, d = (torch.empty(tokens, device=DEVICE) for _ in range(2))
    g = torch.full((tokens,), 1.0 / tokens, device=DEVICE)
    block = min(32768, triton.next_power_of_2(vocab))

    def fwd() -> None:
        mod.ce_fwd[(tokens,)](logits, target, m, d, logits.stride(0), vocab, BLOCK=block,
                              num_warps=32)

    def bwd() -> None:
        mod.ce_bwd[(tokens,)](logits, target, m, d, g, logits.stride(0), vocab, BLOCK=block,
                              num_warps=32)

    return (_time_ms(fwd, warmup=2, reps=5, batches=3),
            _time_ms(bwd, warmup=2, reps=5, batches=3))


def ce_fused(args: argparse.Namespace) -> list[Row]:
    """The fused losses against the bytes trainsim charges them (``CE_BYTES``): Megatron-Core's
    native fusion (26 + 14 a logit) and a Triton kernel shaped as Transformer Engine's (2 + 4)."""
    import torch

    out: list[Row] = []
    for impl, timer, (fb, bb) in (("native", _native_times, (26, 14)),
                                  ("te_like", _triton_times, (2, 4))):
        for tokens, vocab in CE_SHAPES:
            try:
                fwd_ms, bwd_ms = timer(tokens, vocab)
            except Exception as e:  # the other implementation's rows still count
                out.append({"impl": impl, "tokens": tokens, "vocab": vocab,
                            "error": str(e).splitlines()[0][:160]})
                continue
            torch.cuda.empty_cache()
            n = tokens * vocab
            for name, ms, nbytes in (("forward", fwd_ms, fb), ("backward", bwd_ms, bb)):
                gbps = nbytes * n / ms / 1e6
                out.append({"impl": impl, "tokens": tokens, "vocab": vocab, "pass": name,
                            "ms": ms, "GBps": gbps, "efficiency": gbps / args.hbm_gbps})
    return out


SECTIONS: list[tuple[str, Callable[..., list[Row]]]] = [
    ("env", env_info), ("optimizer", optimizer), ("cross_entropy", cross_entropy),
    ("moe_permutes", moe_permutes), ("rope_embedding", rope_embedding),
    ("moe_fused", moe_fused), ("ce_fused", ce_fused)]


def main() -> int:
    return script_main(SECTIONS, __doc__, hbm=True)


if __name__ == "__main__":
    sys.exit(main())
