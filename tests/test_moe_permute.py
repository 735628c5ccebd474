"""The token permutations of a MoE layer (Megatron-Core's token dispatchers): where they run
around the dispatch and combine, the bytes each moves, and their backward."""

from __future__ import annotations

import pytest

from tests.test_deepep import MOE
from tracegen import Strategy
from tracegen.ops import PERMUTATIONS, layer_bwd, layer_fwd
from tracegen.routing import Route, expected_units

H, K = MOE.hidden_size, MOE.experts_per_token
TOKENS = MOE.seq_len  # micro-batch 1, tp 1


def _moe_names(items: list) -> list[str]:
    names = [it.name for it in items]
    return names[names.index("router") + 1:names.index("resid2")]


def test_the_all_to_all_dispatcher_permutes_sorts_and_undoes_both() -> None:
    """Permutation 1 before the all-to-all, the sort by local expert after it (8 experts per
    rank at ep 8), both undone around the combine."""
    names = _moe_names(layer_fwd(MOE, Strategy(dp=8, ep=8, global_batch_size=8)))
    assert names == ["moe_permute", "moe_dispatch", "moe_sort", "expert_fc1", "expert_act",
                     "expert_fc2", "moe_unsort", "moe_combine", "moe_unpermute"]


def test_one_expert_per_rank_needs_no_sort() -> None:
    names = _moe_names(layer_fwd(MOE, Strategy(dp=64, ep=64, global_batch_size=64)))
    assert "moe_sort" not in names and "moe_unsort" not in names
    assert names[0] == "moe_permute" and names[-1] == "moe_unpermute"


def test_deepep_permutes_on_the_expert_side() -> None:
    """The flex dispatcher hands DeepEP the tokens as they are, permutes what arrived into
    per-expert copies and sums them back before the combine."""
    names = _moe_names(layer_fwd(MOE, Strategy(dp=8, ep=8, global_batch_size=8,
                                               moe_dispatcher="deepep")))
    assert names == ["moe_dispatch", "moe_permute", "expert_fc1", "expert_act", "expert_fc2",
                     "moe_unpermute", "moe_combine"]


@pytest.mark.parametrize("disp", ["alltoall", "deepep"])
def test_each_pass_moves_its_rows(disp: str) -> None:
    """A permutation reads and writes the k copies of every token (2 bytes an element); the
    weighted sum reads the copies and writes a row per token (all-to-all) or per token and
    destination GPU (DeepEP); the backward moves the same bytes back."""
    s = Strategy(dp=8, ep=8, global_batch_size=8, moe_dispatcher=disp)  # type: ignore[arg-type]
    fwd = {it.name: it for it in layer_fwd(MOE, s)}
    copies = TOKENS * K * H * 2
    assert fwd["moe_permute"].bytes == 2 * copies
    rows = TOKENS * (expected_units(Route(8, 64, 8, 4), 8) if disp == "deepep" else 1)
    assert fwd["moe_unpermute"].bytes == pytest.approx(copies + rows * H * 2, abs=H * 2)
    bwd = {it.name: it for it in layer_bwd(MOE, s)}
    for name in PERMUTATIONS & set(fwd):
        assert bwd[f"{name}_bwd"].bytes == fwd[name].bytes


# ---- Megatron-Core's "moe" recompute module: the whole MoE layer again ----------------------

def test_the_moe_module_reruns_the_layers_mlp_side_with_its_dispatch() -> None:
    """Router, permutations, dispatch, experts and combine run again before the backward (the
    checkpointed MoELayer holds its all-to-alls); ``moe_act`` beside it adds nothing."""
    from tracegen.program import RoleProgram

    s = Strategy(dp=8, ep=8, global_batch_size=8, recompute="selective",
                 recompute_modules="moe,moe_act")
    names = [it.name for it in RoleProgram(MOE, s, 0).selective_items(s.selective_modules)]
    assert names == ["router", *_moe_names(layer_fwd(MOE, s))]


def test_the_moe_module_drops_the_layers_expert_activations() -> None:
    """Per token: the k dispatched copies (2h each), the experts' FC1 outputs (2·2f each, gated)
    and activation outputs (2f), against selective recompute of the core attention alone."""
    from tracegen.memory import activation_bytes_per_layer

    base = Strategy(dp=8, ep=8, global_batch_size=8, recompute="selective")
    moe = Strategy(dp=8, ep=8, global_batch_size=8, recompute="selective",
                   recompute_modules="core_attn,moe")
    f = MOE.moe_ffn_hidden_size * K
    dropped = K * H * 2 + 2 * 2 * f + 2 * f
    got = activation_bytes_per_layer(MOE, base) - activation_bytes_per_layer(MOE, moe)
    assert got == pytest.approx(TOKENS * dropped, abs=1)


@pytest.mark.parametrize("kw", [dict(dp=8, ep=8), dict(tp=2, dp=4, ep=8, expert_tp=1,
                                                        sequence_parallel=True),
                                dict(dp=8, ep=4, moe_dispatcher="deepep"),
                                dict(tp=2, dp=4, ep=2, sequence_parallel=True)])
def test_fast_path_equals_replay_recomputing_moe_layers(kw: dict) -> None:
    from analysis.fastpath import estimate
    from replay import get_system
    from tests.conftest import replayed

    hw = get_system("dgx-h100")
    s = Strategy(**{**dict(pp=2, global_batch_size=16, recompute="selective",
                           recompute_modules="layernorm,moe"), **kw})  # type: ignore[arg-type]
    ref = replayed(MOE, s, hw).step_time_s
    assert estimate(MOE, s, hw).step_time_s == pytest.approx(ref, rel=0.005)


def test_hfu_counts_the_recomputed_moe_layers() -> None:
    """2 FLOPs per weight per token through the k experts (3 matrices each, gated) and the
    router, every layer."""
    from tracegen.flops import recompute_flop_per_step

    extra = recompute_flop_per_step(MOE, 2, "selective", modules=("moe",))
    assert extra == 2 * 2 * TOKENS * MOE.num_layers * H * (
        3 * K * MOE.moe_ffn_hidden_size + MOE.num_experts)


def test_the_moe_module_needs_a_moe_model() -> None:
    from tracegen import ConfigError, get_model
    from tracegen.fit import check_fits_model

    with pytest.raises(ConfigError, match="'moe' recomputes a mixture-of-experts layer"):
        check_fits_model(Strategy(recompute="selective", recompute_modules="moe"),
                         get_model("llama3-8b"))


# ---- uneven routing: ModelSpec.moe_load_imbalance ------------------------------------------

def test_an_uneven_load_scales_what_the_busiest_rank_receives_and_computes() -> None:
    """At 1.5× the mean the rank's dispatch and combine, expert GEMMs, activation and sorting
    passes carry 1.5× the copies; permuting its own tokens does not change."""
    import dataclasses

    s = Strategy(dp=8, ep=8, global_batch_size=8)
    even = {it.name: it for it in layer_fwd(MOE, s)}
    heavy = {it.name: it for it in layer_fwd(
        dataclasses.replace(MOE, moe_load_imbalance=1.5), s)}
    for name in ("moe_dispatch", "moe_combine"):
        assert heavy[name].size_bytes == 1.5 * even[name].size_bytes
    for name in ("expert_fc1", "expert_fc2", "expert_act", "moe_sort", "moe_unsort"):
        assert heavy[name].flop == pytest.approx(1.5 * even[name].flop, rel=1e-9) and (
            heavy[name].bytes >= even[name].bytes)
    assert heavy["expert_fc1"].m == 1.5 * even["expert_fc1"].m
    for name in ("moe_permute", "moe_unpermute", "router"):
        assert heavy[name] == even[name]


def test_an_uneven_load_slows_the_step_and_keeps_more_copies() -> None:
    """Replay and the fast path agree; memory holds 1.5× the dispatched copies and expert
    activations; a load below the mean is refused."""
    import dataclasses

    from analysis.fastpath import estimate
    from replay import get_system
    from tests.conftest import replayed
    from tracegen import ConfigError
    from tracegen.memory import activation_bytes_per_layer

    hw = get_system("dgx-h100")
    heavy = dataclasses.replace(MOE, moe_load_imbalance=1.5)
    s = Strategy(pp=2, dp=8, ep=8, global_batch_size=16)
    ref = replayed(heavy, s, hw).step_time_s
    assert estimate(heavy, s, hw).step_time_s == pytest.approx(ref, rel=0.005)
    assert ref > replayed(MOE, s, hw).step_time_s
    f = MOE.moe_ffn_hidden_size * K
    extra = 0.5 * (K * H * 2 + 2 * 2 * f + 2 * f)  # copies, FC1 out (gated), activation out
    got = activation_bytes_per_layer(heavy, s) - activation_bytes_per_layer(MOE, s)
    assert got == pytest.approx(TOKENS * extra, abs=1)
    with pytest.raises(ConfigError, match="moe_load_imbalance is the busiest rank's load"):
        dataclasses.replace(MOE, moe_load_imbalance=0.8)


# ---- token dropping: ModelSpec.moe_capacity_factor / moe_pad_to_capacity --------------------

@pytest.mark.parametrize(("imbalance", "capacity", "pad", "load"), [
    (1.5, 1.2, False, 1.2),   # dropped beyond capacity: the capacity binds
    (1.5, 2.0, False, 1.5),   # capacity above the load: nothing dropped on the busiest rank
    (1.0, 0.8, False, 0.8),   # below 1: tokens dropped even when balanced
    (1.0, 1.25, True, 1.25),  # padded: every expert runs its capacity
    (1.5, 1.25, True, 1.25),
])
def test_capacity_caps_or_pads_what_the_busiest_rank_runs(imbalance: float, capacity: float,
                                                          pad: bool, load: float) -> None:
    """Megatron-Core's capacity factor: an expert takes at most its balanced share times the
    factor (the rest dropped), or exactly that with its input padded; the dispatch, combine and
    expert work scale by the load that results, the rank's own permutation does not."""
    import dataclasses

    s = Strategy(dp=8, ep=8, global_batch_size=8)
    even = {it.name: it for it in layer_fwd(MOE, s)}
    m = dataclasses.replace(MOE, moe_load_imbalance=imbalance, moe_capacity_factor=capacity,
                            moe_pad_to_capacity=pad)
    assert m.moe_busiest_load == load
    got = {it.name: it for it in layer_fwd(m, s)}
    # (copies are whole: the load times the copies, rounded)
    assert got["moe_dispatch"].size_bytes == pytest.approx(
        load * even["moe_dispatch"].size_bytes, rel=1e-4)
    assert got["expert_fc1"].flop == pytest.approx(load * even["expert_fc1"].flop, rel=1e-4)
    assert got["moe_permute"] == even["moe_permute"]


def test_capacity_settings_that_cannot_run_are_refused() -> None:
    import dataclasses

    from tracegen import ConfigError, get_model
    from tracegen.fit import check_fits_model

    with pytest.raises(ConfigError, match="moe_capacity_factor must be ≥ 0"):
        dataclasses.replace(MOE, moe_capacity_factor=-1.0)
    with pytest.raises(ConfigError, match="set moe_capacity_factor > 0 with it"):
        dataclasses.replace(MOE, moe_pad_to_capacity=True)
    with pytest.raises(ConfigError, match="num_experts is 0"):
        dataclasses.replace(get_model("llama3-8b"), moe_capacity_factor=1.0)
    padded = dataclasses.replace(MOE, moe_capacity_factor=1.0, moe_pad_to_capacity=True)
    with pytest.raises(ConfigError, match="flex dispatcher does not pad"):
        check_fits_model(Strategy(dp=8, ep=8, global_batch_size=8, moe_dispatcher="deepep"),
                         padded)


@pytest.mark.parametrize(("overrides", "said"), [
    ({"model.moe_load_imbalance": 1.2}, "moe_load_imbalance not applied"),
    ({"model.moe_capacity_factor": 1.5, "model.moe_pad_to_capacity": True},
     "moe_capacity_factor, moe_pad_to_capacity not applied"),
])
def test_validate_takes_routing_overrides_for_the_moe_rows_only(overrides: dict[str, object],
                                                                 said: str) -> None:
    """An uneven load or a padded capacity set for a whole file slows its MoE rows; its dense
    rows are predicted as before, saying the override had nothing to apply to."""
    from pathlib import Path

    from analysis.validate import validate

    mixed = Path(__file__).resolve().parent / "data" / "megatron_bridge_h100_runs.csv"
    even = validate(mixed, fast=True)
    heavy = validate(mixed, fast=True, overrides=overrides)
    assert (heavy["status"] == "ok").all()
    moe = heavy["id"].str.contains("qwen3")
    assert (heavy.filter(moe)["predicted_iter_time_s"]
            > even.filter(moe)["predicted_iter_time_s"]).all()
    assert heavy.filter(~moe)["predicted_iter_time_s"].equals(
        even.filter(~moe)["predicted_iter_time_s"])
    assert heavy.filter(~moe)["assumptions"].str.contains(said).all()
