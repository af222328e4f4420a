"""Sharded checkpoint folders written whole or not at all, in the foreground or behind it.

Every rank writes its shard with ``torch.distributed.checkpoint`` (DCP) into a hidden
folder beside the target (``.step000200.ckpt.partial``); rank 0 adds ``meta.pt`` (the
loops' and callbacks' state). Each file is hashed as it is written: DCP writes through
:class:`~recipes_lib.checkpoint.sharded_writer.HashingFileSystemWriter`, whose streams
hash the bytes on their way to the disk, so no file is read back. When every rank is
done, rank 0 gathers the digests, writes ``sha256.json`` inside, and renames the folder
into place; the other ranks wait for that. A crash at any point leaves the previous
checkpoint and a hidden ``.partial`` folder, never a folder named like a checkpoint
that is not one.

With ``asynchronous``, :meth:`ShardedSaver.save` returns once DCP has copied this
rank's shards to host memory; the write, its digests and the rename run on a background
thread that talks over a gloo process group of its own (so its collectives never
interleave with training's). The next save, a load, a removal and the end of training
wait for it first. DCP's staging copies every tensor, including those already on the
CPU, so training may change its weights while the copy is written.
"""

from __future__ import annotations

import logging
import shutil
import time
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from recipes_lib.checkpoint.background import BackgroundWrite
from recipes_lib.checkpoint.integrity import (
    Checksums,
    FileDigest,
    folder_files,
    refuse_foreign_link,
    remember_verified,
    write_checksums,
    write_torch_file,
)
from recipes_lib.checkpoint.layout import checksum_sidecar, partial_checkpoint
from recipes_lib.checkpoint.sharded import SHARDED_METADATA_NAME
from recipes_lib.files import fsync_dir

if TYPE_CHECKING:
    from recipes_lib.checkpoint.sharded_writer import HashingFileSystemWriter

log = logging.getLogger(__name__)


@dataclass
class SaveTiming:
    """One sharded save as rank 0 saw it.

    Attributes:
        path: the checkpoint folder.
        step: the step it holds.
        blocked_s: seconds training waited in ``save`` (the whole save when synchronous;
            the copy to host memory when asynchronous).
        finished_s: seconds from the start of ``save`` until the folder was in place.
        bytes: the folder's size.
        asynchronous: whether it was written in the background.
    """

    path: Path
    step: int | None
    blocked_s: float
    finished_s: float | None = None
    bytes: int = 0
    asynchronous: bool = False


def _replace(partial: Path, target: Path) -> None:
    """Rename the finished folder ``partial`` to ``target``, replacing what is there (a
    link, a file checkpoint and its record, or an older folder of the same name)."""
    if target.is_symlink() or target.is_file():
        target.unlink()
        checksum_sidecar(target).unlink(missing_ok=True)
    elif target.is_dir():
        # no rename replaces a folder that is not empty: move it out of the way first
        old = target.with_name(f".{target.name}.replaced")
        shutil.rmtree(old, ignore_errors=True)
        target.rename(old)
        partial.rename(target)
        shutil.rmtree(old, ignore_errors=True)
        return
    partial.rename(target)


class ShardedSaver:
    """Writes sharded checkpoint folders for a strategy (see the module docstring).

    Args:
        timeout: the collective timeout of its gloo process group.
        on_landed: called on rank 0 with each folder once it is in place (retention).
    """

    def __init__(self, timeout: timedelta, on_landed=None):
        self.timeout = timeout
        self.on_landed = on_landed
        self.timings: list[SaveTiming] = []
        self._group: Any = None
        self._background = BackgroundWrite()

    def _process_group(self) -> Any:
        # gloo: DCP's and our object collectives run on the CPU, and from a background
        # thread they must not share a communicator with training's all-reduces
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=self.timeout)
        return self._group

    def save(
        self, state: dict[str, Any], metadata: dict[str, Any], path: Path, asynchronous: bool
    ) -> None:
        """Write ``state`` (DCP state dicts: ``state_dict``, ``optimizer_N``) and
        ``metadata`` (the rest of Lightning's checkpoint) as the folder ``path``. Every
        rank calls it, with the same ``path``."""
        import torch.distributed.checkpoint as dcp

        from recipes_lib.checkpoint.sharded_writer import HashingFileSystemWriter

        refuse_foreign_link(path)  # every rank sees the same link and stops alike
        self.wait()
        started = time.perf_counter()
        group = self._process_group()
        rank = dist.get_rank()
        partial = partial_checkpoint(path)
        if rank == 0 and partial.exists():  # what an interrupted save of this name left
            shutil.rmtree(partial)
        dist.barrier(group=group)
        partial.mkdir(parents=True, exist_ok=True)
        written: dict[str, FileDigest] = {}  # meta.pt's digest, on rank 0
        if rank == 0:
            written[SHARDED_METADATA_NAME] = write_torch_file(
                metadata, partial / SHARDED_METADATA_NAME
            )
        step = metadata.get("global_step")
        timing = SaveTiming(path, step if isinstance(step, int) else None, 0.0)
        timing.asynchronous = asynchronous
        writer = HashingFileSystemWriter(partial)
        if asynchronous:
            response = dcp.async_save(
                state, checkpoint_id=partial, storage_writer=writer, process_group=group
            )
            # with a stager, DCP answers with a staging and an upload future: wait on the upload
            upload = response if isinstance(response, Future) else response.upload_completion
            timing.blocked_s = time.perf_counter() - started
            self._background.submit(path, self._land, upload, writer, written, timing, started)
        else:
            dcp.save(state, checkpoint_id=partial, storage_writer=writer, process_group=group)
            self._finish(partial, path, writer.digests(partial) | written, timing)
            timing.blocked_s = timing.finished_s = time.perf_counter() - started
        if rank == 0:
            self.timings.append(timing)

    def _land(
        self,
        upload: Future,
        writer: HashingFileSystemWriter,
        written: dict[str, FileDigest],
        timing: SaveTiming,
        started: float,
    ) -> None:
        upload.result()  # every rank's shards and DCP's .metadata are on disk
        partial = partial_checkpoint(timing.path)
        self._finish(partial, timing.path, writer.digests(partial) | written, timing)
        timing.finished_s = time.perf_counter() - started
        log.debug(
            "checkpoint %s written in the background in %.1f s (training waited %.2f s)",
            timing.path.name,
            timing.finished_s,
            timing.blocked_s,
        )

    def _finish(
        self, partial: Path, target: Path, mine: dict[str, FileDigest], timing: SaveTiming
    ) -> None:
        """Gather the digests of the folder's files (``mine``: this rank's, each hashed
        as it was written), record them, rename into place."""
        group = self._process_group()
        rank, world = dist.get_rank(), dist.get_world_size()
        shares: list[Any] = [None] * world
        dist.all_gather_object(shares, mine, group=group)
        if rank == 0:
            gathered = {name: d for share in shares for name, d in share.items()}
            digests = {}
            for name in folder_files(partial):  # the folder says which files it holds
                if name not in gathered:  # never expected: DCP wrote it some other way
                    log.warning("%s was not hashed as it was written; hashing it now", name)
                digests[name] = gathered.get(name) or FileDigest.of(partial / name)
            timing.bytes = sum(d.bytes for d in digests.values())
            write_checksums(partial, Checksums(dict(sorted(digests.items())), timing.step))
            fsync_dir(partial)
            _replace(partial, target)
            fsync_dir(target.parent)
            remember_verified(target)
            if self.on_landed is not None:
                self.on_landed(target)
        dist.barrier(group=group)  # no rank goes on before the folder has its name

    def wait(self) -> None:
        """Block until the background save (if any) has landed.

        Raises:
            CheckpointError: it failed (naming the checkpoint and the error).
        """
        self._background.wait()

    def close(self) -> None:
        """Wait for the background save, then stop the background thread."""
        self._background.close()
