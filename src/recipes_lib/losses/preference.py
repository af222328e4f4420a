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

:func:`kto_loss` (objective ``kto``) scores unpaired completions, each desirable or
not, against the reference and a KL estimate.

Two losses need no reference model. With ``ac, ar`` the policy's mean log-probability
per response token (``pc / nc``, ``pr / nr``):

- ``simpo`` (Meng et al. 2024): ``-log sigmoid(beta * (ac - ar) - gamma)``, rewards
  ``beta * ac`` and ``beta * ar``;
- ``orpo`` (Hong et al. 2024): the chosen responses' negative log-likelihood per token
  plus ``beta`` times ``-log sigmoid(log odds(ac) - log odds(ar))``, where ``log odds(a)
  = a - log(1 - exp(a))``; rewards ``beta * ac`` and ``beta * ar``.

:data:`PREFERENCE_LOSSES` holds each loss as a :class:`PreferenceLoss`, called with the
pairs' :class:`PairLogps`, which says whether it needs the reference's log-probs.

The summed log-probabilities come from :mod:`recipes_lib.losses.logprobs`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

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


def kto_loss(
    policy: Tensor,
    reference: Tensor,
    policy_kl: Tensor,
    reference_kl: Tensor,
    desirable: Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    kl: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """KTO (Ethayarajh et al. 2024) on unpaired completions, each desirable or not.

    With ``r = policy - reference`` each completion's log-ratio and ``z`` the batch's
    estimate of ``KL(policy || reference)`` (the mean log-ratio of completions paired
    with another example's prompt, clamped at 0, without gradient), a desirable
    completion costs ``desirable_weight * (1 - sigmoid(beta * (r - z)))`` and an
    undesirable one ``undesirable_weight * (1 - sigmoid(beta * (z - r)))``.

    Args:
        policy: ``(N,)`` the policy's summed log-probs of each completion.
        reference: ``(N,)`` the reference's.
        policy_kl: ``(N,)`` the policy's summed log-probs of the mismatched completions.
        reference_kl: ``(N,)`` the reference's.
        desirable: ``(N,)`` bool, whether each completion is desirable.
        beta: the inverse temperature.
        desirable_weight: ``lambda_D``; undesirable_weight: ``lambda_U``.
        kl: the mean log-ratio of mismatched completions to use instead of this batch's
            (e.g. over every rank's batch); clamped at 0 all the same.

    Returns:
        The mean loss, the rewards ``beta * r`` (detached, ``(N,)``) and ``z`` (0-d).
    """
    _check_beta(beta)
    rewards = policy.float() - reference.float()  # (N,)
    if kl is None:
        kl = (policy_kl.float() - reference_kl.float()).mean()
    kl = kl.float().clamp(min=0).detach()
    gain = torch.where(desirable, rewards - kl, kl - rewards)
    weight = torch.where(
        desirable,
        torch.tensor(desirable_weight, device=rewards.device),
        torch.tensor(undesirable_weight, device=rewards.device),
    )
    losses = weight * (1.0 - torch.sigmoid(beta * gain))  # (N,)
    return losses.mean(), beta * rewards.detach(), kl


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
