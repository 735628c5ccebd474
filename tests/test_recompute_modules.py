"""Selective recompute of named modules (``Strategy.recompute_modules``, Megatron-Core's
``--recompute-modules``): the trace re-runs exactly those modules' forward ops, the memory model
drops exactly their activation terms (Korthikanti et al. 2022 §4.1 inventory), the fast path
agrees with replay, HFU counts the recomputed matrix FLOPs, and bad combinations are refused."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from pathlib import Path

import pytest

from analysis.fastpath import estimate
from analysis.glance import fit_by_recompute, fit_hint_words
from replay import get_system
from tests.conftest import read_et, replayed
from tests.studies import enumerated
from tracegen import ConfigError, ModelSpec, Strategy, generate, get_model
from tracegen.fit import check_fits_model
from tracegen.flops import model_flop_per_step, recompute_flop_per_step
from tracegen.memory import activation_bytes_per_layer

MODEL = ModelSpec(name="rcm", num_layers=8, hidden_size=256, num_attention_heads=8,
                  num_kv_heads=4, ffn_hidden_size=512, vocab_size=1024, seq_len=256,
                  activation="swiglu")
MOE = dataclasses.replace(MODEL, name="rcm-moe", num_experts=4, experts_per_token=2,
                          moe_ffn_hidden_size=256)
SYSTEM = get_system("dgx-h100")


def _sel(modules: str, **kw: object) -> Strategy:
    base: dict[str, object] = dict(tp=2, pp=2, dp=2, global_batch_size=8,
                                   sequence_parallel=True, dp_bucket_params=200_000)
    return Strategy(recompute="selective", recompute_modules=modules,  # type: ignore[arg-type]
                    **{**base, **kw})


def _recompute_ops(trace_dir: Path) -> Counter[str]:
    """Op names in one rank's recompute phase for layer 0 (nodes ``….L0.rc.<op>…``)."""
    _, nodes = read_et(next(iter(sorted(trace_dir.glob("*.0.et")))))
    return Counter(hit.group(1) for n in nodes
                   if (hit := re.search(r"\.L0\.rc\.([a-z0-9_]+)", n.name)) is not None)


@pytest.mark.parametrize(("modules", "ops"), [
    ("core_attn", {"flash_attn"}),
    ("layernorm", {"ln1", "ln2"}),
    ("mlp", {"ln2_ag", "fc1", "act", "fc2", "fc2_rs"}),
    ("mlp,layernorm,core_attn", {"ln1", "ln2", "flash_attn", "ln2_ag", "fc1", "act", "fc2",
                                 "fc2_rs"}),
])
def test_the_trace_recomputes_the_named_modules(modules: str, ops: set[str],
                                                tmp_path: Path) -> None:
    """Each recomputed op once per micro-batch, the MLP with its sequence-parallel gather and
    reduce-scatter (Megatron-Core checkpoints the module with its TP collectives)."""
    s = _sel(modules)
    generate(MODEL, s, tmp_path, mode="representative")
    got = _recompute_ops(tmp_path)
    assert set(got) == ops
    assert set(got.values()) == {s.num_microbatches}


def test_the_experts_activation_is_recomputed_on_a_moe_model(tmp_path: Path) -> None:
    generate(MOE, _sel("moe_act"), tmp_path, mode="representative")
    assert set(_recompute_ops(tmp_path)) == {"expert_act"}


GPT = get_model("gpt3-175b")


@pytest.mark.parametrize("t", [1, 8])
@pytest.mark.parametrize(("modules", "replicated", "split", "scores"), [
    # Korthikanti's 10 + 24/t (+ 5as/h per t without flash attention, unless core_attn)
    ("core_attn", 10, 24, False),
    ("layernorm", 6, 24, True),  # the QKV and FC1 inputs (LN outputs): 2·2 bytes
    ("mlp", 10, 8, True),  # FC1 out 8 and GeLU out 8 (ffn 4h, 2 bytes)
    ("core_attn,mlp", 10, 8, False),
    ("layernorm,core_attn,mlp", 6, 8, False),
])
@pytest.mark.parametrize("sp", [False, True])
def test_activation_terms_of_the_recomputed_modules(t: int, modules: str, replicated: int,
                                                    split: int, scores: bool, sp: bool) -> None:
    """GPT-3 175B shapes, standard attention (the score term is visible): what each module
    rebuilds leaves its terms, in closed form."""
    sp = sp and t > 1
    s = Strategy(tp=t, sequence_parallel=sp, recompute="selective", recompute_modules=modules)
    seq, h, a = GPT.seq_len, GPT.hidden_size, GPT.num_attention_heads
    sbh = seq * h
    per = (replicated + split) / t if sp else replicated + split / t
    expected = sbh * (per + (5 * a * seq / (h * t) if scores else 0))
    assert activation_bytes_per_layer(GPT, s, flash_attention=False) == pytest.approx(
        expected, rel=1e-9)


@pytest.mark.parametrize(("model", "modules"), [
    (MODEL, "core_attn"), (MODEL, "layernorm"), (MODEL, "mlp"), (MODEL, "core_attn,mlp"),
    (MODEL, "layernorm,core_attn,mlp"), (MOE, "moe_act"), (MOE, "core_attn,moe_act"),
])
@pytest.mark.parametrize("kw", [dict(), dict(tp_comm_overlap=True),
                                dict(vpp=2, schedule="interleaved_1f1b"),
                                dict(precision="fp8")])
def test_fast_path_equals_replay_and_hfu_counts_the_recomputed_gemms(
        model: ModelSpec, modules: str, kw: dict) -> None:
    s = _sel(modules, **kw)
    ref = replayed(model, s, SYSTEM)
    fast = estimate(model, s, SYSTEM)
    assert fast.step_time_s == pytest.approx(ref.step_time_s, rel=0.005)
    extra = recompute_flop_per_step(model, s.global_batch_size, "selective",
                                    modules=s.selective_modules)
    assert ref.metrics["hfu"] == pytest.approx(
        ref.metrics["mfu"] * (1 + extra / model_flop_per_step(model, s.global_batch_size)),
        rel=1e-9)
    # HFU's extra: the core attention's 4·B·s²·q·l and the dense MLP's forward GEMMs
    b, seq, n_l = s.global_batch_size, model.seq_len, model.num_layers
    want = (4 * b * seq * seq * model.q_size * n_l if "core_attn" in modules else 0) + (
        2 * b * seq * n_l * 3 * model.hidden_size * model.ffn_hidden_size if "mlp" in modules
        else 0)
    assert extra == want


def test_more_modules_trade_memory_for_time() -> None:
    """On a real size (Llama 3 70B, 1,024 H100s, micro-batch 4): each module added runs more,
    and the norms and the MLP keep less; the core attention keeps nothing more under
    FlashAttention (no score matrix), so recomputing it only costs time. Selective of
    everything still keeps more than full recompute."""
    m = get_model("llama3-70b")
    base = dict(tp=8, pp=4, dp=32, sequence_parallel=True, micro_batch_size=4,
                global_batch_size=1024, zero_stage=1)
    ladder = [Strategy(**base),  # type: ignore[arg-type]
              *(Strategy(recompute="selective", recompute_modules=mods, **base)  # type: ignore
                for mods in ("layernorm", "layernorm,mlp", "layernorm,core_attn,mlp"))]
    got = [estimate(m, s, SYSTEM) for s in ladder]
    mems = [g.peak_memory_GiB for g in got]
    times = [g.step_time_s for g in got]
    assert mems[0] > mems[1] > mems[2] == mems[3]
    assert times == sorted(times) and len(set(times)) == len(times)
    full = estimate(m, Strategy(recompute="full", **base), SYSTEM)  # type: ignore[arg-type]
    assert full.peak_memory_GiB < mems[-1]


def test_the_fit_hint_is_the_fastest_fitting_recompute_modules_included() -> None:
    """The hint weighs selective recompute of the MLP beside full recompute of the first N
    layers and takes the fastest that fits (here, as on every preset layout tried, full
    recompute of some layers: the MLP is two thirds of a layer's forward for ~60% of its
    activations); a selective hint is said with the flags and fields that ask for it."""
    m = get_model("llama3-70b")
    s = Strategy(tp=8, pp=4, dp=32, sequence_parallel=True, micro_batch_size=4,
                 global_batch_size=1024, zero_stage=1)
    got = fit_by_recompute(m, s, SYSTEM)
    assert got is not None
    mlp = dataclasses.replace(s, recompute="selective", recompute_modules="core_attn,mlp")
    options = [mlp, *(dataclasses.replace(s, recompute="full", recompute_num_layers=n)
                      for n in range(1, 20)), dataclasses.replace(s, recompute="full")]
    fitting = [(o, e) for o in options if (e := estimate(m, o, SYSTEM)).fits]
    assert estimate(m, mlp, SYSTEM).fits  # the MLP option was in the race
    assert got[1].step_time_s == min(e.step_time_s for _, e in fitting)
    assert (got[0].recompute, got[0].recompute_num_layers) == ("full", 6)
    words, flags, fields = fit_hint_words({"recompute": "selective", "recompute_num_layers": 0,
                                           "recompute_modules": "core_attn,mlp"})
    assert words == "selective recompute of core_attn, mlp"
    assert flags == "--recompute selective --recompute-modules core_attn,mlp"
    assert fields == 'recompute = "selective", recompute_modules = "core_attn,mlp"'


@pytest.mark.parametrize(("kw", "message"), [
    (dict(recompute="selective", recompute_modules="mlp,attention"),
     "name modules among layernorm, mla_up_proj, core_attn, mlp, moe, moe_act"),
    (dict(recompute="selective", recompute_modules=""), "name modules among"),
    (dict(recompute="full", recompute_modules="mlp"), "needs recompute 'selective'"),
    (dict(recompute="none", recompute_modules="core_attn,mlp"), "needs recompute 'selective'"),
])
def test_bad_module_lists_are_refused(kw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        Strategy(**kw)  # type: ignore[arg-type]


def test_modules_must_exist_in_the_model_and_are_kept_in_layer_order() -> None:
    with pytest.raises(ConfigError, match="'mlp' recomputes a dense MLP"):
        check_fits_model(_sel("mlp", tp=1, sequence_parallel=False), MOE)
    with pytest.raises(ConfigError, match="'moe_act' needs a mixture-of-experts model"):
        check_fits_model(_sel("moe_act", tp=1, sequence_parallel=False), MODEL)
    assert _sel(" mlp,core_attn,layernorm").recompute_modules == "layernorm,core_attn,mlp"
    assert _sel("mlp,core_attn") == _sel("core_attn,mlp")


def test_a_sweep_searches_the_recomputed_modules(tmp_path: Path) -> None:
    """A module list is a search dimension; it pairs only with selective recompute."""
    valid, invalid = enumerated(
        tmp_path, 'model = "llama3-70b"\nsystem = "dgx-h100"\ngpus = 64\n'
        'global_batch_size = 64\n[search]\ntp = [8]\npp = [4]\nvpp = [1]\n'
        'micro_batch_size = [1]\nrecompute = ["none", "selective"]\nzero_stage = [1]\n'
        'sequence_parallel = [true]\n'
        'recompute_modules = ["core_attn", "core_attn,mlp", "mlp,layernorm"]\n')
    assert sorted((s.recompute, s.recompute_modules) for s in valid) == [
        ("none", "core_attn"), ("selective", "core_attn"), ("selective", "core_attn,mlp"),
        ("selective", "layernorm,mlp")]
    assert invalid == 0  # a module list without selective recompute: taken as the default


def test_the_fit_hint_keeps_the_modules_a_strategy_already_recomputes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A strategy recomputing the norms that does not fit is offered the norms plus the core
    attention and the MLP — never a set without the norms (its optimizer offloaded instead
    keeps the norms it recomputes too)."""
    import analysis.glance as G

    m = get_model("llama3-70b")
    s = Strategy(tp=8, pp=4, dp=32, sequence_parallel=True, micro_batch_size=4,
                 global_batch_size=1024, zero_stage=1, recompute="selective",
                 recompute_modules="layernorm")
    tried: list[str] = []

    def spy(model: ModelSpec, strategy: Strategy, system: object) -> object:
        if strategy.recompute == "selective":
            (offloaded if strategy.optimizer_offload_fraction else tried).append(
                strategy.recompute_modules)
        return estimate(model, strategy, system)  # type: ignore[arg-type]

    offloaded: list[str] = []
    monkeypatch.setattr(G, "estimate", spy)
    G.fit_by_recompute(m, s, SYSTEM)
    assert tried == ["layernorm,core_attn", "layernorm,core_attn,mlp"]
    assert offloaded and set(offloaded) == {"layernorm"}

