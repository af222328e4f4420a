"""Tiny, quiet pieces the tests build their runs from: a CPU Trainer that prints and saves
nothing unless asked, a small decoder config, and the overrides that shrink a recipe's
vocabulary and quiet its console. Imported as ``from tiny import ...`` from any test
(``tests/`` is on ``sys.path`` through ``tests/conftest.py``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ProgressBar
from torch.utils.data import DataLoader

from recipes_lib.config.schema import ModelConfig

# a 512-token vocabulary for the model and the tokenizer trained for it
SMALL_VOCAB_OVERRIDES = ("model.vocab_size=512", "data.tokenizer.vocab_size=512")
# no progress bar or model summary in a run's output
QUIET_OVERRIDES = ("trainer.enable_progress_bar=false", "trainer.enable_model_summary=false")


def quiet_trainer(max_steps: int, callbacks: Iterable[L.Callback] = (), **overrides: Any):
    """A one-device CPU Trainer with no logger, progress bar, model summary or checkpoints.

    A ``ModelCheckpoint`` or a progress bar among ``callbacks`` turns its switch on (Lightning
    refuses one while the switch is off); ``overrides`` are any other Trainer arguments,
    ``accelerator="gpu"`` or ``logger=...`` included.
    """
    callbacks = list(callbacks)
    settings: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=any(isinstance(c, ProgressBar) for c in callbacks),
        enable_model_summary=False,
        callbacks=callbacks,
    )
    settings.update(overrides)
    return L.Trainer(**settings)


def step_loader(micro_batches: Sequence[Any], accumulate: int) -> DataLoader:
    """``micro_batches`` in order, ``accumulate`` at a time as one optimizer step's list:
    the batches a recipes module trains one step on (a run's data module groups them
    so; a plain loader of single batches is one micro-batch per step)."""
    return DataLoader(
        list(micro_batches),
        batch_size=accumulate,
        collate_fn=list,
        shuffle=False,
        generator=torch.Generator(),  # leaves the global torch RNG untouched
    )


def step_checkpoints(folder: Path, every: int) -> ModelCheckpoint:
    """A ModelCheckpoint that keeps a ``step{N}.ckpt`` in ``folder`` every ``every`` steps."""
    return ModelCheckpoint(
        dirpath=folder,
        filename="step{step}",
        every_n_train_steps=every,
        save_top_k=-1,
        auto_insert_metric_name=False,
    )


def family_overrides(name: str) -> list[str]:
    """``model.family=NAME`` and the block options the family fixes, as overrides (the
    options it reads from a config.json, such as Gemma 3's windows, are the test's)."""
    from recipes_lib.models.families import get_family

    def value(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else str(v)

    fixed = get_family(name).fixed
    return [f"model.family={name}", *(f"model.{k}={value(v)}" for k, v in fixed.items())]


def tiny_model_config(**changes: Any) -> ModelConfig:
    """A two-layer decoder that trains in a second on a CPU (dim 32, 4 query and 2 KV heads,
    a 64-token vocabulary); ``changes`` set any other field, e.g. the shape a test needs."""
    values: dict[str, Any] = dict(
        vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32
    )
    values.update(changes)
    return ModelConfig(**values)


class StopAtStep(Callback):
    """Ends training once ``step`` optimizer steps are done, as a preemption would."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = True
