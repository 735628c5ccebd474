"""Multi-head latent attention (``ModelSpec.kv_lora_rank`` and friends; DeepSeek-V2/V3,
Megatron-Core's MLASelfAttention): parameters (duplicated down-projections), FLOPs, the
trace's ops and TP collectives, activation memory and the fast path against replay."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from analysis.fastpath import estimate
from replay import get_system
from tests.conftest import read_et, replayed
from tracegen import ConfigError, ModelSpec, Strategy, generate, get_model
from tracegen.fit import check_fits_model
from tracegen.flops import model_flop_per_step, recompute_flop_per_step
from tracegen.memory import activation_bytes_per_layer
from tracegen.ops import layer_bwd, layer_fwd
from tracegen.program import RoleProgram

MLA = ModelSpec(name="mla", num_layers=4, hidden_size=256, num_attention_heads=8,
                head_dim=32, ffn_hidden_size=512, vocab_size=1024, seq_len=256,
                activation="swiglu", kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16,
                v_head_dim=32)
SYSTEM = get_system("dgx-h100")


def test_deepseek_v3_counts_its_published_parameters() -> None:
    """DeepSeek-V3: 671 B parameters, 37 B activated per token (§1, without its MTP module)."""
    m = get_model("deepseek-v3")
    assert m.num_params() / 1e9 == pytest.approx(671, rel=0.002)
    h = m.hidden_size
    active = (m.num_layers * m.attention_params() + 3 * 3 * h * m.ffn_hidden_size
              + 58 * (3 * h * m.moe_ffn_hidden_size * 9 + h * m.num_experts)
              + m.embedding_params())
    assert active / 1e9 == pytest.approx(37, rel=0.02)


def test_attention_weights_and_their_tensor_parallel_split() -> None:
    """Q: 256·96 down + 96·8·48 up; K/V: 256·(64 + 16) down + 64·8·(32 + 32) up; out 8·32·256.
    The down-projections are whole on every TP rank, the rest split."""
    assert MLA.mla_down_params() == 256 * (96 + 64 + 16)
    assert MLA.mla_up_params() == 96 * 8 * 48 + 64 * 8 * 64 + 8 * 32 * 256
    block = RoleProgram(MLA, Strategy(tp=2), 0).layer_block()
    assert block.dense == MLA.mla_down_params() + MLA.mla_up_params() // 2 + 3 * 256 * 512 // 2


def test_flops_count_mla_projections_and_its_head_widths() -> None:
    """Per token and layer, forward: 2 FLOPs per attention weight, QKᵀ 2·s·heads·48, attention·V
    2·s·heads·32 (full, as Megatron counts); ×3 with the backward. Selective recompute of the
    core attention repeats those two products."""
    b, s, n_l = 2, MLA.seq_len, MLA.num_layers
    plain = dataclasses.replace(MLA, kv_lora_rank=0, q_lora_rank=0, qk_rope_head_dim=0,
                                v_head_dim=0)
    attn_std = 3 * b * s * n_l * (2 * plain.attention_params() + 4 * s * plain.q_size)
    attn_mla = 3 * b * s * n_l * (2 * MLA.attention_params() + 2 * s * 8 * (48 + 32))
    assert model_flop_per_step(MLA, b) - model_flop_per_step(plain, b) == pytest.approx(
        attn_mla - attn_std, abs=4)
    assert recompute_flop_per_step(MLA, b, "selective") == 2 * b * s * s * 8 * 80 * n_l


def _names(items: list) -> list[str]:
    return [it.name for it in items]


@pytest.mark.parametrize("sp", [False, True])
def test_the_layer_runs_mla_with_its_tp_collectives(sp: bool) -> None:
    """Down-projections and latent norms on the rank's own tokens; with SP the latents (Q's 96,
    K/V's 64, the rotary key's 16) all-gathered, then the up-projections on every token; the
    backward gathers them again (SP) or all-reduces their gradients (no SP)."""
    s = Strategy(tp=2, sequence_parallel=sp)
    fwd, bwd = layer_fwd(MLA, s), layer_bwd(MLA, s)
    names = _names(fwd)
    assert names[:5] == ["ln1", "q_down", "q_norm", "kv_down", "kv_norm"]
    down = next(it for it in fwd if it.name == "q_down")
    tokens = MLA.seq_len
    assert down.m == (tokens // 2 if sp else tokens) and down.n == 96
    up = next(it for it in fwd if it.name == "kv_up")
    assert (up.m, up.n, up.k) == (tokens, 4 * 64, 64)
    latent = tokens * (96 + 64 + 16) * 2
    comms = {it.name: it for it in fwd + bwd if hasattr(it, "coll") and it.axis == "tp"}
    if sp:
        assert comms["mla_latent_ag"].size_bytes == latent // 2
        assert comms["mla_latent_in_ag"].size_bytes == latent // 2
        assert comms["mla_latent_ag_bwd"].coll == "REDUCE_SCATTER"
        assert "mla_latent_grad_ar" not in comms
    else:
        assert comms["mla_latent_grad_ar"].size_bytes == latent
        assert "mla_latent_ag" not in comms
    attn = next(it for it in fwd if it.name == "flash_attn")
    assert attn.flop == 4 * 1 * tokens * tokens * 40 * 4 // 2  # heads 8/2, mean head 40


@pytest.mark.parametrize("sp", [False, True])
def test_activations_keep_latents_and_per_head_tensors(sp: bool) -> None:
    """Per token beyond LN1's input and output: the latents' norm inputs and outputs (2 + 2
    bytes × (96 + 64)) and the rotary key (2·16) on the rank's own tokens; Q, K (2·48 per head
    each), V and the output (2·32 each) split over TP — against Korthikanti's GQA terms."""
    s = Strategy(tp=2, sequence_parallel=sp, global_batch_size=1)
    plain = dataclasses.replace(MLA, kv_lora_rank=0, q_lora_rank=0, qk_rope_head_dim=0,
                                v_head_dim=0)
    replicated = 4 * (96 + 64) + 2 * 16
    split = 8 * (4 * 48 + 4 * 32) - (2 * 256 + 4 * 256 + 2 * 256)  # less Q, K, V, out of GQA
    per_token = (replicated + split) / 2 if sp else replicated + split / 2
    got = activation_bytes_per_layer(MLA, s) - activation_bytes_per_layer(plain, s)
    assert got == pytest.approx(MLA.seq_len * per_token, abs=1)


def test_the_trace_holds_the_mla_ops(tmp_path: Path) -> None:
    generate(MLA, Strategy(tp=2, dp=2, sequence_parallel=True, global_batch_size=2), tmp_path,
             mode="representative")
    _, nodes = read_et(tmp_path / "trainsim.0.et")
    ops = {hit.group(1) for n in nodes
           if (hit := re.search(r"\.L0\.([a-z_]+)$", n.name)) is not None}
    assert {"q_down", "q_norm", "kv_down", "kv_norm", "mla_latent_ag", "q_up", "kv_up",
            "flash_attn", "attn_out"} <= ops


@pytest.mark.parametrize(("model", "kw"), [
    (MLA, dict()), (MLA, dict(tp=2, sequence_parallel=True)), (MLA, dict(tp=2)),
    (MLA, dict(tp=2, sequence_parallel=True, recompute="selective")),
    (MLA, dict(tp=2, sequence_parallel=True, pp=2, vpp=2, schedule="interleaved_1f1b")),
    (MLA, dict(zero_stage=3, dp=4, pp=1)), (MLA, dict(tp=2, sequence_parallel=True,
                                                     precision="fp8")),
    (dataclasses.replace(MLA, q_lora_rank=0), dict(tp=2, sequence_parallel=True)),
    (MLA, dict(tp=2, sequence_parallel=True, recompute="selective",
               recompute_modules="mla_up_proj,core_attn")),
    (MLA, dict(tp=2, recompute="selective", recompute_modules="layernorm,mla_up_proj")),
])
def test_fast_path_equals_replay_with_mla(model: ModelSpec, kw: dict) -> None:
    base: dict[str, object] = dict(pp=2, dp=2, global_batch_size=8, dp_bucket_params=100_000)
    s = Strategy(**{**base, **kw})  # type: ignore[arg-type]
    ref = replayed(model, s, SYSTEM)
    assert estimate(model, s, SYSTEM).step_time_s == pytest.approx(ref.step_time_s, rel=0.005)


def test_what_mla_is_not_modelled_with_is_refused() -> None:
    with pytest.raises(ConfigError, match="num_kv_heads must equal num_attention_heads"):
        dataclasses.replace(MLA, num_kv_heads=4)
    with pytest.raises(ConfigError, match="set kv_lora_rank"):
        dataclasses.replace(MLA, kv_lora_rank=0)
    with pytest.raises(ConfigError, match="not modelled"):
        check_fits_model(Strategy(cp=2), MLA)
    with pytest.raises(ConfigError, match="not modelled"):
        check_fits_model(Strategy(tp=2, sequence_parallel=True, tp_comm_overlap=True), MLA)


def test_a_runs_file_may_give_mla_widths(tmp_path: Path) -> None:
    """Extra columns, read when present: an MLA row predicts with its latents."""
    from tests.test_moe_folding import _row_inputs

    got = _row_inputs(tmp_path, num_kv_heads=8, kv_lora_rank=128, q_lora_rank=256,
                      qk_rope_head_dim=32, v_head_dim=64, expert_tp=0, ep=4)
    assert not isinstance(got, str), got
    assert (got.model.kv_lora_rank, got.model.q_lora_rank, got.model.qk_rope_head_dim,
            got.model.v_head_dim) == (128, 256, 32, 64)


@pytest.mark.parametrize("sp", [False, True])
def test_recomputing_the_up_projections_drops_q_k_v(sp: bool) -> None:
    """``mla_up_proj`` (Megatron-Core's MLA up-projection checkpoint): Q and K (2·48 bytes per
    head each) and V (2·32) are rebuilt, not kept — 8 heads' worth per token split over TP; the
    attention output and the latents stay."""
    base = Strategy(tp=2, sequence_parallel=sp, global_batch_size=1, recompute="selective")
    up = dataclasses.replace(base, recompute_modules="core_attn,mla_up_proj")
    dropped = 8 * (2 * 48 + 2 * 48 + 2 * 32) / 2
    got = activation_bytes_per_layer(MLA, base) - activation_bytes_per_layer(MLA, up)
    assert got == pytest.approx(MLA.seq_len * dropped, abs=1)


@pytest.mark.parametrize(("sp", "gather"), [(True, 1), (False, 0)])
def test_the_recompute_reruns_the_up_projections(sp: bool, gather: int) -> None:
    """What runs again before a layer's backward: the latents' gather (with SP), Q's and K/V's
    up-projections and the rotary embedding, in the forward's order."""
    s = Strategy(tp=2, sequence_parallel=sp, global_batch_size=1, recompute="selective",
                 recompute_modules="mla_up_proj")
    names = [it.name for it in RoleProgram(MLA, s, 0).selective_items(s.selective_modules)]
    assert names == ["mla_latent_ag"] * gather + ["q_up", "kv_up", "rope"]


def test_hfu_counts_the_recomputed_up_projections() -> None:
    """2 FLOPs per weight per token: Q's 96 → 8·48 and K/V's 64 → 8·(32 + 32), every layer."""
    extra = recompute_flop_per_step(MLA, 2, "selective", modules=("mla_up_proj",))
    assert extra == 2 * 2 * MLA.seq_len * MLA.num_layers * (96 * 8 * 48 + 64 * 8 * 64)


def test_up_projection_recompute_needs_mla() -> None:
    plain = get_model("llama3-8b")
    with pytest.raises(ConfigError, match="'mla_up_proj' recomputes multi-head latent"):
        check_fits_model(Strategy(recompute="selective", recompute_modules="mla_up_proj"), plain)


def test_deepseek_v3_fit_hint_may_recompute_the_up_projections() -> None:
    """NVIDIA's DeepSeek-V3 layout on 1,024 H100s with the micro-batch doubled does not fit;
    the hint weighs the up-projections with the MLP among its options and names the fastest
    that fits."""
    from analysis.glance import fit_by_recompute

    m = get_model("deepseek-v3")
    s = Strategy(tp=2, pp=8, dp=64, ep=64, expert_tp=1, sequence_parallel=True,
                 micro_batch_size=2, global_batch_size=8192, zero_stage=1, precision="fp8",
                 first_stage_layers=4, last_stage_layers=3)
    hw = get_system("dgx-h100")
    assert not estimate(m, s, hw).fits
    got = fit_by_recompute(m, s, hw)
    assert got is not None and got[1].fits
    up = dataclasses.replace(s, recompute="selective",
                             recompute_modules="mla_up_proj,core_attn,moe_act")
    assert estimate(m, up, hw).peak_memory_GiB < estimate(
        m, dataclasses.replace(up, recompute_modules="core_attn,moe_act"), hw).peak_memory_GiB
    assert got[1].step_time_s <= estimate(m, up, hw).step_time_s or not estimate(m, up, hw).fits
