"""A model at another sequence length: ``--seq-len``, ``NAME@seqN`` and a study's ``seq_len``
give the model a file with that length would, under a name that says so and resolves back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.glance import glance
from analysis.study import load_study
from replay import get_system
from tracegen import ConfigError, ModelSpec, Strategy, get_model, resolve_model, with_seq_len
from tracegen.flops import model_flop_per_step

STRATEGY = Strategy(tp=2, pp=2, dp=2, cp=2, micro_batch_size=1, global_batch_size=32)


def test_the_name_says_the_length_and_resolves_back() -> None:
    base = get_model("llama3-8b")
    long = with_seq_len(base, 32768)
    assert long.name == "llama3-8b@seq32768" and long.seq_len == 32768
    assert resolve_model(long.name) == long
    assert with_seq_len(long, 4096).name == "llama3-8b@seq4096"  # not @seq32768@seq4096
    assert with_seq_len(base, base.seq_len) is base
    file_model = ModelSpec.from_dict({**base.to_dict(), "seq_len": 32768})
    assert {**long.to_dict(), "name": ""} == {**file_model.to_dict(), "name": ""}


def test_attention_grows_with_the_square_of_the_length() -> None:
    """A step's model FLOPs per sequence are a·s + c·s²: the GEMMs grow with s, the attention
    scores with s² (Narayanan et al. 2021, eq. 3: 72·B·s·l·h²·(1 + s/6h + …), so c = 12·l·h for
    a model whose query width is h). Three lengths fix a and c; the s² term is exactly that."""
    base = get_model("llama3-8b")
    s, n_l, h = 8192, base.num_layers, base.hidden_size
    f1, f2, f4 = (model_flop_per_step(with_seq_len(base, k * s), 1) for k in (1, 2, 4))
    c = (f2 - 2 * f1) / 2  # f(k) = a·k + c·k² at k = 1, 2
    assert c == pytest.approx(12 * n_l * h * s * s, rel=1e-9)
    assert f4 - 2 * f2 == pytest.approx(8 * c, rel=1e-9)  # and k = 4 lies on the same curve


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "8k"])
def test_a_length_that_is_not_a_positive_count_is_refused(bad: object) -> None:
    with pytest.raises(ConfigError, match="seq_len must be a positive whole number"):
        with_seq_len(get_model("llama3-8b"), bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["llama3-8b@seq32k", "llama3-8b@seq0", "llama3-8b@seq-5"])
def test_a_suffix_without_a_positive_number_is_named(name: str) -> None:
    # @seq0 had resolved to the preset at its own length (0 read as "no length given")
    with pytest.raises(ConfigError, match="after @seq as a whole number of tokens"):
        resolve_model(name)


def test_the_cli_and_a_study_give_the_estimate_a_model_file_gives(tmp_path: Path) -> None:
    model = ModelSpec.from_dict({**get_model("llama3-8b").to_dict(), "seq_len": 16384})
    expected = glance(model, STRATEGY, get_system("dgx-h100")).step_time_s
    out = tmp_path / "e.json"
    r = subprocess.run([sys.executable, "-m", "analysis.cli", "estimate", "--model", "llama3-8b",
                        "--seq-len", "16384", "--gpus", "16", "--tp", "2", "--pp", "2", "--cp",
                        "2", "--mbs", "1", "--gbs", "32", "--system", "dgx-h100", "--json",
                        str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(out.read_text())
    assert got["model"] == "llama3-8b@seq16384"
    assert got["step_time_s"] == pytest.approx(expected, rel=1e-12)
    study = tmp_path / "s.toml"
    study.write_text('model = "llama3-8b"\nseq_len = 16384\nsystem = "dgx-h100"\ngpus = 16\n'
                     'global_batch_size = 32\n')
    assert load_study(study).model == with_seq_len(get_model("llama3-8b"), 16384)
    study.write_text('model = "llama3-8b"\nseq_len = "16k"\nsystem = "dgx-h100"\ngpus = 16\n'
                     'global_batch_size = 32\n')
    with pytest.raises(ConfigError, match="seq_len must be a whole number ≥ 1, got '16k'"):
        load_study(study)


def test_a_long_sequence_says_how_mfu_counts_attention() -> None:
    """At 131 K tokens attention is most of Megatron's full-attention FLOP count, so `estimate`
    says so with the causal count's MFU; at the model's own 8 K it stays quiet."""
    from tests.test_cli import run
    from tracegen.flops import attention_share

    args = ["--gpus", "64", "--tp", "8", "--cp", "8", "--mbs", "1", "--gbs", "8",
            "--system", "dgx-h100"]
    for name, said in (("llama3-8b@seq131072", True), ("llama3-8b", False)):
        r = run("estimate", "--model", name, *args)
        assert r.returncode == 0, r.stderr
        text = " ".join(r.stdout.split())
        assert ("MFU counts attention in full" in text) is said
        if said:
            share = attention_share(resolve_model(name), 8)
            assert 0.7 < share < 0.9 and f"attention is {share:.0%} of that count" in text
