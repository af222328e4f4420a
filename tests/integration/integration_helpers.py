"""Helpers for end-to-end runs: tiny configs on a small slice of the embedded corpus."""

from __future__ import annotations

from pathlib import Path

import torch
from run_helpers import metric_series, read_metrics
from tiny import QUIET_OVERRIDES, SMALL_VOCAB_OVERRIDES

__all__ = ["metric_series", "read_metrics", "tiny_overrides"]


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
        *SMALL_VOCAB_OVERRIDES,
        "trainer.max_steps=16",
        "trainer.val_check_interval=8",
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=1",
        *QUIET_OVERRIDES,
        "scheduler.warmup=4",
        "run.checkpoint_every_n_steps=8",
        "callbacks=minimal",
        *extra,
    ]


def checkpoint_tensors(path: Path) -> list[torch.Tensor]:
    """Every tensor of a Lightning checkpoint file: its weights, then each optimizer's
    state."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    tensors = list(state["state_dict"].values())
    for optimizer in state["optimizer_states"]:
        tensors += [
            t for s in optimizer["state"].values() for t in s.values() if torch.is_tensor(t)
        ]
    return tensors
