"""DCP's file-system writer, with every file hashed as it is written.

A sharded checkpoint's files are written by ``torch.distributed.checkpoint`` (DCP)
through the streams of its ``FileSystem``. :class:`HashingFileSystemWriter` is DCP's own
``FileSystemWriter`` (one file per rank, each synced before DCP goes on) whose file
system hands DCP streams that hash the bytes on their way to the disk
(:class:`~recipes_lib.checkpoint.integrity.HashingWriter`), so the checksums recorded
in the folder cost no second read of it. Its digests are those of whole files only: a
stream DCP abandons on an error records nothing.

Importing DCP takes seconds, so :mod:`recipes_lib.checkpoint.sharded_save` imports this
module when it first saves.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from recipes_lib.checkpoint.integrity import FileDigest, HashingWriter


class _HashedStream(HashingWriter):
    """A file DCP writes, hashed as it goes; DCP also asks where it is (``tell``), syncs
    it (``fileno``) and closes it."""

    def close(self) -> None:
        self._file.close()


class _HashingFileSystem(FileSystem):
    """DCP's local file system, recording the digest of every file written through it."""

    def __init__(self) -> None:
        super().__init__()
        self._digests: dict[Path, FileDigest] = {}
        self._lock = threading.Lock()  # DCP may write files from several threads

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if mode != "wb":
            with super().create_stream(path, mode) as plain:
                yield plain
            return
        with open(path, "wb") as f:
            hashed = _HashedStream(f)
            yield hashed
        digest = hashed.file_digest()  # reached only when the file was written whole
        with self._lock:
            self._digests[Path(path)] = digest

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)  # DCP writes .metadata.tmp, then renames it
        with self._lock:
            if Path(path) in self._digests:
                self._digests[Path(new_path)] = self._digests.pop(Path(path))

    def written(self) -> dict[Path, FileDigest]:
        with self._lock:
            return dict(self._digests)


class HashingFileSystemWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` that knows the size and checksum of every file it
    wrote (:meth:`digests`)."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path)
        self._hashing = _HashingFileSystem()
        self.fs = self._hashing

    def digests(self, folder: Path) -> dict[str, FileDigest]:
        """The files written into ``folder``, by path relative to it."""
        return {
            path.relative_to(folder).as_posix(): digest
            for path, digest in self._hashing.written().items()
            if path.is_relative_to(folder)
        }
