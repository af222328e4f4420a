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
        # Lightning has no public "validate now" inside fit, so this runs the loop the fit
        # runs mid-epoch (public attributes only), as the training loop does: the trainer's
        # state picks the active loop. The training loop also saves and restores its
        # logger's first-batch flag around it; that flag is unset (None) until the first
        # training batch, and the validation loop leaves it unset, so nothing needs keeping.
        trainer.validating = True
        try:
            trainer.fit_loop.epoch_loop.val_loop.run()
        finally:
            trainer.training = True
