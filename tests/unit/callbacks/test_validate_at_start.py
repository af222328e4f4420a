"""ValidateAtStart: held-out figures of the starting weights, logged at step 0."""

import csv

import lightning as L
import torch
from callback_helpers import BATCH, SEQ_LEN, VOCAB, tiny_causal_lm
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from tiny import quiet_trainer
from torch.utils.data import DataLoader

from recipes_lib.callbacks import TokenProgressBar, ValidateAtStart
from recipes_lib.config.schema import SchedulerConfig
from recipes_lib.training import CausalLMModule

STEPS = 6


def tiny_module() -> CausalLMModule:
    return tiny_causal_lm(STEPS, SchedulerConfig(name="constant", warmup=0), lr=3e-2)


def loader(seed: int, n: int = 3) -> DataLoader:
    gen = torch.Generator().manual_seed(seed)
    repeated = torch.randint(0, VOCAB, (BATCH, SEQ_LEN + 1), generator=gen)  # learnable
    items = [{"input_ids": repeated[:, :-1], "labels": repeated[:, 1:]} for _ in range(n)]
    return DataLoader(items, batch_size=None)


def fit(tmp_path, version: int, max_steps: int, ckpt_path=None, **trainer_args):
    L.seed_everything(0)
    module = tiny_module()
    trainer = quiet_trainer(
        max_steps,
        [
            ValidateAtStart(),
            TokenProgressBar(plain=False),
            ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1),
        ],
        val_check_interval=3,
        log_every_n_steps=1,
        logger=CSVLogger(tmp_path, name="run", version=version),
        num_sanity_val_steps=0,
        **trainer_args,
    )
    trainer.fit(module, loader(0, 12), loader(0), ckpt_path=ckpt_path)
    with open(tmp_path / "run" / f"version_{version}" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    return trainer, [(int(r["step"]), float(r["val/loss"])) for r in rows if r.get("val/loss")]


def test_the_starting_weights_are_validated_at_step_0(tmp_path):
    trainer, val = fit(tmp_path, version=0, max_steps=STEPS)
    assert trainer.global_step == STEPS
    assert [step for step, _ in val] == [0, 2, 5]  # before the first step, then every 3
    assert val[0][1] > val[-1][1]  # the data is learnable: the start is the worst
    # no checkpoint was written for the validation before training
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*.ckpt")) == [
        "epoch=0-step=3.ckpt",
        "epoch=0-step=6.ckpt",
    ]


def test_a_resumed_run_is_not_validated_again_at_its_start(tmp_path):
    fit(tmp_path, version=0, max_steps=3)
    _, val = fit(
        tmp_path, version=1, max_steps=STEPS, ckpt_path=tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    )
    assert [step for step, _ in val] == [5]


def test_nothing_runs_without_validation(tmp_path):
    trainer, val = fit(tmp_path, version=0, max_steps=3, limit_val_batches=0)
    assert trainer.global_step == 3 and val == []


def test_validating_at_start_leaves_the_training_as_it_was(tmp_path):
    # it runs as Lightning's sanity check, widened for the run and put back afterwards
    weights = []
    for callbacks in ([ValidateAtStart()], []):
        L.seed_everything(0)
        module = tiny_module()
        trainer = quiet_trainer(3, callbacks, num_sanity_val_steps=0)
        trainer.fit(module, loader(0), loader(0))
        assert trainer.num_sanity_val_steps == 0
        weights.append([p.detach().clone() for p in module.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*weights, strict=True))
