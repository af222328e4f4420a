"""Distillation losses between a teacher's and a student's next-token distributions.

Both distributions come from hidden states and output heads, a chunk of rows at a time
(:func:`chunked_distill_loss`): neither the teacher's nor the student's full ``(N, V)``
logits ever exist. With ``p`` the teacher's and ``q`` the student's distribution (both
at temperature ``T``: logits divided by ``T``, the loss scaled by ``T**2``):

- ``forward_kl``: ``KL(p || q) = sum_v p_v (log p_v - log q_v)``, the student covering
  the teacher's mass (Hinton et al. 2015's soft targets);
- ``jsd``: the generalised Jensen-Shannon divergence of Agarwal et al. 2024 (GKD):
  with ``m = beta * p + (1 - beta) * q``, ``beta * KL(p || m) + (1 - beta) * KL(q || m)``;
  ``beta`` near 0 behaves like the forward KL, near 1 like the reverse KL ``KL(q || p)``.

The loss is the mean over the rows that count (``mask``). Its gradient with respect to
each chunk of student logits is computed in the forward pass (by autograd on that one
chunk) and turned into the gradients of the student's hidden states and head weight
there, as :func:`~recipes_lib.losses.chunked_cross_entropy` does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from recipes_lib.losses.cross_entropy import (
    accumulate_product,
    head_grad_buffer,
    matmul_dtype,
    spend_saved_gradients,
)

DISTILL_LOSSES = ("forward_kl", "jsd")


def divergence(
    student_logits: Tensor, teacher_logits: Tensor, loss: str, beta: float, temperature: float
) -> Tensor:
    """Per-row divergence ``(C,)`` between two ``(C, V)`` blocks of logits (fp32)."""
    log_q = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_p = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    if loss == "forward_kl":
        per_row = (log_p.exp() * (log_p - log_q)).sum(-1)
    elif loss == "jsd":
        if beta <= 0.0:  # the limit: forward KL
            per_row = (log_p.exp() * (log_p - log_q)).sum(-1)
        elif beta >= 1.0:  # the limit: reverse KL
            per_row = (log_q.exp() * (log_q - log_p)).sum(-1)
        else:
            log_m = torch.logsumexp(
                torch.stack([log_p + math.log(beta), log_q + math.log(1.0 - beta)]), dim=0
            )
            kl_p = (log_p.exp() * (log_p - log_m)).sum(-1)
            kl_q = (log_q.exp() * (log_q - log_m)).sum(-1)
            per_row = beta * kl_p + (1.0 - beta) * kl_q
    else:
        raise ValueError(f"unknown distillation loss {loss!r}; choose one of {DISTILL_LOSSES}")
    return per_row * temperature**2


class _ChunkedDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, teacher_hidden, teacher_weight, mask, settings):
        chunk_size, loss_name, beta, temperature, with_grad = settings
        dtype = matmul_dtype(hidden, weight)
        w, tw = weight.to(dtype), teacher_weight.to(dtype)
        count = mask.sum().clamp(min=1).float()
        # under no_grad (evaluation) nothing is computed for a backward pass
        need_hidden, need_weight = (with_grad and need for need in ctx.needs_input_grad[:2])
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = head_grad_buffer(weight, need_weight)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        rows_counted = mask.nonzero().squeeze(1)  # only rows that count are computed
        for start in range(0, rows_counted.numel(), chunk_size):
            rows = rows_counted[start : start + chunk_size]
            h = hidden[rows].to(dtype)  # (C, D)
            with torch.no_grad():
                teacher = teacher_hidden[rows].to(dtype) @ tw.t()  # (C, V)
            if not (need_hidden or need_weight):  # evaluation
                student = (h @ w.t()).float()
                total += divergence(student, teacher, loss_name, beta, temperature).sum()
                continue
            with torch.enable_grad():
                student = (h @ w.t()).float().requires_grad_()  # (C, V)
                chunk = divergence(student, teacher, loss_name, beta, temperature).sum()
                (grad_logits,) = torch.autograd.grad(chunk, student)
            total += chunk.detach()
            grad_logits = (grad_logits / count).to(dtype)
            if grad_hidden is not None:
                grad_hidden[rows] = (grad_logits @ w).to(grad_hidden.dtype)
            if grad_weight is not None:
                accumulate_product(grad_weight, grad_logits.t(), h)
        ctx.save_for_backward(*[g for g in (grad_hidden, grad_weight) if g is not None])
        ctx.has = (grad_hidden is not None, grad_weight is not None)
        ctx.weight_dtype = weight.dtype
        return total / count

    @staticmethod
    def backward(ctx, grad_output):
        saved = spend_saved_gradients(ctx, grad_output, "chunked_distill_loss")
        grad_hidden = saved.pop(0) if ctx.has[0] else None
        grad_weight = saved.pop(0).to(ctx.weight_dtype) if ctx.has[1] else None
        return grad_hidden, grad_weight, None, None, None, None


def chunked_distill_loss(
    hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    mask: Tensor,
    *,
    loss: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk_size: int = 256,
) -> Tensor:
    """Mean divergence (see the module docstring) over the rows ``mask`` keeps.

    Args:
        hidden: ``(N, D)`` the student's final hidden states.
        weight: ``(V, D)`` the student's output head.
        teacher_hidden: ``(N, Dt)`` the teacher's final hidden states (no gradient).
        teacher_weight: ``(V, Dt)`` the teacher's output head (same vocabulary).
        mask: ``(N,)`` bool, the rows that count (assistant tokens in SFT data).
        loss: ``forward_kl`` or ``jsd``.
        beta: the JSD's interpolation weight, in ``[0, 1]``.
        temperature: both distributions' temperature (the loss is scaled by its square).
        chunk_size: rows of logits computed at once.

    Returns:
        The 0-d fp32 loss (0 when no row counts); its backward pass is a multiply.
    """
    if hidden.dim() != 2 or teacher_hidden.shape[0] != hidden.shape[0]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and teacher_hidden {tuple(teacher_hidden.shape)} "
            "must be (N, D) and (N, Dt)"
        )
    if weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(
            f"the student's vocabulary ({weight.shape[0]}) is not the teacher's "
            f"({teacher_weight.shape[0]})"
        )
    if loss not in DISTILL_LOSSES:
        raise ValueError(f"unknown distillation loss {loss!r}; choose one of {DISTILL_LOSSES}")
    if not 0.0 <= beta <= 1.0 or not temperature > 0 or chunk_size < 1:
        raise ValueError(
            f"beta={beta} must be in [0, 1], temperature={temperature} positive and "
            f"chunk_size={chunk_size} positive"
        )
    settings = (chunk_size, loss, beta, temperature, torch.is_grad_enabled())
    return _ChunkedDistill.apply(
        hidden, weight, teacher_hidden.detach(), teacher_weight.detach(), mask, settings
    )
