"""Records of SFT and preference sources, and the tokenizer a chat run uses.

A record source is a local ``.jsonl``/``.json``/``.parquet`` file or directory, a
``datasets`` hub name, or a built-in generator of records (``stdlib_sft`` here; the
preference data adds its own). Each source's records are split into training and
held-out records by a seeded ``data.val_fraction``. The SFT and the preference data
modules share what is here: loading and splitting records, the texts a tokenizer is
trained on, the identity of their sources and examples, finding the tokenizer (beside
the weights a stage starts from) and saving it with its chat template beside a run's
output weights.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import datasets
from tokenizers import Tokenizer

from recipes_lib.config.schema import DataConfig, SourceConfig
from recipes_lib.data.chat import CHATML_TOKENS
from recipes_lib.data.instructions import stdlib_instruction_records
from recipes_lib.data.prepare import resolve_cache_dir
from recipes_lib.data.raw import local_files, source_fingerprint, source_kind
from recipes_lib.data.shards import held_out_mask
from recipes_lib.data.tokenizer import (
    TOKENIZER_FILE,
    load_tokenizer,
    resolve_tokenizer_file,
    save_tokenizer,
    save_tokenizer_folder,
    tokenizer_sha256,
    train_bpe_tokenizer,
)
from recipes_lib.errors import ConfigError, DataError

# name -> (max_records, seed) -> records
RecordBuiltin = Callable[[int | None, int], list[dict[str, Any]]]
SFT_BUILTINS: dict[str, RecordBuiltin] = {"stdlib_sft": stdlib_instruction_records}
RECORD_FORMATS = ("json", "parquet")


def load_records(
    name: str,
    source: SourceConfig,
    builtins: Mapping[str, RecordBuiltin],
    *,
    cache_dir: Path | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Every record of ``data.sources.<name>`` (at most ``max_documents`` of them).

    Raises:
        ConfigError: the source names none or several origins, or a bad max_documents.
        DataError: an unknown built-in, a missing path, a file of plain text, an
            unreadable dataset, or no records.
    """
    key = f"data.sources.{name}"
    kind = source_kind(name, source)
    limit = source.max_documents
    if limit is not None and limit < 1:
        raise ConfigError(f"{key}.max_documents must be >= 1, got {limit}")
    if kind == "builtin":
        if source.builtin not in builtins:
            raise DataError(
                f"{key}.builtin={source.builtin!r} is not a built-in record source here; "
                f"choose one of {sorted(builtins)}"
            )
        records = builtins[source.builtin](limit, seed)
        description = f"builtin {source.builtin}"
    else:
        if kind == "path":
            builder, files = local_files(name, source.path)  # type: ignore[arg-type]
            if builder not in RECORD_FORMATS:
                raise DataError(
                    f"{key}.path: {source.path} holds {builder} files; chat and preference "
                    "records must be .jsonl, .json or .parquet"
                )
            args: dict[str, Any] = {"path": builder, "data_files": [str(f) for f in files]}
            args["split"] = "train"
            if cache_dir is not None:
                args["cache_dir"] = str(cache_dir)
            description = f"{builder}: {source.path}"
        else:
            args = {"path": source.hub, "name": source.subset, "split": source.split}
            description = f"hub: {source.hub} split={source.split}"
        try:
            dataset = datasets.load_dataset(**args, streaming=source.streaming)
        except Exception as err:  # datasets raises many types
            raise DataError(
                f"{key}: could not load {description}: {type(err).__name__}: {err}"
            ) from err
        if limit is not None:
            dataset = (
                dataset.take(limit)
                if source.streaming
                else dataset.select(range(min(limit, len(dataset))))
            )
        records = list(dataset)
    if not records:
        raise DataError(f"{key}: no records in {description}")
    return records


def load_source_records(
    config: DataConfig, name: str, source: SourceConfig, builtins: Mapping[str, RecordBuiltin]
) -> list[dict[str, Any]]:
    """:func:`load_records` of ``data.sources.<name>`` with the run's cache and seed
    (``datasets`` files are cached under ``<data.cache_dir>/hf_datasets``)."""
    cache = resolve_cache_dir(config.cache_dir) / "hf_datasets"
    return load_records(name, source, builtins, cache_dir=cache, seed=config.seed)


def split_records(
    records: list[dict[str, Any]], val_fraction: float, seed: int
) -> tuple[list[int], list[int]]:
    """Indices of the training and the held-out records (a seeded ``val_fraction``)."""
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
    held = held_out_mask(len(records), val_fraction, seed).tolist()
    train = [i for i, is_held in enumerate(held) if not is_held]
    return train, [i for i, is_held in enumerate(held) if is_held]


def records_fingerprint(name: str, source: SourceConfig) -> str:
    """A cheap identity of a record source (names cached tokenizers)."""
    if source_kind(name, source) != "builtin":
        return source_fingerprint(name, source)
    identity = {k: v for k, v in asdict(source).items() if k != "weight"}
    identity["python"] = sys.version
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def sources_fingerprint(sources: Mapping[str, SourceConfig]) -> str:
    """The identity of a mixture of record sources (see :func:`records_fingerprint`)."""
    fingerprints = {name: records_fingerprint(name, s) for name, s in sorted(sources.items())}
    return hashlib.sha256(json.dumps(fingerprints).encode()).hexdigest()


def chat_data_fingerprint(
    config: DataConfig, sources: str, tokenizer: Tokenizer, template: str
) -> str:
    """The identity of a chat run's examples: its sources (:func:`sources_fingerprint`),
    tokenizer, chat settings and template, sequence length, split and seed."""
    identity = {
        "sources": sources,
        "tokenizer": tokenizer_sha256(tokenizer),
        "chat": asdict(config.chat),
        "template": template,
        "seq_len": config.seq_len,
        "val_fraction": config.val_fraction,
        "seed": config.seed,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def record_texts(records: Iterable[Any], fields: Sequence[str] | None = None) -> Iterator[str]:
    """Every piece of text in the records' ``fields`` (default: all of them), plain or
    as the ``content`` of chat messages: what a tokenizer for them is trained on.
    Records that are not mappings are passed over (loading reports them)."""
    for record in records:
        if not isinstance(record, Mapping):
            continue
        values = record.values() if fields is None else (record.get(f) for f in fields)
        for value in values:
            if isinstance(value, str):
                yield value
            elif isinstance(value, list):
                yield from (
                    m["content"]
                    for m in value
                    if isinstance(m, Mapping) and isinstance(m.get("content"), str)
                )


def init_tokenizer_path(config: DataConfig, init_from: str | None) -> str | None:
    """The tokenizer of a chat run: ``data.tokenizer.path`` when set; else, for a stage
    that starts from weights (``stage.init_from``), the ``tokenizer.json`` beside them;
    else None (a tokenizer is trained on the records).

    Raises:
        ConfigError: ``stage.init_from`` is set but has no tokenizer beside it.
    """
    if config.tokenizer.path is not None or init_from is None:
        return config.tokenizer.path
    found = tokenizer_beside(init_from)
    if found is None:
        raise ConfigError(
            f"stage.init_from={init_from!r} has no tokenizer.json beside it; set "
            "data.tokenizer.path to the tokenizer its weights were trained with"
        )
    return str(found)


def load_chat_tokenizer(
    config: DataConfig,
    training_texts: Callable[[], Iterable[str]],
    fingerprint: str,
) -> tuple[Tokenizer, str | None, Path]:
    """The tokenizer of a chat run, its own chat template, and its file.

    ``data.tokenizer.path`` (a tokenizer.json or a Hugging Face folder, whose template
    comes along; a pipeline stage gets the previous stage's here), or else a byte-level
    BPE trained on ``training_texts`` and cached under ``data.cache_dir``, with the
    ChatML tokens (``<|im_start|>``, ``<|im_end|>``) added as special tokens within
    ``data.tokenizer.vocab_size``.

    Raises:
        DataError: a missing or invalid tokenizer file.
    """
    settings = config.tokenizer
    if settings.path is not None:
        file = resolve_tokenizer_file(settings.path).resolve()
        return load_tokenizer(file), tokenizer_chat_template(file.parent), file
    identity = json.dumps(
        {"tokenizer": asdict(settings), "sources": fingerprint, "chat_tokens": CHATML_TOKENS},
        sort_keys=True,
    )
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    path = resolve_cache_dir(config.cache_dir) / "tokenizers" / f"chat-{digest}" / TOKENIZER_FILE
    if not path.is_file():
        tokenizer = train_bpe_tokenizer(
            _limited(training_texts(), settings.train_max_bytes),
            settings.vocab_size - len(CHATML_TOKENS),
            settings.eos_token,
        )
        tokenizer.add_special_tokens(list(CHATML_TOKENS))
        save_tokenizer(tokenizer, path)
    return load_tokenizer(path, key=f"tokenizer cache {path.parent}"), None, path


def save_chat_tokenizer(
    folder: str | Path,
    tokenizer_path: str | Path,
    tokenizer: Tokenizer,
    config: DataConfig,
    *,
    chat_template: str | None,
    model_max_length: int | None = None,
) -> Path:
    """Write a chat run's tokenizer and the chat template it rendered with into
    ``folder`` as transformers reads them (see
    :func:`recipes_lib.data.tokenizer.save_tokenizer_folder`), so that
    ``apply_chat_template`` there gives the token ids training used. The EOS token is
    ``data.tokenizer.eos_token``, left out when the tokenizer has no such token.
    """
    eos_token: str | None = config.tokenizer.eos_token
    if tokenizer.token_to_id(eos_token) is None:
        eos_token = None
    return save_tokenizer_folder(
        folder,
        tokenizer_path,
        eos_token=eos_token,
        chat_template=chat_template,
        model_max_length=model_max_length,
    )


class SavesChatTokenizer:
    """Mixin of the chat data modules (SFT, preference pairs): :meth:`save_tokenizer`.

    Uses the module's ``prepared`` (``tokenizer_path``, ``chat_template``, set in
    ``setup``), ``tokenizer``, ``config`` and ``model_max_seq_len``.
    """

    def save_tokenizer(self, folder: str | Path) -> Path:
        """Write the tokenizer and the chat template this run renders with into
        ``folder`` (``tokenizer.json`` and transformers' ``tokenizer_config.json``), so
        the run's output weights carry what their conversations looked like.

        Raises:
            RuntimeError: called before ``setup``.
        """
        prepared, tokenizer = getattr(self, "prepared", None), getattr(self, "tokenizer", None)
        if prepared is None or tokenizer is None:
            raise RuntimeError("call setup() before save_tokenizer()")
        return save_chat_tokenizer(
            folder,
            prepared.tokenizer_path,
            tokenizer,
            self.config,  # type: ignore[attr-defined]
            chat_template=prepared.chat_template,
            model_max_length=self.model_max_seq_len,  # type: ignore[attr-defined]
        )


def tokenizer_beside(weights: str | None) -> Path | None:
    """The ``tokenizer.json`` in the folder of ``weights`` (a file or a folder), if any:
    where a pipeline stage leaves the tokenizer its output weights use."""
    if weights is None:
        return None
    path = Path(weights).expanduser()
    candidate = (path if path.is_dir() else path.parent) / TOKENIZER_FILE
    return candidate if candidate.is_file() else None


def tokenizer_chat_template(folder: Path) -> str | None:
    """The chat template stored beside a tokenizer, as ``transformers`` saves it:
    ``chat_template`` of ``tokenizer_config.json``, else ``chat_template.jinja``.

    Raises:
        DataError: tokenizer_config.json is not readable JSON.
    """
    config_file = folder / "tokenizer_config.json"
    if config_file.is_file():
        try:
            template = json.loads(config_file.read_text()).get("chat_template")
        except (OSError, ValueError, AttributeError) as err:
            raise DataError(
                f"data.tokenizer.path: {config_file} is not readable JSON: {err}"
            ) from err
        if isinstance(template, list):  # named templates: "default" wins
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if isinstance(template, str):
            return template
    jinja_file = folder / "chat_template.jinja"
    return jinja_file.read_text() if jinja_file.is_file() else None


def _limited(texts: Iterable[str], max_bytes: int) -> Iterator[str]:
    taken = 0
    for text in texts:
        if taken >= max_bytes:
            return
        taken += len(text.encode("utf-8"))
        yield text
