"""Raw documents of one source, loaded with ``datasets``.

A source is a local file or directory (``.txt``/``.text`` read one document per file,
``.jsonl``/``.json`` and ``.parquet`` one document per record), a ``datasets`` hub name,
or the built-in standard-library corpus. Whatever the origin, :func:`load_source`
returns a ``datasets`` dataset and :func:`iter_texts` the validated text of each
document, so everything downstream sees one shape of input.

``datasets`` (with pyarrow and pandas, over half a second) is imported when a source is
loaded, not with this module: every console script imports it through the objectives,
and a refused command line or a run on prepared shards never loads a source.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from recipes_lib.config.schema import SourceConfig
from recipes_lib.data.corpus import builtin_documents
from recipes_lib.data.sources import local_files, offline_read, source_key, source_kind
from recipes_lib.errors import ConfigError, DataError

if TYPE_CHECKING:
    import datasets

_TEXT_BATCH = 256


@dataclass
class RawSource:
    """The documents of one configured source.

    Attributes:
        name: the source's key under ``data.sources``.
        key: the config key naming it, e.g. ``data.sources.web``.
        documents: a dataset with the text in column ``text_field`` (an
            ``IterableDataset`` when the source streams).
        text_field: the column holding each document's text.
        description: a short human-readable origin, e.g. ``json: /data/web (3 files)``.
    """

    name: str
    key: str
    documents: datasets.Dataset | datasets.IterableDataset
    text_field: str
    description: str

    @property
    def num_documents(self) -> int | None:
        """The number of records, or ``None`` for a streaming source."""
        import datasets

        if isinstance(self.documents, datasets.Dataset):
            return len(self.documents)
        return None


def load_source(name: str, source: SourceConfig, cache_dir: Path | None = None) -> RawSource:
    """Load the documents of ``data.sources.<name>``.

    Args:
        name: the source's key under ``data.sources``.
        source: its configuration.
        cache_dir: where ``datasets`` keeps the Arrow copy of local files (``None``:
            the ``datasets`` default). Hub datasets always use the ``datasets`` cache.

    Raises:
        ConfigError: the source does not name exactly one origin.
        DataError: a missing path, an unreadable or empty dataset, or records without
            the text field.
    """
    import datasets

    key = source_key(name)
    kind = source_kind(name, source)
    if kind == "builtin":
        docs = builtin_documents(source.builtin, f"{key}.builtin")  # type: ignore[arg-type]
        documents = datasets.Dataset.from_dict(
            {source.text_field: [d.text for d in docs], "path": [d.path for d in docs]}
        )
        description = f"builtin: {source.builtin} ({len(docs)} files)"
    elif kind == "path":
        builder, files = local_files(name, source.path)  # type: ignore[arg-type]
        if all(f.stat().st_size == 0 for f in files):
            raise DataError(f"{key}: dataset is empty (every file under {source.path} is empty)")
        extra = {"sample_by": "document"} if builder == "text" else {}
        where = files[0] if len(files) == 1 else f"{source.path} ({len(files)} files)"
        description = f"{builder}: {where}"
        with offline_read():
            documents = _load(
                key,
                description,
                builder,
                data_files=[str(f) for f in files],
                split="train",
                streaming=source.streaming,
                cache_dir=str(cache_dir) if cache_dir is not None else None,
                **extra,
            )
    else:
        description = f"hub: {source.hub}" + (f"/{source.subset}" if source.subset else "")
        description += f" split={source.split}"
        documents = _load(
            key,
            description,
            source.hub,
            name=source.subset,
            split=source.split,
            streaming=source.streaming,
        )
    if source.max_documents is not None:
        if source.max_documents < 1:
            raise ConfigError(f"{key}.max_documents must be >= 1, got {source.max_documents}")
        if isinstance(documents, datasets.Dataset):
            documents = documents.select(range(min(source.max_documents, len(documents))))
        else:
            documents = documents.take(source.max_documents)
    raw = RawSource(name, key, documents, source.text_field, description)
    if isinstance(documents, datasets.Dataset):
        _check_text_column(raw)
    return raw


def _load(key: str, description: str, path: str | None, **kwargs):
    import datasets

    try:
        return datasets.load_dataset(path, **kwargs)
    except (DataError, ConfigError):
        raise
    except Exception as err:  # datasets raises many types, including bare StopIteration
        reason = f"{type(err).__name__}: {err}"
        raise DataError(f"{key}: could not load {description}: {reason}") from err


def _check_text_column(raw: RawSource) -> None:
    """Fail on an empty dataset, a missing text column, or a record whose text is missing."""
    import pyarrow as pa
    import pyarrow.compute as pc

    documents: datasets.Dataset = raw.documents
    field = raw.text_field
    if len(documents) == 0:
        raise DataError(f"{raw.key}: dataset is empty ({raw.description})")
    if field not in documents.column_names:
        raise DataError(
            f"{raw.key}: record 0 has no field {field!r} (fields: {documents.column_names}); "
            f"set {raw.key}.text_field"
        )
    column = documents.select_columns([field]).with_format("arrow")[:][field]
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise DataError(f"{raw.key}: field {field!r} holds {column.type}, not text (record 0)")
    if column.null_count:
        first = pc.index(pc.is_null(column), True).as_py()
        raise DataError(f"{raw.key}: record {first} has no field {field!r} ({raw.description})")


def iter_texts(raw: RawSource, indices: list[int] | None = None) -> Iterator[str]:
    """Yield the text of each document (of ``indices`` only, when given), in order.

    Raises:
        DataError: a streamed record lacks the text field or holds something else.
    """
    import datasets

    documents = raw.documents
    if indices is not None:
        if not isinstance(documents, datasets.Dataset):
            raise TypeError("indices need a map-style dataset")
        documents = documents.select(indices)
    field = raw.text_field
    if isinstance(documents, datasets.Dataset):
        column = documents.select_columns([field])
        for batch in column.iter(batch_size=_TEXT_BATCH):
            yield from batch[field]
        return
    for index, record in enumerate(documents):
        text = record.get(field)
        if not isinstance(text, str):
            what = "has no field" if text is None else f"holds {type(text).__name__} in field"
            raise DataError(f"{raw.key}: record {index} {what} {field!r} ({raw.description})")
        yield text
