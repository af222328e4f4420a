"""Validation before the first training step: where a stage starts on held-out data."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Callback
from torch import Tensor


class ValidateAtStart(Callback):
    """Validates the starting weights of a fresh run on all of its held-out data.

    A fine-tuning stage's first held-out figures then describe the weights it started
    from (logged at step 0, like any validation during training), so the first and last
    ``val/*`` values measure what the stage changed. A run resumed from a checkpoint
    (``ckpt_path``) validated at its start already, and skips it. Nothing runs when
    validation is off (``trainer.val_check_interval: null`` or no held-out data).

    Lightning's one validation before training is its sanity check, which runs the
    module's own validation loop and hooks before the first step (the random number
    generators kept as they were). This callback widens it to every held-out batch
    (``trainer.num_sanity_val_steps``, as ``-1`` does) and sends the figures it reached
    to the loggers at step 0, which a sanity check does not do. The setting is put
    back once the check has run.
    """

    def __init__(self) -> None:
        self._kept_sanity_steps: int | float | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._kept_sanity_steps = None
        if trainer.ckpt_path is not None or not trainer.limit_val_batches:
            return
        self._kept_sanity_steps = trainer.num_sanity_val_steps
        trainer.num_sanity_val_steps = float("inf")  # every batch, as -1 asks

    def on_sanity_check_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._kept_sanity_steps is None:
            return
        trainer.num_sanity_val_steps = self._kept_sanity_steps
        self._kept_sanity_steps = None
        # what the validation loop logged (epoch figures), as it logs them after training
        # steps: the loop's logged metrics and the epoch, at step 0
        metrics: dict[str, float] = {
            name: value.item() if isinstance(value, Tensor) else value
            for name, value in trainer.logged_metrics.items()
        }
        if not metrics:
            return
        metrics.setdefault("epoch", trainer.current_epoch)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=0)
            logger.save()
