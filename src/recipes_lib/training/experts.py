"""The bookkeeping of a mixture of experts' training: after each training forward, the
auxiliary losses to add (:func:`moe_losses`); per optimizer step, the tokens each expert
took (summed over the step's micro-batches and the ranks), logged as the load balance of
each layer, and the sigmoid router's balancing bias moved by them.

The balance loss is the whole batch's under data parallelism: each expert's share of
the tokens (which takes no gradient) is summed over every rank by one all-reduce for all
layers, and each rank's mean router probabilities meet it, so the gradients that data
parallelism averages are those of one process on the whole batch. The counts are summed
over every rank before the bias moves, so the bias stays the same on every rank (it is a
buffer, outside the optimizer). A step the guard skips still moves it: the routing it
saw happened.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from recipes_lib.config.schema import ModelConfig
from recipes_lib.losses import IGNORE_INDEX
from recipes_lib.models.moe import MoEFeedForward, balance_loss, moe_layers
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
        metrics to log (:func:`moe_losses`; None and none for a
        dense model), the forward's token counts added to the step's."""
        if not self.config.moe_experts:  # a dense model: nothing to look for
            return None, {}
        layers = moe_layers(model)
        losses = moe_losses(layers, self.config, summed_over_ranks)
        counts = take_expert_counts(layers)
        if counts is not None:
            self.counts = counts if self.counts is None else self.counts + counts
        return losses

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


def moe_losses(
    layers: list[MoEFeedForward],
    config: ModelConfig,
    summed: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor | None, dict[str, Tensor]]:
    """After a training forward of a model's mixture ``layers`` (:func:`moe_layers`): the
    auxiliary loss to add to the objective's (``moe_aux_loss_coef`` times the mean
    balance loss of the layers plus ``moe_z_loss_coef`` times their mean z-loss; None
    for a dense model or outside training) and the two means to log. With ``summed``
    (the sum over ranks), each expert's share of the tokens is the whole batch's."""
    # a training forward sets the three together: a layer lacking one has none
    counts = [m.expert_counts for m in layers if m.expert_counts is not None]
    mean_probs = [m.mean_probs for m in layers if m.mean_probs is not None]
    z_losses = [m.z_loss for m in layers if m.z_loss is not None]
    if not layers or not len(layers) == len(counts) == len(mean_probs) == len(z_losses):
        for m in layers:
            m.z_loss = m.mean_probs = None
        return None, {}
    # (layers, E + 1): the counts and the tokens, summed over the ranks at once
    rows = [torch.cat([c.float(), _tokens(m, c)]) for m, c in zip(layers, counts, strict=True)]
    shares = torch.stack(rows)
    if summed is not None:
        shares = summed(shares)
    probs = torch.stack(mean_probs)
    balance = balance_loss(shares[:, :-1], shares[:, -1:], probs, config.moe_experts).mean()
    z = torch.stack(z_losses).mean()
    for m in layers:
        m.z_loss = m.mean_probs = None
    aux = config.moe_aux_loss_coef * balance + config.moe_z_loss_coef * z
    return aux, {"moe_balance_loss": balance.detach(), "moe_z_loss": z.detach()}


def _tokens(layer: MoEFeedForward, counts: Tensor) -> Tensor:
    """A layer's routed tokens as a one-element float row beside its expert ``counts``."""
    device = counts.device
    return torch.as_tensor(layer.routed_tokens, dtype=torch.float32, device=device).reshape(1)


def take_expert_counts(layers: list[MoEFeedForward]) -> Tensor | None:
    """Tokens per expert of each layer's last training forward, ``(layers, E)``, or None."""
    counts = [m.expert_counts for m in layers if m.expert_counts is not None]
    if not counts or len(counts) < len(layers):
        return None
    for m in layers:
        m.expert_counts = None
    return torch.stack(counts)


def load_metrics(counts: Tensor) -> dict[str, Tensor]:
    """Per-layer balance of ``(layers, E)`` token counts: ``moe/load_max_mean/L`` (the
    busiest expert's tokens over the mean: 1 when balanced) and
    ``moe/load_min_mean/L``."""
    counts = counts.float()
    mean = counts.mean(-1).clamp_min(1e-9)
    out = {}
    for layer, (top, low, avg) in enumerate(
        zip(counts.max(-1).values, counts.min(-1).values, mean, strict=True)
    ):
        out[f"moe/load_max_mean/{layer}"] = top / avg
        out[f"moe/load_min_mean/{layer}"] = low / avg
    return out


def up_to_last_label(labels: Tensor) -> Tensor:
    """``(R, L)`` True up to each row's last label (``labels`` not ``IGNORE_INDEX``
    there): the tokens of rows padded after their last label (GRPO's prompt +
    completion rows)."""
    return (labels != IGNORE_INDEX).flip(-1).cummax(-1).values.flip(-1)
