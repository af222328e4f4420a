"""Next-token cross-entropy, in full and in row chunks.

:func:`chunked_cross_entropy` fuses the output projection with the loss: it never holds
the full ``(N, V)`` logits, only one ``(chunk_size, V)`` block at a time, and computes the
gradients with respect to the hidden states and the projection weight in the same pass.
For a 128k vocabulary and 16k tokens per micro-batch that is the difference between
8 GiB of fp32 logits (plus as much again for their gradient) and a few hundred MiB.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100
DEFAULT_CHUNK_SIZE = 4096


def causal_lm_loss(logits: Tensor, labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Mean cross-entropy over the tokens whose label is not ``ignore_index``.

    Labels are already aligned with the logits (``labels[..., t]`` is the token that
    follows position ``t``); no shift happens here. Logits are upcast to fp32. A batch
    whose labels are all ignored gives a loss of 0 (with a gradient of 0), not NaN.

    Args:
        logits: ``(..., V)`` scores.
        labels: ``(...)`` target token ids, ``ignore_index`` where no loss applies.
        ignore_index: Label value that contributes nothing.
    """
    vocab_size = logits.size(-1)
    flat_labels = labels.reshape(-1)
    loss_sum = F.cross_entropy(
        logits.reshape(-1, vocab_size).float(),
        flat_labels,
        ignore_index=ignore_index,
        reduction="sum",
    )
    n_tokens = (flat_labels != ignore_index).sum().clamp(min=1)
    return loss_sum / n_tokens


def matmul_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype ``hidden @ weight.T`` runs in here: autocast's when it is on."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def head_grad_buffer(weight: Tensor, needed: bool) -> Tensor | None:
    """An fp32 zero ``(V, D)`` buffer for the head weight's gradient, or None when the
    weight takes none (a frozen head under LoRA)."""
    if not needed:
        return None
    return torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)


def spend_saved_gradients(ctx, grad_output: Tensor, name: str) -> list[Tensor]:
    """The gradients a fused loss saved in its forward pass, scaled by ``grad_output``
    in place, so no second copy of a ``(V, D)`` gradient exists at once. They are then
    spent: a second backward pass over the graph is refused."""
    if getattr(ctx, "spent", False):
        raise RuntimeError(f"{name}'s graph can be backpropagated once")
    ctx.spent = True
    return [g.mul_(grad_output.to(g.dtype)) for g in ctx.saved_tensors]


def accumulate_product(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` into an fp32 ``acc``, without rounding a low-precision product
    to its inputs' dtype first (on CUDA the product is accumulated in fp32 by the
    matmul itself; elsewhere the inputs are upcast). Summing chunk products rounded to
    bf16 would bias a weight gradient that is the sum of many chunks."""
    if a.dtype == acc.dtype and b.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    if acc.is_cuda:
        try:
            torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except (RuntimeError, TypeError):  # a build without mixed-dtype matmuls
            pass
    acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _chunk_loss_and_logit_grad(
    hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, with_grad: bool
) -> tuple[Tensor, Tensor | None]:
    """Summed loss of one row chunk and, if asked, d(summed loss)/d(logits) in fp32."""
    logits = (hidden @ weight.t()).float()  # (C, V)
    valid = labels != ignore_index  # (C,)
    safe_labels = labels.masked_fill(~valid, 0)
    log_normalizer = torch.logsumexp(logits, dim=-1)  # (C,)
    target_logits = logits.gather(1, safe_labels.unsqueeze(1)).squeeze(1)  # (C,)
    loss_sum = ((log_normalizer - target_logits) * valid).sum()
    if not with_grad:
        return loss_sum, None
    # d loss / d logits = softmax - one_hot(label), zero on ignored rows; reuse the buffer.
    grad_logits = logits.sub_(log_normalizer.unsqueeze(1)).exp_()  # (C, V)
    grad_logits.scatter_add_(
        1, safe_labels.unsqueeze(1), torch.full_like(target_logits, -1.0).unsqueeze(1)
    )
    grad_logits.mul_(valid.unsqueeze(1))
    return loss_sum, grad_logits


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Loss and both input gradients computed chunk by chunk in the forward pass."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, ignore_index, reduction):
        if reduction == "mean":
            scale = 1.0 / (labels != ignore_index).sum().clamp(min=1).float()
        else:
            scale = torch.ones((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = head_grad_buffer(weight, ctx.needs_input_grad[1])
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        dtype = matmul_dtype(hidden, weight)  # autocast's, cast once for every chunk
        w = weight.to(dtype)
        for start in range(0, hidden.size(0), chunk_size):
            rows = slice(start, start + chunk_size)
            hidden_chunk = hidden[rows].to(dtype)  # (C, D)
            chunk_loss, grad_logits = _chunk_loss_and_logit_grad(
                hidden_chunk, w, labels[rows], ignore_index, with_grad=True
            )
            loss += chunk_loss
            assert grad_logits is not None  # asked for with_grad
            grad_logits = grad_logits.mul_(scale).to(dtype)  # (C, V)
            grad_hidden[rows] = (grad_logits @ w).to(grad_hidden.dtype)  # (C, D)
            if grad_weight is not None:
                accumulate_product(grad_weight, grad_logits.t(), hidden_chunk)  # (V, D)
        if grad_weight is None:
            ctx.save_for_backward(grad_hidden)
        else:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return loss * scale

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, *weight_part = spend_saved_gradients(ctx, grad_output, "chunked_cross_entropy")
        grad_weight = weight_part[0] if weight_part else None
        return grad_hidden, grad_weight, None, None, None, None


def chunked_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    ignore_index: int = IGNORE_INDEX,
    reduction: str = "mean",
) -> Tensor:
    """Cross-entropy of ``hidden @ weight.T`` against ``labels`` without the full logits.

    Equal to ``causal_lm_loss(hidden @ weight.T, labels)`` (``reduction="mean"``) or its
    sum over tokens (``"sum"``), with the same gradients, but only a
    ``(chunk_size, V)`` block of fp32 logits exists at any time. When gradients are
    needed they are computed during the forward pass and kept (``hidden``- and
    ``weight``-sized), so the backward pass is a multiply.

    Args:
        hidden: ``(N, D)`` final hidden states (after the last norm).
        weight: ``(V, D)`` output projection weight.
        labels: ``(N,)`` target ids, ``ignore_index`` where no loss applies.
        chunk_size: Rows of logits computed at once.
        ignore_index: Label value that contributes nothing.
        reduction: ``mean`` over non-ignored tokens (0 when there are none) or ``sum``.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError(
            "chunked_cross_entropy expects hidden (N, D), weight (V, D) and labels (N,), got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)} and {tuple(labels.shape)}"
        )
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if needs_grad:
        return _ChunkedCrossEntropy.apply(
            hidden, weight, labels, chunk_size, ignore_index, reduction
        )
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.size(0), chunk_size):
        rows = slice(start, start + chunk_size)
        chunk_loss, _ = _chunk_loss_and_logit_grad(
            hidden[rows], weight, labels[rows], ignore_index, with_grad=False
        )
        loss += chunk_loss
    if reduction == "mean":
        loss = loss / (labels != ignore_index).sum().clamp(min=1)
    return loss
