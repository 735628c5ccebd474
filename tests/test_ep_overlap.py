"""Combined 1F1B (``Strategy.overlap_moe_ep_comm``; Megatron-Core's
--overlap-moe-expert-parallel-comm): the merged pass in the trace, in replay and in the fast
path, its memory, and what it is not modelled with."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from analysis.cli import app
from analysis.fastpath import estimate
from analysis.merged_pass import MergedPieces, PassClock, run_pieces
from replay import get_system, replay
from replay.reader import NodeRec, read_et
from tracegen import ConfigError, ModelSpec, Strategy, generate, get_model
from tracegen.memory import FRAGMENTATION, activation_bytes_per_layer
from tracegen.memory import estimate as memory_estimate
from tracegen.program import RoleProgram
from tracegen.schedule import combined, stage_order

MOE = ModelSpec(name="a2ao", num_layers=8, hidden_size=256, num_attention_heads=8,
                num_kv_heads=4, ffn_hidden_size=512, vocab_size=1024, seq_len=256,
                activation="swiglu", num_experts=4, experts_per_token=2, moe_ffn_hidden_size=256)


def _strategy(**kw: object) -> Strategy:
    base: dict[str, object] = dict(tp=1, pp=1, dp=4, ep=4, micro_batch_size=1,
                                   global_batch_size=16, zero_stage=1, overlap_moe_ep_comm=True)
    return Strategy(**{**base, **kw})  # type: ignore[arg-type]


def _replayed(model: ModelSpec, s: Strategy, system: object) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        generate(model, s, tmp, mode="representative")
        return replay(tmp, system, contention=False).step_time_s  # type: ignore[arg-type]


def test_the_clock_of_a_layer_pair_matches_its_hand_worked_timeline() -> None:
    """One MoE layer pair with κ = 0.5 and 40 ns all-to-alls: B0 10 (its combine after it),
    F0 100 beside it (40 ns of it in flight: 40/1.5 of work done, so it ends at 10 + 40 + 100 −
    40/1.5), B1 60, F1 60 and B2 100 each beside the other pass's all-to-all issued just
    before them (so each ends 40 + (its work − 40/1.5) after it starts), F2 10 alone:
    393⅓ ns, against 500 for the two passes one after the other."""
    clock = PassClock(0.5)
    for name, work in (("B", 10), ("F", 100), ("B", 60), ("F", 60)):
        clock.run(name, ((work, 0),))
        clock.all_to_all(name, 40)  # B0's combine, F0's dispatch, B1's dispatch, F1's combine
    clock.run("B", ((100, 0),))
    clock.run("F", ((10, 0),))
    start = 10.0
    end_f0 = start + 40 + (100 - 40 / 1.5)
    end_b1 = end_f0 + 40 + (60 - 40 / 1.5)
    end_f1 = end_b1 + 40 + (60 - 40 / 1.5)
    end_b2 = end_f1 + 40 + (100 - 40 / 1.5)
    assert clock.end() == pytest.approx(end_b2 + 10, abs=1e-9)
    assert clock.end() == pytest.approx(393 + 1 / 3, abs=1e-9)


def test_an_all_to_all_longer_than_the_compute_beside_it_sets_the_pace() -> None:
    """κ = 0: a 100 ns combine beside a 30 ns F0 — B1 waits for the combine (100), then the
    dispatch issued at 30 queues behind it on the one stream (100..200) while B1 runs
    (100..130): F1 starts at 200."""
    clock = PassClock(0.0)
    clock.run("B", ())  # an empty piece: the combine waits for nothing
    clock.all_to_all("B", 100)
    clock.run("F", ((30, 0),))
    clock.all_to_all("F", 100)
    clock.run("B", ((30, 0),))
    clock.run("F", ((5, 0),))
    assert clock.end() == 205


def test_a_kernel_beside_its_own_collective_and_an_all_to_all_is_slowed_by_both() -> None:
    """κ = 0.5, an all-to-all in flight over [0, 100) and a 30 ns kernel issued at 0 with a
    40 ns TP collective beside it (TP overlap): two collectives in flight until 40, so the
    kernel runs at 1/(1 + 2κ) — 20 ns of work by 40 — then at 1/(1 + κ) beside the all-to-all
    alone: the last 10 ns take 15, ending at 55 (replay/sim.py's rule; slowing it by its own
    collective first, to 43⅓, and by the all-to-all after, ×1.5, as the pieces were costed
    until the fifty-second session, ended it at 65)."""
    clock = PassClock(0.5)
    clock.all_to_all("B", 100)
    clock.run("F", ((30, 40),))
    assert clock.compute == pytest.approx(55, abs=1e-9)
    # a collective longer than its kernel holds the piece until it ends
    clock = PassClock(0.5)
    clock.run("F", ((10, 40),))
    assert clock.compute == pytest.approx(40, abs=1e-9)


def _work(nodes: list[NodeRec]) -> list[tuple[str, int, object, object]]:
    return sorted((n.name, n.type, n.attrs.get("num_ops"), n.attrs.get("comm_size"))
                  for n in nodes)


@pytest.mark.parametrize("kw", [{}, dict(tp=2, sequence_parallel=True, tp_comm_overlap=True),
                                dict(tp=2, sequence_parallel=True, tp_comm_overlap=True,
                                     moe_dispatcher="deepep"),
                                dict(cp=2, dp=2, ep=2),
                                dict(cp=2, dp=2, ep=2, cp_comm_type="all_gather")])
def test_merging_reorders_the_same_work_and_saves_time(kw: dict[str, object]) -> None:
    """The merged trace holds the same nodes (names, FLOPs, bytes) as 1F1B's, only ordered and
    linked otherwise; replayed, its step is shorter, and the first and last micro-batch run
    alone (m passes become 1 + (m − 1) merged + 1). With TP overlap too (the ModelZoo BF16
    script runs both): its overlapped collectives are nodes of the merged passes; and with
    context parallelism, its ring or all-gather of K/V in the attention pieces."""
    ranks, merged_s, plain_s = _against_unmerged(MOE, _strategy(**kw))
    assert ranks and merged_s < plain_s
    if kw.get("tp_comm_overlap"):
        # the first merged pass's first all-gather runs beside its GEMM, off the chain: both
        # start after the norm, and the node after the GEMM waits for the two
        by_name = {n.name: n for n in ranks[0]}
        ag, gemm = by_name["F1.c0.L0.ln1_ag"], by_name["F1.c0.L0.qkv"]
        assert ag.data_deps == gemm.data_deps
        assert {ag.id, gemm.id} <= set(by_name["F1.c0.L0.rope"].data_deps)
        # the dispatch waits for the tokens it sends, the all-gather beside the router (with
        # DeepEP the router is its piece's last node, and it had waited for the router alone)
        by_id = {n.id: n for n in ranks[0]}
        seen, todo = set(), [by_name["F1.c0.L0.moe_dispatch"].id]
        while todo:
            for d in by_id[todo.pop()].data_deps:
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        assert by_name["F1.c0.L0.ln2_ag"].id in seen


def test_tp_overlap_beside_merged_passes_saves_what_it_saves_without_them() -> None:
    """TP overlap hides the sequence-parallel collectives in their GEMMs whether or not the
    passes merge: replayed, it shortens the merged step as it shortens the plain one (within
    a tenth of the saving: interference differs where an all-to-all is also in flight)."""
    hw = get_system("dgx-h100")
    step = {(tpo, ovl): _replayed(MOE, _strategy(tp=2, sequence_parallel=True,
                                                 tp_comm_overlap=tpo, overlap_moe_ep_comm=ovl),
                                  hw)
            for tpo in (False, True) for ovl in (False, True)}
    plain_saving = step[False, False] - step[True, False]
    merged_saving = step[False, True] - step[True, True]
    assert plain_saving > 0
    assert merged_saving == pytest.approx(plain_saving, rel=0.1)


def _against_unmerged(model: ModelSpec, s: Strategy) -> tuple[list[list[NodeRec]], float,
                                                               float]:
    """Each rank's merged trace checked against the trace without merging — the same nodes
    (names, FLOPs, bytes), as many — and (the merged nodes per rank, both steps replayed on
    DGX H100 without contention)."""
    hw = get_system("dgx-h100")
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        generate(model, s, a, mode="representative")
        generate(model, dataclasses.replace(s, overlap_moe_ep_comm=False,
                                            delay_wgrad_compute=False), b,
                 mode="representative")
        files = [sorted(Path(d).glob("*.et")) for d in (a, b)]
        assert [x.name for x in files[0]] == [y.name for y in files[1]]
        ranks = []
        for x, y in zip(*files, strict=True):
            merged, plain = (read_et(f, 0).nodes for f in (x, y))
            assert len(merged) == len(plain)
            assert _work(merged) == _work(plain)
            ranks.append(merged)
        return ranks, *(replay(d, hw, contention=False).step_time_s for d in (a, b))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tp=st.sampled_from([1, 2]), dp=st.sampled_from([2, 4, 8]), ep=st.sampled_from([2, 4]),
       mb=st.integers(1, 4), mbs=st.sampled_from([1, 2]), zero=st.sampled_from([0, 1, 2]),
       modules=st.sampled_from(["", "core_attn", "moe_act", "layernorm,moe_act"]),
       shared=st.booleans(), dense=st.booleans(), mtp=st.booleans(), tied=st.booleans(),
       deepep=st.booleans(), fold=st.booleans(), sp=st.booleans(), gather=st.booleans(),
       system=st.sampled_from(["dgx-h100", "dgx-b200", "dgx-a100-80gb"]),
       gpn=st.sampled_from([2, 8]), fp8=st.booleans(), delay=st.booleans(),
       tpo=st.booleans(), cp=st.sampled_from([1, 2]))
def test_fast_path_within_0_1_percent_of_replay(tp: int, dp: int, ep: int, mb: int, mbs: int,
                                                 zero: int, modules: str, shared: bool,
                                                 dense: bool, mtp: bool, tied: bool,
                                                 deepep: bool, fold: bool, sp: bool,
                                                 gather: bool, system: str, gpn: int,
                                                 fp8: bool, delay: bool, tpo: bool,
                                                 cp: int) -> None:
    """The merged pass costed piece by piece (``merged_pass``) lands on contention-free replay
    of the trace: MoE layers with shared experts, a dense first layer, an MTP module, tied
    embeddings, DeepEP, folded experts, selective recompute (the MoE side too), ZeRO 0-2 with
    overlapped parameter gathers (in FP8 on FP8 runs), BF16 or FP8 (its casts in the pieces),
    deferred weight gradients or not, TP overlap or not, context parallelism or not, 2 or 8
    GPUs a node (all-to-alls over the NICs or NVLink), κ of H100/A100 and none on B200."""
    model = dataclasses.replace(MOE, shared_expert_ffn_hidden_size=256 if shared else 0,
                                first_dense_layers=int(dense), mtp_layers=int(mtp),
                                tied_embeddings=tied)
    hw = get_system(system)
    hw = dataclasses.replace(hw, node=dataclasses.replace(hw.node, gpus_per_node=gpn))
    try:
        s = _strategy(tp=tp, dp=dp, cp=cp, ep=ep, micro_batch_size=mbs,
                      global_batch_size=mb * mbs * dp,
                      zero_stage=zero, recompute="selective" if modules else "none",
                      recompute_modules=modules or "core_attn", sequence_parallel=sp and tp > 1,
                      tp_comm_overlap=tpo and sp and tp > 1,
                      moe_dispatcher="deepep" if deepep else "alltoall",
                      expert_tp=1 if fold and tp > 1 else 0,
                      overlap_param_gather=gather and zero > 0,
                      precision="fp8" if fp8 else "bf16", fp8_param_gather=fp8 and zero > 0,
                      delay_wgrad_compute=delay)
        fast = estimate(model, s, hw).step_time_s
    except ConfigError:
        return
    assert fast == pytest.approx(_replayed(model, s, hw), rel=1e-3)


def test_a_moe_model_on_64_h100s_gains_what_its_all_to_alls_cost() -> None:
    """Qwen3-30B-A3B on 64 H100s (ep 8, the all-to-alls within a node; 16 micro-batches): the
    merged passes hide part of the all-to-alls — faster than 1F1B, never faster than with
    them free of cost; the fast path and replay of the representative traces agree."""
    model, hw = get_model("qwen3-30b-a3b"), get_system("dgx-h100")
    model = dataclasses.replace(model, num_layers=8)  # (a shorter stack, the same layers)
    s = _strategy(dp=64, ep=8, global_batch_size=1024, micro_batch_size=1)
    plain = dataclasses.replace(s, overlap_moe_ep_comm=False)
    merged_s, plain_s = (estimate(model, x, hw).step_time_s for x in (s, plain))
    assert merged_s < plain_s
    assert merged_s == pytest.approx(_replayed(model, s, hw), rel=1e-3)


@pytest.mark.parametrize("kw", [{}, dict(cp=2, dp=2, ep=2)])
def test_memory_holds_one_layer_more_than_1f1b(kw: dict[str, object]) -> None:
    """At layer pair k the next micro-batch's forward holds layers 0..k and the backward
    still holds 0..L−1−k: L + 1 layers, one more than 1F1B's one micro-batch; one
    micro-batch merges nothing. With context parallelism the layer is its share of the
    sequence's."""
    hw = get_system("dgx-h100")
    s = _strategy(**kw)
    plain = dataclasses.replace(s, overlap_moe_ep_comm=False)
    layer = activation_bytes_per_layer(MOE, s)
    more = (estimate(MOE, s, hw).peak_memory_GiB - estimate(MOE, plain, hw).peak_memory_GiB)
    assert more * 2**30 == pytest.approx(layer * (1 + FRAGMENTATION), rel=1e-9, abs=2)
    one = dataclasses.replace(s, global_batch_size=s.dp)
    assert estimate(MOE, one, hw).peak_memory_GiB == estimate(
        MOE, dataclasses.replace(one, overlap_moe_ep_comm=False), hw).peak_memory_GiB


def test_the_merged_order_pairs_layer_k_with_layer_l_minus_1_minus_k() -> None:
    """In a merged pass each layer's backward comes beside the forward of its mirror layer,
    and every all-to-all of a pair is issued off the compute chain (a compute node of the
    other pass runs between an all-to-all and the node that waits for it)."""
    s = _strategy(global_batch_size=8)  # two micro-batches: F0, merged (F1, B0), B1
    nodes = RoleProgram(MOE, s, 0).build()
    names = [n.name for n in nodes]
    first = {lbl: min(i for i, x in enumerate(names) if x.startswith(lbl))
             for lbl in [f"F1.c0.L{k}." for k in range(8)] + [f"B0.c0.L{k}." for k in range(8)]}
    for k in range(7):  # F1's layer k starts after B0's layer 7−k does, before B0's 6−k
        assert first[f"B0.c0.L{7 - k}."] < first[f"F1.c0.L{k}."] < first[f"B0.c0.L{6 - k}."]
    by_id = {n.id: n for n in nodes}
    a2a = [n for n in nodes if n.name.startswith(("F1.", "B0.")) and "moe_" in n.name
           and n.axis == "ep"]
    assert a2a
    for n in a2a:
        waiters = [m for m in nodes if n.id in m.data_deps]
        assert waiters and all(by_id[n.id].name.split(".")[0] == m.name.split(".")[0]
                               for m in waiters)
        assert all(names.index(m.name) > names.index(n.name) + 1 for m in waiters)


@pytest.mark.parametrize(("kw", "words"), [
    (dict(pp=2, dp=2), "needs schedule .interleaved_1f1b. with vpp > 1"),
    (dict(schedule="gpipe"), "it needs schedule '1f1b', got 'gpipe'"),
    (dict(ep=1), "needs ep > 1"),
    (dict(recompute="full"), "full recompute"),
    (dict(recompute="selective", recompute_modules="layernorm,moe"),
     "recompute module 'moe' .Megatron-Core refuses it"),
    (dict(zero_stage=3), "ZeRO-3"),
])
def test_what_it_is_not_modelled_with_is_named(kw: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        _strategy(**kw)


def test_a_dense_model_is_told_it_has_no_experts() -> None:
    dense = dataclasses.replace(MOE, num_experts=0, experts_per_token=0, moe_ffn_hidden_size=0)
    with pytest.raises(ConfigError, match="has no experts"):
        estimate(dense, _strategy(), get_system("dgx-h100"))


def test_deferred_weight_gradients_run_beside_the_all_to_all_after_their_data_gradients(
        ) -> None:
    """Hand-worked, κ 0: the experts' data gradients 40 ns then their dispatch's backward
    (50 ns), the experts' weight gradients 30 ns, then attention's backward (20 ns, waits for
    the all-to-all). Deferred: 0–40, the all-to-all 40–90 beside the weight gradients 40–70,
    attention 90–110. In place: 0–70, the all-to-all 70–120, attention 120–140: 30 ns more,
    the weight gradients' time."""
    deferred = MergedPieces((("B", ((40, 0),), 50), ("W", ((30, 0),), -1),
                             ("B", ((20, 0),), -1)), 3)
    in_place = MergedPieces((("B", ((70, 0),), 50), ("B", ((20, 0),), -1)), 2)
    assert run_pieces(deferred, 0.0) == (110, 110)
    assert run_pieces(in_place, 0.0) == (140, 140)


def test_deferred_weight_gradients_follow_the_backwards_next_all_to_all() -> None:
    """--delay-wgrad-compute in the trace, as ``TransformerLayerSchedulePlan.run`` orders it:
    each layer's experts' dispatch backward waits for their last data gradient and is issued
    before their weight gradients; attention's weight gradients come after the next layer's
    combine backward is issued; the router's stays in place. The step holds the same nodes
    as without merging, and replays no slower than merging without deferring."""
    s = _strategy(global_batch_size=8, delay_wgrad_compute=True)
    nodes = RoleProgram(MOE, s, 0).build()
    at = {n.name: i for i, n in enumerate(nodes)}
    for k in range(7, 0, -1):  # B0's layers in a merged pass
        layer = f"B0.c0.L{k}."
        dispatch = nodes[at[layer + "moe_dispatch_bwd"]]
        assert [nodes[d].name for d in dispatch.data_deps] == [layer + "expert_fc1_dgrad"]
        assert at[layer + "moe_dispatch_bwd"] < at[layer + "expert_fc2_wgrad"]
        assert at[f"B0.c0.L{k - 1}.moe_combine_bwd"] < at[layer + "qkv_wgrad"]
        assert at[layer + "router_dgrad"] < at[layer + "router_wgrad"] < at[layer + "ln2_bwd"]
    plain = RoleProgram(MOE, dataclasses.replace(s, delay_wgrad_compute=False), 0).build()
    assert sorted(at) == sorted(n.name for n in plain)
    ranks, deferred_s, unmerged_s = _against_unmerged(MOE, s)
    merged_s = _against_unmerged(MOE, dataclasses.replace(s, delay_wgrad_compute=False))[1]
    assert ranks and deferred_s <= merged_s < unmerged_s


def test_deferring_weight_gradients_needs_combined_1f1b() -> None:
    with pytest.raises(ConfigError, match=r"delay_wgrad_compute .* needs overlap_moe_ep_comm"):
        _strategy(overlap_moe_ep_comm=False, delay_wgrad_compute=True)


def test_more_than_one_mtp_module_is_refused_as_megatron_core_does() -> None:
    """Megatron-Core's TransformerConfig: "MTP layernum only supports 1 when enabling
    overlap_moe_expert_parallel_comm"."""
    two = dataclasses.replace(MOE, mtp_layers=2)
    with pytest.raises(ConfigError, match="at most one multi-token-prediction module"):
        estimate(two, _strategy(), get_system("dgx-h100"))
    assert estimate(dataclasses.replace(MOE, mtp_layers=1), _strategy(),
                    get_system("dgx-h100")).step_time_s > 0


def test_the_cli_flag_reaches_the_estimate_and_the_label(tmp_path: Path) -> None:
    args = ["estimate", "--model", "mixtral-8x7b", "--gpus", "64", "--ep", "8", "--mbs", "1",
            "--gbs", "256", "--zero", "1", "--system", "dgx-h100"]
    out = tmp_path / "e.json"
    got = CliRunner().invoke(app, [*args, "--overlap-moe-expert-parallel-comm", "--json",
                                   str(out)])
    assert got.exit_code == 0, got.stdout
    assert "a2ao" in got.stdout
    plain = CliRunner().invoke(app, args)
    step = [float(x.stdout.split("step time ")[1].split(" s")[0]) for x in (got, plain)]
    assert step[0] < step[1]
    # what such an estimate is worth is said with it (the published pairs' 2.4× and 1.5×
    # savings), and only with it
    said = [" ".join(x.stdout.split()) for x in (got, plain)]
    assert "2.4 and 1.5 times the measured one" in said[0] and "read the step time" in said[0]
    assert "combined 1F1B" not in said[1]
    # ... and the other end of the range beside it: the same strategy without merging
    unmerged = float(said[0].split("without the merged passes: step time ")[1].split(" s")[0])
    assert unmerged == pytest.approx(step[1], abs=1e-4)
    assert "without the merged passes" not in said[1]
    other = json.loads(out.read_text())["without_merged_passes"]
    assert other["step_time_s"] == pytest.approx(step[1], abs=1e-4)
    assert other["saved_at_most_s"] == pytest.approx(step[1] - step[0], abs=1e-3)


# ---- on an interleaved pipeline (combined_1f1b_schedule_for_interleaved_pipelining) ----------

PIPE = dataclasses.replace(MOE, num_layers=12)


@pytest.mark.parametrize(("m", "p", "v", "group"), [
    (4, 2, 2, 0), (2, 2, 3, 0), (6, 3, 2, 0), (8, 4, 2, 0), (5, 2, 2, 3), (12, 4, 3, 6)])
def test_the_interleaved_order_warms_one_forward_more_and_merges_each_steady_pair(
        m: int, p: int, v: int, group: int) -> None:
    """Megatron-Core's ``get_pp_rank_microbatches``: one warm-up forward more than the
    interleaved schedule's ((p − i − 1)·2 + (v − 1)·N + 1, at most m·v), run alone; then each
    steady forward merged with the backward the interleaved order runs after it — never of the
    same micro-batch (what the extra forward is for) —; then the cool-down alone, which holds
    every chunk's last backward. Every pass once; a stage whose warm-up holds every forward
    merges nothing."""
    for stage in range(p):
        order_id = f"interleaved_1f1b/{group}" if group else "interleaved_1f1b"
        units = combined(order_id + "+a2a", m=m, p=p, v=v, stage=stage)
        plain = stage_order(order_id, m=m, p=p, v=v, stage=stage)
        assert [x for u in units for x in u] == stage_order(order_id + "+a2a", m=m, p=p, v=v,
                                                            stage=stage)
        assert sorted(x for u in units for x in u) == sorted(plain)
        warm = min((p - stage - 1) * 2 + (v - 1) * (group or p) + 1, m * v)
        assert all(len(u) == 1 and u[0][0] == "F" for u in units[:warm])
        pairs = [u for u in units if len(u) == 2]
        assert len(pairs) == m * v - warm
        assert all(f[0] == "F" and b[0] == "B" and f[1] != b[1] for f, b in pairs)
        assert all(len(u) == 1 and u[0][0] == "B" for u in units[warm + len(pairs):])
        lasts = {("B", m - 1, ch) for ch in range(v)}
        assert lasts <= {u[0] for u in units[warm + len(pairs):]}


def test_a_merged_pass_whose_forward_input_comes_late_runs_the_backward_first() -> None:
    """Hand-worked, κ 0: B0 100 ns then its 50 ns all-to-all, F0 80 then 40, B1 30, F1 20.
    Both inputs there: B0 0–100, F0 100–180, B1 180–210, F's all-to-all 180–220, F1 220–240.
    The forward's input at 150: B0 still runs 0–100 and its all-to-all 100–150, F0 150–230,
    its all-to-all 230–270, B1 230–260, F1 270–290 — 50 ns later, not 150 (the sends go
    after F1: no head or embedding after the layers here)."""
    pieces = MergedPieces((("B", ((100, 0),), 50), ("F", ((80, 0),), 40),
                           ("B", ((30, 0),), -1), ("F", ((20, 0),), -1)), 4)
    assert run_pieces(pieces, 0.0) == (240, 240)
    assert run_pieces(pieces, 0.0, f_ready=150) == (290, 290)
    assert run_pieces(pieces, 0.0, b_ready=150) == (150 + 240, 150 + 240)  # B0 goes first


def _pipe(**kw: object) -> Strategy:
    return _strategy(**{**dict(pp=2, vpp=2, dp=2, ep=2, global_batch_size=8,
                               schedule="interleaved_1f1b"), **kw})


def test_a_pipelined_merged_trace_holds_the_interleaved_nodes_and_steps_faster() -> None:
    """pp 2 · vpp 2, four micro-batches: every rank's trace holds the interleaved trace's
    nodes (names, FLOPs, bytes; its sends and receives among them), ordered and linked
    otherwise, and replays faster."""
    ranks, merged_s, plain_s = _against_unmerged(PIPE, _pipe())
    assert len(ranks) == 2 and merged_s < plain_s
    assert all(any("send_grad" in n.name for n in nodes) for nodes in ranks)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pp=st.sampled_from([2, 3, 4]), vpp=st.sampled_from([2, 3, 4]),
       tp=st.sampled_from([1, 2]), dp=st.sampled_from([1, 2, 4]), ep=st.sampled_from([2, 4]),
       rounds=st.integers(1, 3), group=st.booleans(), zero=st.sampled_from([0, 1, 2]),
       gather=st.booleans(), shared=st.booleans(), dense=st.booleans(), mtp=st.booleans(),
       tied=st.booleans(), selective=st.booleans(),
       system=st.sampled_from(["dgx-h100", "dgx-b200", "dgx-a100-80gb"]),
       gpn=st.sampled_from([2, 8]), fp8=st.booleans(), delay=st.booleans(),
       tpo=st.booleans(), cp=st.sampled_from([1, 2]))
@example(pp=2, vpp=3, tp=2, dp=2, ep=2, rounds=1, group=False, zero=0, gather=False,
         shared=False, dense=False, mtp=False, tied=False, selective=False, system="dgx-h100",
         gpn=2, fp8=False, delay=False, tpo=False, cp=2)
def test_pipelined_fast_path_within_0_2_percent_of_replay(
        pp: int, vpp: int, tp: int, dp: int, ep: int, rounds: int, group: bool, zero: int,
        gather: bool, shared: bool, dense: bool, mtp: bool, tied: bool, selective: bool,
        system: str, gpn: int, fp8: bool, delay: bool, tpo: bool, cp: int) -> None:
    """The walk of the merged units (``merged_walk``: each merged pass costed piece by piece
    from each of its inputs' arrival, its sends after its layers) lands on contention-free
    replay of the pipelined traces:
    pp 2–4, vpp 2–4, micro-batch groups, the dense first layer, MTP, shared experts, tied
    embeddings, selective recompute, ZeRO 0–2 with overlapped parameter gathers, BF16 or FP8,
    deferred weight gradients or not, TP overlap or not, context parallelism or not,
    all-to-alls over NVLink or the NICs, κ of H100/A100 and none on B200. (The example: an
    exploratory draw 0.29% short until the cool-down walk slowed a MoE pass beside the two
    gradient lanes kernel by kernel, ``dp_tails._slowed_pass``.)"""
    model = dataclasses.replace(PIPE, shared_expert_ffn_hidden_size=256 if shared else 0,
                                first_dense_layers=int(dense), mtp_layers=int(mtp),
                                tied_embeddings=tied)
    hw = get_system(system)
    hw = dataclasses.replace(hw, node=dataclasses.replace(hw.node, gpus_per_node=gpn))
    m = rounds * pp
    try:
        s = _pipe(pp=pp, vpp=vpp, tp=tp, dp=dp, cp=cp, ep=ep, global_batch_size=m * dp,
                  microbatch_group_size=pp + 1 if group and m > pp else 0, zero_stage=zero,
                  overlap_param_gather=gather and zero > 0, sequence_parallel=tp > 1,
                  tp_comm_overlap=tpo and tp > 1,
                  recompute="selective" if selective else "none",
                  precision="fp8" if fp8 else "bf16", delay_wgrad_compute=delay)
        fast = estimate(model, s, hw).step_time_s
    except ConfigError:
        return
    # with TP overlap the interleaved walk alone, merging nothing, is up to 0.19% off replay
    # (pp 3, vpp 4, m = p, A100 over the NICs), and the merged walk inherits that
    assert fast == pytest.approx(_replayed(model, s, hw), rel=3e-3 if tpo and tp > 1 else 2e-3)


def test_pipelined_memory_holds_one_layer_more_where_a_stage_merges() -> None:
    """A stage that merges holds the interleaved peak's virtual micro-batches (its warm-up,
    one more than the interleaved one's, is the same count) and, inside a merged pass, one
    layer more; a stage whose warm-up holds every forward merges nothing and holds the
    same."""
    s = _pipe(pp=2, vpp=3, global_batch_size=4)  # m = 2: stage 0 all warm-up, stage 1 merges
    plain = dataclasses.replace(s, overlap_moe_ep_comm=False)
    layer = activation_bytes_per_layer(PIPE, s)
    got = [memory_estimate(PIPE, s, st, 10**6).activations_bytes - memory_estimate(
        PIPE, plain, st, 10**6).activations_bytes for st in range(2)]
    assert got == [0, layer]


def test_a_pipeline_of_plain_1f1b_is_told_to_interleave() -> None:
    with pytest.raises(ConfigError, match="needs schedule 'interleaved_1f1b' with vpp > 1"):
        _pipe(vpp=1, schedule="1f1b")


def test_the_bound_note_is_said_once_where_any_strategy_merges(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A study's strategies (``compare``) or its searched values (``sweep``): the note once if
    any runs combined 1F1B, nothing if none does."""
    from analysis.cli_common import note_combined_1f1b

    note_combined_1f1b(iter([False, True, True]))
    assert capsys.readouterr().out.count("note: merged passes") == 1
    note_combined_1f1b([False])
    note_combined_1f1b([])
    assert capsys.readouterr().out == ""


def test_a_searched_space_says_it_once_its_values_checked_first(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``sweep`` and ``scale``: the note where the space searches combined 1F1B; a malformed
    dimension refused with its own message before any note."""
    from analysis.cli_study import _note_space
    from analysis.study import load_study
    from tests.studies import write_study

    study = load_study(write_study(tmp_path / "s", strategies=False, failures=False,
                                   search=True))
    _note_space(dataclasses.replace(study, search={**study.search,
                                                   "overlap_moe_ep_comm": [False, True]}))
    assert capsys.readouterr().out.count("note: merged passes") == 1
    _note_space(study)
    assert capsys.readouterr().out == ""
    with pytest.raises(ConfigError, match="must each be a non-empty list"):
        _note_space(dataclasses.replace(study, search={"overlap_moe_ep_comm": "true"}))
    assert capsys.readouterr().out == ""
