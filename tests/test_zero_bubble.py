"""ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): the order, the trace's B and W
passes, its memory, the fast path's walk of it, and compare."""

from __future__ import annotations

import dataclasses
import tempfile

import polars as pl
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from analysis.compare import evaluate_strategy
from analysis.fastpath import estimate
from analysis.study import study_from_dict
from analysis.sweep import enumerate_space
from analysis.zb_walk import zb_h1_rate, zero_bubble
from replay import get_system, replay

# the fast path's toy models (h 256, 8 heads of 32, 4 KV heads, SwiGLU 512, 256 tokens; the
# MoE one with 4 experts of 256, top 2) and its DGX H100
from tests.test_fastpath import MODEL, MOE, SYSTEM
from tracegen import ConfigError, Strategy, generate, memory
from tracegen import ops as O
from tracegen.memory import inflight_microbatches
from tracegen.program import RoleProgram
from tracegen.schedule import one_f_one_b, zb_h1


def _walk(orders: list[list[tuple[str, int, int]]], f: float | list[int], b: float | list[int],
          w: float | list[int], c: list[int] | None = None) -> list[float]:
    """Each stage's end for per-stage orders of passes (costs per stage, or one for all;
    ``c``: the send after each stage, none where not given): a forward waits for the previous
    stage's and one send, a B for the next stage's and one send, a W for nothing but its
    stage — pass by pass, as the schedule says and nothing else."""
    p = len(orders)
    cost = {ph: x if isinstance(x, list) else [x] * p for ph, x in zip("FBW", (f, b, w), strict=True)}
    sends = c or [0] * p
    end: dict[tuple[str, int, int], float] = {}
    pos, clock = [0] * p, [0.0] * p
    while any(pos[s] < len(orders[s]) for s in range(p)):
        for s in range(p):
            while pos[s] < len(orders[s]):
                ph, j, _ = orders[s][pos[s]]
                dep = (("F", j, s - 1) if ph == "F" and s else
                       ("B", j, s + 1) if ph == "B" and s < p - 1 else None)
                if dep is not None and dep not in end:
                    break
                ready = end[dep] + sends[s - 1 if ph == "F" else s] if dep else 0.0
                clock[s] = max(clock[s], ready) + cost[ph][s]
                end[ph, j, s] = clock[s]
                pos[s] += 1
    return clock


def test_the_order_of_the_authors_schedule() -> None:
    """p 4, m 6 as the authors' ZB-H1 runs it: stage i defers the W of its first i B passes
    and runs them last (sail-sg/zero-bubble-pipeline-parallelism, ``ZeroBubbleH1Pipeline``)."""
    got = [" ".join(f"{ph}{j}" for ph, j, _ in zb_h1(6, 4, s)) for s in range(4)]
    assert got == ["F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5",
                   "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 B4 W3 B5 W4 W5",
                   "F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 B5 W3 W4 W5",
                   "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 W3 W4 W5"]


@settings(max_examples=200, deadline=None)
@given(m=st.integers(1, 24), p=st.integers(2, 8), data=st.data())
def test_every_pass_once_in_order_with_at_most_p_in_flight(m: int, p: int,
                                                           data: st.DataObject) -> None:
    stage = data.draw(st.integers(0, p - 1))
    order = zb_h1(m, p, stage)
    for ph in "FBW":  # each micro-batch's pass once, micro-batches in order
        assert [j for x, j, _ in order if x == ph] == list(range(m))
    at = {(ph, j): i for i, (ph, j, _) in enumerate(order)}
    assert all(at["F", j] < at["B", j] < at["W", j] for j in range(m))
    # B passes as 1F1B runs its backwards (so the pipeline's data dependences are 1F1B's)
    assert [x for x in order if x[0] != "W"] == one_f_one_b(m, p, stage)
    held = peak = 0
    for ph, _, _ in order:
        held += {"F": 1, "B": 0, "W": -1}[ph]
        peak = max(peak, held)
    assert peak == min(p, m) == inflight_microbatches(
        Strategy(pp=p, micro_batch_size=1, global_batch_size=m, schedule="zb_h1"), stage)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 16), (8, 24)])
def test_the_bubble_is_the_papers(p: int, m: int) -> None:
    """Equal stages, F = B = W: 1F1B's bubble is (p − 1)(F + B + W), ZB-H1's (p − 1)(F + B −
    W) (Qi et al. 2024 §3.1): the walks of the two orders take exactly that."""
    zb = max(_walk([zb_h1(m, p, s) for s in range(p)], 1.0, 1.0, 1.0))
    fused = [[("B" if ph == "B" else ph, j, c) for ph, j, c in one_f_one_b(m, p, s)]
             for s in range(p)]
    one = max(_walk(fused, 1.0, 2.0, 0.0))  # 1F1B: each backward is B and W together
    assert one == m * 3 + (p - 1) * 3
    assert zb == m * 3 + (p - 1) * 1


_COSTS = st.lists(st.integers(0, 400), min_size=1, max_size=10)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), p=st.integers(1, 10), rounds=st.integers(0, 20), r=st.integers(0, 9),
       equal=st.booleans())
@example(data=None, p=4, rounds=10, r=0, equal=True)  # a transient of two rounds
def test_the_fast_paths_walk_is_the_schedules(data: st.DataObject | None, p: int, rounds: int,
                                              r: int, equal: bool) -> None:
    """``zb_walk.zero_bubble`` (W passes riding on the pass before them, and from 4p
    micro-batches on the shortcut at ``zb_h1_rate``) gives each stage's end exactly as
    walking every pass of the schedule does, for any costs and sends: stages alike but for
    the ends (as a model's are) or each its own."""
    m = rounds * p + r % p + 1
    if data is None:  # the example: equal stages whose first round is still a transient
        f, b, w, c = [185] * p, [370] * p, [370] * p, [45, 0, 8, 0]
    else:
        def costs(lo: int, hi: int) -> list[int]:
            if equal:  # alike middle stages, their own first and last
                first, mid, last = (data.draw(st.integers(lo, hi)) for _ in range(3))
                return ([first] + [mid] * (p - 2) + [last])[-p:] if p > 1 else [mid]
            return data.draw(st.lists(st.integers(lo, hi), min_size=p, max_size=p))
        f, b, w = costs(1, 300), costs(1, 600), costs(0, 400)
        c = data.draw(st.lists(st.sampled_from([0, 7, 60, 900, 2500]), min_size=p,
                               max_size=p))
    want = _walk([zb_h1(m, p, s) for s in range(p)], f, b, w, c)
    assert zero_bubble(m, f, b, w, c) == want


@pytest.mark.parametrize(("f", "b", "w", "c", "rate"), [
    ([1, 1, 1], [1, 1, 1], [1, 1, 1], [0, 0, 0], (3, 1)),  # each stage's F + B + W
    ([1, 1, 5], [2, 2, 9], [1, 1, 0], [0, 0, 0], (14, 1)),  # the slowest stage's
    # a send of 10 from stage 0: the round trip through stage 1 and back, F₀ F₁ B₁ B₀ + W₀ +
    # 2·10, over two micro-batches (through stage 2 it is 30 over three)
    ([1, 1, 1], [2, 2, 2], [1, 1, 1], [10, 0, 0], (27, 2)),
])
def test_the_steady_rate_is_the_slowest_cycles(f: list[int], b: list[int], w: list[int],
                                              c: list[int], rate: tuple[int, int]) -> None:
    """ZB-H1's steady time per micro-batch (``zb_h1_rate``, W / A): the slowest of each stage's
    F + B + W and the round trips; and every stage's end moves by A·p·W/A per further A rounds
    of p micro-batches once steady (not by p·W/A each round: with sends the round trip of two
    micro-batches on three stages adds 31 and 50 in turn)."""
    got = zb_h1_rate(f, b, w, c)
    assert got[0] * rate[1] == rate[0] * got[1]
    p, a = len(f), got[1]
    ends = [_walk([zb_h1(m, p, s) for s in range(p)], f, b, w, c)
            for m in (12 * p, (12 + a) * p)]
    assert all(y - x == p * got[0] for x, y in zip(*ends, strict=True))


def _trace_nodes(s: Strategy) -> list[tuple[int, list[str]]]:
    out = []
    for stage in range(s.pp):
        prog = RoleProgram(MODEL, s, stage)
        out.append((stage, [n.name for n in prog.build()]))
    return out


def test_the_trace_moves_each_weight_gradient_into_its_w_pass() -> None:
    """The same ops, kernels and FLOPs as 1F1B's trace; every ``_wgrad`` GEMM of micro-batch j
    in a ``W{j}`` pass, none in a B pass, and the gradient buckets after the last W."""
    base = Strategy(tp=2, pp=4, dp=2, sequence_parallel=True, micro_batch_size=1,
                    global_batch_size=12)
    zb = dataclasses.replace(base, schedule="zb_h1")
    for (_, one), (_, two) in zip(_trace_nodes(base), _trace_nodes(zb), strict=True):
        assert sorted(n.rsplit(".", 1)[-1] for n in one) == sorted(
            n.rsplit(".", 1)[-1] for n in two)
        wgrads = [n for n in two if n.endswith("_wgrad")]
        assert wgrads and all(n.startswith("W") for n in wgrads)
        assert not any(n.startswith("B") and n.endswith("_wgrad") for n in two)
        # what else a W pass issues: the gradient buckets, on the last micro-batch's only
        others = [i for i, n in enumerate(two) if n.startswith("W") and not n.endswith("_wgrad")]
        last_b = max(i for i, n in enumerate(two) if n.startswith("B"))
        assert others and all(two[i].startswith(f"W{zb.num_microbatches - 1}.")
                              and "grad_all_reduce" in two[i] and i > last_b for i in others)
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        one_sum, two_sum = generate(MODEL, base, a), generate(MODEL, zb, b)
        for x, y in zip(one_sum.stages, two_sum.stages, strict=True):
            assert sum(x.flop_by_phase.values()) == sum(y.flop_by_phase.values())


def test_a_collective_beside_a_deferred_wgrad_blocks_in_b() -> None:
    """Without SP the input gradient's all-reduce ran beside the weight-gradient GEMM; in B it
    has nothing to run beside and the next op reads its result."""
    s = Strategy(tp=2, pp=2, micro_batch_size=1, global_batch_size=4)
    bwd = O.layer_bwd(MODEL, s)
    b, w = O.split_weight_grads(bwd)
    assert [it.name for it in w] == [it.name for it in bwd if it.name.endswith("_wgrad")]
    assert any(isinstance(it, O.Comm) and it.overlapped for it in bwd)
    assert not any(isinstance(it, O.Comm) and it.overlapped for it in b)
    assert len(b) + len(w) == len(bwd)


@pytest.mark.parametrize(("pp", "gbs"), [(2, 8), (4, 8), (4, 16)])
def test_replay_fills_the_cooldown_with_w_passes(pp: int, gbs: int) -> None:
    """Replayed, ZB-H1 is faster than 1F1B by at most the paper's 2(p − 1)·W (the bubble it
    removes: (p − 1)(F + B + W) → (p − 1)(F + B − W)) and by most of it, with W a stage's
    weight-gradient time per micro-batch read off the replayed timeline (the stages differ by
    the embedding and the head: the slowest's W bounds it above, the fastest's below)."""
    base = Strategy(tp=1, pp=pp, micro_batch_size=1, global_batch_size=gbs)
    zb = dataclasses.replace(base, schedule="zb_h1")
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        generate(MODEL, base, a, mode="representative")
        generate(MODEL, zb, b, mode="representative")
        one = replay(a, SYSTEM, contention=False)
        two = replay(b, SYSTEM, contention=False)
    tl = two.timeline.filter(pl.col("name").str.starts_with("W0.")
                             & pl.col("name").str.ends_with("_wgrad"))
    w_s = tl.group_by("rank").agg((pl.col("end_s") - pl.col("start_s")).sum())["end_s"]
    saved = one.step_time_s - two.step_time_s
    assert 0 < saved <= 2 * (pp - 1) * w_s.max() * 1.01  # (pp 2: equal to it, to 1e-6)
    assert saved >= 0.5 * (pp - 1) * w_s.min()


def test_memory_holds_p_micro_batches_on_every_stage() -> None:
    """Stage 0 holds what 1F1B's stage 0 does; later stages the micro-batches whose W they
    defer on top (Qi et al. 2024 §3.1: ≤ p·M_B)."""
    base = Strategy(tp=1, pp=4, micro_batch_size=1, global_batch_size=16)
    zb = dataclasses.replace(base, schedule="zb_h1")
    assert [inflight_microbatches(base, s) for s in range(4)] == [4, 3, 2, 1]
    assert [inflight_microbatches(zb, s) for s in range(4)] == [4, 4, 4, 4]


@pytest.mark.parametrize(("change", "says"), [
    ({"pp": 1}, "zb_h1 needs pp ≥ 2"),
    ({"zero_stage": 3}, "set zero_stage ≤ 2"),
    ({"tp": 2, "sequence_parallel": True, "tp_comm_overlap": True},
     "set tp_comm_overlap = false"),
    ({"tp": 2, "zb_w_regather": True}, "zb_w_regather needs sequence_parallel"),
    ({"tp": 2, "sequence_parallel": True, "zb_w_regather": True, "schedule": "1f1b"},
     "zb_w_regather needs schedule 'zb_h1'"),
])
def test_what_zb_h1_is_not_modelled_with_is_refused(change: dict[str, object],
                                                     says: str) -> None:
    fields: dict[str, object] = {"pp": 2, "micro_batch_size": 1, "global_batch_size": 4,
                                 "schedule": "zb_h1", **change}
    with pytest.raises(ConfigError) as info:
        Strategy(**fields)  # type: ignore[arg-type]
    assert says in str(info.value)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tp=st.sampled_from([1, 2]), pp=st.sampled_from([2, 3, 4]), dp=st.sampled_from([1, 2, 4]),
       sp=st.booleans(), zero=st.sampled_from([0, 1, 2]),
       recompute=st.sampled_from(["none", "selective", "full"]), m=st.integers(1, 10),
       dp_overlap=st.sampled_from(["both", "grad", "none"]), ep=st.sampled_from([0, 1, 2]),
       cp=st.sampled_from([1, 1, 2]), tied=st.booleans(), uneven=st.booleans(),
       mtp=st.sampled_from([0, 0, 1]),
       system=st.sampled_from(["dgx-h100", "dgx-a100-80gb", "dgx1-v100", "mi300x"]),
       gpn=st.sampled_from([8, 2, 4]), regather=st.booleans())
@example(tp=2, pp=4, dp=2, sp=True, zero=1, recompute="selective", m=6, dp_overlap="both",
         ep=0, cp=1, tied=True, uneven=False, mtp=0, system="dgx-h100", gpn=8, regather=True)
def test_the_fast_path_walks_zb_h1_as_replay_runs_it(tp: int, pp: int, dp: int, sp: bool,
                                                       zero: int, recompute: str, m: int,
                                                       dp_overlap: str, ep: int, cp: int,
                                                       tied: bool, uneven: bool, mtp: int,
                                                       system: str, gpn: int,
                                                       regather: bool) -> None:
    """Within 2% of contention-free replay (``zb_walk.zero_bubble`` and the buckets
    beside the last W pass, ``Stage.w_view``), with and without ``zb_w_regather``; every draw
    came out within 2e-4 (within 1e-5 without regathering)."""
    model = dataclasses.replace(MOE if ep else MODEL, tied_embeddings=tied, mtp_layers=mtp)
    hw = get_system(system)
    hw = dataclasses.replace(hw, node=dataclasses.replace(hw.node, gpus_per_node=gpn))
    try:
        s = Strategy(tp=tp, pp=pp, dp=dp, ep=max(ep, 1), cp=cp, sequence_parallel=sp and tp > 1,
                     zero_stage=zero, recompute=recompute,  # type: ignore[arg-type]
                     micro_batch_size=1, global_batch_size=dp * m, schedule="zb_h1",
                     first_stage_layers=int(uneven), last_stage_layers=int(uneven),
                     dp_bucket_params=200_000, overlap_grad_reduce=dp_overlap != "none",
                     overlap_param_gather=dp_overlap == "both" and zero > 0,
                     zb_w_regather=regather and sp and tp > 1)
        fast = estimate(model, s, hw)
    except ConfigError:
        assume(False)
        raise
    with tempfile.TemporaryDirectory() as tmp:
        generate(model, s, tmp, mode="representative")
        ref = replay(tmp, hw, contention=False).step_time_s
    assert fast.step_time_s == pytest.approx(ref, rel=0.02)


def test_compare_ranks_zb_h1_beside_1f1b() -> None:
    """A study listing both: each replayed, ZB-H1 the faster at more memory."""
    study = study_from_dict({"model": "gpt-1.7b", "system": "dgx-h100", "gpus": 8,
                             "global_batch_size": 16,
                             "strategies": [{"tp": 2, "pp": 4},
                                            {"tp": 2, "pp": 4, "schedule": "zb_h1"}]})
    one, zb = (evaluate_strategy(study, s, replay_it=True) for s in study.strategies)
    assert one["status"] == zb["status"] == "replayed"
    assert zb["step_time_s"] < one["step_time_s"]
    assert zb["peak_memory_GiB"] > one["peak_memory_GiB"]
    assert zb["fast_step_time_s"] == pytest.approx(zb["step_time_s"], rel=0.02)


def test_a_sweep_space_with_zb_h1_keeps_what_it_can_run() -> None:
    """A search over schedules: ZB-H1 where it runs (pp ≥ 2, no chunks), each the twin of a
    1F1B strategy of the space; never where it does not."""
    study = study_from_dict({"model": "gpt-1.7b", "system": "dgx-h100", "gpus": 16,
                             "global_batch_size": 64,
                             "search": {"tp": [1, 2], "pp": [1, 2, 4], "vpp": [1, 2],
                                        "micro_batch_size": [1],
                                        "recompute": ["none", "selective", "full"],
                                        "zero_stage": [1], "sequence_parallel": [False],
                                        "schedule": ["1f1b", "interleaved_1f1b", "zb_h1"]}})
    valid, _ = enumerate_space(study)
    zb = [s for s in valid if s.schedule == "zb_h1"]
    twins = {dataclasses.replace(s, schedule="zb_h1") for s in valid
             if s.schedule == "1f1b" and s.pp >= 2}
    assert zb and all(s.pp >= 2 and s.vpp == 1 for s in zb)
    assert set(zb) == twins


def test_the_timeline_plot_draws_the_w_passes() -> None:
    """The report's Gantt chart: ZB-H1's W passes in their own colour, named in the title."""
    from matplotlib.colors import to_rgba

    from analysis.plots import pipeline_timeline

    s = Strategy(tp=1, pp=2, micro_batch_size=1, global_batch_size=4, schedule="zb_h1")
    with tempfile.TemporaryDirectory() as tmp:
        generate(MODEL, s, tmp, mode="representative")
        fig = pipeline_timeline(replay(tmp, SYSTEM, contention=False).timeline)
    ax = fig.axes[0]
    assert "W (red)" in ax.get_title()
    red = [c for c in ax.collections if tuple(c.get_facecolor()[0]) == to_rgba("tab:red")]
    assert len(red) == 2 and all(len(c.get_paths()) >= 3 for c in red)  # 4 W passes (two touch)


def test_regathering_moves_the_input_gathers_into_w() -> None:
    """``zb_w_regather``: each column-parallel GEMM's input all-gather leaves B (where it ran
    beside the data gradient only for the weight gradient's sake) for W, blocking just before
    its weight-gradient GEMM; nothing else moves."""
    s = Strategy(tp=2, pp=2, sequence_parallel=True, micro_batch_size=1, global_batch_size=4,
                 schedule="zb_h1")
    bwd = O.layer_bwd(MODEL, s)
    b0, w0 = O.split_weight_grads(bwd)
    b1, w1 = O.split_weight_grads(bwd, regather=True)
    gathers = [it.name for it in b0 if it.name.endswith("_in_ag")]
    assert gathers == ["fc1_in_ag", "qkv_in_ag"]
    assert [it.name for it in b1] == [it.name for it in b0 if it.name not in gathers]
    assert [it.name for it in w1] == ["fc2_wgrad", "fc1_in_ag", "fc1_wgrad", "attn_out_wgrad",
                                      "qkv_in_ag", "qkv_wgrad"]
    assert not any(isinstance(it, O.Comm) and it.overlapped for it in w1)
    # what W keeps: the two gathered inputs as shards (256·256 → 256·128 each)
    assert O.weight_grad_operand_bytes(w0) - O.weight_grad_operand_bytes(w1) == 2 * 2 * 256 * 128


def test_a_deferred_w_keeps_its_gemms_operands() -> None:
    """A layer's W-pass hold, from its GEMM shapes: dW = Xᵀ·dY keeps X as the GEMM reads it —
    gathered over the sequence under SP — and dY. The toy layer (h 256, 8 heads of 32, 4 KV
    heads, SwiGLU 512) at tp 2 with SP, 256 tokens: QKV X 256·256, dY 256·(256 + 256)/2;
    proj X 256·256/2, dY 256·256; fc1 X 256·256, dY 256·1024/2; fc2 X 256·512/2, dY 256·256."""
    s = Strategy(tp=2, pp=2, sequence_parallel=True, micro_batch_size=1, global_batch_size=4)
    _, w = O.split_weight_grads(O.layer_bwd(MODEL, s))
    elems = 256 * (256 + 256 + 128 + 256 + 256 + 512 + 256 + 256)
    assert O.weight_grad_operand_bytes(w) == 2 * elems


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("m", [2, 4, 12])
def test_the_last_stage_holds_its_deferred_ws_operands(m: int, recompute: str) -> None:
    """Stage p − 1 defers the W of its first p − 1 B passes: its activations peak at (k − 1)·W
    + max(M_B, W) with k = min(p, m) — W what one deferred pass keeps (``w_hold_bytes``),
    M_B what one in-flight micro-batch does (1F1B's last stage holds one). Under full recompute
    M_B is the layers' inputs alone and W the larger by far."""
    one = Strategy(tp=2, pp=4, dp=1, sequence_parallel=True, micro_batch_size=1,
                   global_batch_size=m, recompute=recompute)  # type: ignore[arg-type]
    zb = dataclasses.replace(one, schedule="zb_h1")
    last = one.pp - 1
    held = RoleProgram(MODEL, one, last).stage_params()
    mem = {s.schedule: memory.estimate(MODEL, s, last, sum(held.values())) for s in (one, zb)}
    (w,), m_b = memory.w_hold_bytes(MODEL, zb, last), mem["1f1b"].activations_bytes
    k = min(one.pp, m)
    assert mem["zb_h1"].activations_bytes == (k - 1) * w + max(m_b, w)


@pytest.mark.parametrize("kw", [
    dict(tp=2, pp=4, dp=2, sequence_parallel=True),
    dict(tp=4, pp=4, dp=2, sequence_parallel=True),  # stages alike: whole nodes each
    dict(tp=1, pp=2, dp=4, ep=2, zero_stage=1),
    dict(tp=2, pp=4, dp=1, first_stage_layers=1, last_stage_layers=1, recompute="selective"),
])
def test_the_fast_paths_memory_is_the_trace_sets(kw: dict[str, object]) -> None:
    """The fast path's peak (each stage's W hold from its memoized costs; of alike stages the
    first and last alone) equals the memory model's on every stage as the trace set's
    manifest states it."""
    model = MOE if kw.get("ep") else dataclasses.replace(MODEL, mtp_layers=1)
    s = Strategy(micro_batch_size=1, global_batch_size=8 * int(kw["dp"]),  # type: ignore[call-overload]
                 schedule="zb_h1", **kw)  # type: ignore[arg-type]
    with tempfile.TemporaryDirectory() as tmp:
        summary = generate(model, s, tmp)
    manifest = max(st.memory.total_bytes for st in summary.stages) / 2**30
    assert estimate(model, s, SYSTEM).peak_memory_GiB == pytest.approx(manifest, rel=1e-12)


def test_a_zb_h1_that_does_not_fit_is_told_its_alternatives() -> None:
    """``estimate`` of a ZB-H1 strategy over the GPU's memory names what W regathering and
    1F1B would need (``glance.zb_hint``: the same strategy estimated each way) — Llama 3 70B
    at tp 8 with SP, micro-batch 2, where the deferred W passes' operands do not fit."""
    from analysis.glance import glance
    from tests.test_cli import run

    args = ["--model", "llama3-70b", "--gpus", "1024", "--tp", "8", "--pp", "4", "--sp",
            "--mbs", "2", "--gbs", "1024", "--zero", "1", "--system", "dgx-h100",
            "--schedule", "zb_h1"]
    s = Strategy(tp=8, pp=4, dp=32, sequence_parallel=True, micro_batch_size=2,
                 global_batch_size=1024, zero_stage=1, schedule="zb_h1")
    g = glance("llama3-70b", s, "dgx-h100")
    assert not g.fits and g.zb_hint is not None and list(g.zb_hint) == ["zb_w_regather", "1f1b"]
    for name, alt in (("zb_w_regather", dataclasses.replace(s, zb_w_regather=True)),
                      ("1f1b", dataclasses.replace(s, schedule="1f1b"))):
        est = estimate("llama3-70b", alt, "dgx-h100")
        assert g.zb_hint[name] == {"step_time_s": est.step_time_s,
                                   "peak_memory_GiB": est.peak_memory_GiB, "fits": est.fits}
    assert g.zb_hint["1f1b"]["fits"] and not g.zb_hint["zb_w_regather"]["fits"]
    out = run("estimate", *args).stdout
    assert "with --zb-w-regather: 100.5 GiB (does not fit)" in out
    assert "with --schedule 1f1b: 59.6 GiB (fits)" in out
    assert glance("llama3-70b", dataclasses.replace(s, schedule="1f1b"),
                  "dgx-h100").zb_hint is None
