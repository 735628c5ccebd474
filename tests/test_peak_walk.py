"""The in-flight activation peak of a long run is its first warm-ups' (``memory.
_peak_chunk_load`` walks at most ``peak_walk_count`` micro-batches): equal to the walk over
every pass past the cap, on every schedule's order, and GPipe's closed form equal to its
walk."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracegen import ConfigError, Strategy, memory


@st.composite
def orders(draw: st.DrawFn) -> tuple[str, int, int, int]:
    """(order id, p, v, stage) of a schedule the strategies can run."""
    kind = draw(st.sampled_from(["1f1b", "zb_h1", "zb_v", "interleaved", "grouped", "a2a"]))
    p = draw(st.integers(2, 6))
    stage = draw(st.integers(0, p - 1))
    if kind in ("1f1b", "zb_h1"):
        return kind, p, 1, stage
    if kind == "zb_v":
        return kind, p, 2, stage
    v = draw(st.integers(2, 4))
    if kind == "grouped":
        return f"interleaved_1f1b/{draw(st.integers(p + 1, 2 * p))}", p, v, stage
    return "interleaved_1f1b" + ("+a2a" if kind == "a2a" else ""), p, v, stage


@settings(max_examples=150, deadline=None)
@given(order=orders(), extra=st.integers(1, 40),
       sizes=st.lists(st.integers(1, 1000), min_size=4, max_size=4),
       holds=st.lists(st.integers(0, 500), min_size=4, max_size=4))
def test_a_long_runs_peak_is_the_walk_over_every_pass(order: tuple[str, int, int, int],
                                                      extra: int, sizes: list[int],
                                                      holds: list[int]) -> None:
    order_id, p, v, stage = order
    cap = memory.peak_walk_count(order_id, 10**9, p, v)  # (≤ the cap plus one period)
    m = cap + extra
    per_chunk = tuple(sizes[:v])
    hold = tuple(h % (c + 1) for h, c in zip(holds[:v], per_chunk, strict=True)) if (
        order_id.startswith("zb")) else ()
    memory._peak_chunk_load.cache_clear()
    assert memory._peak_chunk_load(order_id, m, p, v, stage, per_chunk, hold) == (
        memory._walk_peak(order_id, m, p, v, stage, per_chunk, hold))


@given(m=st.integers(1, 300), size=st.integers(1, 10**6))
def test_gpipe_holds_every_micro_batch(m: int, size: int) -> None:
    assert memory._peak_chunk_load("gpipe", m, 4, 1, 1, (size,)) == memory._walk_peak(
        "gpipe", m, 4, 1, 1, (size,)) == m * size


def test_a_global_batch_given_in_tokens_is_caught() -> None:
    """4 M tokens typed as sequences: 1 M micro-batches a pipeline — refused with the unit,
    where the grouped and merged walks, linear in the count, would have run for minutes."""
    with pytest.raises(ConfigError, match="counts sequences, not tokens"):
        Strategy(tp=2, pp=4, dp=4, micro_batch_size=1, global_batch_size=4_194_304)
    ok = Strategy(tp=2, pp=4, dp=4, micro_batch_size=1, global_batch_size=4 * 100_000)
    assert ok.num_microbatches == 100_000
