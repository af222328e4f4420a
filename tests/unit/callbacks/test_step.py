"""OptimizerStepCallback: one call after each optimizer step, never for a micro-batch."""

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from tiny import quiet_trainer
from torch.utils.data import DataLoader

from recipes_lib.callbacks.step import OptimizerStepCallback


class StepRecorder(OptimizerStepCallback):
    """Records each call: the step, the batch it ended, and whether the weights moved."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[int, int]] = []  # (step, batch_idx of the batch it ended)
        self.moved: list[bool] = []
        self._batch_idx = -1
        self._weights: torch.Tensor | None = None

    def on_train_start(self, trainer, pl_module):
        super().on_train_start(trainer, pl_module)
        self._weights = pl_module.layer.weight.detach().clone()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._batch_idx = batch_idx
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_optimizer_step_end(self, trainer, pl_module, step):
        assert step == trainer.global_step
        self.calls.append((step, self._batch_idx))
        weights = pl_module.layer.weight.detach().clone()
        self.moved.append(not torch.equal(weights, self._weights))
        self._weights = weights


def fit(max_steps, accumulate, callbacks, ckpt_path=None, root=None):
    L.seed_everything(0)
    trainer = quiet_trainer(
        max_steps, callbacks, accumulate_grad_batches=accumulate, default_root_dir=root
    )
    # 64 batches per epoch: more than any run here takes, so no epoch boundary interferes
    trainer.fit(BoringModel(), DataLoader(RandomDataset(32, 64), batch_size=1), ckpt_path=ckpt_path)
    return trainer


@pytest.mark.parametrize("accumulate", [1, 3])
def test_called_once_after_each_optimizer_step(accumulate):
    recorder = StepRecorder()
    fit(4, accumulate, [recorder])
    # after the last micro-batch of each step, with the step already taken
    assert recorder.calls == [(s, s * accumulate - 1) for s in range(1, 5)]
    assert recorder.moved == [True] * 4
    assert recorder.last_step == 4


def test_a_resumed_fit_counts_on_from_its_restored_step(tmp_path):
    saver = ModelCheckpoint(
        tmp_path, "step{step}", every_n_train_steps=3, auto_insert_metric_name=False
    )
    first = StepRecorder()
    fit(3, 2, [first, saver], root=tmp_path)
    assert [step for step, _ in first.calls] == [1, 2, 3]

    resumed = StepRecorder()
    fit(6, 2, [resumed], ckpt_path=tmp_path / "step3.ckpt", root=tmp_path)
    assert [step for step, _ in resumed.calls] == [4, 5, 6]  # step 3 is not repeated
    assert resumed.moved == [True] * 3


def test_no_call_before_training():
    assert OptimizerStepCallback().last_step is None
