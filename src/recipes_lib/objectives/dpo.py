"""Direct preference optimisation: the ``dpo`` objective.

:class:`DPOModule` is a :class:`~recipes_lib.training.module.CausalLMModule` whose loss
compares the policy with a frozen reference on preference pairs (batches of
:mod:`recipes_lib.data.preference.collate`). One forward pass of the policy covers the chosen
and the rejected sequences of every pair (they are rows of one batch, or documents of
packed rows); summed response log-probs per sequence feed the configured loss
(:mod:`recipes_lib.losses.preference`).

The reference is, by default, the weights the stage starts from
(``preference.reference_from``, else ``stage.init_from``, else the policy's initial
weights). With a LoRA or QLoRA adapter and no other reference source it is the policy
itself with its adapters bypassed, so no second copy of the base exists. Otherwise it
is a separate frozen model: in eval mode, without gradients, outside the optimizer and
outside checkpoints (it is not a submodule). A checkpoint records only where the
reference came from, and a resumed run (which has no ``stage.init_from``) rebuilds it
from there.

With ``preference.precompute_reference=true`` the reference runs once over every
training and validation pair before the first step (in ``on_fit_start``); its
log-probs are stored on the datasets by pair index, so the resumable sampler's order
does not matter, and a separate reference model is freed afterwards.

Logged as ``train/...`` and ``val/...``: ``loss``, ``rewards/chosen``,
``rewards/rejected`` (``beta`` times the policy-reference log-ratio), ``rewards/margin``
(their difference), ``rewards/accuracy`` (the share of pairs whose chosen reward is the
higher) and the policy's ``logps/chosen`` and ``logps/rejected``.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

import torch
from torch import Tensor

from recipes_lib.config.schema import PreferenceConfig
from recipes_lib.config.store import as_config
from recipes_lib.errors import ConfigError
from recipes_lib.losses.cross_entropy import IGNORE_INDEX
from recipes_lib.losses.logprobs import token_logprobs
from recipes_lib.losses.preference import PREFERENCE_LOSSES, PairLogps, PreferenceLoss
from recipes_lib.objectives.sft import save_chat_tokenizer_beside_outputs
from recipes_lib.training.module import Batch, CausalLMModule
from recipes_lib.training.reference import (
    REFERENCE_SOURCE_KEY,
    FrozenReference,
    build_reference,
    restore_reference,
)

SPLITS = ("train", "val")


def pair_logprobs(logits: Tensor, labels: Tensor, sequence_ids: Tensor, n_pairs: int) -> Tensor:
    """Summed response log-probs of every pair's two sequences, ``(P, 2)`` fp32.

    Args:
        logits: ``(R, T, V)`` scores of the batch's rows.
        labels: ``(R, T)`` next-token ids, -100 where nothing counts.
        sequence_ids: ``(R, T)``: ``j`` on tokens of pair ``j``'s chosen sequence,
            ``P + j`` on its rejected one, -1 on padding.
        n_pairs: ``P``.

    Returns:
        Column 0 the chosen, column 1 the rejected log-probabilities.
    """
    return pair_sums(token_logprobs(logits, labels), sequence_ids, n_pairs)


def pair_token_counts(labels: Tensor, sequence_ids: Tensor, n_pairs: int) -> Tensor:
    """The response tokens counted in each of :func:`pair_logprobs`' sums, ``(P, 2)``."""
    return pair_sums((labels != IGNORE_INDEX).long(), sequence_ids, n_pairs)


def pair_sums(values: Tensor, sequence_ids: Tensor, n_pairs: int) -> Tensor:
    """``values`` (``(R, T)``) summed over each pair's chosen and rejected sequence,
    padding (``sequence_ids`` -1) left out: ``(P, 2)``."""
    real = sequence_ids >= 0
    sums = torch.zeros(2 * n_pairs, dtype=values.dtype, device=values.device)
    sums = sums.index_add(0, sequence_ids.clamp(min=0).flatten(), (values * real).flatten())
    return sums.view(2, n_pairs).t()  # (P, 2)


class DPOModule(CausalLMModule):
    """Preference optimisation of a causal LM against a frozen reference.

    Takes :class:`CausalLMModule`'s arguments plus ``preference`` (loss, beta,
    reference source, precomputation). When fitting ends, the run's folder gets the
    tokenizer and chat template the pairs were rendered with, as after SFT.

    Raises:
        ConfigError: an unknown loss or a non-positive beta.
    """

    config_groups = ("preference",)
    varying_shapes = True  # pairs of every length

    def __init__(self, *args: Any, preference: PreferenceConfig | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        config = preference if preference is not None else PreferenceConfig()
        self.preference_config: PreferenceConfig = as_config(PreferenceConfig, config, "preference")
        if not self.preference_config.beta > 0:
            raise ConfigError(f"preference.beta={self.preference_config.beta} must be positive")
        self._preference_loss = self.resolve_loss(self.preference_config.loss)
        if self.preference_config.precompute_reference and not self.uses_reference:
            raise ConfigError(
                f"preference.precompute_reference=true with preference.loss="
                f"{self.preference_config.loss}, which compares with no reference: set it false"
            )
        self.hparams["preference"] = asdict(self.preference_config)
        self.reference: FrozenReference | None = None
        self.reference_source: str | None = None  # the file a separate reference came from

    def resolve_loss(self, name: str) -> PreferenceLoss | None:
        """The ``preference.loss`` this objective computes (None: one it computes itself,
        in its own ``compute_loss``).

        Raises:
            ConfigError: a name this objective does not take.
        """
        if name not in PREFERENCE_LOSSES:
            raise ConfigError(f"preference.loss={name!r} is not one of {sorted(PREFERENCE_LOSSES)}")
        return PREFERENCE_LOSSES[name]

    # ------------------------------------------------------------- reference
    @property
    def uses_reference(self) -> bool:
        """Whether ``preference.loss`` compares with a reference (``simpo`` and ``orpo``
        do not: no reference model is built)."""
        return self._preference_loss.needs_reference

    def configure_model(self) -> None:
        """Build the policy (see :class:`CausalLMModule`), then its frozen reference."""
        if self.model is not None:
            return
        super().configure_model()
        if self.uses_reference:
            self.reference = self._build_reference()

    def _build_reference(self) -> FrozenReference:
        """The frozen reference (:func:`~recipes_lib.training.reference.build_reference`):
        ``preference.reference_from``, else the weights the policy started from."""
        settings = self.preference_config
        source = settings.reference_from or self.init_from
        same_base = settings.reference_from is None or settings.reference_from == self.init_from
        key = "preference.reference_from" if settings.reference_from else "stage.init_from"
        upcycle = self.upcycle and not settings.reference_from  # as the policy started
        reference = build_reference(self, source, key, same_base=same_base, upcycle=upcycle)
        self.reference_source = reference.source
        return reference

    # ----------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint[REFERENCE_SOURCE_KEY] = self.reference_source

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A resumed run has no ``stage.init_from``: rebuild a separate reference from the
        source the checkpoint names (its weights are never in the checkpoint)."""
        super().on_load_checkpoint(checkpoint)
        self.reference_source = restore_reference(
            self.reference, checkpoint, self.reference_source, "preference.reference_from"
        )

    def _reference(self) -> FrozenReference:
        if self.reference is None:
            raise RuntimeError(
                "the reference was freed after precomputing its log-probs, or never built"
            )
        return self.reference

    def free_reference(self) -> None:
        """Drop a separate reference model (an adapter-based one costs nothing to keep)."""
        if self.reference is not None and not self.reference.shares_policy:
            self.reference = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def label_logprobs(self, model: Any, batch: Batch) -> Tensor:
        """``(R, T)`` fp32 log-probs of the batch's labels under ``model`` (0 where
        ignored), through the model's head, fused with the loss when
        ``kernels.loss_chunk_size`` is set: the full logits never exist then."""
        input_ids, doc_ids = self.model_inputs(batch)
        chunk = self.kernels_config.loss_chunk_size
        return model(
            input_ids,
            doc_ids,
            labels=batch["labels"],
            per_token=True,
            loss_chunk_size=chunk,
            token_mask=self.expert_load.token_mask(batch),
        )

    @torch.no_grad()
    def reference_logprobs(self, batch: Batch) -> Tensor:
        """``(P, 2)`` reference log-probs of the batch's pairs, computed now."""
        per_token = self.label_logprobs(self._reference(), batch)
        return pair_sums(per_token, batch["sequence_ids"], batch["pair_index"].numel())

    def precompute_reference(self, batches: Iterable[Batch], n_pairs: int) -> Tensor:
        """``(n_pairs, 2)`` reference log-probs of every pair in ``batches``, placed by
        ``pair_index`` (rows of pairs not in ``batches`` stay 0)."""
        table = torch.zeros(n_pairs, 2, dtype=torch.float32, device=self.device)
        for batch in batches:
            batch = {k: v.to(self.device) if isinstance(v, Tensor) else v for k, v in batch.items()}
            with self._autocast():
                table[batch["pair_index"]] = self.reference_logprobs(batch)
        return table

    def _autocast(self):
        try:
            return self.trainer.precision_plugin.forward_context()
        except RuntimeError:  # not attached to a Trainer
            return torch.autocast(self.device.type, enabled=False)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        if not self.uses_reference:
            return
        self._reference().match_dtype(next(self._built_model().parameters()).dtype)
        if not self.preference_config.precompute_reference:
            return
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is None or not hasattr(datamodule, "reference_dataloader"):
            raise ConfigError(
                "preference.precompute_reference=true needs a data module with "
                "reference_dataloader() and set_reference_logps() (PreferenceDataModule)"
            )
        rank, world = self.trainer.global_rank, self.trainer.world_size
        for split in SPLITS:
            dataset = datamodule.split_dataset(split)
            if dataset is None or len(dataset) == 0:
                continue
            loader = datamodule.reference_dataloader(split, rank, world)
            table = self.precompute_reference(loader, len(dataset))
            if world > 1:  # each rank filled its own share of the rows
                table = self.trainer.strategy.reduce(table, reduce_op="sum")
            datamodule.set_reference_logps(split, table)
        self.free_reference()

    # ------------------------------------------------------------------ loss
    def compute_loss(self, batch: Batch) -> tuple[Tensor, dict[str, Tensor]]:
        """The preference loss of a batch of pairs, and the reward metrics."""
        n_pairs = batch["pair_index"].numel()
        per_token = self.label_logprobs(self._built_model(), batch)  # chosen and rejected rows
        policy = pair_sums(per_token, batch["sequence_ids"], n_pairs)
        reference = None
        if self.uses_reference:
            reference = batch.get("reference_logps")
            if reference is None:
                if self.preference_config.precompute_reference and self.reference is None:
                    raise RuntimeError(
                        "preference.precompute_reference=true but the batch carries no "
                        "reference_logps and the reference model was freed"
                    )
                reference = self.reference_logprobs(batch)
        tokens = pair_token_counts(batch["labels"], batch["sequence_ids"], n_pairs)
        loss, chosen_rewards, rejected_rewards = self._preference_loss(
            PairLogps(policy, tokens, reference),
            self.preference_config.beta,
            self.preference_config.gamma,
        )
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
        count = batch.get("num_tokens")
        if count is None:
            count = int((batch["sequence_ids"] >= 0).sum())
        return int(count)

    def on_validation_epoch_end(self) -> None:
        # a preference loss has no perplexity: drop the base module's running sums
        self._val_loss_sum = self._val_batches = None

    def on_fit_end(self) -> None:
        save_chat_tokenizer_beside_outputs(self)  # the tokenizer and template, as SFT's
