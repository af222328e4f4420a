"""The model summary as one log line, with the FLOPs per token the module computes."""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ModelSummary

from recipes_lib.callbacks.progress import format_count

log = logging.getLogger(__name__)


class ModelSizeSummary(ModelSummary):
    """Logs ``model: Transformer, 918k params (918k trainable, 3.7 MB), 6.3M FLOPs per
    token trained at seq_len 256`` when fitting starts (global rank 0).

    Lightning's own summary counts FLOPs by running the module on an
    ``example_input_array``; our modules have none, so it printed a FLOPs column of
    zeros and "Total FLOPs: 0". The FLOPs here are the module's
    ``flops_per_token(seq_len)`` (forward and backward, as the throughput figures use);
    left out when the module has no such method or no ``seq_len`` is given. Being a
    ``ModelSummary``, it replaces Lightning's default one.

    Args:
        seq_len: Tokens per sequence the FLOPs are counted at (the run's ``data.seq_len``).
        max_depth: As for Lightning's ``ModelSummary``: 0 turns the summary off.
    """

    def __init__(self, seq_len: int | None = None, max_depth: int = 1):
        super().__init__(max_depth=max_depth)
        self.seq_len = seq_len

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._max_depth or not trainer.is_global_zero:
            return
        summary = self._summary(trainer, pl_module)
        log.info("%s", self.summary_line(pl_module, summary))

    def summary_line(self, pl_module: L.LightningModule, summary: Any) -> str:
        """The line for a Lightning ``ModelSummary``/``DeepSpeedSummary`` of ``pl_module``."""
        names = [type(m).__name__ for m in pl_module.children()] or [type(pl_module).__name__]
        line = (
            f"model: {', '.join(names)}, {format_count(summary.total_parameters)} params "
            f"({format_count(summary.trainable_parameters)} trainable, "
            f"{summary.model_size:.1f} MB)"
        )
        flops = self.flops_per_token(pl_module)
        if flops is not None:
            line += f", {format_count(flops)} FLOPs per token trained at seq_len {self.seq_len}"
        return line

    def flops_per_token(self, pl_module: L.LightningModule) -> float | None:
        method = getattr(pl_module, "flops_per_token", None)
        if self.seq_len is None or not callable(method):
            return None
        return float(method(self.seq_len))
