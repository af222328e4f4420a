"""The shared base of the chat pipelines: SFT conversations and preference pairs.

Both read records by source (:mod:`recipes_lib.data.records`) and render them with a
chat template, so they share what is here: the ``data.chat`` policies, the identity of
their sources and examples, the tokenizer of a chat run (given, inherited from the
weights a stage starts from, or trained on the records with the ChatML tokens), saving
it with its chat template beside a run's output weights, and
:class:`ChatRecordsDataModule`, the data module both build their examples on.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from recipes_lib.config.schema import ChatFormatConfig, DataConfig, SourceConfig
from recipes_lib.data.module import ResumableDataModule, rank_zero_warning
from recipes_lib.data.records import (
    RecordBuiltin,
    Records,
    RecordSource,
    load_source_records,
    record_text_bytes,
    record_where,
    split_records,
)
from recipes_lib.data.sources import (
    configured_sources,
    resolve_cache_dir,
    source_fingerprint,
    source_key,
    source_kind,
)
from recipes_lib.data.tokenizer import (
    CHATML_TOKENS,
    TOKENIZER_FILE,
    load_tokenizer,
    resolve_tokenizer_file,
    save_tokenizer,
    save_tokenizer_folder,
    tokenizer_sha256,
    train_bpe_tokenizer,
)
from recipes_lib.errors import ConfigError, DataError

TRUNCATION_POLICIES = ("right", "left", "drop", "turn")
BAD_RECORD_POLICIES = ("error", "skip")


def check_chat_format(chat: ChatFormatConfig) -> None:
    """Raise :class:`ConfigError` on an unknown truncation or bad-record policy (the
    chat pipeline checks its record format and train-on policy itself)."""
    if chat.truncation not in TRUNCATION_POLICIES:
        raise ConfigError(
            f"data.chat.truncation={chat.truncation!r} is not one of {list(TRUNCATION_POLICIES)}"
        )
    if chat.on_bad_record not in BAD_RECORD_POLICIES:
        raise ConfigError(
            f"data.chat.on_bad_record={chat.on_bad_record!r} is not one of "
            f"{list(BAD_RECORD_POLICIES)}"
        )
    if chat.max_record_bytes is not None and chat.max_record_bytes < 1:
        raise ConfigError(
            f"data.chat.max_record_bytes={chat.max_record_bytes} must be positive (or null)"
        )


def bad_record_error(problem: Exception | str) -> DataError:
    """The error that stops a run at a malformed record, saying how to skip such records."""
    return DataError(f"{problem} (set data.chat.on_bad_record=skip to skip it)")


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
    tokenizer and its end token (templates write ``eos_token`` after turns), chat
    settings and template, sequence length, split and seed."""
    identity = {
        "sources": sources,
        "tokenizer": tokenizer_sha256(tokenizer),
        "eos_token": config.tokenizer.eos_token,
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
                yield from _turn_texts(value)


def _turn_texts(turns: list) -> Iterator[str]:
    """The text of chat turns: content, reasoning, and tool calls or tool schemas as the
    JSON a template writes them in."""
    for turn in turns:
        if not isinstance(turn, Mapping):
            continue
        if "role" not in turn and "content" not in turn:  # a tool schema
            yield json.dumps(dict(turn))
            continue
        for key in ("content", "reasoning_content", "thinking"):
            if isinstance(turn.get(key), str):
                yield turn[key]
        if isinstance(turn.get("tool_calls"), list):
            yield json.dumps(turn["tool_calls"], default=str)


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
    if eos_token is not None and tokenizer.token_to_id(eos_token) is None:
        eos_token = None
    return save_tokenizer_folder(
        folder,
        tokenizer_path,
        eos_token=eos_token,
        chat_template=chat_template,
        model_max_length=model_max_length,
    )


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


def tokenizer_bos_token(source: str | Path | None) -> str | None:
    """The BOS token that the ``tokenizer_config.json`` beside a tokenizer names
    (``source``: a tokenizer.json or its folder), which templates write as
    ``bos_token``; None when there is none.

    Raises:
        DataError: tokenizer_config.json is not readable JSON.
    """
    if source is None:
        return None
    folder = Path(source).expanduser()
    config_file = (folder if folder.is_dir() else folder.parent) / "tokenizer_config.json"
    if not config_file.is_file():
        return None
    try:
        token = json.loads(config_file.read_text()).get("bos_token")
    except (OSError, ValueError, AttributeError) as err:
        raise DataError(f"data.tokenizer.path: {config_file} is not readable JSON: {err}") from err
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _limited(texts: Iterable[str], max_bytes: int) -> Iterator[str]:
    taken = 0
    for text in texts:
        if taken >= max_bytes:
            return
        taken += len(text.encode("utf-8"))
        yield text


@dataclass(frozen=True)
class PreparedChat:
    """The tokenizer and data identity of a chat run (for hand-off manifests)."""

    tokenizer_path: Path
    fingerprint: str
    chat_template: str  # the Jinja template the records were rendered with


class ChatRecordsDataModule(ResumableDataModule):
    """The data module of chat records, by source, before SFT and preference pairs differ.

    It resolves the sources a run reads (``data.path``, else ``data.sources``, else
    :attr:`default_sources`), loads each one's records once and splits them by a seeded
    ``data.val_fraction``, finds or trains the tokenizer (on the training records' text
    in :meth:`_text_fields`), and saves it with its chat template (:meth:`save_tokenizer`).
    Subclasses check their settings before calling ``__init__`` and build, in ``setup``,
    ``self.tokenizer``, the datasets and ``self.prepared`` (a :class:`PreparedChat`).

    Args:
        config: the data configuration (``data.chat`` says how records are read).
        model_vocab_size: ``model.vocab_size``; the tokenizer must fit in it.
        model_max_seq_len: ``model.max_seq_len``; ``data.seq_len`` must not exceed it.
        total_train_samples: samples each rank draws over the run (``None``: one pass).
        builtins: built-in record sources by name.
        tokenizer_path: overrides ``data.tokenizer.path``.
    """

    default_sources: Mapping[str, SourceConfig] = {}

    def __init__(
        self,
        config: DataConfig,
        model_vocab_size: int,
        model_max_seq_len: int,
        total_train_samples: int | None = None,
        *,
        builtins: Mapping[str, RecordBuiltin],
        tokenizer_path: str | None = None,
    ) -> None:
        super().__init__(config, model_vocab_size, model_max_seq_len, total_train_samples)
        self.builtins = dict(builtins)
        self.tokenizer_path = tokenizer_path or config.tokenizer.path
        self.prepared: PreparedChat | None = None
        self._sources: dict[str, SourceConfig] | None = None
        self._records: dict[str, Records] = {}
        self._oversized: dict[str, set[int]] = {}  # by source: records over max_record_bytes

    # ------------------------------------------------------------- sources
    @property
    def sources(self) -> dict[str, SourceConfig]:
        """The sources this run reads, resolved on first use."""
        if self._sources is None:
            self._sources = self._resolve_sources()
        return self._sources

    def _resolve_sources(self) -> dict[str, SourceConfig]:
        return configured_sources(self.config, self.default_sources)

    def _source_records(self, name: str) -> Records:
        """Every record of source ``name``, loaded once (and its over-long ones found)."""
        if name not in self._records:
            records = load_source_records(self.config, name, self.sources[name], self.builtins)
            self._records[name] = records
            self._oversized[name] = self._find_oversized(name, records)
        return self._records[name]

    def _find_oversized(self, name: str, records: Records) -> set[int]:
        """The records over ``data.chat.max_record_bytes`` of text: an error naming the
        first, or with ``on_bad_record=skip`` left out of both splits and counted.

        A record of megabytes costs its size many times over, in the tokenizer's
        per-token records above all (about 140 bytes a byte of text), however little
        of it ``data.seq_len`` keeps."""
        limit = self.config.chat.max_record_bytes
        if limit is None:
            return set()
        sizes = {i: n for i, r in enumerate(records) if (n := record_text_bytes(r)) > limit}
        if not sizes:
            return set()
        first = min(sizes)
        where = record_where(self._where_of(name, records), first)
        problem = (
            f"{where}: {sizes[first]:,} bytes of text, over data.chat.max_record_bytes={limit}"
        )
        if self.config.chat.on_bad_record == "error":
            raise bad_record_error(problem)
        rank_zero_warning(
            f"{source_key(name)}: skipped {len(sizes)} record(s) over "
            f"data.chat.max_record_bytes (data.chat.on_bad_record=skip); first: {problem}"
        )
        return set(sizes)

    def _split(self, name: str) -> tuple[list[int], list[int]]:
        """Indices of the source's training and held-out records (over-long ones left
        out after the split, so the others' split does not move)."""
        records = self._source_records(name)
        train, val = split_records(records, self.config.val_fraction, self.config.seed)
        oversized = self._oversized.get(name)
        if oversized:
            train = [i for i in train if i not in oversized]
            val = [i for i in val if i not in oversized]
        return train, val

    def oversized_skipped(self) -> dict[str, int]:
        """The records left out for their size (``skipped_records``' entry)."""
        count = sum(len(found) for found in self._oversized.values())
        reason = "over data.chat.max_record_bytes (data.chat.on_bad_record=skip)"
        return {reason: count} if count else {}

    def _record_source(self, name: str) -> RecordSource:
        """How messages name the source's records: by file and line where known."""
        return self._where_of(name, self._source_records(name))

    @staticmethod
    def _where_of(name: str, records: Records) -> RecordSource:
        return records.where if isinstance(records, Records) else source_key(name)

    # ------------------------------------------------------------- tokenizer
    def _text_fields(self) -> Sequence[str] | None:
        """The record fields a tokenizer for these records is trained on (None: all)."""
        return None

    def _training_texts(self) -> Iterator[str]:
        fields = self._text_fields()
        for name in self.sources:
            records = self._source_records(name)
            train, _ = self._split(name)
            yield from record_texts((records[i] for i in train), fields)

    def _fingerprint(self) -> str:
        return sources_fingerprint(self.sources)

    def _load_tokenizer(self) -> tuple[Tokenizer, str | None, Path]:
        """The run's tokenizer, its own chat template and its file (see
        :func:`load_chat_tokenizer`)."""
        config = self.config
        if self.tokenizer_path is not None:
            tokenizer = replace(config.tokenizer, path=str(self.tokenizer_path))
            config = replace(config, tokenizer=tokenizer)
        return load_chat_tokenizer(config, self._training_texts, self._fingerprint())

    def prepare_data(self) -> None:
        """Train (or find) the tokenizer once, on rank 0."""
        self._load_tokenizer()

    def _data_fingerprint(self, tokenizer: Tokenizer, template: str) -> str:
        return chat_data_fingerprint(self.config, self._fingerprint(), tokenizer, template)

    def save_tokenizer(self, folder: str | Path) -> Path:
        """Write the tokenizer and the chat template this run renders with into
        ``folder`` (``tokenizer.json`` and transformers' ``tokenizer_config.json``), so
        the run's output weights carry what their conversations looked like.

        Raises:
            RuntimeError: called before ``setup``.
        """
        if self.prepared is None or self.tokenizer is None:
            raise RuntimeError("call setup() before save_tokenizer()")
        return save_chat_tokenizer(
            folder,
            self.prepared.tokenizer_path,
            self.tokenizer,
            self.config,
            chat_template=self.prepared.chat_template,
            model_max_length=self.model_max_seq_len,
        )
