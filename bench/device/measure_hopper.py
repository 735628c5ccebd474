"""Measure GEMM, attention, context-parallel attention, memory-bound kernels, launch overhead and
the sustained clock on one NVIDIA GPU (PyTorch), for the trainsim compute model's constants.

Prints a table per section and, with --out, writes JSON after every section (a section that
fails records its traceback and the others still run). Timing: CUDA events, warm-up, then the
median of repeated runs; inputs are random (never zeros). Peak bf16 / fp8 and HBM bandwidth are
given by --peak-tflops / --peak-fp8-tflops / --hbm-gbps (H200 SXM datasheet defaults).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

Row = dict[str, Any]
SLEEP_CYCLES = 20_000_000  # ~10 ms at boost clock: longer than enqueuing a batch of calls

# (label, m, n, k) of Y[m,n] = X[m,k]·W[n,k]ᵀ: the MAMF anchors and transformer layers' GEMMs
# (tokens × out × in) at the tensor-parallel widths of the validation rows.
GEMM_SHAPES = [
    ("mamf_best", 2048, 2048, 13312), ("cube8k", 8192, 8192, 8192), ("cube4k", 4096, 4096, 4096),
    ("l8b_qkv", 8192, 6144, 4096), ("l8b_proj", 8192, 4096, 4096),
    ("l8b_fc1", 8192, 28672, 4096), ("l8b_fc2", 8192, 4096, 14336),
    ("l8b_fc1_wgrad", 28672, 4096, 8192), ("l70b_tp4_qkv", 8192, 2560, 8192),
    ("l70b_tp4_proj", 8192, 8192, 2048), ("l70b_tp4_fc1", 8192, 14336, 8192),
    ("l70b_tp4_fc2", 8192, 8192, 7168), ("l405b_tp8_qkv", 8192, 2304, 16384),
    ("l405b_tp8_proj", 8192, 16384, 2048), ("l405b_tp8_fc1", 8192, 13312, 16384),
    ("l405b_tp8_fc2", 8192, 16384, 6656), ("gpt175b_tp8_qkv", 2048, 4608, 12288),
    ("gpt175b_tp8_proj", 2048, 12288, 1536), ("gpt175b_tp8_fc1", 2048, 6144, 12288),
    ("gpt175b_tp8_fc2", 2048, 12288, 6144), ("gpt175b_tp8_fc1_wgrad", 6144, 12288, 2048),
    ("small_m1024", 1024, 4096, 4096), ("small_m512", 512, 8192, 8192),
    ("lmhead_tp8", 8192, 16032, 8192),
]


def _time_ms(fn: Callable[[], object], *, warmup: int = 3, reps: int = 10,
             batches: int = 5) -> float:
    """GPU milliseconds per call, the calls queued back to back: a sleeping kernel holds the
    stream while the host enqueues ``reps`` calls, so host dispatch (PyTorch, cuDNN plan
    lookup, autograd) stays out of the time, as in training where the host runs ahead."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(batches):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times)


def _held(fn: Callable[[], object], seconds: float = 1.2) -> tuple[float, Row]:
    """Milliseconds per call with the calls back to back for ``seconds`` (the chip reaches its
    power limit within a fraction of a second), over the second half; and the clock then."""
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    calls, mark, mark_calls = 0, None, 0
    while True:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        calls += 5
        now = time.perf_counter()
        if mark is None and now - t0 > seconds / 2:
            mark, mark_calls = now, calls
        if now - t0 > seconds:
            break
    assert mark is not None
    return (now - mark) * 1e3 / max(calls - mark_calls, 1), _clock_power(NV)


def _nvml() -> Any:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:  # nvml is optional: clocks are then not reported
        return None


def _clock_power(nv: Any) -> Row:
    if nv is None:
        return {}
    h = nv.nvmlDeviceGetHandleByIndex(0)
    return {"sm_mhz": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
            "power_w": nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
            "temp_c": nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)}


NV = _nvml()


def env_info(args: argparse.Namespace) -> list[Row]:
    import torch

    p = torch.cuda.get_device_properties(0)
    nv = _nvml()
    row: Row = {"device": p.name, "sms": p.multi_processor_count,
                "mem_GiB": p.total_memory / 2**30, "torch": torch.__version__,
                "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version()}
    if nv is not None:
        h = nv.nvmlDeviceGetHandleByIndex(0)
        row["power_limit_w"] = nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0
        row["max_sm_mhz"] = nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM)
        row.update(_clock_power(nv))
    return [row]


def _gemm_bf16(m: int, n: int, k: int) -> Callable[[], object]:
    import torch

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    return lambda: a @ w.t()


def _gemm_fp8(m: int, n: int, k: int, fast: bool = False) -> Callable[[], object]:
    """Tensor-wise scaled FP8 (e4m3) GEMM, bf16 out, as Transformer Engine's delayed scaling
    (which uses the fast, split accumulation in forward only)."""
    import torch

    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    w = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    return lambda: torch._scaled_mm(a, w.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                    use_fast_accum=fast)


def gemms(args: argparse.Namespace, dtype: str) -> list[Row]:
    peak = args.peak_tflops if dtype == "bf16" else args.peak_fp8_tflops
    out = []
    for label, m, n, k in GEMM_SHAPES:
        fn = _gemm_bf16(m, n, k) if dtype == "bf16" else _gemm_fp8(m, n, k, dtype == "fp8_fast")
        ms = _time_ms(fn, reps=15)
        tflops = 2 * m * n * k / ms / 1e9
        out.append({"shape": label, "m": m, "n": n, "k": k, "ms": ms,
                    "sm_mhz": _clock_power(NV).get("sm_mhz"), "tflops": tflops,
                    "efficiency": tflops / peak})
    return out


def gemms_held(args: argparse.Namespace, dtype: str) -> list[Row]:
    """Each shape back to back for 1.2 s: its rate at the clock the power limit allows."""
    peak = args.peak_tflops if dtype == "bf16" else args.peak_fp8_tflops
    out = []
    for label, m, n, k in GEMM_SHAPES:
        fn = _gemm_bf16(m, n, k) if dtype == "bf16" else _gemm_fp8(m, n, k)
        ms, clk = _held(fn)
        tflops = 2 * m * n * k / ms / 1e9
        out.append({"shape": label, "m": m, "n": n, "k": k, "ms": ms, **clk,
                    "tflops": tflops, "efficiency": tflops / peak})
    return out


def attention_held(args: argparse.Namespace) -> list[Row]:
    """cuDNN causal attention, head dim 128, forward + backward back to back for 1.2 s."""
    import torch

    out = []
    for seq in (1024, 2048, 4096, 8192, 16384):
        b, h, d = max(1, 16384 // seq), 16, 128
        q, k, v = (torch.randn(b, seq, h, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        fwd = _sdpa("cudnn", True)

        def step(q: Any = q, k: Any = k, v: Any = v, fwd: Any = fwd) -> None:
            o = fwd(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            o.backward(torch.ones_like(o))

        ms, clk = _held(step)
        flop = 3.5 * 4 * b * h * seq * seq * d / 2
        out.append({"seq": seq, "ms": ms, **clk, "tflops": flop / ms / 1e9,
                    "eff": flop / ms / 1e9 / args.peak_tflops})
    return out


def attention_occupancy(args: argparse.Namespace) -> list[Row]:
    """Causal 4096 tokens, head dim 128, b 1, as the heads per call (b·h) shrink."""
    out = []
    for backend in ("cudnn", "flash"):
        for h in (4, 8, 16, 32, 64):
            ms_f, ms_b = _attn_times(backend, True, 1, h, 4096, 4096, 128)
            flop = 4 * h * 4096 * 4096 * 128 / 2
            out.append({"backend": backend, "heads": h, "fwd_eff": flop / ms_f / 1e9 /
                        args.peak_tflops, "bwd_eff": 2.5 * flop / ms_b / 1e9 / args.peak_tflops})
    return out


def attention_grid(args: argparse.Namespace) -> list[Row]:
    """cuDNN causal attention, b = 1, over head dim × sequence × heads per call: how the
    efficiency falls as a call has fewer query tiles (b·heads·s/128) to spread over the SMs."""
    out = []
    for d in (64, 128, 256):
        for seq in (1024, 2048, 4096, 8192):
            for h in (4, 8, 16, 32, 64):
                ms_f, ms_b = _attn_times("cudnn", True, 1, h, seq, seq, d)
                flop = 4 * h * seq * seq * d / 2
                out.append({"d": d, "seq": seq, "heads": h,
                            "fwd_eff": flop / ms_f / 1e9 / args.peak_tflops,
                            "bwd_eff": 2.5 * flop / ms_b / 1e9 / args.peak_tflops})
    return out


def _sdpa(backend: str, causal: bool, gqa: bool = False) -> Callable[..., Any]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]

    def run(q: Any, k: Any, v: Any) -> Any:
        with sdpa_kernel(be):
            if gqa:  # (the keyword only where used: older PyTorch lacks it)
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                      enable_gqa=True)
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def _attn_times(backend: str, causal: bool, b: int, h: int, sq: int, skv: int,
                d: int, kv_heads: int = 0) -> tuple[float, float]:
    """Forward and backward milliseconds of one attention call, q [b,h,sq,d], k/v [b,h,skv,d]
    (``kv_heads`` K/V heads, grouped-query attention, where given) as views of [b,s,h,d]
    storage: the layout a transformer's projections produce and the one the fused kernels take
    without a copy."""
    import torch

    hkv = kv_heads or h

    def t(s: int, heads: int) -> Any:
        base = torch.randn(b, s, heads, d, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True)
        return base, base.transpose(1, 2)

    (qb, q), (kb, k), (vb, v) = t(sq, h), t(skv, hkv), t(skv, hkv)
    fwd = _sdpa(backend, causal, gqa=hkv != h)
    ms_f = _time_ms(lambda: fwd(q, k, v))
    o = fwd(q, k, v)
    g = torch.randn_like(o)
    ms_b = _time_ms(lambda: torch.autograd.grad(o, (qb, kb, vb), g, retain_graph=True))
    return ms_f, ms_b


def attention(args: argparse.Namespace) -> list[Row]:
    """FlashAttention-3 paper's setup (Shah et al. 2024): 16 K tokens, hidden 2048, so heads =
    2048 / head dim; forward FLOPs 4·b·h·s²·d (half if causal), backward 2.5× that."""
    out = []
    cases = [(d, c) for d in (64, 128, 256) for c in (True, False) if d == 128 or c]
    for backend in ("cudnn", "flash"):
        for d, causal in cases:
            for seq in (512, 1024, 2048, 4096, 8192, 16384):
                b, h = max(1, 16384 // seq), 2048 // d
                try:
                    ms_f, ms_b = _attn_times(backend, causal, b, h, seq, seq, d)
                except Exception as e:  # a backend may not take a head dim
                    out.append({"backend": backend, "d": d, "causal": causal, "seq": seq,
                                "error": str(e).splitlines()[0][:120]})
                    continue
                flop = 4 * b * h * seq * seq * d / (2 if causal else 1)
                f_tf, b_tf = flop / ms_f / 1e9, 2.5 * flop / ms_b / 1e9
                out.append({"backend": backend, "d": d, "causal": causal, "seq": seq,
                            "sm_mhz": _clock_power(NV).get("sm_mhz"), "fwd_ms": ms_f,
                            "bwd_ms": ms_b, "fwd_tflops": f_tf,
                            "bwd_tflops": b_tf, "fwd_eff": f_tf / args.peak_tflops,
                            "bwd_over_fwd": b_tf / f_tf})
    return out


def attention_gqa(args: argparse.Namespace) -> list[Row]:
    """Grouped-query attention (K/V heads shared by groups of query heads: Llama 3's 8 K/V
    heads, 1 a rank at tp 8) against the same call with a K/V head per query head: causal,
    head dim 128, 16K tokens a call, cuDNN and flash — whether sharing K/V changes the rate
    per FLOP (the FLOPs are the query heads'; the compute model reads no K/V head count)."""
    out = []
    for backend in ("cudnn", "flash"):
        for s in (2048, 8192):
            for hq in (8, 16, 64):
                for hkv in sorted({hq, hq // 4, hq // 8}, reverse=True):
                    b = max(1, 16384 // s)
                    try:
                        ms_f, ms_b = _attn_times(backend, True, b, hq, s, s, 128, hkv)
                    except Exception as e:  # (a backend without GQA: said, the rest go on)
                        out.append({"backend": backend, "seq": s, "heads": hq, "kv_heads": hkv,
                                    "error": f"{type(e).__name__}: {str(e)[:160]}"})
                        continue
                    flop = 2 * b * hq * s * s * 128  # causal: 4·b·h·s²·d / 2
                    out.append({"backend": backend, "seq": s, "heads": hq, "kv_heads": hkv,
                                "fwd_ms": ms_f, "bwd_ms": ms_b,
                                "fwd_eff": flop / ms_f / 1e9 / args.peak_tflops,
                                "bwd_eff": 2.5 * flop / ms_b / 1e9 / args.peak_tflops})
    return out


def _merge_ms(b: int, h: int, s: int, d: int) -> float:
    """The ring's partial-softmax merge of one step (out = o₁·e^(l₁−l) + o₂·e^(l₂−l))."""
    import torch

    o1, o2 = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    l1, l2 = (torch.randn(b, h, s, device="cuda") for _ in range(2))

    def merge() -> Any:
        lse = torch.logaddexp(l1, l2)
        w1, w2 = torch.exp(l1 - lse).unsqueeze(-1), torch.exp(l2 - lse).unsqueeze(-1)
        return (o1.float() * w1 + o2.float() * w2).to(torch.bfloat16)

    return _time_ms(merge)


def cp_ring(args: argparse.Namespace) -> list[Row]:
    """Context parallelism 2 on one GPU: a rank's work in Transformer Engine's load-balanced
    ring (sequence in 4 chunks of c, rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2):
    step 0 causal over its own 2c; step 1 rank 0's last chunk against the other's 2c K/V
    (q c × kv 2c), rank 1's 2c queries against chunk 0 (q 2c × kv c), then the merge.
    Against cp 1's whole causal attention over 4c: ideal is half of it."""
    out = []
    d = 128
    for backend, h in (("cudnn", 8), ("cudnn", 16), ("flash", 8)):
        for total in (8192, 16384, 32768):
            c = total // 4
            full_f, full_b = _attn_times(backend, True, 1, h, total, total, d)
            s0_f, s0_b = _attn_times(backend, True, 1, h, 2 * c, 2 * c, d)
            r0_f, r0_b = _attn_times(backend, False, 1, h, c, 2 * c, d)
            r1_f, r1_b = _attn_times(backend, False, 1, h, 2 * c, c, d)
            m0, m1 = _merge_ms(1, h, c, d), _merge_ms(1, h, 2 * c, d)
            rank0 = s0_f + s0_b + r0_f + r0_b + 2 * m0  # merge in forward and its backward
            rank1 = s0_f + s0_b + r1_f + r1_b + 2 * m1
            half = (full_f + full_b) / 2
            out.append({"backend": backend, "heads": h, "seq": total, "full_fwd_ms": full_f,
                        "full_bwd_ms": full_b, "step0_ms": s0_f + s0_b,
                        "step1_rank0_ms": r0_f + r0_b, "step1_rank1_ms": r1_f + r1_b,
                        "merge_rank1_ms": m1, "rank0_over_half": rank0 / half,
                        "rank1_over_half": rank1 / half})
    return out


def memory_bound(args: argparse.Namespace) -> list[Row]:
    import torch
    import torch.nn.functional as F

    n = 1 << 28  # 256 Mi bf16 elements, 512 MiB per tensor: far beyond the L2
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    rows = x.view(n // 8192, 8192)
    ln = torch.nn.LayerNorm(8192, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(8192, device="cuda", dtype=torch.bfloat16)
    half = n // 2
    a, g = x[:half].view(-1, 8192), y[:half].view(-1, 8192)
    cases: dict[str, tuple[Callable[[], object], float]] = {
        "copy": (lambda: x.clone(), 2), "add": (lambda: x + y, 3),
        "gelu": (lambda: F.gelu(x), 2), "layernorm": (lambda: ln(rows), 2),
        "rmsnorm": (lambda: F.rms_norm(rows, (8192,), w), 2),
        "swiglu": (lambda: F.silu(a) * g, 1.5),  # two halves read, one half written
        "softmax": (lambda: torch.softmax(rows, dim=-1), 2),
        "cast_fp8": (lambda: x.to(torch.float8_e4m3fn), 1.5),
    }
    compiled = {"layernorm": lambda t: F.layer_norm(t, (8192,), w, w),
                "rmsnorm": lambda t: F.rms_norm(t, (8192,), w),
                "gelu": lambda t: F.gelu(t, approximate="tanh"),
                "swiglu": lambda t: F.silu(t[:, :4096]) * t[:, 4096:]}
    for name, f in compiled.items():
        try:
            cf = torch.compile(f)
            cases[f"compiled_{name}"] = ((lambda cf=cf: cf(rows)),
                                         1.5 if name == "swiglu" else 2)
        except Exception:  # torch.compile may be unavailable; the eager rows still count
            pass
    out = []
    for name, (fn, tensors) in cases.items():
        try:
            ms = _time_ms(fn)
        except Exception as e:  # a compile failure surfaces at the first call
            out.append({"kernel": name, "error": str(e).splitlines()[0][:120]})
            continue
        gbps = tensors * n * 2 / ms / 1e6
        out.append({"kernel": name, "ms": ms, "GBps": gbps, "efficiency": gbps / args.hbm_gbps})
    return out


def launch(args: argparse.Namespace) -> list[Row]:
    """Eager launch rate: back-to-back tiny kernels (host-bound), wall time per launch."""
    import torch

    x = torch.randn(256, device="cuda")
    out = []
    for reps in (1000, 5000):
        for _ in range(100):
            x.add_(1.0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            x.add_(1.0)
        torch.cuda.synchronize()
        out.append({"kernels": reps, "us_per_launch": (time.perf_counter() - t0) / reps * 1e6})
    # GPU side: the stream held by a sleeping kernel while the host queues the tiny kernels, so
    # the device runs them back to back (the per-kernel gap the catalog's launch overhead is)
    for reps in (200, 1000):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(200_000_000)  # ~0.1 s at 1.98 GHz: longer than the queueing
        start.record()
        for _ in range(reps):
            x.add_(1.0)
        end.record()
        torch.cuda.synchronize()
        out.append({"kernels": reps, "gpu_us_per_kernel": start.elapsed_time(end) * 1e3 / reps})
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(1000):
            x.add_(1.0)
    g.replay()
    ms = _time_ms(g.replay, warmup=2, reps=5)
    out.append({"kernels": 1000, "graph_us_per_kernel": ms * 1e3 / 1000})
    return out


def _hold(fn: Callable[[], object], flop: float, seconds: float, nv: Any) -> list[Row]:
    import torch

    samples, t_end, last = [], time.time() + seconds, time.time()
    while time.time() < t_end:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        now = time.time()
        samples.append({"t": now, "tflops": 20 * flop / (now - last) / 1e12, **_clock_power(nv)})
        last = now
    return [r for r in samples if r["t"] > t_end - seconds / 2]


def sustained(args: argparse.Namespace) -> list[Row]:
    """Burst vs sustained (the catalog's ``sustained_clock_ratio``): an 8192³ GEMM timed after
    two idle seconds (boost clock), then held back to back; the rate, SM clock and power over
    the second half of the window (the chip at its power limit)."""
    import torch

    nv = _nvml()
    out = []
    m = 8192
    for dtype, make, window in (("bf16", _gemm_bf16, args.hold_s), ("fp8", _gemm_fp8, 4.0)):
        fn, flop = make(m, m, m), 2.0 * m**3
        fn()
        torch.cuda.synchronize()
        time.sleep(2.0)
        idle = _clock_power(nv)
        burst_ms = _time_ms(fn, warmup=2, reps=5)
        tail = _hold(fn, flop, window, nv)
        med = {key: statistics.median(r[key] for r in tail) for key in tail[0] if key != "t"}
        burst = flop / burst_ms / 1e9
        out.append({"dtype": dtype, "burst_tflops": burst, "held_tflops": med["tflops"],
                    "ratio": med["tflops"] / burst, "idle_sm_mhz": idle.get("sm_mhz"),
                    "held_sm_mhz": med.get("sm_mhz"), "held_power_w": med.get("power_w"),
                    "held_temp_c": med.get("temp_c")})
    return out


SECTIONS: list[tuple[str, Callable[..., list[Row]]]] = [
    ("env", env_info), ("gemm_bf16", lambda a: gemms(a, "bf16")),
    ("gemm_fp8", lambda a: gemms(a, "fp8")), ("gemm_fp8_fast", lambda a: gemms(a, "fp8_fast")),
    ("attention", attention),
    ("gemm_bf16_held", lambda a: gemms_held(a, "bf16")),
    ("gemm_fp8_held", lambda a: gemms_held(a, "fp8")),
    ("attention_held", attention_held),
    ("attention_occupancy", attention_occupancy),
    ("attention_grid", attention_grid), ("attention_gqa", attention_gqa), ("cp_ring", cp_ring),
    ("memory_bound", memory_bound), ("launch", launch), ("sustained", sustained),
]


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--peak-tflops", type=float, default=989.4, help="dense bf16 peak")
    ap.add_argument("--peak-fp8-tflops", type=float, default=1978.9, help="dense fp8 peak")
    ap.add_argument("--hbm-gbps", type=float, default=4800.0, help="HBM bandwidth, 10^9 B/s")
    ap.add_argument("--hold-s", type=float, default=8.0, help="sustained window, seconds")
    ap.add_argument("--only", nargs="*", help="run these sections only")
    ap.add_argument("--out", help="write the results as JSON here (after every section)")
    return run_sections(SECTIONS, ap.parse_args())


def script_main(sections: list[tuple[str, Callable[..., list[Row]]]], doc: str | None,
                hbm: bool = False) -> int:
    """The command line of a device script whose sections are ``sections``: ``--only``,
    ``--out`` and, with ``hbm``, ``--hbm-gbps`` (what efficiencies are fractions of)."""
    ap = argparse.ArgumentParser(description=doc)
    if hbm:
        ap.add_argument("--hbm-gbps", type=float, default=4800.0, help="HBM bandwidth, 10^9 B/s")
    ap.add_argument("--only", nargs="*", help="run these sections only")
    ap.add_argument("--out", help="write the results as JSON here (after every section)")
    return run_sections(sections, ap.parse_args())


def run_sections(sections: list[tuple[str, Callable[..., list[Row]]]],
                 args: argparse.Namespace) -> int:
    """Run each section (all, or those in ``args.only``), print its rows, and rewrite
    ``args.out`` as JSON after every one; a failing section records its traceback. Exit
    status 2, with a message, where PyTorch or a CUDA device is missing."""
    try:
        import torch
    except ImportError:
        print("PyTorch is not installed: this script is for the device machine", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("no CUDA device: this script is for the device machine", file=sys.stderr)
        return 2
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d")}
    for name, fn in sections:
        if args.only and name not in args.only:
            continue
        t0 = time.time()
        try:
            rows = fn(args)
        except Exception:  # keep the other sections' numbers
            rows = [{"error": traceback.format_exc()[-1500:]}]
        result[name] = rows
        print(f"## {name} ({time.time() - t0:.1f} s)", flush=True)
        for row in rows:
            print("  " + ", ".join(f"{k}={_fmt(v)}" for k, v in row.items()), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
