"""``torch.save`` files written at the disk's speed: torch lays the file out, large writes fill it.

``torch.save`` writes a zip archive: the pickled structure of the checkpoint, then every
tensor storage as one record. Streamed through a Python file object it copies each GPU
storage to pageable host memory, one at a time, and runs the zip writer's CRC-32 over
every byte on the calling thread before the bytes reach the file, so a full-state save
ran at about half the disk's speed. :func:`save_torch_file` writes the same archive in
two steps:

1. ``torch.save`` under ``torch.serialization.skip_data()`` writes the archive with a
   gap where each storage's bytes go. What it writes (headers, the pickle, the zip
   directory: kilobytes) is kept in memory as a :class:`Layout`: pieces of structure
   and the gaps between them.
2. The layout is written in order: the structure from memory, each gap from its
   storage's own memory in pieces of ``PIECE`` bytes, with no copy for a tensor on the
   CPU (or a staged copy of one). A GPU storage comes through two pinned buffers: one
   fills from the device while the other is written.

The file is byte for byte what ``torch.save`` writes, except the zip CRC-32 fields,
which ``skip_data`` leaves unset: ``torch.load`` does not read them (see
``torch.serialization.set_crc32_options``), and the checkpoint's own checksum
(:mod:`recipes_lib.checkpoint.integrity`) covers every byte. ``torch.load``, with
``mmap=True`` too, reads it as any other ``torch.save`` file, and files written before
read as they always did.

torch numbers the storages in the order its pickler first meets them and names each
record by that number; :func:`plan_layout` pickles the checkpoint the same way to list
them, matches each gap to its storage by the record's name, and keeps the layout only
when every gap has its storage's size. Should a later
torch lay its files out otherwise, or refuse to lay out a checkpoint without its data
(a tensor on a backend without storages), the checkpoint is written by ``torch.save``
itself.
"""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any, Protocol, cast

import torch

log = logging.getLogger(__name__)

PIECE = 64 << 20  # bytes handed to one write (and, from a GPU, one pinned buffer)


class Sink(Protocol):
    """Where a checkpoint's bytes go, in order (a file, or a file that also hashes)."""

    def write(self, data: Any, /) -> int: ...


@dataclass
class Layout:
    """A ``torch.save`` file without its storages' bytes.

    Attributes:
        pieces: in file order, the bytes torch wrote (``bytes``) and the size of each
            gap it left for a storage (``int``).
        storages: the storages that fill the gaps, in the same order.
    """

    pieces: list[bytes | int]
    storages: list[torch.UntypedStorage]


class _LayoutRecorder:
    """The file object ``torch.save`` writes to under ``skip_data``: it keeps what is
    written and, for each storage's bytes it skips (a relative seek), the gap."""

    def __init__(self) -> None:
        self.pieces: list[bytes | int] = []
        self._structure = bytearray()
        self._position = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self._structure += view
        self._position += view.nbytes
        return view.nbytes

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        if whence != os.SEEK_CUR or offset < 0:
            raise ValueError(f"torch.save seeked to ({offset}, {whence}): not a gap")
        self._close_structure()
        self.pieces.append(offset)
        self._position += offset
        return self._position

    def tell(self) -> int:
        return self._position

    def flush(self) -> None:
        pass

    def finish(self) -> list[bytes | int]:
        self._close_structure()
        return self.pieces

    def _close_structure(self) -> None:
        if self._structure:
            self.pieces.append(bytes(self._structure))
            self._structure = bytearray()


class _Discard:
    def write(self, data: Any) -> int:
        return len(memoryview(data))


def _storage_order(obj: Any) -> list[torch.UntypedStorage]:
    """The storages of ``obj`` in the order ``torch.save`` numbers them: as its pickler
    first meets them, one per underlying storage (torch's own rule, by ``_cdata``)."""
    seen: dict[int, torch.UntypedStorage] = {}

    class StorageOrder(pickle.Pickler):
        def persistent_id(self, value: Any) -> Any:
            if isinstance(value, torch.storage.TypedStorage):
                storage = value._untyped_storage
            elif isinstance(value, torch.UntypedStorage):
                storage = value
            else:
                return None
            seen.setdefault(storage._cdata, storage)
            return "storage"

    # the same pickle protocol and skip_data state as torch.save's own pass
    StorageOrder(_Discard(), protocol=torch.serialization.DEFAULT_PROTOCOL).dump(obj)
    return list(seen.values())


def plan_layout(obj: Any) -> Layout | None:
    """The layout of ``torch.save(obj)``, or None when its gaps do not match the storages
    (then :func:`save_torch_file` lets ``torch.save`` write the file).

    Each gap is matched to its storage by the record name torch wrote just before it
    (``.../data/<key>``, the key being the storage's number in pickling order), not by
    position: torch releases have written the records in other orders (2.6 sorts the
    keys as strings: 0, 1, 10, 11, 2, ...), and storages of equal size in the wrong gaps
    would pass any size check."""
    recorder = _LayoutRecorder()
    try:
        with torch.serialization.skip_data():
            torch.save(obj, cast(IO[bytes], recorder))
            storages = _storage_order(obj)
    except Exception as err:  # noqa: BLE001 - torch.save itself then says what is wrong
        log.debug("torch.save cannot lay out the checkpoint without its data: %r", err)
        return None
    pieces = recorder.finish()
    kept: list[bytes | int] = []
    filling: list[torch.UntypedStorage] = []
    for piece in pieces:
        if isinstance(piece, int) and piece == 0:
            continue  # an empty storage's record: no bytes to write
        if isinstance(piece, int):
            key = _record_key(kept[-1]) if kept and isinstance(kept[-1], bytes) else None
            if key is None or not key.isdigit() or int(key) >= len(storages):
                log.debug("torch.save's layout names no storage before a gap")
                return None
            storage = storages[int(key)]
            if storage.nbytes() != piece:
                log.debug("torch.save's layout does not match the checkpoint's storages")
                return None
            filling.append(storage)
        kept.append(piece)
    if len(filling) != sum(1 for s in storages if s.nbytes() > 0):
        return None
    return Layout(kept, filling)


_LOCAL_HEADER = b"PK\x03\x04"  # a zip record's local header; its name follows 30 bytes in


def _record_key(structure: bytes) -> str | None:
    """The key of the zip record whose data follows ``structure``: the last part of the
    name in its local header (``archive/data/7`` gives ``7``), or None."""
    start = structure.rfind(_LOCAL_HEADER)
    if start < 0 or len(structure) < start + 30:
        return None
    name_length = int.from_bytes(structure[start + 26 : start + 28], "little")
    name = structure[start + 30 : start + 30 + name_length].decode("utf-8", "replace")
    return name.rsplit("/", 1)[-1] if "/data/" in name else None


def _host_view(storage: torch.UntypedStorage) -> memoryview:
    """The bytes of a CPU storage, without a copy."""
    data = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
    return data.numpy().data


class _DeviceReader:
    """A GPU storage's bytes through two reused pinned buffers: piece ``i + 1`` is
    copied from the device while the caller writes piece ``i``."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._stream: Any = None

    def pieces(self, storage: torch.UntypedStorage) -> Iterator[memoryview]:
        device = storage.device
        if not self._buffers:
            self._buffers = [torch.empty(PIECE, dtype=torch.uint8, pin_memory=True) for _ in "ab"]
            self._stream = torch.cuda.Stream(device)
        size = storage.nbytes()
        source = torch.empty(0, dtype=torch.uint8, device=device)
        source.set_(storage, 0, (size,), (1,))
        # the copies start after whatever the training stream queued for these tensors
        self._stream.wait_stream(torch.cuda.current_stream(device))
        pending: tuple[torch.cuda.Event, torch.Tensor] | None = None
        for index, start in enumerate(range(0, size, PIECE)):
            host = self._buffers[index % 2][: min(PIECE, size - start)]
            with torch.cuda.stream(self._stream):
                host.copy_(source[start : start + host.numel()], non_blocking=True)
                copied = torch.cuda.Event()
                copied.record()
            if pending is not None:  # the buffer now filling was written before this
                pending[0].synchronize()
                yield pending[1].numpy().data
            pending = (copied, host)
        if pending is not None:
            pending[0].synchronize()
            yield pending[1].numpy().data


def _storage_pieces(storage: torch.UntypedStorage, device: _DeviceReader) -> Iterator[memoryview]:
    if storage.device.type == "cpu":
        view = _host_view(storage)
        for start in range(0, view.nbytes, PIECE):
            yield view[start : start + PIECE]
    elif storage.device.type == "cuda":
        yield from device.pieces(storage)
    else:  # another accelerator: one host copy of this storage at a time
        yield from _storage_pieces(storage.cpu(), device)


def write_layout(layout: Layout, sink: Sink) -> int:
    """Write ``layout`` to ``sink`` in file order; returns the bytes written."""
    device = _DeviceReader()
    storages = iter(layout.storages)
    written = 0
    for piece in layout.pieces:
        if isinstance(piece, bytes):
            written += sink.write(piece)
            continue
        for view in _storage_pieces(next(storages), device):
            written += sink.write(view)
    return written


def save_torch_file(obj: Any, sink: Sink) -> None:
    """Write ``obj`` to ``sink`` as ``torch.save`` would (see the module docstring)."""
    layout = plan_layout(obj)
    if layout is None:
        torch.save(obj, cast(IO[bytes], sink))
        return
    write_layout(layout, sink)
