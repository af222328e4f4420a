"""Preference data for the ``dpo`` objective: a resumable data module of pairs.

Records come from each ``data.sources`` entry (local ``.jsonl``/``.json``/``.parquet``
files or a ``datasets`` hub name, read with ``datasets``, or ``builtin: stdlib_dpo``)
and are validated and tokenized by :mod:`recipes_lib.data.preference.pairs`. A seeded
``data.val_fraction`` of the pairs is held out for validation. Batches are described in
:mod:`recipes_lib.data.preference.collate`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from torch import Tensor
from torch.utils.data import DataLoader

from recipes_lib.config.schema import DataConfig, RunConfig, SourceConfig
from recipes_lib.data.chat.template import ChatRenderer
from recipes_lib.data.chat_records import (
    ChatRecordsDataModule,
    PreparedChat,
    check_chat_format,
)
from recipes_lib.data.encoded import EncodedCache, encoded_fingerprint
from recipes_lib.data.module import check_batch_shape, rank_zero_warning
from recipes_lib.data.preference.collate import PairCollator, PreferencePairDataset
from recipes_lib.data.preference.pairs import (
    EncodedPair,
    EncodedPairs,
    PairEncoder,
    encode_records,
    pairs_from_arrays,
    pairs_to_arrays,
)
from recipes_lib.data.preference.stdlib_pairs import stdlib_preference_records
from recipes_lib.data.records import RecordBuiltin, RecordSource
from recipes_lib.data.sources import check_val_fraction, resolve_cache_dir, source_key
from recipes_lib.data.tokenizer import check_vocab_fits, eos_token_id, init_tokenizer_path
from recipes_lib.errors import ConfigError, DataError
from recipes_lib.kernels.compiled import bucketed_length

DEFAULT_PREFERENCE_SOURCES = {"stdlib_dpo": SourceConfig(builtin="stdlib_dpo")}
PREFERENCE_BUILTINS: dict[str, RecordBuiltin] = {"stdlib_dpo": stdlib_preference_records}


@dataclass(frozen=True)
class PreparedPairs(PreparedChat):
    """What the data module made of its sources (read by ``train.run`` and manifests)."""

    num_train: int = 0
    num_val: int = 0
    skipped: dict[str, int] = field(default_factory=dict)


class PreferenceDataModule(ChatRecordsDataModule):
    """Batches of preference pairs (see :mod:`~recipes_lib.data.preference.collate`),
    resumable like pretraining.

    The training stream is a :class:`ResumableSampler` over pairs; its state is the
    pairs this rank has consumed (``trainer.global_step * accumulate_grad_batches *
    batch_size``), so a resumed run continues with exactly the pairs the interrupted one
    would have seen next. Reference log-probs computed before training are stored on
    the datasets by pair index (:meth:`set_reference_logps`), so the sampler's order
    does not matter.

    Args:
        config: the data configuration (``data.chat`` for fields and policies).
        model_vocab_size: the tokenizer must fit ``model.vocab_size``.
        model_max_seq_len: ``data.seq_len`` must not exceed ``model.max_seq_len``.
        total_train_samples: pairs each rank draws over the run (``None``: one pass).
        tokenizer_path: overrides ``data.tokenizer.path``.
        shifted: batches of inputs and next-token labels; False: of whole sequences
            with each one's ``score_index`` (a reward model's).

    Raises:
        ConfigError: bad sizes or policies, or packing without document masking.
    """

    fixed_width = False  # packed rows of one width (compiled blocks): packed_width, collate

    default_sources = DEFAULT_PREFERENCE_SOURCES
    builtin_records: dict[str, RecordBuiltin] = PREFERENCE_BUILTINS

    def __init__(
        self,
        config: DataConfig,
        model_vocab_size: int,
        model_max_seq_len: int,
        total_train_samples: int | None = None,
        tokenizer_path: str | None = None,
        shifted: bool = True,
    ) -> None:
        check_batch_shape(config, model_max_seq_len, min_seq_len=2)
        check_val_fraction(config.val_fraction)
        check_chat_format(config.chat)
        if config.chat.packing and not config.document_mask:
            raise ConfigError(
                "data.chat.packing=true puts several sequences in one row, which needs "
                "data.document_mask=true (with kernels.attention=flex) so that they do not "
                "attend to each other; or set data.chat.packing=false to pad instead"
            )
        super().__init__(
            config,
            model_vocab_size,
            model_max_seq_len,
            total_train_samples,
            builtins=self.builtin_records,
            tokenizer_path=tokenizer_path,
        )
        self.prepared: PreparedPairs | None = None
        self.eos_id: int | None = None
        self.train_dataset: PreferencePairDataset | None = None
        self.val_dataset: PreferencePairDataset | None = None
        self.skipped: Counter = Counter()
        self.shifted = shifted

    # ------------------------------------------------------------- preparation
    def _resolve_sources(self) -> dict[str, SourceConfig]:
        sources = super()._resolve_sources()
        weights = {n: s.weight for n, s in sources.items()}
        if len(sources) > 1 and len(set(weights.values())) > 1:
            raise ConfigError(
                f"data.sources weights {weights}: preference sources are concatenated, not "
                "sampled by weight; leave every weight at 1.0"
            )
        return sources

    def _text_fields(self) -> tuple[str, ...]:
        chat = self.config.chat
        return (chat.prompt_field, chat.messages_field, chat.chosen_field, chat.rejected_field)

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        config = self.config
        tokenizer, template, tokenizer_path = self._load_tokenizer()
        check_vocab_fits(tokenizer, self.model_vocab_size)
        eos_id = eos_token_id(tokenizer, config.tokenizer.eos_token)
        renderer = ChatRenderer.from_config(tokenizer, config, template, self.tokenizer_path)
        encoder = PairEncoder(renderer, config.seq_len, config.chat, shifted=self.shifted)
        fingerprint = self._data_fingerprint(tokenizer, renderer.template_text)
        cache_dir = resolve_cache_dir(config.cache_dir)
        splits: dict[str, list[EncodedPair]] = {"train": [], "val": []}
        for name in self.sources:
            key = source_key(name)
            skipped: Counter = Counter()
            total = 0
            records = self._source_records(name)
            for split, indices in zip(("train", "val"), self._split(name), strict=True):
                cache = EncodedCache(
                    cache_dir,
                    encoded_fingerprint(
                        type(self).__qualname__, self.shifted, fingerprint, name, split
                    ),
                    f"{key}, {split}",
                )
                where = self._record_source(name)
                encoded = cache.kept(
                    partial(self.encode, [records[i] for i in indices], encoder, where, indices),
                    pairs_to_arrays,
                    pairs_from_arrays,
                )
                splits[split].extend(encoded.pairs)
                skipped.update(encoded.skipped)
                total += encoded.total
            if skipped:
                reasons = ", ".join(f"{n} {reason}" for reason, n in skipped.most_common())
                rank_zero_warning(
                    f"{key}: skipped {sum(skipped.values())} of {total} records: {reasons}"
                )
                self.skipped.update(skipped)
        if not splits["train"]:
            raise DataError(
                f"data.sources {sorted(self.sources)}: no usable preference pairs for "
                f"training ({sum(self.skipped.values())} skipped: {dict(self.skipped)})"
            )
        self.train_dataset = PreferencePairDataset(splits["train"])
        self.val_dataset = PreferencePairDataset(splits["val"]) if splits["val"] else None
        self.tokenizer, self.eos_id = tokenizer, eos_id
        template = renderer.template_text
        self.prepared = PreparedPairs(
            tokenizer_path=Path(tokenizer_path).resolve(),
            fingerprint=fingerprint,
            num_train=len(splits["train"]),
            num_val=len(splits["val"]),
            skipped=dict(self.skipped),
            chat_template=template,
        )

    def encode(
        self, records: list, encoder: PairEncoder, where: RecordSource, indices: list[int]
    ) -> EncodedPairs:
        """Validate and encode the records of one split of a source (``indices``: their
        positions in it, named in errors)."""
        return encode_records(records, encoder, where, indices)

    def skipped_records(self) -> dict[str, int]:
        """Pairs left out, by reason (malformed ones with ``data.chat.on_bad_record=skip``,
        and pairs that truncation made empty or identical, and records over
        ``data.chat.max_record_bytes``)."""
        return dict(self.skipped) | self.oversized_skipped()

    # ------------------------------------------------------------- loaders
    def collate_fn(self) -> PairCollator:
        if self.eos_id is None:
            raise RuntimeError("call setup() first")
        chat = self.config.chat
        width = self.packed_width() if chat.packing and self.fixed_width else self.config.seq_len
        return PairCollator(self.eos_id, chat.packing, width, self.shifted, self.fixed_width)

    def packed_width(self) -> int:
        """How wide packed rows are for compiled blocks: the data's longest sequence
        (training and validation) rounded up to a multiple of
        :data:`~recipes_lib.kernels.compiled.LENGTH_MULTIPLE`, at most ``data.seq_len``.

        One width for the whole run, so the blocks keep their one graph per kind of call
        (only the number of rows varies); but no wider than the data needs, so short
        pairs fill rows instead of padding ``data.seq_len``-wide ones (4 pairs of 180
        tokens a sequence took two 2,048-wide rows, a third of them real tokens)."""
        longest = max(
            (
                pair.max_len
                for dataset in (self.train_dataset, self.val_dataset)
                if dataset is not None
                for pair in dataset.pairs
            ),
            default=self.config.seq_len,
        )
        return bucketed_length(max(1, longest - int(self.shifted)), self.config.seq_len)

    def split_dataset(self, split: str) -> PreferencePairDataset | None:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        self.setup("fit")
        return self.train_dataset if split == "train" else self.val_dataset

    def reference_dataloader(self, split: str, rank: int = 0, world_size: int = 1) -> DataLoader:
        """Every pair of ``split`` once, in order (rank ``r`` reads ``r, r + world, ...``):
        what reference log-probs are precomputed over."""
        dataset = self.split_dataset(split)
        if dataset is None:
            return self._loader(PreferencePairDataset([]), None)
        indices = list(range(rank, len(dataset), world_size))
        return self._loader(dataset, indices)

    def set_reference_logps(self, split: str, table: Tensor) -> None:
        """Store ``(N, 2)`` reference log-probs (chosen, rejected) for ``split``'s pairs."""
        dataset = self.split_dataset(split)
        if dataset is None:
            return
        if tuple(table.shape) != (len(dataset), 2):
            raise ValueError(
                f"reference log-probs for {split} must have shape ({len(dataset)}, 2), got "
                f"{tuple(table.shape)}"
            )
        dataset.reference_logps = table.detach().float().cpu()


def build_preference_data(
    cfg: RunConfig, *, total_train_samples: int, shifted: bool = True
) -> PreferenceDataModule:
    """The data module of the ``dpo`` objective (``shifted=False``: of ``reward``).

    Without ``data.tokenizer.path``, a stage that starts from weights uses the
    ``tokenizer.json`` beside them; one that starts from scratch trains a tokenizer on
    its pairs.

    Raises:
        ConfigError: ``stage.init_from`` is set but no tokenizer for its weights is known.
    """
    tokenizer = init_tokenizer_path(cfg.data, cfg.stage.init_from)
    module = PreferenceDataModule(
        cfg.data,
        model_vocab_size=cfg.model.vocab_size,
        model_max_seq_len=cfg.model.max_seq_len,
        total_train_samples=total_train_samples,
        tokenizer_path=tokenizer,
        shifted=shifted,
    )
    module.fixed_width = bool(cfg.kernels.compile)  # one row width for compiled blocks
    return module
