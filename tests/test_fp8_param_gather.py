"""``Strategy.fp8_param_gather`` (Megatron --fp8-param-gather): an FP8 run's distributed
optimizer all-gathers its updated parameters in 1 byte, Megatron-FSDP (ZeRO-3) its forward's and
backward's gathers. The trace's bytes, the fast path
against replay, the refusals, and how ``validate --set`` and a sweep take it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import polars as pl
import pytest

from analysis.compare import strategy_label
from analysis.fastpath import estimate
from analysis.validate import validate
from replay import get_system
from tests.conftest import read_et, replayed
from tests.studies import enumerated
from tests.test_cli import run
from tracegen import ConfigError, ModelSpec, Strategy, generate

MODEL = ModelSpec(name="fpg", num_layers=8, hidden_size=1024, num_attention_heads=16,
                  ffn_hidden_size=4096, vocab_size=8192, seq_len=1024)
MOE = ModelSpec(name="fpg-moe", num_layers=4, hidden_size=1024, num_attention_heads=8,
                num_kv_heads=4, ffn_hidden_size=2048, vocab_size=4096, seq_len=1024,
                activation="swiglu", num_experts=8, experts_per_token=2, moe_ffn_hidden_size=512)
H100 = get_system("dgx-h100")
BASE = Strategy(tp=2, pp=2, dp=4, micro_batch_size=1, global_batch_size=32, zero_stage=1,
                precision="fp8", dp_bucket_params=2_000_000)


def _gathered(s: Strategy, tmp: Path, name: str) -> int:
    """Bytes of every collective called ``name`` over the rank files written."""
    generate(MODEL, s, tmp, mode="representative")
    total = 0
    for f in sorted(tmp.glob("*.et")):
        for node in read_et(f)[1]:
            if node.name.endswith(name):
                total += next(a.int64_val for a in node.attr if a.name == "comm_size")
    return total


@pytest.mark.parametrize("overlap", [False, True])
def test_parameter_gathers_halve_and_the_gradients_do_not(tmp_path: Path, overlap: bool) -> None:
    """Each parameter all-gather's shard: 2 bytes a parameter, 1 with the flag (after the step
    or, overlapped, opening the next one); the gradient reduce-scatters keep their bytes."""
    s = dataclasses.replace(BASE, overlap_param_gather=overlap)
    fp8 = dataclasses.replace(s, fp8_param_gather=True)
    bf16_ag = _gathered(s, tmp_path / "a", "param_all_gather")
    fp8_ag = _gathered(fp8, tmp_path / "b", "param_all_gather")
    assert bf16_ag > 0 and bf16_ag == 2 * fp8_ag
    rs = [_gathered(x, tmp_path / f"rs{i}", "grad_reduce_scatter") for i, x in enumerate((s, fp8))]
    assert rs[0] > 0 and rs[0] == rs[1]


@pytest.mark.parametrize(("model", "kw"), [
    (MODEL, {}),
    (MODEL, {"overlap_param_gather": True}),
    (MODEL, {"pp": 2, "tp": 1, "dp": 8, "vpp": 2, "schedule": "interleaved_1f1b",
             "overlap_param_gather": True, "zero_stage": 2}),
    (MOE, {"ep": 2, "tp": 1, "dp": 8}),
])
def test_fast_path_matches_replay(model: ModelSpec, kw: dict) -> None:
    s = dataclasses.replace(BASE, fp8_param_gather=True, **kw)
    fast = estimate(model, s, H100).step_time_s
    assert fast == pytest.approx(replayed(model, s, H100).step_time_s, rel=0.02)
    assert fast <= estimate(model, dataclasses.replace(s, fp8_param_gather=False),
                            H100).step_time_s


@pytest.mark.parametrize("prefetch", [False, True])
def test_zero3_gathers_halve_before_forward_and_backward(tmp_path: Path, prefetch: bool
                                                         ) -> None:
    """Megatron-FSDP with FP8 parameters (its 1-byte weight buffers): every layer's gathers,
    forward and backward, move 1 byte a parameter; the embedding and the head, which Megatron
    keeps in 16 bits, still 2; the reduce-scatters keep their bytes."""
    s = dataclasses.replace(BASE, zero_stage=3, zero3_prefetch=prefetch)
    fp8 = dataclasses.replace(s, fp8_param_gather=True)
    for name, ratio in (("layer_param_ag", 2), ("embedding_param_ag", 1),
                        ("lm_head_param_ag", 1)):
        ag = [_gathered(x, tmp_path / f"{name}{i}", name) for i, x in enumerate((s, fp8))]
        assert ag[0] > 0 and ag[0] == ratio * ag[1], name
    rs = [_gathered(x, tmp_path / f"rs{i}", "_grad_rs") for i, x in enumerate((s, fp8))]
    assert rs[0] > 0 and rs[0] == rs[1]


@pytest.mark.parametrize(("model", "kw"), [
    (MODEL, {}),
    (MODEL, {"zero3_prefetch": True}),
    (MODEL, {"pp": 1, "dp": 8}),
    (MOE, {"ep": 2, "tp": 1, "dp": 8}),
])
def test_zero3_fast_path_matches_replay(model: ModelSpec, kw: dict) -> None:
    """The fast path's ZeRO-3 terms take the 1-byte gathers as the trace does, and they
    never make a step slower."""
    s = dataclasses.replace(BASE, zero_stage=3, fp8_param_gather=True, **kw)
    fast = estimate(model, s, H100).step_time_s
    assert fast == pytest.approx(replayed(model, s, H100).step_time_s, rel=0.02)
    assert fast <= estimate(model, dataclasses.replace(s, fp8_param_gather=False),
                            H100).step_time_s


def test_zero3_memory_is_unchanged_by_it() -> None:
    """Under ZeRO-3 the sharded state is the fp32 master and Adam's moments either way, and a
    gathered FP8 weight (1 byte) with the transpose its backward makes (1 byte) takes what the
    16-bit gathered weight did: the memory model charges both alike (DESIGN.md)."""
    from tracegen import memory as mem

    s = dataclasses.replace(BASE, zero_stage=3)
    fp8 = dataclasses.replace(s, fp8_param_gather=True)
    for stage in (0, 1):
        assert mem.estimate(MODEL, s, stage, 10**8) == mem.estimate(MODEL, fp8, stage, 10**8)


@pytest.mark.parametrize("zero", [1, 3])
def test_a_memo_does_not_mix_the_two(zero: int) -> None:
    from analysis.fastpath import clear_cache

    s = dataclasses.replace(BASE, overlap_param_gather=True, zero_stage=zero)
    clear_cache()
    cold = estimate(MODEL, s, H100)
    clear_cache()
    estimate(MODEL, dataclasses.replace(s, fp8_param_gather=True), H100)
    assert estimate(MODEL, s, H100) == cold


@pytest.mark.parametrize("kw", [{"precision": "bf16"}, {"zero_stage": 0},
                                {"precision": "bf16", "zero_stage": 3}])
def test_it_needs_an_fp8_run_with_sharded_state(kw: dict) -> None:
    with pytest.raises(ConfigError, match="needs precision 'fp8' and zero_stage 1, 2 or 3"):
        dataclasses.replace(BASE, fp8_param_gather=True, **kw)


def test_the_command_line_takes_it_and_refuses_a_bf16_run() -> None:
    args = ("estimate", "--model", "llama3-8b", "--gpus", "16", "--mbs", "1", "--gbs", "32",
            "--system", "dgx-h100", "--zero", "1", "--fp8-param-gather")
    ok = run(*args, "--precision", "fp8")
    assert ok.returncode == 0 and "parameters gathered in FP8" in ok.stdout
    bad = run(*args)
    assert bad.returncode != 0 and "needs precision 'fp8'" in bad.stdout + bad.stderr
    assert "Traceback" not in bad.stdout + bad.stderr


def test_validate_applies_it_only_where_it_can(tmp_path: Path) -> None:
    """``--set strategy.fp8_param_gather=true`` over Megatron-Bridge's FP8 rows applies to
    each, the ZeRO-3 (Megatron-FSDP) row's too; a row made BF16 is predicted as before, saying
    the override was not applied."""
    runs = pl.read_csv(Path(__file__).parent / "data" / "megatron_bridge_h100_runs.csv",
                       infer_schema_length=0)
    bf16_id = "mbridge2511-llama3-70b"
    runs = runs.with_columns(pl.when(pl.col("id") == bf16_id).then(pl.lit("bf16"))
                             .otherwise(pl.col("precision")).alias("precision"))
    path = tmp_path / "runs.csv"
    runs.write_csv(path)
    over = {"strategy.fp8_param_gather": True}
    got = validate(path, fast=True, overrides=over)
    assert (got["status"] == "ok").all()
    bf16 = got.filter(pl.col("id") == bf16_id)
    assert "fp8_param_gather not applied" in bf16["assumptions"].item()
    assert bf16["predicted_iter_time_s"].item() == validate(path, fast=True).filter(
        pl.col("id") == bf16_id)["predicted_iter_time_s"].item()
    others = got.filter(pl.col("id") != bf16_id)
    assert others["assumptions"].str.contains("override fp8_param_gather = True").all()
    assert not others["assumptions"].str.contains("not applied").any()


def test_a_sweep_searches_it_and_the_precision_and_names_them(tmp_path: Path) -> None:
    """Both are search dimensions; FP8 gathers pair only with FP8 on ZeRO 1, and a result's
    strategy name says the precision and the gathers."""
    valid, invalid = enumerated(
        tmp_path, 'model = "llama3-8b"\nsystem = "dgx-h100"\ngpus = 16\n'
        'global_batch_size = 64\n[search]\ntp = [2]\npp = [1]\nvpp = [1]\n'
        'micro_batch_size = [1]\nrecompute = ["full"]\nzero_stage = [0, 1]\n'
        'sequence_parallel = [true]\nprecision = ["bf16", "fp8"]\n'
        'fp8_param_gather = [false, true]\n')
    assert sorted((s.precision, s.zero_stage, s.fp8_param_gather) for s in valid) == [
        ("bf16", 0, False), ("bf16", 1, False), ("fp8", 0, False), ("fp8", 1, False),
        ("fp8", 1, True)]
    assert invalid == 0  # FP8 gathers on bf16 runs or at ZeRO 0 do not apply: taken as off
    names = sorted(strategy_label(s) for s in valid if s.zero_stage == 1)
    assert names == ["tp2-pp1-dp8-mbs1-rcf-z1-fp8-sp", "tp2-pp1-dp8-mbs1-rcf-z1-fp8-sp-fp8pg",
                     "tp2-pp1-dp8-mbs1-rcf-z1-sp"]


def _weights(m: ModelSpec, s: Strategy, stage: int, params: int) -> int:
    from tracegen import memory as mem

    return mem.estimate(m, s, stage, params).weights_bytes


def test_fp8_weights_are_cached_beside_16_bit_ones_unless_they_are_the_parameters() -> None:
    """Transformer Engine keeps a row-wise and a column-wise FP8 copy of every GEMM weight
    across a step's micro-batches: a middle stage (layers only) holds 2 + 2 bytes a parameter
    under FP8, 2 with FP8 parameters (the FP8 weight and its transpose), 2 in bf16."""
    s = dataclasses.replace(BASE, pp=4, dp=2)
    params = 100_000_000
    assert _weights(MODEL, s, 1, params) == 4 * params
    assert _weights(MODEL, dataclasses.replace(s, fp8_param_gather=True), 1, params) == 2 * params
    assert _weights(MODEL, dataclasses.replace(s, precision="bf16"), 1, params) == 2 * params


@pytest.mark.parametrize(("kw", "stage", "copies"), [
    ({"pp": 4, "dp": 2}, 0, 1),  # the embedding
    ({"pp": 4, "dp": 2}, 3, 1),  # the output head
    ({"pp": 1, "dp": 8}, 0, 2),  # both on one stage
])
def test_the_embedding_and_head_are_not_cached(kw: dict, stage: int, copies: int) -> None:
    """They are not Transformer Engine GEMMs (Megatron runs them in 16 bits): the cache is 2
    bytes a parameter of the rest; a tied head on one chunk is the embedding itself."""
    s = dataclasses.replace(BASE, **kw)
    params, vocab = 300_000_000, MODEL.vocab_size * MODEL.hidden_size // s.tp
    assert _weights(MODEL, s, stage, params) == 2 * params + 2 * (params - copies * vocab)
    if copies == 2:
        tied = dataclasses.replace(MODEL, tied_embeddings=True)
        assert _weights(tied, s, stage, params) == 2 * params + 2 * (params - vocab)


def test_fsdp_is_left_as_it_was() -> None:
    """ZeRO-3 frees each gathered weight; no cache is charged there (not modelled)."""
    s = dataclasses.replace(BASE, zero_stage=3)
    assert _weights(MODEL, s, 1, 10**8) == _weights(
        MODEL, dataclasses.replace(s, precision="bf16"), 1, 10**8)


def test_a_runs_file_states_them_per_row(tmp_path: Path) -> None:
    """Columns beyond the schema: ``fp8_param_gather`` (true/false) and ``adam_moments_dtype``
    (text, any case) reach each row's strategy; a cell that does not parse, or a value the
    strategy refuses, skips only its row, named."""
    from analysis.validate import load_runs, row_inputs

    runs = Path(__file__).parent / "data" / "megatron_bridge_h100_runs.csv"
    rows = pl.read_csv(runs, infer_schema_length=0)
    ids = rows["id"].to_list()
    fp8pg = ["true" if "70b" in i else "False" if "405b" in i else "" for i in ids]
    moments = ["BF16" if "70b" in i else "" for i in ids]
    fp8pg[ids.index("mbridge2511-llama3.1-405b")] = "yes"  # unreadable
    moments[ids.index("mbridge2602-qwen3-235b-a22b")] = "fp4"  # refused
    edited = tmp_path / "runs.csv"
    rows.with_columns(pl.Series("fp8_param_gather", fp8pg),
                      pl.Series("adam_moments_dtype", moments)).write_csv(edited)
    got = {r["id"]: row_inputs(r) for r in load_runs(edited).iter_rows(named=True)}
    s70 = got["mbridge2511-llama3-70b"].strategy  # type: ignore[union-attr]
    assert s70.fp8_param_gather and s70.adam_moments_dtype == "bf16"
    s405 = got["mbridge2602-llama3.1-405b"].strategy  # type: ignore[union-attr]
    assert not s405.fp8_param_gather and s405.adam_moments_dtype == "fp32"
    status = dict(zip(*validate(edited, fast=True)[["id", "status"]], strict=True))
    assert "fp8_param_gather 'yes'" in status["mbridge2511-llama3.1-405b"]
    assert "adam_moments_dtype must be one of fp32, bf16, fp16, fp8" in status["mbridge2602-qwen3-235b-a22b"]
    assert sum(v == "ok" for v in status.values()) == len(ids) - 2
