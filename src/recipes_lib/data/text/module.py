"""The pretraining LightningDataModule: packed sequences from cached shards, resumable."""

from __future__ import annotations

from torch.utils.data import ConcatDataset

from recipes_lib.config.schema import DataConfig
from recipes_lib.data.mixture import MixtureDataset
from recipes_lib.data.module import ResumableDataModule, check_batch_shape, rank_zero_warning
from recipes_lib.data.text.packing import PackedSequenceDataset
from recipes_lib.data.text.prepare import PreparedData, prepare
from recipes_lib.data.text.shards import TokenShard
from recipes_lib.data.tokenizer import check_vocab_fits, eos_token_id, load_tokenizer
from recipes_lib.errors import ConfigError


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
        check_batch_shape(config, model_max_seq_len)
        if config.tokenizer.path is None and config.tokenizer.vocab_size > model_vocab_size:
            raise ConfigError(
                f"data.tokenizer.vocab_size={config.tokenizer.vocab_size} exceeds "
                f"model.vocab_size={model_vocab_size}"
            )
        super().__init__(config, model_vocab_size, model_max_seq_len, total_train_samples)
        self.prepared: PreparedData | None = None
        self.eos_id: int | None = None

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
