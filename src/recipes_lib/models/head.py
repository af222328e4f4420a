"""The output head: the projection to the vocabulary, and its loss without the logits.

:class:`OutputHead` is an ``nn.Linear`` (its weight is ``output.weight``, as before)
whose forward also takes the labels. Given them it returns the loss instead of the
logits, computed inside its own forward so that whatever gathers a module's weights
around its forward (FSDP, hooks) gathers the head's for the loss as for the logits.
With a chunk size the projection is fused with the loss
(:func:`~recipes_lib.losses.chunked_cross_entropy`,
:func:`~recipes_lib.losses.linear_token_logprobs`): at most that many rows of logits
exist at once. Any other loss of the head (a distillation's) comes as ``fused``, a
function of the hidden states and the head's weight, called inside the forward too.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from recipes_lib.losses import (
    causal_lm_loss,
    chunked_cross_entropy,
    linear_token_logprobs,
    token_logprobs,
)


def head_loss(logits: Tensor, labels: Tensor, per_token: bool) -> Tensor:
    """The loss of materialised logits: the mean cross-entropy, or each label's log-prob."""
    return token_logprobs(logits, labels) if per_token else causal_lm_loss(logits, labels)


class OutputHead(nn.Linear):
    """``hidden @ weight.T``; with ``labels``, the loss of those logits instead.

    Args of :meth:`forward`:
        hidden: ``(..., D)`` final hidden states.
        labels: ``(...)`` target ids aligned with ``hidden``, -100 where nothing counts;
            None: return the logits ``(..., V)``.
        per_token: return each label's log-probability (fp32, 0 where ignored) rather
            than the mean cross-entropy over the counted labels (0-d).
        loss_chunk_size: rows of logits computed at once; None: all at once.
        fused: ``fused(hidden, weight)``, a loss of the head computed here instead
            (``labels`` is then not taken).
    """

    def forward(
        self,
        hidden: Tensor,
        labels: Tensor | None = None,
        *,
        per_token: bool = False,
        loss_chunk_size: int | None = None,
        fused: Callable[[Tensor, Tensor], Tensor] | None = None,
    ) -> Tensor:
        if fused is not None:
            return fused(hidden, self.weight)
        if labels is None:
            return super().forward(hidden)
        if labels.shape != hidden.shape[:-1]:
            raise ValueError(
                f"labels {tuple(labels.shape)} do not match hidden states {tuple(hidden.shape)}"
            )
        if loss_chunk_size is None:
            return head_loss(super().forward(hidden), labels, per_token)
        if self.bias is not None:
            raise ValueError("the fused head loss takes a head without a bias")
        flat_hidden, flat_labels = hidden.flatten(0, -2), labels.flatten()
        if per_token:
            out = linear_token_logprobs(flat_hidden, self.weight, flat_labels, loss_chunk_size)
            return out.view(labels.shape)
        return chunked_cross_entropy(flat_hidden, self.weight, flat_labels, loss_chunk_size)
