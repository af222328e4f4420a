"""The SFT LightningDataModule: rendered conversations, packed or padded, resumable.

Records become examples as :mod:`recipes_lib.data.chat.examples` says, and rows of
examples as :mod:`recipes_lib.data.chat.packing` says; sources, their split and the
tokenizer are the chat base's (:class:`~recipes_lib.data.chat_records.ChatRecordsDataModule`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial

from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import ConcatDataset, Dataset

from recipes_lib.config.schema import DataConfig, RunConfig, SourceConfig
from recipes_lib.data.chat.examples import (
    IGNORE_INDEX,
    ChatExample,
    ChatSourceStats,
    examples_from_arrays,
    examples_to_arrays,
    tokenize_records,
)
from recipes_lib.data.chat.formats import check_format
from recipes_lib.data.chat.instructions import stdlib_instruction_records
from recipes_lib.data.chat.packing import ChatExampleDataset, PackedChatDataset, pad_collate
from recipes_lib.data.chat.template import ChatRenderer, check_train_on
from recipes_lib.data.chat_records import (
    ChatRecordsDataModule,
    PreparedChat,
    check_chat_format,
)
from recipes_lib.data.encoded import EncodedCache, encoded_fingerprint
from recipes_lib.data.mixture import MixtureDataset
from recipes_lib.data.module import check_batch_shape, rank_zero_warning
from recipes_lib.data.records import RecordBuiltin, Records
from recipes_lib.data.sources import resolve_cache_dir, source_key
from recipes_lib.data.tokenizer import check_vocab_fits, init_tokenizer_path
from recipes_lib.errors import DataError

DEFAULT_SFT_SOURCES = {"stdlib_sft": SourceConfig(builtin="stdlib_sft")}
SFT_BUILTINS: dict[str, RecordBuiltin] = {"stdlib_sft": stdlib_instruction_records}


class ChatDataModule(ChatRecordsDataModule):
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

    default_sources = DEFAULT_SFT_SOURCES

    def __init__(
        self,
        config: DataConfig,
        model_vocab_size: int,
        model_max_seq_len: int,
        total_train_samples: int | None = None,
        builtins: Mapping[str, RecordBuiltin] = SFT_BUILTINS,
    ) -> None:
        check_chat_format(config.chat)
        check_format(config.chat)
        check_train_on(config.chat.train_on)
        check_batch_shape(config, model_max_seq_len)
        super().__init__(
            config,
            model_vocab_size,
            model_max_seq_len,
            total_train_samples,
            builtins=builtins,
        )
        self.renderer: ChatRenderer | None = None
        self.pad_id = 0
        self.stats: dict[str, ChatSourceStats] = {}
        # padded rows widened to a few lengths for compiled blocks (kernels.compile)
        self.bucketed = False

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        config = self.config
        tokenizer, template, tokenizer_path = self._load_tokenizer()
        check_vocab_fits(tokenizer, self.model_vocab_size)
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer.from_config(tokenizer, config, template, self.tokenizer_path)
        eos = tokenizer.token_to_id(config.tokenizer.eos_token)
        self.pad_id = eos if eos is not None else 0
        fingerprint = self._data_fingerprint(tokenizer, self.renderer.template_text)
        train: dict[str, Dataset] = {}
        val: list[Dataset] = []
        for name in self.sources:
            key = source_key(name)
            records = self._source_records(name)
            cache = EncodedCache(
                resolve_cache_dir(config.cache_dir),
                encoded_fingerprint(type(self).__qualname__, fingerprint, name),
                key,
            )
            train_examples, val_examples, stats = cache.kept(
                partial(self._examples, name, records), examples_to_arrays, examples_from_arrays
            )
            self.stats[name] = stats
            self._report(key, stats, train_examples + val_examples)
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
        self.prepared = PreparedChat(tokenizer_path, fingerprint, self.renderer.template_text)

    def _examples(
        self, name: str, records: Records
    ) -> tuple[list[ChatExample], list[ChatExample], ChatSourceStats]:
        """A source's training and held-out examples, tokenized, and what became of its
        records."""
        assert self.renderer is not None  # set by setup before any source is read
        stats = ChatSourceStats(records=len(records))
        train_idx, val_idx = self._split(name)
        where = self._record_source(name)
        train = tokenize_records(records, train_idx, self.renderer, self.config, where, stats)
        held_out = tokenize_records(records, val_idx, self.renderer, self.config, where, stats)
        stats.train, stats.val = len(train), len(held_out)
        return train, held_out, stats

    def _dataset(self, examples: list[ChatExample], seed: int) -> Dataset:
        if self.config.chat.packing:
            return PackedChatDataset(examples, self.config.seq_len, self.pad_id, seed)
        return ChatExampleDataset(examples)

    @staticmethod
    def _report(key: str, stats: ChatSourceStats, examples: list[ChatExample]) -> None:
        tokens = sum(len(e) for e in examples)
        trained = sum(int((e.labels != IGNORE_INDEX).sum()) for e in examples)
        rank_zero_info(
            f"{key}: {stats.records} records -> {stats.train} training and {stats.val} "
            f"held-out conversations ({stats.truncated} truncated, {stats.dropped} dropped); "
            f"{trained:,} of their {tokens:,} tokens trained, {tokens - trained:,} not"
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
        return {reason: n for reason, n in counts.items() if n} | self.oversized_skipped()

    def collate_fn(self) -> Callable | None:
        """Padding to the longest row, unless samples are already packed rows."""
        if self.config.chat.packing:
            return None
        return pad_collate(self.pad_id, self.config.seq_len if self.bucketed else None)


def build_chat_data(
    cfg: RunConfig,
    *,
    total_train_samples: int,
    weights: str | None = None,
    weights_key: str = "stage.init_from",
) -> ChatDataModule:
    """The data module of the ``sft`` objective.

    Without ``data.tokenizer.path``, a stage that starts from weights
    (``stage.init_from``, or the ``weights`` that ``weights_key`` names) uses the
    ``tokenizer.json`` beside them; one that starts from scratch trains a tokenizer on
    its records.

    Raises:
        ConfigError: the weights are set but no tokenizer for them is known.
    """
    if weights is None:
        weights, weights_key = cfg.stage.init_from, "stage.init_from"
    tokenizer = init_tokenizer_path(cfg.data, weights, key=weights_key)
    data = replace(cfg.data, tokenizer=replace(cfg.data.tokenizer, path=tokenizer))
    module = ChatDataModule(
        data,
        model_vocab_size=cfg.model.vocab_size,
        model_max_seq_len=cfg.model.max_seq_len,
        total_train_samples=total_train_samples,
    )
    module.bucketed = bool(cfg.kernels.compile)  # a few row lengths for compiled blocks
    return module
