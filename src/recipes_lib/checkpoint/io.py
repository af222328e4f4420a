"""Lightning's checkpoint files, written atomically with a checksum and verified when read.

:class:`VerifiedCheckpointIO` is the ``CheckpointIO`` plugin every run's Trainer gets
(``recipes_lib.train.build_trainer``). Lightning hands every single-file save to it
(``ModelCheckpoint``'s, ``trainer.save_checkpoint``'s) on global rank 0 and every
load on each rank, so no callback needs to know:

- a save streams ``torch.save`` to a hidden temporary file, hashing as it writes,
  syncs it and renames it into place, then records its size, SHA-256 and step beside
  it (:func:`~recipes_lib.checkpoint.integrity.save_torch_checkpoint`); a save in the
  run's ``checkpoints/`` folder then applies the run's retention;
- a load checks the file against its record first and refuses one that differs,
  naming the file and how (a checkpoint without a record loads as before);
- a removal takes the record with the file.

Sharded folders are written by :class:`~recipes_lib.parallel.engines.FSDP2Strategy`,
which asks this plugin for the retention (:meth:`VerifiedCheckpointIO.retain`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch.plugins.io import TorchCheckpointIO

from recipes_lib.checkpoint.integrity import save_torch_checkpoint, verify_checkpoint
from recipes_lib.checkpoint.layout import checksum_sidecar
from recipes_lib.checkpoint.retention import Retention, apply_retention


class VerifiedCheckpointIO(TorchCheckpointIO):
    """Atomic, checksummed checkpoint files, verified on load, pruned by retention.

    Args:
        folder: the run's ``checkpoints/`` folder: retention applies there only, never
            to a checkpoint saved elsewhere.
        retention: which step checkpoints stay (None: all of them).
    """

    def __init__(self, folder: str | os.PathLike | None = None, retention: Retention | None = None):
        super().__init__()
        self.folder = Path(folder) if folder is not None else None
        self.retention = retention

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        target = Path(path)
        save_torch_checkpoint(checkpoint, target)
        self.retain(target)

    def load_checkpoint(
        self,
        path: str | os.PathLike,
        map_location: Callable | Any = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        verify_checkpoint(path)  # raises CorruptCheckpointError, naming the file
        return super().load_checkpoint(
            Path(path), map_location=map_location, weights_only=weights_only
        )

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        super().remove_checkpoint(Path(path))
        checksum_sidecar(path).unlink(missing_ok=True)

    def retain(self, newest: str | os.PathLike) -> list[Path]:
        """Apply the retention to the run's folder now that ``newest`` has landed there
        (global rank 0 only); returns the checkpoints removed."""
        target = Path(newest)
        if self.retention is None or self.folder is None:
            return []
        if target.parent.resolve() != self.folder.resolve():
            return []
        return apply_retention(self.folder, self.retention, target)
