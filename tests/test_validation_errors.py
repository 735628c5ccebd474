"""Bad strategies and models: each case names the ConfigError text it must produce."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tracegen import ConfigError, ModelSpec, Strategy, generate, get_model
from tracegen.fit import check_fits_model

STRATEGY_CASES = [
    (dict(tp=0), "tp must be ≥ 1, got 0"),
    (dict(dp=2, micro_batch_size=2, global_batch_size=6),
     "global_batch_size 6 is not divisible by micro_batch_size · dp = 2 · 2 = 4; use a multiple "
     "of 4 (e.g. 4 or 8)"),
    (dict(schedule="zigzag"), "schedule must be one of gpipe, 1f1b, interleaved_1f1b, zb_h1, zb_v, dualpipe_v, interleaved_zb; got 'zigzag'"),
    (dict(recompute="most"), "recompute must be one of none, selective, full; got 'most'"),
    (dict(precision="fp4"), "precision must be one of bf16, fp16, fp8, nvfp4; got 'fp4' (did you "
     "mean 'nvfp4'?)"),
    (dict(fp8_recipe="current"), "fp8_recipe must be one of delayed, tensorwise, mxfp8 "
     "(Transformer Engine's delayed or current per-tensor scaling, or MXFP8 block scaling "
     "(Blackwell)); got 'current'"),
    (dict(zero_stage=4), "zero_stage must be 0, 1, 2 or 3; got 4"),
    (dict(sequence_parallel=True), "sequence_parallel needs tp > 1"),
    (dict(pp=2, vpp=2, global_batch_size=4), "vpp = 2 needs schedule 'interleaved_1f1b' or 'interleaved_zb' (or 'zb_v' or 'dualpipe_v' with vpp 2), got '1f1b'"),
    (dict(pp=1, vpp=2, schedule="interleaved_1f1b"), "interleaved_1f1b needs pp ≥ 2 and vpp ≥ 2"),
    (dict(pp=4, vpp=2, schedule="interleaved_1f1b", global_batch_size=6),
     "interleaved_1f1b needs the number of micro-batches (6) to be a multiple of pp (4)"),
    # Megatron-Core's micro-batch group lifts that rule, with its own (and names groups that fit)
    (dict(pp=4, vpp=2, schedule="interleaved_1f1b", global_batch_size=10),
     "or set microbatch_group_size (Megatron-Core's microbatch_group_size_per_vp_stage) to a "
     "group of micro-batches that leaves a last group of 0 or at least pp; groups that fit: 5, "
     "6, 10"),
    (dict(pp=4, vpp=2, schedule="interleaved_1f1b", global_batch_size=10,
          microbatch_group_size=3),
     "microbatch_group_size 3 must lie in [pp, micro-batches] = [4, 10]"),
    (dict(pp=4, vpp=2, schedule="interleaved_1f1b", global_batch_size=10,
          microbatch_group_size=7),
     "microbatch_group_size 7 leaves a last group of 3 micro-batches of 10, fewer than pp (4)"),
    (dict(pp=4, vpp=2, schedule="interleaved_1f1b", global_batch_size=3,
          microbatch_group_size=4), "microbatch_group_size needs at least pp (4) micro-batches"),
    (dict(pp=4, global_batch_size=10, microbatch_group_size=5),
     "microbatch_group_size needs schedule 'interleaved_1f1b'"),
    (dict(dp=4, ep=3, global_batch_size=12), "ep 3 must divide dp 4"),
    # built directly in Python: a wrong type is named, not a TypeError from deep inside
    (dict(tp="2"), "tp must be an integer, got '2'"),
    (dict(first_stage_layers=None), "first_stage_layers must be an integer, got None"),
    (dict(micro_batch_size=1.5), "micro_batch_size must be an integer, got 1.5"),
    (dict(sequence_parallel="yes"), "sequence_parallel must be true or false, got 'yes'"),
    (dict(schedule=3), "schedule must be a string, got 3"),
]


@pytest.mark.parametrize(("kwargs", "message"), STRATEGY_CASES)
def test_bad_strategy(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        Strategy(**kwargs)
    assert message in str(info.value)


def test_a_micro_batch_group_names_the_order_it_runs() -> None:
    """A group that fits runs its own order (its id and label say so); a group of pp is the
    default schedule, not a variant of it."""
    s = Strategy(pp=4, vpp=2, schedule="interleaved_1f1b", global_batch_size=10,
                 microbatch_group_size=5)
    assert (s.order_id, s.label()) == ("interleaved_1f1b/5", "tp1-pp4-dp1-vpp2-g5-mbs1")
    same = Strategy(pp=4, vpp=2, schedule="interleaved_1f1b", global_batch_size=8,
                    microbatch_group_size=4)
    assert (same.schedule_group, same.order_id) == (0, "interleaved_1f1b")


FIT_CASES = [
    (dict(tp=3), "num_attention_heads 32 is not divisible by tp 3; choose tp among [1, 2, 4, 8, 16, 32]"),
    (dict(tp=16), "num_kv_heads 8 is not divisible by tp 16; choose tp among [1, 2, 4, 8]"),
    (dict(pp=5), "num_layers 32 is not divisible by pp · vpp = 5 · 1 = 5"),
    (dict(pp=2, first_stage_layers=5, last_stage_layers=5),
     "first_stage_layers 5 and last_stage_layers 5 add up to 10, not the model's 32 layers"),
    (dict(ep=2, dp=2, global_batch_size=2), "ep = 2 needs a mixture-of-experts model"),
    (dict(cp=3), "seq_len 8192 is not divisible by 2·cp = 6"),
]


@pytest.mark.parametrize(("kwargs", "message"), FIT_CASES)
def test_strategy_does_not_fit_model(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_fits_model(Strategy(**kwargs), get_model("llama3-8b"))
    assert message in str(info.value)


def test_world_size_mismatch_and_all_problems_listed() -> None:
    with pytest.raises(ConfigError) as info:
        check_fits_model(Strategy(tp=3, pp=5), get_model("llama3-8b"), gpus=8)
    text = str(info.value)
    assert "world size tp·cp·dp·pp = 3·1·1·5 = 15 differs from the GPU count 8" in text
    assert "num_attention_heads 32" in text and "num_layers 32" in text
    assert "problems" in text


MODEL_CASES = [
    (dict(hidden_size=100, num_attention_heads=3), "hidden_size 100 is not divisible by"),
    (dict(num_attention_heads=32, num_kv_heads=5), "not a multiple of num_kv_heads 5"),
    (dict(activation="tanh"), "activation must be one of gelu, swiglu, geglu, relu2, relu; got 'tanh'"),
    (dict(num_layers=0), "num_layers must be positive, got 0"),
    (dict(num_experts=8, experts_per_token=9, moe_ffn_hidden_size=8),
     "experts_per_token must be in 1..num_experts (8), got 9"),
    (dict(hidden_size="64"), "hidden_size must be an integer, got '64'"),
    (dict(tied_embeddings="yes"), "tied_embeddings must be true or false, got 'yes'"),
]


@pytest.mark.parametrize(("kwargs", "message"), MODEL_CASES)
def test_bad_model(kwargs: dict, message: str) -> None:
    base = dict(name="m", num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                vocab_size=64, seq_len=16)
    with pytest.raises(ConfigError) as info:
        ModelSpec(**{**base, **kwargs})
    assert message in str(info.value)


def test_model_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "m.toml"
    bad.write_text('num_layers = "x"\nhidden = 3\n')
    with pytest.raises(ConfigError) as info:
        ModelSpec.from_file(bad)
    text = str(info.value)
    assert "num_layers must be an integer, got 'x'" in text
    assert "unknown key 'hidden'" in text
    assert "missing required key 'hidden_size'" in text
    broken = tmp_path / "b.toml"
    broken.write_text("num_layers = = 3")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        ModelSpec.from_file(broken)
    with pytest.raises(ConfigError, match="does not exist"):
        ModelSpec.from_file(tmp_path / "missing.json")


def test_strategy_file_unknown_key(tmp_path: Path) -> None:
    f = tmp_path / "s.json"
    f.write_text('{"tp": 2, "pipeline": 4}')
    with pytest.raises(ConfigError, match="unknown key 'pipeline'"):
        Strategy.from_file(f)


@pytest.mark.parametrize("name", ["", "../up", "a/b", ".hidden"])
def test_generate_rejects_a_name_that_is_not_a_file_stem(tmp_path: Path, name: str) -> None:
    """'../up' had written its rank files beside the folder, '' hidden ones named '.0.et'."""
    s = Strategy(tp=2, pp=2, micro_batch_size=1, global_batch_size=4)
    with pytest.raises(ConfigError, match="must be a file-name stem"):
        generate(get_model("llama3-8b"), s, tmp_path / "o", name=name)
    assert not list(tmp_path.rglob("*.et"))


def test_generate_rejects_bad_mode(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="mode must be 'full' or 'representative'"):
        generate(get_model("llama3-8b"), Strategy(), tmp_path, mode="some")  # type: ignore[arg-type]


def test_numpy_and_whole_float_fields_are_taken_as_python_values() -> None:
    """A strategy or model built from a pandas or NumPy row: its integers (and whole floats, as
    a column with gaps holds them) and booleans are stored as Python ones, equal to the same
    config built from plain values."""
    import numpy as np

    s = Strategy(tp=np.int64(2), dp=np.int32(2), global_batch_size=8.0,
                 sequence_parallel=np.bool_(True))
    assert s == Strategy(tp=2, dp=2, global_batch_size=8, sequence_parallel=True)
    assert type(s.tp) is int and type(s.global_batch_size) is int
    assert type(s.sequence_parallel) is bool
    m = ModelSpec(name="m", num_layers=np.int64(2), hidden_size=64.0, num_attention_heads=4,
                  ffn_hidden_size=128, vocab_size=64, seq_len=16)
    assert type(m.num_layers) is int and type(m.hidden_size) is int and m.head_dim == 16


@settings(max_examples=400, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2, 3, 4]),
       dp=st.sampled_from([1, 2, 3, 4, 8]), vpp=st.sampled_from([1, 2, 3]),
       mbs=st.sampled_from([1, 2, 4]), gbs=st.integers(1, 200), sp=st.booleans(),
       overlap=st.booleans(),
       schedule=st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v",
                                 "dualpipe_v", "interleaved_zb"]))
def test_what_a_sweep_rules_out_early_a_strategy_refuses(tp, pp, dp, vpp, mbs, gbs, sp, overlap,
                                                         schedule) -> None:
    """``ruled_out`` (a sweep's enumeration skips those combinations before building a
    Strategy) says True only where the Strategy would be refused, and it catches every
    refusal for the reasons it covers: what the sweep skips is exactly what it would drop."""
    from tracegen.strategy import ruled_out

    fields = dict(tp=tp, pp=pp, dp=dp, vpp=vpp, micro_batch_size=mbs, global_batch_size=gbs,
                  sequence_parallel=sp, tp_comm_overlap=overlap, schedule=schedule)
    try:
        Strategy(**fields)
        refused = None
    except ConfigError as exc:
        refused = str(exc)
    if ruled_out(**fields):
        assert refused is not None
    elif refused is not None:  # refused for another reason only
        covered = ("not divisible by micro_batch_size", "sequence_parallel needs tp > 1",
                   "tp_comm_overlap needs", "needs schedule 'interleaved_1f1b'",
                   "interleaved_1f1b needs", "zb_h1 needs pp", "zb_h1 is modelled without "
                   "tp_comm_overlap", "zb_v needs pp", "zb_v is modelled without "
                   "tp_comm_overlap", "zb_v runs two model chunks", "'dualpipe_v' with vpp 2",
                   "dualpipe_v needs pp", "dualpipe_v is modelled without tp_comm_overlap",
                   "dualpipe_v runs two model chunks", "dualpipe_v needs at least",
                   "interleaved_zb needs pp", "interleaved_zb is modelled without "
                   "tp_comm_overlap", "interleaved_zb runs several model chunks",
                   "interleaved_zb runs the micro-batches in")
        assert not any(text in refused for text in covered), refused


@pytest.mark.parametrize(("key", "hint"), [("tpp", "did you mean 'tp'? "),
                                           ("zero_stag", "did you mean 'zero_stage'? "),
                                           ("gradient_accumulation", "")])
def test_a_misspelt_key_is_named_with_the_nearest_known_one(key: str, hint: str) -> None:
    """A study's or strategy file's misspelt key gets the nearest known key (difflib's 0.6),
    and none where nothing is near; every known key is listed either way."""
    with pytest.raises(ConfigError) as info:
        Strategy.from_dict({key: 1, "pp": 1})
    text = str(info.value)
    assert f"unknown key {key!r} ({hint}known keys: " in text
    assert all(f.name in text for f in dataclasses.fields(Strategy))
