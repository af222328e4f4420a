"""Parts shared by the objectives that score two sequences per example against a frozen
reference (DPO and its reference-free kin on pairs, KTO on a completion and its twin).

Batches are :mod:`recipes_lib.data.preference.collate`'s: ``sequence_ids`` ``(R, T)``
marks each token with its example's first (``j``) or second (``P + j``) sequence, -1 on
padding; ``pair_index`` numbers the examples. :func:`pair_sums` turns per-token values
into ``(P, 2)`` sums. :class:`PairedReference` is the frozen reference such an
objective compares its policy with: built, precomputed or bypassed, recorded in
checkpoints and restored from them, the same way for every objective that has one.

The reference is, by default, the weights the stage starts from (``reference_from``,
else ``stage.init_from``, else the policy's initial weights). With a LoRA or QLoRA
adapter and no other reference source it is the policy itself with its adapters
bypassed, so no second copy of the base exists. Otherwise it is a separate frozen model
outside the optimizer and the checkpoints; a checkpoint records only where it came from.
With ``precompute_reference`` it runs once over every training and validation example
before the first step; its log-probs are stored on the datasets by example index, and a
separate reference model is freed afterwards.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from recipes_lib.config.schema import RunConfig
from recipes_lib.errors import ConfigError
from recipes_lib.kernels.sharded import ContextShard
from recipes_lib.losses.cross_entropy import IGNORE_INDEX
from recipes_lib.losses.logprobs import token_logprobs
from recipes_lib.objectives.registry import FrozenModel
from recipes_lib.parallel.context import group_sum, holding_shard, shard_padded
from recipes_lib.training.module import Batch, CausalLMModule
from recipes_lib.training.reference import (
    REFERENCE_SOURCE_KEY,
    FrozenReference,
    build_reference,
    restore_reference,
)

if TYPE_CHECKING:
    from recipes_lib.models import Transformer

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


def label_logprobs(module: CausalLMModule, model: Any, batch: Batch) -> Tensor:
    """``(R, T)`` fp32 log-probs of the batch's labels under ``model`` (0 where
    ignored), through the model's head, fused with the loss when
    ``kernels.loss_chunk_size`` is set: the full logits never exist then."""
    return rows_logprobs(module, model, batch_rows(module, batch))


@dataclass(frozen=True)
class RowsShare:
    """The rows a rank runs a model on: a batch's, or its share of them under context
    parallelism (:func:`recipes_lib.parallel.context.split_rows`), with each token's
    sequence (``sequence_ids``; None where not needed)."""

    input_ids: Tensor
    labels: Tensor
    doc_ids: Tensor | None
    token_mask: Tensor | None
    sequence_ids: Tensor | None = None

    def rows(self, which: slice) -> RowsShare:
        """Only ``which`` of the rows (KTO's completions, or their twins)."""

        def part(tensor: Tensor | None) -> Tensor | None:
            return None if tensor is None else tensor[which]

        return RowsShare(
            self.input_ids[which],
            self.labels[which],
            part(self.doc_ids),
            part(self.token_mask),
            part(self.sequence_ids),
        )


def batch_rows(module: CausalLMModule, batch: Batch) -> RowsShare:
    """A batch's whole rows: its inputs as ``module`` reads them (document ids when it
    masks documents), labels and the tokens its expert load counts."""
    input_ids, doc_ids = module.model_inputs(batch)
    token_mask = module.expert_load.token_mask(batch)
    return RowsShare(input_ids, batch["labels"], doc_ids, token_mask)


def split_pair_rows(module: CausalLMModule, batch: Batch) -> tuple[ContextShard, RowsShare] | None:
    """This rank's share of a batch's rows under ``strategy.context_parallel``, with
    each token's sequence (None: whole rows, as without it)."""
    whole = batch_rows(module, batch)
    split = module.rows_share(whole.input_ids, whole.labels, whole.doc_ids, whole.token_mask)
    if split is None:
        return None
    shard, (ids, labels, docs, mask) = split
    sequences = shard_padded(shard, batch["sequence_ids"], -1)
    return shard, RowsShare(ids, labels, docs, mask, sequences)


def rows_logprobs(module: CausalLMModule, model: Any, rows: RowsShare) -> Tensor:
    """:func:`label_logprobs` of ``rows``."""
    return model(
        rows.input_ids,
        rows.doc_ids,
        labels=rows.labels,
        per_token=True,
        loss_chunk_size=module.kernels_config.loss_chunk_size,
        token_mask=rows.token_mask,
    )


def split_rows_logprobs(
    module: CausalLMModule, model: Any, rows: RowsShare, twin_rows: int | None
) -> Tensor:
    """:func:`rows_logprobs` of ``rows``, those from ``twin_rows`` on (KTO's mismatched
    twins, rows of their own) without a gradient, which spares the backward pass their
    rows; None: every row in one pass."""
    if twin_rows is None:
        return rows_logprobs(module, model, rows)
    trained = rows_logprobs(module, model, rows.rows(slice(0, twin_rows)))
    with torch.no_grad():
        twins = rows_logprobs(module, model, rows.rows(slice(twin_rows, None)))
    return torch.cat([trained, twins])


def shared_pair_logps(
    module: CausalLMModule,
    batch: Batch,
    shard: ContextShard,
    rows: RowsShare,
    n_pairs: int,
    reference: PairedReference | None,
    *,
    twin_rows: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The policy's and the reference's ``(P, 2)`` log-probs of whole sequences, each
    rank of a context-parallel group running its share of every row: the sums over the
    shares of each sequence add up over the group (:func:`group_sum`). Rows from
    ``twin_rows`` on run without a gradient (:func:`split_rows_logprobs`). The policy
    keeps its shard until the backward has run, as the base module's ``compute_loss``
    does; a precomputed reference was run on whole rows.
    """
    assert rows.sequence_ids is not None
    model = module.built_model()
    with holding_shard(model, shard):
        per_token = split_rows_logprobs(module, model, rows, twin_rows)
        logps = None
        if reference is not None:
            logps = batch.get("reference_logps")  # precomputed on whole rows
            if logps is None:
                logps = reference.share_logprobs(module, rows, shard, n_pairs)
    return group_sum(pair_sums(per_token, rows.sequence_ids, n_pairs), shard), logps


def count_pair_tokens(batch: Batch) -> int:
    """Real (non-padding) tokens of both sequences of every example."""
    count = batch.get("num_tokens")
    if count is None:
        return int((batch["sequence_ids"] >= 0).sum())
    return int(count)


def reference_models(
    cfg: RunConfig, reference_from: str | None, precompute: bool
) -> tuple[FrozenModel, ...]:
    """The reference a run compares with through training: none once precomputed
    log-probs freed it; with an adapter over the same base, the policy without its
    adapters (no memory of its own)."""
    if precompute:
        return ()
    same_base = reference_from is None or reference_from == cfg.stage.init_from
    shared = cfg.adapter.kind != "none" and same_base
    return (FrozenModel("reference", cfg.model, sharded=True, shares_policy=shared),)


class PairedReference:
    """The frozen reference of a two-sequence objective, for the module that holds it.

    Args:
        key: where its settings live (``stage.dpo``), for messages.
        reference_from: weights of the reference; None: the policy's starting weights.
        precompute: run it once over every example before training, then free it.
    """

    def __init__(self, key: str, reference_from: str | None, precompute: bool):
        self.key = key
        self.reference_from = reference_from
        self.precompute = precompute
        self.model: FrozenReference | None = None
        self.source: str | None = None  # the file a separate reference came from

    def build(self, module: CausalLMModule) -> None:
        """Build it beside ``module``'s built policy: ``reference_from``, else the
        weights the policy started from."""
        source = self.reference_from or module.init_from
        same_base = self.reference_from is None or self.reference_from == module.init_from
        key = f"{self.key}.reference_from" if self.reference_from else "stage.init_from"
        upcycle = module.upcycle and not self.reference_from  # as the policy started
        self.model = build_reference(module, source, key, same_base=same_base, upcycle=upcycle)
        self.source = self.model.source

    def save(self, checkpoint: dict[str, Any]) -> None:
        """Record where a separate reference came from (never its weights)."""
        checkpoint[REFERENCE_SOURCE_KEY] = self.source

    def restore(self, checkpoint: dict[str, Any]) -> None:
        """A resumed run has no ``stage.init_from``: rebuild a separate reference from
        the source the checkpoint names."""
        self.source = restore_reference(
            self.model, checkpoint, self.source, f"{self.key}.reference_from"
        )

    def built(self) -> FrozenReference:
        if self.model is None:
            raise RuntimeError(
                "the reference was freed after precomputing its log-probs, or never built"
            )
        return self.model

    def free(self) -> None:
        """Drop a separate reference model (an adapter-based one costs nothing to keep)."""
        if self.model is not None and not self.model.shares_policy:
            self.model = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    @torch.no_grad()
    def logprobs(self, module: CausalLMModule, batch: Batch) -> Tensor:
        """``(P, 2)`` reference log-probs of the batch's examples, computed now."""
        per_token = label_logprobs(module, self.built(), batch)
        return pair_sums(per_token, batch["sequence_ids"], batch["pair_index"].numel())

    @torch.no_grad()
    def share_logprobs(
        self, module: CausalLMModule, rows: RowsShare, shard: ContextShard, n_pairs: int
    ) -> Tensor:
        """``(P, 2)`` reference log-probs of whole sequences from this rank's ``rows`` of
        them, summed over the context-parallel group of ``shard``."""
        reference = self.built()
        # a model of its own takes the shard; the adapted policy has it set already
        separate = cast("Transformer | None", reference.model)
        if separate is not None:
            separate.set_context_shard(shard)
        try:
            per_token = rows_logprobs(module, reference, rows)
        finally:
            if separate is not None:
                separate.set_context_shard(None)
        assert rows.sequence_ids is not None
        return group_sum(pair_sums(per_token, rows.sequence_ids, n_pairs), shard)

    def of_batch(self, module: CausalLMModule, batch: Batch) -> Tensor:
        """The batch's precomputed reference log-probs, else computed now."""
        reference = batch.get("reference_logps")
        if reference is not None:
            return reference
        if self.precompute and self.model is None:
            raise RuntimeError(
                f"{self.key}.precompute_reference=true but the batch carries no "
                "reference_logps and the reference model was freed"
            )
        return self.logprobs(module, batch)

    def precompute_table(
        self, module: CausalLMModule, batches: Iterable[Batch], n_pairs: int
    ) -> Tensor:
        """``(n_pairs, 2)`` reference log-probs of every example in ``batches``, placed
        by ``pair_index`` (rows of examples not in ``batches`` stay 0)."""
        table = torch.zeros(n_pairs, 2, dtype=torch.float32, device=module.device)
        for batch in batches:
            batch = {
                k: v.to(module.device) if isinstance(v, Tensor) else v for k, v in batch.items()
            }
            with _autocast(module):
                table[batch["pair_index"]] = self.logprobs(module, batch)
        return table

    def on_fit_start(self, module: CausalLMModule) -> None:
        """Match the policy's dtype; with ``precompute``, fill every split's table of
        reference log-probs on the data module and free a separate reference."""
        self.built().match_dtype(next(module.built_model().parameters()).dtype)
        if not self.precompute:
            return
        trainer = module.trainer
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is None or not hasattr(datamodule, "reference_dataloader"):
            raise ConfigError(
                f"{self.key}.precompute_reference=true needs a data module with "
                "reference_dataloader() and set_reference_logps() (PreferenceDataModule)"
            )
        rank, world = trainer.global_rank, trainer.world_size
        for split in SPLITS:
            dataset = datamodule.split_dataset(split)
            if dataset is None or len(dataset) == 0:
                continue
            loader = datamodule.reference_dataloader(split, rank, world)
            table = self.precompute_table(module, loader, len(dataset))
            if world > 1:  # each rank filled its own share of the rows
                table = trainer.strategy.reduce(table, reduce_op="sum")
            datamodule.set_reference_logps(split, table)
        self.free()


def _autocast(module: CausalLMModule):
    try:
        return module.trainer.precision_plugin.forward_context()
    except RuntimeError:  # not attached to a Trainer
        return torch.autocast(module.device.type, enabled=False)
