"""The data-module base of every pipeline: a training position that every checkpoint keeps.

:class:`ResumableDataModule` builds the loaders of pretraining, SFT and preference data
alike: a seeded, resumable shuffle for training (:class:`ResumableDataLoader`), and for
validation each rank's strided share in order (:class:`StridedSampler`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sized
from pathlib import Path
from typing import Any, Protocol, cast

import lightning.pytorch as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from tokenizers import Tokenizer
from torch.utils.data import DataLoader, Dataset, Sampler

from recipes_lib.config.schema import DataConfig
from recipes_lib.data.sampler import ResumableSampler
from recipes_lib.data.tokenizer import tokenizer_vocab_size
from recipes_lib.errors import ConfigError

log = logging.getLogger(__name__)


def dataset_length(dataset: Dataset | None, name: str) -> int:
    """The length of a dataset that ``setup`` built: every dataset here is map-style and
    has one, which torch's ``Dataset`` does not declare."""
    if dataset is None:
        raise RuntimeError(f"call setup() before reading {name}")
    return len(cast(Sized, dataset))


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


class Prepared(Protocol):
    """What a data module prepared: the tokenizer it saved and one fingerprint of its data."""

    @property
    def tokenizer_path(self) -> Path: ...

    @property
    def fingerprint(self) -> str: ...


class ResumableDataModule(L.LightningDataModule):
    """A data module whose training position is part of every checkpoint.

    The position is the number of training samples this rank has consumed, counted
    from optimizer steps (``global_step * accumulate_grad_batches * data.batch_size``,
    or the micro-batches of ``batch_schedule``'s steps under a batch ramp), not from what
    the loader prefetched, so it is exact at every checkpoint. Subclasses
    build ``self.tokenizer``, ``self.train_dataset`` and ``self.val_dataset`` in an
    idempotent ``setup``, and override :meth:`collate_fn` where samples need their own
    collation; the loaders are built here.

    Args:
        config: the data configuration.
        model_vocab_size: ``model.vocab_size``; the tokenizer must fit in it.
        model_max_seq_len: ``model.max_seq_len``; ``data.seq_len`` must not exceed it.
        total_train_samples: the samples each rank draws over the run (the training
            loader's length); ``None``: one pass over the training data.
    """

    prepared: Prepared | None  # set by each subclass (None until prepared)

    def __init__(
        self,
        config: DataConfig,
        model_vocab_size: int,
        model_max_seq_len: int,
        total_train_samples: int | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.model_vocab_size = model_vocab_size
        self.model_max_seq_len = model_max_seq_len
        self.total_train_samples = total_train_samples
        # Only global rank 0 prepares (tokenizes, trains a tokenizer), so data.cache_dir
        # must be shared by all nodes.
        self.prepare_data_per_node = False
        self.tokenizer: Tokenizer | None = None
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self._consumed_samples = 0
        # samples moved past without training on them (a rollback's skipped window):
        # restored from checkpoints, plus what the run asks to skip on top of them
        self.sample_offset = 0
        self._skip_on_restore = 0
        self._skipped_on_restore = 0  # what the last restore added, for the loader's state
        # micro-batches per optimizer step when they vary (recipes_lib.optim.batch_ramp);
        # None: trainer.accumulate_grad_batches each
        self.batch_schedule: Any = None
        self.group_steps = False  # the loader yields each optimizer step's micro-batches

    @property
    def vocab_size(self) -> int:
        """The embedding rows the tokenizer needs (its largest id plus one)."""
        if self.tokenizer is None:
            raise RuntimeError("call setup() before reading vocab_size")
        return tokenizer_vocab_size(self.tokenizer)

    @property
    def consumed_samples(self) -> int:
        """This rank's position in its stream of training samples: what it trained on
        (from the trainer's optimizer steps when attached) plus what it moved past."""
        trainer = self.trainer
        if trainer is None:
            return self._consumed_samples
        return self.micro_batches_before(trainer.global_step) * self.config.batch_size + (
            self.sample_offset
        )

    def micro_batches_before(self, step: int) -> int:
        """Micro-batches this rank trains on before optimizer step ``step``."""
        if self.batch_schedule is not None:
            return self.batch_schedule.micro_batches_before(step)
        if self.trainer is None:
            raise RuntimeError("micro_batches_before needs a trainer or a batch_schedule")
        return step * self.trainer.accumulate_grad_batches

    def skip_samples(self, count: int) -> None:
        """Move ``count`` samples further on when the run resumes from a checkpoint (a
        rollback's window of batches), on top of where the checkpoint stood."""
        self._skip_on_restore += count

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": self.consumed_samples, "sample_offset": self.sample_offset}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        # checkpoints written before samples could be skipped have no sample_offset
        skip, self._skip_on_restore = self._skip_on_restore, 0
        self._skipped_on_restore = skip
        self.sample_offset = int(state_dict.get("sample_offset", 0)) + skip
        self._consumed_samples = int(state_dict["consumed_samples"]) + skip

    def _rank_and_world(self) -> tuple[int, int]:
        """This rank and the world size its samplers shard over (0, 1 without a Trainer).

        The Trainer must not shard the loaders a second time: it is built with
        ``use_distributed_sampler=False`` (as :func:`recipes_lib.assembly.build_trainer`
        builds every Trainer of a run). That is not checked here: Lightning keeps the
        flag in a private attribute and offers no public way to read it back.
        """
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        # the ranks of a context-parallel group share their rows (recipes_lib.parallel.context)
        degree = getattr(getattr(trainer, "strategy", None), "context_parallel", 1)
        return trainer.global_rank // degree, trainer.world_size // degree

    def train_sampler(self) -> ResumableSampler:
        """The seeded shuffle of ``train_dataset`` that this rank reads its share of,
        starting after the samples a restored checkpoint had consumed; its length is
        ``total_train_samples`` (None: one pass)."""
        rank, world_size = self._rank_and_world()
        return self.make_sampler(
            dataset_length(self.train_dataset, "train_dataset"),
            seed=self.config.seed,
            start=self._consumed_samples,
            rank=rank,
            world_size=world_size,
            length=self.total_train_samples,
        )

    def make_sampler(self, num_samples: int, **kwargs: Any) -> ResumableSampler:
        """The training sampler of :meth:`train_sampler`'s arguments (a subclass may
        draw its stream otherwise)."""
        return ResumableSampler(num_samples, **kwargs)

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

    def train_dataloader(self) -> DataLoader | StepBatches:
        self.setup("fit")
        if self.train_dataset is None:
            raise RuntimeError("setup('fit') built no train_dataset")
        loader = self._loader(
            self.train_dataset,
            self.train_sampler(),
            cls=ResumableDataLoader,
            drop_last=True,
            consumed_samples=lambda: self.consumed_samples,
            restored_position=lambda saved: saved + self._skipped_on_restore,
        )
        assert isinstance(loader, ResumableDataLoader)
        if not self.group_steps or self.batch_schedule is None:
            return loader

        def first_step() -> int:  # the step a fit (a resumed one too) starts at
            return self.trainer.global_step if self.trainer is not None else 0

        return StepBatches(loader, self.batch_schedule, first_step)

    def val_dataloader(self) -> DataLoader | list:
        """This rank's share of the held-out samples, in order (empty without any)."""
        self.setup("validate")
        if self.val_dataset is None:
            return []
        rank, world_size = self._rank_and_world()
        sampler = StridedSampler(dataset_length(self.val_dataset, "val_dataset"), rank, world_size)
        return self._loader(self.val_dataset, sampler)


class ResumableDataLoader(DataLoader):
    """A DataLoader over a :class:`ResumableSampler` that Lightning treats as resumable.

    Its state is the samples this rank has consumed; loading it moves the sampler there.
    (The position is exact because it is counted from optimizer steps, not from what the
    loader prefetched.) ``ResumableDataModule.load_state_dict`` restores the same position;
    this makes the loader itself resumable, so Lightning restores it mid-epoch too.
    """

    sampler: ResumableSampler

    def __init__(
        self,
        *args,
        consumed_samples: Callable[[], int] | None = None,
        restored_position: Callable[[int], int] | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._consumed_samples = consumed_samples
        self._restored_position = restored_position

    def state_dict(self) -> dict[str, int]:
        if self._consumed_samples is None:
            return {"consumed_samples": self.sampler.position}
        return {"consumed_samples": self._consumed_samples()}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        position = int(state_dict["consumed_samples"])
        if self._restored_position is not None:  # plus what the run moves past (a rollback)
            position = self._restored_position(position)
        self.sampler.position = position


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


class StepBatches:
    """The micro-batches of one optimizer step at a time, as a list: ``schedule.accumulation(s)``
    of ``loader``'s batches for step ``s``, counted from the step a fit starts at."""

    def __init__(self, loader: ResumableDataLoader, schedule: Any, first_step: Callable[[], int]):
        self.loader = loader
        self.schedule = schedule
        self.first_step = first_step

    def __len__(self) -> int:
        micro = len(self.loader)
        return self.schedule.step_of(micro) if micro else 0

    def __iter__(self) -> Iterator[list[Any]]:
        step = self.first_step()
        micro_batches = iter(self.loader)
        while True:
            group = []
            for _ in range(self.schedule.accumulation(step)):
                try:
                    group.append(next(micro_batches))
                except StopIteration:
                    return
            yield group
            step += 1

    def state_dict(self) -> dict[str, int]:
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.loader.load_state_dict(state_dict)
