"""Which precision? One strategy under every precision and FP8 recipe trainsim models
(``trainsim estimate --precisions``): BF16 (FP16 on a GPU without BF16 tensor cores), FP8
with delayed scaling, current scaling and MXFP8 blocks, and NVFP4 — each costed by the fast
path with everything else of the strategy kept, or named with the tensor cores the GPU lacks.

What changes with the precision: the linear layers' GEMMs and their casts, FP8's sequence-
parallel gathers (1 byte under per-tensor scaling), the copies kept for the weight gradients
and the cached weights; FP8 parameter gathers stay as set for the FP8 rows and are off for
the others (they need FP8). MFU is not compared: each row's is against its own peak.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from analysis.compare import strategy_label
from analysis.schedules import estimate_changed
from replay.hardware import GPUSpec, SystemSpec
from tracegen.model import ModelSpec
from tracegen.strategy import Strategy


@dataclasses.dataclass(frozen=True, slots=True)
class PrecisionRow:
    """One precision (and FP8 recipe) for the strategy: its estimate, or why it cannot run."""

    name: str  # "bf16", "fp8 tensorwise", "nvfp4", …
    strategy: Strategy | None  # None where refused
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    peak_memory_GiB: float = 0.0
    fits: bool = False
    refused: str = ""  # what the GPU lacks, or the first reason ``Strategy`` gives
    current: bool = False  # the strategy as given

    def to_dict(self) -> dict[str, Any]:
        return {"precision": self.name, "step_time_s": self.step_time_s or None,
                "tokens_per_s": self.tokens_per_s or None,
                "peak_memory_GiB": self.peak_memory_GiB or None,
                "fits": self.fits if not self.refused else None,
                "refused": self.refused or None, "current": self.current,
                "strategy": strategy_label(self.strategy) if self.strategy else None}


def _candidates(s: Strategy, gpu: GPUSpec) -> list[tuple[str, dict[str, Any]]]:
    """(name, fields changed) of every precision tried for ``s``."""
    fp8_gathers = s.fp8_param_gather if s.precision == "fp8" else False
    plain = {"fp8_param_gather": False, "fp8_recipe": "delayed"}
    sixteen = "bf16" if gpu.bf16 else "fp16"
    out: list[tuple[str, dict[str, Any]]] = [(sixteen, {**plain, "precision": sixteen})]
    out += [(f"fp8 {recipe}", {"precision": "fp8", "fp8_recipe": recipe,
                               "fp8_param_gather": fp8_gathers})
            for recipe in ("delayed", "tensorwise", "mxfp8")]
    out.append(("nvfp4", {**plain, "precision": "nvfp4"}))
    return out


def precision_rows(model: ModelSpec, s: Strategy, system: SystemSpec) -> list[PrecisionRow]:
    """``s`` under every precision and FP8 recipe its GPU runs, fastest first, then the ones
    it cannot run with the reason."""
    ran: list[PrecisionRow] = []
    refused: list[PrecisionRow] = []
    # (a recipe named beside a 16-bit precision means nothing: the row is the default's)
    given = s if s.precision == "fp8" else dataclasses.replace(s, fp8_recipe="delayed")
    for name, changes in _candidates(s, system.gpu):
        done = (system.gpu.lacks(changes["precision"], changes["fp8_recipe"])
                or estimate_changed(model, s, changes, system))
        if isinstance(done, str):
            refused.append(PrecisionRow(name, None, refused=done))
            continue
        alt, got = done
        tokens_per_s = alt.global_batch_size * model.seq_len / got.step_time_s
        ran.append(PrecisionRow(name, alt, got.step_time_s, tokens_per_s, got.peak_memory_GiB,
                                got.fits, current=alt == given))
    return sorted(ran, key=lambda r: r.step_time_s) + refused
