"""Named software stacks for ``trainsim validate --stack``: what a framework's published runs
have switched on that the public-runs schema has no column for (overlaps, parameter gathers in
FP8, the fused loss, 16-bit gradient reduction, the attention kernel of the time), each as the
``--set`` overrides and ``--attention`` kernel trainsim's own reference sets are validated with.

One source: the reference-set tests and ``bench/reference_sets.py`` read their stacks from here,
so a stack a user names is the one whose errors the README quotes. Each stack names its
evidence (the recipe or script that sets it) and the set that holds it; a row's own cells
(true/false switches, its ``fp8_recipe``) still win over a stack, and ``--set`` and
``--attention`` over both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from tracegen import ConfigError
from tracegen.errors import did_you_mean


@dataclasses.dataclass(frozen=True)
class Stack:
    """A framework's settings beyond the schema: ``overrides`` as ``validate``'s ``--set``
    takes them, ``attention`` as its ``--attention`` (None: the GPU preset's kernel)."""

    name: str
    describes: str
    overrides: Mapping[str, Any]
    attention: str | None
    evidence: str


def _frozen(d: dict[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(d)


STACKS: Mapping[str, Stack] = _frozen({s.name: s for s in (
    Stack("megatron-bridge", "NVIDIA Megatron-Bridge (NeMo 25.x-26.x) performance recipes",
          _frozen({"strategy.tp_comm_overlap": True, "strategy.overlap_param_gather": True,
                   "strategy.zero3_prefetch": True, "strategy.fp8_param_gather": True,
                   "strategy.cross_entropy_fusion": "native",
                   "strategy.fp8_recipe": "tensorwise", "strategy.grad_reduce_in_bf16": True}),
          None,  # (the Hopper preset is cuDNN 9.19's measured curve; Blackwell's borrows it)
          "scripts/performance: CommOverlapConfig's TP and DP overlaps, Megatron-FSDP's "
          "prefetched gathers, the FP8 current-scaling precision config (fp8_param_gather), "
          "the fused loss, each model's common config grad_reduce_in_fp32 = False; "
          "tests/test_megatron_bridge_runs.py"),
    Stack("nemo-24.07", "NVIDIA NeMo 2.0 (24.07 container) performance recipes",
          _frozen({"strategy.tp_comm_overlap": True, "strategy.overlap_param_gather": True,
                   "strategy.fp8_param_gather": True}),
          "cudnn",
          "MegatronCommOverlapCallback's TP and DP overlaps and the bf16_with_fp8_mixed "
          "recipe's fp8_params; cuDNN attention of mid-2024; tests/test_nemo_runs.py"),
    Stack("megatron-moe-modelzoo", "NVIDIA Megatron-MoE-ModelZoo's scripts (Megatron-LM, 2025)",
          _frozen({"strategy.overlap_param_gather": True, "strategy.fp8_param_gather": True,
                   "strategy.zero3_prefetch": True, "strategy.fp8_recipe": "tensorwise"}),
          None,
          "the repository's launch scripts (--overlap-param-gather, --fp8-param-gather, "
          "Megatron-FSDP's prefetch); tests/test_megatron_moe_runs.py"),
    Stack("megatron-lm-2022", "Megatron-LM as Korthikanti et al. 2022 ran it (A100)",
          _frozen({"gpu.flash_attention": False}), None,
          "the paper's stack predates FlashAttention (softmax attention unfused); "
          "tests/test_validate.py (megatron2022_runs.csv)"),
    Stack("llm-foundry", "MosaicML llm-foundry / Composer benchmark runs (2023)",
          _frozen({"model.dropout": 0.0}), None,
          "the benchmark yamls train without dropout; tests/test_mpt_benchmarks.py"),
)})


def get_stack(name: str) -> Stack:
    """The stack of that name, or a ConfigError naming the known ones."""
    try:
        return STACKS[name]
    except KeyError:
        known = ", ".join(f"{k} ({s.describes})" for k, s in STACKS.items())
        raise ConfigError(f"no stack named {name!r}; {did_you_mean(name, STACKS)}known: "
                          f"{known}", what="validate --stack") from None


def with_stack(stack: str | None, overrides: Mapping[str, Any], attention: str | None
               ) -> tuple[dict[str, Any], str | None]:
    """``validate``'s overrides and attention kernel with a named stack under them: the
    caller's ``--set`` values and ``--attention`` win over the stack's."""
    if stack is None:
        return dict(overrides), attention
    s = get_stack(stack)
    return {**s.overrides, **overrides}, attention if attention is not None else s.attention
