"""Validation before the first training step: where a stage starts on held-out data."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import Callback


class ValidateAtStart(Callback):
    """Runs the validation loop once before the first optimizer step of a fresh run.

    A fine-tuning stage's first held-out figures then describe the weights it started
    from (logged at step 0, like any validation during training), so the first and last
    ``val/*`` values measure what the stage changed. A run resumed from a checkpoint
    (``ckpt_path``) validated at its start already, and skips it. Nothing runs when
    validation is off (``trainer.val_check_interval: null`` or no held-out data).
    """

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.ckpt_path is not None or trainer.sanity_checking:
            return
        if not trainer.limit_val_batches:
            return
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        # the order of the training loop's own mid-epoch validation: the active loop is
        # picked from the trainer's state, and the logger's first-iteration flag is kept
        connector = trainer._logger_connector
        first_loop_iter = connector._first_loop_iter
        trainer.validating = True
        try:
            val_loop.run()
        finally:
            trainer.training = True
            connector._first_loop_iter = first_loop_iter
