"""MosaicML's MPT training benchmarks in the public-runs schema (a diagnostic set, not the public
set): every row of the four tables in llm-foundry's ``scripts/train/benchmarking/README.md``
(H100 80GB BF16, H100 80GB FP8, A100 80GB and A100 40GB with 1600 Gb/s RoCE per node),
transcribed in ``tests/data/mpt_benchmarks_raw.csv`` and mapped here exactly as the public set maps
its eleven MPT rows (``mpt-01`` … ``mpt-11`` are rows of these tables). One framework, one
parallel layout (FSDP full shard), 125M–70B parameters and 512–65,536 tokens per sequence: the
stack is held fixed, so the residuals show how the per-operator physics generalizes across shapes.

Regenerate the schema file after editing the raw table::

    python -m tests.mpt_benchmarks
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data"
RAW = DATA / "mpt_benchmarks_raw.csv"
RUNS = DATA / "mpt_benchmarks_runs.csv"
SOURCE = "mosaicml/llm-foundry scripts/train/benchmarking/README.md"

# (layers, d_model, heads) from llm-foundry's scripts/train/yamls/pretrain/mpt-*.yaml; every
# model has expansion_ratio 4, vocab 50,368 and multi-head attention (3b/1b/760m set n_heads so
# that the head is 128 wide, as their yaml comments say).
ARCH = {"125m": (12, 768, 12), "350m": (24, 1024, 16), "760m": (24, 1536, 12),
        "1b": (24, 2048, 16), "3b": (32, 2560, 20), "7b": (32, 4096, 32),
        "13b": (40, 5120, 40), "30b": (48, 7168, 56), "70b": (80, 8192, 64)}
VOCAB = 50368
# table → (gpu, precision, per-GPU scale-out in Gb/s, or "" where the table does not state it)
TABLES = {"h100_bf16": ("h100-sxm", "bf16", ""), "h100_fp8": ("h100-sxm", "fp8", ""),
          "a100_80gb": ("a100-80gb", "bf16", "200"), "a100_40gb": ("a100-40gb", "bf16", "200")}
# the public set's ids for the rows it took from these tables
PUBLIC = {("h100_bf16", "70b", 2048, 64): "mpt-01", ("h100_bf16", "30b", 2048, 32): "mpt-02",
          ("h100_bf16", "13b", 2048, 64): "mpt-03", ("h100_bf16", "7b", 2048, 8): "mpt-04",
          ("a100_80gb", "70b", 2048, 64): "mpt-05", ("a100_80gb", "30b", 2048, 8): "mpt-06",
          ("a100_80gb", "13b", 2048, 8): "mpt-07", ("a100_80gb", "7b", 2048, 8): "mpt-08",
          ("a100_40gb", "70b", 2048, 128): "mpt-09", ("a100_40gb", "13b", 2048, 128): "mpt-10",
          ("a100_40gb", "7b", 2048, 128): "mpt-11"}
# MPT's MFU convention (the README's "MFU" section): 6·N + 3·(4·L·d·s²)/s FLOPs per token
PEAK_TFLOPS = {"h100_bf16": 989.0, "h100_fp8": 1979.0, "a100_80gb": 312.0, "a100_40gb": 312.0}


def raw_rows() -> list[dict[str, Any]]:
    """The transcribed tables, numbers parsed."""
    with RAW.open(newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for k in ("seq_len", "num_gpus", "micro_batch_size", "grad_accum", "global_batch_size",
                  "tokens_per_s", "num_params"):
            r[k] = int(r[k])
        for k in ("mfu_pct", "hfu_pct"):
            r[k] = float(r[k])
    return rows


def source_mfu_pct(r: dict[str, Any]) -> float:
    """A row's MFU recomputed from its own throughput with the README's formula: checks the
    transcription (each row's MFU, throughput and parameter count must agree)."""
    layers, d, _ = ARCH[r["model"]]
    per_token = 6 * r["num_params"] + 12 * layers * d * r["seq_len"]
    return 100 * per_token * r["tokens_per_s"] / (r["num_gpus"] * PEAK_TFLOPS[r["table"]] * 1e12)


def row_id(r: dict[str, Any], seen: set[str]) -> str:
    base = f"mptb-{r['table']}-{r['model']}-s{r['seq_len']}-g{r['num_gpus']}"
    rid = base if base not in seen else f"{base}-mb{r['micro_batch_size']}"
    seen.add(rid)
    return rid


def schema_row(r: dict[str, Any], rid: str) -> dict[str, Any]:
    layers, d, heads = ARCH[r["model"]]
    gpu, precision, scaleout = TABLES[r["table"]]
    n = r["num_gpus"]
    ckpt = r["activation_checkpointing"] == "True"
    public = PUBLIC.get((r["table"], r["model"], r["seq_len"], n))
    notes = [f"table {r['table']}, row {r['model']} seq {r['seq_len']} on {n} GPUs",
             f"architecture from llm-foundry yamls/pretrain/mpt-{r['model']}.yaml",
             f"sharding FULL_SHARD -> zero_stage 3; mixed precision {r['precision']} "
             f"{r['mp_mode']}",
             f"activation checkpointing {r['activation_checkpointing']} -> recompute "
             f"{'full' if ckpt else 'none'}",
             f"gradient accumulation {r['grad_accum']}",
             "iter_time = global_batch_size*seq_len / Throughput (T/s)"]
    if not scaleout and n > 8:
        notes.append("scaleout left empty: the H100 table does not state the inter-node network")
    if public:
        notes.append(f"also in the public set as {public}")
    return {
        "id": rid, "source_short": f"{SOURCE}, table {r['table']}", "model_name":
        f"MPT-{r['model'].upper()}", "arch": "dense", "num_layers": layers, "hidden_size": d,
        "num_attention_heads": heads, "num_kv_heads": heads, "ffn_hidden_size": 4 * d,
        "vocab_size": VOCAB, "seq_len": r["seq_len"], "activation": "gelu", "num_experts": "",
        "experts_per_token": "", "moe_ffn_hidden_size": "",
        "global_batch_size": r["global_batch_size"], "micro_batch_size": r["micro_batch_size"],
        "num_gpus": n, "tp": 1, "pp": 1, "dp": n, "cp": 1, "ep": 1, "sequence_parallel": "false",
        "virtual_pp": 1, "recompute": "full" if ckpt else "none", "zero_stage": 3,
        "precision": precision, "gpu": gpu, "gpus_per_node": 8, "scaleout_gbps_per_gpu": scaleout,
        "measured_iter_time_s": round(r["global_batch_size"] * r["seq_len"] / r["tokens_per_s"],
                                      6),
        "measured_tokens_per_s_per_gpu": round(r["tokens_per_s"] / n, 1),
        "measured_mfu_pct": r["mfu_pct"], "measured_hfu_pct": r["hfu_pct"],
        "measured_tflops_per_gpu": "", "iter_time_derivation": "from_tokens_per_s",
        "confidence": "A", "notes": " | ".join(notes)}


def schema_rows() -> list[dict[str, Any]]:
    seen: set[str] = set()
    return [schema_row(r, row_id(r, seen)) for r in raw_rows()]


def write(path: Path = RUNS) -> None:
    rows = schema_rows()
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    write()
