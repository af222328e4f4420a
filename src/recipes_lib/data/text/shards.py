"""Tokenized shards: a source's documents tokenized once into memory-mapped files.

A shard directory holds

    tokens.bin       every document's token ids, each followed by EOS, back to back
                     (uint16 when the vocabulary has at most 65535 ids, else uint32)
    doc_offsets.npy  int64 (n_docs + 1,): document d is tokens[offsets[d]:offsets[d + 1]]
    meta.json        dtype, counts, fingerprint, tokenizer hash, source description

A source is written as a pair of shards, ``train/`` and ``val/`` (a seeded hold-out of
whole documents), inside one directory named by the source's fingerprint. This module
reads a pair and says whether a cached one is whole;
:mod:`recipes_lib.data.text.shard_writer` writes one.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recipes_lib.errors import DataError
from recipes_lib.files import move_aside

SHARD_FORMAT_VERSION = 1
TOKENS_FILE = "tokens.bin"
OFFSETS_FILE = "doc_offsets.npy"
META_FILE = "meta.json"
SPLITS = ("train", "val")

_META_KEYS = ("format_version", "dtype", "n_tokens", "n_docs", "eos_id")
# Deleting only a split's folder leaves a pair that cannot be renamed over, so the advice
# is to prepare again, which moves the damaged pair aside itself (set_aside).
_REBUILD = (
    "prepare the data again (recipes-prepare, or the run): the shards are moved aside and rebuilt"
)


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id of a ``vocab_size`` vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 65535 else np.dtype(np.uint32)


def shard_fingerprint(
    source_fingerprint: str, tokenizer_sha256: str, val_fraction: float, seed: int
) -> str:
    """The name of a source's cached shard pair: what went in and how it was split."""
    identity = {
        "format_version": SHARD_FORMAT_VERSION,
        "source": source_fingerprint,
        "tokenizer": tokenizer_sha256,
        "val_fraction": float(val_fraction),
        "seed": int(seed),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


class TokenShard:
    """A read-only view of one shard directory.

    ``tokens`` is memory-mapped on first use and not pickled, so DataLoader workers
    (forked or spawned) each map the file themselves instead of copying it.
    """

    def __init__(self, path: Path, meta: dict, doc_offsets: np.ndarray) -> None:
        self.path = path
        self.meta = meta
        self.doc_offsets = doc_offsets  # (n_docs + 1,) int64
        self.dtype = np.dtype(meta["dtype"])
        self.n_tokens: int = meta["n_tokens"]
        self.n_docs: int = meta["n_docs"]
        self.eos_id: int = meta["eos_id"]
        self._tokens: np.ndarray | None = None

    @property
    def source(self) -> str:
        """The source's name and origin, for messages."""
        return f"{self.meta.get('source', '?')} ({self.meta.get('description', self.path)})"

    @property
    def tokens(self) -> np.ndarray:
        """All token ids, (n_tokens,), memory-mapped."""
        if self._tokens is None:
            if self.n_tokens == 0:
                self._tokens = np.empty(0, dtype=self.dtype)
            else:
                self._tokens = np.memmap(
                    self.path / TOKENS_FILE, dtype=self.dtype, mode="r", shape=(self.n_tokens,)
                )
        return self._tokens

    def document(self, index: int) -> np.ndarray:
        """The tokens of document ``index``, its EOS included."""
        return self.tokens[self.doc_offsets[index] : self.doc_offsets[index + 1]]

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_tokens"] = None
        return state

    def __repr__(self) -> str:
        return f"TokenShard({self.path}, n_docs={self.n_docs}, n_tokens={self.n_tokens})"

    @classmethod
    def open(cls, path: str | Path, verify: bool = False) -> TokenShard:
        """Open a shard directory, checking its files against meta.json.

        Args:
            path: the shard directory.
            verify: also hash tokens.bin against meta.json and check every document
                ends with EOS (reads the whole file).

        Raises:
            DataError: naming the missing, truncated or corrupt file.
        """
        path = Path(path)
        meta_file = path / META_FILE
        if not meta_file.is_file():
            raise DataError(f"shard {path} is missing {META_FILE}; {_REBUILD}")
        try:
            meta = json.loads(meta_file.read_text())
            missing = [k for k in _META_KEYS if k not in meta]
        except (ValueError, TypeError) as err:
            raise DataError(f"{meta_file} is corrupt ({err}); {_REBUILD}") from err
        if missing:
            raise DataError(f"{meta_file} lacks {missing}; {_REBUILD}")
        if meta["format_version"] != SHARD_FORMAT_VERSION:
            raise DataError(
                f"{meta_file} has format_version {meta['format_version']}, this version of "
                f"recipes-lib reads {SHARD_FORMAT_VERSION}; {_REBUILD}"
            )
        dtype = np.dtype(meta["dtype"])
        tokens_file = path / TOKENS_FILE
        expected = meta["n_tokens"] * dtype.itemsize
        actual = tokens_file.stat().st_size if tokens_file.is_file() else None
        if actual != expected:
            found = "missing" if actual is None else f"{actual} bytes"
            raise DataError(
                f"{tokens_file} is {found}, expected {expected} bytes "
                f"({meta['n_tokens']} {dtype.name} tokens per {META_FILE}); {_REBUILD}"
            )
        offsets_file = path / OFFSETS_FILE
        try:
            offsets = np.load(offsets_file, allow_pickle=False)
        except (OSError, ValueError, EOFError) as err:
            raise DataError(f"{offsets_file} is missing or corrupt ({err}); {_REBUILD}") from err
        if (
            offsets.dtype != np.int64
            or offsets.shape != (meta["n_docs"] + 1,)
            or offsets[0] != 0
            or offsets[-1] != meta["n_tokens"]
            or np.any(np.diff(offsets) < 1)
        ):
            raise DataError(
                f"{offsets_file} does not match {META_FILE} (want int64 of shape "
                f"({meta['n_docs'] + 1},) from 0 to {meta['n_tokens']}, increasing; got "
                f"{offsets.dtype} {offsets.shape}); {_REBUILD}"
            )
        shard = cls(path, meta, offsets)
        if verify:
            shard.verify()
        return shard

    def verify(self) -> None:
        """Hash tokens.bin against meta.json and check each document ends with EOS.

        Raises:
            DataError: naming tokens.bin.
        """
        digest = hashlib.sha256()
        tokens_file = self.path / TOKENS_FILE
        with open(tokens_file, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                digest.update(block)
        want = self.meta.get("tokens_sha256")
        if want is not None and digest.hexdigest() != want:
            raise DataError(
                f"{tokens_file} is corrupt: its sha256 differs from {META_FILE}; {_REBUILD}"
            )
        if self.n_docs and np.any(self.tokens[self.doc_offsets[1:] - 1] != self.eos_id):
            raise DataError(f"{tokens_file} is corrupt: a document does not end in EOS; {_REBUILD}")


@dataclass(frozen=True)
class SplitShards:
    """The train and validation shards of one source."""

    train: TokenShard
    val: TokenShard


def is_complete(directory: str | Path) -> bool:
    """Whether ``directory`` holds a finished shard pair (both meta.json files)."""
    directory = Path(directory)
    return all((directory / split / META_FILE).is_file() for split in SPLITS)


def open_split_shards(directory: str | Path) -> SplitShards:
    directory = Path(directory)
    return SplitShards(*(TokenShard.open(directory / split) for split in SPLITS))


def set_aside(directory: str | Path) -> Path:
    """Rename a damaged shard pair to ``<name>.corrupt-<time>`` beside it, so it can be
    rebuilt without deleting anything; returns the new path."""
    return move_aside(directory, "corrupt")
