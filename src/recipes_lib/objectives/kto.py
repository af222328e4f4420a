"""Kahneman-Tversky optimisation: the ``kto`` objective, on unpaired completions.

:class:`KTOModule` is a :class:`~recipes_lib.objectives.dpo.DPOModule` (same frozen
reference, built, precomputed or bypassed the same way) whose batches come from
:mod:`recipes_lib.data.preference.unpaired`: each example is a completion of its prompt,
labelled desirable or not, beside a mismatched twin (another example's completion after
this prompt). The policy runs the completions with a gradient and their twins (rows of
their own) without one; the twins' log-ratios give the
estimate of ``KL(policy || reference)``, the reference point of
:func:`~recipes_lib.losses.preference.kto_loss` (without gradient, as in the paper): their
mean over the twins of every rank's micro-batch, so that data parallelism trains as one
process does on the whole batch.

Logged as ``train/...`` and ``val/...``: ``loss``, ``rewards/desirable`` and
``rewards/undesirable`` (the mean ``beta`` times log-ratio of each kind in the batch, 0
when the batch has none), ``rewards/margin`` (their difference: it grows as the policy
learns), ``kl`` and the policy's ``logps/desirable`` and ``logps/undesirable``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from recipes_lib.errors import ConfigError
from recipes_lib.losses.preference import PREFERENCE_LOSSES, kto_loss
from recipes_lib.objectives.dpo import DPOModule, pair_sums
from recipes_lib.parallel.collectives import summed_over_ranks
from recipes_lib.training.module import Batch

KTO_LOSS = "kto"


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def _rows(batch: Batch, rows: slice) -> Batch:
    """``batch`` with only ``rows`` of its ``(R, T)`` tensors (the rest as they are)."""
    height = batch["input_ids"].shape[0]
    return {
        k: v[rows] if isinstance(v, Tensor) and v.dim() == 2 and v.shape[0] == height else v
        for k, v in batch.items()
    }


def mean_over_ranks(values: Tensor) -> Tensor:
    """The mean of ``values`` ``(N,)`` and every other rank's (one all-reduce of their
    sum and count; this rank's alone when it runs by itself)."""
    totals = torch.stack([values.float().sum(), values.new_tensor(values.numel()).float()])
    totals = summed_over_ranks(totals)
    return totals[0] / totals[1].clamp(min=1)


class KTOModule(DPOModule):
    """KTO of a causal LM against a frozen reference (``preference.loss=kto``; ``beta``,
    ``desirable_weight`` and ``undesirable_weight`` from ``preference``).

    Raises:
        ConfigError: another ``preference.loss``, a non-positive beta or a negative
            weight.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        settings = self.preference_config
        for key in ("desirable_weight", "undesirable_weight"):
            if not getattr(settings, key) >= 0:
                raise ConfigError(f"preference.{key}={getattr(settings, key)} must be >= 0")

    def resolve_loss(self, name: str) -> None:
        """Only ``kto``, computed by :meth:`compute_loss` on labelled completions."""
        if name != KTO_LOSS:
            raise ConfigError(
                f"preference.loss={name!r} with stage.objective=kto: KTO's loss is "
                f"preference.loss=kto (the paired losses {sorted(PREFERENCE_LOSSES)} are "
                "objective dpo's)"
            )

    @property
    def uses_reference(self) -> bool:
        """KTO always compares with the frozen reference."""
        return True

    def policy_logprobs(self, batch: Batch) -> Tensor:
        """``(R, T)`` label log-probs under the policy: the completions' rows with a
        gradient, then the twins' rows (``twin_rows`` on) without one, which spares the
        backward pass half the rows. A mixture of experts runs them in one pass (its
        balance loss is read from the last forward)."""
        model, split = self._built_model(), batch.get("twin_rows")
        if split is None or self.model_config.moe_experts:
            return self.label_logprobs(model, batch)
        completions = self.label_logprobs(model, _rows(batch, slice(0, split)))
        with torch.no_grad():
            twins = self.label_logprobs(model, _rows(batch, slice(split, None)))
        return torch.cat([completions, twins])

    def compute_loss(self, batch: Batch) -> tuple[Tensor, dict[str, Tensor]]:
        """KTO's loss of a batch of labelled completions, and its reward metrics."""
        if "desirable" not in batch:
            raise ConfigError(
                "stage.objective=kto needs batches of labelled completions (its data module "
                "gives them: data=stdlib_kto or data=unpaired)"
            )
        n = batch["pair_index"].numel()
        per_token = self.policy_logprobs(batch)
        policy = pair_sums(per_token, batch["sequence_ids"], n)  # (N, 2): completion, twin
        reference = batch.get("reference_logps")
        if reference is None:
            reference = self.reference_logprobs(batch)
        reference = reference.to(policy.dtype)
        settings = self.preference_config
        desirable = batch["desirable"].to(policy.device)
        twins = policy[:, 1].detach() - reference[:, 1]  # mismatched completions' log-ratios
        loss, rewards, kl = kto_loss(
            policy[:, 0],
            reference[:, 0],
            policy[:, 1].detach(),
            reference[:, 1],
            desirable,
            settings.beta,
            settings.desirable_weight,
            settings.undesirable_weight,
            kl=mean_over_ranks(twins),
        )
        wanted, unwanted = desirable.float(), (~desirable).float()
        logps = policy[:, 0].detach()
        metrics = {
            "rewards/desirable": _masked_mean(rewards, wanted),
            "rewards/undesirable": _masked_mean(rewards, unwanted),
            "kl": kl,
            "logps/desirable": _masked_mean(logps, wanted),
            "logps/undesirable": _masked_mean(logps, unwanted),
        }
        metrics["rewards/margin"] = metrics["rewards/desirable"] - metrics["rewards/undesirable"]
        return loss, metrics
