"""The pretraining LightningDataModule: packed sequences from cached shards, resumable."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import lightning.pytorch as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from tokenizers import Tokenizer
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Sampler

from recipes_lib.config.schema import DataConfig
from recipes_lib.data.mixture import MixtureDataset
from recipes_lib.data.packing import PackedSequenceDataset
from recipes_lib.data.prepare import PreparedData, prepare
from recipes_lib.data.sampler import ResumableSampler
from recipes_lib.data.shards import TokenShard
from recipes_lib.data.tokenizer import (
    check_vocab_fits,
    eos_token_id,
    load_tokenizer,
    tokenizer_vocab_size,
)
from recipes_lib.errors import ConfigError

log = logging.getLogger(__name__)


@rank_zero_only
def rank_zero_warning(message: str) -> None:
    """Log ``message`` as a warning on global rank 0: one line in the run's log, not a
    Python warning with a source location."""
    log.warning(message)


def check_batch_shape(config: DataConfig, model_max_seq_len: int, *, min_seq_len: int = 1) -> None:
    """Raise :class:`ConfigError` unless ``min_seq_len <= data.seq_len <= model.max_seq_len``
    and ``data.batch_size >= 1``, naming the keys and their values."""
    if config.seq_len > model_max_seq_len:
        raise ConfigError(
            f"data.seq_len={config.seq_len} exceeds model.max_seq_len={model_max_seq_len}"
        )
    if config.seq_len < min_seq_len or config.batch_size < 1:
        raise ConfigError(
            f"data.seq_len must be >= {min_seq_len} and data.batch_size >= 1, got "
            f"data.seq_len={config.seq_len} and data.batch_size={config.batch_size}"
        )


class ResumableDataModule(L.LightningDataModule):
    """A data module whose training position is part of every checkpoint.

    The position is the number of training samples this rank has consumed, counted
    from optimizer steps (``global_step * accumulate_grad_batches * data.batch_size``),
    not from what the loader prefetched, so it is exact at every checkpoint. Subclasses
    keep ``self.config`` (a :class:`DataConfig`), ``self.train_dataset``,
    ``self.val_dataset`` and ``self.total_train_samples``, build them in an idempotent
    ``setup``, and override :meth:`collate_fn` where samples need their own collation;
    the loaders are built here.
    """

    config: DataConfig
    train_dataset: Dataset | None = None
    val_dataset: Dataset | None = None
    total_train_samples: int | None = None
    _consumed_samples: int = 0

    @property
    def consumed_samples(self) -> int:
        """Training samples this rank has consumed (from the trainer when attached)."""
        trainer = self.trainer
        if trainer is None:
            return self._consumed_samples
        return trainer.global_step * trainer.accumulate_grad_batches * self.config.batch_size

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._consumed_samples = int(state_dict["consumed_samples"])

    def _rank_and_world(self) -> tuple[int, int]:
        """This rank and the world size its samplers shard over (0, 1 without a Trainer).

        Raises:
            ConfigError: the Trainer would also shard the loaders (a distributed
                sampler), so each rank would see a share of its share.
        """
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        if trainer.world_size > 1 and getattr(
            getattr(trainer, "_accelerator_connector", None), "use_distributed_sampler", False
        ):
            raise ConfigError(
                f"{type(self).__name__} shards batches across ranks itself; build the Trainer "
                "with use_distributed_sampler=False"
            )
        return trainer.global_rank, trainer.world_size

    def train_sampler(self) -> ResumableSampler:
        """The seeded shuffle of ``train_dataset`` that this rank reads its share of,
        starting after the samples a restored checkpoint had consumed; its length is
        ``total_train_samples`` (None: one pass)."""
        rank, world_size = self._rank_and_world()
        return ResumableSampler(
            len(self.train_dataset),
            seed=self.config.seed,
            start=self._consumed_samples,
            rank=rank,
            world_size=world_size,
            length=self.total_train_samples,
        )

    def collate_fn(self) -> Callable | None:
        """How samples become a batch (None: torch's default collation)."""
        return None

    def skipped_records(self) -> dict[str, int]:
        """Records left out of training, by reason (for the run's summary); none here."""
        return {}

    def _loader(
        self, dataset: Dataset, sampler, *, cls: type[DataLoader] = DataLoader, **kwargs
    ) -> DataLoader:
        """A loader of ``data.batch_size`` batches of ``dataset`` drawn by ``sampler``."""
        workers = self.config.num_workers
        return cls(
            dataset,
            batch_size=self.config.batch_size,
            sampler=sampler,
            collate_fn=self.collate_fn(),
            # its own generator: creating an iterator must not draw from the global RNG,
            # whose state a resumed run restores
            generator=torch.Generator().manual_seed(self.config.seed),
            num_workers=workers,
            persistent_workers=workers > 0,
            pin_memory=torch.cuda.is_available(),
            **kwargs,
        )

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        return self._loader(
            self.train_dataset,
            self.train_sampler(),
            cls=ResumableDataLoader,
            drop_last=True,
            consumed_samples=lambda: self.consumed_samples,
        )

    def val_dataloader(self) -> DataLoader | list:
        """This rank's share of the held-out samples, in order (empty without any)."""
        self.setup("validate")
        if self.val_dataset is None:
            return []
        rank, world_size = self._rank_and_world()
        sampler = StridedSampler(len(self.val_dataset), rank, world_size)
        return self._loader(self.val_dataset, sampler)


class PretrainDataModule(ResumableDataModule):
    """Packed next-token batches over a weighted mixture of tokenized sources.

    Batches are ``{"input_ids": (B, T) int64, "labels": (B, T) int64, "doc_ids": (B, T)
    int32}`` with ``T = data.seq_len``. The training stream is an endless seeded shuffle
    that each rank reads a disjoint share of, and that resumes after the samples a
    checkpoint had consumed (see :meth:`state_dict`). Validation reads every source's
    held-out documents in a fixed order.

    The sampler shards across ranks itself, so a distributed Trainer must be built with
    ``use_distributed_sampler=False``.

    Args:
        config: the data configuration.
        model_vocab_size: ``model.vocab_size``; the tokenizer must fit in it.
        model_max_seq_len: ``model.max_seq_len``; ``data.seq_len`` must not exceed it.
        total_train_samples: the samples each rank draws over the run
            (``max_steps * accumulate_grad_batches * batch_size``); the length Lightning
            sees for the training loader. ``None``: one pass over the training data.

    Raises:
        ConfigError: ``data.seq_len`` longer than ``model.max_seq_len``, or a tokenizer
            vocabulary larger than ``model.vocab_size``.
    """

    def __init__(
        self,
        config: DataConfig,
        model_vocab_size: int,
        model_max_seq_len: int,
        total_train_samples: int | None = None,
    ) -> None:
        super().__init__()
        check_batch_shape(config, model_max_seq_len)
        if config.tokenizer.path is None and config.tokenizer.vocab_size > model_vocab_size:
            raise ConfigError(
                f"data.tokenizer.vocab_size={config.tokenizer.vocab_size} exceeds "
                f"model.vocab_size={model_vocab_size}"
            )
        self.config = config
        self.model_vocab_size = model_vocab_size
        self.model_max_seq_len = model_max_seq_len
        self.total_train_samples = total_train_samples
        # Only global rank 0 prepares; cache_dir must be shared by all nodes.
        self.prepare_data_per_node = False
        self.prepared: PreparedData | None = None
        self.tokenizer: Tokenizer | None = None
        self.eos_id: int | None = None
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self._consumed_samples = 0

    @property
    def vocab_size(self) -> int:
        """The embedding rows the tokenizer needs (its largest id plus one)."""
        if self.tokenizer is None:
            raise RuntimeError("call setup() before reading vocab_size")
        return tokenizer_vocab_size(self.tokenizer)

    def prepare_data(self) -> None:
        self.prepared = prepare(self.config, model_vocab_size=self.model_vocab_size)

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        if self.prepared is None:
            # Ranks other than 0 find rank 0's files in the cache (or wait for them).
            self.prepared = prepare(self.config, progress=False, quiet=True)
        prepared = self.prepared
        self.tokenizer = load_tokenizer(prepared.tokenizer_path)
        check_vocab_fits(self.tokenizer, self.model_vocab_size)
        self.eos_id = eos_token_id(self.tokenizer, self.config.tokenizer.eos_token)
        seq_len = self.config.seq_len
        train = {
            name: PackedSequenceDataset(TokenShard.open(path), seq_len)
            for name, path in prepared.train_shards.items()
        }
        if len(train) == 1:
            self.train_dataset = next(iter(train.values()))
        else:
            self.train_dataset = MixtureDataset(train, prepared.weights)
        val = []
        for name, path in prepared.val_shards.items():
            shard = TokenShard.open(path)
            if shard.n_tokens < seq_len + 1:
                if self.config.val_fraction > 0:
                    rank_zero_warning(
                        f"data.sources.{name}: {shard.n_tokens} held-out tokens are too few "
                        f"for one sequence of data.seq_len={seq_len}; not validating on it"
                    )
                continue
            val.append(PackedSequenceDataset(shard, seq_len))
        self.val_dataset = ConcatDataset(val) if val else None


class ResumableDataLoader(DataLoader):
    """A DataLoader over a :class:`ResumableSampler` that Lightning treats as resumable.

    Its state is the samples this rank has consumed; loading it moves the sampler there.
    (The position is exact because it is counted from optimizer steps, not from what the
    loader prefetched.) ``PretrainDataModule.load_state_dict`` restores the same position;
    this makes the loader itself resumable, so Lightning restores it mid-epoch too.
    """

    sampler: ResumableSampler

    def __init__(self, *args, consumed_samples: Callable[[], int] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._consumed_samples = consumed_samples

    def state_dict(self) -> dict[str, int]:
        if self._consumed_samples is None:
            return {"consumed_samples": self.sampler.position}
        return {"consumed_samples": self._consumed_samples()}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.sampler.position = int(state_dict["consumed_samples"])


class StridedSampler(Sampler[int]):
    """Rank ``r`` reads ``r, r + world_size, ...`` in order, padded by wrapping so every
    rank reads the same number of items (ranks must run the same number of steps)."""

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1) -> None:
        self.num_samples = num_samples
        self.rank = rank
        self.world_size = world_size
        self.length = -(-num_samples // world_size)

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[int]:
        for k in range(self.length):
            yield (self.rank + k * self.world_size) % self.num_samples
