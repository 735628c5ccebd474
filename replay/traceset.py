"""Locate and load a trace set: ours (with manifest.json), a directory of ``NAME.RANK.et`` files,
or a workload prefix as ASTRA-sim takes it (``path/name`` for ``path/name.<rank>.et``)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from replay.reader import RankTrace, ReadCache, read_et
from tracegen.errors import TraceFormatError
from tracegen.traceset import MANIFEST, read_manifest

_ET_RE = re.compile(r"^(?P<name>.+)\.(?P<rank>\d+)\.et$")


@dataclasses.dataclass(frozen=True, slots=True)
class TraceSet:
    name: str
    world_size: int
    ranks: list[RankTrace]
    groups: dict[str, tuple[int, ...]]  # pg_name → member ranks
    group_axis: dict[str, str]  # pg_name → axis (ours), else "group"
    multiplicity: dict[int, int]  # rank → ranks it stands for (1 in full mode)
    manifest: dict[str, Any] | None

    @property
    def representative(self) -> bool:
        return any(m > 1 for m in self.multiplicity.values())

    @property
    def num_nodes(self) -> int:
        return sum(len(r.nodes) for r in self.ranks)


def _find_files(path: Path) -> tuple[str, dict[int, Path]]:
    if path.is_dir():
        files = [p for p in path.iterdir() if _ET_RE.match(p.name)]
        names = sorted({_ET_RE.match(p.name).group("name") for p in files})  # type: ignore[union-attr]
        if not names:
            raise TraceFormatError(f"{path} holds no NAME.RANK.et files")
        if len(names) > 1:
            raise TraceFormatError(f"{path} holds several workloads ({', '.join(names)}); pass "
                                   f"{path}/NAME to choose one")
        name, folder = names[0], path
    else:
        name, folder = path.name, path.parent
        if not folder.is_dir():
            raise TraceFormatError(f"{path}: neither a trace-set directory nor a workload prefix "
                                   f"(folder {folder} does not exist)")
    ranks: dict[int, Path] = {}
    for p in folder.iterdir():
        m = _ET_RE.match(p.name)
        if m and m.group("name") == name:
            ranks[int(m.group("rank"))] = p
    if not ranks:
        raise TraceFormatError(f"no {name}.<rank>.et files in {folder}")
    return name, ranks


def load_comm_groups(path: str | Path, world_size: int) -> dict[str, tuple[int, ...]]:
    """An ASTRA-sim comm-group JSON: {"1": [0, 1, ...], ...} with positive integer keys."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TraceFormatError(f"comm groups {p}: cannot read JSON ({exc})") from None
    if not isinstance(data, dict):
        raise TraceFormatError(f"comm groups {p}: expected an object {{\"1\": [ranks], ...}}")
    out: dict[str, tuple[int, ...]] = {}
    for key, ranks in data.items():
        if not (key.isdigit() and int(key) > 0):
            raise TraceFormatError(f"comm groups {p}: key {key!r} is not a positive integer")
        if not (isinstance(ranks, list) and ranks and all(isinstance(r, int) for r in ranks)):
            raise TraceFormatError(f"comm groups {p}: group {key} must be a non-empty list of ranks")
        bad = [r for r in ranks if not 0 <= r < world_size]
        if bad:
            raise TraceFormatError(f"comm groups {p}: group {key} names ranks {bad} outside the "
                                   f"world of {world_size}")
        out[key] = tuple(ranks)
    return out


def load_trace_set(path: str | Path, *, comm_groups: str | Path | None = None,
                   progress: Callable[[int, int], None] | None = None) -> TraceSet:
    """Read every rank file of a trace set and its groups."""
    p = Path(path)
    if not p.is_dir() and (p.parent / MANIFEST).is_file():  # a prefix inside one of our sets
        if read_manifest(p.parent).get("name") == p.name:
            p = p.parent
    manifest = read_manifest(p) if (p / MANIFEST).is_file() else None
    if manifest is not None:
        name = manifest["name"]
        files = {r: p / f"{name}.{r}.et" for r in manifest["ranks_written"]}
        missing = [r for r, f in files.items() if not f.is_file()]
        world = int(manifest["world_size"])
    else:
        name, files = _find_files(p)
        world = max(files) + 1
        missing = [r for r in range(world) if r not in files]
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise TraceFormatError(f"trace set {p}: rank file(s) missing for rank(s) {shown} "
                               f"({len(missing)} of {len(files) + len(missing)})")
    cache = ReadCache()
    ranks = []
    for i, (r, f) in enumerate(sorted(files.items())):
        ranks.append(read_et(f, r, cache))
        if progress:
            progress(i + 1, len(files))
    groups, axes = _groups(manifest, comm_groups, world)
    mult = ({int(k): int(v) for k, v in manifest["multiplicity"].items()} if manifest
            else {r: 1 for r in files})
    return TraceSet(name, world, ranks, groups, axes, mult, manifest)


def _groups(manifest: dict[str, Any] | None, comm_groups: str | Path | None,
            world: int) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    if comm_groups is not None:
        groups = load_comm_groups(comm_groups, world)
        return groups, {k: "group" for k in groups}
    if manifest is not None:
        g = manifest["groups"]
        return ({k: tuple(v["ranks"]) for k, v in g.items()}, {k: v["axis"] for k, v in g.items()})
    return {}, {}
