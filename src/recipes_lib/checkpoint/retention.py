"""Which step checkpoints a run keeps: the last K, every M-th step, never the newest.

Applied each time a checkpoint lands in the run's ``checkpoints/`` folder (by
:class:`~recipes_lib.checkpoint.io.VerifiedCheckpointIO` for files, by the sharded
writer for folders), on global rank 0:

- the newest ``run.keep_last_checkpoints`` (K) step checkpoints up to the one just
  written are kept (-1 keeps every one);
- every step checkpoint at a multiple of ``run.keep_every_n_steps`` (M) is kept;
- the checkpoint just written is never removed (``last.ckpt``, when it links to one
  about to be removed, is pointed at the new one by ``ModelCheckpoint`` right after);
- checkpoints of later steps (left by an earlier attempt that went further) are left
  alone: the run overwrites them when it gets there.

``stage.average_last_k`` raises K to at least its k, so the average finds its
checkpoints. Checkpoints moved aside (``*.corrupt-<time>``) are not step checkpoints
and are never removed.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from recipes_lib.checkpoint.layout import checksum_sidecar
from recipes_lib.checkpoint.weights import list_step_checkpoints, listed_step
from recipes_lib.config.schema import RunInfoConfig
from recipes_lib.files import global_rank

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Retention:
    """How many step checkpoints stay.

    Attributes:
        keep_last: the newest K step checkpoints are kept; -1 keeps every one.
        keep_every: step checkpoints at multiples of M are kept too (None: none).
    """

    keep_last: int = 2
    keep_every: int | None = None

    @property
    def keeps_all(self) -> bool:
        return self.keep_last < 0


def retention_of(run: RunInfoConfig, average_last_k: int | None = None) -> Retention:
    """The retention of a run's config (``run.keep_last_checkpoints``,
    ``run.keep_every_n_steps``), K raised to ``stage.average_last_k``."""
    if run.save_top_k == 1 and global_rank() == 0:
        log.warning(
            "run.save_top_k=1 is deprecated: it keeps only the newest step checkpoint, which "
            "leaves nothing to fall back to; run.keep_last_checkpoints=N says how many stay"
        )
    keep = run.keep_last_checkpoints
    if average_last_k is not None and keep >= 0:
        keep = max(keep, average_last_k)
    return Retention(keep_last=keep, keep_every=run.keep_every_n_steps)


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Delete a checkpoint (file or sharded folder) and its checksum sidecar."""
    target = Path(path)
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target)
    else:
        target.unlink(missing_ok=True)
    checksum_sidecar(target).unlink(missing_ok=True)


def apply_retention(folder: str | os.PathLike, retention: Retention, newest: Path) -> list[Path]:
    """Remove the step checkpoints of ``folder`` that ``retention`` does not keep, now that
    ``newest`` has landed; returns what was removed (see the module docstring)."""
    if retention.keeps_all:
        return []
    newest_step = listed_step(Path(newest))
    if newest_step is None:  # nothing to measure "the last K" from: keep everything
        return []
    directory = Path(folder)
    protected = Path(newest).resolve()
    earlier = [(s, p) for s, p in list_step_checkpoints(directory) if s <= newest_step]
    recent = {p for _, p in earlier[-max(retention.keep_last, 1) :]}
    removed = []
    for step, path in earlier:
        every = retention.keep_every
        if path in recent or path.resolve() == protected or (every and step % every == 0):
            continue
        remove_checkpoint(path)
        removed.append(path)
    if removed:
        log.debug("retention removed %s", ", ".join(p.name for p in removed))
    return removed
