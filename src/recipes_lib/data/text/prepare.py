"""Turn a ``DataConfig`` into a tokenizer and tokenized shards, once, in the cache.

``prepare`` is what ``recipes-prepare`` and ``PretrainDataModule.prepare_data`` run.
Everything it writes is named by a fingerprint of what went into it, under
``data.cache_dir``:

    tokenizers/<fingerprint>/tokenizer.json   a trained tokenizer (unless data.tokenizer.path)
    shards/<fingerprint>/{train,val}/          one source's tokenized documents
    hf_datasets/                               ``datasets``' Arrow copies of local files

so a second run with the same sources, tokenizer and split reuses them without reading
any raw text. Only global rank 0 writes; other ranks wait for its files to appear.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from tokenizers import Tokenizer

from recipes_lib.config.schema import DataConfig, SourceConfig
from recipes_lib.data.mixture import check_weights
from recipes_lib.data.sources import (
    check_val_fraction,
    configured_sources,
    held_out_mask,
    resolve_cache_dir,
    source_fingerprint,
)
from recipes_lib.data.text.raw import RawSource, iter_texts, load_source
from recipes_lib.data.text.shard_writer import write_split_shards
from recipes_lib.data.text.shards import (
    SHARD_FORMAT_VERSION,
    SplitShards,
    is_complete,
    open_split_shards,
    set_aside,
    shard_fingerprint,
)
from recipes_lib.data.tokenizer import (
    TOKENIZER_FILE,
    check_vocab_fits,
    eos_token_id,
    load_tokenizer,
    resolve_tokenizer_file,
    save_tokenizer,
    tokenizer_sha256,
    train_bpe_tokenizer,
)
from recipes_lib.errors import ConfigError, DataError
from recipes_lib.files import global_rank

log = logging.getLogger(__name__)

DEFAULT_SOURCES = {"stdlib": SourceConfig(builtin="stdlib")}


@dataclass(frozen=True)
class PreparedData:
    """Where ``prepare`` left a config's tokenizer and shards.

    Attributes:
        tokenizer_path: the tokenizer.json to load.
        train_shards: source name -> its training shard directory.
        val_shards: source name -> its validation shard directory.
        fingerprints: source name -> the fingerprint naming its shards.
        weights: source name -> mixture weight.
        tokenizer_sha256: content hash of the tokenizer.
        eos_id: the end-of-document token id.
    """

    tokenizer_path: Path
    train_shards: dict[str, Path]
    val_shards: dict[str, Path]
    fingerprints: dict[str, str]
    weights: dict[str, float] = field(default_factory=dict)
    tokenizer_sha256: str = ""
    eos_id: int = 0

    @property
    def fingerprint(self) -> str:
        """One fingerprint of the whole data setup (for stage hand-off manifests)."""
        blob = json.dumps([self.fingerprints, self.weights], sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()


def resolve_sources(config: DataConfig) -> dict[str, SourceConfig]:
    """The configured sources (``data.path`` or ``data.sources``), or the built-in
    standard-library corpus when there are none."""
    return configured_sources(config, DEFAULT_SOURCES)


def prepare(
    config: DataConfig,
    *,
    model_vocab_size: int | None = None,
    progress: bool = True,
    quiet: bool = False,
    rank: int | None = None,
    wait_timeout_s: float = 3600.0,
) -> PreparedData:
    """Train or load the tokenizer and tokenize every source into cached shards.

    Args:
        config: the data configuration.
        model_vocab_size: when given, fail early if the tokenizer does not fit it.
        progress: show progress bars while tokenizing.
        quiet: do not print the summary table.
        rank: this process's global rank (``None``: detected from torch.distributed or
            the launcher's environment). Only rank 0 writes; the others wait up to
            ``wait_timeout_s`` for rank 0's files.

    Raises:
        ConfigError: bad weights, split fraction, seed, or a tokenizer too large for
            ``model_vocab_size``.
        DataError: missing or malformed input, corrupt cached shards, or a timeout
            waiting for rank 0.
    """
    rank = global_rank() if rank is None else rank
    cache_dir = resolve_cache_dir(config.cache_dir)
    sources = resolve_sources(config)
    weights = check_weights({name: source.weight for name, source in sources.items()})
    seed = _check_seed(config.seed)
    check_val_fraction(config.val_fraction)
    source_fps = {name: source_fingerprint(name, source) for name, source in sources.items()}
    raw_cache: dict[str, RawSource] = {}

    def raw(name: str) -> RawSource:
        if name not in raw_cache:
            raw_cache[name] = load_source(name, sources[name], cache_dir / "hf_datasets")
        return raw_cache[name]

    tokenizer, tokenizer_path = _tokenizer(
        config, cache_dir, source_fps, weights, seed, raw, rank, wait_timeout_s
    )
    if model_vocab_size is not None:
        check_vocab_fits(tokenizer, model_vocab_size)
    eos_id = eos_token_id(tokenizer, config.tokenizer.eos_token)
    tokenizer_hash = tokenizer_sha256(tokenizer)

    shards: dict[str, SplitShards] = {}
    fingerprints: dict[str, str] = {}
    reused: dict[str, bool] = {}
    for name in sources:
        fp = shard_fingerprint(source_fps[name], tokenizer_hash, config.val_fraction, seed)
        directory = cache_dir / "shards" / fp[:16]
        fingerprints[name] = fp
        reused[name] = is_complete(directory)
        if not reused[name] and rank != 0:
            _wait_for(directory, lambda d=directory: is_complete(d), wait_timeout_s)
        if is_complete(directory):
            opened = _open_or_set_aside(directory, name, rank, wait_timeout_s)
            if opened is not None:
                shards[name] = opened
                continue
            reused[name] = False
        documents = raw(name)
        shards[name] = write_split_shards(
            iter_texts(documents),
            directory,
            tokenizer,
            eos_id,
            num_documents=documents.num_documents,
            val_fraction=config.val_fraction,
            seed=seed,
            meta={
                "source": name,
                "description": documents.description,
                "fingerprint": fp,
                "source_fingerprint": source_fps[name],
                "tokenizer_sha256": tokenizer_hash,
                "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
            },
            num_threads=config.num_proc,
            progress=progress and rank == 0,
        )
    if not quiet and rank == 0:
        _print_summary(shards, reused, tokenizer_path, cache_dir)
    return PreparedData(
        tokenizer_path=tokenizer_path,
        train_shards={name: pair.train.path for name, pair in shards.items()},
        val_shards={name: pair.val.path for name, pair in shards.items()},
        fingerprints=fingerprints,
        weights=weights,
        tokenizer_sha256=tokenizer_hash,
        eos_id=eos_id,
    )


def _open_or_set_aside(
    directory: Path, name: str, rank: int, wait_timeout_s: float
) -> SplitShards | None:
    """The cached shards of source ``name``, or None once rank 0 moved damaged ones aside
    (to ``<dir>.corrupt-<time>``, never deleted) to be rebuilt; other ranks wait for that."""
    try:
        return open_split_shards(directory)
    except DataError as err:
        if rank != 0:
            _wait_for(directory, lambda: _opens(directory), wait_timeout_s)
            return open_split_shards(directory)
        aside = set_aside(directory)
        log.warning(
            "source %s: moved damaged shards aside to %s to rebuild them (%s)", name, aside, err
        )
        return None


def _opens(directory: Path) -> bool:
    try:
        open_split_shards(directory)
    except DataError:
        return False
    return True


def _check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"data.seed must be an integer, got {seed!r}")
    return seed


def _tokenizer(
    config: DataConfig,
    cache_dir: Path,
    source_fps: Mapping[str, str],
    weights: Mapping[str, float],
    seed: int,
    raw: Callable[[str], RawSource],
    rank: int,
    wait_timeout_s: float,
) -> tuple[Tokenizer, Path]:
    """Load ``data.tokenizer.path``, or the cached tokenizer trained on these sources."""
    settings = config.tokenizer
    if settings.path is not None:
        return load_tokenizer(settings.path), resolve_tokenizer_file(settings.path).resolve()
    identity = {
        "format_version": SHARD_FORMAT_VERSION,
        "tokenizer": asdict(settings),
        "sources": {name: [source_fps[name], weights[name]] for name in sorted(source_fps)},
        "val_fraction": config.val_fraction,
        "seed": seed,
    }
    fp = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    path = cache_dir / "tokenizers" / fp[:16] / TOKENIZER_FILE
    if not path.is_file() and rank != 0:
        _wait_for(path, path.is_file, wait_timeout_s)
    if not path.is_file():
        texts = _training_texts(
            [raw(name) for name in source_fps],
            [weights[name] for name in source_fps],
            settings.train_max_bytes,
            config.val_fraction,
            seed,
        )
        tokenizer = train_bpe_tokenizer(
            texts, settings.vocab_size, settings.eos_token, settings.train_max_bytes
        )
        save_tokenizer(tokenizer, path)
    return load_tokenizer(path, key=f"tokenizer cache {path.parent}"), path


def _training_texts(
    raws: list[RawSource], weights: list[float], max_bytes: int, val_fraction: float, seed: int
) -> Iterator[str]:
    """Documents to train the tokenizer on: each source's share of ``max_bytes``.

    A map-style source contributes documents in a seeded random order, skipping the ones
    its shards will hold out for validation; a stream contributes from its start.
    """
    total = sum(weights)
    for documents, weight in zip(raws, weights, strict=True):
        budget = max_bytes * weight / total
        indices = None
        if documents.num_documents is not None:
            n = documents.num_documents
            keep = np.flatnonzero(~held_out_mask(n, val_fraction, seed))
            indices = np.random.default_rng(seed).permutation(keep).tolist()
        taken = 0
        for text in iter_texts(documents, indices):
            if taken >= budget:
                break
            taken += len(text.encode("utf-8"))
            yield text


def _wait_for(path: Path, ready, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise DataError(
                f"timed out after {timeout_s:.0f}s waiting for rank 0 to write {path}; "
                "data.cache_dir must be on a filesystem that every rank shares"
            )
        time.sleep(0.5)


def _print_summary(
    shards: Mapping[str, SplitShards], reused: Mapping[str, bool], tokenizer: Path, cache: Path
) -> None:
    table = Table(title="data", caption=f"tokenizer {tokenizer}\nshards under {cache / 'shards'}")
    for column in ("source", "train docs", "train tokens", "val docs", "val tokens", "shards"):
        table.add_column(column, justify="left" if column in ("source", "shards") else "right")
    for name, pair in shards.items():
        table.add_row(
            name,
            f"{pair.train.n_docs:,}",
            f"{pair.train.n_tokens:,}",
            f"{pair.val.n_docs:,}",
            f"{pair.val.n_tokens:,}",
            "cached" if reused[name] else "written",
        )
    Console().print(table)
