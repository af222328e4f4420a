"""Sharded checkpoints: the folders FSDP2 runs write with ``torch.distributed.checkpoint``
(one file per rank plus ``.metadata``, ``meta.pt`` and ``sha256.json``; see
:mod:`recipes_lib.checkpoint.sharded_save`), read back as one whole state dict on the
CPU, so they can start another stage, be exported, or be converted to a single file
(:func:`recipes_lib.checkpoint.weights.consolidate_sharded_checkpoint`).
"""

from __future__ import annotations

import os
from pathlib import Path

from torch import Tensor

from recipes_lib.checkpoint.integrity import verify_checkpoint
from recipes_lib.errors import CheckpointError

# the loops, callbacks and step of a sharded Lightning checkpoint (all but the tensors)
SHARDED_METADATA_NAME = "meta.pt"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder written by ``torch.distributed.checkpoint``."""
    return Path(path).is_dir() and (Path(path) / ".metadata").is_file()


def read_sharded_checkpoint(path: str | os.PathLike) -> dict[str, Tensor]:
    """The model weights of a sharded checkpoint folder, gathered into one state dict on
    the CPU (keys as in the LightningModule's state dict, e.g. ``model.layers.0...``).

    Raises:
        CheckpointError: the folder is not a sharded checkpoint or cannot be read.
        CorruptCheckpointError: a file differs from the checksums recorded in the folder.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    folder = Path(path)
    if not is_sharded_checkpoint(folder):
        raise CheckpointError(f"'{folder}' is not a sharded checkpoint folder (no .metadata file)")
    verify_checkpoint(folder)
    state: dict = {}
    try:
        _load_state_dict(
            state,
            storage_reader=FileSystemReader(folder),
            planner=_EmptyStateDictLoadPlanner(keys={"state_dict"}),
            no_dist=True,
        )
    except Exception as err:  # noqa: BLE001 - any unreadable shard is one error here
        raise CheckpointError(f"cannot read sharded checkpoint '{folder}': {err}") from err
    weights = state.get("state_dict")
    if not isinstance(weights, dict) or not weights:
        raise CheckpointError(f"sharded checkpoint '{folder}' holds no model state_dict")
    return {k: v for k, v in weights.items() if isinstance(v, Tensor)}
