from types import SimpleNamespace

import lightning.pytorch as L
import pytest
import torch
from data_helpers import data_config, synthetic_documents, write_jsonl
from lightning.pytorch.callbacks import ModelCheckpoint
from tiny import quiet_trainer

from recipes_lib.config.schema import SourceConfig
from recipes_lib.data.mixture import MixtureDataset
from recipes_lib.data.text.module import PretrainDataModule
from recipes_lib.errors import ConfigError

SEQ_LEN, BATCH = 32, 4


@pytest.fixture(scope="module")
def shard_cache(tmp_path_factory):
    """One data cache for the module: the stdlib sample is tokenized into shards once,
    and each test's data module reads them (a source a test adds gets its own)."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture()
def config(shard_cache, stdlib_jsonl, small_tokenizer_path):
    sources = {"code": SourceConfig(path=str(stdlib_jsonl))}
    return data_config(
        shard_cache, sources, small_tokenizer_path, seq_len=SEQ_LEN, batch_size=BATCH
    )


def ready(config, **kwargs) -> PretrainDataModule:
    module = PretrainDataModule(config, model_vocab_size=512, model_max_seq_len=64, **kwargs)
    module.prepare_data()
    module.setup("fit")
    return module


def fake_trainer(rank=0, world_size=1, global_step=0, accumulate=1):
    return SimpleNamespace(
        global_rank=rank,
        world_size=world_size,
        global_step=global_step,
        accumulate_grad_batches=accumulate,
    )


def test_batches_follow_the_batch_contract(config):
    module = ready(config, total_train_samples=40)
    assert module.eos_id == 0 and module.vocab_size == 512
    assert module.tokenizer.token_to_id("<|endoftext|>") == 0
    loader = module.train_dataloader()
    assert len(loader) == 40 // BATCH
    batch = next(iter(loader))
    assert batch["input_ids"].shape == batch["labels"].shape == (BATCH, SEQ_LEN)
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    assert batch["doc_ids"].dtype == torch.int32 and batch["doc_ids"].shape == (BATCH, SEQ_LEN)
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])
    assert int(batch["input_ids"].max()) < 512


def test_validation_is_fixed_and_sharded_evenly(config):
    module = ready(config)
    first = [b["input_ids"] for b in module.val_dataloader()]
    again = [b["input_ids"] for b in module.val_dataloader()]
    assert len(first) >= 2 and all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    n = len(module.val_dataset)
    assert torch.equal(first[0][0], module.val_dataset[0]["input_ids"])  # in order
    counts = []
    for rank in range(3):
        module.trainer = fake_trainer(rank=rank, world_size=3)
        counts.append(sum(len(b["input_ids"]) for b in module.val_dataloader()))
    assert counts == [-(-n // 3)] * 3


def test_ranks_draw_disjoint_training_samples(config):
    module = ready(config)
    drawn = []
    for rank in range(2):
        module.trainer = fake_trainer(rank=rank, world_size=2)
        sampler = module.train_dataloader().sampler
        assert (sampler.rank, sampler.world_size) == (rank, 2)
        iterator = iter(sampler)
        drawn.append({next(iterator) for _ in range(50)})
    assert not drawn[0] & drawn[1]


def test_state_dict_counts_consumed_samples_and_resumes_the_stream(config):
    module = ready(config)
    module.trainer = fake_trainer(global_step=5, accumulate=2)
    state = module.state_dict()
    assert state == {"consumed_samples": 5 * 2 * BATCH, "sample_offset": 0}
    full = iter(module.train_dataloader())
    uninterrupted = [next(full)["input_ids"] for _ in range(14)]

    resumed = ready(config)
    resumed.load_state_dict(state)
    tail = iter(resumed.train_dataloader())
    for expected in uninterrupted[10:]:
        assert torch.equal(next(tail)["input_ids"], expected)


def test_several_sources_are_mixed(config, tmp_path):
    chat = write_jsonl(tmp_path / "chat.jsonl", synthetic_documents(300))
    config.sources = {**config.sources, "chat": SourceConfig(path=str(chat), weight=0.5)}
    module = ready(config)
    assert isinstance(module.train_dataset, MixtureDataset)
    assert module.train_dataset.names == ["code", "chat"]
    assert len(module.val_dataset.datasets) == 2


def test_seq_len_longer_than_model_context(config):
    config.seq_len = 128
    with pytest.raises(ConfigError, match=r"data\.seq_len=128.*model\.max_seq_len=64"):
        PretrainDataModule(config, model_vocab_size=512, model_max_seq_len=64)


def test_tokenizer_vocab_larger_than_model(config):
    with pytest.raises(ConfigError, match=r"512 tokens.*model\.vocab_size=400"):
        PretrainDataModule(config, model_vocab_size=400, model_max_seq_len=64).prepare_data()
    config.tokenizer.path = None
    with pytest.raises(ConfigError, match=r"data\.tokenizer\.vocab_size=512.*vocab_size=400"):
        PretrainDataModule(config, model_vocab_size=400, model_max_seq_len=64)


class BatchRecorder(L.LightningModule):
    """Records every training batch it is given; learns nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"].clone())
        return (self.weight * batch["input_ids"].float().mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def fit(config, max_steps, ckpt_dir=None, ckpt_path=None) -> list[torch.Tensor]:
    module = PretrainDataModule(config, 512, 64, total_train_samples=max_steps * 2 * BATCH)
    callbacks = []
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1))
    trainer = quiet_trainer(max_steps, callbacks, accumulate_grad_batches=2, limit_val_batches=0)
    recorder = BatchRecorder()
    trainer.fit(recorder, datamodule=module, ckpt_path=ckpt_path)
    return recorder.seen


def test_lightning_resume_continues_the_train_stream(config, tmp_path):
    uninterrupted = fit(config, max_steps=6)
    assert len(uninterrupted) == 12
    first_half = fit(config, max_steps=3, ckpt_dir=tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(first_half, uninterrupted[:6], strict=True))
    (checkpoint,) = (tmp_path / "ckpt").glob("*.ckpt")
    saved = torch.load(checkpoint, weights_only=False)
    assert saved["PretrainDataModule"] == {"consumed_samples": 3 * 2 * BATCH, "sample_offset": 0}
    # the train loader is resumable too, so Lightning restores it mid-epoch without warning
    loader_states = saved["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert loader_states == [{"consumed_samples": 3 * 2 * BATCH}]
    second_half = fit(config, max_steps=6, ckpt_path=str(checkpoint))
    assert len(second_half) == 6
    assert all(torch.equal(a, b) for a, b in zip(second_half, uninterrupted[6:], strict=True))
