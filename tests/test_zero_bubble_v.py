"""ZB-V (Qi et al. 2024 §6, "Zero Bubble Pipeline Parallelism"): two model chunks a stage placed
in a V, each backward split into B and W. The order (PyTorch's ``ScheduleZBVZeroBubble``), the
placement the trace carries (sends, the turn, stage 0's embedding and head), its memory, the fast
path's walk of it against replay, and what it is not modelled with."""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from analysis import zbv_walk
from analysis.fastpath import estimate
from analysis.pipeline_walk import Opened, pipeline_ns
from analysis.zb_walk import zero_bubble
from analysis.zbv_walk import zero_bubble_v
from replay import get_system
from tests.conftest import replayed

# the fast path's toy models (8 layers, h 256; the MoE one with 4 experts) and its DGX H100
from tests.test_fastpath import MODEL, MOE, SYSTEM
from tracegen import ConfigError, ModelSpec, Strategy, generate, memory
from tracegen.program import COMM_SEND_NODE, RoleProgram
from tracegen.schedule import Step, dualpipe_v, zb_v


def _v(**kw: object) -> Strategy:
    fields: dict[str, object] = {"pp": 4, "vpp": 2, "micro_batch_size": 1,
                                 "global_batch_size": 8, "schedule": "zb_v", **kw}
    return Strategy(**fields)  # type: ignore[arg-type]


def _walk_v(m: int, p: int, f: list[tuple[int, ...]], b: list[tuple[int, ...]],
            w: list[tuple[int, ...]], c: list[int],
            order_of: Callable[[int, int, int], list[Step]] = zb_v, ring: bool = False
            ) -> tuple[list[int], list[list[int]]]:
    """Each stage's end and each of its chunks' last W end, walking the schedule pass by pass
    as it says and nothing else: global chunk g runs on stage g or 2p − 1 − g (``ring``: as
    chunk g // p of stage g mod p, interleaved); a forward waits for chunk g − 1's, a B for
    chunk g + 1's, each with the send between their stages (``c[s]`` between s and s + 1, round
    the ring the last stage's to stage 0; none where both are one stage); a W for nothing but
    its stage."""
    v = len(f[0])
    on = [g % p for g in range(v * p)] if ring else [*range(p), *reversed(range(p))]
    orders = [order_of(m, p, s) for s in range(p)]
    cost = {"F": f, "B": b, "W": w}
    end: dict[tuple[str, int, int], int] = {}
    pos, clock = [0] * p, [0] * p
    last = [[0] * v for _ in range(p)]
    while any(pos[s] < len(orders[s]) for s in range(p)):
        for s in range(p):
            while pos[s] < len(orders[s]):
                ph, j, ch = orders[s][pos[s]]
                g = ch * p + s if ring else (2 * p - 1 - s if ch else s)
                src = g - 1 if ph == "F" else g + 1
                dep = (ph, j, src) if ph != "W" and 0 <= src < v * p else None
                if dep is not None and dep not in end:
                    break
                ready = 0
                if dep is not None and on[src] != s:
                    link = (on[src] if ph == "F" else s) if ring else min(s, on[src])
                    ready = end[dep] + c[link]
                elif dep is not None:
                    ready = end[dep]
                clock[s] = max(clock[s], ready) + cost[ph][s][ch]
                end[ph, j, g] = clock[s]
                if ph == "W":
                    last[s][ch] = clock[s]
                pos[s] += 1
    return clock, last


def test_the_order_pytorch_runs() -> None:
    """p 4, m 8 as ``ScheduleZBVZeroBubble._calculate_single_rank_operations`` lays it out
    (torch.distributed.pipelining; a = the stage's first chunk, b its second)."""
    got = [" ".join(f"{ph}{j}{'ab'[c]}" for ph, j, c in zb_v(8, 4, s)) for s in (0, 3)]
    assert got == [
        "F0a F1a F2a F3a F4a F5a F6a F0b B0b W0b F1b B1b W1b F2b B2b W2b F3b B3b W3b F7a B0a "
        "W0a F4b B4b W4b B1a W1a F5b B5b W5b B2a W2a F6b B6b W6b B3a W3a F7b B7b W7b B4a W4a "
        "B5a W5a B6a W6a B7a W7a",
        "F0a F0b F1a F1b F2a F2b F3a F3b B0b W0b F4a B0a W0a F4b B1b W1b F5a B1a W1a F5b B2b "
        "W2b F6a B2a W2a F6b B3b W3b F7a B3a W3a F7b B4b W4b B4a B5b B5a B6b B6a B7b B7a W4a "
        "W5b W6b W7b W5a W6a W7a"]


def assert_every_pass_once(order: list[Step], m: int, chunks: int) -> None:
    """A stage's order (phase, micro-batch, chunk) holds each of its ``chunks`` chunks' F, B and
    W once per micro-batch, micro-batches in order, F before B before W."""
    for ph in "FBW":
        for ch in range(chunks):
            assert [j for x, j, c in order if x == ph and c == ch] == list(range(m))
    at = {(ph, j, c): i for i, (ph, j, c) in enumerate(order)}
    assert all(at["F", j, c] < at["B", j, c] < at["W", j, c]
               for j in range(m) for c in range(chunks))


@settings(max_examples=200, deadline=None)
@given(m=st.integers(1, 30), p=st.integers(2, 8), data=st.data())
def test_every_pass_once_in_order(m: int, p: int, data: st.DataObject) -> None:
    """Each chunk's passes once per micro-batch, micro-batches in order, F before B before W;
    at most p stage-loads in flight — 2p chunk passes between F and W, 1F1B's first stage
    (the paper's "same peak activation memory as 1F1B"), p on every stage once m ≥ 2p − 1."""
    stage = data.draw(st.integers(0, p - 1))
    assert_every_pass_once(zb_v(m, p, stage), m, 2)
    s = Strategy(pp=p, vpp=2, micro_batch_size=1, global_batch_size=m, schedule="zb_v")
    held = memory.inflight_microbatches(s, stage)
    assert held <= p
    if m >= 2 * p - 1:
        assert held == p


@settings(max_examples=300, deadline=None)
@given(data=st.data(), p=st.integers(2, 8), m=st.integers(1, 40), equal=st.booleans())
def test_the_fast_paths_walk_is_the_schedules(data: st.DataObject, p: int, m: int,
                                              equal: bool) -> None:
    """``zbv_walk.zero_bubble_v`` gives each stage's end and its chunks' last W ends
    exactly as walking the schedule pass by pass does, for any costs and sends."""
    def costs(lo: int, hi: int) -> list[tuple[int, int]]:
        if equal:  # alike stages but stage 0 (the embedding and the head)
            first = (data.draw(st.integers(lo, hi)), data.draw(st.integers(lo, hi)))
            rest = (data.draw(st.integers(lo, hi)),) * 2
            return [first] + [rest] * (p - 1)
        return [(data.draw(st.integers(lo, hi)), data.draw(st.integers(lo, hi)))
                for _ in range(p)]
    f, b, w = costs(1, 300), costs(1, 600), costs(0, 400)
    c = data.draw(st.lists(st.sampled_from([0, 7, 60, 900]), min_size=p, max_size=p))
    assert zero_bubble_v(m, f, b, w, c) == _walk_v(m, p, f, b, w, c)


def _stage_costs(data: st.DataObject, p: int, shape: str, lo: int, hi: int
                 ) -> list[tuple[int, int]]:
    """Per stage (chunk 0, chunk 1) costs: all alike, alike but stage 0 (the embedding and the
    head: its slower pace takes the others over one by one), or any."""
    draw = lambda: data.draw(st.integers(lo, hi))  # noqa: E731
    if shape == "any":
        return [(draw(), draw()) for _ in range(p)]
    rest = (draw(),) * 2
    return [rest if shape == "alike" else (draw(), draw())] + [rest] * (p - 1)


# the V schedules whose steady rounds the walk jumps, with their orders
JUMPED = {"zb_v": zb_v, "dualpipe_v": dualpipe_v}


@settings(max_examples=60, deadline=None)
@given(data=st.data(), p=st.integers(2, 12), shape=st.sampled_from(["alike", "first", "any"]),
       schedule=st.sampled_from(sorted(JUMPED)))
def test_long_runs_jump_their_steady_rounds_exactly(data: st.DataObject, p: int, shape: str,
                                                    schedule: str) -> None:
    """Runs of up to 300 micro-batches, whose steady rounds the walk jumps where they are
    affine (``zbv_walk._regime``), end as walking every pass of the schedule does — through
    a slower stage's pace taking the others over and periodic rounds of q > 1; ZB-V's order
    and DualPipe-V's."""
    m = data.draw(st.integers(2 * p + 3, min(300, 30 * p)))
    f, b = _stage_costs(data, p, shape, 1, 300), _stage_costs(data, p, shape, 1, 600)
    w = _stage_costs(data, p, shape, 0, 400)
    c = data.draw(st.lists(st.sampled_from([0, 7, 60, 900]), min_size=p, max_size=p))
    assert zero_bubble_v(m, f, b, w, c, None, schedule) == _walk_v(m, p, f, b, w, c,
                                                                   JUMPED[schedule])


@settings(max_examples=60, deadline=None)
@given(data=st.data(), p=st.integers(2, 8), shape=st.sampled_from(["alike", "first", "any"]),
       schedule=st.sampled_from(sorted(JUMPED)))
def test_the_opening_walks_the_same_with_jumps(data: st.DataObject, p: int, shape: str,
                                               schedule: str) -> None:
    """With the parameter gathers that open the step (``overlap_param_gather``: passes slowed
    until a stage's gathers are done, first forwards held to their floors) the rounds are
    looked at only once no pass is slowed, and the walk equals walking every pass."""
    m = data.draw(st.integers(2 * p + 3, 20 * p))
    f, b = _stage_costs(data, p, shape, 1, 300), _stage_costs(data, p, shape, 1, 600)
    w = _stage_costs(data, p, shape, 0, 400)
    c = data.draw(st.lists(st.sampled_from([0, 7, 60, 900]), min_size=p, max_size=p))
    floors = tuple(((s, ch), data.draw(st.integers(0, 4_000))) for s in range(p)
                   for ch in (0, 1) if data.draw(st.booleans()))
    busy = tuple(tuple(data.draw(st.lists(st.integers(0, 20_000), max_size=2)))
                 for _ in range(p))
    share = tuple(data.draw(st.floats(0, 1)) for _ in range(6 * p))
    opened = Opened(floors, busy, data.draw(st.sampled_from([0.0, 0.2, 0.5])), share)
    jumped = zero_bubble_v(m, f, b, w, c, opened, schedule)
    with pytest.MonkeyPatch.context() as patch:  # every run short: its whole plan walked
        patch.setattr(zbv_walk, "STEADY_ROUNDS", 10**9)
        assert zero_bubble_v(m, f, b, w, c, opened, schedule) == jumped


@settings(max_examples=80, deadline=None)
@given(data=st.data(), p=st.integers(2, 8), shape=st.sampled_from(["alike", "first", "any"]),
       opening=st.booleans(), schedule=st.sampled_from(sorted(JUMPED)))
def test_every_jump_lands_where_walking_its_rounds_does(data: st.DataObject, p: int, shape: str,
                                                        opening: bool, schedule: str) -> None:
    """Each jump ``zbv_walk._regime`` allows — k blocks of q rounds, each round position moved
    k times its increment — gives the rounds that walking those k·q rounds gives (the final
    ends alone would not show a jump one block too far: a pass whose other wait overtook it
    is walked again right after, and the pace that took over hides the error)."""
    m = data.draw(st.integers(2 * p + 3, 30 * p))
    f, b = _stage_costs(data, p, shape, 90, 110), _stage_costs(data, p, shape, 180, 220)
    w = _stage_costs(data, p, shape, 0, 120)
    c = [data.draw(st.sampled_from([0, 7, 60]))] * p
    opened = Opened((), tuple((data.draw(st.integers(0, 5_000)),) for _ in range(p)), 0.5,
                    (0.5,) * 6 * p) if opening else None
    landed: list[bool] = []
    regime = zbv_walk._regime

    def checked(run: zbv_walk._Run, pieces: zbv_walk._Pieces, q: int, most: int
                ) -> tuple[int, list[int]] | None:
        got = regime(run, pieces, q, most)
        if got is not None and got[0]:
            k, shift = got
            again = zbv_walk._Run(run.cost, run.sends, list(run.clock), list(run.ends), opened)
            for _ in range(k * q):
                again.walk(pieces.body)
            block = q * len(pieces.body)
            landed.append(again.ends[-block:] == [e + k * d for e, d in
                                                  zip(run.ends[-block:], shift, strict=True)])
        return got

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(zbv_walk, "_regime", checked)
        zero_bubble_v(m, f, b, w, c, opened, schedule)
    assert all(landed)


@pytest.mark.parametrize(("p", "m", "heavy", "most"), [
    (4, 400, 0, 0.03), (4, 400, 7, 0.07), (16, 1536, 7, 0.08)])
@pytest.mark.parametrize("schedule", sorted(JUMPED))
def test_steady_rounds_are_jumped_not_walked(p: int, m: int, heavy: int, most: float,
                                             schedule: str) -> None:
    """The jump is taken: alike stages walk their warm-up, a few rounds and the cool-down (3%
    of 6·m·p passes at p 4, m 400); a stage 0 heavier by 7% (its pace takes the others over
    one by one) a few rounds more per stage. ZB-V and DualPipe-V alike."""
    walked = 0
    walk = zbv_walk._Run.walk

    def counted(run: zbv_walk._Run, entries: tuple[zbv_walk.Entry, ...],
                first_f: tuple[tuple[int, int], ...] = ()) -> None:
        nonlocal walked
        walked += len(entries)
        walk(run, entries, first_f)

    f = [(100 + heavy, 100 + heavy)] + [(100, 100)] * (p - 1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(zbv_walk._Run, "walk", counted)
        zero_bubble_v(m, f, [(200, 200)] * p, [(100, 100)] * p, [20] * p, None, schedule)
    assert 0 < walked <= most * 6 * m * p


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_equal_passes_leave_only_the_fill(p: int) -> None:
    """Every chunk pass t, no sends: a step is each stage's 6·m·t of work and (p − 1)·t, the
    last stage's wait for the first micro-batch's first chunk — none later (Qi et al. 2024
    §6: zero bubble at T_F = T_B = T_W once steps follow each other without a synchronized
    start, their post-validated optimizer step; replay starts every step together). ZB-H1
    on the same stages (F = B = W = 2t a stage) leaves (p − 1)·2t, 1F1B (p − 1)·6t."""
    t = 5
    for m in (2 * p - 1, 2 * p, 4 * p + 1):
        ends, _ = zero_bubble_v(m, [(t, t)] * p, [(t, t)] * p, [(t, t)] * p, [0] * p)
        assert max(ends) == 6 * m * t + (p - 1) * t
        if p > 1:
            h1 = zero_bubble(m, [2 * t] * p, [2 * t] * p, [2 * t] * p, [0] * p)
            assert max(h1) == 6 * m * t + (p - 1) * 2 * t
            one = Strategy(pp=p, micro_batch_size=1, global_batch_size=m)
            assert pipeline_ns(one, [2 * t] * p, [4 * t] * p, [0] * p) == (
                6 * m * t + (p - 1) * 6 * t)


def test_the_trace_sends_twice_1f1b_and_turns_in_place() -> None:
    """A micro-batch crosses each link twice each way (the paper's 2× pipeline communication):
    2·(2p − 2) sends per micro-batch over the stages against 1F1B's 2·(p − 1); the last stage
    hands chunk p − 1's output to chunk p, and chunk p's gradient back, without a send."""
    p, m = 4, 8
    v, one = _v(pp=p, global_batch_size=m), Strategy(pp=p, micro_batch_size=1,
                                                     global_batch_size=m)
    sends = {s.schedule: sum(n.type == COMM_SEND_NODE for st in range(p)
                             for n in RoleProgram(MODEL, s, st).build()) for s in (v, one)}
    assert sends == {"zb_v": 2 * (2 * p - 2) * m, "1f1b": 2 * (p - 1) * m}
    last = [n.name for n in RoleProgram(MODEL, v, p - 1).build()]
    assert not any(f".c{p}.recv_act" in x or f".c{p - 1}.recv_grad" in x for x in last)


def test_stage_0_holds_the_embedding_and_the_tied_head_once() -> None:
    """Stage 0 runs chunks 0 and 2p − 1: the embedding and, tied, the output head as the same
    weight — no embedding all-reduce, the model's parameters counted once over the stages."""
    tied = dataclasses.replace(MODEL, tied_embeddings=True)
    v, one = _v(), Strategy(pp=4, micro_batch_size=1, global_batch_size=8)
    total = {s.schedule: sum(sum(RoleProgram(tied, s, st).stage_params().values())
                             for st in range(4)) for s in (v, one)}
    assert total["zb_v"] == total["1f1b"] - tied.vocab_size * tied.hidden_size
    names = [n.name for st in range(4) for n in RoleProgram(tied, v, st).build()]
    assert not any("embedding_grad_ar" in x for x in names)
    assert v.head_stage == 0 and v.chunk_stage(7) == 0 and v.chunk_stage(4) == 3


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tp=st.sampled_from([1, 2]), pp=st.sampled_from([2, 4]), dp=st.sampled_from([1, 2]),
       sp=st.booleans(), zero=st.sampled_from([0, 1, 2]),
       recompute=st.sampled_from(["none", "selective", "full"]), m=st.integers(1, 10),
       overlap=st.sampled_from(["both", "grad", "param", "none"]), ep=st.sampled_from([0, 1, 2]),
       tied=st.booleans(), system=st.sampled_from(["dgx-h100", "dgx-a100-80gb", "mi300x"]),
       gpn=st.sampled_from([8, 2]), regather=st.booleans(), uneven=st.booleans(),
       mtp=st.sampled_from([0, 0, 1]))
@example(tp=2, pp=4, dp=2, sp=True, zero=1, recompute="selective", m=6, overlap="both", ep=0,
         tied=True, system="dgx-h100", gpn=8, regather=False, uneven=False, mtp=0)
@example(tp=1, pp=2, dp=4, sp=False, zero=1, recompute="none", m=1, overlap="param", ep=0,
         tied=False, system="dgx-h100", gpn=8, regather=False, uneven=True, mtp=1)
def test_the_fast_path_walks_zb_v_as_replay_runs_it(tp: int, pp: int, dp: int, sp: bool,
                                                      zero: int, recompute: str, m: int,
                                                      overlap: str, ep: int, tied: bool,
                                                      system: str, gpn: int, regather: bool,
                                                      uneven: bool, mtp: int) -> None:
    """Within 2% of contention-free replay (``zero_bubble_v``; each chunk's buckets beside its
    last W pass; the step's overlapped parameter gathers holding each chunk's first forward
    and slowing what runs beside them; shorter end chunks, both on stage 0; MTP modules with
    the head on stage 0). Exact where nothing drains beside compute (with the
    parameter gathers overlapped alone too); with overlapped gradient reduction the buckets of
    the chunk that finishes first slow the other chunk's cool-down passes, which the tails do
    not step through (up to 1.0% below replay here at one to three micro-batches, 1.4% on an
    agreement-benchmark draw at two: DESIGN.md)."""
    model = dataclasses.replace(MOE if ep else MODEL, tied_embeddings=tied, mtp_layers=mtp)
    base = get_system(system)
    hw = dataclasses.replace(base, node=dataclasses.replace(base.node, gpus_per_node=gpn))
    try:
        s = _v(tp=tp, pp=pp, dp=dp, ep=max(ep, 1), sequence_parallel=sp and tp > 1,
               zero_stage=zero, recompute=recompute, global_batch_size=dp * m,
               dp_bucket_params=200_000, overlap_grad_reduce=overlap in ("both", "grad"),
               overlap_param_gather=overlap in ("both", "param") and zero > 0,
               zb_w_regather=regather and sp and tp > 1,
               first_stage_layers=int(uneven), last_stage_layers=int(uneven))
        fast = estimate(model, s, hw)
    except ConfigError:
        assume(False)
        raise
    assert fast.step_time_s == pytest.approx(replayed(model, s, hw).step_time_s, rel=0.02)


@pytest.mark.parametrize("kw", [dict(tp=2, pp=4, dp=1, sequence_parallel=True),
                                dict(tp=1, pp=2, dp=2, recompute="full"),
                                dict(tp=2, pp=2, dp=2, ep=2, sequence_parallel=True,
                                     zb_w_regather=True),
                                dict(tp=1, pp=2, dp=1, first_stage_layers=1,
                                     last_stage_layers=1),
                                dict(tp=1, pp=5, dp=1, account_for_embedding_in_pipeline_split=True,
                                     account_for_loss_in_pipeline_split=True),
                                dict(tp=1, pp=2, dp=2, mtp=1)])
def test_the_fast_paths_memory_is_the_trace_sets(kw: dict[str, object]) -> None:
    """Every stage's peak (its chunks' in-flight passes, the deferred W's operands, stage 0's
    logits) as the trace set's manifest states it — with shorter end chunks too, both on
    stage 0 in a V (the split that lightens the stage holding the embedding and the head),
    and with MTP modules beside the head there."""
    kw = dict(kw)  # (the parameter's own dict stays as listed)
    model = dataclasses.replace(MOE if kw.get("ep") else MODEL,
                                mtp_layers=int(kw.pop("mtp", 0)))  # type: ignore[call-overload]
    s = _v(global_batch_size=8 * int(kw["dp"]), **kw)  # type: ignore[call-overload]
    assert_memory_is_the_manifests(model, s)


def assert_memory_is_the_manifests(model: ModelSpec, s: Strategy) -> None:
    """The fast path's peak memory is the largest stage total the trace set's manifest
    states."""
    with tempfile.TemporaryDirectory() as tmp:
        summary = generate(model, s, tmp)
    manifest = max(x.memory.total_bytes for x in summary.stages) / 2**30
    assert estimate(model, s, SYSTEM).peak_memory_GiB == pytest.approx(manifest, rel=1e-12)


@pytest.mark.parametrize(("change", "says"), [
    ({"vpp": 1}, "set vpp = 2"),
    ({"vpp": 4, "global_batch_size": 16}, "set vpp = 2"),
    ({"zero_stage": 3}, "ZeRO 0-2"),
    ({"tp": 2, "sequence_parallel": True, "tp_comm_overlap": True}, "without tp_comm_overlap"),
    ({"pp": 1, "vpp": 2}, "needs pp ≥ 2"),
])
def test_what_zb_v_is_not_modelled_with_is_refused(change: dict[str, object],
                                                   says: str) -> None:
    with pytest.raises(ConfigError) as info:
        _v(**change)
    assert says in str(info.value)



def test_compare_ranks_zb_v_beside_the_interleaved_schedule() -> None:
    """A study listing the two chunk placements and ZB-H1, each replayed (GPT 1.7B on 8 GPUs,
    tp 2, pp 4, 8 micro-batches): ZB-V the fastest (0.076 s against 0.081 interleaved and
    0.086 ZB-H1), the fast path within 2% of its replay."""
    from analysis.compare import evaluate_strategy
    from analysis.study import study_from_dict

    study = study_from_dict({"model": "gpt-1.7b", "system": "dgx-h100", "gpus": 8,
                             "global_batch_size": 8,
                             "strategies": [{"tp": 2, "pp": 4, "vpp": 2},
                                            {"tp": 2, "pp": 4, "schedule": "zb_h1"},
                                            {"tp": 2, "pp": 4, "vpp": 2, "schedule": "zb_v"}]})
    inter, h1, v = (evaluate_strategy(study, s, replay_it=True) for s in study.strategies)
    assert inter["status"] == h1["status"] == v["status"] == "replayed"
    assert v["step_time_s"] < min(inter["step_time_s"], h1["step_time_s"])
    assert v["fast_step_time_s"] == pytest.approx(v["step_time_s"], rel=0.02)


def test_a_sweep_space_with_zb_v_keeps_what_it_can_run() -> None:
    """A search over schedules: ZB-V exactly where it runs — the twin of every interleaved
    strategy of the space with two chunks a stage — never with one chunk or none."""
    from analysis.study import study_from_dict
    from analysis.sweep import enumerate_space

    study = study_from_dict({"model": "gpt-1.7b", "system": "dgx-h100", "gpus": 16,
                             "global_batch_size": 64,
                             "search": {"tp": [1, 2], "pp": [1, 2, 4], "vpp": [1, 2, 4],
                                        "micro_batch_size": [1],
                                        "recompute": ["none", "full"],
                                        "zero_stage": [1], "sequence_parallel": [False],
                                        "schedule": ["1f1b", "interleaved_1f1b", "zb_v"]}})
    valid, _ = enumerate_space(study)
    v = [s for s in valid if s.schedule == "zb_v"]
    twins = {dataclasses.replace(s, schedule="zb_v") for s in valid
             if s.schedule == "interleaved_1f1b" and s.vpp == 2}
    assert v and all(s.pp >= 2 and s.vpp == 2 for s in v)
    assert set(v) == twins


def test_a_zb_v_that_does_not_fit_is_told_its_alternatives() -> None:
    """Llama 3 70B at tp 8 with SP, micro-batch 2, pp 4 as a V: 117.6 GiB. ``estimate`` names
    what W regathering and 1F1B with one chunk a stage would need, as for ZB-H1."""
    from analysis.glance import glance
    from tests.test_cli import run

    s = Strategy(tp=8, pp=4, vpp=2, dp=32, sequence_parallel=True, micro_batch_size=2,
                 global_batch_size=1024, zero_stage=1, schedule="zb_v")
    g = glance("llama3-70b", s, "dgx-h100")
    assert not g.fits and g.zb_hint is not None
    one = estimate("llama3-70b", dataclasses.replace(s, schedule="1f1b", vpp=1), "dgx-h100")
    assert g.zb_hint["1f1b"]["peak_memory_GiB"] == one.peak_memory_GiB and one.fits
    out = run("estimate", "--model", "llama3-70b", "--gpus", "1024", "--tp", "8", "--pp", "4",
              "--vpp", "2", "--sp", "--mbs", "2", "--gbs", "1024", "--zero", "1", "--system",
              "dgx-h100", "--schedule", "zb_v").stdout
    assert "with --schedule 1f1b --vpp 1: 59.6 GiB (fits)" in out
