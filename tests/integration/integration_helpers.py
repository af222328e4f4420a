"""Helpers for end-to-end runs: tiny configs on a small slice of the embedded corpus."""

from __future__ import annotations

import csv
from pathlib import Path


def tiny_overrides(tmp_path: Path, cache_dir: Path, *extra: str) -> list[str]:
    """The tiny recipe shrunk to seconds: short sequences, a small slice of the corpus."""
    other_data = any(o.startswith("data=") for o in extra)
    return [
        "recipe=pretrain/tiny",
        f"run.dir={tmp_path / 'run'}",
        f"data.cache_dir={cache_dir}",
        *([] if other_data else ["data.sources.stdlib.max_documents=120"]),
        "data.seq_len=64",
        "data.batch_size=4",
        "model.vocab_size=512",
        "data.tokenizer.vocab_size=512",
        "trainer.max_steps=16",
        "trainer.val_check_interval=8",
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "scheduler.warmup=4",
        "run.checkpoint_every_n_steps=8",
        "callbacks=minimal",
        *extra,
    ]


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    """Rows of every CSV log version of a run (a resume starts a new version)."""
    rows: list[dict[str, str]] = []
    for path in sorted((run_dir / "logs").glob("version_*/metrics.csv")):
        with open(path) as f:
            rows.extend(csv.DictReader(f))
    return rows


def metric_series(rows: list[dict[str, str]], name: str) -> list[tuple[int, float]]:
    return [(int(r["step"]), float(r[name])) for r in rows if r.get(name)]
