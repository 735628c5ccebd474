"""Small study files for the analysis tests (a tiny model on 8 GPUs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_MODEL = """num_layers = 8
hidden_size = 256
num_attention_heads = 8
num_kv_heads = 4
ffn_hidden_size = 768
vocab_size = 2048
seq_len = 512
activation = "swiglu"
"""

STUDY = """model = "tiny.toml"
system = "dgx-h100"
gpus = 8
global_batch_size = 32
tokens = 1e9
{extra}
"""

STRATEGIES = """
[[strategies]]
tp = 2
pp = 2
micro_batch_size = 1
sequence_parallel = true
zero_stage = 1

[[strategies]]
tp = 1
pp = 4
vpp = 2
micro_batch_size = 2
recompute = "selective"

[[strategies]]
tp = 4
pp = 2
micro_batch_size = 4
recompute = "full"
"""

FAILURES = """
[failures]
rate_per_gpu_hour = 0.01

[checkpoint]
mode = "sync"
storage_GBps = 5.0
"""

SEARCH = """
[search]
tp = [1, 2, 4]
pp = [1, 2, 4]
vpp = [1, 2]
micro_batch_size = [1, 2]
recompute = ["none", "full"]
zero_stage = [0, 1]
sequence_parallel = [false, true]
"""


def write_study(directory: Path, *, strategies: bool = True, failures: bool = True,
                search: bool = False, name: str = "study.toml") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tiny.toml").write_text(TINY_MODEL)
    extra = (STRATEGIES if strategies else "") + (FAILURES if failures else "") + (
        SEARCH if search else "")
    path = directory / name
    path.write_text(STUDY.format(extra=extra))
    return path


def enumerated(tmp_path: Path, text: str) -> tuple[list[Any], int]:
    """(valid strategies, invalid combinations) of the search space of a study file's text."""
    from analysis.study import load_study
    from analysis.sweep import enumerate_space

    study = tmp_path / "space.toml"
    study.write_text(text)
    return enumerate_space(load_study(study))
