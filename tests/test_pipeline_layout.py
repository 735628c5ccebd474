"""Megatron-Core's custom pipeline layout (``Strategy.pipeline_layout``,
``--pipeline-model-parallel-layout``): the parser and its messages, the split it gives, its
equivalence to the uneven splits trainsim already had, MTP modules on a chunk of their own
(DeepSeek-V3's layout), and the fast path against replay on random layouts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from analysis.fastpath import estimate
from replay import get_system
from tests.conftest import replayed
from tests.test_cli import run
from tests.test_fastpath import MODEL, MOE
from tracegen import ConfigError, Strategy, generate, get_model
from tracegen.fit import check_fits_model
from tracegen.layout import Chunk, parse_layout
from tracegen.memory import mtp_activation_bytes, unit_params
from tracegen.mesh import embedding_partner
from tracegen.program import RoleProgram

H100 = get_system("dgx-h100")
DSV3 = "Et*3|(tt|)*29,m|L"  # Megatron-Core's user guide: DeepSeek-V3 on pp 16 × vpp 2


def test_megatrons_deepseek_v3_example() -> None:
    """32 chunks: the embedding and 3 layers, 29 of 2 layers, the MTP module alone, the loss
    alone — on pp 16 × vpp 2 the module is stage 14's second chunk, the loss stage 15's."""
    chunks = parse_layout(DSV3)
    assert len(chunks) == 32
    assert chunks[0] == Chunk(3, embedding=True)
    assert set(chunks[1:30]) == {Chunk(2)}
    assert chunks[30:] == (Chunk(0, mtp=1), Chunk(0, loss=True))
    s = Strategy(pp=16, vpp=2, dp=1, global_batch_size=16, schedule="interleaved_1f1b",
                 pipeline_layout=DSV3)
    assert [len(s.chunk_layers(61, g)) for g in range(32)] == [3] + [2] * 29 + [0, 0]
    assert (s.mtp_chunk, s.mtp_chunk % 16, s.mtp_chunk // 16) == (30, 14, 1)
    check_fits_model(s, get_model("deepseek-v3"))
    assert parse_layout("E, t*2 |(t|)*2 t L") == (Chunk(2, embedding=True), Chunk(1), Chunk(1),
                                                   Chunk(1, loss=True))


@pytest.mark.parametrize(("layout", "message"), [
    ("Et|tX|L", "unknown symbol 'X' at position 4"),
    ("E(t|t|L", "a '(' is never closed"),
    ("Et|t)|L", "a ')' closes no '('"),
    ("Et*|L", "'*' needs a count after it"),
    ("t|EL", "the embedding (E) comes once, first in the first chunk"),
    ("Et|L|t", "the loss (L) comes once, last in the last chunk"),
    ("Et|m|t|L", "the MTP modules (m) come together in one chunk, after every layer (t)"),
    ("Etm|mL", "the MTP modules (m) come together in one chunk"),
    ("E||t|L", "chunk(s) 1 hold nothing"),
    ("E(t*100000)*100000|L", "the layout expands past 1,048,576 symbols"),  # refused, unbuilt
    ("E" + "(" * 40 + "t" + ")" * 40 + "L", "parentheses nest deeper than 32"),
])
def test_a_malformed_layout_says_what_is_wrong(layout: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("*", r"\*").replace("|", r"\|")):
        parse_layout(layout)


def test_a_layout_that_does_not_fit_the_strategy_or_model_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"lists 4 chunks, pp · vpp = 2 · 1 = 2; set vpp = "
                                          r"chunks / pp = 2"):
        Strategy(pp=2, dp=1, global_batch_size=2, pipeline_layout="Ett|tt|tt|ttL")
    with pytest.raises(ConfigError, match="set pipeline_layout or first_stage_layers"):
        Strategy(pp=2, dp=1, global_batch_size=2, pipeline_layout="Etttt|ttttL",
                 first_stage_layers=4)
    s = Strategy(pp=2, dp=1, global_batch_size=2, pipeline_layout="Ettt|ttttL")
    with pytest.raises(ConfigError, match="places 7 layers"):
        check_fits_model(s, MODEL)
    with pytest.raises(ConfigError, match=r"places 1 MTP modules \(m\), the model has 0"):
        check_fits_model(dataclasses.replace(s, pipeline_layout="Etttt|ttttmL"), MODEL)
    tied = dataclasses.replace(MODEL, tied_embeddings=True, mtp_layers=1)
    off_last = Strategy(pp=3, dp=1, global_batch_size=3, pipeline_layout="Etttt|ttttm|L")
    with pytest.raises(ConfigError, match="tied output head with MTP modules off the last"):
        check_fits_model(off_last, tied)


@pytest.mark.parametrize(("layout", "fields"), [
    ("Ett|tt|tt|ttL", {}),  # the even split
    ("Ettt|tt|t|ttL", None),  # no field says it: only compared with replay below
    ("Ettt|tt|tt|tL", {"first_stage_layers": 3, "last_stage_layers": 1}),
])
def test_a_layout_gives_what_the_split_it_spells_gives(layout: str, fields: dict | None) -> None:
    """The same split spelled as a layout or by the fields: the same step and memory; and the
    fast path equal to replay on it."""
    s = Strategy(pp=4, dp=2, global_batch_size=16, zero_stage=1, pipeline_layout=layout)
    got = estimate(MODEL, s, H100)
    if fields is not None:
        plain = estimate(MODEL, dataclasses.replace(s, pipeline_layout="", **fields), H100)
        assert (got.step_time_s, got.peak_memory_GiB) == (plain.step_time_s,
                                                          plain.peak_memory_GiB)
    assert got.step_time_s == pytest.approx(replayed(MODEL, s, H100).step_time_s, rel=1e-6)


def test_mtp_on_a_chunk_of_its_own(tmp_path: Path) -> None:
    """DeepSeek-V3's placement in small: the module alone on stage 2, the loss on stage 3.
    Stage 2 holds the module, a copy of the embedding it reads and their activations; the
    embedding's gradient is all-reduced between stages 0 and 2 only; replay and the fast path
    agree."""
    m = dataclasses.replace(MODEL, mtp_layers=1)
    s = Strategy(pp=4, dp=2, global_batch_size=16, pipeline_layout="Etttt|tttt|m|L")
    assert embedding_partner(m, s) == 2
    runs = RoleProgram(m, s, 2).chunk_runs(2)
    assert [(b.name, n) for b, n in runs] == [("mtp_embedding", 1), ("mtp", 1)]
    assert runs[0][0].dense == m.vocab_size * m.hidden_size
    assert [b.name for b, _ in RoleProgram(m, s, 3).chunk_runs(3)] == ["lm_head"]
    summary = generate(m, s, tmp_path)
    embd = [st.comm_bytes_by_axis.get("embd", 0) > 0 for st in summary.stages]
    assert embd == [True, False, True, False]
    act = [st.memory.activations_bytes for st in summary.stages]
    assert act[2] == mtp_activation_bytes(m, s) * 2  # 1F1B: stage 2 of 4 holds 2 micro-batches
    # under ZeRO-3 the embedding's copy is the largest weight stage 2 gathers whole
    wide = dataclasses.replace(m, vocab_size=4 * m.vocab_size)
    assert unit_params(wide, s, 2) == wide.vocab_size * m.hidden_size > unit_params(wide, s, 1)
    assert estimate(m, s, H100).step_time_s == pytest.approx(
        replayed(m, s, H100).step_time_s, rel=1e-6)


@st.composite
def _layouts(draw: st.DrawFn) -> tuple[object, Strategy]:
    """A model (dense or MoE, 0-2 MTP modules, its head tied or not) and a strategy with a
    random layout: chunk sizes summing to its 8 layers (the end chunks may hold none), the
    modules with the loss or on a chunk of their own before it; tp 1 or 2 (SP or not), ZeRO
    0/1/3 (prefetched or not), BF16 or FP8, any recompute."""
    pp, vpp = draw(st.sampled_from([2, 3, 4])), draw(st.sampled_from([1, 1, 2]))
    n = pp * vpp
    mtp = draw(st.sampled_from([0, 1, 2]))
    alone = bool(mtp) and draw(st.booleans()) and n > 2
    body = n - 1 if alone else n  # chunks that share the 8 layers
    cuts = sorted(draw(st.lists(st.integers(0, 8), min_size=body - 1, max_size=body - 1)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, 8], strict=True)]
    assume(all(sizes[1:-1]) if not alone else all(sizes[1:]))
    pieces = ["t" * k for k in sizes]
    pieces[0] = "E" + pieces[0]
    if alone:
        pieces.append("m" * mtp)
    else:
        pieces[-1] += "m" * mtp
    pieces[-1] += "L"
    moe = draw(st.booleans())
    model = dataclasses.replace(MOE if moe else MODEL, mtp_layers=mtp,
                                tied_embeddings=not alone and draw(st.booleans()))
    tp = draw(st.sampled_from([1, 2]))
    zero = draw(st.sampled_from([0, 1, 3]))
    s = Strategy(pp=pp, vpp=vpp, dp=2, tp=tp, sequence_parallel=tp > 1 and draw(st.booleans()),
                 ep=2 if moe else 1, global_batch_size=2 * pp * 2,
                 schedule="interleaved_1f1b" if vpp > 1 else "1f1b", zero_stage=zero,
                 zero3_prefetch=zero == 3 and draw(st.booleans()),
                 precision=draw(st.sampled_from(["bf16", "fp8"])),
                 recompute=draw(st.sampled_from(["none", "full", "selective"])),
                 pipeline_layout="|".join(pieces))
    return model, s


@settings(max_examples=25, deadline=None)
@given(case=_layouts())
def test_fast_path_within_2_percent_of_replay_on_random_layouts(case) -> None:
    model, s = case
    check_fits_model(s, model)
    assert estimate(model, s, H100).step_time_s == pytest.approx(
        replayed(model, s, H100).step_time_s, rel=0.02)


def test_the_cli_takes_a_layout_and_says_what_is_wrong_with_one() -> None:
    est = ("estimate", "--model", "gpt-1.7b", "--gpus", "8", "--pp", "4", "--mbs", "1",
           "--gbs", "16", "--system", "dgx-h100", "--pipeline-layout")
    good = run(*est, "Et*6|t*6|t*6|t*6L")
    assert good.returncode == 0, good.stderr
    mtp = run("estimate", "--model", "deepseek-v3", "--gpus", "1024", "--tp", "2", "--pp", "8",
              "--vpp", "4", "--schedule", "interleaved_1f1b", "--ep", "64", "--expert-tp", "1",
              "--sp", "--mbs", "1", "--gbs", "8192", "--zero", "1", "--system", "dgx-h100",
              "--precision", "fp8", "--moe-dispatcher", "deepep", "--pipeline-layout",
              "Et|(tt|)*30mL")
    assert mtp.returncode == 0, mtp.stderr
    rows = [line.split("│")[1:3] for line in mtp.stdout.splitlines() if line.startswith("│")]
    assert [layers.strip() for _, layers in rows] == ["7"] + ["8"] * 6 + ["6 +1 MTP"]
    bad = run(*est, "Et*6|t*6|t*6|t*6")
    assert bad.returncode != 0 and "the loss (L) comes once" in bad.stdout + bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_sweep_searches_layouts(tmp_path: Path) -> None:
    """Layouts are a search dimension: each pairs with the pp · vpp it lists, the others are
    counted invalid; "" is the split by the fields."""
    from tests.studies import enumerated

    valid, invalid = enumerated(
        tmp_path, 'model = "llama3-8b"\nsystem = "dgx-h100"\ngpus = 16\n'
        'global_batch_size = 64\n[search]\ntp = [2]\npp = [2, 4]\nvpp = [1]\n'
        'micro_batch_size = [1]\nrecompute = ["full"]\nzero_stage = [1]\n'
        'sequence_parallel = [true]\n'
        'pipeline_layout = ["", "Et*15|t*17L", "Et*7|t*8|t*8|t*9L"]\n')
    assert sorted((s.pp, s.pipeline_layout) for s in valid) == [
        (2, ""), (2, "Et*15|t*17L"), (4, ""), (4, "Et*7|t*8|t*8|t*9L")]
    assert invalid == 2  # each layout with the other pp
    from analysis.compare import strategy_label

    labels = {strategy_label(s) for s in valid}
    assert len(labels) == 4  # the report tells the layouts apart
    assert any(x.endswith("-layout[Et*15|t*17L]") for x in labels)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_prefetched_stage_of_the_modules_and_the_loss_alone(schedule: str) -> None:
    """A last stage of the MTP module and the loss alone ('mL') under prefetched ZeRO-3: its
    backward ends with the embedding's copy, whose lookup's gradient the module computes, so
    that block's gathers (issued as the module's backward starts, queued behind the head's
    reduce-scatter) hold up no compute — the stage's passes end with the module and the
    embedding all-reduce starts from there. The fast path once ended each of them after those
    gathers: seed 433 of the agreement benchmark (vocabulary 128K, 2 GPUs a node) was 2.5%
    slower than replay; here the gap is the head's scatter and the copy's gathers on a wide
    vocabulary."""
    m = dataclasses.replace(MODEL, mtp_layers=1, vocab_size=32768)
    s = Strategy(pp=3, dp=4, global_batch_size=24, zero_stage=3, zero3_prefetch=True,
                 schedule=schedule, pipeline_layout="Etttt|tttt|mL")  # type: ignore[arg-type]
    a100 = dataclasses.replace(get_system("dgx-a100-80gb"), node=dataclasses.replace(
        get_system("dgx-a100-80gb").node, gpus_per_node=2))
    assert estimate(m, s, a100).step_time_s == pytest.approx(
        replayed(m, s, a100).step_time_s, rel=1e-6)


@pytest.mark.parametrize("m_count", [1, 3])
def test_a_moe_stage_of_the_module_and_the_loss_gathers_the_module_before_its_input(
        m_count: int) -> None:
    """ZeRO-3 without prefetch on a MoE model (the two-stream walk, ``pipeline_walk.z3_map``),
    a last stage of the MTP module and the loss alone: its forward opens with the embedding's
    copy, which gathers and runs nothing, so the module's dense and expert gathers follow at
    once, before the received input is needed. The walk made the input wait for the first
    block, so the module gathered after it came: seed 446 of the agreement benchmark was 0.49%
    slower than replay (2.4% with one micro-batch), a constant 0.4 ms a step."""
    m = dataclasses.replace(MOE, mtp_layers=1, vocab_size=32768)
    s = Strategy(pp=3, dp=4, ep=2, global_batch_size=4 * m_count, zero_stage=3,
                 pipeline_layout="Etttt|tttt|mL")
    h800 = dataclasses.replace(get_system("dgx-h800"), node=dataclasses.replace(
        get_system("dgx-h800").node, gpus_per_node=4))
    assert estimate(m, s, h800).step_time_s == pytest.approx(
        replayed(m, s, h800).step_time_s, rel=1e-6)


@pytest.mark.parametrize("outer", ["no_shard", "optim"])
def test_a_stage_of_the_modules_alone_gathers_them_before_its_input_comes(outer: str) -> None:
    """ZeRO-3 with instances, without prefetch, the two MTP modules on a stage of their own:
    its chunk opens with the embedding's copy, which runs nothing in the forward, so the
    modules' gathers too (and under HFSDP, the first forward's gathers across the instances)
    run in the chain before the received input is needed (``fastpath_stages._leading``). The
    fast path counted the first block's alone there: the agreement benchmark's seed 438 was
    0.88% slower than replay (HFSDP), a constant 2.3 ms a step."""
    m = dataclasses.replace(MODEL, mtp_layers=2, vocab_size=32768)
    s = Strategy(pp=4, dp=4, cp=2, global_batch_size=32, zero_stage=3, dist_opt_instances=4,
                 outer_dp_sharding_strategy=outer,  # type: ignore[arg-type]
                 pipeline_layout="Etttt|tttt|mm|L")
    v100 = dataclasses.replace(get_system("dgx1-v100"), node=dataclasses.replace(
        get_system("dgx1-v100").node, gpus_per_node=2))
    assert estimate(m, s, v100).step_time_s == pytest.approx(
        replayed(m, s, v100).step_time_s, rel=1e-6)
