"""``analysis.glance`` (``trainsim estimate``): the fast path's estimate with its per-stage
breakdown — the same numbers the fast path and the memory model give, and the pipeline's idle
share against the 1F1B bubble's closed form."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from analysis.fastpath import estimate
from analysis.glance import glance
from replay import get_system
from tests.test_cli import run
from tracegen import Strategy, get_model
from tracegen.flops import model_flop_per_step, recompute_flop_per_step
from tracegen.units import GiB


def test_glance_is_the_fast_path_with_its_memory_breakdown() -> None:
    model, system = get_model("gpt3-175b"), get_system("dgx-a100-80gb")
    s = Strategy(tp=8, pp=8, dp=16, micro_batch_size=1, global_batch_size=1536,
                 sequence_parallel=True, recompute="full", zero_stage=1)
    g, est = glance(model, s, system), estimate(model, s, system)
    assert g.step_time_s == est.step_time_s and g.pipeline_s == est.pipeline_s
    assert [st.fwd_s for st in g.stages] == list(est.stage_fwd_s)
    # the peak the fast path screens with is the largest stage total of the breakdown
    assert max(st.memory.total_bytes for st in g.stages) / GiB == pytest.approx(
        est.peak_memory_GiB, rel=1e-12)
    # MFU and HFU by their definitions (Megatron FLOP count; HFU adds the recomputed forward)
    peak = system.gpu.peak_flop_per_s("bf16") * s.world_size
    flop = model_flop_per_step(model, s.global_batch_size)
    assert g.mfu == pytest.approx(flop / (g.step_time_s * peak), rel=1e-12)
    extra = recompute_flop_per_step(model, s.global_batch_size, "full")
    assert g.hfu == pytest.approx((flop + extra) / (g.step_time_s * peak), rel=1e-12)
    assert g.tokens_per_s == pytest.approx(1536 * model.seq_len / g.step_time_s, rel=1e-12)


@pytest.mark.parametrize(("pp", "m"), [(4, 8), (8, 8), (8, 64)])
def test_idle_share_is_the_1f1b_bubble_for_alike_stages(pp: int, m: int) -> None:
    """A model whose embedding and head are negligible next to its layers, its stages each on
    their own nodes (sends of a few MB next to seconds of compute): the busiest stage idles
    (p − 1)/(m + p − 1) of the pipeline (Narayanan et al. 2021 §2.2.1)."""
    model = get_model("gpt3-175b")
    s = Strategy(tp=8, pp=pp, dp=1, micro_batch_size=1, global_batch_size=m)
    g = glance(model, s, get_system("dgx-a100-80gb"))
    assert g.pipeline_idle == pytest.approx((pp - 1) / (m + pp - 1), abs=0.01)


def test_a_strategy_that_does_not_fit_says_so() -> None:
    model, system = get_model("gpt3-175b"), get_system("dgx-a100-80gb")
    g = glance(model, Strategy(tp=8, pp=2, dp=1, micro_batch_size=1, global_batch_size=8),
               system)
    assert not g.fits and g.peak_memory_GiB > g.capacity_GiB == 80


def test_estimate_cli_prints_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "e.json"
    r = run("estimate", "--model", "gpt3-175b", "--gpus", "1024", "--tp", "8", "--pp", "8",
            "--sp", "--mbs", "1", "--gbs", "1536", "--recompute", "selective", "--zero", "1",
            "--system", "dgx-a100-80gb", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "tokens/s, MFU" in r.stdout and "fits in 80 GiB" in r.stdout
    d = json.loads(out.read_text())
    assert d["strategy"] == "tp8-pp8-dp16-mbs1" and len(d["stages"]) == 8
    assert d["peak_memory_GiB"] == pytest.approx(max(st["total_GiB"] for st in d["stages"]))
    assert [st["layers"] for st in d["stages"]] == [12] * 8
    fields = d["strategy_fields"]  # what the label leaves out, every field by name
    assert (fields["zero_stage"], fields["recompute"], fields["sequence_parallel"]) == (
        1, "selective", True)
    assert fields["adam_moments_dtype"] == "fp32" and fields["fp8_param_gather"] is False
    bad = run("estimate", "--model", "gpt3-175b", "--gpus", "1020", "--tp", "8", "--mbs", "1",
              "--gbs", "8", "--system", "dgx-a100-80gb")
    assert bad.returncode == 2 and "not divisible by tp·pp·cp" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_batch_below_one_step_of_micro_batches_suggests_the_smallest_that_works() -> None:
    bad = run("estimate", "--model", "gpt3-175b", "--gpus", "1000", "--tp", "8", "--mbs", "1",
              "--gbs", "8", "--system", "dgx-a100-80gb")
    assert bad.returncode == 2
    assert "use a multiple of 125 (e.g. 125)" in bad.stderr, bad.stderr


def test_glance_says_what_interference_costs() -> None:
    """The step with the GPU's interference against the same strategy without it: positive
    where collectives overlap compute (TP overlap on H100), 0 on a GPU without a measurement."""
    model = get_model("llama3-8b")
    s = Strategy(tp=2, dp=4, sequence_parallel=True, tp_comm_overlap=True,
                 micro_batch_size=1, global_batch_size=32)
    h100 = get_system("dgx-h100")
    g = glance(model, s, h100)
    free = dataclasses.replace(h100, gpu=dataclasses.replace(h100.gpu, comm_interference=0.0))
    assert g.interference_s == pytest.approx(
        g.step_time_s - estimate(model, s, free).step_time_s)
    assert 0 < g.interference_s < 0.2 * g.step_time_s
    assert glance(model, s, get_system("mi300x")).interference_s == 0
    assert g.to_dict()["interference_s"] == g.interference_s


def test_model_and_system_may_be_named_as_the_cli_names_them() -> None:
    """``glance`` and ``estimate`` take preset names (or files) as well as specs, as ``replay``
    does; a name that is none is the catalog's error, not an AttributeError from inside."""
    from tracegen import ConfigError

    s = Strategy(tp=8, micro_batch_size=1, global_batch_size=8, dp=1)
    spec = glance(get_model("llama3-8b"), s, get_system("dgx-h100"))
    assert glance("llama3-8b", s, "dgx-h100") == spec
    assert estimate("llama3-8b", s, "dgx-h100") == estimate(get_model("llama3-8b"), s,
                                                           get_system("dgx-h100"))
    with pytest.raises(ConfigError, match="no preset system named 'dgx-h1000'"):
        glance("llama3-8b", s, "dgx-h1000")


def test_estimate_cli_takes_llama3s_own_pipeline_split(tmp_path: Path) -> None:
    """Llama 3 405B as Dubey et al. 2024 (§3.3.2) laid it out: pp 16 × vpp 8, the first chunk
    the embedding alone and the last the loss alone, so each end stage holds one layer fewer
    (7, 8 × 14, 7); with FSDP's sharded gradients (ZeRO-2) it fits, as it trained, without
    activation checkpointing."""
    out = tmp_path / "e.json"
    r = run("estimate", "--model", "llama3.1-405b", "--gpus", "16384", "--tp", "8", "--pp", "16",
            "--vpp", "8", "--schedule", "interleaved_1f1b", "--sp", "--mbs", "1", "--gbs",
            "2048", "--zero", "2", "--account-for-embedding-in-pipeline-split",
            "--account-for-loss-in-pipeline-split", "--system", "dgx-h100", "--json", str(out))
    assert r.returncode == 0, r.stderr
    d = json.loads(out.read_text())
    assert [st["layers"] for st in d["stages"]] == [7] + [8] * 14 + [7]
    assert d["fits"]
    assert "embedding and loss counted as layers in the split" in " ".join(r.stdout.split())


def test_estimate_says_the_uneven_split_it_costed() -> None:
    """The header names the end chunks' layers (the label leaves them out), so that the
    strategy printed is the strategy costed: Llama 3 70B's 80 layers as 29 + 3 × 17."""
    r = run("estimate", "--model", "llama3-70b", "--gpus", "64", "--tp", "8", "--pp", "4",
            "--mbs", "1", "--gbs", "64", "--first-stage-layers", "29", "--system", "dgx-h100")
    assert r.returncode == 0, r.stderr
    assert "bf16, first chunk 29 layers)" in " ".join(r.stdout.split())


def test_results_show_as_one_line_in_a_repl_and_as_a_table_in_jupyter(tmp_path: Path) -> None:
    """A glance and a replay print their figures in one line (a replay's dataclass repr had
    dumped its whole timeline frame), and render in Jupyter as HTML tables that parse."""
    from html.parser import HTMLParser

    from replay import replay
    from tracegen import generate

    class Cells(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.text: list[str] = []

        def handle_data(self, data: str) -> None:
            self.text.append(data.strip())

    s = Strategy(tp=2, pp=2, dp=2, micro_batch_size=1, global_batch_size=8)
    g = glance("llama3-8b", s, "dgx-h100")
    generate(get_model("llama3-8b"), s, tmp_path / "t", mode="representative")
    r = replay(tmp_path / "t", "dgx-h100")
    for obj, step in ((g, g.step_time_s), (r, r.step_time_s)):
        line = repr(obj)
        assert "\n" not in line and f"step time s {step:.4f}" in line and "MFU" in line
        cells = Cells()
        cells.feed(obj._repr_html_())
        got = dict(zip(cells.text[1::2], cells.text[2::2], strict=False))
        assert got["step time s"] == f"{step:.4f}" and got["fits"] == "True"
    assert f"timeline {r.timeline.height:,} rows" in repr(r) and len(repr(r)) < 400
