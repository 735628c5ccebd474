"""Conservation: FLOPs and communication bytes summed over all ranks equal closed forms that do not
depend on how the job is split (hypothesis over random valid strategies)."""

from __future__ import annotations

import tempfile
from collections import defaultdict
from pathlib import Path

from chakra.schema.protobuf import et_def_pb2 as pb
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.conftest import attrs, read_et
from tracegen import ConfigError, ModelSpec, Strategy, generate, read_manifest
from tracegen.program import PNode, RoleProgram, build_role
from tracegen.vocab import COLL_CODE

AXIS_OF_GROUP: dict[str, str] = {}


def model(tied: bool) -> ModelSpec:
    return ModelSpec(name="cons", num_layers=8, hidden_size=64, num_attention_heads=8,
                     num_kv_heads=4, ffn_hidden_size=128, vocab_size=256, seq_len=64,
                     activation="swiglu", tied_embeddings=tied)


def closed_form_flop(m: ModelSpec, s: Strategy) -> dict[str, int]:
    """Matmul FLOPs of one step, unsharded. Linear layers 2·m·n·k per GEMM (Kaplan et al. 2020);
    causal attention 2·s²·h per layer and sequence forward, 2.5× that backward (Dao 2023)."""
    h, kv, f, v, seq, n_l = (m.hidden_size, m.kv_size, m.ffn_hidden_size, m.vocab_size,
                             m.seq_len, m.num_layers)
    up = 2 if m.gated else 1
    layer_lin = 2 * h * (h + 2 * kv) + 2 * h * h + 2 * up * h * f + 2 * f * h
    tokens = s.global_batch_size * seq
    attn = s.global_batch_size * n_l * 2 * seq * seq * h
    lin = tokens * (n_l * layer_lin + 2 * h * v)
    rc = {"none": 0, "selective": attn, "full": tokens * n_l * layer_lin + attn}[s.recompute]
    return {"fwd": lin + attn, "bwd": 2 * lin + attn * 5 // 2, "recompute": rc}


def closed_form_comm(m: ModelSpec, s: Strategy) -> dict[str, int]:
    """Bytes (Chakra comm_size, ASTRA-sim meaning) summed over all ranks, per axis."""
    h, v = m.hidden_size, m.vocab_size
    t, n_mb, ranks_per_stage = s.tp, s.num_microbatches, s.tp * s.dp
    tokens = s.micro_batch_size * m.seq_len
    act = tokens * h * 2
    out: dict[str, int] = defaultdict(int)
    if t > 1:
        if s.sequence_parallel:
            per_pass = 2 * act // t + 2 * act  # two all-gathers (shards) + two reduce-scatters
            # + backward re-gathers the input of QKV and FC1 for their weight gradients
            # (Korthikanti et al. 2022 §4.2.2: only the shard was kept)
            layer = per_pass * (2 + (s.recompute == "full")) + 2 * act // t
            emb_head = act + act // t + act // t + 12 * tokens + act
        else:
            layer = 2 * act * (2 + (s.recompute == "full"))
            emb_head = act + 12 * tokens + act
        out["tp"] = ranks_per_stage * n_mb * (m.num_layers * layer + emb_head)
    p2p = act // t if s.sequence_parallel else act
    boundaries = s.pp * s.vpp - 1
    if boundaries:
        out["pp"] = ranks_per_stage * n_mb * boundaries * 2 * p2p
    extra_copy = m.vocab_size * h if (m.tied_embeddings and s.pp > 1) else 0
    params = m.num_params() + extra_copy
    if s.dp > 1:
        out["dp"] = s.dp * params * 4  # fp32 gradients: all-reduce or reduce-scatter (full buffer)
        if s.zero_stage == 1:
            out["dp"] += params * 2  # bf16 parameter all-gather, per-rank shard
    if extra_copy:
        out["embd"] = s.dp * t * 2 * (v * h // t) * 4
    return dict(out)


def measured(directory: Path) -> tuple[dict[str, int], dict[str, int]]:
    man = read_manifest(directory)
    axis = {gid: g["axis"] for gid, g in man["groups"].items()}
    flop: dict[str, int] = defaultdict(int)
    comm: dict[str, int] = defaultdict(int)
    for r in man["ranks_written"]:
        _, nodes = read_et(directory / f"c.{r}.et")
        for n in nodes:
            a = attrs(n)
            if n.type == pb.COMP_NODE and a["op_type"][1] in ("gemm", "attention"):
                phase = "recompute" if ".rc." in n.name else ("fwd" if n.name[0] == "F" else "bwd")
                flop[phase] += a["num_ops"][1]
            elif n.type == pb.COMM_COLL_NODE:
                comm[axis[a["pg_name"][1]]] += a["comm_size"][1]
            elif n.type == pb.COMM_SEND_NODE:
                comm["pp"] += a["comm_size"][1]
    return dict(flop), dict(comm)


@settings(max_examples=40, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2, 4]), dp=st.sampled_from([1, 2]),
       vpp=st.sampled_from([1, 2]), sp=st.booleans(), tied=st.booleans(),
       recompute=st.sampled_from(["none", "selective", "full"]), zero=st.sampled_from([0, 1]),
       mbs=st.sampled_from([1, 2]), mb_per_pp=st.sampled_from([1, 2]),
       schedule=st.sampled_from(["gpipe", "1f1b"]))
def test_flops_and_bytes_conserved(tp, pp, dp, vpp, sp, tied, recompute, zero, mbs, mb_per_pp,
                                   schedule) -> None:
    m = model(tied)
    try:
        s = Strategy(tp=tp, pp=pp, dp=dp, vpp=vpp, sequence_parallel=sp and tp > 1,
                     schedule="interleaved_1f1b" if vpp > 1 else schedule, recompute=recompute,
                     zero_stage=zero, micro_batch_size=mbs,
                     global_batch_size=mbs * dp * pp * mb_per_pp, dp_bucket_params=30_000)
    except ConfigError:
        assume(False)
        raise
    with tempfile.TemporaryDirectory() as tmp:
        try:
            generate(m, s, tmp, mode="full", name="c")
        except ConfigError:
            assume(False)
        flop, comm = measured(Path(tmp))
    expected = closed_form_flop(m, s)
    assert flop.get("fwd", 0) == expected["fwd"]
    assert flop.get("bwd", 0) == expected["bwd"]
    assert flop.get("recompute", 0) == expected["recompute"]
    assert comm == closed_form_comm(m, s)


@settings(max_examples=30, deadline=None)
@given(heads=st.sampled_from([4, 8, 12]), hd=st.sampled_from([8, 16, 24]),
       width=st.sampled_from([1, 2]), kv_div=st.sampled_from([1, 2, 4, 0]),
       ffn=st.sampled_from([64, 96, 192]), vocab=st.sampled_from([256, 500, 1000]),
       activation=st.sampled_from(["gelu", "swiglu", "relu2", "relu"]), tied=st.booleans(),
       tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2, 3]), cp=st.sampled_from([1, 2]),
       vpp=st.sampled_from([1, 2]), sp=st.booleans(),
       recompute=st.sampled_from(["none", "selective", "full"]), zero=st.sampled_from([0, 1, 3]))
def test_flops_conserved_for_any_head_shape(heads, hd, width, kv_div, ffn, vocab, activation,
                                            tied, tp, pp, cp, vpp, sp, recompute,
                                            zero) -> None:
    """Heads of their own width (q = heads·head_dim ≠ h), grouped K/V down to one head, every
    activation, context parallelism's ring: the matmul FLOPs summed over all ranks are the
    unsharded closed form with q in place of h — QKV 2·h·(q + 2·kv), the output projection
    2·q·h, attention 2·s²·q per layer and sequence (the closed form above for q = h)."""
    kv = heads // kv_div if kv_div else 1
    try:
        m = ModelSpec(name="shape", num_layers=pp * vpp * 2, hidden_size=heads * hd * width,
                      num_attention_heads=heads, num_kv_heads=kv, head_dim=hd,
                      ffn_hidden_size=ffn, vocab_size=vocab, seq_len=64, activation=activation,
                      tied_embeddings=tied)
        s = Strategy(tp=tp, pp=pp, cp=cp, vpp=vpp, sequence_parallel=sp and tp > 1,
                     schedule="interleaved_1f1b" if vpp > 1 else "1f1b", recompute=recompute,
                     zero_stage=zero, micro_batch_size=1, global_batch_size=2 * pp)
        with tempfile.TemporaryDirectory() as tmp:
            generate(m, s, tmp, mode="full", name="c")
            flop, _ = measured(Path(tmp))
    except ConfigError:
        assume(False)
        raise
    h, q = m.hidden_size, m.q_size
    layer = (2 * h * (q + 2 * m.kv_size) + 2 * q * h
             + 2 * (2 if m.gated else 1) * h * ffn + 2 * ffn * h)
    tokens, attn = s.global_batch_size * 64, s.global_batch_size * m.num_layers * 2 * 64 * 64 * q
    lin = tokens * (m.num_layers * layer + 2 * h * vocab)
    again = {"none": 0, "selective": attn, "full": tokens * m.num_layers * layer + attn}
    assert flop == {"fwd": lin + attn, "bwd": 2 * lin + attn * 5 // 2,
                    **({"recompute": again[recompute]} if recompute != "none" else {})}


def test_representative_times_multiplicity_equals_full(tmp_path: Path) -> None:
    m = model(True)
    s = Strategy(tp=2, pp=2, dp=2, micro_batch_size=1, global_batch_size=8, zero_stage=1)
    generate(m, s, tmp_path / "f", mode="full", name="c")
    generate(m, s, tmp_path / "r", mode="representative", name="c")
    full_flop, full_comm = measured(tmp_path / "f")
    rep_flop, rep_comm = measured(tmp_path / "r")
    mult = s.tp * s.dp
    assert {k: v * mult for k, v in rep_flop.items()} == full_flop
    assert {k: v * mult for k, v in rep_comm.items()} == full_comm


@settings(max_examples=40, deadline=None)
@given(bucket=st.integers(1_000, 400_000), dp=st.sampled_from([2, 4, 8]),
       tp=st.sampled_from([1, 2]))
def test_zero3_gather_buckets_split_each_block_and_keep_its_bytes(bucket: int, dp: int,
                                                                 tp: int) -> None:
    """ZeRO-3 all-gathers in buckets of at most ``bucket`` parameters (DeepSpeed's
    stage3_prefetch_bucket_size): each block's gather becomes ⌈params / bucket⌉ collectives whose
    per-rank shards add up to the unbucketed one's, up to one padding element per piece."""
    m = ModelSpec(name="z3", num_layers=2, hidden_size=128, num_attention_heads=4,
                  num_kv_heads=4, ffn_hidden_size=512, vocab_size=512, seq_len=64,
                  activation="gelu")
    whole = Strategy(tp=tp, dp=dp, global_batch_size=dp, zero_stage=3)
    split = Strategy(tp=tp, dp=dp, global_batch_size=dp, zero_stage=3,
                     zero3_gather_bucket_params=bucket)

    def gathers(s: Strategy) -> list[int]:
        return [n.comm_bytes for n in build_role(m, s, 0)
                if n.axis == "dp" and _coll_name(n) == "ALL_GATHER"]

    prog = RoleProgram(m, whole, 0)
    blocks = [prog.layer_block().dense, prog.vocab_block("embedding", "emb").dense]
    params_of = {-(-n // dp) * 2: n for n in blocks}  # a whole gather's shard bytes → params
    expected = sum(-(-params_of[b] // bucket) for b in gathers(whole))
    assert len(gathers(split)) == expected
    slack = 2 * expected  # at most one padded parameter (2 bytes) per piece
    assert 0 <= sum(gathers(split)) - sum(gathers(whole)) <= slack


def _coll_name(node: PNode) -> str:
    codes = {v: k for k, v in COLL_CODE.items()}
    return next((codes[v] for k, _, v in node.attrs if k == "comm_type"), "")


@settings(max_examples=20, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), mbs=st.sampled_from([1, 2]), sp=st.booleans())
def test_cross_entropy_traffic_is_megatrons_passes_over_every_logit(tp, mbs, sp) -> None:
    """Summed over the tensor-parallel ranks, the loss moves 38 bytes per logit forward and 14
    backward (Megatron's unfused vocab-parallel cross-entropy, ops.CE_FWD/BWD_BYTES) for every
    token of the micro-batch and every vocabulary entry, however the vocabulary is split."""
    from tracegen import ops as O

    m = model(False)
    s = Strategy(tp=tp, sequence_parallel=sp and tp > 1, micro_batch_size=mbs,
                 global_batch_size=mbs)
    logits = mbs * m.seq_len * m.vocab_size
    fwd = {it.name: it for it in O.head_fwd(m, s) if isinstance(it, O.Op)}
    bwd = {it.name: it for it in O.head_bwd(m, s) if isinstance(it, O.Op)}
    assert tp * fwd["cross_entropy"].bytes == 38 * logits
    assert tp * bwd["cross_entropy_bwd"].bytes == 14 * logits
