"""Fast path against replay on real model sizes: how far the closed forms land from the
contention-free replay of the same strategy. The hypothesis test (tests/test_fastpath.py) holds
2% on a tiny model, where every term weighs in; this draws random valid strategies of four
preset models on their usual systems (GPT-3 175B on 1,024 A100s, Llama 3 8B on 64 H100s,
Mixtral 8x7B on 128 H100s, Llama 2 70B on 48 H100s; a third of the non-interleaved ones with a
global batch of any count of micro-batches, not whole rounds of pp) and prints the distribution of
|fast / replay − 1| and the worst cases. Seeded: the same draw on every machine.

    python bench/bench_fastpath_agreement.py [--n 60] [--seed 1] [--odd]

``--odd`` draws sizes and options the default cases never reach (GPU counts with a factor 3,
pp 3/5/6, up to 4 chunks, cp up to 4, any count of micro-batches, shorter end stages, B200 and
H200, FP8, TP overlap, ZeRO 2, overlapped parameter gathers, the all-gather CP ring): the
fifteenth session's start had 16 of 150 such strategies (seed 11) above 2%, up to 16.6%, from
two bugs the default draw never reached (DESIGN.md); now 1 (+2.2%).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

from analysis.fastpath import estimate
from replay import get_system, replay
from tracegen import ConfigError, Strategy, generate, get_model

# (model, system, GPUs, global batch)
CASES = (("gpt3-175b", "dgx-a100-80gb", 1024, 1536), ("llama3-8b", "dgx-h100", 64, 128),
         ("mixtral-8x7b", "dgx-h100", 128, 256), ("llama2-70b", "dgx-h100", 48, 96))


def draw(rng: random.Random) -> tuple[str, str, Strategy] | None:
    """One random strategy of one case, or None where the draw is not a valid layout."""
    model, system, gpus, gbs = rng.choice(CASES)
    tp, pp, cp = rng.choice((1, 2, 4, 8)), rng.choice((1, 2, 4, 8)), rng.choice((1, 1, 2))
    if gpus % (tp * pp * cp):
        return None
    vpp, zero = rng.choice((1, 1, 2)), rng.choice((0, 1, 3))
    moe = model == "mixtral-8x7b"
    dp, mbs = gpus // (tp * pp * cp), rng.choice((1, 2))
    if vpp == 1 and rng.random() < 1 / 3:  # a batch of any count of micro-batches, not rounds
        gbs = dp * mbs * rng.randrange(pp, 6 * pp + 1)
    try:
        s = Strategy(tp=tp, pp=pp, dp=dp, cp=cp, vpp=vpp,
                     ep=rng.choice((1, 2, 4, 8)) if moe else 1,
                     expert_tp=rng.choice((0, 1)) if moe else 0,
                     micro_batch_size=mbs, global_batch_size=gbs,
                     recompute=rng.choice(("none", "selective", "full")),  # type: ignore[arg-type]
                     zero_stage=zero, sequence_parallel=tp > 1 and rng.random() < 0.6,
                     schedule="interleaved_1f1b" if vpp > 1 else rng.choice(("1f1b", "1f1b",
                                                                             "1f1b", "gpipe")),
                     overlap_param_gather=zero == 1 and rng.random() < 0.5,
                     zero3_prefetch=zero == 3 and rng.random() < 0.5)
    except ConfigError:
        return None
    return model, system, s


# --odd: GPU counts with a factor 3, pipelines of 3, 5 and 6 stages, up to 4 chunks, cp up to 4,
# any count of micro-batches, shorter end stages, more systems and the options the default draw
# leaves at their defaults (model, systems, GPU counts)
ODD_CASES = (("gpt3-175b", ("dgx-a100-80gb", "dgx-h100"), (96, 192, 384, 768, 1024)),
             ("llama3-8b", ("dgx-h100", "dgx-b200", "hgx-h200"), (16, 24, 48, 96)),
             ("mixtral-8x7b", ("dgx-h100", "dgx-b200"), (32, 48, 96, 192)),
             ("llama2-70b", ("dgx-h100", "dgx-a100-80gb"), (24, 64, 72, 144)))


def draw_odd(rng: random.Random) -> tuple[str, str, Strategy] | None:
    """``draw`` on the sizes and options the default cases never reach (``ODD_CASES``)."""
    model, systems, counts = rng.choice(ODD_CASES)
    system, gpus = rng.choice(systems), rng.choice(counts)
    tp, pp = rng.choice((1, 2, 4, 8)), rng.choice((1, 2, 3, 4, 5, 6, 8))
    cp = rng.choice((1, 1, 2, 4))
    if gpus % (tp * pp * cp):
        return None
    vpp, zero = rng.choice((1, 1, 2, 3, 4)), rng.choice((0, 1, 2, 3))
    moe = model == "mixtral-8x7b"
    dp, mbs = gpus // (tp * pp * cp), rng.choice((1, 2, 4))
    m = pp * rng.randrange(1, 8) if vpp > 1 else rng.randrange(1, 8 * pp + 1)
    sp = tp > 1 and rng.random() < 0.6
    try:
        s = Strategy(tp=tp, pp=pp, dp=dp, cp=cp, vpp=vpp,
                     ep=rng.choice((1, 2, 4, 8)) if moe else 1,
                     expert_tp=rng.choice((0, 1)) if moe else 0,
                     micro_batch_size=mbs, global_batch_size=dp * mbs * m,
                     recompute=rng.choice(("none", "selective", "full")),  # type: ignore[arg-type]
                     zero_stage=zero, sequence_parallel=sp,
                     tp_comm_overlap=sp and rng.random() < 0.5,
                     schedule="interleaved_1f1b" if vpp > 1 else rng.choice(("1f1b", "1f1b",
                                                                             "gpipe")),
                     first_stage_layers=rng.choice((0, 0, 0, 1, 2)) if pp > 1 else 0,
                     last_stage_layers=rng.choice((0, 0, 0, 1)) if pp > 1 else 0,
                     overlap_grad_reduce=rng.random() < 0.8,
                     grad_reduce_in_bf16=rng.random() < 0.3,
                     overlap_param_gather=zero in (1, 2) and rng.random() < 0.5,
                     cp_comm_type=rng.choice(("p2p", "p2p", "all_gather")),  # type: ignore[arg-type]
                     precision=(rng.choice(("bf16", "bf16", "fp8"))  # type: ignore[arg-type]
                                if system != "dgx-a100-80gb" else "bf16"),
                     zero3_prefetch=zero == 3 and rng.random() < 0.5)
    except ConfigError:
        return None
    return model, system, s


def label(s: Strategy) -> str:
    return (f"tp{s.tp} pp{s.pp} dp{s.dp} cp{s.cp} ep{s.ep} vpp{s.vpp} {s.schedule} "
            f"mbs{s.micro_batch_size} "
            f"zero{s.zero_stage}{' prefetch' if s.zero3_prefetch else ''} {s.recompute}"
            f"{' sp' if s.sequence_parallel else ''}"
            f"{' overlap-param-gather' if s.overlap_param_gather else ''}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=60, help="strategies to compare")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--odd", action="store_true",
                    help="odd sizes and options: GPU counts with a factor 3, pp 3/5/6, up to 4 "
                         "chunks, cp up to 4, any micro-batch count, shorter end stages, more "
                         "systems and options")
    args = ap.parse_args()
    pick = draw_odd if args.odd else draw
    rng = random.Random(args.seed)
    rows: list[tuple[float, str, str]] = []
    t0 = time.perf_counter()
    while len(rows) < args.n:
        got = pick(rng)
        if got is None:
            continue
        model_name, system_name, s = got
        model, system = get_model(model_name), get_system(system_name)
        try:
            fast = estimate(model, s, system)
        except ConfigError:
            continue
        if not fast.fits:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            generate(model, s, tmp, mode="representative")
            ref = replay(tmp, system, contention=False)
        rows.append(((fast.step_time_s / ref.step_time_s - 1) * 100, model_name, label(s)))
    errs = sorted(abs(e) for e, _, _ in rows)
    print(f"fast path vs contention-free replay, {len(rows)} random strategies of 4 preset "
          f"models{' at odd sizes' if args.odd else ''} (seed {args.seed}, "
          f"{time.perf_counter() - t0:.0f} s): |error| median "
          f"{statistics.median(errs):.2f}%, p90 {errs[int(0.9 * (len(errs) - 1))]:.2f}%, max "
          f"{errs[-1]:.2f}%; {sum(e > 2 for e in errs)} above 2%")
    for e, model_name, what in sorted(rows, key=lambda r: -abs(r[0]))[:5]:
        print(f"  {e:+.2f}%  {model_name}  {what}")


if __name__ == "__main__":
    main()
