"""Online RL objectives: GRPO's group-normalised advantages and its clipped objective.

For each prompt, ``k`` completions are sampled and scored; a completion's advantage is
its reward against its group's (:func:`group_advantages`). The policy then maximises
the PPO-style clipped surrogate per completion token (:func:`grpo_loss`), with the
probability ratio ``pi / pi_old`` to the policy that sampled, optionally minus ``beta``
times an estimate of ``KL(pi || pi_ref)`` to a frozen reference (Schulman's ``k3``:
``exp(ref - logp) - (ref - logp) - 1``, non-negative and unbiased).

The per-token terms are averaged by ``loss_norm``:

- ``sequence``: over each completion's tokens, then over completions (GRPO's paper);
- ``token``: over every completion token of the batch (DAPO);
- ``dr_grpo``: summed and divided by ``completions * max_new_tokens``, a constant, so no
  completion's tokens weigh more for being short (Dr. GRPO); with
  ``scale_rewards=False`` in :func:`group_advantages`, as Dr. GRPO pairs them.

Every average is built from each completion's sums (of its terms, tokens and clipped
tokens), so a completion split over the ranks of a context-parallel group gives the
whole completion's loss once ``across`` adds up the ranks' sums.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

LOSS_NORMS = ("sequence", "token", "dr_grpo")


def group_advantages(
    rewards: Tensor, group_size: int, scale: bool = True, eps: float = 1e-4
) -> Tensor:
    """``(N,)`` advantages of ``(N,)`` rewards in consecutive groups of ``group_size``:
    each minus its group's mean, divided by the group's standard deviation (``+ eps``)
    when ``scale``. A group whose completions scored alike gives zeros."""
    if rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.float().view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale and group_size > 1:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    return centred.flatten()


def grpo_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    ref_logps: Tensor | None = None,
    kl_coef: float = 0.0,
    loss_norm: str = "sequence",
    max_new_tokens: int | None = None,
    across: Callable[[Tensor], Tensor] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The clipped GRPO objective to minimise, and its diagnostics.

    Args:
        logps: ``(N, T)`` log-probs of the completion tokens under the policy (with
            gradient); positions outside ``mask`` are ignored.
        old_logps: ``(N, T)`` the same under the policy that sampled them.
        advantages: ``(N,)`` each completion's advantage.
        mask: ``(N, T)`` bool: the completion tokens.
        clip_low, clip_high: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``
            (``clip_high`` None: ``clip_low``).
        ref_logps: ``(N, T)`` the reference's log-probs, for the KL term.
        kl_coef: ``beta``, the KL term's weight (0: none).
        loss_norm: ``sequence`` | ``token`` | ``dr_grpo`` (module docstring).
        max_new_tokens: the completions' token limit (``dr_grpo``'s constant).
        across: adds up ``(N,)`` per-completion sums over the ranks that each hold a
            share of every completion's tokens (context parallelism), keeping each
            rank's own gradient; None: the tensors hold whole completions.

    Returns:
        The loss (0-d) and ``clip_fraction`` (the share of tokens whose ratio was clipped
        where it mattered) and ``kl`` (the mean estimate; 0 without a reference).
    """
    if loss_norm not in LOSS_NORMS:
        raise ValueError(f"loss_norm={loss_norm!r}: choose one of {list(LOSS_NORMS)}")
    if kl_coef and ref_logps is None:
        raise ValueError("kl_coef > 0 needs the reference's log-probs")
    high = clip_low if clip_high is None else clip_high
    mask = mask.to(logps.dtype)
    ratio = torch.exp(logps - old_logps)
    adv = advantages.to(logps.dtype)[:, None]  # (N, 1)
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)  # (N, T)
    kl = torch.zeros((), device=logps.device)
    if ref_logps is not None:
        delta = ref_logps - logps
        estimate = torch.exp(delta) - delta - 1  # k3, >= 0
        if kl_coef:
            per_token = per_token + kl_coef * estimate
    total = across if across is not None else (lambda sums: sums)
    sums = total((per_token * mask).sum(dim=1))  # (N,) each completion's terms
    counted = total(mask.sum(dim=1).detach())  # (N,) and its tokens
    tokens = counted.sum().clamp(min=1)
    if loss_norm == "sequence":
        loss = (sums / counted.clamp(min=1)).mean()
    elif loss_norm == "token":
        loss = sums.sum() / tokens
    else:
        if max_new_tokens is None:
            raise ValueError("loss_norm='dr_grpo' needs max_new_tokens")
        loss = sums.sum() / (logps.shape[0] * max_new_tokens)
    with torch.no_grad():
        was_clipped = ((ratio < 1 - clip_low) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))
        clip_fraction = total((was_clipped.to(mask.dtype) * mask).sum(dim=1)).sum() / tokens
        if ref_logps is not None:
            kl = total((estimate * mask).sum(dim=1)).sum() / tokens
    return loss, {"clip_fraction": clip_fraction, "kl": kl.detach()}
