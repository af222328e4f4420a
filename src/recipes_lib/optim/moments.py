"""Starting an optimizer from another run's moments (``stage.init_optimizer``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from recipes_lib.errors import CheckpointError


def load_optimizer_moments(
    optimizer: torch.optim.Optimizer, checkpoint: Mapping[str, Any], label: str
) -> torch.optim.Optimizer:
    """Load the per-parameter state (AdamW moments and step counts) of a Lightning
    checkpoint (as loaded) into ``optimizer``, keeping ``optimizer``'s own
    hyperparameters; ``label`` names the checkpoint in errors.

    Every group's ``lr``, ``initial_lr``, betas, epsilon and weight decay stay as the
    new run configured them, so a schedule built afterwards starts from the new peak
    learning rate instead of where the earlier run left off.

    Raises:
        CheckpointError: the checkpoint holds no optimizer state, or its groups or
            moment shapes do not match ``optimizer``.
    """
    saved_states = checkpoint.get("optimizer_states") or []
    if len(saved_states) != 1:
        raise CheckpointError(
            f"{label} holds {len(saved_states)} optimizer states; stage.init_optimizer=true "
            "needs a Lightning checkpoint of a run with one optimizer"
        )
    saved = saved_states[0]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved_sizes = [len(g["params"]) for g in saved["param_groups"]]
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    if saved_sizes != sizes:
        raise CheckpointError(
            f"{label}: its optimizer has parameter groups of sizes {saved_sizes}, this run's "
            f"has {sizes} (a different model or optim.decay_embeddings)"
        )
    index_order = [i for g in saved["param_groups"] for i in g["params"]]
    for position, (index, param) in enumerate(zip(index_order, params, strict=True)):
        moment = saved["state"].get(index, {}).get("exp_avg")
        if moment is not None and tuple(moment.shape) != tuple(param.shape):
            raise CheckpointError(
                f"{label}: optimizer state of parameter {position} has shape "
                f"{tuple(moment.shape)}, the parameter {tuple(param.shape)}"
            )
    configured = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, settings in zip(optimizer.param_groups, configured, strict=True):
        group.update(settings)
        group["initial_lr"] = settings["lr"]
    return optimizer
