"""Stamp a trace set's compute nodes with ``duration_micros`` from the GPU model.

ASTRA-sim, without its roofline, times a COMP node by the trace's ``duration_micros`` alone
(its ``Workload::issue_replay``: a node without one takes 1 ns), so a trace set trainsim
wrote — shapes and FLOPs, no durations — would run there with free compute. ``stamp`` writes
each compute node's time under the calibrated model of one system (the same
``RooflineCompute`` replay uses: wave quantization, attention curves, launches) into its
``duration_micros``, leaving every other byte of the node as it was.

The field is integer microseconds. Rounding each node on its own would lose up to 0.5 µs a
node, a bias that adds up over the ~10⁵ kernels of a rank's step; instead each stream's
running total is rounded (cumulative rounding: node i gets ``round(T_i) − round(T_{i−1})``
of the running model total T), so a stream's stamped sum stays within 0.5 µs of the model's.
A stamped node carries at least 1 µs: Chakra's 0 means "no duration" (ASTRA-sim skips such a
node when it has no ``num_ops``; replay's ``--compute trace`` falls back to the model), so the
floor keeps every stamped node stamped; the excess it adds is at most 1 µs per node below 1 µs
(none in trainsim's own sets: every kernel pays the launch overhead).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from chakra.schema.protobuf import et_def_pb2 as pb

from replay.compute import RooflineCompute
from replay.hardware import SystemSpec, resolve_system
from replay.reader import NodeRec, ReadCache, read_et_messages, uvarint
from replay.traceset import trace_files
from tracegen import __version__
from tracegen.errors import ConfigError, ReplayError, TraceFormatError
from tracegen.traceset import MANIFEST
from tracegen.units import NS_PER_S, NS_PER_US
from tracegen.writer import varint

STAMP_FILE = "stamp.json"
COMM_GROUPS = "comm_groups.json"
_DURATION_FIELD = 7  # Node.duration_micros (chakra et_def.proto)
_DURATION_KEY = bytes([_DURATION_FIELD << 3])  # field 7, wire type 0 (varint)


@dataclasses.dataclass(frozen=True, slots=True)
class StampSummary:
    """What ``stamp_trace_set`` wrote: counts over every node of every rank file."""

    out: Path
    system: str
    ranks: int
    stamped: int  # compute nodes given the model's duration
    kept: int  # compute nodes that had a duration and kept it (``only_missing``)
    untimed: int  # compute nodes the model cannot time (no FLOPs, bytes or duration): as they were
    replaced_us: int  # the durations the stamped nodes carried before (measured ones, say)
    model_ns: int  # the model's total over the stamped nodes
    stamped_us: int  # the stamped total
    max_drift_ns: int  # the largest |stamped − model| total of one rank's stream

    def to_dict(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        d["out"] = str(self.out)
        return d


class _Stamper:
    """The model's duration of each compute node, in integer µs by cumulative rounding."""

    def __init__(self, system: SystemSpec, only_missing: bool) -> None:
        self.model = RooflineCompute(system.gpu)
        self.host_Bps = system.node.host_cpu_GBps * 1e9
        self.only_missing = only_missing
        self.spliced: dict[tuple[bytes, int], bytes] = {}  # the ranks of a stage share nodes

    def splice(self, msg: bytes, us: int) -> bytes:
        """``with_duration``, cached: a stage's ranks carry the same compute nodes."""
        key = (msg, us)
        out = self.spliced.get(key)
        if out is None:
            out = self.spliced[key] = with_duration(msg, us)
        return out

    def node_ns(self, node: NodeRec) -> int | None:
        """The model's time of a compute node; None where it is not to be stamped."""
        if self.only_missing and node.duration_micros:
            return None
        if node.attrs.get("is_cpu_op"):  # a host op: its bytes at the host CPU rate, else
            size = int(node.attrs.get("tensor_size", 0))  # its own duration (replay's)
            if not size:
                return node.duration_micros * NS_PER_US or None
            return round(size / self.host_Bps * NS_PER_S) if self.host_Bps else None
        try:
            return self.model.duration_ns(node)
        except ReplayError:  # neither FLOPs, bytes nor a duration: nothing to time it by
            return None


def cumulative_us(durations_ns: list[int]) -> list[int]:
    """Integer µs per duration, ≥ 1 each, whose running sum tracks the running ns total: each
    gets ``round(T_i/1000) − stamped so far`` (at least 1), T_i the running total."""
    out, total_ns, emitted = [], 0, 0
    for d in durations_ns:
        total_ns += d
        us = max(1, (total_ns + NS_PER_US // 2) // NS_PER_US - emitted)
        out.append(us)
        emitted += us
    return out


def _fields(msg: bytes) -> Iterator[tuple[int, int, int]]:
    """(field number, start, end) of each top-level field of a protobuf message."""
    pos, end = 0, len(msg)
    while pos < end:
        start = pos
        key, pos = uvarint(msg, pos)
        wire = key & 7
        if wire == 0:
            _, pos = uvarint(msg, pos)
        elif wire == 2:
            size, pos = uvarint(msg, pos)
            pos += size
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:  # groups: not in Chakra's schema (the reader has parsed the node already)
            raise TraceFormatError(f"unsupported protobuf wire type {wire} in a node")
        yield key >> 3, start, pos


def with_duration(msg: bytes, us: int) -> bytes:
    """``msg`` (a serialized Node) with ``duration_micros`` = ``us``, in field order (where
    protobuf's own serializer puts it) and every other field's bytes unchanged."""
    before, after = bytearray(), bytearray()
    for field, start, end in _fields(msg):
        if field != _DURATION_FIELD:
            (before if field < _DURATION_FIELD else after).extend(msg[start:end])
    return bytes(before) + _DURATION_KEY + varint(us) + bytes(after)


@dataclasses.dataclass(slots=True)
class _Tally:
    """``StampSummary``'s counters while the files are stamped (the same names)."""

    stamped: int = 0
    kept: int = 0
    untimed: int = 0
    replaced_us: int = 0
    model_ns: int = 0
    stamped_us: int = 0
    max_drift_ns: int = 0


def _stamp_rank(path: Path, rank: int, stamper: _Stamper, cache: ReadCache, tally: _Tally
                ) -> bytes:
    """The rank file's bytes with its compute nodes stamped (streams rounded apart)."""
    trace, msgs = read_et_messages(path, rank, cache)  # validated, and read once
    streams: dict[bool, list[tuple[int, int]]] = {}  # is_cpu_op → (message index, ns)
    for k, node in enumerate(trace.nodes, start=1):
        if node.type != pb.COMP_NODE:
            continue
        ns = stamper.node_ns(node)
        if ns is None:
            if node.duration_micros and stamper.only_missing:
                tally.kept += 1
            else:
                tally.untimed += 1
            continue
        streams.setdefault(bool(node.attrs.get("is_cpu_op")), []).append((k, ns))
        tally.replaced_us += node.duration_micros
    body = [m for _, m in msgs]
    for items in streams.values():
        durations = [ns for _, ns in items]
        stamped = cumulative_us(durations)
        for (k, _), us in zip(items, stamped, strict=True):
            body[k] = stamper.splice(body[k], us)
        total_ns, total_us = sum(durations), sum(stamped)
        tally.stamped += len(items)
        tally.model_ns += total_ns
        tally.stamped_us += total_us
        tally.max_drift_ns = max(tally.max_drift_ns, abs(total_us * NS_PER_US - total_ns))
    return b"".join(varint(len(m)) + m for m in body)


def stamp_trace_set(src: str | Path, system: str | Path | SystemSpec,
                    out: str | Path | None = None, *,
                    only_missing: bool = False,
                    progress: Callable[[int, int], None] | None = None) -> StampSummary:
    """Write ``src``'s trace set to ``out`` (in place where None) with every compute node's
    ``duration_micros`` from ``system``'s GPU model; ``only_missing`` keeps the durations nodes
    already carry (a profiled set's measured times). The manifest and comm groups are copied;
    ``stamp.json`` beside them records the system (a preset name, TOML file or SystemSpec)
    and the totals."""
    system = system if isinstance(system, SystemSpec) else resolve_system(system)
    src_dir, name, files, manifest = trace_files(Path(src))
    dest = src_dir if out is None else Path(out)
    if out is not None:
        _check_destination(src_dir, dest)
        dest.mkdir(parents=True, exist_ok=True)
        for extra in (MANIFEST, COMM_GROUPS) if manifest is not None else (COMM_GROUPS,):
            if (src_dir / extra).is_file():
                shutil.copyfile(src_dir / extra, dest / extra)
    stamper, cache, tally = _Stamper(system, only_missing), ReadCache(), _Tally()
    for i, (rank, path) in enumerate(sorted(files.items())):
        data = _stamp_rank(path, rank, stamper, cache, tally)
        target = dest / path.name
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)  # a file is either the old one or the whole new one
        if progress:
            progress(i + 1, len(files))
    summary = StampSummary(dest, system.name, len(files), **dataclasses.asdict(tally))
    record = {"generator": f"trainsim {__version__}", "workload": name, "source": str(src_dir),
              "gpu": system.gpu.name, "only_missing": only_missing, **summary.to_dict()}
    (dest / STAMP_FILE).write_text(json.dumps(record, indent=2) + "\n")
    return summary


def _check_destination(src: Path, dest: Path) -> None:
    if dest.exists() and not dest.is_dir():
        raise ConfigError(f"{dest} is a file, not a folder", what="--out")
    if dest.resolve() == src.resolve():
        raise ConfigError(f"{dest} is the trace set's own folder: name another, or stamp the "
                          "set in place (--in-place)", what="--out")
    if dest.is_dir() and any(p.name.endswith(".et") for p in dest.iterdir()):
        raise ConfigError(f"{dest} already holds trace files: name an empty or new folder",
                          what="--out")
