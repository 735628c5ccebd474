"""Fast-path benchmark: strategies per second screened (GPT-3 175B on 1,024 A100s). Each round
starts cold (no memo from an earlier round), so a round shares only what one sweep shares: layer,
stage and collective costs between its own strategies. Prints the median and best of 7 rounds."""

from __future__ import annotations

import itertools
import statistics
import time

from analysis.fastpath import clear_cache, estimate
from replay import get_system
from replay.hardware import SystemSpec
from tracegen import ConfigError, ModelSpec, Strategy, get_model
from tracegen.gcpause import gc_paused


def strategies(gpus: int = 1024, gbs: int = 1536, vpps: tuple[int, ...] = (1,)
               ) -> list[Strategy]:
    out = []
    for tp, pp, mbs, rc, zero, sp, vpp in itertools.product(
            (1, 2, 4, 8), (1, 2, 4, 8, 16), (1, 2, 4), ("none", "selective", "full"),
            (0, 1), (False, True), vpps):
        dp = gpus // (tp * pp)
        try:
            out.append(Strategy(tp=tp, pp=pp, dp=dp, vpp=vpp, micro_batch_size=mbs,
                                global_batch_size=gbs, recompute=rc,  # type: ignore[arg-type]
                                zero_stage=zero,
                                sequence_parallel=sp and tp > 1,
                                schedule="interleaved_1f1b" if vpp > 1 else "1f1b"))
        except ConfigError:
            continue
    return out


def rate(model: ModelSpec, system: SystemSpec, cands: list[Strategy], rounds: int
         ) -> list[float]:
    rates = []
    for _ in range(rounds):
        clear_cache()  # cold: each round shares only what one sweep would share
        t0 = time.perf_counter()
        for s in cands:
            estimate(model, s, system)
        rates.append(len(cands) / (time.perf_counter() - t0))
    return rates


def main() -> None:
    model, system = get_model("gpt3-175b"), get_system("dgx-a100-80gb")
    cands = strategies()
    # as a sweep runs it: ``analysis.runner.evaluate_chunk`` pauses the cyclic collector per chunk
    rates = gc_paused(rate)(model, system, cands, 7)
    on = rate(model, system, cands, 5)
    print(f"fast path, cold sweep of {len(cands)} GPT-3 175B strategies on 1,024 A100s: "
          f"{statistics.median(rates):,.0f} strategies/s median, {max(rates):,.0f} best of 7 "
          f"(target 10,000/s) with the collector paused as a sweep chunk runs it; "
          f"{statistics.median(on):,.0f} median with it on")
    mixed = strategies(vpps=(1, 2))  # the sweep's default space also has vpp 2 (interleaved)
    rates = gc_paused(rate)(model, system, mixed, 3)
    n_int = sum(s.vpp > 1 for s in mixed)
    print(f"  with interleaved 1F1B (vpp 2) as the default sweep space has it: {len(mixed)} "
          f"strategies ({n_int} interleaved), {statistics.median(rates):,.0f} strategies/s "
          "median of 3")


if __name__ == "__main__":
    main()
