"""Disk space for a run's checkpoints, from its config: what :func:`checkpoint_space` adds up.

A checkpoint holds the weights as stored (:mod:`.parameters`' rules: QLoRA's base in
4 bits, LoRA's frozen projections in bf16 where ``adapter.base_dtype`` says so) and the
optimizer's state of the trainable ones, as the optimizer's spec counts it
(:func:`.optimizer_state.optimizer_state_bytes`, the memory estimate's figure too). The
run keeps its retention's step checkpoints (``run.keep_last_checkpoints``,
``run.keep_every_n_steps``) and, for a moment, one more: a new checkpoint lands before
the oldest is removed. A sharded checkpoint's folders together are the same size,
whatever the world size.

The space is the free space of the file system ``run.dir`` is on, plus what the
checkpoints already in ``run.dir`` take (a resumed run replaces them as it goes).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from recipes_lib.checkpoint.layout import RunDir
from recipes_lib.checkpoint.retention import retention_of
from recipes_lib.config.schema import RunConfig
from recipes_lib.launch_check.activations import DecoderShape
from recipes_lib.launch_check.memory import nf4_bytes_per_weight
from recipes_lib.launch_check.optimizer_state import optimizer_state_bytes
from recipes_lib.launch_check.parameters import ParameterCounts, weight_bytes_of


def checkpoint_bytes(cfg: RunConfig) -> int:
    """About the size of one checkpoint of ``cfg``: its stored weights and optimizer state."""
    weights = ParameterCounts.of(DecoderShape.of(cfg), cfg)
    weight_bytes = weight_bytes_of(cfg.precision.name)
    narrowed = weights.narrowed if weight_bytes == 4 else 0  # stored in bf16
    dense = weights.total + weights.adapters - weights.quantized
    stored: float = dense * weight_bytes - 2 * narrowed
    stored += weights.quantized * nf4_bytes_per_weight(cfg.adapter.double_quant)
    return int(stored) + optimizer_state_bytes(cfg)


def kept_checkpoints(cfg: RunConfig, steps: int) -> int:
    """The most step checkpoints ``run.dir`` holds at once over ``steps`` optimizer steps:
    the retention's, one more while the next lands, never more than are written."""
    every = cfg.run.checkpoint_every_n_steps
    written = steps // every if every > 0 and cfg.run.save_top_k != 0 else 0
    if written == 0:
        return 1  # last.ckpt alone, at the end
    retention = retention_of(cfg.run, cfg.stage.average_last_k)
    if retention.keeps_all:
        return written
    kept = max(retention.keep_last, 1) + 1
    if retention.keep_every:
        kept += sum(1 for k in range(1, written + 1) if (k * every) % retention.keep_every == 0)
    return min(written, kept)


@dataclass(frozen=True)
class CheckpointSpace:
    """The checkpoints' disk space against what the run folder's file system has.

    Attributes:
        each: bytes of one checkpoint.
        count: how many exist at once at most.
        free: free bytes where ``folder`` is (or would be created).
        existing: bytes of the checkpoints already in ``folder``.
        folder: the run folder.
    """

    each: int
    count: int
    free: int
    existing: int
    folder: Path

    @property
    def needed(self) -> int:
        return self.each * self.count

    @property
    def available(self) -> int:
        return self.free + self.existing


def checkpoint_space(cfg: RunConfig, steps: int) -> CheckpointSpace:
    """The checkpoints ``cfg`` keeps over ``steps`` steps against its folder's disk."""
    folder = Path(cfg.run.dir)
    found = RunDir(folder).checkpoints.glob("*.ckpt")  # links take no space here
    existing = sum(_size(p) for p in found if not p.is_symlink())
    return CheckpointSpace(
        each=checkpoint_bytes(cfg),
        count=kept_checkpoints(cfg, steps),
        free=shutil.disk_usage(_existing_parent(folder)).free,
        existing=existing,
        folder=folder,
    )


def _existing_parent(folder: Path) -> Path:
    """``folder``, or its nearest ancestor that exists (a run folder not made yet)."""
    path = folder.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _size(path: Path) -> int:
    """Bytes of a checkpoint file, or of every file in a sharded folder."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return os.path.getsize(path)
