"""The sources a run reads, shared by every pipeline: which they are, their files, their
identity, the seeded hold-out of their documents or records, and the cache they fill.

A source (``data.sources.<name>``, or ``data.path`` alone) names exactly one origin: a
local file or directory, a ``datasets`` hub name, or a built-in generator. Pretraining
text (:mod:`recipes_lib.data.text.raw`) and chat and preference records
(:mod:`recipes_lib.data.records`) read them their own way, but name, fingerprint and
split them the same way here, so cached shards and tokenizers keep their names.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from recipes_lib.config.schema import DataConfig, SourceConfig
from recipes_lib.data.corpus import builtin_fingerprint
from recipes_lib.errors import ConfigError, DataError

# File suffix -> ``datasets`` builder that reads it.
BUILDER_BY_SUFFIX = {
    ".txt": "text",
    ".text": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
}
_BUILDER_PRIORITY = ("json", "parquet", "text")  # tie-break when a directory mixes kinds

log = logging.getLogger(__name__)

# The name under which ``data.path`` joins the data as its only source.
PATH_SOURCE = "path"


def source_key(name: str) -> str:
    """How messages name a source's config key: ``data.sources.<name>``, or ``data.path``
    for the source that shorthand makes."""
    return "data.path" if name == PATH_SOURCE else f"data.sources.{name}"


def configured_sources(
    config: DataConfig, defaults: Mapping[str, SourceConfig]
) -> dict[str, SourceConfig]:
    """The sources a run reads: ``data.path`` alone when it is set (it replaces
    ``data.sources``, which a recipe may have filled; the run says so), else
    ``data.sources``, else the objective's built-in ``defaults``."""
    if config.path is not None:
        if config.sources:
            log.info(
                "data.path=%s replaces data.sources (%s)", config.path, ", ".join(config.sources)
            )
        return {PATH_SOURCE: SourceConfig(path=config.path)}
    return dict(config.sources) if config.sources else dict(defaults)


def source_kind(name: str, source: SourceConfig) -> str:
    """Which of ``path``, ``hub`` or ``builtin`` names the source.

    Raises:
        ConfigError: none or more than one of them is set.
    """
    given = [k for k in ("path", "hub", "builtin") if getattr(source, k) is not None]
    if len(given) != 1:
        raise ConfigError(
            f"{source_key(name)} must set exactly one of path, hub or builtin; got "
            f"{given or 'none'}"
        )
    return given[0]


def local_files(name: str, path: str) -> tuple[str, list[Path]]:
    """The ``datasets`` builder and the files a local ``path`` stands for.

    A file stands for itself. A directory stands for its files (searched recursively,
    sorted, hidden ones ignored) of the supported kind that most of them have.

    Raises:
        DataError: the path does not exist, or holds no file of a supported kind.
    """
    key = source_key(name) + ("" if name == PATH_SOURCE else ".path")
    root = Path(path).expanduser()
    if not root.exists():
        raise DataError(f"{key}: no such file or directory: {root}")
    if root.is_file():
        builder = BUILDER_BY_SUFFIX.get(root.suffix.lower())
        if builder is None:
            raise DataError(
                f"{key}: {root} has an unsupported suffix {root.suffix!r}; "
                f"supported: {sorted(BUILDER_BY_SUFFIX)}"
            )
        return builder, [root]
    by_builder: dict[str, list[Path]] = {}
    for file in root.rglob("*"):
        parts = file.relative_to(root).parts
        if any(part.startswith(".") for part in parts) or not file.is_file():
            continue
        builder = BUILDER_BY_SUFFIX.get(file.suffix.lower())
        if builder is not None:
            by_builder.setdefault(builder, []).append(file)
    if not by_builder:
        raise DataError(
            f"{key}: directory {root} holds no files with a supported suffix "
            f"{sorted(BUILDER_BY_SUFFIX)}"
        )
    counts = Counter({b: len(files) for b, files in by_builder.items()})
    builder = max(counts, key=lambda b: (counts[b], -_BUILDER_PRIORITY.index(b)))
    return builder, sorted(by_builder[builder])


@contextmanager
def offline_read() -> Iterator[None]:
    """``datasets.load_dataset`` of local files, without the Hub request it sends with
    each: for its packaged ``json``, ``parquet`` and ``text`` loaders it counts a download
    with an HTTP HEAD to the Hub (``HF_UPDATE_DOWNLOAD_COUNTS``), which waits up to 3 s
    where outbound traffic is dropped, and tells the Hub of a read that is nobody's
    download. A hub source keeps the default."""
    from datasets import config

    counts = config.HF_UPDATE_DOWNLOAD_COUNTS
    config.HF_UPDATE_DOWNLOAD_COUNTS = False
    try:
        yield
    finally:
        config.HF_UPDATE_DOWNLOAD_COUNTS = counts


def source_fingerprint(name: str, source: SourceConfig) -> str:
    """A cheap identity of a source's raw documents, used to name cached shards.

    It hashes the config (``weight`` aside: it only matters when sampling) plus, for a
    local path, each file's name, size and modification time, and for the built-in
    corpus the interpreter version and file list. A hub dataset is identified by its
    name, subset and split alone.

    Raises:
        ConfigError: the source does not name exactly one origin.
        DataError: a missing path or unknown built-in corpus.
    """
    kind = source_kind(name, source)
    identity: dict = {k: v for k, v in asdict(source).items() if k != "weight"}
    if kind == "path":
        builder, files = local_files(name, source.path)  # type: ignore[arg-type]
        identity["files"] = [
            [str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files
        ]
        identity["builder"] = builder
    elif kind == "builtin":
        identity["corpus"] = builtin_fingerprint(source.builtin, f"data.sources.{name}.builtin")  # type: ignore[arg-type]
    blob = json.dumps(identity, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()


def held_out_mask(num_documents: int, val_fraction: float, seed: int) -> np.ndarray:
    """Which documents go to validation: a seeded ``val_fraction`` of them.

    At least one document is held out when there are two or more and ``val_fraction``
    is positive; at least one is always left for training.
    """
    mask = np.zeros(num_documents, dtype=bool)
    if val_fraction <= 0 or num_documents < 2:
        return mask
    count = min(num_documents - 1, max(1, round(num_documents * val_fraction)))
    mask[np.random.default_rng(seed).permutation(num_documents)[:count]] = True
    return mask


def check_val_fraction(val_fraction: float) -> None:
    """Raise :class:`ConfigError` unless ``0 <= data.val_fraction < 1``."""
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"data.val_fraction must be in [0, 1), got {val_fraction}")


def resolve_cache_dir(value: str, key: str = "data.cache_dir") -> Path:
    """``data.cache_dir`` (or the cache folder ``key`` names) as a path: ``~`` expanded,
    ``${oc.env:...}`` resolved if still there.

    Raises:
        ConfigError: an interpolation that cannot be resolved outside a full run config.
    """
    if "${" in value:
        try:
            value = OmegaConf.create({"cache_dir": value}).cache_dir
        except Exception as err:
            raise ConfigError(f"{key}={value!r} cannot be resolved: {err}") from err
    return Path(value).expanduser()
