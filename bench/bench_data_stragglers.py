"""What the data-straggler estimate costs (``analysis.data_stragglers``): the median time of
``data_straggler`` for layouts from one stage to a deep interleaved pipeline, with the
simulated sequences cached (as every strategy of a sweep after the first finds them) and
without (the first), and the wait it gives beside the step.

Run: ``PYTHONPATH=. python bench/bench_data_stragglers.py``."""

from __future__ import annotations

import functools

from analysis.data_stragglers import data_straggler
from analysis.fastpath import estimate
from bench._timing import median_time
from replay import get_system
from tracegen import Strategy, resolve_model
from tracegen.documents import rank_pairs

CASES = {
    "llama3-8b 32K tp2 cp4 dp8 (one stage)": (
        "llama3-8b@seq32768@doc2000~1",
        Strategy(tp=2, cp=4, dp=8, sequence_parallel=True, global_batch_size=64)),
    "llama3-70b 32K tp8 pp4 dp2 (1F1B, 32 micro-batches)": (
        "llama3-70b@seq32768@doc4000~1",
        Strategy(tp=8, pp=4, dp=2, sequence_parallel=True, global_batch_size=64,
                 recompute="selective")),
    "llama3.1-405b 32K tp8 pp14 cp2 dp4 (1F1B, 128 micro-batches)": (
        "llama3.1-405b@seq32768@doc4000~1",
        Strategy(tp=8, pp=14, cp=2, dp=4, sequence_parallel=True, global_batch_size=512,
                 recompute="selective")),
    "llama3-70b 32K tp8 pp4 dp2 (ZB-H1, 32 micro-batches)": (
        "llama3-70b@seq32768@doc4000~1",
        Strategy(tp=8, pp=4, dp=2, sequence_parallel=True, global_batch_size=64,
                 recompute="selective", schedule="zb_h1")),
    "llama3-70b 32K tp8 pp4 vpp2 dp2 (ZB-V, 32 micro-batches)": (
        "llama3-70b@seq32768@doc4000~1",
        Strategy(tp=8, pp=4, vpp=2, dp=2, sequence_parallel=True, global_batch_size=64,
                 recompute="selective", schedule="zb_v")),
    "llama3.1-405b 8K tp8 pp7 vpp3 dp64 (interleaved, 28 micro-batches)": (
        "llama3.1-405b@doc2000~1.5",
        Strategy(tp=8, pp=7, vpp=3, dp=64, schedule="interleaved_1f1b",
                 sequence_parallel=True, global_batch_size=1792)),
}


def main() -> None:
    h100 = get_system("dgx-h100")
    for label, (name, s) in CASES.items():
        model = resolve_model(name)
        step = estimate(model, s, h100).step_time_s
        rank_pairs.cache_clear()
        call = functools.partial(data_straggler, model, s, h100)
        cold, _ = median_time(call, 1)
        warm, d = median_time(call, 5)
        assert d is not None
        print(f"{label}: {warm * 1e3:,.0f} ms a strategy ({cold * 1e3:,.0f} ms the first); "
              f"wait {d.wait_s:.3f} s on a {step:.2f} s step ({d.wait_s / step:+.1%}), "
              f"{d.pipeline_s:.3f} s of it a replica's own pipeline")


if __name__ == "__main__":
    main()
