"""Fast-path benchmark: strategies per second screened (GPT-3 175B on 1,024 A100s). Each round
starts cold (no memo from an earlier round), so a round shares only what one sweep shares: layer,
stage and collective costs between its own strategies. Prints the median and best of 7 rounds on
one core, and the rate of this machine's cores screening the same strategies together, one
process per core, each with its contiguous share as a sweep's workers get theirs (each share
cold, so they share less than one process does)."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import itertools
import multiprocessing
import os
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


_SHARES: dict[tuple[int, int], list[Strategy]] = {}  # a worker's share, built once


def _share(lo: int, hi: int) -> float:
    """Seconds one worker takes to screen strategies [lo, hi) of the benchmark, cold (its share
    is built on the first call, the warm-up, not in the timed rounds)."""
    model, system = get_model("gpt3-175b"), get_system("dgx-a100-80gb")
    cands = _SHARES.get((lo, hi))
    if cands is None:
        cands = _SHARES[lo, hi] = strategies()[lo:hi]
    clear_cache()
    t0 = time.perf_counter()
    gc_paused(lambda: [estimate(model, s, system) for s in cands])()
    return time.perf_counter() - t0


def machine_rate(n: int, rounds: int) -> tuple[int, list[float]]:
    """(processes, strategies/s per round) with one process per core screening its share of
    the ``n`` strategies at the same time, workers started and warmed up beforehand."""
    procs = os.cpu_count() or 1
    bounds = [(i * n // procs, (i + 1) * n // procs) for i in range(procs)]
    ctx = multiprocessing.get_context("spawn")
    rates = []
    with cf.ProcessPoolExecutor(procs, mp_context=ctx) as pool:
        list(pool.map(_share, *zip(*bounds, strict=True)))  # imports and start-up
        for _ in range(rounds):
            t0 = time.perf_counter()
            list(pool.map(_share, *zip(*bounds, strict=True)))
            rates.append(n / (time.perf_counter() - t0))
    return procs, rates


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
    procs, rates = machine_rate(len(cands), 7)
    print(f"  this machine, {procs} processes screening their shares at once: "
          f"{statistics.median(rates):,.0f} strategies/s median, {max(rates):,.0f} best of 7")
    mixed = strategies(vpps=(1, 2))  # the sweep's default space also has vpp 2 (interleaved)
    rates = gc_paused(rate)(model, system, mixed, 3)
    n_int = sum(s.vpp > 1 for s in mixed)
    print(f"  with interleaved 1F1B (vpp 2) as the default sweep space has it: {len(mixed)} "
          f"strategies ({n_int} interleaved), {statistics.median(rates):,.0f} strategies/s "
          "median of 3")
    # a space searching schedules: each pipelined strategy ZB-H1 can run, as ZB-H1 too
    zb = [dataclasses.replace(s, schedule="zb_h1") for s in cands if s.pp > 1]
    rates = gc_paused(rate)(model, system, zb, 3)
    print(f"  ZB-H1 (walked, from 4p micro-batches on to a steady round and extrapolated): the "
          f"{len(zb)} pipelined strategies as "
          f"ZB-H1, {statistics.median(rates):,.0f} strategies/s median of 3")
    # and each interleaved strategy of the mixed space (two chunks a stage) as ZB-V
    zbv = [dataclasses.replace(s, schedule="zb_v") for s in mixed if s.vpp == 2]
    rates = gc_paused(rate)(model, system, zbv, 3)
    print(f"  ZB-V (warm-up, cool-down and the steady rounds until they are affine walked, "
          f"the rest jumped): the {len(zbv)} interleaved strategies as ZB-V, "
          f"{statistics.median(rates):,.0f} strategies/s median of 3")
    # the same at four times the global batch (4x the micro-batches, 3p to 48p a pipeline):
    # a walk of every pass would take 4x as long
    zbv4 = [dataclasses.replace(s, global_batch_size=4 * s.global_batch_size) for s in zbv]
    rates = gc_paused(rate)(model, system, zbv4, 3)
    print(f"    at 4x the global batch ({min(s.num_microbatches for s in zbv4)}-"
          f"{max(s.num_microbatches for s in zbv4)} micro-batches): "
          f"{statistics.median(rates):,.0f} strategies/s median of 3")
    # DualPipe-V: the same V placement and walk, its steady rounds jumped as ZB-V's are (every
    # pass walked until the sixty-ninth session: 553/s); those with the 2p micro-batches it
    # needs
    dpv = [dataclasses.replace(s, schedule="dualpipe_v") for s in zbv4
           if s.num_microbatches >= 2 * s.pp]
    rates = gc_paused(rate)(model, system, dpv, 3)
    print(f"  DualPipe-V (steady rounds jumped as ZB-V's) at 4x the global batch: {len(dpv)} "
          f"strategies, "
          f"{statistics.median(rates):,.0f} strategies/s median of 3")
    # interleaved ZB: the interleaved strategies whose micro-batches split into rounds,
    # walked pass by pass on the same placer
    izb = [dataclasses.replace(s, schedule="interleaved_zb", microbatch_group_size=0)
           for s in mixed if s.vpp > 1
           and s.num_microbatches % max(1, s.num_microbatches // s.pp) == 0]
    rates = gc_paused(rate)(model, system, izb, 3)
    print(f"  interleaved ZB (every pass walked): {len(izb)} strategies, "
          f"{statistics.median(rates):,.0f} strategies/s median of 3")
    # the same space on two sites of 512 GPUs: stages are no longer alike, each is costed
    two = dataclasses.replace(system, scaleout=dataclasses.replace(
        system.scaleout, site_gpus=512, site_Gbps_per_gpu=50.0, site_latency_us=250.0))
    rates = gc_paused(rate)(model, two, cands, 3)
    print(f"  the same {len(cands)} strategies on two sites of 512 GPUs (50 Gb/s a GPU between "
          f"them; every stage costed on its own): {statistics.median(rates):,.0f} strategies/s "
          "median of 3")
    # ZeRO-2 reducing every micro-batch (DeepSpeed, FSDP SHARD_GRAD_OP): every pass walked
    # with each stage's data-parallel streams (analysis/grad_stream.py)
    per = [dataclasses.replace(s, zero_stage=2, grad_reduce_per_microbatch=True)
           for s in cands if s.zero_stage == 1]
    rates = gc_paused(rate)(model, system, per, 3)
    print(f"  ZeRO-2 reducing every micro-batch (each pass walked with its stage's streams): "
          f"the {len(per)} ZeRO-1 strategies so, {statistics.median(rates):,.0f} strategies/s "
          "median of 3")

    # the model with GPT-3's shape and Gemma 3's windows (1,024 keys in five layers of six):
    # each stage costed by where it starts in the pattern
    windowed = dataclasses.replace(model, sliding_window=1024, window_pattern="SSSSSF")
    rates = gc_paused(rate)(windowed, system, cands, 3)
    print(f"  sliding windows in five layers of six (stages at different places in the "
          f"pattern, each costed): the {len(cands)} strategies, "
          f"{statistics.median(rates):,.0f} strategies/s median of 3")

    _combined_1f1b()


def moe_strategies(merged: bool) -> list[Strategy]:
    """Qwen3-30B-A3B on 64 H100s: tp 1-2, pp 1 or interleaved pp 2-4 with vpp 2, ep 8-16,
    micro-batch 1-2, selective recompute of the experts' activation or none, each with or
    without combined 1F1B (--overlap-moe-expert-parallel-comm, and its deferred weight
    gradients half the time)."""
    out = []
    for tp, pp, ep, mbs, rc, delay in itertools.product(
            (1, 2), (1, 2, 4), (8, 16), (1, 2), ("none", "selective"), (False, True)):
        try:
            out.append(Strategy(
                tp=tp, pp=pp, dp=64 // (tp * pp), ep=ep, micro_batch_size=mbs,
                global_batch_size=512, zero_stage=1, sequence_parallel=tp > 1,
                recompute=rc, recompute_modules="moe_act" if rc == "selective" else "core_attn",
                vpp=2 if pp > 1 else 1, schedule="interleaved_1f1b" if pp > 1 else "1f1b",
                overlap_moe_ep_comm=merged, delay_wgrad_compute=merged and delay))
        except ConfigError:
            continue
    return out


def _combined_1f1b() -> None:
    """Combined 1F1B's merged passes are walked piece by piece (``analysis/merged_pass.py``):
    the same MoE space screened with and without them."""
    model, system = get_model("qwen3-30b-a3b"), get_system("dgx-h100")
    for merged in (False, True):
        cands = moe_strategies(merged)
        rates = gc_paused(rate)(model, system, cands, 3)
        print(f"  Qwen3-30B-A3B on 64 H100s, {len(cands)} strategies "
              f"{'with' if merged else 'without'} combined 1F1B: "
              f"{statistics.median(rates):,.0f} strategies/s median of 3")


if __name__ == "__main__":
    main()
