"""Pipeline schedules: the order in which one stage runs its forward and backward passes.

Each entry is ``(phase, microbatch, chunk)`` with phase ``"F"`` or ``"B"`` and chunk the virtual
stage index on this rank (0 unless interleaved).

* GPipe: all forwards, then all backwards (Huang et al. 2019).
* 1F1B (PipeDream-Flush): stage ``i`` of ``p`` runs ``min(p - i - 1, m)`` warm-up forwards, then
  alternates one forward and one backward, then drains (Narayanan et al. 2021, §2.2.1, Fig. 4).
* Interleaved 1F1B: Megatron-LM's ``forward_backward_pipelining_with_interleaving``
  (``megatron/core/pipeline_parallel/schedules.py``): warm-up ``(p - i - 1)·2 + (v - 1)·p`` virtual
  micro-batches; virtual micro-batch ``k`` runs chunk ``(k // p) % v`` forward and chunk
  ``v - 1 - (k // p) % v`` backward, on micro-batch ``(k // (p·v))·p + k % p``
  (Narayanan et al. 2021, §2.2.2).
"""

from __future__ import annotations

from typing import Literal

Phase = Literal["F", "B"]
Step = tuple[Phase, int, int]


def gpipe(m: int) -> list[Step]:
    return [("F", j, 0) for j in range(m)] + [("B", j, 0) for j in range(m)]


def one_f_one_b(m: int, p: int, stage: int) -> list[Step]:
    warmup = min(p - stage - 1, m)
    out: list[Step] = [("F", j, 0) for j in range(warmup)]
    f, b = warmup, 0
    while f < m:
        out.append(("F", f, 0))
        out.append(("B", b, 0))
        f, b = f + 1, b + 1
    out += [("B", j, 0) for j in range(b, m)]
    return out


def _virtual(k: int, p: int, v: int, *, forward: bool) -> tuple[int, int]:
    """(microbatch, chunk) of virtual micro-batch ``k`` (Megatron's get_model_chunk_id)."""
    in_group = k % (p * v)
    chunk = in_group // p
    if not forward:
        chunk = v - 1 - chunk
    mb = (k // (p * v)) * p + k % p
    return mb, chunk


def interleaved(m: int, p: int, v: int, stage: int) -> list[Step]:
    total = m * v
    warmup = total if m == p else min((p - stage - 1) * 2 + (v - 1) * p, total)
    out: list[Step] = []
    for k in range(warmup):
        out.append(("F", *_virtual(k, p, v, forward=True)))
    for i in range(total - warmup):
        out.append(("F", *_virtual(warmup + i, p, v, forward=True)))
        out.append(("B", *_virtual(i, p, v, forward=False)))
    for i in range(total - warmup, total):
        out.append(("B", *_virtual(i, p, v, forward=False)))
    return out


def stage_order(schedule: str, *, m: int, p: int, v: int, stage: int) -> list[Step]:
    """The op order of ``stage`` for ``m`` micro-batches on ``p`` stages with ``v`` chunks."""
    if schedule == "gpipe":
        return gpipe(m)
    if schedule == "1f1b":
        return one_f_one_b(m, p, stage)
    return interleaved(m, p, v, stage)
