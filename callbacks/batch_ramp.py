"""Gradient accumulation that changes from one optimizer step to the next (a batch ramp).

Lightning accumulates a fixed ``trainer.accumulate_grad_batches`` micro-batches per step
and finds a step's edges by ``batch index % accumulate_grad_batches``. Under a ramp the
step sizes come from a schedule instead, and the callback makes the fit loop follow it:

- at each micro-batch ``trainer.accumulate_grad_batches`` is the size of the step it
  belongs to (Lightning divides each micro-batch's loss by it);
- a step ends after the micro-batch the schedule says ends it, and its gradients are
  zeroed at its first micro-batch (the epoch loop's ``_accumulated_batches_reached``
  and the automatic optimization's ``_make_zero_grad_fn``, replaced on this trainer's
  loops for this fit: Lightning has no public hook for either);
- validation every ``val_every`` optimizer steps falls at the end of a step.

The schedule is any object with ``accumulation(step)``, ``micro_batches_before(step)``,
``step_of(micro_batch)`` and ``ends_a_step(micro_batches)``
(``recipes_lib.optim.batch_ramp.BatchSchedule``). The positions it reads are the loops'
own progress counters, restored from checkpoints, so a run resumed mid-ramp goes on
with the same step sizes. Only for a run of one epoch (the library sizes the training
loader to the run's steps).
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

NEVER = 2**62  # a validation interval no batch index reaches


class BatchRamp(Callback):
    """Make the fit loop accumulate ``schedule.accumulation(step)`` micro-batches per step.

    Args:
        schedule: the step sizes (see the module docstring).
        val_every: optimizer steps between validations (``None``: none in the epoch).
    """

    def __init__(self, schedule: Any, val_every: int | None = None) -> None:
        self.schedule = schedule
        self.val_every = val_every

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        epoch_loop = trainer.fit_loop.epoch_loop
        schedule = self.schedule

        def accumulated_batches_reached() -> bool:
            return schedule.ends_a_step(epoch_loop.batch_progress.current.ready)

        optimization = epoch_loop.automatic_optimization

        def make_zero_grad_fn(batch_idx: int, optimizer: Any) -> Any:
            # Lightning's own, with the step's first micro-batch from the schedule
            if optimization._skip_backward:
                return None
            if schedule.micro_batches_before(schedule.step_of(batch_idx)) != batch_idx:
                return None

            def zero_grad_fn() -> None:
                optimization._on_before_zero_grad(optimizer)
                optimization._optimizer_zero_grad(batch_idx, optimizer)

            return zero_grad_fn

        # replaces two of Lightning's methods on these instances (see the module docstring)
        epoch_loop._accumulated_batches_reached = accumulated_batches_reached  # type: ignore[method-assign]
        optimization._make_zero_grad_fn = make_zero_grad_fn  # type: ignore[method-assign]

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        trainer.accumulate_grad_batches = self.schedule.accumulation(
            self.schedule.step_of(batch_idx)
        )

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if self.val_every is None:
            return
        # the loop checks (batch index + 1) % val_check_batch after this hook (the
        # interval it computed counts micro-batches of one size)
        ended = self.schedule.ends_a_step(batch_idx + 1)
        step = trainer.global_step
        due = ended and step > 0 and step % self.val_every == 0
        trainer.val_check_batch = batch_idx + 1 if due else NEVER
