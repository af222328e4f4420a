"""The reward model's loss: Bradley-Terry on preference pairs.

Under the Bradley-Terry model the chosen response of a pair wins with probability
``sigmoid(r_chosen - r_rejected)``; the loss is its negative log-likelihood, averaged over
the pairs. Rewards are defined up to a constant, which ``center_coef`` pins near zero by
adding ``center_coef * mean((r_chosen + r_rejected) ** 2)`` (a small weight such as 0.01
keeps the scores centred without changing which response wins).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def bradley_terry_loss(chosen: Tensor, rejected: Tensor, center_coef: float = 0.0) -> Tensor:
    """``-log sigmoid(chosen - rejected)``, averaged over pairs, plus the centring term.

    Args:
        chosen, rejected: ``(P,)`` scalar rewards of each pair's two responses.
        center_coef: weight of ``mean((chosen + rejected) ** 2)``; 0: none.
    """
    if chosen.shape != rejected.shape:
        raise ValueError(
            f"chosen rewards {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} differ"
        )
    if center_coef < 0:
        raise ValueError(f"center_coef={center_coef} must be >= 0")
    chosen, rejected = chosen.float(), rejected.float()
    loss = -F.logsigmoid(chosen - rejected).mean()
    if center_coef:
        loss = loss + center_coef * (chosen + rejected).pow(2).mean()
    return loss
