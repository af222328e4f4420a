"""Pretraining: next-token prediction on packed text, the base module as it is.

Batch contract (from :class:`~recipes_lib.data.PretrainDataModule`): ``input_ids`` and
``labels`` ``(B, T)``, rows of ``data.seq_len`` tokens, and ``doc_ids`` ``(B, T)`` for
document masking. Continued pretraining from weights reads the text with the tokenizer
beside them.
"""

from __future__ import annotations

import dataclasses

import lightning as L

from recipes_lib.config.schema import RunConfig
from recipes_lib.data import PretrainDataModule
from recipes_lib.data.tokenizer import init_tokenizer_path
from recipes_lib.objectives.registry import ObjectiveSpec, register_objective
from recipes_lib.training.module import CausalLMModule


def pretrain_data(cfg: RunConfig, *, total_train_samples: int) -> L.LightningDataModule:
    """Packed text, tokenized with the tokenizer beside ``stage.init_from`` if any."""
    tokenizer = init_tokenizer_path(cfg.data, cfg.stage.init_from)
    return PretrainDataModule(
        dataclasses.replace(
            cfg.data, tokenizer=dataclasses.replace(cfg.data.tokenizer, path=tokenizer)
        ),
        model_vocab_size=cfg.model.vocab_size,
        model_max_seq_len=cfg.model.max_seq_len,
        total_train_samples=total_train_samples,
    )


PRETRAIN = register_objective(
    ObjectiveSpec(
        name="pretrain",
        module=CausalLMModule.from_run_config,
        data=pretrain_data,
        batch="input_ids, labels, doc_ids (B, data.seq_len)",
        loss="causal_lm_loss",
        from_scratch=True,
        context_parallel=True,
    )
)
