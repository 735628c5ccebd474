"""DualPipe-V (PyTorch's ``ScheduleDualPipeV``, after DeepSeek-AI's DualPipe, DeepSeek-V3
technical report §3.2.1): ZB-V's two chunks a stage in a V, another order — paired forwards and
full backwards in the steady state, zero-bubble W passes only in the cool-down — run one pass
after the other, or with the pairs merged to hide the expert all-to-alls (torchtitan's
overlap, ``overlap_moe_ep_comm``). The order, its memory, the fast path's walks of it against
replay, and what it is not modelled with."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from analysis.fastpath import estimate
from analysis.pipeline_imbalance import makespan
from analysis.zbv_walk import zero_bubble_v
from replay import get_system
from tests.conftest import fast_meets_replay, replayed
from tests.test_fastpath import MODEL, MOE
from tests.test_zero_bubble_v import _walk_v, assert_every_pass_once, assert_memory_is_the_manifests
from tracegen import ConfigError, Strategy, memory
from tracegen.schedule import dualpipe_v, dualpipe_v_units


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
    assert_every_pass_once(dualpipe_v(m, p, stage), m, 2)
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
    fast_meets_replay(model, lambda: _dv(
        tp=tp, pp=pp, dp=dp, ep=max(ep, 1), sequence_parallel=sp and tp > 1,
        zero_stage=zero, recompute=recompute, global_batch_size=dp * (2 * pp + extra),
        dp_bucket_params=200_000, overlap_grad_reduce=overlap in ("both", "grad"),
        overlap_param_gather=overlap in ("both", "param") and zero > 0,
        zb_w_regather=regather and sp and tp > 1), get_system(system))


@pytest.mark.parametrize("kw", [dict(tp=2, pp=4, dp=1, sequence_parallel=True),
                                dict(tp=1, pp=2, dp=2, recompute="full"),
                                dict(tp=2, pp=2, dp=2, ep=2, sequence_parallel=True),
                                dict(tp=1, pp=4, dp=2, ep=2, overlap_moe_ep_comm=True)])
def test_the_fast_paths_memory_is_the_trace_sets(kw: dict[str, object]) -> None:
    """Every stage's peak as the trace set's manifest states it (the order's 2p + 1 chunk
    passes, the deferred W's operands, stage 0's logits; with the pairs merged, each pair
    walked backward first, plus the one layer a merged pass holds beyond it)."""
    model = MOE if kw.get("ep") else MODEL
    s = _dv(global_batch_size=8 * int(kw["dp"]), **kw)  # type: ignore[call-overload]
    assert_memory_is_the_manifests(model, s)


@pytest.mark.parametrize(("change", "says"), [
    ({"global_batch_size": 7}, "needs at least 2·pp = 8 micro-batches"),
    ({"vpp": 1}, "set vpp = 2"),
    ({"zero_stage": 3}, "zero_stage 1 with overlap_param_gather runs that pattern"),
    ({"tp": 2, "sequence_parallel": True, "tp_comm_overlap": True}, "without tp_comm_overlap"),
    ({"ep": 2, "dp": 2, "global_batch_size": 16, "overlap_moe_ep_comm": True,
      "delay_wgrad_compute": True}, "paired passes run full backwards"),
    ({"overlap_moe_ep_comm": True}, "needs ep > 1"),
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


def test_a_plain_moe_estimate_names_what_merging_the_pairs_gives() -> None:
    """A MoE model with expert parallelism on DualPipe-V without the merge: ``estimate``
    names the merged step (the schedule's point); with the merge, or on a dense model, no
    such note."""
    from tests.test_cli import run

    args = ("estimate", "--model", "qwen3-30b-a3b", "--gpus", "64", "--pp", "4", "--vpp", "2",
            "--ep", "8", "--mbs", "1", "--gbs", "512", "--zero", "1", "--recompute",
            "selective", "--system", "dgx-h100", "--schedule", "dualpipe_v")
    out = " ".join(run(*args).stdout.split())
    assert "merged as torchtitan's overlap runs them (--overlap-moe-expert-parallel-comm): " \
        "2.9768 s a step (-11.8%), 42.7 GiB" in out
    merged = run(*args, "--overlap-moe-expert-parallel-comm").stdout
    assert "merged as torchtitan's" not in merged and "without the merged passes" in merged


@settings(max_examples=100, deadline=None)
@given(p=st.integers(2, 8), extra=st.integers(0, 20), data=st.data())
def test_the_pairs_are_pytorchs_overlap_actions(p: int, extra: int, data: st.DataObject
                                                ) -> None:
    """``dualpipe_v_units``: each OVERLAP_F_B a merged (forward, backward) unit whose full
    backward has no W of its own — steps 4 and 5 of PyTorch's order, 2(m − 2p + i + 1) of
    them on stage i less the last stage's first (which PyTorch does not overlap), plus
    p − i − 1 — and the order is the units with each pair run F, B, W (``paired``: B, W, F,
    for the memory walk). A pair is never a chunk's first forward nor its last backward (no
    gather waits, no gradient buckets in a merged pass)."""
    m = 2 * p + extra
    stage = data.draw(st.integers(0, p - 1))
    units = dualpipe_v_units(m, p, stage)
    pairs = [u for u in units if len(u) == 2]
    rest = p - stage - 1
    assert len(pairs) == 2 * (m - 2 * p + stage + 1) - (stage == p - 1) + rest
    assert all(f[0] == "F" and b[0] == "B" and f[2] != b[2] for f, b in pairs)
    for paired in (False, True):
        flat = [x for u in units for x in (
            u if len(u) == 1 else ([u[1], ("W", *u[1][1:]), u[0]] if paired
                                   else [u[0], u[1], ("W", *u[1][1:])]))]
        assert flat == dualpipe_v(m, p, stage, paired)
    assert all(f[1] > 0 and b[1] < m - 1 for f, b in pairs)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tp=st.sampled_from([1, 2]), pp=st.sampled_from([2, 4]), dp=st.sampled_from([2, 4]),
       sp=st.booleans(), zero=st.sampled_from([0, 1, 2]),
       recompute=st.sampled_from(["none", "selective"]), extra=st.integers(0, 4),
       overlap=st.sampled_from(["both", "grad", "param", "none"]), ep=st.sampled_from([2, 4]),
       system=st.sampled_from(["dgx-h100", "dgx-a100-80gb"]), gpn=st.sampled_from([8, 2]),
       deepep=st.booleans(), mtp=st.sampled_from([0, 1]), shared=st.booleans(),
       cp=st.sampled_from([1, 2]))
@example(tp=1, pp=2, dp=2, sp=False, zero=1, recompute="none", extra=1, overlap="both", ep=2,
         system="dgx-a100-80gb", gpn=8, deepep=False, mtp=1, shared=False, cp=1)
@example(tp=2, pp=4, dp=4, sp=True, zero=2, recompute="selective", extra=6, overlap="both",
         ep=2, system="dgx-h100", gpn=2, deepep=False, mtp=1, shared=True, cp=1)
def test_the_fast_path_walks_the_merged_pairs_as_replay_runs_them(
        tp: int, pp: int, dp: int, sp: bool, zero: int, recompute: str, extra: int,
        overlap: str, ep: int, system: str, gpn: int, deepep: bool, mtp: int, shared: bool,
        cp: int) -> None:
    """With the pairs merged (``dualpipe_walk``: each merged pass's pieces from each input's
    arrival, ``merged_pass.run_pieces``) within 2% of contention-free replay of the trace set
    (20 exploratory draws: worst 0.12%, overlapped gathers and reductions on A100; the rest
    within 0.001%)."""
    model = dataclasses.replace(MOE, mtp_layers=mtp, first_dense_layers=int(shared),
                                shared_expert_ffn_hidden_size=256 * shared)
    base = get_system(system)
    hw = dataclasses.replace(base, node=dataclasses.replace(base.node, gpus_per_node=gpn))
    try:
        s = _dv(tp=tp, pp=pp, dp=dp, ep=ep, cp=cp, sequence_parallel=sp and tp > 1,
                zero_stage=zero, recompute=recompute, global_batch_size=dp * (2 * pp + extra),
                dp_bucket_params=200_000, overlap_grad_reduce=overlap in ("both", "grad"),
                overlap_param_gather=overlap in ("both", "param") and zero > 0,
                overlap_moe_ep_comm=True, moe_dispatcher="deepep" if deepep else "alltoall")
        fast = estimate(model, s, hw)
    except ConfigError:
        assume(False)
        raise
    assert fast.step_time_s == pytest.approx(replayed(model, s, hw).step_time_s, rel=0.02)


def test_merging_the_pairs_hides_the_all_to_alls() -> None:
    """Qwen3-30B-A3B on 64 H100s (pp 4 as a V, ep 8 across the nodes' NICs, selective
    recompute): the merged pairs take 3.38 s to 2.98 s, below combined 1F1B on the same chunks
    interleaved (3.03 s), and hold less at the peak than the plain order (a pair holds one
    layer more than the backward it frees, not the forward's whole chunk)."""
    kw = dict(pp=4, vpp=2, dp=16, ep=8, micro_batch_size=1, global_batch_size=512,
              zero_stage=1, recompute="selective")
    plain = estimate("qwen3-30b-a3b", Strategy(schedule="dualpipe_v", **kw), "dgx-h100")
    merged = estimate("qwen3-30b-a3b", Strategy(schedule="dualpipe_v", overlap_moe_ep_comm=True,
                                                **kw), "dgx-h100")
    combined = estimate("qwen3-30b-a3b", Strategy(schedule="interleaved_1f1b",
                                                  overlap_moe_ep_comm=True, **kw), "dgx-h100")
    assert merged.step_time_s < combined.step_time_s < plain.step_time_s
    assert merged.step_time_s == pytest.approx(2.977, rel=0.002)
    assert merged.peak_memory_GiB < plain.peak_memory_GiB
