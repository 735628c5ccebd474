"""Does a sweep's winner stand? Its table ranks the replayed strategies (the best K of the fast
path's screen) above the screened ones, and the two are not on one footing: replay adds what
the closed form leaves out (link sharing, stragglers), so a screened strategy listed below a
replayed one may be the faster of the two. ``verdict`` says which case a sweep is in, from
how far replay moved the strategies it replayed off their fast-path estimates: if no screened
strategy would outrank #1 even were replay to move it as little as it moved any replayed one,
#1 stands; otherwise it names them and the ``--top-k`` that replays them.
"""

from __future__ import annotations

import dataclasses

import polars as pl


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    replayed: int                  # strategies replayed
    gap_lo: float                  # replay / fast path − 1: least and most over them
    gap_hi: float
    best: str                      # #1's name
    contenders: tuple[str, ...]    # screened strategies that could outrank #1
    top_k: int                     # the --top-k that replays them (0 without contenders)
    margin: float                  # without: the best screened one's estimate over #1's, − 1

    def sentence(self) -> str:
        moved = (f"replay moved the replayed strategy's step time {_pct(self.gap_lo)} off the "
                 "fast path's" if self.replayed == 1 else
                 f"replay moved the step times of the {self.replayed} replayed strategies "
                 f"{_pct(self.gap_lo)} to {_pct(self.gap_hi)} off the fast path's")
        if not self.contenders:
            return (f"#1 ({self.best}) stands: {moved}; the best screened strategy's estimate "
                    f"is {_pct(self.margin)} off #1's, and moved as little it would still rank "
                    "below it")
        names = ", ".join(self.contenders[:3]) + (
            f" and {len(self.contenders) - 3} more" if len(self.contenders) > 3 else "")
        return (f"#1 ({self.best}) is not settled: {moved}; moved as little, the screened "
                f"{names} would rank above it — replay them with --top-k {self.top_k} into the "
                "same folder (what it replayed is kept)")


def _pct(x: float) -> str:
    """Signed to a tenth of a percent; none where it rounds to nothing (not "-0.0%")."""
    tenths = round(1000 * x)
    return f"{tenths / 10:+.1f}%" if tenths else "0.0%"


def verdict(results: pl.DataFrame, rank_by: str) -> Verdict | None:
    """The verdict on a sweep's ranked results (``sweep``'s frame or results.parquet), or None
    where there is none to give (nothing replayed, or nothing screened that fits)."""
    # (by the P90, the expected time: screened rows carry no spread to compare with)
    key = "step_time_s" if rank_by == "step_time" else "time_to_train_s"
    fits = results.filter(pl.col("fits").fill_null(False) & pl.col(key).is_not_null()
                          & pl.col("fast_step_time_s").is_not_null())
    # each row's key as the fast path has it (a replayed row's scaled by its step's ratio)
    fits = fits.with_columns((pl.col(key) * pl.col("fast_step_time_s") / pl.col("step_time_s"))
                             .alias("_fast_key"))
    replayed = fits.filter(pl.col("status") == "replayed")
    screened = fits.filter(pl.col("status") != "replayed")
    if replayed.is_empty() or screened.is_empty():
        return None
    gaps = replayed["step_time_s"] / replayed["fast_step_time_s"] - 1.0
    lo, hi = float(gaps.min()), float(gaps.max())  # type: ignore[arg-type]
    first = replayed.sort(key).row(0, named=True)
    contenders = screened.filter(pl.col(key) * (1.0 + lo) < first[key]).sort(key)
    if contenders.is_empty():
        margin = float(screened[key].min()) / first[key] - 1.0  # type: ignore[arg-type]
        return Verdict(replayed.height, lo, hi, first["strategy"], (), 0, margin)
    worst = float(contenders["_fast_key"].max())  # type: ignore[arg-type]
    top_k = int(fits.filter(pl.col("_fast_key") <= worst).height)
    return Verdict(replayed.height, lo, hi, first["strategy"],
                   tuple(contenders["strategy"].to_list()), top_k, 0.0)


__all__ = ["Verdict", "verdict"]
