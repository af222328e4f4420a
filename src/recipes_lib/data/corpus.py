"""The built-in corpus: the Python standard library's own source files.

Every machine that runs recipes-lib has a Python installation, so its standard library
is a text corpus that needs no download: about 800 modules and 12 MB of English
comments, docstrings and code. It is what a pretraining run reads when
``data.sources`` is empty, and what a source with ``builtin: stdlib`` names; the
built-in SFT instructions and preference pairs are made from the same files.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from recipes_lib.errors import DataError

BUILTIN_CORPORA = ("stdlib",)

# Directories of the standard library that hold its own test suites.
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
# Directories that are not the standard library even though they live under it.
_FOREIGN_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


@dataclass(frozen=True)
class CorpusDocument:
    """One document of the built-in corpus: a source file and its text."""

    path: str  # relative to the standard library root, "/"-separated
    text: str


def stdlib_root() -> Path:
    """The directory of this interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(include_tests: bool = False) -> list[Path]:
    """The standard library's ``.py`` files in sorted order (site-packages excluded)."""
    root = stdlib_root()
    skip = _FOREIGN_DIRS | (frozenset() if include_tests else _TEST_DIRS)
    files: list[Path] = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in skip]  # prune: never walk site-packages
        files.extend(Path(directory, n) for n in names if n.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def iter_stdlib_documents(
    max_bytes: int | None = None, include_tests: bool = False
) -> Iterator[CorpusDocument]:
    """Yield the standard library's source files, one document per file.

    Args:
        max_bytes: stop before the document that would take the UTF-8 total past this
            many bytes (``None``: every file).
        include_tests: also yield the standard library's own test suites.

    Files that are not valid UTF-8 are skipped.
    """
    root = stdlib_root()
    total = 0
    for path in stdlib_files(include_tests):
        try:
            raw = path.read_bytes()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text:
            continue
        if max_bytes is not None and total + len(raw) > max_bytes:
            return
        total += len(raw)
        yield CorpusDocument(path.relative_to(root).as_posix(), text)


def builtin_documents(name: str, key: str, max_bytes: int | None = None) -> list[CorpusDocument]:
    """The documents of the built-in corpus ``name``.

    Raises:
        DataError: ``name`` is not a built-in corpus (``key`` names the config key).
    """
    check_builtin_name(name, key)
    return list(iter_stdlib_documents(max_bytes=max_bytes))


def check_builtin_name(name: str, key: str) -> None:
    if name not in BUILTIN_CORPORA:
        raise DataError(
            f"{key}={name!r} is not a built-in corpus; choose one of {list(BUILTIN_CORPORA)}"
        )


def builtin_fingerprint(name: str, key: str) -> str:
    """A cheap identity of the built-in corpus: interpreter version, file names and sizes.

    Hashing names and sizes instead of contents keeps a cache lookup instant while still
    changing whenever the interpreter (and so its standard library) changes.
    """
    check_builtin_name(name, key)
    digest = hashlib.sha256(f"{name}\n{sys.version}\n".encode())
    root = stdlib_root()
    for path in stdlib_files():
        digest.update(f"{path.relative_to(root).as_posix()}:{path.stat().st_size}\n".encode())
    return digest.hexdigest()
