"""Preference optimisation on pairs: the module the ``dpo``, ``simpo`` and ``orpo``
objectives share, each with its own settings and loss.

One forward pass of the policy covers the chosen and the rejected sequences of every
pair (they are rows of one batch, or documents of packed rows); summed response
log-probs per sequence feed the objective's loss (:mod:`recipes_lib.losses.preference`).
A loss that compares with a reference (DPO's) has a frozen one
(:class:`~recipes_lib.objectives.pairs.PairedReference`); SimPO's and ORPO's build none.

An objective's settings say which loss and with what coefficients
(``settings.pair_loss()``), and, for a loss with a reference, ``reference_from`` and
``precompute_reference``.

Logged as ``train/...`` and ``val/...``: ``loss``, ``rewards/chosen``,
``rewards/rejected`` (``beta`` times the policy-reference log-ratio, or the loss's own
reward), ``rewards/margin`` (their difference), ``rewards/accuracy`` (the share of pairs
whose chosen reward is the higher) and the policy's ``logps/chosen`` and
``logps/rejected``. When fitting ends, the run's folder gets the tokenizer and chat
template the pairs were rendered with, as after SFT.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from torch import Tensor

from recipes_lib.losses.preference import PairLogps, PreferenceLoss
from recipes_lib.objectives.pairs import (
    PairedReference,
    count_pair_tokens,
    label_logprobs,
    pair_sums,
    pair_token_counts,
    shared_pair_logps,
    split_pair_rows,
)
from recipes_lib.objectives.sft import save_chat_tokenizer_beside_outputs
from recipes_lib.parallel.context import group_loss, group_sum
from recipes_lib.training.module import Batch, CausalLMModule


@dataclass(frozen=True)
class PairLoss:
    """A preference loss with its coefficients (``gamma``: SimPO's margin, else unused)."""

    loss: PreferenceLoss
    beta: float
    gamma: float = 0.0


class PreferenceModule(CausalLMModule):
    """Preference optimisation of a causal LM on pairs.

    Takes :class:`CausalLMModule`'s arguments plus ``objective`` (its name: settings
    are ``stage.<objective>``) and ``settings`` (with ``pair_loss()``).
    """

    def __init__(self, *args: Any, objective: str, settings: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.objective = objective
        self.settings = settings
        self.pair_loss: PairLoss = settings.pair_loss()
        self.hparams[objective] = asdict(settings)
        self.reference: PairedReference | None = None
        if self.pair_loss.loss.needs_reference:
            self.reference = PairedReference(
                f"stage.{objective}",
                getattr(settings, "reference_from", None),
                getattr(settings, "precompute_reference", False),
            )

    def configure_model(self) -> None:
        """Build the policy (see :class:`CausalLMModule`), then its frozen reference."""
        if self.model is not None:
            return
        super().configure_model()
        if self.reference is not None:
            self.reference.build(self)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.reference is not None:
            self.reference.save(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        if self.reference is not None:
            self.reference.restore(checkpoint)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        if self.reference is not None:
            self.reference.on_fit_start(self)

    def compute_loss(self, batch: Batch) -> tuple[Tensor, dict[str, Tensor]]:
        """The preference loss of a batch of pairs, and the reward metrics."""
        n_pairs = batch["pair_index"].numel()
        shared = split_pair_rows(self, batch)
        if shared is None:
            per_token = label_logprobs(self, self.built_model(), batch)  # both sequences
            policy = pair_sums(per_token, batch["sequence_ids"], n_pairs)
            reference = None if self.reference is None else self.reference.of_batch(self, batch)
            tokens = pair_token_counts(batch["labels"], batch["sequence_ids"], n_pairs)
        else:
            shard, rows = shared
            policy, reference = shared_pair_logps(self, batch, shard, rows, n_pairs, self.reference)
            assert rows.sequence_ids is not None
            tokens = group_sum(pair_token_counts(rows.labels, rows.sequence_ids, n_pairs), shard)
        loss, chosen_rewards, rejected_rewards = self.pair_loss.loss(
            PairLogps(policy, tokens, reference), self.pair_loss.beta, self.pair_loss.gamma
        )
        if shared is not None:
            loss = group_loss(loss, shared[0])
        metrics = {
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/margin": (chosen_rewards - rejected_rewards).mean(),
            "rewards/accuracy": (chosen_rewards > rejected_rewards).float().mean(),
            "logps/chosen": policy[:, 0].detach().mean(),
            "logps/rejected": policy[:, 1].detach().mean(),
        }
        return loss, metrics

    def count_tokens(self, batch: Batch) -> int:
        """Real (non-padding) tokens of both sequences of every pair."""
        return count_pair_tokens(batch)

    def on_validation_epoch_end(self) -> None:
        # a preference loss has no perplexity: drop the base module's running sums
        self._val_loss_sum = self._val_batches = None

    def on_fit_end(self) -> None:
        save_chat_tokenizer_beside_outputs(self)  # the tokenizer and template, as SFT's
