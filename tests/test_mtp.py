"""Multi-token prediction (DeepSeek-V3 §2.2; Megatron-Core ``--mtp-num-layers``): what an MTP
module runs and holds on the last pipeline stage, its FLOPs as Megatron-LM counts them, its
memory, the shared embedding's gradient all-reduce, and bad input."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from analysis.fastpath import estimate
from replay import get_system
from replay.reader import read_et
from tests.test_fastpath import MODEL, MOE, _replayed_s
from tracegen import ConfigError, ModelSpec, Strategy, generate, get_model
from tracegen import ops as O
from tracegen.flops import model_flop_per_step
from tracegen.memory import estimate as memory
from tracegen.memory import mtp_activation_bytes
from tracegen.program import RoleProgram

H100 = get_system("dgx-h100")
DENSE = dataclasses.replace(MODEL, mtp_layers=1)
S = Strategy(tp=2, pp=2, dp=2, sequence_parallel=True, micro_batch_size=1, global_batch_size=8)


def _names(items: list[O.Item]) -> list[str]:
    return [it.name for it in items]


def test_a_module_runs_its_input_and_a_layer_and_the_head_runs_once_more() -> None:
    """Embedding of the next tokens (vocab-parallel: reduce-scattered under SP), two norms, the
    2h → h projection between its input's gather and its output's gather, then a layer — the
    model's ops; the shared head runs over the model's and every module's tokens together."""
    fwd = O.mtp_fwd(DENSE, S)
    names = _names(fwd)
    assert names[:7] == ["mtp_embedding", "mtp_embedding_rs", "mtp_enorm", "mtp_hnorm",
                         "mtp_eh_ag", "mtp_eh_proj", "mtp_eh_gather"]
    assert names[7:] == _names(O.layer_fwd(DENSE, S))
    two = dataclasses.replace(DENSE, mtp_layers=2)
    heads = {m.mtp_layers: {it.name: it for it in O.head_fwd(m, S)} for m in (MODEL, two)}
    assert heads[2]["lm_head"].m == 3 * heads[0]["lm_head"].m  # (1 + 2) × the tokens
    assert heads[2]["cross_entropy"].flop == 3 * heads[0]["cross_entropy"].flop
    d = O.dims(DENSE, S)
    proj = fwd[5]
    assert isinstance(proj, O.Op) and (proj.m, proj.n, proj.k) == (d.tokens, DENSE.hidden_size
                                                                   // 2, 2 * DENSE.hidden_size)
    gathers = {it.name: it.size_bytes for it in fwd if isinstance(it, O.Comm)}
    assert gathers["mtp_eh_ag"] == d.tokens * 2 * d.h * O.ACT_BYTES // 2  # the 2h input's shard
    assert gathers["mtp_eh_gather"] == d.tokens * d.h // 2 * O.ACT_BYTES  # h/tp of the output


def test_the_backward_mirrors_the_forward() -> None:
    """The head's and the layer's backward, then the projection's data and weight gradients
    with its input gathered again (SP) and the gradient reduce-scattered; every forward GEMM
    has its two; the reduce-scatters carry what the gathers brought."""
    fwd, bwd = O.mtp_fwd(DENSE, S), O.mtp_bwd(DENSE, S)
    gemms = {it.name for it in fwd if isinstance(it, O.Op) and it.kind == "gemm"}
    grads = {it.name for it in bwd if isinstance(it, O.Op) and it.kind == "gemm"}
    assert grads == {f"{g}_{x}" for g in gemms for x in ("dgrad", "wgrad")}
    assert sum(it.flop for it in bwd if isinstance(it, O.Op) and it.kind == "gemm") == 2 * sum(
        it.flop for it in fwd if isinstance(it, O.Op) and it.kind == "gemm")
    sizes = {it.name: it.size_bytes for it in bwd if isinstance(it, O.Comm)}
    d = O.dims(DENSE, S)
    assert sizes["mtp_eh_ag_bwd"] == d.tokens * 2 * d.h * O.ACT_BYTES  # reduce-scatter: full
    assert sizes["mtp_eh_in_ag"] == sizes["mtp_eh_ag_bwd"] // 2
    no_sp = O.mtp_bwd(DENSE, dataclasses.replace(S, sequence_parallel=False))
    assert "mtp_eh_in_grad_ar" in _names(no_sp) and "mtp_eh_in_ag" not in _names(no_sp)


def test_the_last_stage_holds_the_modules_and_a_copy_of_the_embedding() -> None:
    """Two modules on the last stage, before the head: each a layer's weights and the 2h·h
    projection (split over tp), after a copy of the embedding they read, the first stage's
    weights (pp > 1, untied). Summed over the stages at tp 1: the model, its MTP modules and
    that copy."""
    m = dataclasses.replace(MODEL, mtp_layers=2)
    s = dataclasses.replace(S, tp=1, sequence_parallel=False, dp=4)
    last = RoleProgram(m, s, 1).chunk_runs(1)
    (emb, _), (mtp, n), (head, _) = last[-3:]
    assert (emb.name, mtp.name, n, head.name) == ("mtp_embedding", "mtp", 2, "lm_head")
    assert mtp.dense == m.layer_params() + 2 * m.hidden_size ** 2
    assert emb.dense == head.dense == m.vocab_size * m.hidden_size
    held = sum(sum(RoleProgram(m, s, st).stage_params().values()) for st in range(2))
    assert held == m.num_params() + m.mtp_params() + m.vocab_size * m.hidden_size
    # one stage: the embedding is already there
    one = RoleProgram(m, dataclasses.replace(s, pp=1, dp=8), 0)
    assert sum(one.stage_params().values()) == m.num_params() + m.mtp_params()


def test_a_moe_models_module_is_a_moe_layer() -> None:
    m = dataclasses.replace(MOE, mtp_layers=1)
    s = Strategy(dp=4, ep=4, pp=2, global_batch_size=8)
    mtp = RoleProgram(m, s, 1).mtp_block()
    layer = RoleProgram(m, s, 1).layer_block()
    assert mtp.expert == layer.expert > 0
    assert "moe_dispatch" in _names(O.mtp_fwd(m, s))


def test_flops_are_megatrons_count() -> None:
    """Megatron-LM's ``num_floating_point_operations`` with mtp_num_layers D: the layers term
    over L + D layers, 3·2·D·(3h + 2h²) per token for the norms and projection, and the logits
    term (D + 1) times — for a GPT shape, 72·B·s·h²·((L + D)(1 + s/6h) + ...) by hand."""
    m = ModelSpec(name="g", num_layers=4, hidden_size=512, num_attention_heads=8,
                  ffn_hidden_size=2048, vocab_size=1000, seq_len=256, mtp_layers=2)
    b, s, h, v, n_l, d = 16, 256, 512, 1000, 4, 2
    layers = 24 * b * s * h * h * (n_l + d) * (1 + s / (6 * h))  # GPT: 72·B·s·h²(1 + s/6h)/3
    by_hand = 3 * layers + 6 * b * s * d * (3 * h + 2 * h * h) + 6 * b * s * h * v * (d + 1)
    assert model_flop_per_step(m, b) == pytest.approx(by_hand, rel=1e-12)
    assert model_flop_per_step(dataclasses.replace(m, mtp_layers=0), b) == pytest.approx(
        3 * 24 * b * s * h * h * n_l * (1 + s / (6 * h)) + 6 * b * s * h * v, rel=1e-12)


def test_memory_of_the_last_stage_grows_by_the_modules() -> None:
    """At 1F1B the last stage holds one micro-batch: its activations grow by the modules'
    (a layer kept whole and its input), its logits by one fp32 copy per module; the first
    stage is unchanged."""
    base = dataclasses.replace(DENSE, mtp_layers=0)
    for stage in (0, 1):
        with_mtp = memory(DENSE, S, stage, 10_000)
        without = memory(base, S, stage, 10_000)
        d_act = with_mtp.activations_bytes - without.activations_bytes
        d_logits = with_mtp.logits_bytes - without.logits_bytes
        if stage == 0:
            assert (d_act, d_logits) == (0, 0)
        else:
            assert d_act == mtp_activation_bytes(DENSE, S) > 0
            assert d_logits == DENSE.seq_len * DENSE.vocab_size // 2 * 4


def test_only_the_last_stage_runs_longer_and_fast_path_equals_replay() -> None:
    est, base = estimate(DENSE, S, H100), estimate(dataclasses.replace(DENSE, mtp_layers=0),
                                                     S, H100)
    assert est.stage_fwd_s[0] == base.stage_fwd_s[0]
    assert est.stage_fwd_s[1] > base.stage_fwd_s[1] and est.stage_bwd_s[1] > base.stage_bwd_s[1]
    assert est.step_time_s > base.step_time_s
    assert est.step_time_s == pytest.approx(_replayed_s(DENSE, S, H100), rel=0.02)


def test_the_trace_names_the_modules_and_all_reduces_the_embedding(tmp_path: Path) -> None:
    """The last stage's trace runs the module (``mtp0``) after its layers, before the head;
    both end stages all-reduce the embedding's gradient over their group."""
    generate(DENSE, S, tmp_path)
    per_file = [[n.name for n in read_et(f, int(f.name.split(".")[-2])).nodes]
                for f in sorted(tmp_path.glob("*.et"))]
    assert len(per_file) == 2  # one representative rank a stage
    first, last = sorted(per_file, key=lambda names: any(".lm_head" in n for n in names))
    assert not any(".mtp0." in n for n in first)
    forward = [n for n in last if n.startswith("F0.")]
    mtp = [i for i, n in enumerate(forward) if ".mtp0." in n]
    head = [i for i, n in enumerate(forward) if n.endswith(".head.lm_head")]
    assert mtp and head and max(mtp) < min(head)
    assert all("step.embedding_grad_ar" in names for names in (first, last))


def test_the_preset_and_bad_input() -> None:
    assert get_model("deepseek-v3").mtp_layers == 1
    assert get_model("deepseek-v3").mtp_params() == pytest.approx(11.6e9, rel=0.01)
    with pytest.raises(ConfigError, match="mtp_layers must be ≥ 0"):
        dataclasses.replace(MODEL, mtp_layers=-1)


def test_recompute_runs_the_modules_again(tmp_path: Path) -> None:
    """Full recompute checkpoints each module whole (Megatron-Core's
    ``MultiTokenPredictionLayer``), keeping only its input; selective recompute applies its
    modules to the module's layer. The trace runs them again, memory keeps what is said, HFU
    counts one more forward of the module's layer, and the fast path agrees with replay."""
    from tracegen.flops import recompute_flop_per_step

    full = dataclasses.replace(S, recompute="full")
    sel = dataclasses.replace(S, recompute="selective", recompute_modules="layernorm,mlp")
    generate(DENSE, full, tmp_path)
    last = max(tmp_path.glob("*.et"), key=lambda f: int(f.name.split(".")[-2]))
    names = [n.name for n in read_et(last, int(last.name.split(".")[-2])).nodes]
    assert any(".mtp0.rc." in n and n.endswith("mtp_eh_proj") for n in names)
    d = O.dims(DENSE, S)
    assert mtp_activation_bytes(DENSE, full) == 2 * d.tokens_sp * d.h  # the module's input
    assert mtp_activation_bytes(DENSE, sel) < mtp_activation_bytes(DENSE, S)
    b = 8
    extra = (recompute_flop_per_step(DENSE, b, "full")
             - recompute_flop_per_step(dataclasses.replace(DENSE, mtp_layers=0), b, "full"))
    one_layer = (model_flop_per_step(dataclasses.replace(MODEL, num_layers=2), b)
                 - model_flop_per_step(dataclasses.replace(MODEL, num_layers=1), b)) // 3
    assert extra == pytest.approx(one_layer, rel=1e-9)
    for st in (full, sel):
        assert estimate(DENSE, st, H100).step_time_s == pytest.approx(
            _replayed_s(DENSE, st, H100), rel=0.02)
