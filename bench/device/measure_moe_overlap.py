"""Measure, on one NVIDIA GPU, MoE expert GEMMs as Megatron-Core runs them and how compute and a
communication-like kernel slow each other when they share the GPU.

Sections (JSON after every one, as ``measure_hopper.py``):

- ``grouped_gemm``: g experts' GEMMs of m tokens each (fc1 m×2f×h, fc2 m×h×f, fc2's weight
  gradient h×f over m) at the expert shapes of Qwen3-235B-A22B, Qwen3-30B-A3B, DeepSeek-V3 and
  Mixtral 8x7B: one cuBLAS GEMM per expert round-robin on 4 streams (Transformer Engine's
  ``GroupedLinear`` through ``nvte_multi_stream_cublas_gemm``), PyTorch's CUTLASS grouped GEMM
  (``torch._grouped_mm``, torchtitan's path), and the one GEMM of g·m rows with the same FLOPs;
- ``overlap``: a foreground (a GEMM, or a communication-like kernel) timed alone and while a
  background of the other kind keeps the GPU busy. The communication-like kernels stand for an
  NCCL collective's footprint (NCCL runs one 512-thread block per channel, 16-32 channels):
  ``copy`` moves HBM to HBM from a fixed number of persistent blocks (a send at HBM speed; it
  reads and writes the local HBM where a send writes a peer's), ``spin`` holds its blocks for a
  fixed wall time and touches no memory (a collective waiting on a slow network). Background
  stream at normal or high priority. This is not NCCL: one GPU has no peer to send to;
- ``launch_wait``: how long such a kernel, launched while back-to-back GEMMs run, waits for
  SMs (per call, by GEMM length and priority); ``held_comm``: GEMMs beside one that started
  first and holds 8-32 blocks throughout; ``carveout``: the wait with PyTorch's experimental
  cuBLAS SM carveout;
- ``held_kernels`` (memory-bound kernels and attention beside held SMs), ``grouped_fp8``,
  ``grouped_imbalance`` (experts with unequal token counts), ``merged_emulation`` (combined
  1F1B's merged pass on one GPU), ``comm_speed`` and ``paced_comm_speed`` (the communication-like
  copy's own speed beside compute, unpaced and held to a network's pace): each function says
  what it times.

Run on the device: ``python3 bench/device/measure_moe_overlap.py --out $OUT/moe_overlap.json``
(it needs PyTorch and CuPy, both in that image).
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure_hopper import SLEEP_CYCLES, Row, _gemm_fp8, _sdpa, _time_ms, env_info, script_main

# (model, hidden h, expert ffn f) of the MoE validation and example models' configs.
EXPERTS = [("qwen3_235b", 4096, 1536), ("qwen3_30b", 2048, 768),
           ("deepseek_v3", 7168, 2048), ("mixtral_8x7b", 4096, 14336)]
# (tokens per expert m, local experts g): top-k · tokens / g at ep · g = experts.
GROUPS = [(512, 4), (2048, 4), (8192, 4), (512, 16), (2048, 16), (8192, 16)]
MAX_FLOP = 8e12  # skip bigger calls (Mixtral at 16 experts and 8K tokens each)
SPIN_MS = 2.0  # the spin kernel's wall time as a foreground
STREAMS = 4  # Transformer Engine's num_streams (multi_streams.h)

KERNELS = r"""
extern "C" __global__ void copy_persistent(const float4* __restrict__ src,
                                           float4* __restrict__ dst, long long n,
                                           int passes) {
  long long stride = (long long)gridDim.x * blockDim.x;
  for (int p = 0; p < passes; ++p)
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
      dst[i] = src[i];
}
extern "C" __global__ void copy_paced(const float4* __restrict__ src,
                                      float4* __restrict__ dst, long long n, int passes,
                                      unsigned long long ns_per_step) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  long long stride = (long long)gridDim.x * blockDim.x, step = 0;
  for (int p = 0; p < passes; ++p)
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
      dst[i] = src[i];
      unsigned long long deadline = t0 + (unsigned long long)(++step) * ns_per_step;
      do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t < deadline);
    }
}
extern "C" __global__ void spin(unsigned long long dur_ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < dur_ns);
}
"""


def _gemm_shapes(h: int, f: int) -> list[tuple[str, int, int, bool]]:
    """(name, n, k, wgrad) of Y[m,n] = X[m,k]·W[n,k]ᵀ, or dW[n,k] = dYᵀ·X reducing over m."""
    return [("fc1", 2 * f, h, False), ("fc2", h, f, False), ("fc2_wgrad", h, f, True)]


def _per_expert(m: int, n: int, k: int, g: int, wgrad: bool) -> Callable[[], object]:
    """One cuBLAS GEMM per expert, round-robin on STREAMS side streams joined to the caller's."""
    import torch

    if wgrad:  # dW_e[n,k] = dY_e[m,n]ᵀ · X_e[m,k]
        dy = [torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(g)]
        x = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(g)]
        calls = [(lambda a=a, b=b: a.t() @ b) for a, b in zip(dy, x, strict=True)]
    else:
        x = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(g)]
        w = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(g)]
        calls = [(lambda a=a, b=b: a @ b.t()) for a, b in zip(x, w, strict=True)]
    return _round_robin(calls)


def _grouped_mm(m: int, n: int, k: int, g: int, wgrad: bool) -> Callable[[], object]:
    """``torch._grouped_mm``: one CUTLASS kernel over the experts (offsets = cumulative m)."""
    import torch

    offs = torch.arange(m, m * g + 1, m, device="cuda", dtype=torch.int32)
    if wgrad:  # K-grouped: dW[g,n,k] from dYᵀ[n, g·m] and X[g·m, k]
        dy = torch.randn(g * m, n, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(g * m, k, device="cuda", dtype=torch.bfloat16)
        return lambda: torch._grouped_mm(dy.t(), x, offs)
    x = torch.randn(g * m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16)
    return lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs)


def _one_gemm(m: int, n: int, k: int) -> Callable[[], object]:
    import torch

    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    return lambda: a @ w.t()


def _grouped_row(model: str, name: str, m: int, n: int, k: int, g: int,
                 wgrad: bool) -> Row:
    import torch

    flop = 2.0 * m * g * n * k
    row: Row = {"model": model, "gemm": name, "m": m, "n": n, "k": k, "g": g,
                "wgrad": wgrad, "flop": flop}
    makers: dict[str, Callable[[], Callable[[], object]]] = {
        "streams": partial(_per_expert, m, n, k, g, wgrad),
        "grouped_mm": partial(_grouped_mm, m, n, k, g, wgrad),
        "one_gemm": partial(_one_gemm, n, k, m * g) if wgrad else partial(_one_gemm, m * g, n, k)}
    for key, make in makers.items():
        try:
            ms = _time_ms(make(), reps=5, batches=3)
            row[key + "_ms"], row[key + "_tflops"] = ms, flop / ms / 1e9
        except Exception as e:  # record and go on (e.g. no grouped GEMM in this build)
            row[key + "_error"] = repr(e)[:200]
        torch.cuda.empty_cache()
    return row


def grouped_gemm(args: argparse.Namespace) -> list[Row]:
    return [_grouped_row(model, name, m, n, k, g, wgrad)
            for model, h, f in EXPERTS for m, g in GROUPS
            for name, n, k, wgrad in _gemm_shapes(h, f) if 2.0 * m * g * n * k <= MAX_FLOP]


class _Comm:
    """The communication-like kernels (CuPy raw CUDA, launched on a PyTorch stream)."""

    def __init__(self, blocks: int, copy_bytes: int) -> None:
        import cupy

        mod = cupy.RawModule(code=KERNELS)
        self.copy_k, self.spin_k = mod.get_function("copy_persistent"), mod.get_function("spin")
        self.paced_k = mod.get_function("copy_paced")
        self.blocks, self.n4 = blocks, copy_bytes // 16
        self.src = cupy.random.random(copy_bytes // 4, dtype=cupy.float32)
        self.dst = cupy.empty_like(self.src)
        self.cupy = cupy

    def _on(self, stream: Any) -> Any:
        return self.cupy.cuda.ExternalStream(stream.cuda_stream)

    def copy(self, stream: Any, times: int = 1, passes: int = 1) -> None:
        import numpy as np

        with self._on(stream):
            for _ in range(times):
                self.copy_k((self.blocks,), (512,),
                            (self.src, self.dst, np.int64(self.n4), np.int32(passes)))

    def paced(self, stream: Any, gbps: float, passes: int = 1) -> None:
        """The copy held to ``gbps`` (10^9 bytes read a second; as many written): each thread
        waits after each 16-byte step until its share of the rate allows the next."""
        import numpy as np

        ns_per_step = self.blocks * 512 * 16 / gbps
        with self._on(stream):
            self.paced_k((self.blocks,), (512,), (self.src, self.dst, np.int64(self.n4),
                                                  np.int32(passes), np.uint64(round(ns_per_step))))

    def spin_fg(self, stream: Any) -> None:
        self.spin(stream, SPIN_MS * 1e6)

    def spin(self, stream: Any, ns: float) -> None:
        import numpy as np

        with self._on(stream):
            self.spin_k((self.blocks,), (512,), (np.uint64(int(ns)),))


def _timed_beside(fg: Callable[[Any], None], bg: Callable[[Any], None], *, reps: int,
                  fg_priority: int = 0, bg_priority: int = 0) -> Row:
    """Milliseconds per foreground call while the background runs on another stream. Both
    streams wait behind sleeping kernels so that everything is queued first; the background
    starts ~1 ms before the foreground's timed calls, sized by the caller to outlast them
    (``covered``: it did, in every batch). Priorities: lower is higher (CUDA)."""
    import torch

    s_fg = torch.cuda.Stream(priority=fg_priority)
    s_bg = torch.cuda.Stream(priority=bg_priority)
    times, covered = [], True
    for _ in range(3):
        torch.cuda.synchronize()
        start, end, bg_end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        with torch.cuda.stream(s_bg):
            torch.cuda._sleep(SLEEP_CYCLES)
        bg(s_bg)
        with torch.cuda.stream(s_bg):
            bg_end.record()
        with torch.cuda.stream(s_fg):
            torch.cuda._sleep(SLEEP_CYCLES + 2_000_000)
            start.record()
        for _ in range(reps):
            fg(s_fg)
        with torch.cuda.stream(s_fg):
            end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
        covered = covered and end.elapsed_time(bg_end) > 0
    return {"ms": statistics.median(times), "covered": covered}


def _alone(fg: Callable[[Any], None], reps: int) -> float:
    ms: float = _timed_beside(fg, lambda _s: None, reps=reps)["ms"]
    return ms


def _gemm_bg(fn: Callable[[], object], n: int) -> Callable[[Any], None]:
    def run(stream: Any) -> None:
        import torch

        with torch.cuda.stream(stream):
            for _ in range(n):
                fn()
    return run


def _on(fn: Callable[[], object]) -> Callable[[Any], None]:
    def run(stream: Any) -> None:
        import torch

        with torch.cuda.stream(stream):
            fn()
    return run


def _gemm_rows(comm: _Comm, name: str, g: Callable[[], object], copy_ms: float,
               spin_ms: float) -> list[Row]:
    """A GEMM beside the copy / the spin at normal and high background priority; then the
    copy and the spin beside back-to-back GEMMs, at normal and high foreground priority."""
    g_ms = _alone(_on(g), reps=10)
    need_ms = 3.0 * (1.0 + 10 * g_ms * 2.5)  # outlast the 1 ms offset and a slowed batch
    base: Row = {"blocks": comm.blocks, "gemm": name, "gemm_alone_ms": g_ms}
    rows = []
    for prio in (0, -10):
        with_copy = _timed_beside(_on(g), lambda s: comm.copy(s, math.ceil(need_ms / copy_ms)),
                                  bg_priority=prio, reps=10)
        with_spin = _timed_beside(_on(g), lambda s: comm.spin(s, need_ms * 1e6),
                                  bg_priority=prio, reps=10)
        rows.append({**base, "fg": "gemm", "comm_priority": prio,
                     "beside_copy_ms": with_copy["ms"], "beside_spin_ms": with_spin["ms"],
                     "slowdown_copy": with_copy["ms"] / g_ms,
                     "slowdown_spin": with_spin["ms"] / g_ms,
                     "covered": with_copy["covered"] and with_spin["covered"]})
    bg = _gemm_bg(g, math.ceil(3.0 * (1.0 + 10 * max(copy_ms, SPIN_MS) * 3) / g_ms))
    for prio in (0, -10):
        copy = _timed_beside(comm.copy, bg, fg_priority=prio, reps=10)
        spin = _timed_beside(comm.spin_fg, bg, fg_priority=prio,
                             reps=5)
        rows.append({**base, "fg": "comm", "comm_priority": prio, "copy_alone_ms": copy_ms,
                     "copy_beside_gemm_ms": copy["ms"], "copy_slowdown": copy["ms"] / copy_ms,
                     "spin_beside_gemm_ms": spin["ms"], "spin_extra_ms": spin["ms"] - spin_ms,
                     "covered": copy["covered"] and spin["covered"]})
    return rows


def overlap(args: argparse.Namespace) -> list[Row]:
    gemms = {"cube8k": _one_gemm(8192, 8192, 8192),
             "expert_fc1_qwen3_235b": _one_gemm(8192, 3072, 4096),
             "l70b_tp4_fc2": _one_gemm(8192, 8192, 7168)}
    out: list[Row] = []
    for blocks in (16, 32):
        comm = _Comm(blocks, 256 * 2**20)
        copy_ms = _alone(comm.copy, reps=10)
        spin_ms = _alone(comm.spin_fg, reps=5)
        out.append({"blocks": blocks, "fg": "comm_alone", "copy_alone_ms": copy_ms,
                    "copy_GBps": 2 * comm.n4 * 16 / copy_ms / 1e6, "spin_alone_ms": spin_ms})
        for name, g in gemms.items():
            out.extend(_gemm_rows(comm, name, g, copy_ms, spin_ms))
    return out


LAUNCH_GEMMS = {"cube2k": (2048, 2048, 2048), "cube4k": (4096, 4096, 4096),
                "expert_fc1_qwen3_235b": (8192, 3072, 4096), "cube8k": (8192, 8192, 8192),
                "cube12k": (12288, 12288, 12288)}
WAIT_SPIN_MS = 0.5  # the communication-like kernel's own length in ``launch_wait``


def _per_call_beside(fg: Callable[[Any], None], bg: Callable[[Any], None], calls: int,
                     fg_priority: int = 0) -> list[float]:
    """Milliseconds of each of ``calls`` foreground calls (launch to end: an event between
    each) while the background runs on another stream, as ``_timed_beside``."""
    import torch

    s_fg, s_bg = torch.cuda.Stream(priority=fg_priority), torch.cuda.Stream()
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(calls + 1)]
    with torch.cuda.stream(s_bg):
        torch.cuda._sleep(SLEEP_CYCLES)
    bg(s_bg)
    with torch.cuda.stream(s_fg):
        torch.cuda._sleep(SLEEP_CYCLES + 2_000_000)
        events[0].record()
    for i in range(calls):
        fg(s_fg)
        with torch.cuda.stream(s_fg):
            events[i + 1].record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in itertools.pairwise(events)]


def _quantiles(xs: list[float]) -> Row:
    q = statistics.quantiles(xs, n=10)
    return {"mean": statistics.fmean(xs), "median": statistics.median(xs), "p10": q[0],
            "p90": q[-1], "max": max(xs)}


def launch_wait(args: argparse.Namespace) -> list[Row]:
    """How long a communication-like kernel launched beside back-to-back GEMMs waits for SMs:
    40 spins of 0.5 ms back to back (each launched as the last ends, at a random phase of the
    GEMMs), each one's launch-to-end time less its time alone, by GEMM length and priority."""
    out: list[Row] = []
    for blocks in (16, 32):
        comm = _Comm(blocks, 2**20)
        spin = partial(comm.spin, ns=WAIT_SPIN_MS * 1e6)
        alone = _per_call_beside(spin, lambda _s: None, 20)
        alone_ms = statistics.median(alone)
        out.append({"blocks": blocks, "gemm": None, "spin_alone_ms": alone_ms})
        for name, (m, n, k) in LAUNCH_GEMMS.items():
            g = _one_gemm(m, n, k)
            g_ms = _alone(_on(g), reps=10)
            bg = _gemm_bg(g, math.ceil((3.0 + 40 * (WAIT_SPIN_MS + 2 * g_ms) * 1.5) / g_ms))
            for prio in (0, -10):
                waits = [t - alone_ms for t in _per_call_beside(spin, bg, 40, prio)]
                out.append({"blocks": blocks, "gemm": name, "gemm_ms": g_ms,
                            "comm_priority": prio, "spin_alone_ms": alone_ms,
                            **{f"wait_{k}_ms": v for k, v in _quantiles(waits).items()}})
    return out


def _beside_held(comm: _Comm, fn: Callable[[], object], pass_ms: float) -> tuple[float, Row]:
    """``fn``'s milliseconds alone, and its slowdown beside the spin and beside the looping
    copy, each started first and outlasting ten slowed calls."""
    ms = _alone(_on(fn), reps=10)
    need_ms = 3.0 * (1.0 + 10 * ms * 2.5)
    spin = _timed_beside(_on(fn), partial(comm.spin, ns=need_ms * 1e6), reps=10)
    copy = _timed_beside(_on(fn), partial(comm.copy, passes=math.ceil(need_ms / pass_ms)),
                         reps=10)
    return ms, {"slowdown_spin": spin["ms"] / ms, "slowdown_copy": copy["ms"] / ms,
                "covered": spin["covered"] and copy["covered"]}


def held_comm(args: argparse.Namespace) -> list[Row]:
    """GEMMs beside one long communication-like kernel that started first and holds its blocks
    throughout (a collective launched before the compute it overlaps): the spin (SMs only) and
    a copy looping over 1 GiB (SMs and HBM)."""
    out: list[Row] = []
    for blocks in (8, 16, 24, 32):
        comm = _Comm(blocks, 2**30)
        pass_ms = _alone(comm.copy, reps=3)
        for name, (m, n, k) in LAUNCH_GEMMS.items():
            g_ms, held = _beside_held(comm, _one_gemm(m, n, k), pass_ms)
            out.append({"blocks": blocks, "gemm": name, "gemm_ms": g_ms,
                        "copy_pass_GBps": 2 * 2**30 / pass_ms / 1e6, **held})
    return out


def carveout(args: argparse.Namespace) -> list[Row]:
    """The same wait with cuBLAS told to leave SMs free (PyTorch's experimental SM carveout,
    as Transformer Engine's GEMM SM margin), and what the carveout costs the GEMM alone."""
    import torch

    out: list[Row] = []
    for sms in (16, 32):
        comm = _Comm(sms, 2**20)
        spin = partial(comm.spin, ns=WAIT_SPIN_MS * 1e6)
        alone_ms = statistics.median(_per_call_beside(spin, lambda _s: None, 20))
        torch._C._set_sm_carveout_experimental(sms)
        try:
            for name in ("cube4k", "cube8k"):
                m, n, k = LAUNCH_GEMMS[name]
                g = _one_gemm(m, n, k)
                g_ms = _alone(_on(g), reps=10)
                bg = _gemm_bg(g, math.ceil((3.0 + 40 * (WAIT_SPIN_MS + 2 * g_ms) * 1.5) / g_ms))
                waits = [t - alone_ms for t in _per_call_beside(spin, bg, 40)]
                out.append({"carveout_sms": sms, "blocks": sms, "gemm": name,
                            "gemm_ms_carved": g_ms,
                            **{f"wait_{k}_ms": v for k, v in _quantiles(waits).items()}})
        finally:
            torch._C._set_sm_carveout_experimental(None)
    return out


def _held_kernels() -> dict[str, Callable[[], object]]:
    """Memory-bound kernels (64 Mi bf16 elements, far beyond the L2) and causal cuDNN
    attention (4K tokens, head dim 128, 16 heads, forward and backward), each one call."""
    import torch
    import torch.nn.functional as F

    n = 1 << 26
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    rows, w = x.view(-1, 8192), torch.randn(8192, device="cuda", dtype=torch.bfloat16)
    qkv = [torch.randn(1, 4096, 16, 128, device="cuda", dtype=torch.bfloat16,
                       requires_grad=True) for _ in range(3)]
    q, k, v = (t.transpose(1, 2) for t in qkv)
    sdpa = _sdpa("cudnn", True)
    o = sdpa(q, k, v)
    grad = torch.randn_like(o)
    return {"add": lambda: x + y, "rmsnorm": lambda: F.rms_norm(rows, (8192,), w),
            "swiglu": lambda: F.silu(rows[:, :4096]) * rows[:, 4096:],
            "attention_fwd": lambda: sdpa(q, k, v),
            "attention_bwd": lambda: torch.autograd.grad(o, qkv, grad, retain_graph=True)}


def held_kernels(args: argparse.Namespace) -> list[Row]:
    """Memory-bound kernels and attention beside a communication-like kernel that started
    first and holds 16 or 32 blocks throughout (spin: SMs only; copy: SMs and HBM): does the
    slowdown of GEMMs (``held_comm``) hold for them?"""
    out: list[Row] = []
    kernels = _held_kernels()
    for blocks in (16, 32):
        comm = _Comm(blocks, 2**30)
        pass_ms = _alone(comm.copy, reps=3)
        for name, fn in kernels.items():
            k_ms, held = _beside_held(comm, fn, pass_ms)
            out.append({"blocks": blocks, "kernel": name, "alone_ms": k_ms, **held})
    return out


def _per_expert_fp8(ms: list[int], n: int, k: int) -> Callable[[], object]:
    """FP8 (tensor-wise scaled, as Transformer Engine's delayed scaling) GEMMs of ``ms`` rows
    each, round-robin on STREAMS side streams, as ``_per_expert``."""
    return _round_robin([_gemm_fp8(m, n, k) for m in ms])


def grouped_fp8(args: argparse.Namespace) -> list[Row]:
    """FP8 expert groups (fc1 and fc2 of Qwen3-235B and DeepSeek-V3, 4 or 16 experts of 512 or
    2,048 tokens) on four streams, each expert's GEMM alone, and the one GEMM of all rows."""
    out: list[Row] = []
    for model, h, f in EXPERTS[:3:2]:
        for m, g in ((512, 4), (2048, 4), (512, 16), (2048, 16)):
            for name, n, k, _w in _gemm_shapes(h, f)[:2]:
                row: Row = {"model": model, "gemm": name, "m": m, "n": n, "k": k, "g": g,
                            "flop": 2.0 * m * g * n * k}
                for key, make in (("streams", partial(_per_expert_fp8, [m] * g, n, k)),
                                  ("expert", partial(_gemm_fp8, m, n, k)),
                                  ("one_gemm", partial(_gemm_fp8, m * g, n, k))):
                    try:
                        row[key + "_ms"] = _time_ms(make(), reps=5, batches=3)
                    except Exception as e:  # record and go on
                        row[key + "_error"] = repr(e)[:200]
                out.append(row)
    return out


def grouped_imbalance(args: argparse.Namespace) -> list[Row]:
    """BF16 groups whose experts get unequal token counts (a multinomial draw of top-k routing
    with the given relative spread of expert popularity, seed fixed), against the balanced
    group of the same total: what balanced routing in the model leaves out."""
    import random

    out: list[Row] = []
    rng = random.Random(7)
    for model, h, f in EXPERTS[:2]:
        for m, g in ((512, 16), (2048, 16), (2048, 4)):
            for spread in (0.0, 0.2, 0.5):
                weights = [max(0.05, 1 + spread * rng.gauss(0, 1)) for _ in range(g)]
                total = m * g
                ms = [max(16, round(total * w / sum(weights) / 16) * 16) for w in weights]
                row: Row = {"model": model, "m": m, "g": g, "spread": spread, "ms": ms,
                            "n": 2 * f, "k": h}
                try:
                    group = _round_robin([_one_gemm(m, 2 * f, h) for m in ms])
                    row["streams_ms"] = _time_ms(group, reps=5, batches=3)
                except Exception as e:  # record and go on
                    row["error"] = repr(e)[:200]
                out.append(row)
    return out


def _round_robin(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """The calls round-robin on STREAMS side streams joined to the caller's stream
    (Transformer Engine's ``nvte_multi_stream_cublas_gemm``)."""
    import torch

    streams = [torch.cuda.Stream() for _ in range(STREAMS)]

    def run() -> None:
        main = torch.cuda.current_stream()
        for s in streams:
            s.wait_stream(main)
        for i, call in enumerate(calls):
            with torch.cuda.stream(streams[i % STREAMS]):
                call()
        for s in streams:
            main.wait_stream(s)
    return run


# Combined 1F1B's merged pass, one layer pair (Megatron-Core's schedule plan): four steps,
# each a compute piece on the compute stream beside a communication piece on another; a step's
# compute waits for the communication of the step before, its communication for the compute
# of the step before: (F attention | B combine-backward), (B MLP-backward | F dispatch),
# (F MLP | B dispatch-backward), (B attention-backward | F combine).
MERGED_COMPUTE = {"attn": (8192, 4096, 4096), "mlp": (8192, 3072, 4096),
                  "mlp_bwd": (8192, 3072, 8192), "attn_bwd": (8192, 4096, 8192)}
MERGED_ORDER = ("attn", "mlp_bwd", "mlp", "attn_bwd")


def _merged_run(gemms: dict[str, Callable[[], object]], comm: _Comm, comm_ns: float,
                layers: int, overlap: bool) -> float:
    """Milliseconds for ``layers`` merged layer pairs, the pieces as in the plan above; without
    ``overlap`` every piece runs on one stream, one after another."""
    import torch

    s_comp, s_comm = torch.cuda.Stream(), torch.cuda.Stream()
    if not overlap:
        s_comm = s_comp
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(s_comp):
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
    s_comm.wait_stream(s_comp)
    for _ in range(layers):
        for name in MERGED_ORDER:
            with torch.cuda.stream(s_comp):
                gemms[name]()
            comm.spin(s_comm, comm_ns)
            s_comp.wait_stream(s_comm)  # the next step's compute waits for this communication
            s_comm.wait_stream(s_comp)  # ... and the next communication for this compute
    with torch.cuda.stream(s_comp):
        end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end))


def merged_emulation(args: argparse.Namespace) -> list[Row]:
    """The merged layer pairs with communication standing in for the all-to-alls (the spin
    holding ``blocks`` SMs for a set wall time: a dispatch bound by the network), overlapped
    and one after another, with each piece timed alone — the data to hold trainsim's model of
    the merged pass against on one GPU."""
    out: list[Row] = []
    gemms = {name: _one_gemm(*shape) for name, shape in MERGED_COMPUTE.items()}
    alone = {name: _alone(_on(g), reps=10) for name, g in gemms.items()}
    for blocks in (8, 24):
        comm = _Comm(blocks, 2**20)
        for comm_ms in (0.1, 0.3, 0.6, 1.2):
            spin_ms = _alone(partial(comm.spin, ns=comm_ms * 1e6), reps=5)
            runs = {key: statistics.median(
                _merged_run(gemms, comm, comm_ms * 1e6, 20, key == "overlapped")
                for _ in range(3)) for key in ("serial", "overlapped")}
            out.append({"blocks": blocks, "comm_ms": comm_ms, "spin_alone_ms": spin_ms,
                        **{f"{k}_alone_ms": v for k, v in alone.items()},
                        "layers": 20, "serial_ms": runs["serial"],
                        "overlapped_ms": runs["overlapped"]})
    return out


def comm_speed(args: argparse.Namespace) -> list[Row]:
    """The communication-like copy's own speed when it started first and compute runs beside
    it: one copy kernel looping ~30 ms over 1 GiB, alone and with back-to-back GEMMs (8K cube,
    Qwen3-235B expert fc1) or memory-bound adds on another stream, launched ~1 ms after it
    (the copy's time: events around it on its own stream)."""
    import torch

    n = 1 << 26
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    backgrounds: dict[str, Callable[[], object] | None] = {
        "alone": None, "cube8k": _one_gemm(8192, 8192, 8192),
        "expert_fc1_qwen3_235b": _one_gemm(8192, 3072, 4096), "add": lambda: x + y}
    out: list[Row] = []
    for blocks in (8, 16, 24, 32):
        comm = _Comm(blocks, 2**30)
        passes = max(1, round(30.0 / _alone(comm.copy, reps=3)))
        for name, fn in backgrounds.items():
            copy_ms = _copy_beside(comm, passes, fn)
            out.append({"blocks": blocks, "beside": name, "passes": passes, "copy_ms": copy_ms,
                        "GBps": 2 * 2**30 * passes / copy_ms / 1e6})
    return out


def _copy_beside(comm: _Comm, passes: int, fn: Callable[[], object] | None,
                 gbps: float = 0.0) -> float:
    """Median over three tries of the looping copy's milliseconds (held to ``gbps`` where
    given), with ``fn`` back to back on another stream from ~1 ms after the copy starts until
    well after it ends."""
    import torch

    times = []
    for _ in range(3):
        s_comm, s_bg = torch.cuda.Stream(), torch.cuda.Stream()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(s_comm):
            torch.cuda._sleep(SLEEP_CYCLES)
            start.record()
        if gbps:
            comm.paced(s_comm, gbps, passes)
        else:
            comm.copy(s_comm, passes=passes)
        with torch.cuda.stream(s_comm):
            end.record()
        if fn is not None:
            with torch.cuda.stream(s_bg):
                torch.cuda._sleep(SLEEP_CYCLES + 2_000_000)
                for _ in range(1000):
                    fn()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def paced_comm_speed(args: argparse.Namespace) -> list[Row]:
    """A copy of 32 blocks held to 50, 370 or 1,000 GB/s (a NIC's, an NVLink ring's, a fast
    all-to-all's pace) for ~30 ms, alone and beside back-to-back GEMMs or memory-bound adds:
    does a transfer whose pace the network sets slow beside compute as an HBM-bound one does
    (``comm_speed``)?"""
    import torch

    n = 1 << 26
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    backgrounds: dict[str, Callable[[], object] | None] = {
        "alone": None, "cube8k": _one_gemm(8192, 8192, 8192), "add": lambda: x + y}
    comm = _Comm(32, 2**28)
    out: list[Row] = []
    for gbps in (50.0, 370.0, 1000.0):
        passes = max(1, round(30e-3 * gbps * 1e9 / 2**28))
        for name, fn in backgrounds.items():
            ms = _copy_beside(comm, passes, fn, gbps)
            out.append({"blocks": 32, "target_GBps": gbps, "beside": name, "passes": passes,
                        "copy_ms": ms, "GBps": 2**28 * passes / ms / 1e6})
    return out


SECTIONS: list[tuple[str, Callable[..., list[Row]]]] = [
    ("env", env_info), ("overlap", overlap), ("grouped_gemm", grouped_gemm),
    ("launch_wait", launch_wait), ("held_comm", held_comm), ("carveout", carveout),
    ("held_kernels", held_kernels), ("grouped_fp8", grouped_fp8),
    ("grouped_imbalance", grouped_imbalance), ("merged_emulation", merged_emulation),
    ("comm_speed", comm_speed), ("paced_comm_speed", paced_comm_speed)]


def main() -> int:
    return script_main(SECTIONS, __doc__)


if __name__ == "__main__":
    sys.exit(main())
