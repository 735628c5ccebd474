"""Named software stacks for ``trainsim validate --stack`` and ``estimate --stack``: what a
framework's published runs have switched on that the public-runs schema has no column for
(overlaps, parameter gathers in FP8, the fused loss, 16-bit gradient reduction, the attention
kernel of the time), each as the ``--set`` overrides and ``--attention`` kernel trainsim's own
reference sets are validated with.

One source: the reference-set tests and ``bench/reference_sets.py`` read their stacks from here,
so a stack a user names is the one whose errors the README quotes. Each stack names its
evidence (the recipe or script that sets it) and the set that holds it; a row's own cells
(true/false switches, its ``fp8_recipe``) still win over a stack, and ``--set`` and
``--attention`` over both; in ``estimate``, the options given on its command line. A value the
layout has no use for (``inapplicable``) is left out either way, and said.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from replay.attention_kernels import kernel_overrides
from replay.hardware import SystemSpec
from tracegen import ConfigError, ModelSpec, Strategy
from tracegen.errors import did_you_mean

STRATEGY_SECTION, MODEL_SECTION = "strategy.", "model."
# the estimate option that sets a strategy field, where its name is not the field's
CLI_OPTION = {"grad_reduce_in_bf16": "grad_reduce_bf16"}


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
          _frozen({}), "unfused",  # (the kernel: gpu.flash_attention = false)
          "the paper's stack predates FlashAttention (softmax attention unfused); "
          "tests/test_validate.py (megatron2022_runs.csv)"),
    Stack("llm-foundry", "MosaicML llm-foundry / Composer benchmark runs (2023)",
          _frozen({"model.dropout": 0.0}), None,
          "the benchmark yamls train without dropout; tests/test_mpt_benchmarks.py"),
)})


def split_overrides(overrides: Mapping[str, Any]
                    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(system ``section.key`` values, strategy fields given as ``strategy.field``, model fields
    given as ``model.field``)."""
    def section(prefix: str) -> dict[str, Any]:
        return {k.removeprefix(prefix): v for k, v in overrides.items() if k.startswith(prefix)}

    system = {k: v for k, v in overrides.items()
              if not k.startswith((STRATEGY_SECTION, MODEL_SECTION))}
    return system, section(STRATEGY_SECTION), section(MODEL_SECTION)


class Layout(NamedTuple):
    """What of a strategy decides whether a stack's value has use there (``inapplicable``)."""

    tp: int
    sp: bool
    zero_stage: int
    precision: str
    moe_with_ep: bool  # a MoE model with expert parallelism


def inapplicable(field: str, value: Any, layout: Layout) -> str | None:
    """Why a strategy value a stack or ``--set`` gives does nothing on a layout (so it is left
    out, and said), in words that follow "not applied"; None where it applies. TP overlap needs
    TP collectives and, in Megatron, sequence parallelism; ZeRO-3 prefetch, ZeRO-3; a MoE
    dispatcher, expert parallelism; FP8 gathers, an FP8 run with sharded parameters; an FP8
    recipe, an FP8 run; the overlapped parameter gather, ZeRO 1 or 2 (the only stages that
    gather after the step)."""
    if field == "tp_comm_overlap" and value and layout.tp == 1:
        return "at tp 1 (no TP collectives)"
    if field == "tp_comm_overlap" and value and not layout.sp:
        return "without sequence parallelism (Megatron overlaps the sequence-parallel gathers)"
    if field == "zero3_prefetch" and value and layout.zero_stage != 3:
        return f"at zero_stage {layout.zero_stage} (no ZeRO-3 gathers)"
    if field == "moe_dispatcher" and value != "alltoall" and not layout.moe_with_ep:
        return "(no expert-parallel dispatch on this row)"
    sharded = layout.zero_stage >= 1
    if field == "fp8_param_gather" and value and not (layout.precision == "fp8" and sharded):
        return "(it needs an FP8 run on ZeRO 1, 2 or 3)"
    if field == "fp8_recipe" and layout.precision != "fp8":
        return f"(a {layout.precision.upper()} run: the recipe scales FP8 tensors)"
    if field == "overlap_param_gather" and value and layout.zero_stage not in (1, 2):
        return (f"at zero_stage {layout.zero_stage} (only ZeRO 1 and 2 gather parameters after "
                "the step)")
    return None


def get_stack(name: str, what: str = "--stack") -> Stack:
    """The stack of that name, or a ConfigError naming the known ones."""
    try:
        return STACKS[name]
    except KeyError:
        known = ", ".join(f"{k} ({s.describes})" for k, s in STACKS.items())
        raise ConfigError(f"no stack named {name!r}; {did_you_mean(name, STACKS)}known: "
                          f"{known}", what=what) from None


def with_stack(stack: str | None, overrides: Mapping[str, Any], attention: str | None
               ) -> tuple[dict[str, Any], str | None]:
    """``validate``'s overrides and attention kernel with a named stack under them: the
    caller's ``--set`` values and ``--attention`` win over the stack's."""
    if stack is None:
        return dict(overrides), attention
    s = get_stack(stack, what="validate --stack")
    return {**s.overrides, **overrides}, attention if attention is not None else s.attention


def layout_of(strategy: Strategy, model: ModelSpec) -> Layout:
    """What of ``strategy`` (on ``model``) decides whether a stack's value has use there."""
    return Layout(strategy.tp, strategy.sequence_parallel, strategy.zero_stage,
                  strategy.precision, model.is_moe and strategy.ep > 1)


def stack_values(stack: Stack, layout: Layout, given: Collection[str]
                 ) -> tuple[dict[str, Any], list[str]]:
    """The stack's strategy values a strategy of ``layout`` takes — those ``given`` (the fields
    its user set) and those it has no use for (``inapplicable``) aside — and what is said of
    the ones left out for no use."""
    used: dict[str, Any] = {}
    notes = []
    for field, value in split_overrides(stack.overrides)[1].items():
        if field in given:
            continue
        why = inapplicable(field, value, layout)
        if why:
            notes.append(f"{field} not applied {why}")
        else:
            used[field] = value
    return used, notes


def with_stack_strategy(stack: Stack, strategy: Strategy, model: ModelSpec,
                        given: Collection[str]) -> Strategy:
    """``strategy`` with the stack's values it takes (``stack_values``)."""
    used, _ = stack_values(stack, layout_of(strategy, model), given)
    return Strategy.from_dict({**strategy.to_dict(), **used}) if used else strategy


def stack_model(stack: Stack, model: ModelSpec) -> ModelSpec:
    """``model`` with the stack's model values (``model.field`` overrides)."""
    model_over = split_overrides(stack.overrides)[2]
    return ModelSpec.from_dict({**model.to_dict(), **model_over}) if model_over else model


def stack_system(stack: Stack, system: SystemSpec, *, kernel_given: bool
                 ) -> tuple[SystemSpec, dict[str, Any]]:
    """``system`` with the stack's system values and attention kernel (unless
    ``kernel_given``: a kernel the user named wins), and the values it set."""
    system_over = split_overrides(stack.overrides)[0]
    if stack.attention and not kernel_given:
        system_over = {**kernel_overrides(stack.attention, system.gpu.name), **system_over}
    return (system.with_overrides(system_over) if system_over else system), system_over


@dataclasses.dataclass(frozen=True)
class Applied:
    """A strategy under a stack (``apply_stack``), with what was said about each value."""

    model: ModelSpec
    strategy: Strategy
    system: SystemSpec | None
    notes: tuple[str, ...]


def command_parts(name: str, system_ref: str) -> tuple[str, str]:
    """How ``trainsim estimate`` spells a study's strategy under stack ``name``, its flags
    already spelling each strategy field: the system with the stack's attention kernel
    (``SYSTEM@KERNEL``, unless the reference names one), and ``--stack NAME`` where the stack
    sets no strategy field (its model values then come exactly; one that did would fill the
    fields the flags leave at their defaults, which the strategy may hold on purpose)."""
    stack = get_stack(name)
    if stack.attention and "@" not in system_ref:
        system_ref = f"{system_ref}@{stack.attention}"
    strategy_over = split_overrides(stack.overrides)[1]
    return system_ref, ("" if strategy_over else f"--stack {name}")


def _option(field: str) -> str:
    """The estimate option that sets a strategy field."""
    return "--" + CLI_OPTION.get(field, field).replace("_", "-")


def apply_stack(stack: Stack, model: ModelSpec, strategy: Strategy, system: SystemSpec | None, *,
                given: Collection[str], kernel_given: bool) -> Applied:
    """One strategy as ``stack`` runs it (``trainsim estimate --stack``): its strategy values
    where the command line gave none (``given``: the fields it set) and the layout has use for
    them (``inapplicable``), its model values, its system values and attention kernel (unless
    ``kernel_given``: a kernel named on ``--system`` wins; no system: ``tracegen`` without
    one). Each value left out is said."""
    _, strategy_over, model_over = split_overrides(stack.overrides)
    used, notes = stack_values(stack, layout_of(strategy, model), given)
    notes += [f"{field} = {value!r} not applied ({_option(field)} given)"
              for field, value in strategy_over.items()
              if field in given and getattr(strategy, field) != value]
    if used:
        strategy = Strategy.from_dict({**strategy.to_dict(), **used})
    model, system_over = stack_model(stack, model), dict[str, Any]()
    if system is not None:
        system, system_over = stack_system(stack, system, kernel_given=kernel_given)
    if stack.attention and kernel_given:
        notes.append(f"attention kernel {stack.attention} not applied (--system names one)")
    set_here = [f"{k} = {v!r}" for k, v in (*used.items(), *model_over.items(),
                                              *system_over.items())]
    said = f"stack {stack.name} ({stack.describes}): " + (", ".join(set_here) or "nothing set")
    return Applied(model, strategy, system, (said, *notes))
