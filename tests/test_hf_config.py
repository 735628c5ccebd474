"""Hugging Face ``config.json`` files as models (``tracegen.hf_config``): the public configs of
the models trainsim has presets for give those presets, GPT-2's gives its published parameter
count, and what trainsim cannot cost is refused with the reason."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from analysis.fastpath import estimate
from analysis.study import study_from_dict
from tracegen import ConfigError, ModelSpec, get_model, resolve_model
from tracegen.hf_config import from_hf_config

HF = Path(__file__).parent / "data" / "hf"


def _config(folder: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((HF / folder / "config.json").read_text())
    return data


def _write(tmp_path: Path, data: dict[str, Any]) -> Path:
    f = tmp_path / "config.json"
    f.write_text(json.dumps(data))
    return f


@pytest.mark.parametrize(("folder", "preset", "changes"), [
    ("Meta-Llama-3-8B", "llama3-8b", {}),
    ("Meta-Llama-3-70B", "llama3-70b", {}),
    ("Llama-3.1-405B", "llama3.1-405b", {}),
    ("Mixtral-8x7B-v0.1", "mixtral-8x7b", {}),
    ("Qwen2-57B-A14B", "qwen2-57b-a14b", {}),  # (a 65,536 window, not in use)
    ("Qwen3-30B-A3B", "qwen3-30b-a3b", {}),
    ("Qwen3-235B-A22B", "qwen3-235b-a22b", {}),
    ("GLM-4.5", "glm4.5-355b-a32b", {"mtp_layers": 1}),  # (the preset leaves its MTP out)
    ("DeepSeek-V3", "deepseek-v3", {}),
])
def test_a_public_config_is_its_preset(folder: str, preset: str, changes: dict[str, int]
                                       ) -> None:
    """Every field the presets took from the papers and these configs, MoE, shared experts,
    leading dense layers, MLA, group-limited routing and MTP included; named after the
    folder at its sequence length."""
    want = dataclasses.replace(get_model(preset), **changes)
    got = resolve_model(HF / folder / "config.json", want.seq_len)
    assert got.name == f"{folder}@seq{want.seq_len}"
    assert dataclasses.replace(got, name=want.name) == want


def test_gpt2s_config_gives_its_published_parameter_count() -> None:
    """GPT-2 small: 124,439,808 parameters in the Hugging Face model, of which trainsim leaves
    out the learned position embeddings (1,024 × 768), the biases and the LayerNorms (DESIGN.md,
    "Models"); tied embeddings, a 4h GELU MLP, dropout 0.1."""
    m = resolve_model(HF / "gpt2" / "config.json", 1024)
    h, layers = 768, 12
    biases = layers * (3 * h + h + 4 * h + h)
    norms = (2 * layers + 1) * 2 * h
    assert m.num_params() == 124_439_808 - 1024 * h - biases - norms
    assert (m.tied_embeddings, m.activation, m.ffn_hidden_size, m.dropout) == (True, "gelu",
                                                                              4 * h, 0.1)


@pytest.mark.parametrize(("folder", "billions"), [("DeepSeek-V2", 236), ("DeepSeek-V3", 671)])
def test_deepseeks_configs_give_their_published_sizes(folder: str, billions: int) -> None:
    """DeepSeek-V2 (arXiv:2405.04434: 236 B parameters; 160 routed experts of 1,536, top-6
    within 3 of 8 groups, two shared, the first layer dense) and V3 (arXiv:2412.19437: 671 B
    without its MTP module): within half a percent of the published totals (norms, which
    trainsim leaves out, and the rounding in between)."""
    m = resolve_model(HF / folder / "config.json", 4096)
    assert m.num_params() == pytest.approx(billions * 1e9, rel=0.005)  # (MTP not counted)
    assert m.is_mla and m.head_dim == 128 and m.qk_rope_head_dim == 64


def test_olmoes_config_gives_its_published_sizes() -> None:
    """OLMoE-1B-7B (Muennighoff et al. 2024, arXiv:2409.02060): 6.9 B parameters, 1.3 B of
    them active (8 of its 64 experts a token); every layer MoE, SwiGLU experts of 1,024. OLMo 2
    reads as the Llama layout it is (untied, SwiGLU, 32 heads of 128)."""
    m = resolve_model(HF / "OLMoE-1B-7B-0924" / "config.json", 4096)
    expert = 3 * m.hidden_size * m.moe_ffn_hidden_size
    idle = m.num_layers * (m.num_experts - m.experts_per_token) * expert
    assert m.num_params() == pytest.approx(6.9e9, rel=0.005)
    assert m.num_params() - idle == pytest.approx(1.3e9, rel=0.02)
    olmo2 = resolve_model(HF / "OLMo-2-1124-7B" / "config.json", 4096)
    assert (olmo2.activation, olmo2.tied_embeddings, olmo2.head_dim, olmo2.is_moe) == (
        "swiglu", False, 128, False)


def test_gemmas_config_gives_its_published_parameter_count() -> None:
    """Gemma 7B (Gemma Team 2024, Table 2): 7,751,248,896 non-embedding parameters, of which
    trainsim leaves out the RMSNorms (two a layer and the final one); a 256,000-token embedding,
    tied, on a 3,072-wide model; 16 heads of 256 (wider than 3,072 / 16); GeGLU."""
    m = resolve_model(HF / "gemma-7b" / "config.json", 8192)
    h = 3072
    assert m.num_params() - 256_000 * h == 7_751_248_896 - (2 * 28 + 1) * h
    assert (m.activation, m.tied_embeddings, m.head_dim, m.gated) == ("geglu", True, 256, True)


def test_a_geglu_mlp_costs_as_a_swiglu_one() -> None:
    """The same GEMMs and bytes (Shazeer 2020): only the gate's function differs."""
    from analysis.fastpath import estimate as fast
    from tracegen import Strategy

    m = resolve_model(HF / "gemma-7b" / "config.json", 8192)
    s = Strategy(tp=2, dp=4, micro_batch_size=1, global_batch_size=32, sequence_parallel=True)
    swiglu = dataclasses.replace(m, activation="swiglu")
    assert fast(m, s, "dgx-h100").step_time_s == fast(swiglu, s, "dgx-h100").step_time_s


def test_the_sequence_length_must_be_given(tmp_path: Path) -> None:
    f = HF / "Meta-Llama-3-8B" / "config.json"
    with pytest.raises(ConfigError, match=r"does not say the sequence length .*max_position_"
                                          r"embeddings 8192.*--seq-len N"):
        resolve_model(f)
    at = resolve_model(f"{f}@seq4096")
    assert at == resolve_model(f, 4096) and at.seq_len == 4096 and at.name.endswith("@seq4096")
    with pytest.raises(ConfigError, match="is a Hugging Face config: read it with"):
        ModelSpec.from_file(f)


@pytest.mark.parametrize(("folder", "preset"), [("Mistral-7B-v0.1", "mistral-7b"),
                                                ("gemma-2-9b", "gemma2-9b")])
def test_a_sliding_window_shorter_than_the_sequence_is_read(folder: str, preset: str) -> None:
    """Mistral 7B v0.1 attends within 4,096 tokens in every layer, Gemma 2 in every other one
    from the first (transformers' ``is_sliding = not layer_idx % 2``): at 8,192 tokens their
    presets; at 4,096 or less the window is the whole causal context, so no window."""
    f = HF / folder / "config.json"
    want = get_model(preset)
    assert dataclasses.replace(resolve_model(f, 8192), name=want.name) == want
    assert want.window == 4096 and want.windowed(0) and want.windowed(2) == want.windowed(1) + (
        preset == "gemma2-9b")
    m = resolve_model(f, 4096)
    assert m.sliding_window == 0 and m.window_pattern == "" and m.num_kv_heads == 8


@pytest.mark.parametrize(("changes", "pattern"), [
    ({"layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 14},
     "SSF"),
    ({"layer_types": ["full_attention"] * 42}, None),
    ({"model_type": "gemma3_text", "sliding_window": 1024, "sliding_window_pattern": 6},
     "SSSSSF"),
    ({"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 28,
      "num_hidden_layers": 42}, "F" * 28 + "S" * 14),
    ({"model_type": "qwen2", "use_sliding_window": False}, None),
])
def test_the_windowed_layers_follow_the_config(changes: dict[str, Any], pattern: str | None
                                               ) -> None:
    """``layer_types`` where a config lists them (transformers ≥ 4.53; shortened to its
    period), else the family's rule: Gemma 3 all but every sixth layer, Qwen from
    ``max_window_layers`` on where ``use_sliding_window`` (the first 28 full)."""
    data = _config("gemma-2-9b") | changes
    m = resolve_model_data(data)
    if pattern is None:
        assert m.window == 0
    else:
        assert m.window == data["sliding_window"] and m.window_pattern == pattern
        assert m.windowed_layers_in(range(42)) == pattern.count("S") * 42 // len(pattern)


def resolve_model_data(data: dict[str, Any]) -> ModelSpec:
    return from_hf_config(data, name="cfg", seq_len=8192)


def test_bad_layer_types_are_refused() -> None:
    data = _config("gemma-2-9b") | {"layer_types": ["sliding_attention", "chunked"] * 21}
    with pytest.raises(ConfigError, match="'layer_types' must list one of sliding_attention, "
                                          "full_attention for each of the 42 layers"):
        resolve_model_data(data)


@pytest.mark.parametrize(("edit", "message"), [
    ({"model_type": "falcon"}, "model_type 'falcon' is not one trainsim reads"),
    ({"model_type": "llama4"}, "holds its text model's keys in 'text_config'"),
    ({"model_type": "gemma3"}, "its 'text_config' as a config file of its own"),
    ({"num_hidden_layers": None}, "'num_hidden_layers' is missing"),
    ({"hidden_act": "tanh"}, "a gated MLP with 'tanh' is not one trainsim costs"),
    ({"decoder_sparse_step": 0}, "'decoder_sparse_step' must be ≥ 1"),
    ({"mlp_only_layers": list(range(48))}, "no layer is mixture-of-experts"),
])
def test_what_trainsim_cannot_cost_is_named(tmp_path: Path, edit: dict[str, Any],
                                            message: str) -> None:
    data = {k: v for k, v in {**_config("Qwen3-30B-A3B"), **edit}.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        resolve_model(_write(tmp_path, data), 4096)


def test_leading_dense_layers_of_a_qwen_moe_config(tmp_path: Path) -> None:
    m = resolve_model(_write(tmp_path, {**_config("Qwen3-30B-A3B"), "mlp_only_layers": [0, 1]}),
                      4096)
    assert m.first_dense_layers == 2 and m.num_experts == 128


def test_estimate_and_a_study_take_a_config(tmp_path: Path) -> None:
    """``--model config.json --seq-len N`` estimates the preset's step; a study names the
    config with its seq_len, and its model reference resolves back (``FILE@seqN``)."""
    f = HF / "Meta-Llama-3-8B" / "config.json"
    out = tmp_path / "e.json"
    r = subprocess.run([sys.executable, "-m", "analysis.cli", "estimate", "--model", str(f),
                        "--seq-len", "8192", "--system", "dgx-h100", "--gpus", "8", "--tp", "2",
                        "--mbs", "1", "--gbs", "32", "--json", str(out)],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    preset = estimate("llama3-8b", study_from_dict(
        {"model": "llama3-8b", "system": "dgx-h100", "gpus": 8, "global_batch_size": 32,
         "strategies": [{"tp": 2, "micro_batch_size": 1}]}, name="p").strategies[0], "dgx-h100")
    assert json.loads(out.read_text())["step_time_s"] == pytest.approx(preset.step_time_s,
                                                                       rel=1e-12)
    study = study_from_dict({"model": str(f), "seq_len": 8192, "system": "dgx-h100", "gpus": 8,
                             "global_batch_size": 32,
                             "strategies": [{"tp": 2, "micro_batch_size": 1}]}, name="hf")
    assert study.model_ref == f"{f}@seq8192"
    assert resolve_model(study.model_ref) == study.model


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6)
                     | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=5)


@settings(max_examples=150, deadline=None)
@given(folder=st.sampled_from(["Meta-Llama-3-8B", "Qwen2-57B-A14B", "DeepSeek-V3", "gpt2",
                               "gemma-2-9b", "Mixtral-8x7B-v0.1", "OLMoE-1B-7B-0924"]),
       data=st.data())
def test_any_value_in_any_key_gives_a_model_or_a_clear_error(folder: str, data: Any) -> None:
    """Bad input: whatever JSON value a config holds in any of its keys (or a key removed),
    reading it gives a model or a ConfigError naming the problem — never another exception
    from deep inside."""
    import tempfile

    config = _config(folder)
    # (and the keys that place sliding windows, which these configs leave out)
    key = data.draw(st.sampled_from([*sorted(config), "layer_types", "sliding_window_pattern",
                                     "max_window_layers", "use_sliding_window"]))
    value = data.draw(_JSON)
    if value is None:
        config.pop(key, None)
    else:
        config[key] = value
    with tempfile.TemporaryDirectory() as tmp:
        f = _write(Path(tmp), config)
        try:
            resolve_model(f, 8192)  # (longer than Mistral's and Gemma 2's windows)
        except ConfigError as err:
            assert str(err)


# gpt-oss-120b's config keys (transformers ``GptOssConfig``) with the model card's values
# (OpenAI 2025, arXiv:2508.10925, §2); no copy of the Hub's file is held here
GPT_OSS = {"model_type": "gpt_oss", "num_hidden_layers": 36, "hidden_size": 2880,
           "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
           "intermediate_size": 2880, "vocab_size": 201088, "num_local_experts": 128,
           "num_experts_per_tok": 4, "hidden_act": "silu", "sliding_window": 128,
           "tie_word_embeddings": False, "swiglu_limit": 7.0,
           "layer_types": ["sliding_attention", "full_attention"] * 18}


def _active(m: ModelSpec) -> int:
    """Parameters a token passes through: attention, its top-k experts and the router in
    every layer, and the output head (the model card's count leaves the embedding out)."""
    h, up = m.hidden_size, 3
    return (m.num_layers * (m.attention_params() + m.experts_per_token * up * h
                            * m.moe_ffn_hidden_size + h * m.num_experts)
            + m.vocab_size * h)


@pytest.mark.parametrize(("layers", "experts", "total_b", "active_b"),
                         [(36, 128, 116.83, 5.13), (24, 32, 20.91, 3.61)])
def test_gpt_oss_is_its_preset_and_its_model_cards_parameters(layers: int, experts: int,
                                                              total_b: float,
                                                              active_b: float) -> None:
    """gpt-oss-120b's config is the preset (MoE in every layer, 128-token windows in every other
    layer from the first); both sizes' total and active parameters are the model card's
    (Table 1: 116.83 B / 5.13 B and 20.91 B / 3.61 B) within 0.1%: what trainsim leaves out
    (biases, norms, attention sinks) is under that."""
    data = GPT_OSS | {"num_hidden_layers": layers, "num_local_experts": experts,
                      "layer_types": GPT_OSS["layer_types"][:layers]}
    m = from_hf_config(data, name="gpt-oss", seq_len=4096)
    if layers == 36:
        assert dataclasses.replace(m, name="gpt-oss-120b") == get_model("gpt-oss-120b")
    assert m.window == 128 and m.window_pattern == "SF"
    assert m.num_params() / 1e9 == pytest.approx(total_b, rel=1e-3)
    assert _active(m) / 1e9 == pytest.approx(active_b, rel=1e-3)
    without_types = {k: v for k, v in data.items() if k != "layer_types"}
    assert from_hf_config(without_types, name="gpt-oss", seq_len=4096) == m  # (the default)


# Gemma 3's text configs as the Hub's multimodal configs hold them: only what differs from
# ``Gemma3TextConfig``'s defaults (4B: the heads, head width and vocabulary are the class's)
GEMMA3_TEXT = {
    "4b": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
           "num_hidden_layers": 34, "sliding_window": 1024},
    "12b": {"model_type": "gemma3_text", "hidden_size": 3840, "intermediate_size": 15360,
            "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 8,
            "sliding_window": 1024},
    "27b": {"model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504,
            "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
            "head_dim": 128, "sliding_window": 1024},
}


@pytest.mark.parametrize(("size", "non_embedding_m"), [("4b", 3_209), ("12b", 10_759),
                                                       ("27b", 25_600)])
def test_gemma3_text_configs_give_the_reports_parameters(size: str, non_embedding_m: int
                                                         ) -> None:
    """Gemma 3's text configs, the class's defaults filled in as transformers fills them: five
    windowed layers of 1,024 tokens to a global one, and the non-embedding parameters of the
    Gemma 3 report's Table 1 (3,209 M / 10,759 M / 25,600 M) within 0.1% (trainsim leaves the
    norms out); the 27B's is the preset."""
    m = from_hf_config(GEMMA3_TEXT[size], name=f"gemma3-{size}", seq_len=32768)
    assert m.window == 1024 and m.window_pattern == "SSSSSF" and m.activation == "geglu"
    non_embedding = m.num_params() - m.embedding_params()
    assert non_embedding / 1e6 == pytest.approx(non_embedding_m, rel=1e-3)
    if size == "27b":
        assert dataclasses.replace(m, name="gemma3-27b") == get_model("gemma3-27b")


# Llama 4 Scout's config keys (transformers ``Llama4Config`` holding a ``Llama4TextConfig`` in
# ``text_config``) with the values of meta-llama/Llama-4-Scout-17B-16E; no copy of the Hub's
# file is held here (its vision_config is not read)
LLAMA4_SCOUT = {"model_type": "llama4", "vision_config": {"hidden_size": 1408},
                "text_config": {"model_type": "llama4_text", "num_hidden_layers": 48,
                                "hidden_size": 5120, "num_attention_heads": 40,
                                "num_key_value_heads": 8, "head_dim": 128,
                                "intermediate_size": 8192, "intermediate_size_mlp": 16384,
                                "num_local_experts": 16, "num_experts_per_tok": 1,
                                "interleave_moe_layer_step": 1, "vocab_size": 202048,
                                "hidden_act": "silu", "attention_chunk_size": 8192,
                                "tie_word_embeddings": False, "use_qk_norm": True}}


def _scout(**text: Any) -> dict[str, Any]:
    return {**LLAMA4_SCOUT, "text_config": {**LLAMA4_SCOUT["text_config"], **text}}


def test_llama4_scouts_config_is_its_preset_and_meta_s_parameters() -> None:
    """Scout's config (its text model) is the preset: every layer MoE, 16 experts of 8,192
    top-1 and a shared expert of that width; 17 B active parameters as Meta gives them (a
    token's attention, shared and routed expert in 48 layers, the embedding and the head:
    17.17 B); 107.8 B in all, which the vision encoder's ~0.8 B (34 layers of 1,408) takes
    to the 109 B Meta gives for the checkpoint."""
    m = from_hf_config(LLAMA4_SCOUT, name="scout", seq_len=8192)
    assert dataclasses.replace(m, name="llama4-scout") == get_model("llama4-scout")
    h, up = m.hidden_size, 3
    active = (m.num_layers * (m.attention_params() + 2 * up * h * m.moe_ffn_hidden_size
                              + h * m.num_experts) + 2 * m.vocab_size * h)
    assert active / 1e9 == pytest.approx(17.0, rel=0.015)
    assert m.num_params() / 1e9 == pytest.approx(107.77, rel=1e-3)
    assert 108.5 < m.num_params() / 1e9 + 0.8 < 109.5


@pytest.mark.parametrize(("text", "pattern"), [
    ({}, "SSSF"),  # the class's no_rope_layer_interval 4
    ({"no_rope_layer_interval": 2}, "SF"),
    ({"no_rope_layers": [1, 1, 0] * 16}, "SSF"),  # 1: RoPE, chunked; 0: NoPE, full
    ({"no_rope_layers": [1] * 48}, ""),  # every layer chunked
])
def test_llama4s_chunked_layers_follow_its_irope(text: dict[str, Any], pattern: str) -> None:
    """iRoPE: the layers with RoPE attend within 8,192-token chunks, the NoPE ones over the
    whole sequence — where the chunk is shorter than the sequence (at 8,192 tokens none)."""
    m = from_hf_config(_scout(**text), name="scout", seq_len=32768)
    assert m.chunked and m.window == 8192 and m.window_pattern == pattern
    assert not from_hf_config(_scout(**text), name="scout", seq_len=8192).window
    unchunked = from_hf_config(_scout(**text, attention_chunk_size=None), name="scout",
                               seq_len=32768)  # (null: no chunks, full attention everywhere)
    assert not unchunked.window and unchunked.attention_chunk == 0


@pytest.mark.parametrize(("text", "message"), [
    ({"interleave_moe_layer_step": 0}, "'interleave_moe_layer_step' must be ≥ 1"),
    ({"moe_layers": []}, "no layer is mixture-of-experts"),
    ({"no_rope_layers": [1, 0]}, "for each of the 48 layers"),
    ({"no_rope_layer_interval": 0}, "'no_rope_layer_interval' must be ≥ 1"),
    ({"intermediate_size_mlp": None}, "'intermediate_size_mlp' is missing"),
])
def test_what_llama4_configs_trainsim_cannot_cost_are_named(text: dict[str, Any], message: str
                                                           ) -> None:
    data = _scout(**text)
    data["text_config"] = {k: v for k, v in data["text_config"].items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        from_hf_config(data, name="maverick", seq_len=32768)
    with pytest.raises(ConfigError, match="'text_config'"):
        from_hf_config({"model_type": "llama4", "text_config": 3}, name="x", seq_len=4096)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_value_in_a_llama4_text_key_gives_a_model_or_a_clear_error(data: Any) -> None:
    text = dict(LLAMA4_SCOUT["text_config"])  # type: ignore[call-overload]
    key = data.draw(st.sampled_from([*sorted(text), "no_rope_layers", "no_rope_layer_interval",
                                     "moe_layers"]))
    value = data.draw(_JSON)
    if value is None:
        text.pop(key, None)
    else:
        text[key] = value
    try:
        from_hf_config({**LLAMA4_SCOUT, "text_config": text}, name="scout", seq_len=32768)
    except ConfigError as err:
        assert str(err)


def test_llama4_mavericks_config_is_its_preset_and_meta_s_parameters() -> None:
    """Maverick: Scout's shape with 128 experts in every other layer from the second
    (``interleave_moe_layer_step`` 2: ``moe_layer_pattern`` "DM"), the dense layers' MLP
    16,384 wide: Meta's 400 B parameters and 17 B active within 0.5% and 1.5% (a token's
    attention, dense MLPs, shared and routed expert, embedding and head: 17.18 B)."""
    m = from_hf_config(_scout(num_local_experts=128, interleave_moe_layer_step=2),
                       name="maverick", seq_len=8192)
    assert dataclasses.replace(m, name="llama4-maverick") == get_model("llama4-maverick")
    assert m.moe_layer_pattern == "DM" and m.dense_layers_in(range(48)) == 24
    h, up = m.hidden_size, 3
    active = (m.num_layers * m.attention_params() + 24 * up * h * m.ffn_hidden_size
              + 24 * (2 * up * h * m.moe_ffn_hidden_size + h * m.num_experts)
              + 2 * m.vocab_size * h)
    assert active / 1e9 == pytest.approx(17.0, rel=0.015)
    assert m.num_params() / 1e9 == pytest.approx(400, rel=0.005)
    listed = from_hf_config(_scout(num_local_experts=128, moe_layers=list(range(1, 48, 2))),
                            name="maverick", seq_len=8192)
    assert listed == m  # (the layers listed as the step places them)


@pytest.mark.parametrize(("kind", "keys", "first", "pattern"), [
    ("Qwen3-30B-A3B", {"decoder_sparse_step": 2}, 0, "DM"),  # (i + 1) % 2 == 0
    ("Qwen3-30B-A3B", {"mlp_only_layers": [0, 1]}, 2, ""),  # leading: as before
    ("Qwen3-30B-A3B", {"mlp_only_layers": [1, 3]}, 0, None),  # (no period shorter than 47)
    ("DeepSeek-V3", {"moe_layer_freq": 2}, 3, "MD"),  # 3 dense, then MoE at even layers
])
def test_moe_every_nth_layer_follows_each_familys_rule(kind: str, keys: dict[str, Any],
                                                       first: int, pattern: str | None) -> None:
    """Which layers are MoE, by each family's decoder-layer rule: Qwen's MoE where (i + 1) is a
    multiple of decoder_sparse_step and i is not in mlp_only_layers; DeepSeek's from
    first_k_dense_replace on where i is a multiple of moe_layer_freq. Leading dense layers
    stay first_dense_layers; anything else is a repeating moe_layer_pattern."""
    m = from_hf_config({**_config(kind), **keys}, name="x", seq_len=4096)
    want = [not m.is_dense_layer(i) for i in range(m.num_layers)]
    data = {**_config(kind), **keys}
    if kind.startswith("Qwen"):
        step = data.get("decoder_sparse_step", 1)
        rule = [i not in data.get("mlp_only_layers", []) and (i + 1) % step == 0
                for i in range(m.num_layers)]
    else:
        rule = [i >= data["first_k_dense_replace"] and i % data["moe_layer_freq"] == 0
                for i in range(m.num_layers)]
    assert want == rule
    assert m.first_dense_layers == first
    if pattern is not None:
        assert m.moe_layer_pattern == pattern


def test_a_config_without_its_model_type_is_named_as_one(tmp_path: Path) -> None:
    """A config.json that lost its model_type is not read as a trainsim model file (a list of
    unknown keys): the refusal names the Hugging Face keys it has and what to add."""
    f = tmp_path / "config.json"
    f.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
                             "num_hidden_layers": 32, "intermediate_size": 14336,
                             "num_attention_heads": 32, "vocab_size": 128256}))
    with pytest.raises(ConfigError, match=r"looks like a Hugging Face config\.json "
                       r"\(architectures, intermediate_size, num_hidden_layers\) without its "
                       r"model_type"):
        resolve_model(str(f), 4096)


def test_a_model_file_without_seq_len_takes_the_one_given(tmp_path: Path) -> None:
    """A trainsim model file that leaves out seq_len is trained at --seq-len (or @seqN); with
    neither, the refusal says to give one."""
    spec = get_model("llama3-8b").to_dict()
    del spec["seq_len"]
    f = tmp_path / "m.json"
    f.write_text(json.dumps(spec))
    assert resolve_model(str(f), 2048).seq_len == 2048
    assert resolve_model(f"{f}@seq1024").seq_len == 1024
    with pytest.raises(ConfigError, match=r"has no seq_len: add seq_len = N .* or give --seq-len"):
        resolve_model(str(f))
