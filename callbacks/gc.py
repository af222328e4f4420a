"""Python's garbage collector run at fixed steps instead of whenever it triggers.

The cyclic collector starts on its own after enough allocations; its full collections
stop the training loop for tens to hundreds of milliseconds. With several processes
that each decide on their own, the ranks pause at different steps, and because every
step ends in a collective, each rank's pause holds all the others up: one process's
collection costs every GPU the same time. FSDP's per-step Python objects (one
``DTensor`` per parameter and gradient) make these pauses larger and more frequent.

:class:`GarbageCollection` turns the automatic collector off for the fit and collects
at the same steps on every rank instead, so the pauses line up. It turns the collector
back on when the fit ends or fails.
"""

from __future__ import annotations

import gc

import lightning as L

from recipes_lib.callbacks.step import OptimizerStepCallback


class GarbageCollection(OptimizerStepCallback):
    """Collects garbage every ``every_n_steps`` optimizer steps, on every rank at once.

    Args:
        every_n_steps: Optimizer steps between collections (at least 1).
        generation: The oldest generation collected at those steps (0, 1 or 2). The
            default, 1, frees the short-lived cycles a training step makes without
            walking every long-lived object.

    A full collection runs once when training starts, after the model and optimizer
    are built (or restored).
    """

    def __init__(self, every_n_steps: int = 50, generation: int = 1):
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps={every_n_steps} must be at least 1")
        if generation not in (0, 1, 2):
            raise ValueError(f"generation={generation} must be 0, 1 or 2")
        super().__init__()
        self.every_n_steps = int(every_n_steps)
        self.generation = int(generation)
        self.collected_at: list[int] = []  # the optimizer steps it collected at
        self._was_enabled: bool | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._was_enabled = gc.isenabled()
        gc.disable()
        self.collected_at = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        gc.collect()  # what building the model and optimizer (or restoring) left behind

    def on_optimizer_step_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, step: int
    ) -> None:
        if step % self.every_n_steps != 0:
            return
        gc.collect(self.generation)
        self.collected_at.append(step)

    def _restore(self) -> None:
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._restore()
