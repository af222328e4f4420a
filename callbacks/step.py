"""A base for callbacks that act once after each optimizer step.

Lightning has no callback hook that runs after the optimizer step. ``on_before_optimizer_step``
runs before it, and ``on_train_batch_end`` runs after every batch, including the micro-batches
of gradient accumulation, after which the weights have not changed. What tells the two apart
is ``trainer.global_step``: it counts optimizer steps, so it has moved on at the end of exactly
those batches that ended in a step. :class:`OptimizerStepCallback` keeps that check in one
place, so that a callback such as the garbage collector or the weight average only says what it
does after a step.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback


class OptimizerStepCallback(Callback):
    """Calls :meth:`on_optimizer_step_end` once after each optimizer step.

    The call comes at the end of the training batch in which the optimizer stepped, once per
    value of ``trainer.global_step``; the micro-batches that only accumulate gradients get
    none. Steps are counted from where the fit starts, so a fit resumed from a checkpoint at
    step ``s`` calls it next with ``s + 1``, never again with ``s``.

    A subclass that also overrides ``on_train_start`` or ``on_train_batch_end`` calls
    ``super()`` there: those two hooks do the counting.
    """

    def __init__(self) -> None:
        self._last_step: int | None = None

    @property
    def last_step(self) -> int | None:
        """The optimizer step (``trainer.global_step``) seen last; None before training."""
        return self._last_step

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # the restored step when resuming: that step's work was done by the saving run
        self._last_step = trainer.global_step

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        step = trainer.global_step
        if step == self._last_step:
            return  # a micro-batch of gradient accumulation: no optimizer step
        self._last_step = step
        self.on_optimizer_step_end(trainer, pl_module, step)

    def on_optimizer_step_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, step: int
    ) -> None:
        """Called once after optimizer step ``step`` (``trainer.global_step``, from 1)."""
