"""Full recompute of only the first N layers of each model chunk (``Strategy.
recompute_num_layers``, Megatron's ``--recompute-method block --recompute-num-layers N``): the
trace recomputes exactly those layers, the memory model keeps every other layer's activations,
the fast path agrees with replay, and HFU counts their share of the recomputed forward."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from analysis.fastpath import estimate
from analysis.glance import glance
from analysis.study import load_study
from analysis.sweep import enumerate_space
from replay import get_system
from tests.conftest import read_et, replayed
from tracegen import ConfigError, ModelSpec, Strategy, generate
from tracegen.flops import model_flop_per_step, recompute_flop_per_step
from tracegen.memory import activation_bytes_per_layer, inflight_microbatches

MODEL = ModelSpec(name="rc", num_layers=8, hidden_size=256, num_attention_heads=8,
                  num_kv_heads=4, ffn_hidden_size=512, vocab_size=1024, seq_len=256,
                  activation="swiglu")
SYSTEM = get_system("dgx-h100")


def _full(n: int, **kw: object) -> Strategy:
    base: dict[str, object] = dict(pp=2, dp=2, global_batch_size=8, recompute="full",
                                   dp_bucket_params=200_000)
    return Strategy(recompute_num_layers=n, **{**base, **kw})  # type: ignore[arg-type]


def _recomputed_layers(trace_dir: Path) -> dict[int, set[int]]:
    """Per pipeline stage, the layers whose recompute ops its ranks' traces hold (node names
    ``….L<i>.rc…``)."""
    manifest = json.loads((trace_dir / "manifest.json").read_text())
    pp_at = manifest["coords_order"].index("pp")
    stage_of = {c[0]: c[pp_at] for c in manifest["coords"]}
    out: dict[int, set[int]] = {}
    for path in sorted(trace_dir.glob("*.et")):
        _, nodes = read_et(path)
        layers = out.setdefault(stage_of[int(path.name.split(".")[-2])], set())
        layers |= {int(hit.group(1)) for n in nodes
                   if (hit := re.search(r"\.L(\d+)\.rc", n.name)) is not None}
    return out


@pytest.mark.parametrize(("kw", "n", "expected"), [
    (dict(), 1, {0: {0}, 1: {4}}),  # 4 layers a stage: the first of each
    (dict(), 3, {0: {0, 1, 2}, 1: {4, 5, 6}}),
    (dict(), 4, {0: {0, 1, 2, 3}, 1: {4, 5, 6, 7}}),  # N ≥ the chunk: every layer
    (dict(vpp=2, schedule="interleaved_1f1b"), 1, {0: {0, 4}, 1: {2, 6}}),  # per virtual stage
])
def test_the_trace_recomputes_the_first_layers_of_each_chunk(kw: dict, n: int,
                                                             expected: dict[int, set[int]],
                                                             tmp_path: Path) -> None:
    generate(MODEL, _full(n, **kw), tmp_path, mode="representative")
    assert _recomputed_layers(tmp_path) == expected


@pytest.mark.parametrize("kw", [dict(), dict(vpp=2, schedule="interleaved_1f1b"),
                                dict(pp=4, global_batch_size=16, first_stage_layers=1,
                                     last_stage_layers=1)])
def test_stored_layers_keep_every_activation(kw: dict) -> None:
    """Per stage: (recomputed layers × the full-recompute checkpoint + stored layers × what no
    recompute keeps) × the micro-batches in flight; N = 0 and N ≥ a chunk are full recompute."""
    for n in range(0, 6):
        s = _full(n, **kw)
        full = _full(0, **kw)
        keep = Strategy(**{**{f: getattr(full, f) for f in ("pp", "dp", "vpp", "schedule",
                                                            "global_batch_size",
                                                            "first_stage_layers",
                                                            "last_stage_layers")}})
        for stage in range(s.pp):
            layers = s.stage_layers(MODEL.num_layers, stage)
            stored = sum(max(0, len(s.chunk_layers(MODEL.num_layers, c * s.pp + stage)) - n)
                         for c in range(s.vpp)) if n else 0
            g = glance(MODEL, s, SYSTEM).stages[stage].memory
            expect = int((activation_bytes_per_layer(MODEL, full) * (layers - stored)
                          + activation_bytes_per_layer(MODEL, keep) * stored)
                         * inflight_microbatches(s, stage))
            assert g.activations_bytes == expect
            assert s.stored_layers(MODEL.num_layers, stage) == stored


@pytest.mark.parametrize("kw", [dict(), dict(vpp=2, schedule="interleaved_1f1b"),
                                dict(pp=1, dp=4, zero_stage=3),
                                dict(zero_stage=1, overlap_param_gather=True),
                                dict(pp=4, global_batch_size=16, first_stage_layers=1,
                                     last_stage_layers=1)])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_fast_path_equals_replay_with_some_layers_recomputed(kw: dict, n: int) -> None:
    s = _full(n, **kw)
    ref = replayed(MODEL, s, SYSTEM)
    fast = estimate(MODEL, s, SYSTEM)
    assert fast.step_time_s == pytest.approx(ref.step_time_s, rel=0.005)
    # fewer layers recomputed: no slower than recomputing all, no faster than none
    none = Strategy(**{**{k: v for k, v in s.to_dict().items()
                          if k not in ("recompute", "recompute_num_layers")}})
    assert estimate(MODEL, none, SYSTEM).step_time_s <= fast.step_time_s <= estimate(
        MODEL, _full(0, **kw), SYSTEM).step_time_s
    # HFU: the recomputed share of the extra forward
    rc = s.recomputed_layers(MODEL.num_layers)
    assert ref.metrics["hfu"] == pytest.approx(ref.metrics["mfu"] * (1 + recompute_flop_per_step(
        MODEL, s.global_batch_size, "full", rc) / _model_flop(s)), rel=1e-9)


def _model_flop(s: Strategy) -> int:
    return model_flop_per_step(MODEL, s.global_batch_size)


@pytest.mark.parametrize(("kw", "message"), [
    (dict(recompute="selective", recompute_num_layers=2),
     "recompute_num_layers 2 needs recompute 'full'"),
    (dict(recompute="full", recompute_num_layers=-1), "recompute_num_layers -1 needs"),
])
def test_recompute_num_layers_without_full_recompute_is_refused(kw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        Strategy(**kw)  # type: ignore[arg-type]


def test_a_sweep_searches_the_recomputed_layers(tmp_path: Path) -> None:
    study = tmp_path / "s.toml"
    study.write_text('model = "llama3-70b"\nsystem = "dgx-h100"\ngpus = 64\n'
                     'global_batch_size = 64\n[search]\ntp = [8]\npp = [4]\nvpp = [1]\n'
                     'micro_batch_size = [1]\nrecompute = ["none", "full"]\nzero_stage = [1]\n'
                     'sequence_parallel = [true]\nrecompute_num_layers = [0, 5, 10]\n')
    valid, invalid = enumerate_space(load_study(study))
    assert sorted((s.recompute, s.recompute_num_layers) for s in valid) == [
        ("full", 0), ("full", 5), ("full", 10), ("none", 0)]
    assert invalid == 0  # none with 5 or 10 layers: taken as none


def test_a_strategy_that_does_not_fit_is_told_the_least_recompute_that_fits() -> None:
    """Llama 3 70B on 1,024 H100s at micro-batch 4 does not fit without recompute; the hint is
    full recompute of the least N layers of each chunk that fits (N − 1 does not), at that
    strategy's step time and memory, and faster than recomputing every layer."""
    from analysis.glance import fit_by_recompute
    from tracegen import get_model

    model = get_model("llama3-70b")
    s = Strategy(tp=8, pp=4, dp=32, sequence_parallel=True, micro_batch_size=4,
                 global_batch_size=1024, zero_stage=1)
    g = glance(model, s, SYSTEM)
    assert not g.fits and g.fit_hint is not None
    n = g.fit_hint["recompute_num_layers"]
    assert g.fit_hint["recompute"] == "full" and 1 < n < 20
    at = {k: estimate(model, Strategy(**{**s.to_dict(), "recompute": "full",
                                         "recompute_num_layers": k}), SYSTEM)
          for k in (n - 1, n)}
    assert at[n].fits and not at[n - 1].fits
    assert (g.fit_hint["step_time_s"], g.fit_hint["peak_memory_GiB"]) == (
        at[n].step_time_s, at[n].peak_memory_GiB)
    every = estimate(model, Strategy(**{**s.to_dict(), "recompute": "full"}), SYSTEM)
    assert at[n].step_time_s < every.step_time_s
    assert glance(model, Strategy(**{**s.to_dict(), "recompute": "full",
                                     "recompute_num_layers": n}), SYSTEM).fit_hint is None
    # where even every layer recomputed does not fit, nothing is suggested
    tight = Strategy(tp=8, dp=1, micro_batch_size=1, global_batch_size=8, recompute="full")
    assert fit_by_recompute(model, tight, SYSTEM) is None


def test_selective_recompute_is_suggested_where_it_fits_and_is_faster() -> None:
    """Without FlashAttention (V100) selective recompute drops the attention scores (Korthikanti
    et al. 2022 §4.3): where that alone fits, it is the hint when it beats the full recompute
    of some layers."""
    from tracegen import get_model

    model, v100 = get_model("gpt3-175b"), get_system("dgx1-v100")
    s = Strategy(tp=8, pp=24, dp=1, micro_batch_size=1, global_batch_size=48,
                 sequence_parallel=True)
    g = glance(model, s, v100)
    sel = estimate(model, Strategy(**{**s.to_dict(), "recompute": "selective"}), v100)
    assert not g.fits and sel.fits
    assert g.fit_hint is not None and g.fit_hint["recompute"] == "selective"
    assert g.fit_hint["step_time_s"] == sel.step_time_s


def test_estimate_cli_says_what_recompute_fits(tmp_path: Path) -> None:
    from tests.test_cli import run

    out = tmp_path / "e.json"
    base = ("estimate", "--model", "llama3-70b", "--gpus", "1024", "--tp", "8", "--pp", "4",
            "--sp", "--mbs", "4", "--gbs", "1024", "--zero", "1", "--system", "dgx-h100")
    r = run(*base, "--json", str(out))
    assert r.returncode == 0, r.stderr
    hint = json.loads(out.read_text())["fit_hint"]
    n = hint["recompute_num_layers"]
    assert (f"it fits with full recompute of the first {n} layers of each chunk (--recompute "
            f"full --recompute-num-layers {n})") in " ".join(r.stdout.split())
    again = run(*base, "--recompute", "full", "--recompute-num-layers", str(n))
    assert again.returncode == 0 and "DOES NOT FIT" not in again.stdout
    assert f"recompute full (first {n} layers of each chunk)" in " ".join(again.stdout.split())
