"""Fast-path work per strategy, counted rather than timed: this VM's speed drifts by ±40% from
minute to minute, so wall-clock rates cannot tell a 5% change from noise. Counts the Python
bytecodes one cold sweep of the benchmark's 600 GPT-3 175B strategies executes (deterministic
on any machine with this Python), and, where valgrind is installed, the machine instructions
(callgrind; two runs, with and without the sweep, so start-up cancels out)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = 3  # cold sweeps in the instruction count


def _setup() -> tuple[Any, ...]:
    sys.path.insert(0, str(ROOT))
    from analysis.fastpath import clear_cache, estimate
    from bench.bench_fastpath import strategies
    from replay import get_system
    from tracegen import get_model

    return get_model("gpt3-175b"), get_system("dgx-a100-80gb"), strategies(), estimate, clear_cache


def sweep(rounds: int) -> None:
    """``rounds`` cold sweeps (what the instruction count runs under valgrind)."""
    model, system, cands, estimate, clear_cache = _setup()
    for _ in range(rounds):
        clear_cache()
        for s in cands:
            estimate(model, s, system)


def bytecodes_per_strategy(interleaved: bool = False) -> float:
    """Per strategy of the benchmark's sweep, or of its interleaved (vpp 2) strategies alone.
    The interleaved schedule's step plans are built before the count (a sweep builds each once
    and keeps it across rounds; ``clear_cache`` leaves them)."""
    sweep(1)  # imports and first-call set-up happen outside the count
    model, system, cands, estimate, clear_cache = _setup()
    if interleaved:
        from bench.bench_fastpath import strategies  # importable once _setup put ROOT on the path

        cands = strategies(vpps=(2,))
        for s in cands:
            estimate(model, s, system)
    clear_cache()
    count = 0

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "opcode":
            count += 1
        return local

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        return local

    sys.settrace(tracer)
    try:
        for s in cands:
            estimate(model, s, system)
    finally:
        sys.settrace(None)
    return count / len(cands)


def instructions_per_strategy() -> float | None:
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        return None

    def refs(rounds: int) -> int:
        out = subprocess.run(
            [valgrind, "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable,
             __file__, "--sweep", str(rounds)], capture_output=True, text=True, check=True)
        line = next(x for x in out.stderr.splitlines() if "refs:" in x)
        return int(line.split()[-1].replace(",", ""))

    n = len(_setup()[2])
    return (refs(ROUNDS) - refs(0)) / (ROUNDS * n)


def main() -> None:
    if sys.argv[1:2] == ["--sweep"]:
        sweep(int(sys.argv[2]))
        return
    print(f"fast path work: {bytecodes_per_strategy():,.0f} Python bytecodes per strategy "
          "(cold sweep of 600 GPT-3 175B strategies)")
    print(f"  interleaved 1F1B (vpp 2, the sweep's default space adds 288): "
          f"{bytecodes_per_strategy(interleaved=True):,.0f} per strategy")
    instr = instructions_per_strategy()
    if instr is None:
        print("  machine instructions: valgrind not installed here")
    else:
        print(f"  {instr:,.0f} machine instructions per strategy (callgrind, {ROUNDS} sweeps)")


if __name__ == "__main__":
    main()
