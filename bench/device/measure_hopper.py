"""Measure GEMM, attention and memory-bound kernel rates on one NVIDIA GPU (PyTorch).

Prints a table and, with --out, writes JSON with the implied efficiencies for the trainsim
catalog (peak bf16 and HBM bandwidth given by --peak-tflops / --hbm-gbps; H200 defaults).
Timing: CUDA events, warm-up then the median of repeated runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _time_ms(fn, *, warmup: int = 3, reps: int = 10) -> float:  # type: ignore[no-untyped-def]
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def gemms(peak: float) -> list[dict[str, float]]:
    import torch

    out = []
    shapes = [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 12288, 4096),
              (16384, 4096, 12288), (8192, 28672, 8192), (8192, 8192, 28672),
              (2048, 2048, 13312), (4096, 5120, 5120), (4096, 1536, 12288), (1000, 4096, 4096)]
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        ms = _time_ms(lambda a=a, b=b: a @ b)
        tflops = 2 * m * n * k / ms / 1e9
        out.append({"m": m, "n": n, "k": k, "ms": ms, "tflops": tflops,
                    "efficiency": tflops / peak})
    return out


def sustained(peak: float, window_s: float = 3.0) -> dict[str, float]:
    """Burst vs sustained matmul (the catalog's ``sustained_clock_ratio``): one large bf16 GEMM
    timed cold after an idle second (the burst, at boost clock), then back to back for
    ``window_s`` seconds, the rate over the last second (the chip at its power limit)."""
    import torch

    m = n = k = 8192
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    flop = 2 * m * n * k
    torch.cuda.synchronize()
    time.sleep(1.0)
    burst_ms = _time_ms(lambda: a @ b, warmup=2, reps=5)
    t_end, done, last = time.time() + window_s, [], time.time()
    while time.time() < t_end:
        for _ in range(20):
            a @ b
        torch.cuda.synchronize()
        now = time.time()
        done.append((now, 20 * flop / (now - last)))
        last = now
    tail = [r for t, r in done if t > t_end - 1.0]
    held = statistics.median(tail) / 1e12
    return {"burst_tflops": flop / burst_ms / 1e9, "sustained_tflops": held,
            "sustained_efficiency": held / peak,
            "ratio": held / (flop / burst_ms / 1e9)}


def attention(peak: float) -> list[dict[str, float]]:
    import torch
    import torch.nn.functional as F

    out = []
    heads, hd = 16, 128
    for seq in (512, 1024, 2048, 4096, 8192, 16384):
        batch = max(1, 16384 // seq)
        q, k, v = (torch.randn(batch, heads, seq, hd, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        for causal in (False, True):
            flop = 4 * batch * heads * seq * seq * hd / (2 if causal else 1)

            def fwd(q=q, k=k, v=v, causal=causal):  # type: ignore[no-untyped-def]
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            ms_f = _time_ms(fwd)
            o = fwd()
            g = torch.randn_like(o)
            inputs = (q, k, v)
            ms_b = _time_ms(lambda o=o, g=g, inputs=inputs: torch.autograd.grad(
                o, inputs, g, retain_graph=True))
            out.append({"seq": seq, "causal": causal, "fwd_tflops": flop / ms_f / 1e9,
                        "bwd_tflops": 2.5 * flop / ms_b / 1e9,
                        "fwd_efficiency": flop / ms_f / 1e9 / peak,
                        "bwd_over_fwd": (2.5 * flop / ms_b) / (flop / ms_f)})
    return out


def memory_bound(hbm_gbps: float) -> list[dict[str, float]]:
    import torch
    import torch.nn.functional as F

    n = 1 << 28  # 256 Mi elements of bf16 = 512 MiB per tensor
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    rows = torch.randn(n // 8192, 8192, device="cuda", dtype=torch.bfloat16)
    ln = torch.nn.LayerNorm(8192, device="cuda", dtype=torch.bfloat16)
    cases = {"copy": (lambda: x.clone(), 2), "add": (lambda: x + y, 3),
             "gelu": (lambda: F.gelu(x), 2), "layernorm": (lambda: ln(rows), 2)}
    out = []
    for name, (fn, tensors) in cases.items():
        ms = _time_ms(fn)
        gbps = tensors * n * 2 / ms / 1e6
        out.append({"kernel": name, "ms": ms, "GBps": gbps, "efficiency": gbps / hbm_gbps})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--peak-tflops", type=float, default=989.4, help="dense bf16 peak")
    ap.add_argument("--hbm-gbps", type=float, default=4800.0, help="HBM bandwidth, 10^9 B/s")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("PyTorch is not installed: this script is for the device machine", file=sys.stderr)
        return 2

    if not torch.cuda.is_available():
        print("no CUDA device: this script is for the device machine", file=sys.stderr)
        return 2
    t0 = time.time()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "gemm": gemms(args.peak_tflops),
              "attention": attention(args.peak_tflops),
              "memory_bound": memory_bound(args.hbm_gbps),
              "sustained": [sustained(args.peak_tflops)]}
    result["seconds"] = time.time() - t0
    for section in ("gemm", "attention", "memory_bound", "sustained"):
        print(f"## {section}")
        for row in result[section]:  # type: ignore[attr-defined]
            print("  " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                                   for k, v in row.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
