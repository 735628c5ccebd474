"""Megatron-Core's account-for-embedding/loss pipeline split (``Strategy.account_for_*``): the
embedding and the loss count as layers, so the end chunks hold one layer fewer — none where the
others hold one, as in Llama 3 405B's own layout (Dubey et al. 2024 §3.3.2)."""

from __future__ import annotations

import dataclasses
import re
import tempfile
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from analysis.fastpath import estimate
from replay import get_system, replay
from tracegen import ConfigError, ModelSpec, Strategy, generate, get_model
from tracegen.fit import check_fits_model, with_shorter_end_chunks

SMALL = ModelSpec(name="split", num_layers=6, hidden_size=256, num_attention_heads=8,
                  num_kv_heads=4, ffn_hidden_size=512, vocab_size=1024, seq_len=256,
                  activation="swiglu")


def _sizes(s: Strategy, layers: int) -> list[int]:
    return [len(s.chunk_layers(layers, g)) for g in range(s.pp * s.vpp)]


def _split(pp: int, vpp: int, emb: bool = True, loss: bool = True, **kw: object) -> Strategy:
    return Strategy(pp=pp, vpp=vpp, schedule="interleaved_1f1b" if vpp > 1 else "1f1b",
                    global_batch_size=4 * pp, account_for_embedding_in_pipeline_split=emb,
                    account_for_loss_in_pipeline_split=loss, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("layers", "pp", "vpp", "emb", "loss", "sizes"), [
    (126, 16, 8, True, True, [0] + [1] * 126 + [0]),  # Llama 3 405B: embedding, loss alone
    (126, 16, 1, True, True, [7] + [8] * 14 + [7]),  # the same split on whole stages
    (126, 8, 8, True, True, [1] + [2] * 62 + [1]),
    (127, 16, 8, True, False, [0] + [1] * 127),
    (127, 16, 8, False, True, [1] * 127 + [0]),
])
def test_end_chunks_give_up_a_layer_each(layers: int, pp: int, vpp: int, emb: bool,
                                         loss: bool, sizes: list[int]) -> None:
    s = _split(pp, vpp, emb, loss)
    assert _sizes(s, layers) == sizes
    assert sum(sizes) == layers
    ranges = [s.chunk_layers(layers, g) for g in range(pp * vpp)]
    assert [r.start for r in ranges[1:]] == [r.stop for r in ranges[:-1]]  # contiguous


def test_on_whole_stages_it_is_the_explicit_end_stage_split() -> None:
    """126 layers on pp 16 with both counted is Llama 3's 7, 8 × 14, 7 given as end-stage sizes."""
    assert _sizes(_split(16, 1), 126) == _sizes(
        Strategy(pp=16, global_batch_size=64, first_stage_layers=7, last_stage_layers=7), 126)


@pytest.mark.parametrize(("strategy", "message"), [
    (lambda: _split(5, 1), "126 + 2 (the embedding / loss counted as layers) = 128 is not "
                           "divisible by pp · vpp = 5 · 1"),
    (lambda: _split(16, 1, first_stage_layers=7), "not both"),
])
def test_bad_splits_say_what_is_wrong(strategy, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_fits_model(strategy(), get_model("llama3.1-405b"))


def test_one_stage_cannot_split() -> None:
    s = Strategy(account_for_loss_in_pipeline_split=True)
    with pytest.raises(ConfigError, match="need pp ≥ 2"):
        check_fits_model(s, SMALL)


@pytest.mark.parametrize(("layers", "emb", "sizes_end"), [(126, True, (0, 0)),
                                                          (127, False, (1, 0))])
def test_shorter_end_chunks_use_the_split_where_an_end_chunk_empties(
        layers: int, emb: bool, sizes_end: tuple[int, int]) -> None:
    """``with_shorter_end_chunks`` (validate, sweep): 126 layers on pp 16 × vpp 8 were refused
    (an end chunk would be empty); they now take Megatron-Core's split."""
    s = with_shorter_end_chunks(Strategy(pp=16, vpp=8, schedule="interleaved_1f1b",
                                         global_batch_size=64), layers)
    assert s.account_for_embedding_in_pipeline_split is emb
    assert s.account_for_loss_in_pipeline_split
    sizes = _sizes(s, layers)
    assert (sizes[0], sizes[-1]) == sizes_end and sum(sizes) == layers


@pytest.mark.parametrize("kw", [
    dict(pp=4, vpp=2, zero_stage=1),  # chunk 0 the embedding alone, chunk 7 the head alone
    dict(pp=4, vpp=2, zero_stage=3),
    dict(pp=4, vpp=1, zero_stage=0),  # 1, 2, 2, 1 layers
    dict(pp=2, vpp=4, zero_stage=1, recompute="full"),
    dict(pp=4, vpp=2, zero_stage=3, zero3_prefetch=True),
    dict(pp=4, vpp=2, zero_stage=1, overlap_param_gather=True),
])
def test_fast_path_agrees_with_replay_on_empty_end_chunks(kw: dict) -> None:
    """The fast path walks these pipelines (uneven) and stays within the 2% it holds elsewhere
    (tests/test_fastpath.py) of the replayed traces, whose first rank runs a chunk that is the
    embedding alone."""
    pp, vpp = kw.pop("pp"), kw.pop("vpp")
    s = _split(pp, vpp, dp=2, tp=2, sequence_parallel=True, **kw)
    assert _sizes(s, SMALL.num_layers)[0] == (0 if vpp > 1 else 1)
    hw = get_system("dgx-h100")
    fast = estimate(SMALL, s, hw)
    with tempfile.TemporaryDirectory() as tmp:
        generate(SMALL, s, tmp, mode="representative")
        ref = replay(tmp, hw, contention=False).step_time_s
    assert fast.step_time_s == pytest.approx(ref, rel=0.02)


def test_a_sweep_ranks_meta_s_published_llama3_layout_first(tmp_path: Path) -> None:
    """Llama 3.1 405B on 16,384 H100s, 16M-token batches: screening tp 4/8 × pp 8/16/32 ×
    vpp 1-8 × micro-batch 1/2 × recompute × ZeRO 1/2 with the fast path, the fastest layout
    that fits is the one Meta published (Dubey et al. 2024 Table 4, §3.3.2): tp 8, pp 16,
    interleaved with the embedding and the loss alone in the end chunks (vpp 8), no activation
    checkpointing — which only the account-for-embedding/loss split makes expressible (the
    next depth, pp 32 × vpp 4, is 7% slower). An observation the physics makes, not a fit."""
    from analysis.study import load_study
    from analysis.sweep import enumerate_space

    study = tmp_path / "s.toml"
    study.write_text('model = "llama3.1-405b"\nsystem = "dgx-h100"\ngpus = 16384\n'
                     "global_batch_size = 2048\n[search]\ntp = [4, 8]\npp = [8, 16, 32]\n"
                     "vpp = [1, 2, 4, 8]\nmicro_batch_size = [1, 2]\n"
                     'recompute = ["none", "selective", "full"]\nzero_stage = [1, 2]\n'
                     "sequence_parallel = [true]\n")
    st = load_study(study)
    cands, _ = enumerate_space(st)
    est = [(estimate(st.model, s, st.system), s) for s in cands]
    fit = sorted(((e.step_time_s, s) for e, s in est if e.fits), key=lambda x: x[0])
    (t0, best), (t1, _) = fit[0], next(x for x in fit if x[1].pp != 16)
    assert (best.tp, best.pp, best.vpp, best.recompute) == (8, 16, 8, "none")
    assert best.account_for_embedding_in_pipeline_split and best.account_for_loss_in_pipeline_split
    assert t1 > 1.05 * t0


@pytest.mark.parametrize("kw", [dict(pp=2, vpp=2, schedule="interleaved_1f1b",
                                     account_for_embedding_in_pipeline_split=True,
                                     account_for_loss_in_pipeline_split=True),
                                dict(pp=2, vpp=1, schedule="1f1b", overlap_param_gather=True)])
def test_zero2_times_as_zero1_and_shares_its_memos(kw: dict) -> None:
    """ZeRO-2 shards the gradients as well, which only the memory model sees: its traces replay
    in the same time as ZeRO-1's, and the fast path, which shares the gradient drain between
    the two (a sweep's twins), gives it the same answer cold or after its twin."""
    from analysis.fastpath import clear_cache

    hw = get_system("dgx-h100")
    z1, z2 = (Strategy(tp=2, dp=4, micro_batch_size=1, global_batch_size=16, zero_stage=z,
                       sequence_parallel=True, dp_bucket_params=200_000, **kw) for z in (1, 2))
    clear_cache()
    cold = estimate(SMALL, z2, hw).step_time_s
    clear_cache()
    estimate(SMALL, z1, hw)
    assert estimate(SMALL, z2, hw).step_time_s == cold == estimate(SMALL, z1, hw).step_time_s
    assert estimate(SMALL, z2, hw).peak_memory_GiB < estimate(SMALL, z1, hw).peak_memory_GiB
    replayed = []
    for s in (z1, z2):
        with tempfile.TemporaryDirectory() as tmp:
            generate(SMALL, s, tmp, mode="representative")
            replayed.append(replay(tmp, hw, contention=False).step_time_s)
    assert replayed[0] == replayed[1]
    assert cold == pytest.approx(replayed[1], rel=0.02)


def _model(layers: int) -> ModelSpec:
    return dataclasses.replace(SMALL, num_layers=layers)


def _end_sizes(message: str) -> list[tuple[int, int]]:
    """The (first, last) sizes a refusal proposes; one size alone is returned as (size, 0)
    or (0, size) after the edge it names."""
    pairs = re.search(r"first/last sizes that split it: ([\d/, ]+)", message)
    if pairs:
        return [tuple(map(int, p.split("/"))) for p in pairs.group(1).split(", ")]  # type: ignore[misc]
    one = re.search(r"(first|last)_stage_layers that split it \(.*?\): ([\d, ]+)", message)
    assert one, message
    return [(int(v), 0) if one.group(1) == "first" else (0, int(v))
            for v in one.group(2).split(", ")]


@settings(max_examples=150, deadline=None)
@given(layers=st.integers(3, 130), pp=st.integers(2, 16), vpp=st.sampled_from([1, 2]),
       first=st.integers(0, 140), last=st.integers(0, 140))
def test_a_refused_end_split_proposes_splits_that_fit(layers: int, pp: int, vpp: int,
                                                      first: int, last: int) -> None:
    """An end-chunk size that does not split the model is refused with the nearest sizes that
    do, and every size proposed is accepted (the message's advice works); the refusal says
    how many layers the sizes leave or exceed."""
    assume(first or last)
    s = Strategy(pp=pp, vpp=vpp, schedule="interleaved_1f1b" if vpp > 1 else "1f1b",
                 global_batch_size=4 * pp, first_stage_layers=first, last_stage_layers=last)
    try:
        check_fits_model(s, _model(layers))
    except ConfigError as e:
        message = str(e)
    else:
        sizes = [len(s.chunk_layers(layers, g)) for g in range(pp * vpp)]
        assert sum(sizes) == layers and min(sizes) >= 1
        return
    assert f"{layers} layers on pp · vpp = {pp} · {vpp}" in message
    if "no end sizes split it" in message:
        return
    proposed = _end_sizes(message)
    assert 1 <= len(proposed) <= 4
    for f, lst in proposed:
        fixed = dataclasses.replace(s, first_stage_layers=f, last_stage_layers=lst)
        check_fits_model(fixed, _model(layers))  # raises if the advice is wrong
        sizes = [len(fixed.chunk_layers(layers, g)) for g in range(pp * vpp)]
        assert sum(sizes) == layers and min(sizes) >= 1


def test_deepseek_v3_on_16_stages_is_told_the_splits_of_its_61_layers() -> None:
    """61 layers with 3 + 3 at the ends leave 55 for 14 stages; the nearest end sizes that
    leave a multiple of 14 (56) are named, nearest first."""
    s = Strategy(pp=16, dp=128, ep=64, global_batch_size=15360, first_stage_layers=3,
                 last_stage_layers=3)
    with pytest.raises(ConfigError) as e:
        check_fits_model(s, get_model("deepseek-v3"))
    assert ("first_stage_layers 3 and last_stage_layers 3 leave 55 layers, not a multiple of "
            "the other 14 stages") in str(e.value)
    assert "first/last sizes that split it: 2/3, 3/2, 1/4, 4/1" in str(e.value)
