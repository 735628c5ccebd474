"""The fast path agrees with replay on healthy symmetric cases (no link contention)."""

from __future__ import annotations

import tempfile

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from analysis.fastpath import estimate
from replay import get_system, replay
from tracegen import ConfigError, ModelSpec, Strategy, generate

MODEL = ModelSpec(name="fast", num_layers=8, hidden_size=256, num_attention_heads=8,
                  num_kv_heads=4, ffn_hidden_size=512, vocab_size=1024, seq_len=256,
                  activation="swiglu")
SYSTEM = get_system("dgx-h100")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2, 4]), dp=st.sampled_from([1, 2, 4]),
       sp=st.booleans(), zero=st.sampled_from([0, 1, 3]),
       recompute=st.sampled_from(["none", "selective", "full"]), mb=st.sampled_from([1, 2, 4, 8]),
       schedule=st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b"]))
def test_fast_path_within_2_percent_of_replay(tp, pp, dp, sp, zero, recompute, mb, schedule
                                              ) -> None:
    try:
        s = Strategy(tp=tp, pp=pp, dp=dp, vpp=2 if schedule == "interleaved_1f1b" else 1,
                     sequence_parallel=sp and tp > 1, zero_stage=zero, recompute=recompute,
                     micro_batch_size=1, global_batch_size=mb * dp * pp, schedule=schedule,
                     dp_bucket_params=200_000)
        fast = estimate(MODEL, s, SYSTEM)
    except ConfigError:
        assume(False)
        raise
    with tempfile.TemporaryDirectory() as tmp:
        generate(MODEL, s, tmp, mode="representative")
        ref = replay(tmp, SYSTEM, contention=False)
    assert fast.step_time_s == pytest.approx(ref.step_time_s, rel=0.02)


def test_fast_path_flags_what_does_not_fit() -> None:
    from tracegen import get_model

    big = estimate(get_model("llama3-70b"), Strategy(tp=1, pp=1, dp=8, global_batch_size=8),
                   get_system("dgx-h100"))
    assert not big.fits and big.peak_memory_GiB > 80
    ok = estimate(get_model("llama3-8b"), Strategy(tp=8, pp=1, dp=1, sequence_parallel=True,
                                                   recompute="full", global_batch_size=8),
                  get_system("dgx-h100"))
    assert ok.fits
