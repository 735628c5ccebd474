"""Locate and load a trace set: ours (with manifest.json), a directory of ``NAME.RANK.et`` files,
or a workload prefix as ASTRA-sim takes it (``path/name`` for ``path/name.<rank>.et``)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from replay.fold import NotFoldable, Template, _Mesh
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
    folded: bool = False  # a full-mode set proven symmetric and replayed by representatives

    @property
    def representative(self) -> bool:
        return any(m > 1 for m in self.multiplicity.values())

    @property
    def num_nodes(self) -> int:
        """Nodes held in memory and simulated."""
        return sum(len(r.nodes) for r in self.ranks)

    @property
    def file_nodes(self) -> int:
        """Nodes in the set's files (a folded set counts every rank it proved equivalent)."""
        if self.folded:
            return sum(len(r.nodes) * self.multiplicity[r.rank] for r in self.ranks)
        return self.num_nodes


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
        raise TraceFormatError(f"{path} is not a trace-set directory, and {folder} holds no "
                               f"{name}.<rank>.et files: pass a trace-set directory or a "
                               "workload prefix (path/NAME for path/NAME.<rank>.et)")
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
            raise TraceFormatError(f"comm groups {p}: group {key} must be a non-empty list of "
                                   "ranks")
        bad = [r for r in ranks if not 0 <= r < world_size]
        if bad:
            raise TraceFormatError(f"comm groups {p}: group {key} names ranks {bad} outside the "
                                   f"world of {world_size}")
        out[key] = tuple(ranks)
    return out


def trace_files(path: Path) -> tuple[Path, str, dict[int, Path], dict[str, Any] | None]:
    """A trace set's folder, workload name, rank → file and manifest (None for a foreign set):
    ours (the manifest's ranks), a folder of ``NAME.RANK.et`` files or a workload prefix; every
    rank file present."""
    p = path
    inside_ours = not p.is_dir() and (p.parent / MANIFEST).is_file()
    if inside_ours and read_manifest(p.parent).get("name") == p.name:  # a prefix of our set
        p = p.parent
    manifest = read_manifest(p) if (p / MANIFEST).is_file() else None
    if manifest is not None:
        name = manifest["name"]
        files = {r: p / f"{name}.{r}.et" for r in manifest["ranks_written"]}
        missing = [r for r, f in files.items() if not f.is_file()]
        expected = len(files)
    else:
        name, files = _find_files(p)
        missing = [r for r in range(max(files) + 1) if r not in files]
        expected = max(files) + 1
    if missing:
        shown = ", ".join(map(str, missing[:10])) + (" ..." if len(missing) > 10 else "")
        raise TraceFormatError(f"trace set {p}: rank file(s) missing for rank(s) {shown} "
                               f"({len(missing)} of {expected})")
    return (p if p.is_dir() else p.parent), name, files, manifest


def load_trace_set(path: str | Path, *, comm_groups: str | Path | None = None, fold: bool = True,
                   progress: Callable[[int, int], None] | None = None) -> TraceSet:
    """Read every rank file of a trace set and its groups. With ``fold``, a full-mode set whose
    ranks provably run their stage's program is replayed by one rank per stage (replay/fold.py)."""
    _, name, files, manifest = trace_files(Path(path))
    world = int(manifest["world_size"]) if manifest is not None else max(files) + 1
    cache = ReadCache()
    groups, axes = _groups(manifest, comm_groups, world)
    if fold and manifest is not None and manifest["mode"] == "full" and comm_groups is None:
        folded = _try_fold(manifest, files, cache, progress)
        if folded is not None:
            ranks, mult = folded
            return TraceSet(name, world, ranks, groups, axes, mult, manifest, folded=True)
    ranks = []
    for i, (r, f) in enumerate(sorted(files.items())):
        ranks.append(read_et(f, r, cache))
        if progress:
            progress(i + 1, len(files))
    mult = ({int(k): int(v) for k, v in manifest["multiplicity"].items()} if manifest
            else {r: 1 for r in files})
    return TraceSet(name, world, ranks, groups, axes, mult, manifest)


def _try_fold(manifest: dict[str, Any], files: dict[int, Path], cache: ReadCache,
              progress: Callable[[int, int], None] | None
              ) -> tuple[list[RankTrace], dict[int, int]] | None:
    """Representatives + multiplicities when every rank provably runs its stage's program."""
    mesh = _Mesh(manifest)
    classes: dict[int, list[int]] = {}
    for r in sorted(files):
        classes.setdefault(mesh.coord[r][0], []).append(r)
    reps, mult = [], {}
    done = 0
    try:
        for members in classes.values():
            rep = read_et(files[members[0]], members[0], cache)
            template = Template(rep, mesh)
            for r in members[1:]:
                if not template.matches(files[r], r):
                    return None
                done += 1
                if progress:
                    progress(done, len(files))
            reps.append(rep)
            mult[rep.rank] = len(members)
            done += 1
    except (NotFoldable, KeyError, IndexError):  # a mesh the manifest does not close: unfolded
        return None
    return reps, mult


def _groups(manifest: dict[str, Any] | None, comm_groups: str | Path | None,
            world: int) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    if comm_groups is not None:
        groups = load_comm_groups(comm_groups, world)
        return groups, {k: "group" for k in groups}
    if manifest is not None:
        g = manifest["groups"]
        return ({k: tuple(v["ranks"]) for k, v in g.items()}, {k: v["axis"] for k, v in g.items()})
    return {}, {}
