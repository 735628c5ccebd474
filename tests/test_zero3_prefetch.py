"""ZeRO-3 prefetch (``Strategy.zero3_prefetch``): the next block's parameter gathers run
alongside the current block's compute, at most two blocks gathered (PyTorch FSDP's forward and
backward prefetch, Megatron-FSDP)."""

from __future__ import annotations

import dataclasses
import tempfile

import pytest

from analysis.fastpath import estimate
from analysis.fastpath_stages import prefetch_pass
from replay import get_system, replay
from tracegen import ConfigError, ModelSpec, Strategy, generate

MODEL = ModelSpec(name="pf", num_layers=8, hidden_size=512, num_attention_heads=8,
                  num_kv_heads=4, ffn_hidden_size=2048, vocab_size=4096, seq_len=512,
                  activation="swiglu")
MOE = dataclasses.replace(MODEL, name="pfmoe", num_experts=8, experts_per_token=2,
                          moe_ffn_hidden_size=512)
BASE = Strategy(tp=1, pp=2, dp=4, zero_stage=3, zero3_prefetch=True, micro_batch_size=1,
                global_batch_size=16)


def test_a_pass_is_max_of_compute_and_the_next_gather_per_block() -> None:
    """Forward over blocks with compute f and gathers g: the first gather exposed, then each
    block takes max(f, next g) — the closed form of FSDP's prefetch with two blocks gathered."""
    comp, gathers = [5, 5, 5, 5], [(3, 0), (8, 0), (2, 0), (6, 0)]
    end, first, last, _ = prefetch_pass(range(4), comp, gathers, None, None, 0.0)
    assert first == 3
    assert end == last == 3 + max(5, 8) + max(5, 2) + max(5, 6) + 5
    # backward: each block's scatter follows its compute on the same stream as the gathers
    end, first, last, _ = prefetch_pass(range(3, -1, -1), comp, gathers, [(1, 0)] * 4, None,
                                         0.0)
    assert first == 6 and end == last + 1  # the last scatter is the tail


def test_interference_slows_a_block_beside_the_next_gather() -> None:
    """With interference κ a block's compute f runs at 1/(1 + κ) while the next gather g is in
    flight: max(f + min(κ·f, κ/(1 + κ)·g), g) per block, the pair formula of the op lists."""
    comp, gathers, k = [500] * 4, [(300, 0), (800, 0), (200, 0), (600, 0)], 0.25

    def pair(f: int, g: int) -> float:
        return max(f + min(k * f, k / (1 + k) * g), g)

    segs = [((500, 0),)] * 4  # runs of (kernel, overlapped collective): all compute
    end, _, _, _ = prefetch_pass(range(4), comp, gathers, None, segs, k)
    assert end == 300 + pair(500, 800) + pair(500, 200) + pair(500, 600) + 500


def test_interference_slows_a_blocks_kernels_not_its_collectives() -> None:
    """A block that starts with 200 of compute, then 100 of its own (blocking) collective,
    then 200 of compute, beside a next gather of 400 from its start: the first kernels run at
    1/(1 + κ) while the gather flies, the collective at full speed, the rest of the gather's
    span slows the second kernels — as replay slows kernels, not transfers."""
    k = 0.25
    segs = [((200, 0), (0, 100), (200, 0))] * 2  # (kernel, collective) runs
    end, _, last, _ = prefetch_pass(range(2), [500, 500], [(0, 0), (400, 0)], None, segs, k)
    # 0–250: 200 of compute at 1/1.25; 250–350: the collective; 350–400: 40 of compute slowed;
    # then the remaining 160 at full speed → 560; the second block runs unslowed: + 500
    assert last == end == 560 + 500


def test_a_kernel_beside_its_own_collective_and_a_gather_is_slowed_by_both() -> None:
    """A block's kernel of 400 with its own overlapped TP collective of 300 beside it, and the
    next block's gather of 500 from its start: both in flight until 300 (1/(1 + 2κ): 200 of
    work), the gather alone until 500 (160 more), then full speed (40): 540. The next block
    waits for its gather (500) and runs slowed by its own collective alone: 400 + κ/(1 + κ)·300
    = 460. Slowing the merged segment (460) by the gather alone gave 560 + 460."""
    k = 0.25
    segs = [((400, 300),)] * 2
    end, _, last, _ = prefetch_pass(range(2), [460, 460], [(0, 0), (500, 0)], None, segs, k)
    assert last == end == 540 + 460


def test_replay_runs_the_prefetched_trace_faster() -> None:
    """The trace issues each pass's later gathers off the compute chain; replay overlaps them
    with compute, so the step is shorter than with every gather blocking."""
    blocking = dataclasses.replace(BASE, zero3_prefetch=False)
    system = get_system("dgx-h100")
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        generate(MODEL, BASE, a, mode="representative")
        generate(MODEL, blocking, b, mode="representative")
        assert replay(a, system).step_time_s < replay(b, system).step_time_s


@pytest.mark.parametrize("model", [MODEL, MOE])
@pytest.mark.parametrize("kw", [{}, {"pp": 4, "dp": 2}, {"vpp": 2, "schedule": "interleaved_1f1b"},
                                {"recompute": "full"}, {"zero3_gather_bucket_params": 200_000},
                                {"tp": 2, "dp": 2, "sequence_parallel": True}])
@pytest.mark.parametrize("interference", [False, True])
def test_fast_path_equals_replay(model: ModelSpec, kw: dict[str, object],
                                 interference: bool) -> None:
    """The fast path walks each pass block by block and the pipeline step by step: the same
    times as replay (contention off), to the nanosecond on these layouts without interference.
    With it, a block's compute is slowed at one rate over the block (``compute_busy``'s share),
    while replay slows its kernels one by one around the block's blocking TP and EP
    collectives: within 0.5%."""
    s = dataclasses.replace(BASE, **kw)
    if model.is_moe:
        s = dataclasses.replace(s, ep=2)
    system = get_system("dgx-h100")
    if not interference:
        system = dataclasses.replace(
            system, gpu=dataclasses.replace(system.gpu, comm_interference=0.0))
    with tempfile.TemporaryDirectory() as tmp:
        generate(model, s, tmp, mode="representative")
        ref = replay(tmp, system, contention=False)
    rel = 5e-3 if interference else 1e-6
    assert estimate(model, s, system).step_time_s == pytest.approx(ref.step_time_s, rel=rel)


def test_prefetch_hides_gathers_up_to_the_compute() -> None:
    """Communication-bound gathers stay exposed beyond the compute they overlap: prefetch
    never makes a step faster than its compute alone, and never slower than blocking."""
    system = get_system("dgx-a100-80gb")
    for dp in (2, 8, 32):
        s = dataclasses.replace(BASE, pp=1, dp=dp, global_batch_size=4 * dp)
        on = estimate(MODEL, s, system).step_time_s
        off = estimate(MODEL, dataclasses.replace(s, zero3_prefetch=False), system).step_time_s
        plain = estimate(MODEL, dataclasses.replace(s, zero_stage=1, zero3_prefetch=False),
                         system).step_time_s
        assert on <= off
        assert on >= 0.9 * plain  # the ZeRO-1 step has no gathers in the chain at all


def test_prefetch_needs_zero3() -> None:
    with pytest.raises(ConfigError, match="zero3_prefetch needs zero_stage 3"):
        dataclasses.replace(BASE, zero_stage=1)


def test_zero3_on_a_pipeline_names_pytorch_pipelinings_pattern() -> None:
    """ZeRO-3 at pp > 1 is costed with FSDP's gathers every micro-batch; ``estimate`` names
    beside it the step of FSDP under PyTorch's pipelining (torchtitan: each stage gathered once
    a step, reduce-scattered after its last backward), which is ZeRO-1 with overlapped
    parameter gathers — the same number the fast path gives that strategy — and says nothing
    at pp 1."""
    from tests.test_cli import run

    args = ("estimate", "--model", "llama3-70b", "--gpus", "256", "--tp", "8", "--sp", "--mbs",
            "1", "--gbs", "256", "--system", "dgx-h100")
    out = " ".join(run(*args, "--pp", "4", "--zero", "3").stdout.split())
    once = estimate("llama3-70b", Strategy(tp=8, pp=4, dp=8, sequence_parallel=True,
                                           micro_batch_size=1, global_batch_size=256,
                                           zero_stage=1, overlap_param_gather=True),
                    "dgx-h100")
    assert (f"as --zero 1 --overlap-param-gather runs: {once.step_time_s:.4f} s a step"
            in out), out
    assert "FSDP under PyTorch's pipelining" not in run(*args, "--pp", "1", "--zero",
                                                        "3").stdout
