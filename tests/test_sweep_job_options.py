"""``trainsim sweep --model … --system … --gpus … --gbs …``: a sweep of a job's default space
without writing a study file — the same ranking as the study file that says the same."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from tests.test_cli import run


def test_the_options_sweep_what_the_study_file_does(tmp_path: Path) -> None:
    study = tmp_path / "job.toml"
    study.write_text('model = "gpt-1.7b"\nsystem = "dgx-a100-80gb"\ngpus = 16\n'
                     "global_batch_size = 64\nseq_len = 1024\n", encoding="utf-8")
    by_file = run("sweep", str(study), "-o", str(tmp_path / "f"), "--top-k", "0",
                  "--workers", "1")
    assert by_file.returncode == 0, by_file.stderr
    by_options = run("sweep", "-o", str(tmp_path / "o"), "--top-k", "0", "--workers", "1",
                     "--model", "gpt-1.7b", "--system", "dgx-a100-80gb", "--gpus", "16",
                     "--gbs", "64", "--seq-len", "1024")
    assert by_options.returncode == 0, by_options.stderr
    a, b = (pl.read_csv(tmp_path / d / "results.csv").select("rank", "strategy", "step_time_s")
            for d in ("f", "o"))  # (equal times ranked by their labels: the same order)
    assert a.height > 10 and a.equals(b)
    assert "trainsim estimate --model gpt-1.7b@seq1024" in by_options.stdout


def test_a_token_budget_gives_the_days_to_train(tmp_path: Path) -> None:
    """``--tokens``: each strategy's healthy days to train, the budget over its tokens/s."""
    r = run("sweep", "-o", str(tmp_path / "t"), "--top-k", "0", "--workers", "1",
            "--model", "gpt-1.7b", "--system", "dgx-a100-80gb", "--gpus", "16", "--gbs", "64",
            "--seq-len", "1024", "--tokens", "1e10")
    assert r.returncode == 0, r.stderr
    rows = pl.read_csv(tmp_path / "t" / "results.csv").head(3)
    for train_s, rate in zip(rows["time_to_train_s"], rows["tokens_per_s"], strict=True):
        assert train_s == pytest.approx(1e10 / rate, rel=1e-6)


def test_a_missing_or_doubled_job_is_named(tmp_path: Path) -> None:
    half = run("sweep", "-o", str(tmp_path / "a"), "--model", "gpt-1.7b", "--gpus", "16")
    assert half.returncode != 0 and "needs --system, --gbs" in half.stdout + half.stderr
    both = run("sweep", "default", "-o", str(tmp_path / "b"), "--gpus", "16")
    assert both.returncode != 0 and "not both" in both.stdout + both.stderr
    assert "Traceback" not in half.stderr + both.stderr


def test_scale_takes_the_job_options_too(tmp_path: Path) -> None:
    """``trainsim scale --gpus 8,16 --model … --system … --gbs …``: each count's best of the
    default space, the study named by its model."""
    r = run("scale", "--gpus", "8,16", "-o", str(tmp_path / "s"), "--workers", "1",
            "--model", "gpt-1.7b", "--system", "dgx-a100-80gb", "--gbs", "64",
            "--seq-len", "1024")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "gpt-1.7b@seq1024: gpt-1.7b@seq1024 on dgx-a100-80gb, global batch 64" in text
    assert "tp1-pp1-dp16" in text
