"""Kahneman-Tversky optimisation: the ``kto`` objective, on unpaired completions.

:class:`KTOModule` compares its policy with a frozen reference built, precomputed or
bypassed as DPO's is (the shared :class:`~recipes_lib.objectives.pairs.PairedReference`);
its batches come from
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

from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor

from recipes_lib.config.schema import RunConfig
from recipes_lib.data.preference.unpaired import build_unpaired_data
from recipes_lib.errors import ConfigError
from recipes_lib.losses.preference import kto_loss
from recipes_lib.objectives.pairs import (
    PairedReference,
    batch_rows,
    count_pair_tokens,
    pair_sums,
    reference_models,
    shared_pair_logps,
    split_pair_rows,
    split_rows_logprobs,
)
from recipes_lib.objectives.registry import (
    FrozenModel,
    ObjectiveSpec,
    register_objective,
    shapes_vary,
)
from recipes_lib.objectives.settings import KTOSettings
from recipes_lib.objectives.sft import save_chat_tokenizer_beside_outputs
from recipes_lib.parallel.collectives import summed_over_ranks
from recipes_lib.parallel.context import group_loss
from recipes_lib.training.module import Batch, CausalLMModule


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def mean_over_ranks(values: Tensor) -> Tensor:
    """The mean of ``values`` ``(N,)`` and every other rank's (one all-reduce of their
    sum and count; this rank's alone when it runs by itself)."""
    totals = torch.stack([values.float().sum(), values.new_tensor(values.numel()).float()])
    totals = summed_over_ranks(totals)
    return totals[0] / totals[1].clamp(min=1)


class KTOModule(CausalLMModule):
    """KTO of a causal LM against a frozen reference (settings: :class:`KTOSettings`).
    When fitting ends, the run's folder gets the tokenizer and chat template, as after
    SFT.

    Raises:
        ConfigError: a non-positive beta or a negative weight.
    """

    def __init__(self, *args: Any, settings: KTOSettings | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.settings = settings if settings is not None else KTOSettings()
        self.settings.check()
        self.hparams["kto"] = asdict(self.settings)
        self.reference = PairedReference(
            "stage.kto", self.settings.reference_from, self.settings.precompute_reference
        )

    def configure_model(self) -> None:
        """Build the policy (see :class:`CausalLMModule`), then its frozen reference."""
        if self.model is not None:
            return
        super().configure_model()
        self.reference.build(self)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        self.reference.save(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.reference.restore(checkpoint)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.reference.on_fit_start(self)

    def twin_rows(self, batch: Batch) -> int | None:
        """Where the batch's twins' rows start, which run without a gradient; None: one
        pass over every row (a mixture of experts reads its balance loss from the last
        forward)."""
        split = batch.get("twin_rows")  # an int: the first row of the twins
        return None if split is None or self.model_config.moe_experts else int(split)

    def policy_logprobs(self, batch: Batch) -> Tensor:
        """``(R, T)`` label log-probs under the policy: the completions' rows with a
        gradient, then the twins' rows without one (:meth:`twin_rows`)."""
        rows = batch_rows(self, batch)
        return split_rows_logprobs(self, self.built_model(), rows, self.twin_rows(batch))

    def compute_loss(self, batch: Batch) -> tuple[Tensor, dict[str, Tensor]]:
        """KTO's loss of a batch of labelled completions, and its reward metrics."""
        if "desirable" not in batch:
            raise ConfigError(
                "stage.objective=kto needs batches of labelled completions (its data module "
                "gives them: data=stdlib_kto or data=unpaired)"
            )
        n = batch["pair_index"].numel()
        shared = split_pair_rows(self, batch)  # strategy.context_parallel: a share of each row
        if shared is None:
            per_token = self.policy_logprobs(batch)
            policy = pair_sums(per_token, batch["sequence_ids"], n)  # (N, 2): completion, twin
            reference = self.reference.of_batch(self, batch)
        else:
            shard, rows = shared
            policy, shared_reference = shared_pair_logps(
                self, batch, shard, rows, n, self.reference, twin_rows=self.twin_rows(batch)
            )
            assert shared_reference is not None  # KTO always has a reference
            reference = shared_reference
        reference = reference.to(policy.dtype)
        settings = self.settings
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
        if shared is not None:  # every rank of the group computed the same loss
            loss = group_loss(loss, shared[0])
        return loss, metrics

    def count_tokens(self, batch: Batch) -> int:
        """Real (non-padding) tokens of the completions and their twins."""
        return count_pair_tokens(batch)

    def on_validation_epoch_end(self) -> None:
        # a preference loss has no perplexity: drop the base module's running sums
        self._val_loss_sum = self._val_batches = None

    def on_fit_end(self) -> None:
        save_chat_tokenizer_beside_outputs(self)  # the tokenizer and template, as SFT's


def _reference(cfg: RunConfig, settings: KTOSettings) -> tuple[FrozenModel, ...]:
    return reference_models(cfg, settings.reference_from, settings.precompute_reference)


KTO = register_objective(
    ObjectiveSpec(
        name="kto",
        module=KTOModule.from_run_config,
        data=build_unpaired_data,
        batch=(
            "as DPO's pairs, each example a completion (first) and its mismatched twin "
            "(second); desirable (N,) bool; twin_rows: where the twins' rows start"
        ),
        loss="kto_loss",
        settings=KTOSettings,
        sequences_per_example=2,
        second_sequence_without_gradient=True,
        example_noun="completions",
        batches_vary=shapes_vary,
        frozen_models=_reference,
        context_parallel=True,
    )
)
