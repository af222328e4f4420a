"""The bookkeeping of a mixture of experts' training, per optimizer step: the tokens
each expert took (summed over the step's micro-batches and the ranks), logged as the
load balance of each layer, and the sigmoid router's balancing bias moved by them.

The counts are summed over every rank before the bias moves, so the bias stays the same
on every rank (it is a buffer, outside the optimizer). A step the guard skips still
moves it: the routing it saw happened.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor, nn

from recipes_lib.config.schema import ModelConfig
from recipes_lib.losses import IGNORE_INDEX
from recipes_lib.models.moe import load_metrics, moe_layers, moe_losses, take_expert_counts
from recipes_lib.parallel.collectives import summed_over_ranks


class ExpertLoad:
    """Counts the tokens per expert of a step's training forwards (:meth:`after_forward`)
    and, once per optimizer step (:meth:`step`), sums them over ranks, moves the router
    biases and returns the per-layer balance to log."""

    def __init__(self, config: ModelConfig):
        self.config, self.rate = config, config.moe_bias_update_rate
        self.counts: Tensor | None = None  # (MoE layers, E)

    def token_mask(self, batch: Mapping[str, Any]) -> Tensor | None:
        """The tokens of ``batch`` a mixture's balance loss, z-loss and load are taken
        over: all but padding (a chat batch's ``padding``, a pair batch's
        ``sequence_ids`` of -1). None for a dense model or a batch with no padding."""
        if not self.config.moe_experts:
            return None
        if "padding" in batch:
            return ~batch["padding"]
        if "sequence_ids" in batch:
            return batch["sequence_ids"] >= 0
        return None

    def rows_mask(self, labels: Tensor) -> Tensor | None:
        """:meth:`token_mask` of rows padded after their last label
        (:func:`up_to_last_label`), built from the rows themselves."""
        return up_to_last_label(labels) if self.config.moe_experts else None

    def after_forward(self, model: nn.Module) -> tuple[Tensor | None, dict[str, Tensor]]:
        """After a training forward: the auxiliary loss to add to the objective's and the
        metrics to log (:func:`~recipes_lib.models.moe.moe_losses`; None and none for a
        dense model), the forward's token counts added to the step's."""
        if not self.config.moe_experts:  # a dense model: nothing to look for
            return None, {}
        layers = moe_layers(model)
        counts = take_expert_counts(layers)
        if counts is not None:
            self.counts = counts if self.counts is None else self.counts + counts
        return moe_losses(layers, self.config)

    def step(self, model: nn.Module, strategy: Any) -> dict[str, Tensor]:
        """The step's ``moe/load_max_mean/L`` and ``moe/load_min_mean/L`` (``L`` counting
        the layers with experts), after moving each sigmoid router's bias."""
        if self.counts is None:
            return {}
        counts = summed_over_ranks(self.counts.float()) if strategy else self.counts
        self.counts = None
        if self.rate:
            for layer, layer_counts in zip(moe_layers(model), counts, strict=True):
                layer.update_bias(layer_counts, self.rate)
        return load_metrics(counts)


def up_to_last_label(labels: Tensor) -> Tensor:
    """``(R, L)`` True up to each row's last label (``labels`` not ``IGNORE_INDEX``
    there): the tokens of rows padded after their last label (GRPO's prompt +
    completion rows)."""
    return (labels != IGNORE_INDEX).flip(-1).cummax(-1).values.flip(-1)
