"""Where a strategy does not fit, the sharding that makes it fit (``analysis.shard_hint``): every
candidate shards the model state at least as much as the strategy; the hint is the least memory
within ``NEAR`` of the fastest candidate that fits; `estimate` and `resilience` say it in their
own flags and fields, and the strategy they name fits."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.fastpath import estimate
from analysis.glance import glance
from analysis.shard_hint import NEAR, candidates, fit_by_sharding, shard_hint_words
from replay import get_system
from tracegen import Strategy, get_model
from tracegen.memory import estimate as memory_estimate
from tracegen.program import RoleProgram

H100 = get_system("dgx-h100")
LLAMA70 = get_model("llama3-70b")
# Llama 3 70B under FSDP on 1,024 H100s with one replica a node (tests/test_hfsdp.py): HSDP
# keeps 16 bytes a parameter over 8 GPUs and does not fit
HSDP = Strategy(dp=1024, zero_stage=3, global_batch_size=1024, recompute="full",
                zero3_prefetch=True, dist_opt_instances=128)


def _state_bytes(s: Strategy) -> int:
    """Weights, gradients and optimizer state on stage 0's rank (what sharding divides)."""
    model = get_model("gpt-1.7b")
    held = RoleProgram(model, s, 0).stage_params()
    mem = memory_estimate(model, s, 0, sum(held.values()), expert_params=held["edp"])
    return mem.weights_bytes + mem.gradients_bytes + mem.optimizer_bytes


@settings(max_examples=40, deadline=None)
@given(zero=st.sampled_from([0, 1, 2, 3]), dp=st.sampled_from([2, 4, 8, 16]),
       r=st.sampled_from([1, 2, 4, 8]), optim=st.booleans(), prefetch=st.booleans())
def test_every_candidate_shards_at_least_as_much(zero: int, dp: int, r: int, optim: bool,
                                                 prefetch: bool) -> None:
    """Each candidate differs from the strategy and holds no more weight, gradient and
    optimizer bytes a rank (a higher stage, fewer instances, the optimizer across them)."""
    r = r if zero and dp % r == 0 else 1
    s = Strategy(dp=dp, zero_stage=zero, global_batch_size=dp, dist_opt_instances=r,
                 outer_dp_sharding_strategy="optim" if optim and zero == 3 and r > 1
                 else "no_shard", zero3_prefetch=prefetch and zero == 3)
    got = candidates(s)
    assert bool(got) != (zero == 3 and r == 1)  # (ZeRO-3 over all dp·cp shards the most)
    assert s not in got and len(set(got)) == len(got)
    for c in got:
        assert c.zero_stage >= s.zero_stage and c.dist_opt_instances <= r
        assert _state_bytes(c) <= _state_bytes(s)


def test_the_hint_is_the_least_memory_near_the_fastest_that_fits() -> None:
    """Brute force over the candidates: among those that fit, the hint's step is within NEAR
    of the fastest, and no candidate as near needs less memory."""
    assert not estimate(LLAMA70, HSDP, H100).fits
    hint, est = fit_by_sharding(LLAMA70, HSDP, H100) or pytest.fail("no hint")
    fitting = [e for e in (estimate(LLAMA70, c, H100) for c in candidates(HSDP)) if e.fits]
    fastest = min(e.step_time_s for e in fitting)
    assert est.fits and est.step_time_s <= fastest * (1 + NEAR)
    assert est.peak_memory_GiB == min(e.peak_memory_GiB for e in fitting
                                      if e.step_time_s <= fastest * (1 + NEAR))
    # here fewer, larger instances shard more and cost almost nothing: the hint keeps several
    assert hint.zero_stage == 3 and 1 < hint.dist_opt_instances < 128


def test_glance_offers_both_hints_only_where_it_does_not_fit() -> None:
    g = glance(LLAMA70, HSDP, H100)
    assert not g.fits and g.shard_hint is not None
    assert g.shard_hint["peak_memory_GiB"] <= g.capacity_GiB
    fixed = dataclasses.replace(HSDP, **{k: g.shard_hint[k] for k in (
        "zero_stage", "dist_opt_instances", "outer_dp_sharding_strategy", "zero3_prefetch")})
    again = glance(LLAMA70, fixed, H100)
    assert again.fits and again.shard_hint is None and again.fit_hint is None
    assert again.step_time_s == g.shard_hint["step_time_s"]


def test_nothing_is_suggested_where_activations_alone_overflow() -> None:
    """Activations do not shard over data parallelism: 70B with four micro-batches of 8K
    tokens on four stages, no recompute, needs more than any ZeRO stage frees."""
    s = Strategy(tp=8, pp=4, dp=32, sequence_parallel=True, micro_batch_size=4,
                 global_batch_size=1024, zero_stage=1)
    assert fit_by_sharding(LLAMA70, s, H100) is None
    assert glance(LLAMA70, s, H100).fit_hint is not None  # recompute does it


def test_words_name_only_what_changes() -> None:
    base = {"zero_stage": 3, "dist_opt_instances": 128, "zero3_prefetch": True,
            "outer_dp_sharding_strategy": "optim", "step_time_s": 1.0, "peak_memory_GiB": 1.0}
    assert shard_hint_words(base, HSDP) == (
        "the optimizer sharded across the instances (HFSDP)", "--outer-dp-sharding optim",
        'outer_dp_sharding_strategy = "optim"')
    zero1 = Strategy(dp=1024, zero_stage=1, global_batch_size=1024)
    what, flags, fields = shard_hint_words({**base, "dist_opt_instances": 1,
                                            "outer_dp_sharding_strategy": "no_shard"}, zero1)
    assert (what, flags) == ("ZeRO-3 with prefetch", "--zero 3 --zero3-prefetch")
    assert fields == "zero_stage = 3, zero3_prefetch = true"
    hfsdp = dataclasses.replace(HSDP, outer_dp_sharding_strategy="optim")
    what, flags, _ = shard_hint_words({**base, "dist_opt_instances": 1,
                                       "outer_dp_sharding_strategy": "no_shard"}, hfsdp)
    assert what == "one optimizer instance over all 1,024 data-parallel ranks"
    assert flags == "--dist-opt-instances 1 --outer-dp-sharding no_shard"
    assert not dataclasses.replace(hfsdp, dist_opt_instances=1,
                                   outer_dp_sharding_strategy="no_shard").hfsdp  # (valid)


def test_estimate_cli_says_what_sharding_fits(tmp_path: Path) -> None:
    """The printed flags, run again, fit."""
    from tests.test_cli import run

    out = tmp_path / "e.json"
    base = ("estimate", "--model", "llama3-70b", "--gpus", "1024", "--zero", "1",
            "--mbs", "1", "--gbs", "1024", "--recompute", "full", "--system", "dgx-h100")
    r = run(*base, "--json", str(out))
    assert r.returncode == 0, r.stderr
    hint = json.loads(out.read_text())["shard_hint"]
    what, flags, _ = shard_hint_words(hint, Strategy(dp=1024, zero_stage=1,
                                                     global_batch_size=1024))
    words = " ".join(r.stdout.split())
    assert "DOES NOT FIT" in words and f"it fits with {what} ({flags})" in words
    at = base.index("--zero")
    again = run(*base[:at], *base[at + 2:], *flags.split())
    assert again.returncode == 0 and "DOES NOT FIT" not in again.stdout
    assert f"{hint['step_time_s']:.4f} s" in again.stdout


def test_estimate_cli_without_any_fit_says_so() -> None:
    from tests.test_cli import run

    r = run("estimate", "--model", "llama3-70b", "--gpus", "8", "--tp", "8", "--mbs", "2",
            "--gbs", "16", "--zero", "1", "--recompute", "full", "--system", "dgx-h100")
    assert r.returncode == 0, r.stderr
    assert ("neither recomputation nor ZeRO sharding makes it fit: shard more (tp, pp) or lower "
            "the micro-batch") in " ".join(r.stdout.split())


def test_where_neither_alone_fits_the_hint_shards_and_recomputes(tmp_path: Path) -> None:
    """Llama 3 70B at tp 2 over 64 H100s under ZeRO-2 without recompute: ZeRO-3 alone leaves
    the activations, recomputation alone the unsharded weights, too large; together they fit,
    and the flags `estimate` prints build that strategy."""
    from analysis.glance import fit_by_recompute
    from tests.test_cli import run

    s = Strategy(tp=2, dp=32, global_batch_size=64, zero_stage=2)
    assert fit_by_recompute(LLAMA70, s, H100) is None
    assert fit_by_sharding(LLAMA70, s, H100) is None
    g = glance(LLAMA70, s, H100)
    assert g.fit_hint is None and g.shard_hint is not None
    hint = g.shard_hint
    assert hint["zero_stage"] == 3 and (hint["recompute"] in ("full", "selective")
                                        or hint["cpu_offload_layers"])
    fixed = dataclasses.replace(s, **{k: hint[k] for k in (
        "zero_stage", "dist_opt_instances", "outer_dp_sharding_strategy", "zero3_prefetch",
        "recompute", "recompute_num_layers", "recompute_modules", "cpu_offload_layers")})
    est = estimate(LLAMA70, fixed, H100)
    assert est.fits and (est.step_time_s, est.peak_memory_GiB) == (
        hint["step_time_s"], hint["peak_memory_GiB"])
    # it is the hint of the sharding it names: the least recompute (since the fifty-eighth
    # session, or activation offloading: ZeRO-3 here offloads 41 layers over PCIe) that fits
    again = fit_by_recompute(LLAMA70, dataclasses.replace(fixed, recompute="none",
                                                          recompute_num_layers=0,
                                                          recompute_modules="core_attn",
                                                          cpu_offload_layers=0), H100)
    assert again is not None and again[0] == fixed
    base = ("estimate", "--model", "llama3-70b", "--gpus", "64", "--tp", "2", "--mbs", "1",
            "--gbs", "64", "--system", "dgx-h100")
    r = run(*base, "--zero", "2")
    assert r.returncode == 0, r.stderr
    what, flags, _ = shard_hint_words(hint, s)
    assert f"it fits with {what} ({flags})" in " ".join(r.stdout.split())
    fitted = run(*base, *flags.split())
    assert fitted.returncode == 0 and "DOES NOT FIT" not in fitted.stdout
