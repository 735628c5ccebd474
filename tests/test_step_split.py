"""Where the fast path's step goes (``analysis.step_split``): the busiest stage's micro-batches
by what runs, the rest of the pipeline's span, and what follows it — parts that add up to the
step exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.fastpath import estimate
from analysis.step_split import (
    AFTER,
    MERGED,
    OTHER_STAGE,
    OVERLAPPING,
    PIPELINE,
    SIDE_BY_SIDE,
    ZERO3,
    step_split,
)
from tracegen import ModelSpec, Strategy, get_model

DENSE = ModelSpec(name="split", num_layers=8, hidden_size=1024, num_attention_heads=16,
                  num_kv_heads=4, ffn_hidden_size=4096, vocab_size=8192, seq_len=4096,
                  activation="swiglu")
MOE = ModelSpec(name="split-moe", num_layers=4, hidden_size=1024, num_attention_heads=16,
                num_kv_heads=4, ffn_hidden_size=4096, vocab_size=8192, seq_len=4096,
                activation="swiglu", num_experts=16, experts_per_token=2,
                moe_ffn_hidden_size=1024)

CASES = {
    "data parallel": (DENSE, dict(dp=8, global_batch_size=32)),
    "tp, sp, 1f1b": (DENSE, dict(tp=2, pp=4, dp=2, sequence_parallel=True,
                                 global_batch_size=32, zero_stage=1)),
    "interleaved": (DENSE, dict(tp=2, pp=2, vpp=2, schedule="interleaved_1f1b", dp=2,
                                sequence_parallel=True, global_batch_size=16)),
    "zb-h1, uneven": (DENSE, dict(pp=4, dp=2, schedule="zb_h1", global_batch_size=16,
                                  first_stage_layers=1, last_stage_layers=1)),
    "cp ring, tp overlap": (DENSE, dict(tp=2, cp=2, dp=2, sequence_parallel=True,
                                        tp_comm_overlap=True, global_batch_size=8)),
    "full recompute, fp8": (DENSE, dict(tp=2, pp=2, dp=2, sequence_parallel=True,
                                        recompute="full", precision="fp8",
                                        global_batch_size=16)),
    "zero-3 prefetched": (DENSE, dict(dp=8, zero_stage=3, zero3_prefetch=True,
                                      global_batch_size=16)),
    "moe": (MOE, dict(ep=4, dp=8, global_batch_size=16)),
    "moe, zero-3": (MOE, dict(ep=2, dp=8, zero_stage=3, global_batch_size=16)),
    "gpipe, zero-3 prefetched": (DENSE, dict(tp=2, dp=4, schedule="gpipe", zero_stage=3,
                                             zero3_prefetch=True, global_batch_size=16)),
}
# the parts that may be negative, each saying what it takes back
NEGATIVE = {MERGED, OVERLAPPING, SIDE_BY_SIDE}


@pytest.mark.parametrize("case", list(CASES))
def test_the_parts_add_up_to_the_step(case: str) -> None:
    """Conservation: the parts sum to the fast path's step; the stage's work is its micro-
    batches times the fast path's forward and backward of that stage (the op table's rows are
    those, to the nanosecond; chunk-timed ZeRO-3 prefetch adds its streams' excess as a part of
    its own, and only it); the stage is the busiest;
    what follows the pipeline is the step less its span."""
    model, kw = CASES[case]
    s = Strategy(micro_batch_size=1, **kw)  # type: ignore[arg-type]
    est = estimate(model, s, "dgx-h100")
    split = step_split(model, s, "dgx-h100", est)
    parts = dict(split.parts)
    assert sum(parts.values()) == pytest.approx(est.step_time_s, abs=1e-9)
    assert split.step_s == est.step_time_s and split.microbatches == s.num_microbatches
    busy = [f + b for f, b in zip(est.stage_fwd_s, est.stage_bwd_s, strict=True)]
    assert busy[split.stage] == max(busy)
    work = sum(v for k, v in parts.items() if k not in (PIPELINE, MERGED, OVERLAPPING, AFTER))
    if not (s.zero3_prefetch and s.schedule == "gpipe"):  # (its streams overlap across passes)
        assert work == pytest.approx(s.num_microbatches * busy[split.stage], rel=1e-6)
    assert (ZERO3 in parts) == s.zero3_prefetch and OTHER_STAGE not in parts
    assert parts[AFTER] == pytest.approx(est.step_time_s - est.pipeline_s, abs=1e-9)
    assert parts["GEMMs"] > 0 and parts["attention"] > 0
    assert all(v >= 0 for k, v in parts.items() if k not in NEGATIVE)
    assert all(k.split()[1] in ("tp", "cp", "ep", "dp", "edp", "pp") for k in parts
               if k.startswith("exposed "))


def test_merged_passes_show_what_they_hide() -> None:
    """Under combined 1F1B one micro-batch's all-to-alls run beside another's compute: the
    stage's work in series is more than the span, and the difference is said as hidden."""
    s = Strategy(ep=8, dp=8, micro_batch_size=1, global_batch_size=32,
                 overlap_moe_ep_comm=True)
    split = step_split(get_model("qwen3-30b-a3b"), s, "dgx-h100")
    parts = dict(split.parts)
    assert parts[MERGED] < 0 and PIPELINE not in parts
    assert sum(parts.values()) == pytest.approx(split.step_s, abs=1e-9)


def test_estimate_prints_and_writes_the_split(tmp_path: Path) -> None:
    out = tmp_path / "e.json"
    r = subprocess.run([sys.executable, "-m", "analysis.cli", "estimate", "--model", "llama3-8b",
                        "--gpus", "16", "--tp", "2", "--pp", "2", "--sp", "--mbs", "1", "--gbs",
                        "16", "--system", "dgx-h100", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, env={"COLUMNS": "250"})
    assert r.returncode == 0, r.stderr
    assert "where the step goes (stage " in r.stdout and "GEMMs" in r.stdout
    got = json.loads(out.read_text())
    split = got["step_split"]
    assert sum(split["parts_s"].values()) == pytest.approx(got["step_time_s"], abs=1e-9)
    assert split["microbatches"] == 4  # 16 sequences over dp 4


def test_the_figure_draws_every_part_and_ends_at_the_step() -> None:
    """One bar per part, in order, each as long as its part (a negative one hatched, drawn
    back from where the parts before it end), and the step's line where they add up to."""
    from analysis import plots

    s = Strategy(ep=8, dp=8, micro_batch_size=1, global_batch_size=32,
                 overlap_moe_ep_comm=True)
    split = step_split(get_model("qwen3-30b-a3b"), s, "dgx-h100")
    fig = plots.step_parts(dict(split.parts))
    ax = fig.axes[0]
    bars = ax.patches
    assert len(bars) == len(split.parts)
    for bar, (_, sec) in zip(bars, split.parts, strict=True):
        assert bar.get_width() == pytest.approx(abs(sec))
        assert (bar.get_hatch() == "//") == (sec < 0)
    (line,) = ax.lines
    assert line.get_xdata()[0] == pytest.approx(split.step_s)
