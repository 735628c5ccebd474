"""Megatron's tensor-parallel communication: the backward's overlapped re-gather and reductions,
and --tp-comm-overlap (collectives alongside their GEMMs)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replay import get_system, replay
from replay.compute import OpCost, RooflineCompute
from replay.traceset import load_trace_set
from tracegen import ConfigError, ModelSpec, Strategy, generate
from tracegen import ops as O
from tracegen.units import DTYPE_CODE

MODEL = ModelSpec(name="ov", num_layers=4, hidden_size=1024, num_attention_heads=16,
                  ffn_hidden_size=4096, vocab_size=4096, seq_len=1024, activation="gelu")
SYSTEM = get_system("dgx-h100")
BASE = Strategy(tp=4, dp=2, sequence_parallel=True, micro_batch_size=2, global_batch_size=8)


def test_overlap_needs_sequence_parallelism() -> None:
    with pytest.raises(ConfigError, match="tp_comm_overlap needs sequence_parallel"):
        Strategy(tp=4, tp_comm_overlap=True)


def test_column_parallel_backward_structure() -> None:
    """With SP: [re-gather ‖ dgrad, reduce-scatter ‖ wgrad] for QKV and FC1; without SP the
    input-gradient all-reduce runs alongside wgrad."""
    names = [(it.name, getattr(it, "overlapped", None)) for it in O.layer_bwd(MODEL, BASE)]
    i = names.index(("qkv_dgrad", None))
    assert names[i - 1] == ("qkv_in_ag", True) and names[i + 1] == ("ln1_ag_bwd", True)
    assert names[i + 2] == ("qkv_wgrad", None)
    no_sp = dataclasses.replace(BASE, sequence_parallel=False)
    names = [(it.name, getattr(it, "overlapped", None)) for it in O.layer_bwd(MODEL, no_sp)]
    i = names.index(("fc1_dgrad", None))
    assert names[i + 1] == ("ln2_in_grad_ar", True) and names[i + 2] == ("fc1_wgrad", None)


def test_overlapped_gemms_run_in_transformer_engines_chunks(tmp_path: Path) -> None:
    """With --tp-comm-overlap the GEMMs fed by a ring-exchange all-gather run as tp chunks
    (QKV and FC1 forward, the output projection's and FC2's data gradients), those feeding a
    pipelined reduce-scatter as 4 (TE's ``initialize_ub`` defaults), the bulk overlaps keep
    theirs whole; the trace carries it (``gemm_splits``) and replay times each chunk's
    occupancy and launch as the op lists say."""
    s = dataclasses.replace(BASE, tp_comm_overlap=True)
    splits = {it.name: it.splits for it in [*O.layer_fwd(MODEL, s), *O.layer_bwd(MODEL, s)]
              if isinstance(it, O.Op) and it.kind == "gemm"}
    assert splits == {"qkv": 4, "attn_out": 4, "fc1": 4, "fc2": 4, "fc2_dgrad": 4,
                      "fc2_wgrad": 1, "fc1_dgrad": 1, "fc1_wgrad": 1, "attn_out_dgrad": 4,
                      "attn_out_wgrad": 1, "qkv_dgrad": 1, "qkv_wgrad": 1}
    tp8 = {it.name: it.splits for it in O.layer_fwd(MODEL, dataclasses.replace(s, tp=8, dp=1))
           if isinstance(it, O.Op) and it.kind == "gemm"}
    assert tp8 == {"qkv": 8, "attn_out": 4, "fc1": 8, "fc2": 4}  # ring: tp; pipeline: 4
    plain = {it.name: it.splits for it in O.layer_fwd(MODEL, BASE) if isinstance(it, O.Op)}
    assert set(plain.values()) == {1}
    # a MoE layer's router and experts are not Transformer Engine's overlapped layers
    moe = dataclasses.replace(MODEL, num_experts=4, experts_per_token=2, moe_ffn_hidden_size=512)
    s_moe = dataclasses.replace(s, ep=2, dp=2)
    moe_splits = {it.name: it.splits for it in [*O.layer_fwd(moe, s_moe), *O.layer_bwd(moe, s_moe)]
                  if isinstance(it, O.Op) and it.kind == "gemm"}
    assert moe_splits["qkv"] == 4 and moe_splits["attn_out_dgrad"] == 4
    assert all(n == 1 for name, n in moe_splits.items() if not name.startswith(("qkv", "attn")))
    generate(MODEL, s, tmp_path, mode="representative")
    ts = load_trace_set(tmp_path)
    compute = RooflineCompute(SYSTEM.gpu)
    ops = {it.name: it for it in O.layer_fwd(MODEL, s) if isinstance(it, O.Op)}
    node = next(n for n in ts.ranks[0].nodes if n.name == "F0.c0.L0.qkv")
    assert node.attrs["gemm_splits"] == 4 and node.attrs["gemm_m"] == ops["qkv"].m
    qkv = ops["qkv"]
    whole = compute.op_ns("gemm", qkv.flop, qkv.bytes, qkv.m, qkv.n, DTYPE_CODE[qkv.dtype],
                          False, qkv.k)
    assert compute.duration_ns(node) > whole  # a quarter of the rows: fewer tiles, 4 launches
    assert compute.duration_ns(node) == compute.op_ns(
        "gemm", qkv.flop, qkv.bytes, qkv.m, qkv.n, DTYPE_CODE[qkv.dtype], False, qkv.k, 4)


@given(chunk_tiles=st.integers(1, 12), n_tiles=st.integers(1, 64), splits=st.integers(2, 16),
       k=st.sampled_from([512, 4096, 8192]))
@settings(max_examples=60, deadline=None)
def test_split_gemm_chunks_share_the_sms_on_three_streams(chunk_tiles: int, n_tiles: int,
                                                          splits: int, k: int) -> None:
    """Transformer Engine issues a split GEMM's chunks round-robin on three compute streams
    (``_NUM_MAX_UB_STREAMS``), each waiting only for its own input, so up to three chunks share
    the SMs: the k-kernel occupancy is one kernel's of k times the rows; a GEMM of whole tiles
    in three chunks computes exactly as fast as whole, and pays two more launches; in more
    chunks, at three chunks' occupancy — never faster than whole, never slower than one chunk
    at a time."""
    gpu = SYSTEM.gpu
    rows, n = 128 * chunk_tiles, 128 * n_tiles
    for kernels in (1, 2, 3):
        assert gpu.gemm_occupancy(rows, n, kernels=kernels) == gpu.gemm_occupancy(
            kernels * rows, n)
    compute = RooflineCompute(gpu)

    def cost(m: int, parts: int) -> OpCost:
        op = O.gemm("g", m, n, k, "bf16")
        return compute.explain("gemm", op.flop, op.bytes, m, n, DTYPE_CODE["bf16"], False, k,
                               parts)

    whole, three = cost(3 * rows, 1), cost(3 * rows, 3)
    assert three.compute_ns == whole.compute_ns
    assert three.launch_ns - whole.launch_ns == 2 * gpu.launch_overhead_ns
    split = cost(splits * rows, splits)
    at_three = gpu.gemm_occupancy(rows, n, kernels=min(splits, 3))
    at_one = gpu.gemm_occupancy(rows, n)
    assert split.efficiency == pytest.approx(
        whole.efficiency / gpu.gemm_occupancy(3 * rows, n) * at_three, rel=1e-12)
    assert cost(splits * rows, 1).compute_ns <= split.compute_ns
    assert split.efficiency >= whole.efficiency / gpu.gemm_occupancy(3 * rows, n) * at_one


def test_overlapped_collective_starts_with_its_gemm(tmp_path: Path) -> None:
    """In replay the forward all-gather and the QKV GEMM start together, and what follows the
    GEMM waits for both."""
    s = dataclasses.replace(BASE, tp_comm_overlap=True)
    wide = dataclasses.replace(MODEL, hidden_size=8192, num_attention_heads=64,
                               num_kv_heads=64, ffn_hidden_size=32768, num_layers=2)
    generate(wide, s, tmp_path, mode="representative")  # GEMMs longer than their collectives
    tl = replay(tmp_path, SYSTEM).timeline.filter(pl.col("rank") == 0)
    row = {n: (a, b) for n, a, b in tl.select("name", "start_s", "end_s").iter_rows()}
    ag, qkv = row["F0.c0.L0.ln1_ag"], row["F0.c0.L0.qkv"]
    assert ag[0] == pytest.approx(qkv[0], abs=1e-12)
    nxt = min((v for k, v in row.items() if k.startswith("F0.c0.L0.") and v[0] >= qkv[1] - 1e-12
               and k not in ("F0.c0.L0.ln1_ag", "F0.c0.L0.qkv")), key=lambda v: v[0])
    assert nxt[0] >= max(ag[1], qkv[1]) - 1e-12


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tp=st.sampled_from([2, 4, 8]), mbs=st.sampled_from([1, 2, 4]),
       recompute=st.sampled_from(["none", "selective", "full"]))
def test_overlap_saves_at_most_the_tp_communication(tmp_path_factory, tp, mbs, recompute
                                                    ) -> None:
    """Overlapping TP collectives with their GEMMs shortens the step by no more than the time
    the TP collectives took without overlap, and lengthens it by no more than what running the
    overlapped GEMMs in chunks costs (Transformer Engine's splits, ``Op.splits``: smaller
    GEMMs fill fewer SMs and each chunk is launched) — on this small model at tp 8 the chunks
    can cost more than the overlap saves. Replay; dp = 1, so every collective of the single TP
    group is a TP collective."""
    s = Strategy(tp=tp, dp=1, sequence_parallel=True, micro_batch_size=mbs,
                 global_batch_size=mbs * 2, recompute=recompute)
    steps, tp_comm = [], 0.0
    for ov in (False, True):
        out = tmp_path_factory.mktemp("ov")
        generate(MODEL, dataclasses.replace(s, tp_comm_overlap=ov), out, mode="representative")
        res = replay(out, SYSTEM)
        steps.append(res.step_time_s)
        if not ov:
            coll = res.timeline.filter((pl.col("rank") == 0)
                                       & (pl.col("kind") == "COMM_COLL_NODE"))
            tp_comm = float((coll["end_s"] - coll["start_s"]).sum())
    plain, over = steps
    assert plain - over <= tp_comm * (1 + 1e-9)
    assert over - plain <= _chunk_cost_s(dataclasses.replace(s, tp_comm_overlap=True)) + 1e-9


def _chunk_cost_s(s: Strategy) -> float:
    """What running the split GEMMs in chunks adds over running them whole, for one step."""
    compute = RooflineCompute(SYSTEM.gpu)

    def extra(items: list[O.Item]) -> int:
        return sum(compute.op_ns(it.kind, it.flop, it.bytes, it.m, it.n, DTYPE_CODE[it.dtype],
                                 False, it.k, it.splits)
                   - compute.op_ns(it.kind, it.flop, it.bytes, it.m, it.n, DTYPE_CODE[it.dtype],
                                   False, it.k)
                   for it in items if isinstance(it, O.Op) and it.splits > 1)

    fwd = extra(O.layer_fwd(MODEL, s))
    per_layer = fwd * (2 if s.recompute == "full" else 1) + extra(O.layer_bwd(MODEL, s))
    assert per_layer > 0  # tp overlap does split GEMMs
    return per_layer * MODEL.num_layers * s.num_microbatches / 1e9


def test_overlap_costs_the_compute_it_slows(tmp_path: Path) -> None:
    """With --tp-comm-overlap every GEMM runs beside a collective: on the H100 preset (κ =
    0.189, Lee et al. 2025) the breakdown says how much compute time that cost, within the
    compute time, and the step is that much longer than with interference switched off; with it
    off nothing is lost."""
    s = dataclasses.replace(BASE, tp_comm_overlap=True)
    wide = dataclasses.replace(MODEL, hidden_size=8192, num_attention_heads=64,
                               num_kv_heads=64, ffn_hidden_size=32768, num_layers=2)
    generate(wide, s, tmp_path, mode="representative")  # GEMMs longer than their collectives
    off = dataclasses.replace(SYSTEM, gpu=dataclasses.replace(SYSTEM.gpu, comm_interference=0.0))
    on, free = replay(tmp_path, SYSTEM), replay(tmp_path, off)
    lost = on.breakdown["interference_s"]
    assert (lost > 0).all() and (lost < on.breakdown["compute_s"]).all()
    assert (free.breakdown["interference_s"] == 0).all()
    assert free.step_time_s < on.step_time_s <= free.step_time_s + lost.max() + 1e-9


@pytest.mark.parametrize(("precision", "per_elem"), [("bf16", 24), ("fp8", 16)])
def test_userbuffers_are_twelve_buffers_of_the_gathered_shape(precision: str,
                                                              per_elem: int) -> None:
    """Transformer Engine's userbuffers (``memory.tp_overlap_buffer_bytes``): 12 communicators,
    each with a buffer of Megatron's shape (seq·mbs / cp, hidden), 16-bit — or, under FP8, the 8
    all-gather ones in 1 byte: 24 or 16 bytes an element of that shape. None without the overlap
    or at tp 1; outside the allocator (no fragmentation share), on every stage."""
    from tracegen import memory as mem

    s = dataclasses.replace(BASE, tp_comm_overlap=True, cp=2, precision=precision)
    elems = s.micro_batch_size * MODEL.seq_len // 2 * MODEL.hidden_size
    assert mem.tp_overlap_buffer_bytes(MODEL, s) == per_elem * elems
    plain = dataclasses.replace(s, tp_comm_overlap=False)
    assert mem.tp_overlap_buffer_bytes(MODEL, plain) == 0
    one = dataclasses.replace(s, tp=1, sequence_parallel=False, tp_comm_overlap=False)
    assert mem.tp_overlap_buffer_bytes(MODEL, one) == 0
    with_ub, without = (mem.estimate(MODEL, x, 0, 10**8) for x in (s, plain))
    assert with_ub.runtime_bytes - without.runtime_bytes == per_elem * elems
    assert with_ub.fragmentation_bytes == without.fragmentation_bytes


def test_the_fast_paths_peak_carries_the_userbuffers() -> None:
    from analysis.fastpath import estimate
    from tracegen import memory as mem
    from tracegen.units import GiB

    s = dataclasses.replace(BASE, tp_comm_overlap=True)
    plain = dataclasses.replace(s, tp_comm_overlap=False)
    gap = estimate(MODEL, s, SYSTEM).peak_memory_GiB - estimate(MODEL, plain,
                                                                 SYSTEM).peak_memory_GiB
    assert gap == pytest.approx(mem.tp_overlap_buffer_bytes(MODEL, s) / GiB, rel=1e-9)
