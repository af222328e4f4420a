"""Encoded examples kept between runs, so a second run on the same records, tokenizer
and settings reads them instead of rendering and tokenizing every record again.

Rendering conversations through a chat template and tokenizing them is most of an SFT
or preference run's data time (2,000 pairs: about 3 s of a 3.3 s setup on two CPU
cores). Pretraining keeps its token shards (:mod:`recipes_lib.data.text.prepare`);
this keeps the examples of the chat and preference data modules: one file per source
(SFT) or per source and split (pairs) under ``<data.cache_dir>/encoded/``, named by a
fingerprint of everything that decides them (the records' files, by name, size and
modification time; the tokenizer; the chat template and settings; the sequence length,
split and seed; the data module's kind; the library's version). A hub source is known
by its name, subset and split alone, as for the pretraining shards: a dataset changed
upstream under the same name is read from the cache until ``data.cache_dir`` is
cleared.

A cache is only ever a shortcut: a file that cannot be read is named in one warning
line and the examples are encoded again, and a write that fails (a read-only or full
cache folder) is one warning line, never a failed run.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import zipfile
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from recipes_lib.errors import DiskFullError
from recipes_lib.files import write_atomic

log = logging.getLogger(__name__)

T = TypeVar("T")
FORMAT = 1  # bumped when what a file holds changes: older files are not read
_META = "meta"


def _library_version() -> str:
    """The installed recipes-lib's version: a release may render or cut differently."""
    try:
        return metadata.version("recipes-lib")
    except metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


def encoded_fingerprint(*parts: Any) -> str:
    """A file name's fingerprint of ``parts`` (JSON-serialisable identities), the file
    layout and the library's version."""
    text = json.dumps([FORMAT, _library_version(), *parts], sort_keys=True, default=str)
    blob = text.encode()
    return hashlib.sha256(blob).hexdigest()


def flatten(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Arrays of varying length as one array of their values and one of offsets
    (``len(arrays) + 1`` of them: array ``i`` is ``values[offsets[i]:offsets[i + 1]]``)."""
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    values = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    return values, offsets


def unflatten(values: np.ndarray, offsets: np.ndarray) -> list[np.ndarray]:
    """The arrays :func:`flatten` joined (views of ``values``)."""
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]


class EncodedCache:
    """One cache file of encoded examples: arrays by name, and a JSON-able ``meta``.

    Args:
        cache_dir: ``data.cache_dir``, resolved.
        fingerprint: :func:`encoded_fingerprint` of what decides the examples.
        label: how warnings name the examples (``data.sources.chat, train``).
    """

    def __init__(self, cache_dir: Path, fingerprint: str, label: str) -> None:
        self.path = Path(cache_dir) / "encoded" / f"{fingerprint[:32]}.npz"
        self.label = label

    def load(self) -> tuple[dict[str, np.ndarray], Any] | None:
        """The arrays and meta saved, or None when there is no readable file."""
        try:
            if not self.path.is_file():
                return None
            with np.load(self.path, allow_pickle=False) as saved:
                arrays = {name: saved[name] for name in saved.files}
            meta = json.loads(arrays.pop(_META).tobytes().decode("utf-8"))
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, UnicodeDecodeError) as err:
            log.warning(
                "%s: the encoded examples cached in %s cannot be read (%s: %s); encoding "
                "them again",
                self.label,
                self.path,
                type(err).__name__,
                str(err).splitlines()[0][:200] if str(err) else "",
            )
            return None
        return arrays, meta

    def kept(
        self,
        make: Callable[[], T],
        write: Callable[[T], tuple[dict[str, np.ndarray], Any]],
        read: Callable[[dict[str, np.ndarray], Any], T],
    ) -> T:
        """What ``make`` computes: read back (``read(arrays, meta)``) when an earlier run
        left it here, else made and left here (``write(made)``) for the next run."""
        found = self.load()
        if found is not None:
            return read(*found)
        made = make()
        self.save(*write(made))
        return made

    def save(self, arrays: dict[str, np.ndarray], meta: Any) -> None:
        """Write the arrays and meta (whole or not at all: the file appears by rename, so
        a rank reading it meanwhile never sees half of it)."""
        buffer = io.BytesIO()
        blob = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
        named: dict[str, Any] = {**arrays, _META: blob}  # numpy types its keywords loosely
        np.savez(buffer, **named)
        data = buffer.getvalue()
        try:
            write_atomic(self.path, lambda tmp: tmp.write_bytes(data), size=len(data))
        except (OSError, DiskFullError) as err:
            log.warning(
                "%s: the encoded examples could not be cached in %s (%s); the run goes on "
                "without the cache",
                self.label,
                self.path,
                str(err).splitlines()[0][:200] if str(err) else type(err).__name__,
            )
