"""Measure, on one NVIDIA GPU (PyTorch), the memory the trainsim memory model takes as runtime
allowances (``tracegen/memory.py``: ``RUNTIME_BYTES``, ``FRAGMENTATION``):

- ``runtime``: device memory outside PyTorch's caching allocator, read from NVML as a process
  brings up what a training process does — the CUDA context, a BF16 GEMM (cuBLAS handle and
  workspace), an FP8 GEMM (cuBLASLt), cuDNN attention forward and backward, and a one-rank
  NCCL process group with an all-reduce (one rank has no peers: NCCL's per-peer channel
  buffers are not in it) — each step's growth in NVML's used memory less the allocator's
  reserved bytes;
- ``fragmentation``: the caching allocator's peak reserved over peak allocated bytes through
  three training steps of a Llama-like stack (8 layers, hidden 4,096, SwiGLU 14,336, 32
  heads of which 8 KV, 4,096 tokens a micro-batch, 4 micro-batches a step, BF16 autocast,
  fused AdamW), with the default allocator and with ``expandable_segments`` (each in its
  own process: the setting is read when CUDA starts).

Output conventions as ``measure_hopper.py`` (``--out`` JSON rewritten after each section).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_hopper import Row, _nvml, env_info, script_main

MiB = 2**20


def _used(nv: Any) -> int:
    """NVML's used bytes on device 0 (every process, the driver's reservation included)."""
    return int(nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(0)).used)


def _runtime_steps() -> list[tuple[str, Callable[[], object]]]:
    import torch
    import torch.nn.functional as F

    def gemm() -> object:
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        return a @ a

    def fp8() -> object:
        a = torch.randn(4096, 4096, device="cuda").to(torch.float8_e4m3fn)
        one = torch.tensor(1.0, device="cuda")
        return torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    def attention() -> object:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q = torch.randn(1, 32, 4096, 128, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
            out.sum().backward()
        return out

    def nccl() -> object:
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        dist.init_process_group("nccl", rank=0, world_size=1)
        t = torch.ones(MiB, device="cuda")
        dist.all_reduce(t)
        return t

    return [("context", lambda: torch.empty(1, device="cuda")), ("cublas_bf16_gemm", gemm),
            ("cublaslt_fp8_gemm", fp8), ("cudnn_attention", attention), ("nccl_one_rank", nccl)]


def runtime(args: argparse.Namespace) -> list[Row]:
    """Per bring-up step: NVML's used memory, the allocator's reserved bytes, and the growth
    outside the allocator since the step before (MiB)."""
    import torch

    nv = _nvml()
    if nv is None:
        return [{"error": "pynvml is missing: NVML's used memory cannot be read"}]
    base = _used(nv)
    out: list[Row] = [{"step": "before_cuda", "used_MiB": base / MiB, "reserved_MiB": 0.0,
                       "outside_allocator_growth_MiB": 0.0}]
    last = base
    for name, step in _runtime_steps():
        try:
            step()
            torch.cuda.synchronize()
        except Exception as e:  # keep the other steps' numbers
            out.append({"step": name, "error": str(e).splitlines()[0][:160]})
            continue
        used, reserved = _used(nv), torch.cuda.memory_reserved()
        outside = used - base - reserved
        out.append({"step": name, "used_MiB": used / MiB, "reserved_MiB": reserved / MiB,
                    "outside_allocator_MiB": outside / MiB,
                    "outside_allocator_growth_MiB": (used - last) / MiB})
        last = used
    return out


TRAIN = r"""
import json, torch, torch.nn as nn, torch.nn.functional as F
h, f, heads, kv, s, layers = 4096, 14336, 32, 8, 4096, 8
d = h // heads
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(h), nn.RMSNorm(h)
        self.qkv = nn.Linear(h, (heads + 2 * kv) * d, bias=False)
        self.proj = nn.Linear(h, h, bias=False)
        self.fc1 = nn.Linear(h, 2 * f, bias=False)
        self.fc2 = nn.Linear(f, h, bias=False)
    def forward(self, x):
        q, k, v = self.qkv(self.n1(x)).split([heads * d, kv * d, kv * d], -1)
        q = q.view(1, s, heads, d).transpose(1, 2)
        k = k.view(1, s, kv, d).transpose(1, 2).repeat_interleave(heads // kv, 1)
        v = v.view(1, s, kv, d).transpose(1, 2).repeat_interleave(heads // kv, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(1, s, h))
        g, u = self.fc1(self.n2(x)).chunk(2, -1)
        return x + self.fc2(F.silu(g) * u)
with torch.device("cuda"):  # initialised on the GPU (CPU init of 1.75 G parameters is slow)
    model = nn.Sequential(*[Block() for _ in range(layers)])
opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
for step in range(3):
    for micro in range(4):
        x = torch.randn(1, s, h, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().pow(2).mean()
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
torch.cuda.synchronize()
st = torch.cuda.memory_stats()
print(json.dumps({"peak_allocated_MiB": st["allocated_bytes.all.peak"] / 2**20,
                  "peak_reserved_MiB": st["reserved_bytes.all.peak"] / 2**20,
                  "segments": st["segment.all.peak"], "alloc_retries": st["num_alloc_retries"],
                  "params": sum(p.numel() for p in model.parameters())}))
"""


def fragmentation(args: argparse.Namespace) -> list[Row]:
    """Peak reserved over peak allocated through three training steps, per allocator
    setting (each in a fresh process)."""
    out: list[Row] = []
    for conf in ("", "expandable_segments:True"):
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": conf}
        r = subprocess.run([sys.executable, "-c", TRAIN], capture_output=True, text=True,
                           env=env, timeout=240)
        if r.returncode:
            out.append({"alloc_conf": conf or "default", "error": r.stderr[-400:]})
            continue
        got = json.loads(r.stdout.strip().splitlines()[-1])
        got["fragmentation"] = got["peak_reserved_MiB"] / got["peak_allocated_MiB"] - 1
        out.append({"alloc_conf": conf or "default", **got})
    return out


SECTIONS: list[tuple[str, Callable[..., list[Row]]]] = [
    ("runtime", runtime), ("env", env_info), ("fragmentation", fragmentation)]
# runtime first: NVML's reading before CUDA starts is its baseline (env_info starts it)


def main() -> int:
    return script_main(SECTIONS, __doc__)


if __name__ == "__main__":
    sys.exit(main())
