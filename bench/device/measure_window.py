"""Measure sliding-window attention on one NVIDIA GPU (PyTorch), for the trainsim compute model's
windowed attention (each query attends to the w keys up to itself: Mistral 7B v0.1, Gemma 2/3,
GPT-OSS): whether a windowed call runs at the efficiency of a causal call whose queries see as
many keys (a causal query sees s/2 on average, a windowed one about w), so that the model may
read its attention curve at the key length 2·pairs/s.

- ``kernels``: which attention packages the image has (FlashAttention 2/3, Transformer Engine,
  the cuDNN frontend), with versions — the kernels production training runs windows with;
- ``window_cudnn``: cuDNN SDPA causal at 512-16K tokens (the presets' curve, for reference) and
  a window's band as a blocked kernel tiles it: causal diagonal blocks of w and full w × w
  blocks beside them (each query block and the block before it);
- ``window_flash``: FlashAttention's ``window_size`` (where installed), causal and windowed;
- ``window_flex``: FlexAttention (``torch.compile``d, block-sparse: it skips the tiles a mask
  empties), causal at 512-16K tokens and windowed (w 128-4K at 4K-32K tokens);
- ``window_heads``: the same at head dims 64 and 256 (and causal 256 tokens at 128), windows
  of 128-4,096.

FLOPs: forward 4·b·h·pairs·d, backward 2.5× that (the FlashAttention papers' convention), pairs
s²/2 causal and s·w − w²/2 windowed — what the model charges — so an efficiency here is what
the model's curve must give. Inputs 16 K tokens a call (32 K at 32 K tokens), 16 heads of 128
(hidden 2048, the FlashAttention-3 paper's setup), bf16. Output conventions as
``measure_hopper.py`` (``--out`` JSON rewritten after each section).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_hopper import Row, _attn_times, _time_ms, env_info, script_main

PEAK_TFLOPS = 989.4  # H200 SXM dense bf16 (as measure_hopper.py's default)
HEADS, HEAD_DIM, TOKENS = 16, 128, 16384
CAUSAL_SEQS = (512, 1024, 2048, 4096, 8192, 16384)
# (sequence, window): GPT-OSS's 128, Gemma 3's 1,024, Gemma 2's and Mistral's 4,096
WINDOWS = ((16384, 128), (16384, 512), (16384, 1024), (16384, 4096), (4096, 1024),
           (32768, 1024), (32768, 4096))
DEVICE = "cuda"  # a CPU dry run of the logic may set "cpu"
FLEX_BUDGET_S = 240.0  # compiles are slow: later cases are skipped past this, and said so


def _pairs(s: int, w: int) -> float:
    """Query-key pairs of one sequence: s²/2 causal (w = 0), s·w − w²/2 within a window."""
    return s * s / 2 if w == 0 or w >= s else s * w - w * w / 2


def _row(kind: str, s: int, w: int, ms_f: float, ms_b: float, *, heads: int = HEADS,
         head_dim: int = HEAD_DIM, **extra: Any) -> Row:
    b = max(1, TOKENS // s)
    flop = 4 * b * heads * _pairs(s, w) * head_dim
    f_tf, b_tf = flop / ms_f / 1e9, 2.5 * flop / ms_b / 1e9
    return {"kernel": kind, "seq": s, "window": w, "batch": b,
            "keys_equiv": round(2 * _pairs(s, w) / s), "fwd_ms": ms_f, "bwd_ms": ms_b,
            "fwd_tflops": f_tf, "bwd_tflops": b_tf, "fwd_eff": f_tf / PEAK_TFLOPS,
            "bwd_eff": b_tf / PEAK_TFLOPS, **extra}


def kernels(args: argparse.Namespace) -> list[Row]:
    out = env_info(args)
    for mod in ("flash_attn", "flash_attn_interface", "transformer_engine", "cudnn", "triton"):
        found = importlib.util.find_spec(mod) is not None
        version = ""
        if found:
            try:
                version = str(getattr(importlib.import_module(mod), "__version__", "?"))
            except Exception as e:  # importable in name only
                version = f"import fails: {type(e).__name__}"
        out.append({"package": mod, "installed": found, "version": version})
    return out


def window_cudnn(args: argparse.Namespace) -> list[Row]:
    """Causal cuDNN at each length; a window's band as causal w-blocks plus full w × w blocks
    (the band's time ≈ the diagonal blocks' + half the off-diagonal ones', whose tiles a
    windowed kernel half skips)."""
    out = []
    for s in CAUSAL_SEQS:
        ms_f, ms_b = _attn_times("cudnn", True, max(1, TOKENS // s), HEADS, s, s, HEAD_DIM)
        out.append(_row("cudnn", s, 0, ms_f, ms_b))
    for s, w in WINDOWS:
        if w < 256:
            continue  # (cuDNN's short-sequence calls are launch-bound there)
        b = max(1, TOKENS // s)
        d_f, d_b = _attn_times("cudnn", True, b * (s // w), HEADS, w, w, HEAD_DIM)
        o_f, o_b = _attn_times("cudnn", False, b * (s // w - 1), HEADS, w, w, HEAD_DIM)
        out.append(_row("cudnn_blocks", s, w, d_f + o_f / 2, d_b + o_b / 2,
                        diag_fwd_ms=d_f, off_fwd_ms=o_f, diag_bwd_ms=d_b, off_bwd_ms=o_b))
    return out


def window_flash(args: argparse.Namespace) -> list[Row]:
    if importlib.util.find_spec("flash_attn") is None:
        return [{"skipped": "flash_attn is not installed"}]
    import torch
    from flash_attn import flash_attn_func  # type: ignore[import-not-found]

    out = []
    for s, w in [(s, 0) for s in CAUSAL_SEQS] + list(WINDOWS):
        b = max(1, TOKENS // s)
        q, k, v = (torch.randn(b, s, HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        win = (w - 1, 0) if w else (-1, -1)

        def fwd(q: Any = q, k: Any = k, v: Any = v, win: Any = win) -> Any:
            return flash_attn_func(q, k, v, causal=True, window_size=win)

        ms_f = _time_ms(fwd)
        o = fwd()
        g = torch.randn_like(o)
        ms_b = _time_ms(lambda o=o, g=g, q=q, k=k, v=v: torch.autograd.grad(
            o, (q, k, v), g, retain_graph=True))
        out.append(_row("flash_attn", s, w, ms_f, ms_b))
    return out


def _flex_case(flex: Callable[..., Any], s: int, w: int, heads: int = HEADS,
               head_dim: int = HEAD_DIM) -> tuple[float, float]:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    def mask(b: Any, h: Any, q: Any, kv: Any) -> Any:
        keep = q >= kv
        return keep & (q - kv < w) if w else keep

    b = max(1, TOKENS // s)
    bm = create_block_mask(mask, None, None, s, s, device=DEVICE)
    q, k, v = (torch.randn(b, heads, s, head_dim, device=DEVICE, dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    ms_f = _time_ms(lambda: flex(q, k, v, block_mask=bm))
    o = flex(q, k, v, block_mask=bm)
    g = torch.randn_like(o)
    ms_b = _time_ms(lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True))
    return ms_f, ms_b


def _compiled_flex() -> Callable[..., Any]:
    """FlexAttention compiled once per shape (``dynamic=False``), with room for every case's
    recompile."""
    import torch
    import torch._dynamo.config as dyn
    from torch.nn.attention.flex_attention import flex_attention

    for key in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(dyn, key):
            setattr(dyn, key, 256)
    return torch.compile(flex_attention, dynamic=False)  # type: ignore[no-any-return]


def window_flex(args: argparse.Namespace) -> list[Row]:
    flex, out, t0 = _compiled_flex(), [], time.time()
    # causal and windowed interleaved by importance, so a cut budget keeps a comparison
    cases = [(16384, 0), (16384, 1024), (2048, 0), (16384, 4096), (8192, 0), (16384, 128),
             (1024, 0), (16384, 512), (4096, 0), (32768, 1024), (512, 0), (4096, 1024),
             (32768, 4096)]
    for s, w in cases:
        if time.time() - t0 > FLEX_BUDGET_S:
            out.append({"kernel": "flex", "seq": s, "window": w, "skipped": "time budget"})
            continue
        c0 = time.time()
        ms_f, ms_b = _flex_case(flex, s, w)
        out.append(_row("flex", s, w, ms_f, ms_b, wall_s=round(time.time() - c0, 1)))
    return out


def window_heads(args: argparse.Namespace) -> list[Row]:
    """The band edge at other head dims (64: GPT-OSS's 128-key windows; 256: Gemma 2's 4,096)
    and at the shortest windows: FlexAttention causal at 256-8K tokens and windows of 128-4,096
    in 16K, hidden 2048 (heads = 2048 / head dim); head dim 128 adds causal 256 beside run 1's
    window of 128."""
    flex, out, t0 = _compiled_flex(), [], time.time()
    cases = [(128, 256, 0), (64, 16384, 128), (64, 256, 0), (64, 16384, 1024), (64, 2048, 0),
             (64, 512, 0), (64, 16384, 512), (64, 1024, 0), (256, 16384, 4096), (256, 8192, 0),
             (256, 16384, 1024), (256, 2048, 0), (256, 4096, 0), (64, 4096, 0),
             (256, 1024, 0), (64, 16384, 4096), (64, 8192, 0)]
    for d, s, w in cases:
        if time.time() - t0 > FLEX_BUDGET_S:
            out.append({"kernel": "flex", "head_dim": d, "seq": s, "window": w,
                        "skipped": "time budget"})
            continue
        c0 = time.time()
        try:
            ms_f, ms_b = _flex_case(flex, s, w, 2048 // d, d)
        except Exception as e:  # (a head dim the kernel cannot tile: said, the rest go on)
            out.append({"kernel": "flex", "head_dim": d, "seq": s, "window": w,
                        "error": f"{type(e).__name__}: {str(e)[:200]}"})
            continue
        out.append(_row("flex", s, w, ms_f, ms_b, heads=2048 // d, head_dim=d,
                        wall_s=round(time.time() - c0, 1)) | {"head_dim": d})
    return out


SECTIONS = [("kernels", kernels), ("window_cudnn", window_cudnn),
            ("window_flash", window_flash), ("window_flex", window_flex),
            ("window_heads", window_heads)]

if __name__ == "__main__":
    sys.exit(script_main(SECTIONS, __doc__))
