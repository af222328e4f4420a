"""Records of SFT and preference sources: loading, naming one in a message, splitting.

A record source is a local ``.jsonl``/``.json``/``.parquet`` file or folder, a
``datasets`` hub name, or a built-in generator of records (``stdlib_sft``,
``stdlib_dpo``). :func:`load_records` reads one with ``datasets`` into
:class:`Records`, a list that can also say where each record came from, so a bad one is
reported as a person finds it: ``data.path: /data/chat.jsonl:17`` for JSON lines,
``... row 17`` for other files, ``record 17`` for the rest. A file that is not valid
JSON is reported at its first bad line, and an empty file by name, each in one line.
``datasets`` is imported when a file or hub source is read, not with this module (see
:mod:`recipes_lib.data.text.raw`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from recipes_lib.config.schema import DataConfig, SourceConfig
from recipes_lib.data.sources import (
    check_val_fraction,
    held_out_mask,
    local_files,
    offline_read,
    resolve_cache_dir,
    source_key,
    source_kind,
)
from recipes_lib.errors import ConfigError, DataError

if TYPE_CHECKING:
    import datasets

# name -> (max_records, seed) -> records
RecordBuiltin = Callable[[int | None, int], list[dict[str, Any]]]
RECORD_FORMATS = ("json", "parquet")
JSON_LINES_SUFFIXES = (".jsonl",)

# Where a record came from: a source's key (messages say "<key>: record <index>") or a
# function naming record <index> itself (Records.where: "<key>: <file>:<line>").
RecordSource = str | Callable[[int], str]


def record_where(source: RecordSource, index: int) -> str:
    """How messages name record ``index`` of ``source``."""
    return source(index) if callable(source) else f"{source}: record {index}"


def record_text_bytes(record: Any) -> int:
    """The UTF-8 bytes of the text in ``record`` (its strings at any depth, keys too): what
    rendering and tokenizing it costs in proportion to."""
    if isinstance(record, str):
        return len(record) if record.isascii() else len(record.encode("utf-8", "replace"))
    if isinstance(record, Mapping):
        return sum(record_text_bytes(k) + record_text_bytes(v) for k, v in record.items())
    if isinstance(record, list | tuple):
        return sum(record_text_bytes(item) for item in record)
    return 0


def _is_json_lines(file: Path) -> bool:
    """Whether a .json/.jsonl file holds one record per line (not one JSON array)."""
    if file.suffix.lower() in JSON_LINES_SUFFIXES:
        return True
    with open(file, "rb") as f:
        for line in f:
            if line.strip():
                return not line.lstrip().startswith(b"[")
    return True


def _record_lines(file: Path) -> np.ndarray:
    """The 1-based line number of each record of a JSON-lines file (blank lines hold
    none, as ``datasets`` reads them)."""
    with open(file, "rb") as f:
        return np.asarray([n for n, line in enumerate(f, start=1) if line.strip()], np.int64)


class Records(list):
    """The records of one source (a list of dicts), and where each one came from.

    Args:
        records: the records, in order.
        key: the source's config key (``data.path``, ``data.sources.<name>``).
        files: for a local source, its files in the order ``datasets`` read them, each
            with its number of records.
    """

    def __init__(
        self, records: Iterable[Any], key: str, files: list[tuple[Path, int]] | None = None
    ):
        super().__init__(records)
        self.key = key
        self.files = files or []
        self._lines: dict[Path, np.ndarray] = {}  # built on the first message that needs it

    def where(self, index: int) -> str:
        """Record ``index`` as a message names it: ``<key>: <file>:<line>`` for a JSON-lines
        file, ``<key>: <file> row <n>`` for another file, else ``<key>: record <index>``."""
        offset = index
        for file, count in self.files:
            if offset < count:
                if file.suffix.lower() == ".parquet":
                    return f"{self.key}: {file} row {offset + 1}"
                if file not in self._lines:
                    self._lines[file] = _record_lines(file)
                return f"{self.key}: {file}:{int(self._lines[file][offset])}"
            offset -= count
        return f"{self.key}: record {index}"


def _first_bad_json_line(files: list[Path]) -> str | None:
    """``<file>:<line>: not valid JSON (...)`` for the first unparsable line of the
    JSON-lines files among ``files``, or None."""
    for file in files:
        if file.suffix.lower() == ".parquet" or not _is_json_lines(file):
            continue
        with open(file, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as err:
                    return f"{file}:{number}: not valid JSON ({err.msg} at column {err.pos + 1})"
    return None


@contextmanager
def _quiet_datasets_errors():
    """``datasets`` logs a file it cannot parse before raising; the caller reports it
    once, naming the line, so that log line is held back."""
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _file_counts(files: list[Path], dataset: datasets.Dataset) -> list[tuple[Path, int]] | None:
    """Records per file, in reading order, when ``datasets`` kept them in file order."""
    import pyarrow.parquet as pq

    counts = []
    for file in files:
        if file.suffix.lower() == ".parquet":
            counts.append((file, pq.ParquetFile(file).metadata.num_rows))
        elif _is_json_lines(file):
            counts.append((file, len(_record_lines(file))))
        else:
            return None  # a JSON array: its records are named by index
    return counts if sum(n for _, n in counts) == len(dataset) else None


def load_records(
    name: str,
    source: SourceConfig,
    builtins: Mapping[str, RecordBuiltin],
    *,
    cache_dir: Path | None = None,
    seed: int = 0,
) -> Records:
    """Every record of ``data.sources.<name>`` (at most ``max_documents`` of them).

    Raises:
        ConfigError: the source names none or several origins, or a bad max_documents.
        DataError: an unknown built-in, a missing path, a file of plain text, an empty
            file, a line that is not JSON (naming the file and line), an unreadable
            dataset, or no records.
    """
    key = source_key(name)
    kind = source_kind(name, source)
    limit = source.max_documents
    if limit is not None and limit < 1:
        raise ConfigError(f"{key}.max_documents must be >= 1, got {limit}")
    if kind == "builtin":
        builtin = source.builtin
        if builtin is None or builtin not in builtins:
            raise DataError(
                f"{key}.builtin={builtin!r} is not a built-in record source here; "
                f"choose one of {sorted(builtins)}"
            )
        records = Records(builtins[builtin](limit, seed), key)
        if not records:
            raise DataError(f"{key}: no records in builtin {source.builtin}")
        return records
    files: list[Path] = []
    if kind == "path":
        builder, files = local_files(name, source.path)  # type: ignore[arg-type]
        if builder not in RECORD_FORMATS:
            raise DataError(
                f"{key}: {source.path} holds {builder} files; chat and preference "
                "records must be .jsonl, .json or .parquet"
            )
        empty = [f for f in files if f.stat().st_size == 0]
        if len(empty) == len(files):
            raise DataError(f"{key}: {empty[0] if len(empty) == 1 else source.path} is empty")
        files = [f for f in files if f not in empty]
        args: dict[str, Any] = {"path": builder, "data_files": [str(f) for f in files]}
        args["split"] = "train"
        if cache_dir is not None:
            args["cache_dir"] = str(cache_dir)
        description = f"{builder}: {source.path}"
    else:
        args = {"path": source.hub, "name": source.subset, "split": source.split}
        description = f"hub: {source.hub} split={source.split}"
    import datasets

    try:
        with _quiet_datasets_errors(), offline_read() if files else nullcontext():
            dataset = datasets.load_dataset(**args, streaming=source.streaming)
    except Exception as err:  # datasets raises many types
        bad_line = _first_bad_json_line(files)
        if bad_line is not None:
            raise DataError(f"{key}: {bad_line}") from err
        reason = f"{type(err).__name__}: {err}".strip().rstrip(":")
        raise DataError(f"{key}: could not load {description}: {reason}") from err
    counts = None if source.streaming else _file_counts(files, dataset)
    if limit is not None:
        dataset = (
            dataset.take(limit)
            if source.streaming
            else dataset.select(range(min(limit, len(dataset))))
        )
    records = Records(dataset, key, counts)
    if not records:
        raise DataError(f"{key}: no records in {description}")
    return records


def load_source_records(
    config: DataConfig, name: str, source: SourceConfig, builtins: Mapping[str, RecordBuiltin]
) -> Records:
    """:func:`load_records` of ``data.sources.<name>`` with the run's cache and seed
    (``datasets`` files are cached under ``<data.cache_dir>/hf_datasets``)."""
    cache = resolve_cache_dir(config.cache_dir) / "hf_datasets"
    return load_records(name, source, builtins, cache_dir=cache, seed=config.seed)


def split_records(
    records: list[dict[str, Any]], val_fraction: float, seed: int
) -> tuple[list[int], list[int]]:
    """Indices of the training and the held-out records (a seeded ``val_fraction``)."""
    check_val_fraction(val_fraction)
    held = held_out_mask(len(records), val_fraction, seed).tolist()
    train = [i for i, is_held in enumerate(held) if not is_held]
    return train, [i for i, is_held in enumerate(held) if is_held]
