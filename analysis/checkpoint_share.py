"""A checkpoint as each GPU holds it: what an asynchronous or in-memory checkpoint copies to
host memory before training goes on (the blocking part of ``resilience``'s δ), and whether a
host's memory holds those copies beside what offloading keeps there.

Two stagings (``[checkpoint] staging``): PyTorch's distributed checkpoint stages each rank's
whole state dict into CPU buffers before its background write, raising host memory by the
per-rank checkpoint size times the ranks (PyTorch recipe "Asynchronous Saving with Distributed
Checkpoint"): what the rank holds, its 16-bit weights and fp32 optimizer state as the strategy
shards them (``"state_dict"``, ``memory.checkpoint_held_bytes``). Megatron-Core's fully
parallel save (its default) has each tensor written by one of its holders, spread over the
data-parallel group, and its async writer copies only those items to host memory
(``"fully_parallel"``, ``memory.checkpoint_written_bytes``). Either way a restarted rank loads
what it holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from replay.hardware import SystemSpec
from tracegen import memory
from tracegen.errors import ConfigError
from tracegen.model import ModelSpec
from tracegen.program import RoleProgram
from tracegen.strategy import Strategy
from tracegen.units import GiB

STAGINGS = ("state_dict", "fully_parallel")


def checked_staging(value: object) -> str:
    """``[checkpoint] staging`` as given, or a ConfigError that names the choices."""
    if value not in STAGINGS:
        raise ConfigError(f"checkpoint staging must be {' or '.join(map(repr, STAGINGS))} "
                          "(all a GPU holds, as PyTorch's distributed checkpoint stages it, or "
                          "the share it writes, as Megatron-Core's fully parallel save), got "
                          f"{value!r}", what="checkpoint")
    return str(value)


@dataclasses.dataclass(frozen=True, slots=True)
class CheckpointShare:
    """``staged_bytes``: the most one rank copies over its host link (a checkpoint blocks until
    the last rank's copy is done). ``host_peak_GiB``: the most one host's ranks keep in host
    memory with their snapshots taken — the copies and what offloading keeps there —, on the
    system whose hosts are the fullest against ``host_capacity_GiB`` (0: no system gives its
    host memory)."""

    staged_bytes: int
    host_peak_GiB: float
    host_capacity_GiB: float
    load_bytes: int = 0  # the most one rank holds of it: what a restarted rank loads


def checkpoint_share(model: ModelSpec, s: Strategy, system: SystemSpec,
                     where: Mapping[int, SystemSpec] | None = None, *, copies: int = 1,
                     staging: str = "state_dict") -> CheckpointShare:
    """The checkpoint's per-rank share of ``s``; ``where``: a ``[mixed]`` cluster's stages on
    another system, whose hosts hold them (each system's hosts checked against their own).
    ``copies``: snapshots a host keeps of each of its ranks' shares (checkpoints kept in memory
    hold a peer's too: 2). ``staging``: what a rank copies (module docstring)."""
    written = checked_staging(staging) == "fully_parallel"
    flash = system.gpu.flash_attention
    act = (memory.activation_bytes_per_layer(model, s, flash_attention=flash)
           if s.cpu_offload_layers else 0)
    staged, kept, loads = [], [], []
    for st in range(s.pp):
        held = RoleProgram(model, s, st).stage_params()
        total = held["dp"] + held["edp"]
        holds = memory.checkpoint_held_bytes(s, total, held["edp"])
        on_gpu, on_host = (memory.checkpoint_written_bytes(s, total, held["edp"]) if written
                           else holds)
        staged.append(on_gpu)
        loads.append(sum(holds))
        kept.append(copies * (on_gpu + on_host) + memory.host_bytes(
            model, s, total, act, expert_params=held["edp"], flash_attention=flash))
    where = where or {}
    hosts = []
    for sys_ in {id(x): x for x in (system, *where.values())}.values():
        mine = [b if where.get(st, system) is sys_ else 0 for st, b in enumerate(kept)]
        hosts.append((memory.host_peak_bytes(mine, s, sys_.node.host_gpus) / GiB,
                      sys_.node.host_memory_GiB))
    given = [h for h in hosts if h[1]]  # the fullest against its memory, where one is given
    peak, capacity = (max(given, key=lambda h: h[0] / h[1]) if given
                      else (max(h[0] for h in hosts), 0.0))
    return CheckpointShare(max(staged), peak, capacity, max(loads))
