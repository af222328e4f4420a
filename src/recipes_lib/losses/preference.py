"""Preference-optimisation losses on summed per-sequence log-probabilities.

Each loss compares how much more the policy prefers the chosen response over the
rejected one than the frozen reference does. With ``pc, pr`` the policy's summed
log-probabilities of the chosen and rejected responses and ``rc, rr`` the reference's,
the log-ratio margin is ``h = (pc - rc) - (pr - rr)`` and

- ``sigmoid`` (DPO, Rafailov et al. 2023): ``-log sigmoid(beta * h)``;
- ``ipo`` (Azar et al. 2023): ``(h - 1 / (2 * beta)) ** 2``;
- ``hinge`` (SLiC, Zhao et al. 2023): ``relu(1 - beta * h)``.

Every loss returns ``(loss, chosen_rewards, rejected_rewards)``: the batch mean of the
per-pair losses and the implicit rewards ``beta * (pc - rc)`` and ``beta * (pr - rr)``
(detached, one per pair) that the stage logs.

Two losses need no reference model. With ``ac, ar`` the policy's mean log-probability
per response token (``pc / nc``, ``pr / nr``):

- ``simpo`` (Meng et al. 2024): ``-log sigmoid(beta * (ac - ar) - gamma)``, rewards
  ``beta * ac`` and ``beta * ar``;
- ``orpo`` (Hong et al. 2024): the chosen responses' negative log-likelihood per token
  plus ``beta`` times ``-log sigmoid(log odds(ac) - log odds(ar))``, where ``log odds(a)
  = a - log(1 - exp(a))``; rewards ``beta * ac`` and ``beta * ar``.

:data:`PREFERENCE_LOSSES` holds each loss as a :class:`PreferenceLoss`, called with the
pairs' :class:`PairLogps`, which says whether it needs the reference's log-probs.

:func:`sequence_logprobs` turns logits and next-token labels into those sums in fp32
without holding an fp32 copy of the whole ``(B, T, V)`` logits: the log-normaliser is
computed a block of rows at a time, and the backward pass rebuilds the softmax block by
block from the saved (low-precision) logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from recipes_lib.losses.cross_entropy import IGNORE_INDEX

LOGPROB_CHUNK_ROWS = 1024  # rows of logits upcast to fp32 at once

LossOutput = tuple[Tensor, Tensor, Tensor]


def _log_ratios(
    policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor
) -> tuple[Tensor, Tensor]:
    chosen = policy_chosen.float() - ref_chosen.float()
    rejected = policy_rejected.float() - ref_rejected.float()
    return chosen, rejected


def _check_beta(beta: float) -> None:
    if not beta > 0:
        raise ValueError(f"beta must be positive, got {beta}")


def dpo_sigmoid_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float,
) -> LossOutput:
    """DPO: ``mean(-log sigmoid(beta * ((pc - rc) - (pr - rr))))``.

    Args:
        policy_chosen: ``(P,)`` summed log-probs of the chosen responses under the policy.
        policy_rejected: ``(P,)`` the same for the rejected responses.
        ref_chosen: ``(P,)`` summed log-probs of the chosen responses under the reference.
        ref_rejected: ``(P,)`` the same for the rejected responses.
        beta: the inverse temperature (strength of the pull towards the reference).

    Returns:
        The mean loss and the per-pair chosen and rejected rewards (detached).
    """
    _check_beta(beta)
    chosen, rejected = _log_ratios(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    losses = -F.logsigmoid(beta * (chosen - rejected))  # (P,)
    return losses.mean(), beta * chosen.detach(), beta * rejected.detach()


def ipo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float,
) -> LossOutput:
    """IPO: ``mean(((pc - rc) - (pr - rr) - 1 / (2 * beta)) ** 2)``.

    The margin is regressed to ``1 / (2 * beta)`` instead of pushed without bound, so
    the policy cannot drift arbitrarily far from the reference on pairs it already
    ranks correctly. Arguments and returns as in :func:`dpo_sigmoid_loss`.
    """
    _check_beta(beta)
    chosen, rejected = _log_ratios(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    losses = (chosen - rejected - 1.0 / (2.0 * beta)) ** 2  # (P,)
    return losses.mean(), beta * chosen.detach(), beta * rejected.detach()


def hinge_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float,
) -> LossOutput:
    """Hinge (SLiC): ``mean(relu(1 - beta * ((pc - rc) - (pr - rr))))``.

    Pairs whose scaled margin already exceeds 1 contribute nothing. Arguments and
    returns as in :func:`dpo_sigmoid_loss`.
    """
    _check_beta(beta)
    chosen, rejected = _log_ratios(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    losses = torch.relu(1.0 - beta * (chosen - rejected))  # (P,)
    return losses.mean(), beta * chosen.detach(), beta * rejected.detach()


def simpo_loss(chosen_mean: Tensor, rejected_mean: Tensor, beta: float, gamma: float) -> LossOutput:
    """SimPO: ``mean(-log sigmoid(beta * (ac - ar) - gamma))`` on the policy's mean
    log-probs per response token (``(P,)`` each); no reference. Returns the mean loss and
    the rewards ``beta * ac``, ``beta * ar`` (detached)."""
    _check_beta(beta)
    chosen, rejected = chosen_mean.float(), rejected_mean.float()
    losses = -F.logsigmoid(beta * (chosen - rejected) - gamma)  # (P,)
    return losses.mean(), beta * chosen.detach(), beta * rejected.detach()


def _log_odds(mean_logp: Tensor) -> Tensor:
    """``log(p / (1 - p))`` of ``p = exp(mean_logp)``, stable for ``mean_logp`` near 0."""
    return mean_logp - torch.log(-torch.expm1(mean_logp.clamp(max=-1e-6)))


def orpo_loss(
    chosen_mean: Tensor, rejected_mean: Tensor, chosen_nll: Tensor, beta: float
) -> LossOutput:
    """ORPO: ``chosen_nll + beta * mean(-log sigmoid(log odds(ac) - log odds(ar)))``.

    Args:
        chosen_mean: ``(P,)`` the policy's mean log-prob per chosen response token.
        rejected_mean: ``(P,)`` the same for the rejected responses.
        chosen_nll: the chosen responses' negative log-likelihood per token (0-d): the
            supervised term ORPO adds.
        beta: the weight of the odds-ratio term (ORPO's lambda).

    Returns:
        The loss and the rewards ``beta * ac``, ``beta * ar`` (detached).
    """
    _check_beta(beta)
    chosen, rejected = chosen_mean.float(), rejected_mean.float()
    ratio = -F.logsigmoid(_log_odds(chosen) - _log_odds(rejected))  # (P,)
    loss = chosen_nll.float() + beta * ratio.mean()
    return loss, beta * chosen.detach(), beta * rejected.detach()


@dataclass(frozen=True)
class PairLogps:
    """What a preference loss reads of a batch of ``P`` pairs (column 0 the chosen
    response, column 1 the rejected one).

    Attributes:
        policy: ``(P, 2)`` the policy's summed response log-probs.
        tokens: ``(P, 2)`` the response tokens counted in each sum.
        reference: ``(P, 2)`` the reference's summed log-probs, or None.
    """

    policy: Tensor
    tokens: Tensor
    reference: Tensor | None = None

    def mean(self) -> Tensor:
        """``(P, 2)`` the policy's mean log-prob per response token."""
        return self.policy / self.tokens.clamp(min=1).to(self.policy.dtype)

    def chosen_nll(self) -> Tensor:
        """The chosen responses' negative log-likelihood per token, over the batch."""
        return -self.policy[:, 0].sum() / self.tokens[:, 0].sum().clamp(min=1)


@dataclass(frozen=True)
class PreferenceLoss:
    """A ``preference.loss``: its function of the pairs and whether it needs a reference."""

    compute: Callable[[PairLogps, float, float], LossOutput]  # (pairs, beta, gamma)
    needs_reference: bool = True

    def __call__(self, pairs: PairLogps, beta: float, gamma: float = 0.0) -> LossOutput:
        if self.needs_reference and pairs.reference is None:
            raise ValueError("this preference loss compares with a reference: none given")
        return self.compute(pairs, beta, gamma)


def _against_reference(loss: Callable[..., LossOutput]) -> PreferenceLoss:
    def compute(pairs: PairLogps, beta: float, gamma: float) -> LossOutput:
        ref = pairs.reference.to(pairs.policy.dtype)  # type: ignore[union-attr]
        return loss(pairs.policy[:, 0], pairs.policy[:, 1], ref[:, 0], ref[:, 1], beta)

    return PreferenceLoss(compute)


def _simpo(pairs: PairLogps, beta: float, gamma: float) -> LossOutput:
    mean = pairs.mean()
    return simpo_loss(mean[:, 0], mean[:, 1], beta, gamma)


def _orpo(pairs: PairLogps, beta: float, gamma: float) -> LossOutput:
    mean = pairs.mean()
    return orpo_loss(mean[:, 0], mean[:, 1], pairs.chosen_nll(), beta)


PREFERENCE_LOSSES: dict[str, PreferenceLoss] = {
    "sigmoid": _against_reference(dpo_sigmoid_loss),
    "ipo": _against_reference(ipo_loss),
    "hinge": _against_reference(hinge_loss),
    "simpo": PreferenceLoss(_simpo, needs_reference=False),
    "orpo": PreferenceLoss(_orpo, needs_reference=False),
}


def runs_reference(objective: str, loss: str, precomputed: bool) -> bool:
    """Whether a run computes a reference model's forward during training: a ``dpo``
    objective whose ``preference.loss`` compares with one, not precomputed."""
    entry = PREFERENCE_LOSSES.get(loss)
    return objective == "dpo" and entry is not None and entry.needs_reference and not precomputed


def get_preference_loss(name: str) -> PreferenceLoss:
    """The loss called ``name`` (``preference.loss``).

    Raises:
        ValueError: an unknown name (the choices are listed).
    """
    try:
        return PREFERENCE_LOSSES[name]
    except KeyError:
        raise ValueError(
            f"unknown preference loss {name!r}; choose one of {sorted(PREFERENCE_LOSSES)}"
        ) from None


class _TokenLogProbs(torch.autograd.Function):
    """``log softmax(logits)[label]`` per row, fp32, with an fp32 copy of one block at a time."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, valid: Tensor, chunk_rows: int) -> Tensor:  # type: ignore[override]
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
    def backward(ctx, grad_output: Tensor):  # type: ignore[override]
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
