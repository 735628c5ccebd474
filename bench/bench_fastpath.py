"""Fast-path benchmark: strategies per second screened (GPT-3 175B on 1,024 A100s). Each round
starts cold (no memo from an earlier round), so a round shares only what one sweep shares: layer,
stage and collective costs between its own strategies. Prints the median and best of 7 rounds."""

from __future__ import annotations

import itertools
import statistics
import time

from analysis.fastpath import clear_cache, estimate
from replay import get_system
from tracegen import ConfigError, Strategy, get_model


def strategies(gpus: int = 1024, gbs: int = 1536) -> list[Strategy]:
    out = []
    for tp, pp, mbs, rc, zero, sp in itertools.product(
            (1, 2, 4, 8), (1, 2, 4, 8, 16), (1, 2, 4), ("none", "selective", "full"),
            (0, 1), (False, True)):
        dp = gpus // (tp * pp)
        try:
            out.append(Strategy(tp=tp, pp=pp, dp=dp, micro_batch_size=mbs, global_batch_size=gbs,
                                recompute=rc, zero_stage=zero, sequence_parallel=sp and tp > 1))
        except ConfigError:
            continue
    return out


def main() -> None:
    model, system = get_model("gpt3-175b"), get_system("dgx-a100-80gb")
    cands = strategies()
    rates = []
    for _ in range(7):
        clear_cache()  # cold: each round shares only what one sweep would share
        t0 = time.perf_counter()
        for s in cands:
            estimate(model, s, system)
        rates.append(len(cands) / (time.perf_counter() - t0))
    print(f"fast path, cold sweep of {len(cands)} GPT-3 175B strategies on 1,024 A100s: "
          f"{statistics.median(rates):,.0f} strategies/s median, {max(rates):,.0f} best of 7 "
          "(target 10,000/s)")


if __name__ == "__main__":
    main()
