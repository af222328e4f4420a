"""The SFT LightningDataModule: rendered conversations, packed or padded, resumable.

Every record becomes one example: its conversation's token ids as inputs and, as
labels, the next token wherever that token is assistant output (``-100`` elsewhere,
and at the example's last position). With ``data.chat.packing`` several examples share
a row of ``data.seq_len`` tokens (``doc_ids`` tell them apart, for document masking),
otherwise each row is one example, padded to the longest of its batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from tokenizers import Tokenizer
from torch.utils.data import ConcatDataset, Dataset

from recipes_lib.config.schema import DataConfig, RunConfig, SourceConfig
from recipes_lib.data.chat import (
    IGNORE_INDEX,
    ChatRenderer,
    RecordSource,
    check_chat_format,
    next_token_labels,
    record_messages,
    truncate,
)
from recipes_lib.data.chat_sources import (
    SFT_BUILTINS,
    SavesChatTokenizer,
    chat_data_fingerprint,
    load_chat_tokenizer,
    record_texts,
    sources_fingerprint,
)
from recipes_lib.data.mixture import MixtureDataset
from recipes_lib.data.module import ResumableDataModule, check_batch_shape, rank_zero_warning
from recipes_lib.data.raw import configured_sources, source_key
from recipes_lib.data.records import (
    RecordBuiltin,
    Records,
    load_source_records,
    split_records,
)
from recipes_lib.data.tokenizer import check_vocab_fits, init_tokenizer_path, tokenizer_vocab_size
from recipes_lib.errors import DataError

DEFAULT_SFT_SOURCES = {"stdlib_sft": SourceConfig(builtin="stdlib_sft")}
_OPEN_ROWS = 64  # packing looks for room in the most recent rows only
_ERRORS_SHOWN = 3


@dataclass
class ChatExample:
    """One conversation: ``input_ids`` and next-token ``labels``, both ``(L,)`` int64."""

    input_ids: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class ChatSourceStats:
    """What became of one source's records."""

    records: int = 0
    train: int = 0
    val: int = 0
    skipped: int = 0  # malformed records, with data.chat.on_bad_record=skip
    truncated: int = 0
    dropped: int = 0  # over-long with truncation=drop, or no assistant token left
    errors: list[str] = field(default_factory=list)  # the first skipped records' errors


def tokenize_records(
    records: Sequence[Mapping[str, Any]],
    indices: Sequence[int],
    renderer: ChatRenderer,
    config: DataConfig,
    source: RecordSource,
    stats: ChatSourceStats,
) -> list[ChatExample]:
    """The training examples of ``records[i]`` for ``i`` in ``indices``.

    Args:
        source: the source's key, or a function naming a record by its place in a file
            (``Records.where``), for messages.

    Raises:
        DataError: a malformed record or a template that fails on it (naming the
            record's file and line, or index, and the field), unless
            ``data.chat.on_bad_record=skip``, which counts it in ``stats`` instead.
    """
    chat = config.chat
    examples = []
    for index in indices:
        try:
            messages = record_messages(records[index], index, chat, source)
            rendered = renderer.render(messages, index=index, source=source)
        except DataError as err:
            if chat.on_bad_record == "error":
                raise DataError(f"{err} (set data.chat.on_bad_record=skip to skip it)") from None
            stats.skipped += 1
            if len(stats.errors) < _ERRORS_SHOWN:
                stats.errors.append(str(err))
            continue
        kept = truncate(rendered, config.seq_len, chat.truncation)
        if kept is not None and len(kept) < len(rendered):
            stats.truncated += 1
        labels = next_token_labels(kept) if kept is not None else []
        if kept is None or all(label == IGNORE_INDEX for label in labels):
            stats.dropped += 1
            continue
        examples.append(
            ChatExample(np.asarray(kept.input_ids, np.int64), np.asarray(labels, np.int64))
        )
    return examples


def pack_examples(lengths: Sequence[int], seq_len: int, seed: int) -> list[list[int]]:
    """Rows of example indices whose lengths fit ``seq_len``: examples in a seeded
    order, each placed in the first of the recent rows with room for it (first fit)."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    rows: list[list[int]] = []
    room: list[int] = []
    first_open = 0
    for index in order.tolist():
        length = lengths[index]
        for r in range(first_open, len(rows)):
            if room[r] >= length:
                rows[r].append(index)
                room[r] -= length
                break
        else:
            rows.append([index])
            room.append(seq_len - length)
            first_open = max(first_open, len(rows) - _OPEN_ROWS)
    return rows


class PackedChatDataset(Dataset):
    """Rows of ``seq_len`` tokens, each holding whole examples and then padding.

    Item ``i``: ``input_ids``, ``labels`` ``(T,)`` int64 and ``doc_ids`` ``(T,)`` int32,
    where ``doc_ids`` numbers the examples of the row ``0, 1, ...`` and the padding
    after them gets the next number (its labels are ``-100``).
    """

    def __init__(self, examples: list[ChatExample], seq_len: int, pad_id: int, seed: int):
        self.examples = examples
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.rows = pack_examples([len(e) for e in examples], seq_len, seed)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        T = self.seq_len
        input_ids = np.full(T, self.pad_id, np.int64)
        labels = np.full(T, IGNORE_INDEX, np.int64)
        doc_ids = np.empty(T, np.int32)
        position = 0
        row = self.rows[index]
        for doc, example_index in enumerate(row):
            example = self.examples[example_index]
            end = position + len(example)
            input_ids[position:end] = example.input_ids
            labels[position:end] = example.labels
            doc_ids[position:end] = doc
            position = end
        doc_ids[position:] = len(row)
        return {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "doc_ids": torch.from_numpy(doc_ids),
        }


class ChatExampleDataset(Dataset):
    """One example per item, unpadded; batch them with :func:`pad_collate`."""

    def __init__(self, examples: list[ChatExample]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        example = self.examples[index]
        return {
            "input_ids": torch.from_numpy(example.input_ids),
            "labels": torch.from_numpy(example.labels),
        }


def pad_collate(pad_id: int) -> Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]]:
    """A collate function padding examples on the right to the longest of the batch
    (inputs with ``pad_id``, labels with ``-100``; ``doc_ids`` 0, then 1 on padding)."""

    def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(len(item["input_ids"]) for item in items)
        batch = len(items)
        input_ids = torch.full((batch, longest), pad_id, dtype=torch.int64)
        labels = torch.full((batch, longest), IGNORE_INDEX, dtype=torch.int64)
        doc_ids = torch.ones((batch, longest), dtype=torch.int32)
        for row, item in enumerate(items):
            n = len(item["input_ids"])
            input_ids[row, :n] = item["input_ids"]
            labels[row, :n] = item["labels"]
            doc_ids[row, :n] = 0
        return {"input_ids": input_ids, "labels": labels, "doc_ids": doc_ids}

    return collate


@dataclass(frozen=True)
class PreparedChat:
    """The tokenizer and data identity of a chat run (for hand-off manifests)."""

    tokenizer_path: Path
    fingerprint: str
    chat_template: str


class ChatDataModule(SavesChatTokenizer, ResumableDataModule):
    """SFT batches ``{"input_ids", "labels", "doc_ids"}`` of rendered conversations.

    The training stream is the same endless seeded shuffle as pretraining's
    (:class:`~recipes_lib.data.sampler.ResumableSampler`), resumed from
    ``state_dict()["consumed_samples"]``; several sources mix by their weights.

    Args:
        config: the data configuration (``data.chat`` says how records are read).
        model_vocab_size: ``model.vocab_size``; the tokenizer must fit in it.
        model_max_seq_len: ``model.max_seq_len``; ``data.seq_len`` must not exceed it.
        total_train_samples: rows each rank draws over the run (the loader's length).
        builtins: built-in record sources by name (``stdlib_sft``).

    Raises:
        ConfigError: a bad ``data.chat`` policy or ``data.seq_len``.
    """

    def __init__(
        self,
        config: DataConfig,
        model_vocab_size: int,
        model_max_seq_len: int,
        total_train_samples: int | None = None,
        builtins: Mapping[str, RecordBuiltin] = SFT_BUILTINS,
    ) -> None:
        super().__init__()
        check_chat_format(config.chat)
        check_batch_shape(config, model_max_seq_len)
        self.config = config
        self.model_vocab_size = model_vocab_size
        self.model_max_seq_len = model_max_seq_len
        self.total_train_samples = total_train_samples
        self.builtins = dict(builtins)
        self.sources = configured_sources(config, DEFAULT_SFT_SOURCES)
        self.prepare_data_per_node = False
        self.prepared: PreparedChat | None = None
        self.tokenizer: Tokenizer | None = None
        self.renderer: ChatRenderer | None = None
        self.pad_id = 0
        self.stats: dict[str, ChatSourceStats] = {}
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self._records: dict[str, list[dict[str, Any]]] = {}
        self._consumed_samples = 0

    # ------------------------------------------------------------- preparing
    def _source_records(self, name: str) -> list[dict[str, Any]]:
        if name not in self._records:
            self._records[name] = load_source_records(
                self.config, name, self.sources[name], self.builtins
            )
        return self._records[name]

    def _training_texts(self):
        for name in self.sources:
            records = self._source_records(name)
            train, _ = split_records(records, self.config.val_fraction, self.config.seed)
            yield from record_texts(records[index] for index in train)

    def _fingerprint(self) -> str:
        return sources_fingerprint(self.sources)

    def prepare_data(self) -> None:
        """Train (or find) the tokenizer once, on rank 0."""
        load_chat_tokenizer(self.config, self._training_texts, self._fingerprint())

    @property
    def vocab_size(self) -> int:
        if self.tokenizer is None:
            raise RuntimeError("call setup() before reading vocab_size")
        return tokenizer_vocab_size(self.tokenizer)

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        config = self.config
        sources_fp = self._fingerprint()
        tokenizer, template, tokenizer_path = load_chat_tokenizer(
            config, self._training_texts, sources_fp
        )
        check_vocab_fits(tokenizer, self.model_vocab_size)
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(
            tokenizer,
            config.chat.chat_template,
            tokenizer_template=template,
            eos_token=config.tokenizer.eos_token,
        )
        eos = tokenizer.token_to_id(config.tokenizer.eos_token)
        self.pad_id = eos if eos is not None else 0
        train: dict[str, Dataset] = {}
        val: list[Dataset] = []
        for name in self.sources:
            key = source_key(name)
            records = self._source_records(name)
            stats = self.stats[name] = ChatSourceStats(records=len(records))
            train_idx, val_idx = split_records(records, config.val_fraction, config.seed)
            where = records.where if isinstance(records, Records) else key
            train_examples = tokenize_records(
                records, train_idx, self.renderer, config, where, stats
            )
            val_examples = tokenize_records(records, val_idx, self.renderer, config, where, stats)
            stats.train, stats.val = len(train_examples), len(val_examples)
            self._report(key, stats)
            if not train_examples:
                raise DataError(
                    f"{key}: no training conversation is left of {len(records)} records "
                    f"({stats.skipped} skipped as malformed, {stats.dropped} dropped as too "
                    f"long or without assistant tokens at data.seq_len={config.seq_len})"
                )
            train[name] = self._dataset(train_examples, config.seed)
            if val_examples:
                val.append(self._dataset(val_examples, config.seed + 1))
        weights = {name: s.weight for name, s in self.sources.items()}
        self.train_dataset = (
            next(iter(train.values())) if len(train) == 1 else MixtureDataset(train, weights)
        )
        self.val_dataset = ConcatDataset(val) if val else None
        template = self.renderer.template_text
        fingerprint = chat_data_fingerprint(config, sources_fp, tokenizer, template)
        self.prepared = PreparedChat(tokenizer_path, fingerprint, template)

    def _dataset(self, examples: list[ChatExample], seed: int) -> Dataset:
        if self.config.chat.packing:
            return PackedChatDataset(examples, self.config.seq_len, self.pad_id, seed)
        return ChatExampleDataset(examples)

    @staticmethod
    def _report(key: str, stats: ChatSourceStats) -> None:
        rank_zero_info(
            f"{key}: {stats.records} records -> {stats.train} training and {stats.val} "
            f"held-out conversations ({stats.truncated} truncated, {stats.dropped} dropped)"
        )
        if stats.skipped:
            rank_zero_warning(
                f"{key}: skipped {stats.skipped} malformed record(s) of {stats.records} "
                f"(data.chat.on_bad_record=skip); first: " + " | ".join(stats.errors)
            )

    def skipped_records(self) -> dict[str, int]:
        """Records left out, by reason: malformed ones (``data.chat.on_bad_record=skip``)
        and conversations too long for ``data.seq_len`` or without an assistant token."""
        counts = {
            "malformed (data.chat.on_bad_record=skip)": sum(s.skipped for s in self.stats.values()),
            "too long or without assistant tokens": sum(s.dropped for s in self.stats.values()),
        }
        return {reason: n for reason, n in counts.items() if n}

    # ------------------------------------------------------------- loading
    def collate_fn(self) -> Callable | None:
        """Padding to the longest row, unless samples are already packed rows."""
        return None if self.config.chat.packing else pad_collate(self.pad_id)


def build_chat_data(cfg: RunConfig, *, total_train_samples: int) -> ChatDataModule:
    """The data module of the ``sft`` objective.

    Without ``data.tokenizer.path``, a stage that starts from weights
    (``stage.init_from``) uses the ``tokenizer.json`` beside them; one that starts from
    scratch trains a tokenizer on its records.

    Raises:
        ConfigError: ``stage.init_from`` is set but no tokenizer for its weights is known.
    """
    tokenizer = init_tokenizer_path(cfg.data, cfg.stage.init_from)
    data = replace(cfg.data, tokenizer=replace(cfg.data.tokenizer, path=tokenizer))
    return ChatDataModule(
        data,
        model_vocab_size=cfg.model.vocab_size,
        model_max_seq_len=cfg.model.max_seq_len,
        total_train_samples=total_train_samples,
    )
