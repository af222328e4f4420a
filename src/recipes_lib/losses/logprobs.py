"""Per-token log-probabilities, from logits or fused with the output projection.

:func:`token_logprobs` reads logits that exist already and upcasts one block of rows
at a time to fp32. :func:`linear_token_logprobs` takes the final hidden states and the
output weight instead and never holds more than one ``(chunk_size, V)`` block of logits:
the forward pass keeps each row's log-normaliser, and the backward pass rebuilds the
logits block by block to form the gradients of the hidden states and of the weight.
That costs one more head matmul than materialising the logits, and saves the
``(N, V)`` logits, their fp32 copy and their gradient: for a 128k vocabulary and 16k
tokens, several GiB. Every objective that reads log-probabilities of its labels
(preference losses, KTO, policy gradients) uses it through the model's fused head
(:meth:`recipes_lib.models.Transformer.forward` with ``labels``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from recipes_lib.losses.cross_entropy import (
    IGNORE_INDEX,
    accumulate_product,
    head_grad_buffer,
    matmul_dtype,
)

LOGPROB_CHUNK_ROWS = 1024  # rows of logits upcast to fp32 at once


class _LinearTokenLogProbs(torch.autograd.Function):
    """``log softmax(hidden @ weight.T)[label]`` per row, one block of logits at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, valid, chunk_size):
        dtype = matmul_dtype(hidden, weight)
        w = weight.to(dtype)
        n_rows = hidden.size(0)
        out = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
        log_normalizer = torch.empty_like(out)
        for start in range(0, n_rows, chunk_size):
            rows = slice(start, start + chunk_size)
            logits = (hidden[rows].to(dtype) @ w.t()).float()  # (C, V)
            log_normalizer[rows] = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, labels[rows].unsqueeze(1)).squeeze(1)
            out[rows] = target - log_normalizer[rows]
        ctx.save_for_backward(hidden, weight, labels, valid, log_normalizer)
        ctx.dtype, ctx.chunk_size = dtype, chunk_size
        return out * valid

    @staticmethod
    def backward(ctx, grad_output):
        hidden, weight, labels, valid, log_normalizer = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        dtype, chunk_size = ctx.dtype, ctx.chunk_size
        w = weight.to(dtype)
        scale = grad_output.float() * valid  # (N,)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = head_grad_buffer(weight, need_weight)
        for start in range(0, hidden.size(0), chunk_size):
            rows = slice(start, start + chunk_size)
            h = hidden[rows].to(dtype)  # (C, D)
            # d logp[label] / d logits = one_hot(label) - softmax(logits), times the row's grad
            block = (h @ w.t()).float()  # (C, V)
            block.sub_(log_normalizer[rows].unsqueeze(1)).exp_()
            block.mul_(-scale[rows].unsqueeze(1))
            block.scatter_add_(1, labels[rows].unsqueeze(1), scale[rows].unsqueeze(1))
            block = block.to(dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = (block @ w).to(hidden.dtype)  # (C, D)
            if grad_weight is not None:
                accumulate_product(grad_weight, block.t(), h)  # (V, D)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def linear_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    chunk_size: int = LOGPROB_CHUNK_ROWS,
    ignore_index: int = IGNORE_INDEX,
) -> Tensor:
    """Log-probability of each label under ``softmax(hidden @ weight.T)``, fp32, 0 where
    the label is ``ignore_index``, without the full logits.

    Equal to ``token_logprobs(hidden @ weight.T, labels)``, gradients included, with at
    most a ``(chunk_size, V)`` block of logits alive (see the module's docstring).

    Args:
        hidden: ``(N, D)`` final hidden states (after the last norm).
        weight: ``(V, D)`` output projection weight.
        labels: ``(N,)`` target ids aligned with ``hidden``.
        chunk_size: rows of logits computed at once.
        ignore_index: label value that contributes nothing.

    Returns:
        ``(N,)`` float32 log-probabilities.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(
            "linear_token_logprobs expects hidden (N, D), weight (V, D) and labels (N,), got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)} and {tuple(labels.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    valid = labels != ignore_index
    safe_labels = labels.masked_fill(~valid, 0)
    return _LinearTokenLogProbs.apply(hidden, weight, safe_labels, valid, chunk_size)


class _TokenLogProbs(torch.autograd.Function):
    """``log softmax(logits)[label]`` per row, fp32, with an fp32 copy of one block at a time."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, valid: Tensor, chunk_rows: int) -> Tensor:
        n_rows = logits.size(0)
        log_normalizer = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        for start in range(0, n_rows, chunk_rows):
            rows = slice(start, start + chunk_rows)
            log_normalizer[rows] = torch.logsumexp(logits[rows].float(), dim=-1)
        target = logits.gather(1, labels.unsqueeze(1)).squeeze(1).float()  # (N,)
        ctx.save_for_backward(logits, labels, valid, log_normalizer)
        ctx.chunk_rows = chunk_rows
        return (target - log_normalizer) * valid

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        logits, labels, valid, log_normalizer = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        scale = grad_output.float() * valid  # (N,)
        grad_logits = torch.empty_like(logits)
        chunk_rows = ctx.chunk_rows
        for start in range(0, logits.size(0), chunk_rows):
            rows = slice(start, start + chunk_rows)
            # d logp[label] / d logits = one_hot(label) - softmax(logits)
            block = logits[rows].to(torch.float32, copy=True)  # never in place on the saved logits
            block.sub_(log_normalizer[rows].unsqueeze(1)).exp_()
            block.mul_(-scale[rows].unsqueeze(1))
            block.scatter_add_(1, labels[rows].unsqueeze(1), scale[rows].unsqueeze(1))
            grad_logits[rows] = block.to(logits.dtype)
        return grad_logits, None, None, None


def token_logprobs(
    logits: Tensor,
    labels: Tensor,
    ignore_index: int = IGNORE_INDEX,
    chunk_rows: int = LOGPROB_CHUNK_ROWS,
) -> Tensor:
    """Log-probability of each label token, fp32, 0 where the label is ``ignore_index``.

    Labels are aligned with the logits (``labels[..., t]`` follows position ``t``).

    Args:
        logits: ``(..., V)`` scores in any floating dtype.
        labels: ``(...)`` target ids, ``ignore_index`` where nothing counts.
        ignore_index: label value that contributes nothing.
        chunk_rows: rows of logits upcast to fp32 at once.

    Returns:
        ``(...)`` float32 log-probabilities.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} do not match"
        )
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    flat_logits = logits.reshape(-1, logits.size(-1))  # (N, V)
    flat_labels = labels.reshape(-1)
    valid = flat_labels != ignore_index
    safe_labels = flat_labels.masked_fill(~valid, 0)
    out = _TokenLogProbs.apply(flat_logits, safe_labels, valid, chunk_rows)
    return out.view(labels.shape)


def sequence_logprobs(
    logits: Tensor,
    labels: Tensor,
    ignore_index: int = IGNORE_INDEX,
    chunk_rows: int = LOGPROB_CHUNK_ROWS,
) -> Tensor:
    """Summed log-probability of each row's non-ignored label tokens, fp32.

    Args:
        logits: ``(B, T, V)`` scores.
        labels: ``(B, T)`` next-token ids, ``ignore_index`` on prompt and padding tokens.
        ignore_index: label value that contributes nothing.
        chunk_rows: rows of logits upcast to fp32 at once.

    Returns:
        ``(B,)`` float32: ``sum_t log p(labels[b, t] | logits[b, t])`` over counted tokens.
    """
    return token_logprobs(logits, labels, ignore_index, chunk_rows).sum(dim=-1)
