"""The committed golden trace set: a tiny model on 8 ranks, tp2 · pp2 · dp2.

Run ``python tests/golden_spec.py`` (``make golden``) to regenerate it after an intended change of
the trace format; the test suite checks the committed files regenerate byte-identically.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tracegen import ModelSpec, Strategy, generate

GOLDEN_DIR = Path(__file__).resolve().parent.parent / "traces" / "golden_tiny_tp2pp2dp2"
GOLDEN_MODEL = ModelSpec(name="tiny", num_layers=4, hidden_size=64, num_attention_heads=4,
                         ffn_hidden_size=256, vocab_size=512, seq_len=32, activation="gelu",
                         tied_embeddings=True)
GOLDEN_STRATEGY = Strategy(tp=2, pp=2, dp=2, micro_batch_size=1, global_batch_size=8,
                           sequence_parallel=True, zero_stage=1, recompute="selective",
                           dp_bucket_params=20_000)


def write(out: Path) -> None:
    generate(GOLDEN_MODEL, GOLDEN_STRATEGY, out, mode="full", name="tiny")


if __name__ == "__main__":
    write(GOLDEN_DIR)
    print(f"wrote {GOLDEN_DIR}", file=sys.stderr)
