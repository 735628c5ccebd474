"""The memory-bound efficiency a GPU preset carries, from measured kernels: each memory-bound
operator of a training step is matched to the kernel family bench/device measured for it, and
the step's efficiency is its bytes over its time at those measured rates (a byte-weighted
harmonic mean). One number per GPU, the catalog's ``memory_efficiency``: the compute model
costs every memory-bound operator at it (``replay/compute.py``), so it is the rate of the mix,
not of any one kernel.

Families (what stands for what: Megatron-Core runs Transformer Engine's fused norms and
activations, which one GPU without TE cannot time; ``torch.compile``'s fused Triton kernels
stand for them, eager PyTorch's unfused ones do not):

- ``ce_forward`` / ``ce_backward``: Megatron-Core's vocab-parallel cross-entropy as eager
  PyTorch runs it (``measure_step_ops.py``'s ``cross_entropy``; Megatron runs these very ops);
- ``optimizer``: the gradient norm, fused AdamW and the copy into 16-bit weights together
  (``measure_step_ops.py``'s ``optimizer``, the pass ``step``);
- ``norm``: compiled RMSNorm (gated models, the Llama family) or LayerNorm;
- ``activation``: compiled SwiGLU or GELU;
- ``fp8_cast``: the cast to FP8 (eager: one kernel either way), NVFP4's casts too;
- ``residual``: an add (residual connections, their gradients);
- ``rope``: compiled rotary embedding (Megatron-Core fuses it by default; the unfused one ran
  at 0.07);
- ``embedding``: the embedding lookup (its gradient too);
- ``permute``: the MoE token permutations — the gather of each token's copies into expert
  order and the sort of what arrived into per-expert chunks, as eager PyTorch runs them
  (``measure_step_ops.py``'s ``moe_fused`` and ``moe_permutes``); the weighted combine back
  too, though no stand-in for Transformer Engine's fused combine was found (eager scatter-add
  0.08, a compiled gather-sum 0.77 at top-2 but 0.10-0.12 at top-8: Inductor's, not TE's);
- ``copy``: anything else that moves a tensor.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

import polars as pl

from replay.compute import RooflineCompute
from replay.hardware import SystemSpec
from tracegen import ops as O
from tracegen.errors import ConfigError
from tracegen.model import ModelSpec
from tracegen.strategy import Strategy

FAMILIES = ("ce_forward", "ce_backward", "optimizer", "norm", "activation", "fp8_cast",
            "residual", "rope", "embedding", "permute", "copy")
# the rows of measure_step_ops.py's sections that stand for a family
STEP_ROWS = {"cross_entropy": {"forward": "ce_forward", "backward": "ce_backward"},
             "optimizer": {"step": "optimizer"},
             "rope_embedding": {"compiled_rope": "rope", "embedding": "embedding"},
             "moe_fused": {"permute_by_expert": "permute"},
             "moe_permutes": {"sort_chunks": "permute"}}


def measured_efficiencies(runs: Iterable[dict[str, Any]], gated: bool) -> dict[str, float]:
    """Each family's efficiency (fraction of the HBM bandwidth the runs were measured
    against): the median over every run and shape that measured it. ``gated``: the model's
    MLP is SwiGLU (its norms RMSNorm) rather than GELU (LayerNorm)."""
    kernel = {"norm": "compiled_rmsnorm" if gated else "compiled_layernorm",
              "activation": "compiled_swiglu" if gated else "compiled_gelu",
              "fp8_cast": "cast_fp8", "residual": "add", "copy": "copy"}
    found: dict[str, list[float]] = {f: [] for f in FAMILIES}
    for run in runs:
        for r in run.get("memory_bound", []):
            for family, name in kernel.items():
                if r.get("kernel") == name and "efficiency" in r:
                    found[family].append(r["efficiency"])
        for section, families in STEP_ROWS.items():
            for r in run.get(section, []):
                if r.get("pass") in families and "efficiency" in r:
                    found[families[r["pass"]]].append(r["efficiency"])
    missing = [f for f, v in found.items() if not v]
    if missing:
        raise ConfigError(f"no measurement of {', '.join(missing)} in the runs given: add the "
                          "measure_hopper.py memory_bound and measure_step_ops.py runs",
                          what="device results")
    return {f: statistics.median(v) for f, v in found.items()}


def family(op: O.Op) -> str:
    """The measured kernel family that stands for a memory-bound tracegen operator."""
    if op.kind == "loss":
        return "ce_backward" if op.name.endswith("_bwd") else "ce_forward"
    if op.kind in ("norm", "optimizer"):
        return op.kind
    base = op.name.removesuffix("_bwd")
    if base.endswith(("_fp8_cast", "_nvfp4_cast", "_mxfp8_cast")):
        return "fp8_cast"
    if base.endswith("act"):
        return "activation"
    if op.kind == "embedding":
        return "embedding"
    for prefix, name in (("resid", "residual"), ("rope", "rope"), ("moe_", "permute")):
        if base.startswith(prefix):
            return name
    return "copy"


def step_ops(m: ModelSpec, s: Strategy) -> list[tuple[O.Op, int]]:
    """One rank's memory-bound operators of a step with their counts, as if it held a stage's
    layers (each forward and backward once per micro-batch) and the embedding and head too
    (once per micro-batch; exact at pp 1, a reference mix beyond), and the optimizer over
    its share of the parameters."""
    micro = s.global_batch_size // (s.dp * s.micro_batch_size)
    layers = m.num_layers // s.pp
    out: list[tuple[O.Op, int]] = []
    for items, times in ((O.layer_fwd(m, s) + O.layer_bwd(m, s), layers * micro),
                         (O.embedding_fwd(m, s) + O.embedding_bwd(m, s) + O.head_fwd(m, s)
                          + O.head_bwd(m, s), micro)):
        out += [(it, times) for it in items
                if isinstance(it, O.Op) and it.kind not in ("gemm", "attention")]
    shard = s.dp if s.zero_stage >= 1 else 1
    params = m.num_params() // (s.tp * s.pp * shard)
    out.append((O.optimizer_step(params, O.adam_bytes_per_param(s)), 1))
    return out


def step_efficiency(m: ModelSpec, s: Strategy, eff: dict[str, float]) -> float:
    """The step's memory-bound bytes over their time at the families' measured efficiencies
    (as a fraction of the bandwidth the efficiencies were measured against)."""
    pairs = [(op.bytes * n, eff[family(op)]) for op, n in step_ops(m, s) if op.bytes]
    return sum(b for b, _ in pairs) / sum(b / e for b, e in pairs)


def kernel_frame(run: dict[str, Any], system: SystemSpec) -> pl.DataFrame:
    """The optimizer steps and cross-entropy passes of a ``measure_step_ops.py`` run, each
    beside the compute model's time for the same bytes on ``system`` (the bytes ``tracegen``
    charges: ``ADAM_BYTES_PER_PARAM`` a parameter, ``CE_FWD_BYTES`` / ``CE_BWD_BYTES`` a
    logit), with the model's signed error in %."""
    model, rows = RooflineCompute(system.gpu), []
    for r in run.get("optimizer", []):
        if r["pass"] == "step":
            op = O.optimizer_step(r["params"])
            rows.append({"what": f"optimizer {r['shard']} {r['params'] / 1e6:.0f}M",
                         "measured_ms": r["ms"], "model_ms": model.op_time_ns(op) / 1e6})
    for r in run.get("cross_entropy", []):
        logits, bwd = r["tokens"] * r["vocab"], r["pass"] == "backward"
        nbytes = (O.CE_BWD_BYTES if bwd else O.CE_FWD_BYTES) * logits
        op = O.Op("cross_entropy_bwd" if bwd else "cross_entropy", "loss", 0, nbytes)
        rows.append({"what": f"cross-entropy {r['pass']} {r['tokens']}x{r['vocab']}",
                     "measured_ms": r["ms"], "model_ms": model.op_time_ns(op) / 1e6})
    frame = pl.DataFrame(rows)
    return frame.with_columns(
        ((pl.col("model_ms") / pl.col("measured_ms") - 1) * 100).alias("error_pct"))
