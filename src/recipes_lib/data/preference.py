"""Preference data for the ``dpo`` objective: sources, batches and a resumable data module.

Records come from each ``data.sources`` entry (local ``.jsonl``/``.json``/``.parquet``
files or a ``datasets`` hub name, read with ``datasets``, or ``builtin: stdlib_dpo``)
and are validated and tokenized by :mod:`recipes_lib.data.preference_records`. A
seeded ``data.val_fraction`` of the pairs is held out for validation.

A batch of ``P`` pairs (``collate_pairs``) is::

    input_ids     (R, T) int64   token ids; padding is the EOS id
    labels        (R, T) int64   next token, -100 on prompt tokens and padding
    doc_ids       (R, T) int32   which sequence of its row each token belongs to
    sequence_ids  (R, T) int64   j for a token of pair j's chosen sequence, P + j for its
                                 rejected one, -1 on padding
    pair_index    (P,)   int64   the pairs' indices in their dataset
    num_tokens    int            real (non-padding) input tokens of the batch
    reference_logps (P, 2) fp32  precomputed reference log-probs (chosen, rejected),
                                 when the dataset holds them

Without packing (``data.chat.packing=false``) every sequence has its own row, padded
to the longest of the batch: rows ``0..P-1`` are the chosen sequences and ``P..2P-1``
the rejected ones, so one forward pass sees both. With packing, sequences share rows
of ``data.seq_len`` (first fit, longest first) and ``doc_ids`` keeps them apart, which
needs ``data.document_mask=true``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from recipes_lib.config.schema import DataConfig, RunConfig, SourceConfig
from recipes_lib.data.chat import ChatRenderer
from recipes_lib.data.chat_sources import (
    SavesChatTokenizer,
    chat_data_fingerprint,
    load_chat_tokenizer,
    record_texts,
    sources_fingerprint,
)
from recipes_lib.data.module import ResumableDataModule, check_batch_shape, rank_zero_warning
from recipes_lib.data.preference_records import (
    EncodedPair,
    PairEncoder,
    check_chat_format,
    encode_records,
)
from recipes_lib.data.raw import configured_sources, source_key
from recipes_lib.data.records import (
    RecordBuiltin,
    Records,
    load_source_records,
    split_records,
)
from recipes_lib.data.stdlib_pairs import stdlib_preference_records
from recipes_lib.data.tokenizer import check_vocab_fits, eos_token_id, init_tokenizer_path
from recipes_lib.errors import ConfigError, DataError

DEFAULT_PREFERENCE_SOURCES = {"stdlib_dpo": SourceConfig(builtin="stdlib_dpo")}
PREFERENCE_BUILTINS: dict[str, RecordBuiltin] = {"stdlib_dpo": stdlib_preference_records}


@dataclass(frozen=True)
class PreparedPairs:
    """What the data module made of its sources (read by ``train.run`` and manifests)."""

    tokenizer_path: Path
    fingerprint: str
    num_train: int
    num_val: int
    skipped: dict[str, int] = field(default_factory=dict)
    chat_template: str | None = None  # the Jinja template the pairs were rendered with


class PreferencePairDataset(Dataset):
    """Encoded pairs; item ``i`` carries its index and, once computed, its reference
    log-probs (``reference_logps``, a ``(N, 2)`` table indexed by pair)."""

    def __init__(self, pairs: Sequence[EncodedPair]) -> None:
        self.pairs = list(pairs)
        self.reference_logps: Tensor | None = None

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> dict[str, Tensor | int]:
        pair = self.pairs[index]
        item: dict[str, Tensor | int] = {
            "index": index,
            "chosen_ids": torch.from_numpy(pair.chosen_ids),
            "chosen_mask": torch.from_numpy(pair.chosen_mask),
            "rejected_ids": torch.from_numpy(pair.rejected_ids),
            "rejected_mask": torch.from_numpy(pair.rejected_mask),
        }
        if self.reference_logps is not None:
            item["reference_logps"] = self.reference_logps[index]
        return item


def _first_fit_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Sequence indices per row: longest first, each into the first row with room."""
    rows: list[list[int]] = []
    room: list[int] = []
    for s in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[s] <= free:
                rows[r].append(s)
                room[r] -= lengths[s]
                break
        else:
            rows.append([s])
            room.append(capacity - lengths[s])
    return rows


def collate_pairs(
    items: Sequence[Mapping], pad_id: int, packing: bool = False, seq_len: int | None = None
) -> dict[str, Tensor]:
    """Batch pairs as described in the module docstring.

    Args:
        items: dataset items of :class:`PreferencePairDataset`.
        pad_id: token id of padding (labels there are -100).
        packing: share rows of ``seq_len`` between sequences.
        seq_len: the row length when packing.
    """
    n_pairs = len(items)
    sequences = [(it["chosen_ids"], it["chosen_mask"]) for it in items]
    sequences += [(it["rejected_ids"], it["rejected_mask"]) for it in items]
    lengths = [len(ids) - 1 for ids, _ in sequences]  # inputs per sequence
    if packing:
        if seq_len is None:
            raise ValueError("packing needs seq_len")
        rows = _first_fit_rows(lengths, seq_len)
    else:
        rows = [[s] for s in range(len(sequences))]
    width = max(sum(lengths[s] for s in row) for row in rows)
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, -100, dtype=torch.long)
    sequence_ids = torch.full(shape, -1, dtype=torch.long)
    doc_ids = torch.zeros(shape, dtype=torch.int32)
    for r, row in enumerate(rows):
        offset = 0
        for k, s in enumerate(row):
            ids, mask = sequences[s]
            n = lengths[s]
            cols = slice(offset, offset + n)
            input_ids[r, cols] = ids[:-1]
            labels[r, cols] = torch.where(mask[1:], ids[1:], torch.full_like(ids[1:], -100))
            sequence_ids[r, cols] = s
            doc_ids[r, cols] = k
            offset += n
        doc_ids[r, offset:] = len(row)  # padding is a document of its own
    batch = {
        "input_ids": input_ids,
        "labels": labels,
        "doc_ids": doc_ids,
        "sequence_ids": sequence_ids,
        "pair_index": torch.tensor([int(it["index"]) for it in items], dtype=torch.long),
        "num_tokens": sum(lengths),  # an int: counting needs no device sync
    }
    if n_pairs and all("reference_logps" in it for it in items):
        batch["reference_logps"] = torch.stack([it["reference_logps"] for it in items]).float()
    return batch


class PairCollator:
    """:func:`collate_pairs` with the run's padding id and packing (picklable for workers)."""

    def __init__(self, pad_id: int, packing: bool, seq_len: int) -> None:
        self.pad_id, self.packing, self.seq_len = pad_id, packing, seq_len

    def __call__(self, items: Sequence[Mapping]) -> dict[str, Tensor]:
        return collate_pairs(items, self.pad_id, self.packing, self.seq_len)


class PreferenceDataModule(SavesChatTokenizer, ResumableDataModule):
    """Batches of preference pairs (see the module docstring), resumable like pretraining.

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

    Raises:
        ConfigError: bad sizes or policies, or packing without document masking.
    """

    def __init__(
        self,
        config: DataConfig,
        model_vocab_size: int,
        model_max_seq_len: int,
        total_train_samples: int | None = None,
        tokenizer_path: str | None = None,
    ) -> None:
        super().__init__()
        check_batch_shape(config, model_max_seq_len, min_seq_len=2)
        if not 0 <= config.val_fraction < 1:
            raise ConfigError(f"data.val_fraction must be in [0, 1), got {config.val_fraction}")
        check_chat_format(config.chat)
        if config.chat.packing and not config.document_mask:
            raise ConfigError(
                "data.chat.packing=true puts several sequences in one row, which needs "
                "data.document_mask=true (with kernels.attention=flex) so that they do not "
                "attend to each other; or set data.chat.packing=false to pad instead"
            )
        self.config = config
        self.model_vocab_size = model_vocab_size
        self.model_max_seq_len = model_max_seq_len
        self.total_train_samples = total_train_samples
        self.tokenizer_path = tokenizer_path or config.tokenizer.path
        self.prepare_data_per_node = False
        self.prepared: PreparedPairs | None = None
        self.tokenizer: Tokenizer | None = None
        self.eos_id: int | None = None
        self.train_dataset: PreferencePairDataset | None = None
        self.val_dataset: PreferencePairDataset | None = None
        self.skipped: Counter = Counter()
        self._raw_records: dict[str, list[dict]] | None = None
        self._consumed_samples = 0

    # ------------------------------------------------------------- preparation
    def _sources(self) -> dict[str, SourceConfig]:
        sources = configured_sources(self.config, DEFAULT_PREFERENCE_SOURCES)
        weights = {n: s.weight for n, s in sources.items()}
        if len(sources) > 1 and len(set(weights.values())) > 1:
            raise ConfigError(
                f"data.sources weights {weights}: preference sources are concatenated, not "
                "sampled by weight; leave every weight at 1.0"
            )
        return sources

    def _records(self) -> dict[str, list[dict]]:
        if self._raw_records is None:
            self._raw_records = {
                name: load_source_records(self.config, name, source, PREFERENCE_BUILTINS)
                for name, source in self._sources().items()
            }
        return self._raw_records

    def _split(self, name: str) -> tuple[list[int], list[int]]:
        """Indices of the source's training and held-out records."""
        return split_records(self._records()[name], self.config.val_fraction, self.config.seed)

    def _training_texts(self):
        chat = self.config.chat
        fields = (chat.prompt_field, chat.messages_field, chat.chosen_field, chat.rejected_field)
        for name in self._sources():
            records = self._records()[name]
            train, _ = self._split(name)
            yield from record_texts((records[i] for i in train), fields)

    def _fingerprint(self) -> str:
        return sources_fingerprint(self._sources())

    def _tokenizer(self) -> tuple[Tokenizer, str | None, Path]:
        config = self.config
        if self.tokenizer_path is not None:
            tokenizer = replace(config.tokenizer, path=str(self.tokenizer_path))
            config = replace(config, tokenizer=tokenizer)
        return load_chat_tokenizer(config, self._training_texts, self._fingerprint())

    def prepare_data(self) -> None:
        """Train (or find) the tokenizer once, on rank 0."""
        self._tokenizer()

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        config = self.config
        tokenizer, template, tokenizer_path = self._tokenizer()
        check_vocab_fits(tokenizer, self.model_vocab_size)
        eos_id = eos_token_id(tokenizer, config.tokenizer.eos_token)
        renderer = ChatRenderer(
            tokenizer,
            config.chat.chat_template,
            tokenizer_template=template,
            eos_token=config.tokenizer.eos_token,
        )
        encoder = PairEncoder(renderer, config.seq_len, config.chat)
        splits: dict[str, list[EncodedPair]] = {"train": [], "val": []}
        for name in self._sources():
            key = source_key(name)
            skipped: Counter = Counter()
            total = 0
            records = self._records()[name]
            for split, indices in zip(("train", "val"), self._split(name), strict=True):
                where = records.where if isinstance(records, Records) else key
                encoded = encode_records([records[i] for i in indices], encoder, where, indices)
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
                f"data.sources {sorted(self._sources())}: no usable preference pairs for "
                f"training ({sum(self.skipped.values())} skipped: {dict(self.skipped)})"
            )
        self.train_dataset = PreferencePairDataset(splits["train"])
        self.val_dataset = PreferencePairDataset(splits["val"]) if splits["val"] else None
        self.tokenizer, self.eos_id = tokenizer, eos_id
        template = renderer.template_text
        self.prepared = PreparedPairs(
            tokenizer_path=Path(tokenizer_path).resolve(),
            fingerprint=chat_data_fingerprint(config, self._fingerprint(), tokenizer, template),
            num_train=len(splits["train"]),
            num_val=len(splits["val"]),
            skipped=dict(self.skipped),
            chat_template=template,
        )

    def skipped_records(self) -> dict[str, int]:
        """Pairs left out, by reason (malformed ones with ``data.chat.on_bad_record=skip``,
        and pairs that truncation made empty or identical)."""
        return dict(self.skipped)

    # ------------------------------------------------------------- loaders
    def collate_fn(self) -> PairCollator:
        if self.eos_id is None:
            raise RuntimeError("call setup() first")
        return PairCollator(self.eos_id, self.config.chat.packing, self.config.seq_len)

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


def build_preference_data(cfg: RunConfig, *, total_train_samples: int) -> PreferenceDataModule:
    """The data module of the ``dpo`` objective.

    Without ``data.tokenizer.path``, a stage that starts from weights uses the
    ``tokenizer.json`` beside them; one that starts from scratch trains a tokenizer on
    its pairs.

    Raises:
        ConfigError: ``stage.init_from`` is set but no tokenizer for its weights is known.
    """
    tokenizer = init_tokenizer_path(cfg.data, cfg.stage.init_from)
    return PreferenceDataModule(
        cfg.data,
        model_vocab_size=cfg.model.vocab_size,
        model_max_seq_len=cfg.model.max_seq_len,
        total_train_samples=total_train_samples,
        tokenizer_path=tokenizer,
    )


__all__ = [
    "PreferenceDataModule",
    "PreferencePairDataset",
    "PreparedPairs",
    "build_preference_data",
    "collate_pairs",
    "stdlib_preference_records",
]
