"""The folders runs and pipelines write: every file name spelled once, here.

A run (``recipes-train``, or one stage of a pipeline) writes into ``run.dir``::

    config.yaml                the resolved config of the run
    checkpoints/               step checkpoints (``stepNNNNNN.ckpt``, files or sharded
      last.ckpt                folders) and the newest one as ``last.ckpt``
    logs/version_N/            the CSV (and TensorBoard) logs of each attempt
    model.safetensors          the output weights (final, averaged or EMA)
    adapter/                   LoRA/QLoRA adapters alone, in PEFT's format
    tokenizer.json             the tokenizer the run read with (and, for chat stages,
    tokenizer_config.json      the chat template it rendered with, as transformers reads it)
    manifest.json              a pipeline stage's hand-off to the next
    stage_fingerprint.json     what a pipeline stage computes, written when it starts

A pipeline's folder holds one such folder per stage and ``report/``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from recipes_lib.data.tokenizer import TOKENIZER_FILE

CONFIG_NAME = "config.yaml"
CHECKPOINTS_DIR = "checkpoints"
LAST_CHECKPOINT_NAME = "last.ckpt"
LOGS_DIR = "logs"
WEIGHTS_NAME = "model.safetensors"
ADAPTER_DIR = "adapter"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
MANIFEST_NAME = "manifest.json"
FINGERPRINT_NAME = "stage_fingerprint.json"
REPORT_DIR = "report"


@dataclass(frozen=True)
class RunDir:
    """The folder of one run (``run.dir``), and the path of everything it writes there."""

    root: Path

    def __init__(self, root: str | os.PathLike):
        object.__setattr__(self, "root", Path(root))

    @property
    def config(self) -> Path:
        return self.root / CONFIG_NAME

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS_DIR

    @property
    def last_checkpoint(self) -> Path:
        """``checkpoints/last.ckpt``: a file, or a folder when the strategy shards."""
        return self.checkpoints / LAST_CHECKPOINT_NAME

    @property
    def logs(self) -> Path:
        return self.root / LOGS_DIR

    @property
    def weights(self) -> Path:
        return self.root / WEIGHTS_NAME

    @property
    def adapter(self) -> Path:
        return self.root / ADAPTER_DIR

    @property
    def tokenizer(self) -> Path:
        return self.root / TOKENIZER_FILE

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST_NAME

    @property
    def fingerprint(self) -> Path:
        return self.root / FINGERPRINT_NAME

    def has_checkpoints(self) -> bool:
        """Whether any checkpoint (file or sharded folder) is in ``checkpoints/``."""
        return self.checkpoints.is_dir() and any(self.checkpoints.glob("*.ckpt"))


def report_dir(pipeline_dir: str | os.PathLike) -> Path:
    """A pipeline's ``report/`` folder (plots and ``summary.json``)."""
    return Path(pipeline_dir) / REPORT_DIR
