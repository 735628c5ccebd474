"""DualPipe-V (PyTorch's ``ScheduleDualPipeV``, after DeepSeek-AI's DualPipe, DeepSeek-V3
technical report §3.2.1): ZB-V's two chunks a stage in a V, another order — paired forwards and
full backwards in the steady state, zero-bubble W passes only in the cool-down. The order, its
memory, the fast path's walk of it against replay, and what it is not modelled with."""

from __future__ import annotations

import dataclasses
import tempfile

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from analysis.fastpath import estimate
from analysis.pipeline_imbalance import makespan
from analysis.zbv_walk import zero_bubble_v
from replay import get_system
from tests.conftest import replayed
from tests.test_fastpath import MODEL, MOE, SYSTEM
from tests.test_zero_bubble_v import _walk_v
from tracegen import ConfigError, Strategy, generate, memory
from tracegen.schedule import dualpipe_v


def _dv(**kw: object) -> Strategy:
    fields: dict[str, object] = {"pp": 4, "vpp": 2, "micro_batch_size": 1,
                                 "global_batch_size": 8, "schedule": "dualpipe_v", **kw}
    return Strategy(**fields)  # type: ignore[arg-type]


def test_the_order_pytorch_runs() -> None:
    """p 4, m 8 as ``ScheduleDualPipeV._calculate_single_rank_operations`` lays it out
    (torch.distributed.pipelining; a = the stage's first chunk, b its second; a full backward
    B W at once, an OVERLAP_F_B its forward then its full backward, as the runtime runs it
    without a registered overlap function), worked by hand from its eight steps: the last
    stage starts with four F0 F1 pairs and ends with two pairs whose W's wait (stage 3 is odd:
    the deferral starts before chunk 1's B at the half), stage 0 with six F0's and ends with
    three (W, B0) pairs."""
    got = [" ".join(f"{ph}{j}{'ab'[c]}" for ph, j, c in dualpipe_v(8, 4, s)) for s in (0, 3)]
    assert got == [
        "F0a F1a F2a F3a F4a F5a F6a F0b B0b W0b F1b B1b W1b F2b B2b W2b F3b F7a B3b W3b F4b "
        "B0a W0a B4b W4b F5b B1a W1a B5b W5b F6b B2a W2a B6b W6b F7b B3a W3a B7b W7b B4a W4a "
        "B5a W5a B6a W6a B7a W7a",
        "F0a F0b F1a F1b F2a F2b F3a F3b F4a B0b W0b F4b B0a W0a F5a B1b W1b F5b B1a W1a F6a "
        "B2b W2b F6b B2a W2a F7a B3b W3b F7b B3a W3a B4b W4b B4a W4a B5b W5b B5a W5a B6b B6a "
        "B7b B7a W6b W6a W7b W7a"]


@settings(max_examples=200, deadline=None)
@given(p=st.integers(2, 8), extra=st.integers(0, 24), data=st.data())
def test_every_pass_once_in_order(p: int, extra: int, data: st.DataObject) -> None:
    """Each chunk's passes once per micro-batch, micro-batches in order, F before B before W;
    at its peak every stage holds 2p + 1 chunk passes between F and W, p + ½ stage-loads —
    one chunk more than ZB-V's p (the steady round's forward runs before the backward it is
    paired with)."""
    m = 2 * p + extra
    stage = data.draw(st.integers(0, p - 1))
    order = dualpipe_v(m, p, stage)
    for ph in "FBW":
        for ch in (0, 1):
            assert [j for x, j, c in order if x == ph and c == ch] == list(range(m))
    at = {(ph, j, c): i for i, (ph, j, c) in enumerate(order)}
    assert all(at["F", j, c] < at["B", j, c] < at["W", j, c] for j in range(m) for c in (0, 1))
    s = _dv(pp=p, global_batch_size=m)
    assert memory.inflight_microbatches(s, stage) == p + 0.5
    zb = dataclasses.replace(s, schedule="zb_v")
    assert memory.inflight_microbatches(zb, stage) == p


@settings(max_examples=200, deadline=None)
@given(data=st.data(), p=st.integers(2, 8), extra=st.integers(0, 30))
def test_the_fast_paths_walk_is_the_schedules(data: st.DataObject, p: int, extra: int) -> None:
    """``zero_bubble_v`` on DualPipe-V's order gives each stage's end and its chunks' last W
    ends exactly as walking that order pass by pass does, for any costs and sends; and the
    step is the vectorized walk's (``pipeline_imbalance.makespan``) with every micro-batch
    alike."""
    import numpy as np

    m = 2 * p + extra

    def costs(lo: int, hi: int) -> list[tuple[int, int]]:
        return [(data.draw(st.integers(lo, hi)), data.draw(st.integers(lo, hi)))
                for _ in range(p)]
    f, b, w = costs(1, 300), costs(1, 600), costs(0, 400)
    c = data.draw(st.lists(st.sampled_from([0, 7, 60, 900]), min_size=p, max_size=p))
    got = zero_bubble_v(m, f, b, w, c, None, "dualpipe_v")
    assert got == _walk_v(m, p, f, b, w, c, dualpipe_v)

    def by_chunk(x: list[tuple[int, int]]) -> np.ndarray:  # (global chunk, micro-batch, 1)
        g = [x[s][0] for s in range(p)] + [x[s][1] for s in reversed(range(p))]
        return np.array(g, dtype=float)[:, None, None] * np.ones((1, m, 1))
    step = makespan(by_chunk(f), by_chunk(b), "dualpipe_v", p, tuple(map(float, c)),
                    by_chunk(w))
    assert float(step[0]) == max(got[0])


@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 9), (4, 8), (4, 31), (8, 17)])
def test_equal_passes_leave_the_fill_on_every_stage(p: int, m: int) -> None:
    """With every pass F = B = W = t and free sends each stage runs 6m passes; ZB-V's stage s
    ends at 6mt + s·t (the first stage turns nothing round and starts its cool-down first),
    DualPipe-V's every stage at 6mt + (p − 1)t: the same step, each stage idle for the same
    (p − 1)t — its paired rounds hold the first stage back as long as the last."""
    t = 100
    one = [(t, t)] * p
    ends, _ = zero_bubble_v(m, one, one, one, [0] * p, None, "dualpipe_v")
    zb, _ = zero_bubble_v(m, one, one, one, [0] * p)
    assert ends == [6 * m * t + (p - 1) * t] * p
    assert zb == [6 * m * t + s * t for s in range(p)]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tp=st.sampled_from([1, 2]), pp=st.sampled_from([2, 4]), dp=st.sampled_from([1, 2]),
       sp=st.booleans(), zero=st.sampled_from([0, 1, 2]),
       recompute=st.sampled_from(["none", "selective", "full"]), extra=st.integers(0, 4),
       overlap=st.sampled_from(["both", "grad", "param", "none"]), ep=st.sampled_from([0, 2]),
       tied=st.booleans(), system=st.sampled_from(["dgx-h100", "dgx-a100-80gb"]),
       regather=st.booleans())
@example(tp=2, pp=4, dp=2, sp=True, zero=1, recompute="selective", extra=2, overlap="both",
         ep=0, tied=True, system="dgx-h100", regather=False)
@example(tp=1, pp=2, dp=2, sp=False, zero=2, recompute="full", extra=0, overlap="both", ep=2,
         tied=False, system="dgx-a100-80gb", regather=False)
def test_the_fast_path_walks_dualpipe_v_as_replay_runs_it(
        tp: int, pp: int, dp: int, sp: bool, zero: int, recompute: str, extra: int,
        overlap: str, ep: int, tied: bool, system: str, regather: bool) -> None:
    """Within 2% of contention-free replay of the trace set (the same walk as ZB-V's, its
    chunks' buckets beside their last W pass, the opening's gathers holding the first
    forwards; 25 exploratory draws agreed within 2e-5 %)."""
    model = dataclasses.replace(MOE if ep else MODEL, tied_embeddings=tied)
    try:
        s = _dv(tp=tp, pp=pp, dp=dp, ep=max(ep, 1), sequence_parallel=sp and tp > 1,
                zero_stage=zero, recompute=recompute, global_batch_size=dp * (2 * pp + extra),
                dp_bucket_params=200_000, overlap_grad_reduce=overlap in ("both", "grad"),
                overlap_param_gather=overlap in ("both", "param") and zero > 0,
                zb_w_regather=regather and sp and tp > 1)
        fast = estimate(model, s, get_system(system))
    except ConfigError:
        assume(False)
        raise
    assert fast.step_time_s == pytest.approx(
        replayed(model, s, get_system(system)).step_time_s, rel=0.02)


@pytest.mark.parametrize("kw", [dict(tp=2, pp=4, dp=1, sequence_parallel=True),
                                dict(tp=1, pp=2, dp=2, recompute="full"),
                                dict(tp=2, pp=2, dp=2, ep=2, sequence_parallel=True)])
def test_the_fast_paths_memory_is_the_trace_sets(kw: dict[str, object]) -> None:
    """Every stage's peak as the trace set's manifest states it (the order's 2p + 1 chunk
    passes, the deferred W's operands, stage 0's logits)."""
    model = MOE if kw.get("ep") else MODEL
    s = _dv(global_batch_size=8 * int(kw["dp"]), **kw)  # type: ignore[call-overload]
    with tempfile.TemporaryDirectory() as tmp:
        summary = generate(model, s, tmp)
    manifest = max(x.memory.total_bytes for x in summary.stages) / 2**30
    assert estimate(model, s, SYSTEM).peak_memory_GiB == pytest.approx(manifest, rel=1e-12)


@pytest.mark.parametrize(("change", "says"), [
    ({"global_batch_size": 7}, "needs at least 2·pp = 8 micro-batches"),
    ({"vpp": 1}, "set vpp = 2"),
    ({"zero_stage": 3}, "ZeRO 0-2"),
    ({"tp": 2, "sequence_parallel": True, "tp_comm_overlap": True}, "without tp_comm_overlap"),
    ({"ep": 2, "dp": 2, "global_batch_size": 16, "overlap_moe_ep_comm": True},
     "one after the other"),
])
def test_what_dualpipe_v_is_not_modelled_with_is_refused(change: dict[str, object],
                                                         says: str) -> None:
    with pytest.raises(ConfigError) as info:
        _dv(**change)
    assert says in str(info.value)


def test_the_cli_takes_it_and_says_what_it_needs() -> None:
    """``estimate --schedule dualpipe_v --vpp 2`` runs; too few micro-batches is told how
    many it needs, with no traceback."""
    from tests.test_cli import run

    args = ("estimate", "--model", "llama3-8b", "--gpus", "16", "--tp", "2", "--pp", "4",
            "--vpp", "2", "--sp", "--mbs", "1", "--system", "dgx-h100", "--schedule",
            "dualpipe_v")
    assert "step time" in run(*args, "--gbs", "32").stdout
    bad = run(*args, "--gbs", "8")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "raise the global batch to 16 or more" in bad.stderr
