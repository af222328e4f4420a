"""Checksums of checkpoints: recorded when one is written, verified whenever one is read.

A checkpoint file gets a sidecar beside it (``step000200.ckpt.sha256.json``); a sharded
folder gets ``sha256.json`` inside it, written before the folder is renamed into place,
so the folder and its record appear together. Both hold the same JSON::

    {"format": 2, "global_step": 200,
     "files": {"step000200.ckpt": {"bytes": 2147483648, "xxh3_128": "9f86d0..."}}}

Each file entry names its checksum by its key: ``xxh3_128`` (xxhash's 128-bit XXH3,
many GB/s on one core) for what this version writes, ``sha256`` for records written
before it (format 1), which still verify. The file names stay as they were
(``.sha256.json``), so older runs' records are found where they always were.

A file's digest is computed while it is written: each large block (a piece of a tensor
storage, see :mod:`recipes_lib.checkpoint.torch_file`) is handed to a hashing thread,
so the hash runs beside the write and needs no second read.
Verifying reads every byte once more: sizes first (a truncated file fails at once),
then the digests. A checkpoint verified once in a process is not hashed again while
its files stay the same (size, inode and modification time), so the resume choice and
the load that follows hash it once.

A checkpoint without a record (written before checksums existed, or by DeepSpeed) is
left to :func:`recipes_lib.checkpoint.resume.check_checkpoint`, which checks that it
loads.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from recipes_lib.checkpoint.layout import (
    PARTIAL_SUFFIX,
    SHARDED_CHECKSUM_NAME,
    checksum_sidecar,
    is_own_link,
)
from recipes_lib.checkpoint.torch_file import save_torch_file
from recipes_lib.errors import CheckpointError, CorruptCheckpointError
from recipes_lib.files import write_atomic, write_json_atomic

FORMAT = 2
# the checksums a record may name, by the key its file entries hold the digest under;
# new records use WRITTEN, older ones (format 1) hold sha256
ALGORITHMS: dict[str, Callable[[], Any]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
WRITTEN = "xxh3_128"
_CHUNK = 8 << 20  # bytes read per hashing step
_PARALLEL_FROM = 1 << 20  # a written block this large is hashed beside its write

# real path -> the stat signature it had when it last verified (see verify_checkpoint)
_verified: dict[str, tuple] = {}


def file_digest(path: str | os.PathLike, algorithm: str, chunk_size: int = _CHUNK) -> str:
    """Hex digest of the file at ``path`` by ``algorithm`` (a key of :data:`ALGORITHMS`)."""
    digest = ALGORITHMS[algorithm]()
    try:
        with open(path, "rb") as f:
            while chunk := f.read(chunk_size):
                digest.update(chunk)
    except OSError as err:
        raise CheckpointError(f"cannot read '{path}' to checksum it: {err}") from err
    return digest.hexdigest()


def sha256_file(path: str | os.PathLike, chunk_size: int = _CHUNK) -> str:
    """Hex SHA-256 digest of the file at ``path``, read in ``chunk_size`` pieces."""
    return file_digest(path, "sha256", chunk_size)


@dataclass(frozen=True)
class FileDigest:
    """The size and checksum a file had when it was written, and the checksum's name."""

    bytes: int
    digest: str
    algorithm: str = WRITTEN

    @classmethod
    def of(cls, path: Path) -> FileDigest:
        return cls(path.stat().st_size, file_digest(path, WRITTEN))

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.bytes, self.algorithm: self.digest}

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> FileDigest:
        """The entry's digest under the first key that names a known checksum."""
        algorithm = next(a for a in ALGORITHMS if a in entry)  # StopIteration: none known
        return cls(int(entry["bytes"]), str(entry[algorithm]), algorithm)


@dataclass(frozen=True)
class Checksums:
    """A checkpoint's record: each file (relative to a sharded folder, or the file's own
    name) with its digest, and the step the checkpoint was saved at."""

    files: dict[str, FileDigest]
    global_step: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "global_step": self.global_step,
            "files": {name: d.to_json() for name, d in self.files.items()},
        }

    @classmethod
    def from_json(cls, data: Any, record: Path) -> Checksums:
        try:
            files = {str(name): FileDigest.from_json(e) for name, e in data["files"].items()}
            step = data.get("global_step")
        except (KeyError, TypeError, ValueError, AttributeError, StopIteration) as err:
            raise CorruptCheckpointError(record, f"is not a checksum record ({err!r})") from err
        return cls(files, int(step) if isinstance(step, int) else None)


def record_path(checkpoint: str | os.PathLike) -> Path:
    """Where ``checkpoint``'s checksums are: inside a folder, beside a file."""
    path = Path(checkpoint)
    return path / SHARDED_CHECKSUM_NAME if path.is_dir() else checksum_sidecar(path)


def read_checksums(checkpoint: str | os.PathLike) -> Checksums | None:
    """The record of ``checkpoint`` (a link is read as what it points at), or None when it
    has none.

    Raises:
        CorruptCheckpointError: the record exists but cannot be read.
    """
    record = record_path(Path(checkpoint).resolve())
    if not record.is_file():
        return None
    try:
        data = json.loads(record.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CorruptCheckpointError(record, f"cannot be read: {err}") from err
    return Checksums.from_json(data, record)


def recorded_step(checkpoint: str | os.PathLike) -> int | None:
    """The step ``checkpoint``'s record names, without opening the checkpoint; None when
    there is no readable record."""
    try:
        record = read_checksums(checkpoint)
    except CheckpointError:
        return None
    return record.global_step if record is not None else None


def write_checksums(checkpoint: str | os.PathLike, checksums: Checksums) -> Path:
    """Write ``checkpoint``'s record atomically (beside a file, inside a folder)."""
    return write_json_atomic(record_path(checkpoint), checksums.to_json())


class HashingWriter:
    """A write-only file object that hashes what passes through it: a checkpoint file
    (or a shard DCP writes) is streamed through it, so the digest costs no second read.

    A large block is hashed on a thread of its own while this one writes it (both let
    go of the GIL), and ``write`` returns once both are done: the block is memory its
    caller may free or reuse as soon as ``write`` returns (a pinned buffer refilled from
    the GPU).
    """

    def __init__(self, file, algorithm: str = WRITTEN):
        self._file = file
        self._algorithm = algorithm
        self._digest = ALGORITHMS[algorithm]()
        self._hasher: ThreadPoolExecutor | None = None
        self.size = 0

    def write(self, data) -> int:
        view = memoryview(data)
        self.size += view.nbytes
        if view.nbytes < _PARALLEL_FROM:
            self._digest.update(view)
            return self._file.write(view)
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checksum")
        hashed = self._hasher.submit(self._digest.update, view)
        try:
            return self._file.write(view)
        finally:
            hashed.result()

    def flush(self) -> None:
        self._file.flush()

    def tell(self) -> int:
        return self._file.tell()

    def fileno(self) -> int:
        return self._file.fileno()

    def hexdigest(self) -> str:
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)
        return self._digest.hexdigest()

    def file_digest(self) -> FileDigest:
        """The size and digest of everything written."""
        return FileDigest(self.size, self.hexdigest(), self._algorithm)


def refuse_foreign_link(path: str | os.PathLike) -> None:
    """Refuse to write a checkpoint at ``path`` when it is a link someone placed there.

    Writing would replace the link with a file (or, written through, change the file it
    names, perhaps another run's); the run's own ``last.ckpt`` link is replaced as usual.

    Raises:
        CheckpointError: naming the link and where it points.
    """
    link = Path(path)
    if link.is_symlink() and not is_own_link(link):
        raise CheckpointError(
            f"checkpoint '{link}' is a link to '{os.readlink(link)}', which a run never "
            "writes through or replaces; move the link away or train in another run.dir"
        )


def tensor_bytes(state: Any) -> int:
    """The bytes of every tensor in a (nested) checkpoint: about its size on disk."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(tensor_bytes(v) for v in state)
    return 0


def save_torch_checkpoint(checkpoint: dict[str, Any], path: str | os.PathLike) -> Checksums:
    """Write ``checkpoint`` to ``path`` atomically as a ``torch.save`` file, in large
    writes (:func:`~recipes_lib.checkpoint.torch_file.save_torch_file`), then record its
    size, checksum and ``global_step`` beside it.

    An older record of ``path`` (``last.ckpt`` is rewritten) is removed first and the new
    one written after the file is in place, so a crash anywhere leaves either a file
    that matches its record or one without a record (checked by loading it), never a
    good file whose record disagrees.

    Raises:
        CheckpointError: ``path`` is a link placed by someone else (:func:`refuse_foreign_link`).
        DiskFullError: the disk filled; the older checkpoints are as they were.
    """
    target = Path(path)
    refuse_foreign_link(target)
    checksum_sidecar(target).unlink(missing_ok=True)
    digest = write_torch_file(checkpoint, target)
    step = checkpoint.get("global_step")
    checksums = Checksums({target.name: digest}, step if isinstance(step, int) else None)
    write_checksums(target, checksums)
    remember_verified(target)
    return checksums


def write_torch_file(obj: Any, path: str | os.PathLike) -> FileDigest:
    """Write ``obj`` to ``path`` atomically as a ``torch.save`` file in large writes
    (:func:`~recipes_lib.checkpoint.torch_file.save_torch_file`), hashing beside them.

    Returns:
        the file's size and checksum, as written.

    Raises:
        DiskFullError: the disk filled; ``path`` is as it was.
    """
    written: list[FileDigest] = []

    def write(partial: Path) -> None:
        with open(partial, "wb") as f:
            hashing = HashingWriter(f)
            save_torch_file(obj, hashing)
        written.append(hashing.file_digest())

    write_atomic(path, write, size=tensor_bytes(obj))
    return written[0]


def folder_files(folder: Path) -> list[str]:
    """Every file of a sharded folder that its record lists: all but the record itself and
    files still being written (relative POSIX paths, sorted)."""
    return sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and p.name != SHARDED_CHECKSUM_NAME and not p.name.endswith(PARTIAL_SUFFIX)
    )


def _stat_key(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _signature(real: Path, checksums: Checksums) -> tuple | None:
    base = real if real.is_dir() else real.parent
    names = checksums.files if real.is_dir() else {real.name: None}
    keys = [_stat_key(record_path(real))] + [_stat_key(base / n) for n in sorted(names)]
    return None if None in keys else tuple(keys)


def remember_verified(checkpoint: str | os.PathLike) -> None:
    """Note that ``checkpoint`` matches its record (it was just written and hashed)."""
    real = Path(checkpoint).resolve()
    record = read_checksums(real)
    if record is not None and (signature := _signature(real, record)) is not None:
        _verified[str(real)] = signature


def forget_verified() -> None:
    """Forget which checkpoints verified in this process (a fresh process's view: the
    next verification hashes again); for measurements and tests."""
    _verified.clear()


def _problem(real: Path, checksums: Checksums) -> str | None:
    """What is wrong with ``real`` against its record (a phrase to follow its name), or
    None when it matches."""
    files: list[tuple[str | None, Path, FileDigest]]
    if real.is_dir():
        files = [(name, real / name, checksums.files[name]) for name in sorted(checksums.files)]
    elif len(checksums.files) == 1:
        files = [(None, real, next(iter(checksums.files.values())))]
    else:
        return f"has a record listing {len(checksums.files)} files, not 1"
    for name, path, want in files:  # sizes first: a truncated file fails without hashing
        if not path.is_file():
            return f"lacks {name}, which its record lists"
        size = path.stat().st_size
        if size != want.bytes:
            what = "is" if name is None else f"has {name}"
            if size < want.bytes:
                return f"{what} truncated: {size:,} of {want.bytes:,} bytes"
            return f"{what} {size:,} bytes long, {want.bytes:,} recorded"
    for name, path, want in files:
        if file_digest(path, want.algorithm) != want.digest:
            what = "" if name is None else f"has {name}, which "
            return f"{what}differs from the {want.algorithm} checksum recorded when it was written"
    return None


def verify_checkpoint(checkpoint: str | os.PathLike) -> bool:
    """Check ``checkpoint`` (a file, a sharded folder, or a link to either) against the
    checksums recorded when it was written.

    Returns:
        True when it matches its record; False when it has none (written before
        checksums, or by DeepSpeed): then only loading it can tell.

    Raises:
        CheckpointError: it does not exist.
        CorruptCheckpointError: it differs from its record (naming the file and how).
    """
    path = Path(checkpoint)
    real = path.resolve()
    if not real.exists():
        raise CheckpointError(f"no such checkpoint '{path}'")
    checksums = read_checksums(real)
    if checksums is None:
        return False
    signature = _signature(real, checksums)
    if signature is not None and _verified.get(str(real)) == signature:
        return True
    problem = _problem(real, checksums)
    if problem is not None:
        raise CorruptCheckpointError(path, problem)
    if signature is not None:
        _verified[str(real)] = signature
    return True
