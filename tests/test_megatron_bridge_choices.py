"""Choices measured on one stack: Megatron-Bridge's skills notes measure Llama 3 70B SFT on 32
H100s in FP8 current scaling (its recipe ``LLAMA3_70B_SFT_CONFIG_H100_FP8_CS_V1``: tp 4, pp 4 ×
vp 5 with SP, dp 2, micro-batch 1, global batch 32, 4,096 tokens, core attention recomputed)
and variants of it, each as model TFLOP/s a GPU (the same model FLOPs whatever is recomputed,
so their ratios are step ratios) and peak allocated memory. What a planner choosing between
strategies relies on: how much each choice costs. The stack as Megatron-Bridge runs its FP8
recipes (FP8 parameter gathers, TP overlap, overlapped gathers, 16-bit gradient reduction);
not modelled: the recipe's CUDA graphs of the MLP and how its SFT data is packed (neither
stated with the runs). Bounds are what was reached (seventy-first session); nothing fitted."""

from __future__ import annotations

import dataclasses

import pytest

from analysis.glance import Glance, glance
from tracegen import Strategy, get_model

BASELINE_TFLOPS = 704.0  # "~704" (the golden figure, 709.93, is another run)


def _sft(**kw: object) -> Glance:
    base: dict[str, object] = dict(
        tp=4, pp=4, dp=2, vpp=5, schedule="interleaved_1f1b", sequence_parallel=True,
        micro_batch_size=1, global_batch_size=32, precision="fp8", fp8_recipe="tensorwise",
        recompute="selective", recompute_modules="core_attn", zero_stage=1,
        grad_reduce_in_bf16=True, fp8_param_gather=True, tp_comm_overlap=True,
        overlap_param_gather=True)
    model = dataclasses.replace(get_model("llama3-70b"), seq_len=4096)
    return glance(model, Strategy(**{**base, **kw}), "dgx-h100")  # type: ignore[arg-type]


def _held_GB(g: Glance) -> float:
    """The tensors held at the busiest stage's peak: the breakdown less its runtime and
    fragmentation allowances, which the allocator's peak does not see (decimal GB, as
    Megatron-Bridge logs ``mem-max-allocated-gigabytes``)."""
    return max(st.memory.total_bytes - st.memory.runtime_bytes - st.memory.fragmentation_bytes
               for st in g.stages) / 1e9


def test_the_recomputed_modules_cost_what_was_measured() -> None:
    """The activation-recompute skill's table: core_attn ~704 TFLOP/s, mlp 593.6, mlp and
    core_attn 586.8, core_attn and layernorm ~702. Step ratios 1.180, 1.203 and 1.004 against
    1.186, 1.200 and 1.003 measured. The mlp run's peak, 55.6 GB, against 54.4 GB held (−2.1%);
    the core_attn run's, ~59 GB (with expandable segments), against 67.8 GB (+15%): the
    MLP's activations of the 22 chunks stage 0 holds in flight, which the two runs' peaks
    put at ~3 GB, trainsim at 13 — what the recipe's CUDA-graphed MLP or its packed SFT data
    do to them is not stated, so this stays a gap, not a fit."""
    base = _sft()
    got = {mods: _sft(recompute_modules=mods)
           for mods in ("mlp", "mlp,core_attn", "core_attn,layernorm")}
    measured = {"mlp": 593.6, "mlp,core_attn": 586.8, "core_attn,layernorm": 702.0}
    for mods, tflops in measured.items():
        ratio = got[mods].step_time_s / base.step_time_s
        assert ratio == pytest.approx(BASELINE_TFLOPS / tflops, abs=0.008), (mods, ratio)
    assert _held_GB(got["mlp"]) / 55.6 - 1 == pytest.approx(-0.021, abs=0.005)
    assert _held_GB(base) / 59.0 - 1 == pytest.approx(0.149, abs=0.01)
    assert all(g.fits for g in (base, *got.values()))


def test_more_pipeline_or_tensor_parallelism_costs_in_the_measured_order() -> None:
    """The memory-tuning skill's table, the same 32 GPUs with dp 1: pp 8 (tp 4, vp 5) 668.0
    TFLOP/s, tp 8 (pp 4, vp 5) 508.7, against ~704 for the baseline. trainsim orders them as
    measured, pp 8 1.084 against 1.054 (3 points too slow), but tp 8 1.170 against 1.384:
    eight-way TP of a 70B model's 4,096-token FP8 layers costs the cluster far more than
    trainsim's exposed TP collectives and smaller GEMMs give (15% optimistic; Megatron-Bridge's
    performance guide calls tp 8 for Llama 3 70B host-performance bound, which trainsim does
    not model). Peaks: 53.2 and 50.2 GB measured against 61.3 and 47.5 held, in the measured
    order."""
    base, pp8, tp8 = _sft(), _sft(pp=8, dp=1), _sft(tp=8, dp=1)
    assert base.step_time_s < pp8.step_time_s < tp8.step_time_s
    # the ratio trainsim gives over the measured one, less 1: +2.8% and -15.5%
    for g, tflops, reached in ((pp8, 668.0, 0.028), (tp8, 508.7, -0.155)):
        ratio = g.step_time_s / base.step_time_s
        assert ratio / (BASELINE_TFLOPS / tflops) - 1 == pytest.approx(reached, abs=0.005)
    assert _held_GB(base) > _held_GB(pp8) > _held_GB(tp8)
    assert _held_GB(pp8) == pytest.approx(61.3, abs=0.2)
    assert _held_GB(tp8) == pytest.approx(47.5, abs=0.2)
