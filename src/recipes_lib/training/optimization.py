"""The optimizer and learning-rate schedule a stage trains with, in Lightning's form,
and what happens to the gradients around each optimizer step.

The optimizer ``optim`` chooses (:func:`recipes_lib.optim.build_optimizer`), AdamW's
moments carried over from ``stage.init_from`` with ``stage.init_optimizer``, and the
run's schedule stepped once per optimizer step, its token lengths counted in the batch
ramp's steps (a rollback's lower learning rate is applied once the fit has restored its
checkpoint: :meth:`CausalLMModule.on_train_start`).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig
from torch import nn

from recipes_lib.checkpoint.weights import read_checkpoint
from recipes_lib.config.schema import OptimConfig, SchedulerConfig
from recipes_lib.errors import CheckpointError
from recipes_lib.optim import build_optimizer, build_scheduler
from recipes_lib.optim.batch_ramp import BatchSchedule
from recipes_lib.optim.moments import load_optimizer_moments
from recipes_lib.parallel.strategy import get_strategy


def configure_optimization(
    target: nn.Module,
    optim: OptimConfig,
    scheduler: SchedulerConfig,
    *,
    total_steps: int,
    tokens_per_step: int,
    batch_schedule: BatchSchedule | None = None,
    init_from: str | None = None,
    init_optimizer: bool = False,
) -> OptimizerLRSchedulerConfig:
    """What ``LightningModule.configure_optimizers`` returns for ``target``'s parameters.

    Raises:
        CheckpointError: ``init_from`` holds no optimizer state that fits (named).
    """
    optimizer = build_optimizer(target, optim)
    if init_optimizer and init_from is not None:
        label = f"stage.init_from={init_from!r}"
        try:
            checkpoint = read_checkpoint(init_from, mmap=False)  # the moments outlive it
        except CheckpointError as err:
            raise CheckpointError(f"{label}: {err}") from err
        # before the scheduler: it reads each group's initial_lr when it is built
        load_optimizer_moments(optimizer, checkpoint, label)
    schedule = build_scheduler(optimizer, scheduler, total_steps, tokens_per_step, batch_schedule)
    return {
        "optimizer": optimizer,
        "lr_scheduler": {"scheduler": schedule, "interval": "step", "frequency": 1},
    }


def free_gradients(optimizer: Any, strategy: str) -> None:
    """After an optimizer step, the gradients set to None at once. Lightning does it in
    the next step, after its forward pass (before the backward): until then a model's
    worth of gradients would sit beside that forward's activations, which is the peak of
    a full fine-tuning step. Where the strategy keeps them anyway
    (``StrategySpec.frees_gradients``), left to it."""
    if get_strategy(strategy).frees_gradients:
        optimizer.zero_grad(set_to_none=True)
