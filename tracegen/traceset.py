"""The trace set: the contract between tracegen and replay.

::

    <dir>/manifest.json      model, strategy, world size, coordinates, groups, multiplicities,
                             generator version, per-rank memory estimate and statistics
    <dir>/comm_groups.json   ASTRA-sim format: {"1": [0, 1, ...], ...}; keys are positive ints
    <dir>/<name>.<rank>.et   one Chakra ET per rank written (GlobalMetadata first, then nodes)
"""

from __future__ import annotations

import dataclasses
import glob
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from tracegen import __version__
from tracegen.errors import ConfigError, TraceFormatError
from tracegen.fit import check_fits_model
from tracegen.gcpause import gc_paused
from tracegen.manifest_check import manifest_problems
from tracegen.memory import MemoryEstimate, estimate
from tracegen.mesh import Mesh, embedding_partner
from tracegen.model import ModelSpec
from tracegen.program import PNode, RoleProgram
from tracegen.strategy import Strategy
from tracegen.units import LOW_PRECISION_GEMMS, GiB
from tracegen.vocab import COMM_COLL_NODE, COMM_SEND_NODE
from tracegen.writer import RoleEncoding, encode_attr

Mode = Literal["full", "representative"]
MANIFEST = "manifest.json"
COMM_GROUPS = "comm_groups.json"
FORMAT = "trainsim-traceset/1"


@dataclasses.dataclass(frozen=True, slots=True)
class StageStats:
    """What one rank of a pipeline stage does in one step."""

    stage: int
    nodes: int
    flop_by_phase: dict[str, int]
    comm_bytes_by_axis: dict[str, int]
    memory: MemoryEstimate
    # what ``memory`` holds that a GPU whose FP8 GEMMs take any layout (Blackwell) does not:
    # the transposed FP8 weight copies (``_fp8_transpose_bytes``)
    fp8_transpose_bytes: int = 0

    def need_bytes(self, fp8_any_layout: bool = False) -> int:
        """What a rank of the stage needs on a GPU (``GPUSpec.fp8_any_layout``); the manifest's
        counterpart is ``replay.results.stage_need_GiB``."""
        return self.memory.total_bytes - (self.fp8_transpose_bytes if fp8_any_layout else 0)


@dataclasses.dataclass(frozen=True, slots=True)
class TraceSetSummary:
    path: Path
    name: str
    mode: Mode
    world_size: int
    ranks_written: int
    nodes_written: int
    stages: list[StageStats]
    stale_removed: int = 0  # rank files of an earlier set of this name in the folder, removed


def et_path(directory: Path, name: str, rank: int) -> Path:
    return directory / f"{name}.{rank}.et"


def _rank_files(directory: Path, name: str) -> dict[int, Path]:
    """The ``name.<rank>.et`` files a folder holds, by rank."""
    prefix, out = f"{name}.", {}
    for p in directory.glob(f"{glob.escape(name)}.*.et"):
        rank = p.name[len(prefix):-3]
        if rank.isdigit():
            out[int(rank)] = p
    return out


def _remove_stale(directory: Path, name: str, written: set[int]) -> int:
    """Remove rank files of this workload name that the set just written does not hold (an
    earlier set written to the same folder, with more ranks or the other mode): a Chakra tool
    that reads every ``name.<rank>.et`` of the folder would otherwise mix two sets."""
    stale = [p for r, p in _rank_files(directory, name).items() if r not in written]
    for p in stale:
        p.unlink()
    return len(stale)


def stage_stats(stage: int, nodes: list[PNode], mem: MemoryEstimate, mesh: Mesh,
                fp8_transpose_bytes: int = 0) -> StageStats:
    flop: dict[str, int] = {}
    comm: dict[str, int] = {}
    for n in nodes:
        if n.flop:
            flop[n.phase] = flop.get(n.phase, 0) + n.flop
        if n.type == COMM_COLL_NODE:
            comm[n.axis] = comm.get(n.axis, 0) + n.comm_bytes
        elif n.type == COMM_SEND_NODE:
            comm["pp"] = comm.get("pp", 0) + n.comm_bytes
    return StageStats(stage, len(nodes), flop, comm, mem, fp8_transpose_bytes)


def _fp8_transpose_bytes(model: ModelSpec, strategy: Strategy, stage: int,
                         held: dict[str, int], mem: MemoryEstimate) -> int:
    """What a rank of the stage needs less on a GPU whose FP8 GEMMs take any layout
    (Blackwell): the transposed copies of its cached FP8 weights (``memory.
    fp8_weight_cache_bytes``) with the allocator's allowance on them. The estimate, which does
    not know its GPU, keeps Hopper's; the manifest names the difference, for replay
    (``replay.results.stage_need_GiB``)."""
    if strategy.precision not in LOW_PRECISION_GEMMS:
        return 0
    blackwell = estimate(model, strategy, stage, sum(held.values()), expert_params=held["edp"],
                         fp8_any_layout=True)
    return mem.total_bytes - blackwell.total_bytes


class _Binder:
    """Rank-bound attributes (pg_name, comm_src, comm_dst) as encoded bytes, cached."""

    def __init__(self, mesh: Mesh, rank: int) -> None:
        self.mesh, self.rank = mesh, rank
        self._pg: dict[str, bytes] = {}
        self._peer: dict[tuple[int, int], bytes] = {}

    def __call__(self, node: PNode) -> bytes:
        if node.type == COMM_COLL_NODE:
            b = self._pg.get(node.axis)
            if b is None:
                gid = self.mesh.group_id(node.axis, self.rank)
                if gid is None:  # pragma: no cover - programs only emit collectives of size ≥ 2
                    raise ConfigError(f"rank {self.rank} has no {node.axis} group for {node.name}")
                b = self._pg[node.axis] = encode_attr("pg_name", "string", str(gid))
            return b
        key = (node.type, node.peer)
        b = self._peer.get(key)
        if b is None:
            peer = self.mesh.pp_peer(self.rank, node.peer)
            src, dst = (self.rank, peer) if node.type == COMM_SEND_NODE else (peer, self.rank)
            b = self._peer[key] = encode_attr("comm_src", "int64", src) + encode_attr(
                "comm_dst", "int64", dst)
        return b

    def attrs(self, node: PNode) -> list[tuple[str, str, Any]]:
        """The same attributes as tuples (for the protobuf reference path)."""
        if node.type == COMM_COLL_NODE:
            return [("pg_name", "string", str(self.mesh.group_id(node.axis, self.rank)))]
        peer = self.mesh.pp_peer(self.rank, node.peer)
        src, dst = (self.rank, peer) if node.type == COMM_SEND_NODE else (peer, self.rank)
        return [("comm_src", "int64", src), ("comm_dst", "int64", dst)]


@gc_paused
def generate(model: ModelSpec, strategy: Strategy, out_dir: str | Path, *,
             mode: Mode = "representative", name: str = "trainsim",
             gpus: int | None = None,
             progress: Callable[[int, int], None] | None = None) -> TraceSetSummary:
    """Write the trace set of one training step of ``model`` under ``strategy``."""
    check_fits_model(strategy, model, gpus=gpus)
    if mode not in ("full", "representative"):
        raise ConfigError(f"mode must be 'full' or 'representative', got {mode!r}")
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):  # files are NAME.RANK.et
        raise ConfigError(f"workload name {name!r} must be a file-name stem: letters, digits, "
                          "'_', '-' or '.', not starting with '.' (no folders: use -o for "
                          "where the set goes)", what="trace set")
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file in the way, no permission
        raise ConfigError(f"cannot create the trace folder {out}: {exc.strerror}",
                          what="output folder") from None
    mesh = Mesh(strategy, embedding_stage=embedding_partner(model, strategy), moe=model.is_moe)
    ranks = mesh.representatives() if mode == "representative" else range(strategy.world_size)
    encodings: dict[int, RoleEncoding] = {}
    stats: list[StageStats] = []
    for stage in range(strategy.pp):
        prog = RoleProgram(model, strategy, stage)
        nodes = prog.build()
        encodings[stage] = RoleEncoding(nodes)
        held = prog.stage_params()
        mem = estimate(model, strategy, stage, sum(held.values()), expert_params=held["edp"])
        stats.append(stage_stats(stage, nodes, mem, mesh,
                                 _fp8_transpose_bytes(model, strategy, stage, held, mem)))
    total_nodes = 0
    ranks = list(ranks)
    first = _check_room(out, mesh, encodings, len(ranks))
    # The earlier set's manifest goes first: interrupted, the folder names no set it does not hold.
    (out / MANIFEST).unlink(missing_ok=True)
    for i, rank in enumerate(ranks):
        enc = encodings[mesh.coord(rank).pp]
        path = et_path(out, name, rank)
        try:
            data = first.pop(rank, None) or enc.encode_rank(_Binder(mesh, rank))
            path.write_bytes(data)
        except OSError as exc:  # the disk filled after all, or the folder went away
            raise ConfigError(f"cannot write {path}: {exc.strerror}; {i} of {len(ranks)} rank "
                              "files were written", what="output folder") from None
        total_nodes += enc.num_nodes
        if progress is not None:
            progress(i + 1, len(ranks))
    stale = _remove_stale(out, name, set(ranks))
    _write_manifest(out, name, mode, model, strategy, mesh, ranks, stats)
    return TraceSetSummary(out, name, mode, strategy.world_size, len(ranks), total_nodes, stats,
                           stale)


def _check_room(out: Path, mesh: Mesh, encodings: dict[int, RoleEncoding], files: int
                ) -> dict[int, bytes]:
    """Refuse, before the first file, a set larger than the free space of its folder: each
    stage's first rank file, times the files of that stage written (a disk that fills midway
    leaves a broken set after minutes of writing). Returns those first files by rank, encoded
    once: in representative mode they are the whole set."""
    per_stage = files // len(encodings)  # full mode: every stage's ranks; representative: one
    first = {r: enc.encode_rank(_Binder(mesh, r)) for enc, r in
             ((enc, mesh.rank_of(pp=stage, dp=0, cp=0, tp=0)) for stage, enc in encodings.items())}
    need = sum(len(b) for b in first.values()) * per_stage
    free = shutil.disk_usage(out).free
    if need > free:
        raise ConfigError(f"the set would write about {need / 1e9:,.1f} GB to {out}, which has "
                          f"{free / 1e9:,.1f} GB free: generate it in representative mode (one "
                          "rank file a pipeline stage), or free space", what="output folder")
    return first


def _write_manifest(out: Path, name: str, mode: Mode, model: ModelSpec, strategy: Strategy,
                    mesh: Mesh, ranks: list[int], stats: list[StageStats]) -> None:
    groups = mesh.groups
    (out / COMM_GROUPS).write_text(
        json.dumps({str(g.gid): list(g.ranks) for g in groups.values()}) + "\n")
    mult = mesh.multiplicity if mode == "representative" else 1
    manifest = {
        "format": FORMAT,
        "generator": f"trainsim {__version__}",
        "name": name,
        "mode": mode,
        "world_size": strategy.world_size,
        "model": model.to_dict(),
        "strategy": strategy.to_dict(),
        "coords_order": ["rank", "pp", "dp", "cp", "tp"],
        "coords": [list(dataclasses.astuple(mesh.coord(r))) for r in range(strategy.world_size)],
        "ranks_written": ranks,
        "multiplicity": {str(r): mult for r in ranks},
        "groups": {str(g.gid): {"axis": g.axis, "ranks": list(g.ranks)} for g in groups.values()},
        "stages": [_stage_entry(s, strategy) for s in stats],
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")


def _stage_entry(s: StageStats, strategy: Strategy) -> dict[str, Any]:
    """A stage's manifest entry; ``fp8_transpose_GiB`` where its GEMMs run in FP8 or NVFP4
    (absent, replay takes nothing off: a 16-bit set's manifest is as before)."""
    out = {"stage": s.stage, "nodes": s.nodes, "flop_by_phase": s.flop_by_phase,
           "comm_bytes_by_axis": s.comm_bytes_by_axis, "memory": s.memory.to_dict()}
    if strategy.precision in LOW_PRECISION_GEMMS:
        out["fp8_transpose_GiB"] = s.fp8_transpose_bytes / GiB
    return out


def read_manifest(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise TraceFormatError(f"{path} not found: not a trainsim trace set") from None
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise TraceFormatError(f"{path} is not a {FORMAT} manifest")
    problems = manifest_problems(data)
    if problems:
        raise TraceFormatError(f"{path}: " + "; ".join(problems) + " (regenerate the set with "
                               "`trainsim tracegen`, or remove the manifest to replay the .et "
                               "files as a foreign trace set)")
    return data
