"""Supervised fine-tuning: next-token loss on the assistant's tokens only.

Batch contract (from :class:`~recipes_lib.data.chat.module.ChatDataModule`):
``input_ids`` ``(B, T)``; ``labels`` ``(B, T)``, the next token where that token is
assistant output (its content and end-of-turn token) and ``-100`` on system and user
turns, role headers, padding and each conversation's last position; ``doc_ids``
``(B, T)`` numbering the conversations packed into a row (used when
``data.document_mask``). Because the labels already carry the mask, the loss is the
causal-LM loss of :class:`~recipes_lib.training.module.CausalLMModule`: a mean over the
assistant tokens of the batch. LoRA and QLoRA come from the ``adapter`` config, applied
by the base module.

Its parts other objectives compose: :func:`assistant_tokens` (distillation's metric),
:func:`chat_rows_vary` and :func:`save_chat_tokenizer_beside_outputs` (every chat
objective's).
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
from torch import Tensor

from recipes_lib.config.schema import RunConfig
from recipes_lib.data.chat.module import build_chat_data
from recipes_lib.losses.cross_entropy import IGNORE_INDEX
from recipes_lib.objectives.registry import ObjectiveSpec, register_objective
from recipes_lib.training.module import Batch, CausalLMModule


def chat_rows_vary(cfg: RunConfig) -> bool:
    """Whether chat rows vary in shape: packed rows all have ``data.seq_len`` tokens."""
    return not cfg.data.chat.packing


def assistant_tokens(batch: Batch) -> Tensor:
    """The tokens of ``batch`` that train (the assistant's), as a float for logging."""
    return (batch["labels"] != IGNORE_INDEX).sum().float()


def save_chat_tokenizer_beside_outputs(module: L.LightningModule) -> Path | None:
    """At the end of a chat stage, write the tokenizer and the chat template it trained
    with into the run's folder (``trainer.default_root_dir``, where ``model.safetensors``
    goes) on global rank 0, when the data module can (``save_tokenizer(folder)``: the
    SFT and preference data modules). Returns the folder written, or None."""
    trainer = module.trainer
    # Lightning's data connector sets Trainer.datamodule, which the class does not declare
    save = getattr(trainer.datamodule, "save_tokenizer", None)  # type: ignore[attr-defined]
    if not trainer.is_global_zero or not callable(save):
        return None
    return save(Path(trainer.default_root_dir))


class SFTModule(CausalLMModule):
    """Fine-tunes on conversations; logs ``assistant_tokens`` (trained tokens per batch).

    When fitting ends, the run's folder gets the tokenizer and chat template the
    conversations were rendered with (see :func:`save_chat_tokenizer_beside_outputs`).

    Takes the arguments of :class:`~recipes_lib.training.module.CausalLMModule`.
    """

    def compute_loss(self, batch: Batch) -> tuple[Tensor, dict[str, Tensor]]:
        loss, metrics = super().compute_loss(batch)
        metrics["assistant_tokens"] = assistant_tokens(batch)
        return loss, metrics

    def on_fit_end(self) -> None:
        save_chat_tokenizer_beside_outputs(self)


SFT = register_objective(
    ObjectiveSpec(
        name="sft",
        module=SFTModule.from_run_config,
        data=build_chat_data,
        batch="input_ids, labels (-100 off the assistant's tokens), doc_ids (B, T)",
        loss="causal_lm_loss on the assistant's tokens",
        batches_vary=chat_rows_vary,
        context_parallel=True,
    )
)
