"""Optimizer-side monitors: gradient norm and learning rates."""

from __future__ import annotations

import math

import lightning as L
import torch
from torch import Tensor


def total_grad_norm(parameters, norm_type: float = 2.0) -> Tensor | None:
    """The norm of all gradients taken together, or None when no parameter has one.

    Sharded gradients (``DTensor``) are reduced over their shards, so every rank gets
    the norm of the full gradient.
    """
    norms = []
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        norm = torch.linalg.vector_norm(grad.detach(), norm_type, dtype=torch.float32)
        if hasattr(norm, "full_tensor"):  # DTensor
            norm = norm.full_tensor()
        norms.append(norm)
    if not norms:
        return None
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def is_logging_step(trainer: L.Trainer, step: int) -> bool:
    """Whether the trainer writes its logs for optimizer step ``step`` (counted from 1).

    ``step`` is the step the current training batch works toward:
    ``trainer.global_step + 1`` until the optimizer has stepped in this batch. The rule is
    Lightning's own (its logger connector's ``should_update_logs``, which is not public):
    every ``log_every_n_steps`` steps, and whenever the fit is about to stop.
    """
    # Lightning's logger connector sets Trainer.log_every_n_steps, undeclared on the class
    every = trainer.log_every_n_steps  # type: ignore[attr-defined]
    if every == 0:
        return False
    return step % every == 0 or trainer.should_stop


class GradNormMonitor(L.Callback):
    """Logs ``train/grad_norm`` and ``train/lr/<group>`` on the trainer's logging steps.

    The gradient norm is taken in ``on_before_optimizer_step``: after gradient
    accumulation and AMP unscaling, before gradient clipping, so it shows how much
    clipping cuts. A non-finite norm is logged as it is. Each parameter group's learning
    rate is logged under its ``"name"`` key (``decay`` / ``no_decay`` for optimizers
    from :func:`recipes_lib.optim.build_optimizer`), else under its index.

    Args:
        norm_type: Order of the norm (2.0: Euclidean; ``inf``: largest magnitude).
        log_lr: Also log the learning rate of each parameter group.
    """

    def __init__(self, norm_type: float = 2.0, log_lr: bool = True):
        super().__init__()
        self.norm_type = float(norm_type)
        self.log_lr = log_lr

    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # the optimizer is about to take step global_step + 1
        if not is_logging_step(trainer, trainer.global_step + 1):
            return  # the norm costs a pass over all gradients
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = total_grad_norm(params, self.norm_type)
        if norm is not None:
            pl_module.log("train/grad_norm", norm, on_step=True, on_epoch=False, batch_size=1)
        if not self.log_lr:
            return
        for index, group in enumerate(optimizer.param_groups):
            name = group.get("name", str(index))
            lr = float(group["lr"])
            if math.isfinite(lr):
                pl_module.log(f"train/lr/{name}", lr, on_step=True, on_epoch=False, batch_size=1)
