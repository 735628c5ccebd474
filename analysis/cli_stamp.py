"""``trainsim stamp``: write the GPU model's compute times into a trace set's ``duration_micros``
(replay/stamp.py), so a simulator that reads only those (ASTRA-sim without its roofline) runs
trainsim's calibrated compute."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from analysis.cli_common import app, console, output_dir, progress_bar
from tracegen import ConfigError
from tracegen.units import NS_PER_S, NS_PER_US

if TYPE_CHECKING:
    from replay.hardware import SystemSpec

SystemOpt = Annotated[str, typer.Option(help="Preset system (see `trainsim systems`) or a TOML "
                                             "system file whose GPU model times the nodes.")]


@app.command("stamp")
def stamp_cmd(
    trace: Annotated[Path, typer.Argument(help="Trace-set directory, or a workload prefix "
                                               "path/name for path/name.<rank>.et")],
    system: SystemOpt,
    out: Annotated[Path | None, typer.Option(
        "-o", "--out", help="Folder for the stamped set (the manifest and comm groups are "
                            "copied beside it).")] = None,
    in_place: Annotated[bool, typer.Option(
        "--in-place", help="Rewrite the set's own files instead of writing to --out.")] = False,
    only_missing: Annotated[bool, typer.Option(
        "--only-missing", help="Keep the durations nodes already carry (a profiled set's "
                               "measured times); stamp only the others.")] = False,
) -> None:
    """Stamp every compute node's duration_micros with the GPU model's time on SYSTEM, for
    simulators that time compute by the trace (ASTRA-sim without its roofline)."""
    from replay import resolve_system
    from replay.stamp import stamp_trace_set

    if (out is None) == (not in_place):
        raise ConfigError("give either --out FOLDER (a stamped copy) or --in-place (rewrite the "
                          "set's own files), not both or neither", what="stamp options")
    spec = resolve_system(system)
    with progress_bar() as bar:
        task = bar.add_task("stamping ranks", total=None)
        summary = stamp_trace_set(trace, spec, output_dir(out, "--out") if out else None,
                                  only_missing=only_missing,
                                  progress=lambda i, n: bar.update(task, completed=i, total=n))
    console.print(f"stamped {summary.stamped:,} compute nodes on {summary.ranks:,} rank files "
                  f"with {spec.name}'s GPU model ({spec.gpu.name}): "
                  f"{summary.stamped_us / 1e6:.6f} s of compute in all, "
                  f"{summary.model_ns / NS_PER_S:.6f} s modelled; largest drift of one "
                  f"stream {summary.max_drift_ns / NS_PER_US:.3f} µs → {summary.out}")
    if summary.replaced_us:
        console.print(f"note: the stamped nodes carried {summary.replaced_us / 1e6:.6f} s of "
                      "durations before, now replaced (--only-missing keeps them)")
    if summary.kept:
        console.print(f"note: {summary.kept:,} nodes kept the durations they carried")
    _note_precision(trace, spec)
    if summary.untimed:
        console.print(f"note: {summary.untimed:,} compute nodes carry neither FLOPs, bytes nor "
                      "a duration (or are host ops on a system without host_cpu_GBps) and were "
                      "left as they were")


def _note_precision(trace: Path, spec: SystemSpec) -> None:
    """A set of ours in a precision the system's GPU lacks (FP8 on an A100): stamped at its
    16-bit rate, as replay costs it; say so as replay does."""
    from analysis.cli_common import note_precision
    from replay.traceset import trace_files

    manifest = trace_files(trace)[3]
    if manifest is not None:
        note_precision({str(manifest["strategy"].get("precision", "bf16"))}, spec,
                       {str(manifest["strategy"].get("fp8_recipe", "delayed"))})
