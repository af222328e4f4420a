"""Reward models: the ``reward`` objective, a score head trained on preference pairs.

A reward model is the decoder with a score head (``model.head=score``): one scalar per
position, read at each sequence's last token that is not the padding id (as
transformers' ``...ForSequenceClassification`` reads it, so an export gives the same
scores; :mod:`recipes_lib.checkpoint.hf_export`). It usually starts from a language
model's weights (an SFT stage's): the body is loaded and the head starts fresh.

Batches are :mod:`recipes_lib.data.preference.collate`'s pairs, unshifted: every token
of a sequence is an input, and ``score_index`` says where each sequence's score is read.
The loss is Bradley-Terry (:func:`~recipes_lib.losses.reward.bradley_terry_loss`).

Logged as ``train/...`` and ``val/...``: ``loss``, ``rewards/chosen`` and
``rewards/rejected`` (the mean scores), ``rewards/margin`` (their mean difference) and
``rewards/accuracy`` (the share of pairs whose chosen response scores higher).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import lightning as L
import torch
from torch import Tensor, nn

from recipes_lib.config.schema import RunConfig
from recipes_lib.data.preference.module import build_preference_data
from recipes_lib.errors import ConfigError
from recipes_lib.kernels.sharded import ContextShard
from recipes_lib.losses.cross_entropy import IGNORE_INDEX
from recipes_lib.losses.reward import bradley_terry_loss
from recipes_lib.objectives.registry import ObjectiveSpec, register_objective, shapes_vary
from recipes_lib.objectives.settings import RewardSettings
from recipes_lib.objectives.sft import save_chat_tokenizer_beside_outputs
from recipes_lib.parallel.context import group_loss, group_sum, split_rows
from recipes_lib.training.module import Batch, CausalLMModule


def sequence_scores(
    model: nn.Module,
    input_ids: Tensor,
    doc_ids: Tensor | None,
    score_index: Tensor,
    token_mask: Tensor | None = None,
) -> Tensor:
    """Each sequence's score, fp32 ``(S,)``: the score head's output at ``score_index``
    (flat indices into ``(R * T)``, one per sequence); ``token_mask`` as the model's
    forward takes it."""
    scores = model(input_ids, doc_ids, token_mask=token_mask)  # (R, T, 1)
    return scores.flatten()[score_index.to(scores.device)].float()


class RewardModule(CausalLMModule):
    """A reward model trained with the Bradley-Terry loss on preference pairs.

    Takes :class:`CausalLMModule`'s arguments plus ``settings`` (:class:`RewardSettings`). When
    fitting ends, the run's folder gets the tokenizer and chat template the pairs were
    rendered with, as after SFT.

    Raises:
        ConfigError: a model without a score head, or a negative ``center_coef``.
    """

    def __init__(self, *args: Any, settings: RewardSettings | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.settings = settings if settings is not None else RewardSettings()
        if self.model_config.head != "score":
            raise ConfigError(
                f"stage.objective=reward trains a score head, but model.head="
                f"{self.model_config.head}: set model.head=score (the reward recipes do)"
            )
        if not self.settings.center_coef >= 0:
            raise ConfigError(f"stage.reward.center_coef={self.settings.center_coef} must be >= 0")
        self.hparams["reward"] = asdict(self.settings)

    def compute_loss(self, batch: Batch) -> tuple[Tensor, dict[str, Tensor]]:
        """The Bradley-Terry loss of a batch of pairs, and the reward metrics."""
        if "score_index" not in batch:
            raise ConfigError(
                "stage.objective=reward needs batches of whole sequences with their "
                "score_index (its data module gives them: data=stdlib_dpo or data=pairs)"
            )
        n_pairs = batch["pair_index"].numel()
        input_ids, doc_ids = self.model_inputs(batch)
        token_mask = self.expert_load.token_mask(batch)
        trainer = self._attached()
        shard = None
        if trainer is not None and getattr(trainer.strategy, "context_parallel", 1) > 1:
            scores, shard = self._shared_scores(trainer.strategy, batch, doc_ids, token_mask)
        else:
            scores = sequence_scores(
                self.built_model(), input_ids, doc_ids, batch["score_index"], token_mask
            )
        chosen, rejected = scores[:n_pairs], scores[n_pairs:]
        loss = bradley_terry_loss(chosen, rejected, self.settings.center_coef)
        if shard is not None:
            loss = group_loss(loss, shard)
        chosen, rejected = chosen.detach(), rejected.detach()
        metrics = {
            "rewards/chosen": chosen.mean(),
            "rewards/rejected": rejected.mean(),
            "rewards/margin": (chosen - rejected).mean(),
            "rewards/accuracy": (chosen > rejected).float().mean(),
        }
        return loss, metrics

    def _shared_scores(
        self, strategy: object, batch: Batch, doc_ids: Tensor | None, token_mask: Tensor | None
    ) -> tuple[Tensor, ContextShard]:
        """Each sequence's score under ``strategy.context_parallel``: each rank runs its
        share of every row and reads the scores whose positions it holds; the group adds
        them up (a score is on one rank, zero on the others). The model keeps its shard
        until the backward has run, as the base module's does."""
        input_ids = batch["input_ids"]
        score_index = batch["score_index"].to(input_ids.device)
        # each position's sequence where a score is read, IGNORE_INDEX elsewhere (what
        # split_rows pads labels with)
        score_at = torch.full_like(input_ids, IGNORE_INDEX)
        score_at.view(-1)[score_index] = torch.arange(
            score_index.numel(), device=input_ids.device, dtype=input_ids.dtype
        )
        split = split_rows(strategy, input_ids, score_at, doc_ids, token_mask)
        assert split is not None  # context_parallel > 1
        shard, (ids, at, docs, mask) = split
        model = self.built_model()
        model.set_context_shard(shard)
        try:
            local = model(ids, docs, token_mask=mask).flatten().float()  # (R * T / N,)
        except BaseException:
            model.set_context_shard(None)
            raise
        if not torch.is_grad_enabled():
            model.set_context_shard(None)
        at = at.flatten()
        held = torch.zeros(score_index.numel(), dtype=local.dtype, device=local.device)
        held = held.index_add(0, at.clamp(min=0), local * (at >= 0))
        return group_sum(held, shard), shard

    def count_tokens(self, batch: Batch) -> int:
        """Real (non-padding) tokens of both sequences of every pair."""
        return int(batch["num_tokens"])

    def on_validation_epoch_end(self) -> None:
        # a Bradley-Terry loss has no perplexity: drop the base module's running sums
        self._val_loss_sum = self._val_batches = None

    def on_fit_end(self) -> None:
        save_chat_tokenizer_beside_outputs(self)  # the tokenizer and template, as SFT's


def reward_data(cfg: RunConfig, *, total_train_samples: int) -> L.LightningDataModule:
    """DPO's pairs, unshifted: a score is read at a sequence's last token."""
    return build_preference_data(cfg, total_train_samples=total_train_samples, shifted=False)


REWARD = register_objective(
    ObjectiveSpec(
        name="reward",
        module=RewardModule.from_run_config,
        data=reward_data,
        batch=(
            "pairs as DPO's, unshifted (every token an input); score_index (2P,): where each "
            "sequence's score is read; num_tokens"
        ),
        loss="bradley_terry_loss",
        settings=RewardSettings,
        sequences_per_example=2,  # chosen and rejected, scored in one pass as DPO's
        example_noun="pairs",
        head="score",
        batches_vary=shapes_vary,
        context_parallel=True,
    )
)
