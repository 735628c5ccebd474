"""Trace-writer benchmark: prints nodes/s of the direct encoder vs protobuf message objects,
a full-mode set of ≥ 5 M nodes, the representative Llama-3.1 405B set on 16,384 GPUs, and
``trainsim stamp`` over that set (nodes/s).

Run: ``make bench`` (or ``python bench/bench_tracegen.py``). Prints medians of repeated runs.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from _timing import median_time

from replay import resolve_system
from replay.stamp import stamp_trace_set
from tracegen import Strategy, generate, get_model
from tracegen.mesh import Mesh
from tracegen.program import build_role
from tracegen.traceset import _Binder
from tracegen.vocab import COMM_COLL_NODE, COMM_RECV_NODE, COMM_SEND_NODE
from tracegen.writer import RoleEncoding, encode_with_protobuf


def bench_encoders() -> None:
    m = get_model("gpt-7.5b")
    s = Strategy(tp=4, pp=4, dp=8, micro_batch_size=1, global_batch_size=256)
    nodes = build_role(m, s, 1)
    binder = _Binder(Mesh(s, tied_embeddings=True), s.tp * s.dp)
    bound = {COMM_COLL_NODE, COMM_SEND_NODE, COMM_RECV_NODE}
    t_pb, ref = median_time(lambda: encode_with_protobuf(
        (n, binder.attrs(n) if n.type in bound else []) for n in nodes), 3)
    enc = RoleEncoding(nodes)
    t_fast, ours = median_time(lambda: enc.encode_rank(binder), 5)
    t_role, _ = median_time(lambda: RoleEncoding(nodes), 3)
    assert ours == ref, "encoders disagree"
    n = len(nodes)
    print(f"encoder, one rank of {n:,} nodes: protobuf objects {n / t_pb:,.0f} nodes/s; "
          f"stage encoding (once per stage) {n / t_role:,.0f} nodes/s; "
          f"per-rank binding {n / t_fast:,.0f} nodes/s; identical bytes: yes")


def bench_full_mode() -> None:
    m = get_model("gpt-7.5b")
    s = Strategy(tp=4, pp=4, dp=8, micro_batch_size=1, global_batch_size=1152,
                 sequence_parallel=True, zero_stage=1)
    tmp = Path(tempfile.mkdtemp(prefix="trainsim-bench-"))
    try:
        t, summary = median_time(lambda: generate(m, s, tmp, mode="full", name="b"), 3)
        nodes = summary.nodes_written  # type: ignore[attr-defined]
        size = sum(p.stat().st_size for p in tmp.iterdir())
    finally:
        shutil.rmtree(tmp)
    print(f"full mode gpt-7.5b tp4·pp4·dp8 (128 ranks, gbs 1152): {nodes:,} nodes, "
          f"{size / 1e6:,.0f} MB in {t:.2f} s (median of 3) = {nodes / t:,.0f} nodes/s end to end")


H100 = resolve_system("dgx-h100")


def bench_405b() -> None:
    m = get_model("llama3.1-405b")
    s = Strategy(tp=8, pp=16, dp=128, micro_batch_size=1, global_batch_size=2048,
                 sequence_parallel=True, zero_stage=1, first_stage_layers=7, last_stage_layers=7)
    tmp = Path(tempfile.mkdtemp(prefix="trainsim-bench-"))
    try:
        t, summary = median_time(lambda: generate(m, s, tmp, mode="representative"), 3)
        t_stamp, stamped = median_time(lambda: stamp_trace_set(tmp, H100), 3)
    finally:
        shutil.rmtree(tmp)
    print(f"representative llama3.1-405b on 16,384 GPUs (tp8·pp16·dp128, gbs 2048): "
          f"{summary.nodes_written:,} nodes in {summary.ranks_written} files, "  # type: ignore[attr-defined]
          f"{t:.2f} s (median of 3; target < 10 s)")
    n = summary.nodes_written  # type: ignore[attr-defined]
    print(f"stamped in place with dgx-h100's GPU model: {stamped.stamped:,} compute nodes of "  # type: ignore[attr-defined]
          f"{n:,}, {t_stamp:.2f} s (median of 3) = {n / t_stamp:,.0f} nodes/s")


if __name__ == "__main__":
    bench_encoders()
    bench_full_mode()
    bench_405b()
