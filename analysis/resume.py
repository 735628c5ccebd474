"""Which study a results folder holds, so that a re-run resumes only its own work.

A sweep keeps each finished chunk as a part file and skips, when run again, every strategy a
part already holds. A strategy's id says the layout, not the model, system or failure tables
it was costed with: a re-run into the same folder with another system had taken the first
run's rows as its own and ranked them beside its new ones. The folder therefore records what
its rows depend on besides the strategy (``fingerprint``), and a run whose study differs there
is refused before any work, naming what differs. The search space is not part of it: widening
a space and running again into the same folder resumes, as it should.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from analysis.study import RATE_KEYS, Study
from tracegen import ConfigError, __version__

RECORD = "study.json"  # in the folder's parts/ directory, beside the part files
# How a refusal names the way out: the CLI's flag (the Python functions' ``fresh=True``)
AFRESH = "--fresh (it deletes the earlier run's results: parts/ of that folder)"


def fingerprint(study: Study) -> dict[str, Any]:
    """What every result row of ``study`` depends on besides its strategy, as JSON values."""
    data = {"trainsim": __version__, "model": study.model.to_dict(),
            "system": dataclasses.asdict(study.system), "gpus": study.gpus,
            "global_batch_size": study.global_batch_size, "tokens": study.tokens,
            "failures": study.failures, "checkpoint": study.checkpoint,
            "restart": study.restart, "policies": study.policies}
    for table in ("fail_slow", "slow_links", "site_links"):  # (absent when empty: folders
        if getattr(study, table):  # written before the table existed still match)
            data[table] = getattr(study, table)
    if study.stack:  # (its strategy values change the strategies; absent when none)
        data["stack"] = study.stack
    if study.mixed is not None:
        mixed: dict[str, Any] = {"system": dataclasses.asdict(study.mixed.system),
                                 "gpus": study.mixed.gpus, "balance": study.mixed.balance}
        for table, key in RATE_KEYS.items():  # (absent at 1: older folders match)
            if study.mixed.rate_factor(table) != 1.0:
                mixed[key] = study.mixed.rate_factor(table)
        data["mixed"] = mixed
    return dict(json.loads(json.dumps(data, sort_keys=True, default=str)))


def claim(parts_dir: Path, study: Study) -> None:
    """Record ``study`` as the owner of ``parts_dir``, or refuse if it holds another's parts."""
    record = parts_dir / RECORD
    now = fingerprint(study)
    if record.is_file():
        try:
            before = json.loads(record.read_text())
        except (OSError, json.JSONDecodeError):
            before = None
        if before == now:
            return
        raise ConfigError(_refusal(parts_dir, before, now), what="output folder")
    if any(parts_dir.rglob("part-*.parquet")):
        raise ConfigError(f"{parts_dir} holds results with no record of the study they belong "
                          f"to (an earlier trainsim wrote them): give another --out, or run "
                          f"again with {AFRESH}", what="output folder")
    parts_dir.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")


def clear(parts_dir: Path) -> None:
    """Delete what earlier runs left in ``parts_dir`` (their part files, timelines and study
    record; not the lock of the run that calls this, which must hold it: ``writing``), so that
    a run starts afresh."""
    for entry in sorted(parts_dir.iterdir()) if parts_dir.is_dir() else ():
        if entry.name == LOCK:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _refusal(parts_dir: Path, before: Any, now: dict[str, Any]) -> str:
    if not isinstance(before, dict):
        return (f"{parts_dir / RECORD} is unreadable, so the results beside it cannot be "
                f"matched to a study: run again with {AFRESH}")
    differ = [_change(key, before.get(key), now.get(key))
              for key in sorted(now.keys() | before.keys()) if before.get(key) != now.get(key)]
    return (f"{parts_dir.parent} holds results of another study ({'; '.join(differ)}); a re-run "
            f"resumes only the same study: give another --out, or run again with {AFRESH}")


def _change(key: str, before: Any, now: Any) -> str:
    """One difference in words: a model or system by its name (or which of its values moved
    where the name stayed), other values as they are."""
    if key in ("model", "system") and isinstance(before, dict) and isinstance(now, dict):
        if before.get("name") != now.get("name"):
            return f"{key} {before.get('name')} → {now.get('name')}"
        moved = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
        return f"{key} {now.get('name')}: {', '.join(moved)} changed"
    return f"{key} {json.dumps(before, sort_keys=True)} → {json.dumps(now, sort_keys=True)}"


LOCK = "writer.lock"  # in the parts directory while a run writes there


@contextlib.contextmanager
def writing(parts_dir: Path) -> Iterator[None]:
    """Hold ``parts_dir`` for one run: two runs into one folder (a sweep started again in
    another terminal while the first goes on) number their parts from the same highest one,
    and the later rename replaced the earlier part: strategies lost from both runs' results.
    A lock left by a run that died (its process is gone) is taken over."""
    parts_dir.mkdir(parents=True, exist_ok=True)
    lock = parts_dir / LOCK
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            break
        except FileExistsError:
            _refuse_or_clear(lock)
    else:  # (cleared, then taken by another run in between)
        _refuse_or_clear(lock)
        raise ConfigError(f"{lock} keeps reappearing: another run is starting here",
                          what="output folder")
    with os.fdopen(fd, "w") as f:
        json.dump({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()},
                  f)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def _refuse_or_clear(lock: Path) -> None:
    """Refuse while the lock's run is alive (or on another host, where that cannot be seen);
    remove a lock whose process is gone or that cannot be read."""
    try:
        held = json.loads(lock.read_text())
        pid, host = int(held["pid"]), str(held["host"])
    except (OSError, ValueError, KeyError, TypeError):
        lock.unlink(missing_ok=True)
        return
    if host == socket.gethostname() and not _alive(pid):
        lock.unlink(missing_ok=True)
        return
    where = f"process {pid}" + ("" if host == socket.gethostname() else f" on {host}")
    raise ConfigError(f"another trainsim run ({where}) is writing to {lock.parent.parent}: "
                      "wait for it to finish, or give another --out (if that run is gone, "
                      f"delete {lock})", what="output folder")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
