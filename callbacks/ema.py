"""An exponential moving average of a module's weights, kept beside training.

After each optimizer step ``ema = decay * ema + (1 - decay) * weight`` for every
trainable parameter, in fp32 on the parameter's device. The averages are part of the
callback's checkpoint state, so a resumed run continues them exactly where the saved
run stood. :meth:`WeightEMA.averaged_state_dict` gives a module's state dict with its
parameters replaced by their averages (buffers as they are), ready to save or load.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from torch import Tensor, nn
from torch.optim.swa_utils import get_ema_multi_avg_fn

from recipes_lib.callbacks.step import OptimizerStepCallback


class WeightEMA(OptimizerStepCallback):
    """Keeps an exponential moving average of the LightningModule's trainable weights.

    Args:
        decay: Weight of the running average at each update, in ``(0, 1)``; the average
            spans roughly the last ``1 / (1 - decay)`` optimizer steps.

    The average starts from the weights at the start of training (or from the state a
    resumed checkpoint holds) and is updated once per optimizer step, so gradient
    accumulation does not change its time scale.
    """

    def __init__(self, decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay={decay} must lie strictly between 0 and 1")
        super().__init__()
        self.decay = float(decay)
        self.updates = 0  # optimizer steps folded into the average
        self._averages: dict[str, Tensor] | None = None  # parameter name -> fp32 average
        self._name_of: dict[int, str] = {}  # id(parameter) -> its name in _averages

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        params = dict(pl_module.named_parameters())
        self._name_of = {id(params[name]): name for name in params if params[name].requires_grad}
        if self._averages is None:
            self._averages = {
                name: p.detach().to(torch.float32, copy=True)
                for name, p in params.items()
                if p.requires_grad
            }
            return
        # restored from a checkpoint: check it fits, then move it next to the weights
        missing = sorted(
            n for n, p in params.items() if p.requires_grad and n not in self._averages
        )
        unexpected = sorted(set(self._averages) - set(params))
        if missing or unexpected:
            raise RuntimeError(
                f"the checkpointed weight average does not fit the module: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        self._averages = {
            name: avg.to(device=params[name].device, dtype=torch.float32)
            for name, avg in self._averages.items()
        }

    @torch.no_grad()
    def on_optimizer_step_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, step: int
    ) -> None:
        if self._averages is None:
            return
        params = dict(pl_module.named_parameters())
        averages = list(self._averages.values())
        weights = [params[name].detach().to(torch.float32) for name in self._averages]
        # torch's own EMA step: one fused lerp over all tensors (built here, not kept: a
        # closure would make the callback unpicklable)
        get_ema_multi_avg_fn(self.decay)(averages, weights, self.updates)
        self.updates += 1

    # ------------------------------------------------------------ the average
    def averaged_state_dict(self, module: nn.Module) -> dict[str, Tensor]:
        """``module.state_dict()`` with each averaged parameter replaced by its average.

        ``module`` is the LightningModule the callback trained with or any submodule of
        it (e.g. its ``model``): parameters are matched by identity, so a tied weight
        keeps one average under each of its names.
        """
        if self._averages is None or not self._name_of:
            raise RuntimeError("no weight average yet: it starts with training")
        return {
            name: self._averages[self._name_of[id(value)]]
            if id(value) in self._name_of
            else value.detach()
            for name, value in module.state_dict(keep_vars=True).items()
        }

    # ------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        averages = None
        if self._averages is not None:
            averages = {name: t.detach().cpu().clone() for name, t in self._averages.items()}
        # "last_step" stays in the format that checkpoints have always had
        return {
            "decay": self.decay,
            "updates": self.updates,
            "last_step": self.last_step,
            "averages": averages,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The average carries over; from here on it decays at this callback's own rate.
        # "last_step" is not read back: the saving run had folded in every step up to the
        # checkpoint's, which is where the step count restarts (OptimizerStepCallback).
        self.updates = int(state_dict["updates"])
        self._averages = state_dict["averages"]
