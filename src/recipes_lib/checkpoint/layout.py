"""The folders runs and pipelines write: every file name spelled once, here.

A run (``recipes-train``, or one stage of a pipeline) writes into ``run.dir``::

    config.yaml                the resolved config of the run
    checkpoints/               step checkpoints (``stepNNNNNN.ckpt``, files or sharded
      last.ckpt                folders) and ``last.ckpt``: a link to the newest one, or a
                               copy at the final step
      stepNNNNNN.ckpt.sha256.json  beside a checkpoint file: its size, checksum and step
      stepNNNNNN.ckpt/sha256.json  inside a sharded folder: each file's size and checksum
      *.corrupt-<time>         a checkpoint that failed verification, moved aside
    logs/version_N/            the CSV (and TensorBoard) logs of each attempt
    model.safetensors          the output weights (final, averaged or EMA)
    adapter/                   LoRA/QLoRA adapters alone, in PEFT's format
    hf/                        the output as a Hugging Face folder (``stage.export_hf``):
                               config.json, weights and tokenizer in the model's family
    tokenizer.json             the tokenizer the run read with (and, for chat stages,
    tokenizer_config.json      the chat template it rendered with, as transformers reads it)
    manifest.json              a pipeline stage's hand-off to the next
    stage_fingerprint.json     what a pipeline stage computes, written when it starts
    hang_stacks.rankN.txt      every thread's Python stack on rank N when the hang
                               watchdog ended the run (conf/callbacks: watchdog)
    run.lock                   while a run writes here: the process holding the folder
                               (``recipes_lib.checkpoint.run_lock``)

A pipeline's folder holds one such folder per stage, ``report/`` and its own ``run.lock``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from recipes_lib.data.tokenizer import TOKENIZER_FILE

CONFIG_NAME = "config.yaml"
CHECKPOINTS_DIR = "checkpoints"
LAST_CHECKPOINT_NAME = "last.ckpt"
LOGS_DIR = "logs"
WEIGHTS_NAME = "model.safetensors"
ADAPTER_DIR = "adapter"
HF_DIR = "hf"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
MANIFEST_NAME = "manifest.json"
FINGERPRINT_NAME = "stage_fingerprint.json"
REPORT_DIR = "report"
STEP_CHECKPOINT = "step{step:06d}.ckpt"  # the step checkpoints (conf/callbacks: filename)
# the size and checksum (xxh3_128; SHA-256 in older records) of what a checkpoint holds:
# beside a file (``<name>.sha256.json``), inside a sharded folder (``sha256.json``,
# written before the folder gets its name); the names predate xxh3 and stay
CHECKSUM_SUFFIX = ".sha256.json"
SHARDED_CHECKSUM_NAME = "sha256.json"
PARTIAL_SUFFIX = ".partial"  # a sharded folder being written: ``.<name>.partial``
HANG_STACKS = "hang_stacks.rank{rank}.txt"  # (conf/callbacks: watchdog.stacks_file)
LOCK_NAME = "run.lock"
_STEP_IN_NAME = re.compile(r"step=?(\d+)")


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
    def hf(self) -> Path:
        """``hf/``: the output weights as a Hugging Face folder."""
        return self.root / HF_DIR

    @property
    def tokenizer(self) -> Path:
        return self.root / TOKENIZER_FILE

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST_NAME

    @property
    def fingerprint(self) -> Path:
        return self.root / FINGERPRINT_NAME

    @property
    def lock(self) -> Path:
        """``run.lock``: held by the one process writing the folder."""
        return self.root / LOCK_NAME

    def step_checkpoint(self, step: int) -> Path:
        """``checkpoints/stepNNNNNN.ckpt``: the checkpoint saved after ``step`` updates."""
        return self.checkpoints / STEP_CHECKPOINT.format(step=step)

    def hang_stacks(self, rank: int) -> Path:
        """``hang_stacks.rankN.txt``: rank N's stacks when the hang watchdog fired."""
        return self.root / HANG_STACKS.format(rank=rank)

    def has_checkpoints(self) -> bool:
        """Whether any checkpoint (file or sharded folder, or a link to one) is in
        ``checkpoints/``; a link to nothing is none."""
        found = self.checkpoints.glob("*.ckpt") if self.checkpoints.is_dir() else ()
        return any(p.exists() for p in found)


def checksum_sidecar(checkpoint: str | os.PathLike) -> Path:
    """``<name>.sha256.json`` beside a checkpoint file: its checksum, recorded as it was written."""
    path = Path(checkpoint)
    return path.with_name(path.name + CHECKSUM_SUFFIX)


def is_own_link(path: str | os.PathLike) -> bool:
    """Whether ``path`` is the link a run makes itself: ``last.ckpt`` naming a checkpoint in
    its own folder. Any other link there was placed by someone else."""
    link = Path(path)
    if not (link.is_symlink() and link.name == LAST_CHECKPOINT_NAME):
        return False
    target = Path(os.readlink(link))
    return not target.is_absolute() and target.parent == Path(".")


def partial_checkpoint(checkpoint: str | os.PathLike) -> Path:
    """``.<name>.partial`` beside ``checkpoint``: where a sharded folder is written before it
    is renamed into place (every rank derives the same name)."""
    path = Path(checkpoint)
    return path.with_name(f".{path.name}{PARTIAL_SUFFIX}")


def step_in_name(name: str) -> int | None:
    """The step a checkpoint's name carries (``step000200.ckpt``, Lightning's
    ``epoch=0-step=200.ckpt``), or None."""
    found = _STEP_IN_NAME.search(name)
    return int(found.group(1)) if found else None


def report_dir(pipeline_dir: str | os.PathLike) -> Path:
    """A pipeline's ``report/`` folder (plots and ``summary.json``)."""
    return Path(pipeline_dir) / REPORT_DIR
