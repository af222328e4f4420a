"""Lightning's checkpoint files, written atomically with a checksum and verified when read.

:class:`VerifiedCheckpointIO` is the ``CheckpointIO`` plugin every run's Trainer gets
(``recipes_lib.assembly.build_trainer``). Lightning hands every single-file save to it
(``ModelCheckpoint``'s, ``trainer.save_checkpoint``'s) on global rank 0 and every
load on each rank, so no callback needs to know:

- a save writes the checkpoint as a ``torch.save`` file to a hidden temporary file in
  large writes, hashing beside them, syncs it and renames it into place, then records
  its size, checksum and step beside it
  (:func:`~recipes_lib.checkpoint.integrity.save_torch_checkpoint`); a save in the
  run's ``checkpoints/`` folder then applies the run's retention;
- a load checks the file against its record first and refuses one that differs,
  naming the file and how (a checkpoint without a record loads as before);
- a removal takes the record with the file.

With ``asynchronous`` (``strategy.async_checkpoint``), a save copies the checkpoint
once into reused host buffers (:class:`~recipes_lib.checkpoint.staging.HostStaging`,
pinned on CUDA) and returns; a writer thread writes and records it as above. The next
save, a load, a removal and the end of fit (:meth:`teardown`) wait for it first, and a
write that failed raises there as a ``CheckpointError``, so a run never ends with its
last checkpoint unwritten or a failure unseen. DDP saves on global rank 0 through this
plugin, so it writes in the background the same way.

Sharded folders are written by :class:`~recipes_lib.parallel.engines.FSDP2Strategy`,
which asks this plugin for the retention (:meth:`VerifiedCheckpointIO.retain`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lightning.pytorch.plugins.io import TorchCheckpointIO

from recipes_lib.checkpoint.background import BackgroundWrite
from recipes_lib.checkpoint.integrity import (
    refuse_foreign_link,
    save_torch_checkpoint,
    verify_checkpoint,
)
from recipes_lib.checkpoint.layout import checksum_sidecar
from recipes_lib.checkpoint.retention import Retention, apply_retention
from recipes_lib.checkpoint.staging import HostStaging


class VerifiedCheckpointIO(TorchCheckpointIO):
    """Atomic, checksummed checkpoint files, verified on load, pruned by retention.

    Args:
        folder: the run's ``checkpoints/`` folder: retention applies there only, never
            to a checkpoint saved elsewhere.
        retention: which step checkpoints stay (None: all of them).
        asynchronous: write each save in the background from a host copy.

    Attributes:
        final_step: the run's last step, asked at each save (the Trainer's ``max_steps``):
            a save at that step is written in the foreground, so what reads it after fit
            (the pipeline, an export) finds it in place.
        blocked_s: seconds the last save kept its caller waiting (the host copy when
            asynchronous, the whole save otherwise).
    """

    def __init__(
        self,
        folder: str | os.PathLike | None = None,
        retention: Retention | None = None,
        asynchronous: bool = False,
    ):
        super().__init__()
        self.folder = Path(folder) if folder is not None else None
        self.retention = retention
        self.asynchronous = asynchronous
        self.final_step: Callable[[], int] | None = None
        self.blocked_s = 0.0
        self._staging = HostStaging()
        self._background = BackgroundWrite()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        self.wait()  # one save at a time; an earlier failure raises here
        started = time.perf_counter()
        target = Path(path)
        step = checkpoint.get("global_step")
        last = self.final_step() if self.final_step is not None else 0
        final = isinstance(step, int) and 0 < last <= step
        if not self.asynchronous or final:
            self._write(checkpoint, target)
        else:
            refuse_foreign_link(target)  # in the caller, before anything is copied
            # the folder exists when save returns: Lightning links last.ckpt in it at once
            target.parent.mkdir(parents=True, exist_ok=True)
            staged = self._staging.stage(checkpoint)
            self._background.submit(target, self._write, staged, target)
        self.blocked_s = time.perf_counter() - started

    def _write(self, checkpoint: dict[str, Any], target: Path) -> None:
        save_torch_checkpoint(checkpoint, target)
        self.retain(target)

    def wait(self) -> None:
        """Block until the background save (if any) is written and recorded.

        Raises:
            CheckpointError: it failed (naming the checkpoint and the error).
        """
        self._background.wait()

    def teardown(self) -> None:
        """The end of fit: the last save lands (or its failure raises) before fit returns."""
        try:
            self._background.close()
        finally:
            self._staging.release()

    def load_checkpoint(
        self,
        path: str | os.PathLike,
        map_location: Callable | Any = lambda storage, loc: storage,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        self.wait()
        verify_checkpoint(path)  # raises CorruptCheckpointError, naming the file
        return super().load_checkpoint(
            Path(path), map_location=map_location, weights_only=weights_only
        )

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        self.wait()
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
