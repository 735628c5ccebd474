"""The interleaved walk's shortcut (``analysis/pipeline_walk.py``): a long run is extrapolated
from a few rounds only where a certificate proves that no cycle of the steady schedule is slower
than the busiest stage's own work (``_certified``). Held here against the whole walk for any
per-stage, per-chunk costs, and the certificate against the steady graph's exact cycles."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis import pipeline_walk as W
from tracegen import Strategy

ORDER = "interleaved_1f1b"


def _strategy(p: int, v: int, m: int) -> Strategy:
    return Strategy(pp=p, dp=1, vpp=v, micro_batch_size=1, global_batch_size=m,
                    schedule=ORDER)


def _costs(data: st.DataObject, p: int, v: int) -> tuple[list[tuple[int, ...]],
                                                          list[tuple[int, ...]], list[int]]:
    """Random per-stage, per-chunk costs (no real pipeline has them: the hard case), or costs
    within 20% of one another (what real stages look like)."""
    spread = data.draw(st.sampled_from([0.2, 1.0]))
    unit = st.floats(1 - spread, 1) if spread < 1 else st.floats(1e-6, 1)
    fwd = [tuple(round(10**6 * data.draw(unit)) for _ in range(v)) for _ in range(p)]
    bwd = [tuple(round(2 * 10**6 * data.draw(unit)) for _ in range(v)) for _ in range(p)]
    c = [data.draw(st.integers(0, 10**5)) for _ in range(p)]
    return fwd, bwd, c


@pytest.mark.parametrize(("m", "f", "b", "c"), [
    (22, [(720655, 158783), (237272, 100858)], [(1151177, 1552542), (1893105, 1407467)],
     [13003, 30597]),
    (20, [(767102, 206271), (318210, 246891), (853784, 664729), (68729, 43246)],
     [(1974147, 697054), (1262545, 1837456), (1535197, 791422), (447564, 765479)],
     [80060, 89742, 92604, 10055])])
def test_a_round_trip_slower_than_the_busiest_stage_is_not_missed(m, f, b, c) -> None:
    """Two random-cost interleaved pipelines whose first rounds add exactly the busiest stage's
    work, several rounds running, before a slower round trip through the stages overtakes it:
    the shortcut took them for steady (3.8% and 3.4% too fast). The certificate fails on them,
    walking goes on, and the answer is the whole walk's."""
    p, v = len(f), len(f[0])
    assert W.interleaved(_strategy(p, v, m), f, b, c) == W._walk(ORDER, p, m, v, f, b, c,
                                                                 None, None)


@settings(max_examples=200, deadline=None)
@given(p=st.sampled_from([2, 3, 4]), v=st.sampled_from([2, 3, 4]), rounds=st.integers(4, 12),
       data=st.data())
def test_the_shortcut_equals_the_whole_walk_for_any_costs(p, v, rounds, data) -> None:
    """Every stage's end and every chunk's, to the nanosecond, whatever the costs."""
    fwd, bwd, c = _costs(data, p, v)
    m = rounds * p
    assert W.interleaved(_strategy(p, v, m), fwd, bwd, c) == W._walk(ORDER, p, m, v, fwd, bwd,
                                                                     c, None, None)


def test_the_steady_edges_are_every_wait_of_a_middle_round_of_a_longer_walk() -> None:
    """The periodic graph read from round 2 of each stage's order of 6 rounds is the one round 6
    of a 12-round walk has: every class waits on its stage's previous step and (but for a first
    chunk's forward on the first stage and a last chunk's backward on the last) the neighbouring
    chunk's same micro-batch, the same number of rounds back."""
    for p, v in ((2, 2), (3, 2), (4, 3), (8, 2), (5, 7), (16, 4)):
        per = 2 * p * p * v
        edges = set(W.steady_edges(ORDER, p, v))
        later, prev = set(), [0] * p
        for stage, bw, k, dep, ch in W._plan(ORDER, 12 * p, p, v):
            slot = W._slot(k, bw)
            if (slot - 1) // per == 6:
                i = (bw * p + stage) * v + ch
                q = prev[stage]
                later.add(((q - 1) % per, (slot - 1) % per, 6 - (q - 1) // per, i, False))
                if dep >= 0:
                    d = W._slot(dep, bw)
                    later.add(((d - 1) % per, (slot - 1) % per, 6 - (d - 1) // per, i, True))
            prev[stage] = slot
        assert later == edges
        into = [sum(x == y[1] for y in edges) for x in range(per)]
        assert into.count(1) == 2 * p and set(into) == {1, 2} and len(edges) == 2 * per - 2 * p


def _slower_cycle(p: int, v: int, plain: W._Plain, lam: int) -> bool:
    """Whether some cycle of the steady graph weighs more than ``lam`` per round: a positive
    cycle of the weights w − δ·λ (Bellman-Ford, longest paths)."""
    edges = W.steady_edges(ORDER, p, v)
    index = W._class_costs(p, v)
    dist = [0] * (2 * p * p * v)
    for _ in range(len(dist) + 1):
        changed = False
        for q, e, delta, i, data in edges:
            w = plain.cost[i] + (plain.send[index[q]] if data else 0) - delta * lam
            if dist[q] + w > dist[e]:
                dist[e], changed = dist[q] + w, True
        if not changed:
            return False
    return True


@settings(max_examples=200, deadline=None)
@given(p=st.sampled_from([2, 3, 4]), v=st.sampled_from([2, 3]), data=st.data())
def test_a_certificate_is_given_only_where_no_cycle_is_slower(p, v, data) -> None:
    """Soundness: where the walk's potentials certify the busiest stage's work λ, no cycle of
    the steady schedule is slower than λ per round (checked exhaustively), and the potentials
    satisfy every edge, not only the few the certificate reads (the others hold by
    construction). Where it is refused nothing is claimed: it may refuse a pipeline with no
    slower cycle (a walk not yet periodic at 3p), which then walks on."""
    fwd, bwd, c = _costs(data, p, v)
    plain = W._Plain(ORDER, p, v, fwd, bwd, c)
    _, (m, slots) = plain.walk(3 * p)
    lam = plain.busiest
    if not W._certified(ORDER, p, v, plain, lam, m, slots):
        return
    assert not _slower_cycle(p, v, plain, lam)
    per, index = 2 * p * p * v, W._class_costs(p, v)
    ends = [slots[0][1 + x + r * per] - plain.send[index[x]] - r * lam
            for x, r in enumerate(max(r, 0) for r in W.potential_rounds(ORDER, m, p, v))]
    for q, e, delta, i, dat in W.steady_edges(ORDER, p, v):
        assert ends[e] + delta * lam >= ends[q] + (plain.send[index[q]] if dat else 0) + \
            plain.cost[i]


def test_the_certificate_fails_where_a_round_trip_is_slower() -> None:
    """The first regression pipeline above: a cycle through both stages is slower than the
    busiest stage, and the certificate is refused from the walk's potentials."""
    f, b, c = [(720655, 158783), (237272, 100858)], [(1151177, 1552542), (1893105, 1407467)], \
        [13003, 30597]
    plain = W._Plain(ORDER, 2, 2, f, b, c)
    _, (m, slots) = plain.walk(6)
    assert _slower_cycle(2, 2, plain, plain.busiest)
    assert not W._certified(ORDER, 2, 2, plain, plain.busiest, m, slots)


def test_real_pipelines_are_certified_from_three_rounds() -> None:
    """Alike layers on every stage, the embedding on the first chunk and the head and loss on
    the last, sends far below the work (what sweeps screen): certified from the walk of 3p
    micro-batches, so screening them walks one round more, not the whole run. (The sweep's
    471 interleaved strategies of four real models all were.)"""
    for p, v in ((4, 2), (8, 2), (8, 4), (16, 2)):
        fwd = [[10**6] * v for _ in range(p)]
        fwd[0][0] += 5 * 10**4
        fwd[-1][-1] += 3 * 10**5
        bwd = [tuple(2 * x for x in row) for row in fwd]
        plain = W._Plain(ORDER, p, v, [tuple(row) for row in fwd], bwd, [20_000] * p)
        _, (m, slots) = plain.walk(3 * p)
        assert W._certified(ORDER, p, v, plain, plain.busiest, m, slots)


def _gather_terms(data: st.DataObject, p: int, v: int, bwd: list[tuple[int, ...]], hide: bool
                  ) -> tuple[dict[tuple[str, int, int], int], dict[tuple[int, int], int],
                             dict[tuple[int, int], tuple[int, int]] | None]:
    """Random ZeRO-3 terms for ``_walk``: gathers before each pass, reduce-scatters after a
    backward's send, and (prefetch) how a backward started beside busy streams ends."""
    term = st.integers(0, 3 * 10**5)
    early = {(ph, s_, ch): data.draw(term) for ph in "FB" for s_ in range(p) for ch in range(v)}
    late = {(s_, ch): data.draw(term) for s_ in range(p) for ch in range(v)}
    held = {(s_, ch): (data.draw(st.integers(0, bwd[s_][ch])), data.draw(st.integers(0, bwd[s_][ch])))
            for s_ in range(p) for ch in range(v)} if hide else None
    return early, late, held


@settings(max_examples=150, deadline=None)
@given(p=st.sampled_from([2, 3, 4]), v=st.sampled_from([2, 3, 4]), rounds=st.integers(4, 10),
       hide=st.booleans(), data=st.data())
def test_the_shortcut_with_zero3_terms_equals_the_whole_walk(p, v, rounds, hide, data) -> None:
    """The walk with ZeRO-3 gathers, late reduce-scatters and prefetched backwards
    (``_certified_gathers``): every end to the nanosecond, whatever the terms. Before its
    certificate 6 of 1,500 such draws with prefetch came out up to 1.6% too fast."""
    fwd, bwd, c = _costs(data, p, v)
    early, late, held = _gather_terms(data, p, v, bwd, hide)
    m = rounds * p
    assert W.interleaved(_strategy(p, v, m), fwd, bwd, c, early, late, hide=held) == W._walk(
        ORDER, p, m, v, fwd, bwd, c, early, late, held)


@settings(max_examples=100, deadline=None)
@given(p=st.sampled_from([2, 3, 4]), v=st.sampled_from([2, 3]), hide=st.booleans(),
       data=st.data())
def test_a_certificate_with_zero3_terms_bounds_the_long_run_rate(p, v, hide, data) -> None:
    """Soundness, without re-deriving the edges: where the walk of 3p certifies λ, a walk far
    past its fill grows by no more than λ a round (the average over 24 rounds after 24, within
    0.2% for what is left of a transient)."""
    fwd, bwd, c = _costs(data, p, v)
    early, late, held = _gather_terms(data, p, v, bwd, hide)
    record: list[list[int]] = []
    W._walk(ORDER, p, 3 * p, v, fwd, bwd, c, early, late, held, record)
    lam = max(p * (sum(f) + sum(b)) for f, b in zip(fwd, bwd, strict=True))
    if not W._certified_gathers(ORDER, lam, 3 * p, record, fwd, bwd, c, early, late, held):
        return
    start = W._walk(ORDER, p, 24 * p, v, fwd, bwd, c, early, late, held)[0]
    end = W._walk(ORDER, p, 48 * p, v, fwd, bwd, c, early, late, held)[0]
    assert max(y - x for x, y in zip(start, end, strict=True)) <= 24 * lam * 1.002


def _as_whole_walk(monkeypatch: pytest.MonkeyPatch, s: Strategy) -> None:
    """Llama 2 70B on 256 H100s under ``s``: the fast path's step time equals the one it gives
    when every schedule is walked whole (no shortcut)."""
    from analysis import fastpath
    from replay import get_system
    from tracegen import get_model

    model, system = get_model("llama2-70b"), get_system("dgx-h100")
    fastpath.clear_cache()
    got = fastpath.estimate(model, s, system).step_time_s
    monkeypatch.setattr(W, "periodic", lambda walk, p, m, v, *a, **k: walk(m))
    fastpath.clear_cache()
    assert got == fastpath.estimate(model, s, system).step_time_s
    fastpath.clear_cache()


def test_a_real_prefetched_zero3_pipeline_is_walked_exactly(monkeypatch) -> None:
    """Llama 2 70B, ZeRO-3 with prefetch, tp 8, pp 8, two chunks, full recompute, on 256
    H100s: the shortcut had taken a transient for the steady state (0.64% fast: 4 of 1,212
    ZeRO-3 interleaved strategies of four models were off); now the estimate is the whole
    walk's."""
    _as_whole_walk(monkeypatch, Strategy(
        tp=8, pp=8, dp=4, vpp=2, micro_batch_size=1, global_batch_size=512, recompute="full",
        zero_stage=3, zero3_prefetch=True, sequence_parallel=True, schedule=ORDER))


def test_a_random_prefetched_pipeline_the_first_check_took_early_is_walked_exactly() -> None:
    """Two stages, four chunks, random ZeRO-3 terms with prefetch: the first round's check had
    taken a transient for the steady state (1.6% too fast); now the whole walk's ends."""
    f = [(651409, 755262, 418432, 219787), (885550, 796815, 823423, 292016)]
    b = [(803088, 1500551, 233595, 1187073), (856253, 1390462, 506064, 612930)]
    gathers = {"F": [[298189, 42118, 121888, 185276], [267433, 123840, 267869, 160896]],
               "B": [[270172, 100497, 144520, 74557], [216911, 206443, 168050, 30430]]}
    early = {(ph, s_, ch): g for ph, rows in gathers.items()
             for s_, row in enumerate(rows) for ch, g in enumerate(row)}
    scatter = [[205780, 174142, 16589, 68695], [145770, 10838, 173029, 103301]]
    late = {(s_, ch): x for s_, row in enumerate(scatter) for ch, x in enumerate(row)}
    pairs = [[(593240, 749869), (40020, 1192601), (155034, 170839), (590252, 790746)],
             [(38587, 480467), (111637, 745613), (407039, 193567), (13187, 226476)]]
    hide = {(s_, ch): x for s_, row in enumerate(pairs) for ch, x in enumerate(row)}
    c = [71858, 63383]
    assert W.interleaved(_strategy(2, 4, 24), f, b, c, early, late, hide=hide) == W._walk(
        ORDER, 2, 24, 4, f, b, c, early, late, hide)


def _passes(data: st.DataObject) -> tuple[tuple[tuple[int, int, int, int, int], int], ...]:
    """One pass of a stage chunk for the two-stream walk: 1–3 runs of equal blocks, each
    (dense gather, expert gather, compute, dense reduce-scatter, expert reduce-scatter) ns."""
    term, work = st.integers(0, 2 * 10**5), st.integers(1, 4 * 10**5)
    return tuple(((data.draw(term), data.draw(term), data.draw(work), data.draw(term),
                   data.draw(term)), data.draw(st.integers(1, 3)))
                 for _ in range(data.draw(st.integers(1, 3))))


@settings(max_examples=100, deadline=None)
@given(p=st.sampled_from([2, 3, 4]), v=st.sampled_from([2, 3]), rounds=st.integers(4, 8),
       data=st.data())
def test_the_two_stream_shortcut_equals_the_whole_walk(p, v, rounds, data) -> None:
    """ZeRO-3 on a MoE model (``_Streams``, ``_certified_streams``): every end as the whole
    two-stream walk's, whatever the passes. Before its certificate 4 of 3,000 random draws
    came out up to 0.45% too fast."""
    z3_f = [tuple(_passes(data) for _ in range(v)) for _ in range(p)]
    z3_b = [tuple(_passes(data) for _ in range(v)) for _ in range(p)]
    fwd = [tuple(sum(n * blk[2] for blk, n in z3_f[s_][ch]) for ch in range(v)) for s_ in range(p)]
    bwd = [tuple(sum(n * blk[2] for blk, n in z3_b[s_][ch]) for ch in range(v)) for s_ in range(p)]
    c = [data.draw(st.integers(0, 10**5)) for _ in range(p)]
    m = rounds * p
    assert W.interleaved(_strategy(p, v, m), fwd, bwd, c, streams=(z3_f, z3_b)) == (
        W._walk_streams(ORDER, p, m, v, z3_f, z3_b, c))


def test_a_random_two_stream_pipeline_the_first_check_took_early_is_walked_exactly() -> None:
    """Two stages, two chunks, random two-stream passes: the first round's check had taken a
    transient for the steady state (0.32% too fast); now the whole walk's ends."""
    z3_f = [((((54978, 100719, 232480, 69827, 84092), 2), ((4693, 49990, 29963, 21308, 30960), 2)),
             (((137313, 108935, 276671, 123161, 78090), 1),
              ((160008, 142407, 332717, 97599, 91670), 2))),
            ((((30045, 13787, 211777, 188498, 73016), 2),),
             (((11278, 143478, 10985, 73587, 109771), 3),
              ((91604, 131274, 396779, 168041, 107312), 1)))]
    z3_b = [((((23818, 32733, 256734, 162817, 167260), 2),),
             (((75118, 90091, 201406, 69383, 5575), 1), ((138440, 127955, 259877, 6228, 30966), 2),
              ((66576, 120163, 373551, 63749, 123755), 1))),
            ((((126034, 92797, 154071, 69254, 66901), 2), ((84648, 73186, 110362, 40605, 61078), 2)),
             (((123515, 45652, 372141, 124122, 113011), 2), ((8949, 148397, 88747, 56009, 100212), 1),
              ((12608, 66082, 40406, 192985, 119998), 2)))]
    fwd = [tuple(sum(n * blk[2] for blk, n in chunk) for chunk in stage) for stage in z3_f]
    bwd = [tuple(sum(n * blk[2] for blk, n in chunk) for chunk in stage) for stage in z3_b]
    c = [30269, 68357]
    assert W.interleaved(_strategy(2, 2, 20), fwd, bwd, c, streams=(z3_f, z3_b)) == (
        W._walk_streams(ORDER, 2, 20, 2, z3_f, z3_b, c))


@settings(max_examples=100, deadline=None)
@given(p=st.sampled_from([2, 3, 4]), rounds=st.integers(4, 10), hide=st.booleans(),
       streams=st.booleans(), data=st.data())
def test_one_f_one_b_walks_with_zero3_terms_equal_the_whole_walk(p, rounds, hide, streams,
                                                                 data) -> None:
    """1F1B pipelines walked for ZeRO-3 (gathers, late reduce-scatters, prefetch; or MoE's two
    streams) take the same certificates, with any number of micro-batches (m mod p left over):
    every end as the whole walk's. Before them 8 and 2 of 1,500 random draws came out up to
    1.7% and 0.39% too fast."""
    fwd, bwd, c = _costs(data, p, 1)
    m = rounds * p + data.draw(st.integers(0, p - 1))
    s = Strategy(pp=p, dp=1, micro_batch_size=1, global_batch_size=m)
    if streams:
        z3_f = [(_passes(data),) for _ in range(p)]
        z3_b = [(_passes(data),) for _ in range(p)]
        fwd = [(sum(n * blk[2] for blk, n in x[0]),) for x in z3_f]
        bwd = [(sum(n * blk[2] for blk, n in x[0]),) for x in z3_b]
        assert W.interleaved(s, fwd, bwd, c, streams=(z3_f, z3_b)) == W._walk_streams(
            "1f1b", p, m, 1, z3_f, z3_b, c)
        return
    early, late, held = _gather_terms(data, p, 1, bwd, hide)
    assert W.interleaved(s, fwd, bwd, c, early, late, hide=held) == W._walk(
        "1f1b", p, m, 1, fwd, bwd, c, early, late, held)


def test_a_real_prefetched_zero3_one_f_one_b_pipeline_is_walked_exactly(monkeypatch) -> None:
    """Llama 2 70B, ZeRO-3 with prefetch, tp 8, pp 8, 1F1B, full recompute: the first check
    had taken a transient for the steady state (0.63% fast; 3 of 678 ZeRO-3 1F1B strategies
    of four models were off); now the estimate is the whole walk's."""
    _as_whole_walk(monkeypatch, Strategy(
        tp=8, pp=8, dp=4, micro_batch_size=1, global_batch_size=512, recompute="full",
        zero_stage=3, zero3_prefetch=True, sequence_parallel=True))
