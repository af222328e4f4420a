"""Model weights on disk: safetensors files, Lightning checkpoints, checksums and averages.

A stage's output is one ``model.safetensors`` file holding the decoder's state dict
(keys as in :class:`~recipes_lib.models.Transformer`, no ``model.`` prefix). safetensors
refuses tensors that share memory, so a tied output head is stored once and its other
names are recorded in the file's metadata; :func:`load_weights` gives every name back.
Files are written to a temporary name in the same folder and renamed into place, so a
reader never sees a half-written file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from recipes_lib.checkpoint.integrity import recorded_step, verify_checkpoint
from recipes_lib.checkpoint.integrity import sha256_file as sha256_file  # used from here too
from recipes_lib.checkpoint.layout import WEIGHTS_NAME, step_in_name
from recipes_lib.checkpoint.sharded import (
    SHARDED_METADATA_NAME,
    is_sharded_checkpoint,
    read_sharded_checkpoint,
)
from recipes_lib.errors import CheckpointError
from recipes_lib.files import write_atomic

TIED_METADATA_KEY = "recipes_lib.tied"  # JSON {alias: stored name} of shared tensors
MODEL_PREFIX = "model."  # CausalLMModule keeps the decoder under ``self.model``
_MAX_LISTED = 5  # mismatches named in an error message


def _tensor_identity(t: Tensor) -> tuple[Any, ...]:
    """Equal for two names of one tensor (same memory, offset, shape and strides)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


def save_weights(
    state_dict: Mapping[str, Tensor],
    path: str | os.PathLike,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write ``state_dict`` to ``path`` as safetensors, atomically.

    Tensors are detached, moved to the CPU and made contiguous. Names that refer to one
    tensor (tied weights) are stored once; the others are listed in the metadata under
    ``recipes_lib.tied``. Two names that only partly overlap in memory are stored as
    separate copies.

    Args:
        state_dict: name -> tensor, e.g. ``model.state_dict()``.
        path: the file to write; its folder is created if needed.
        metadata: extra string metadata stored in the file's header.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        CheckpointError: a value is not a tensor, or the file cannot be written (an
            existing file at ``path`` is then left as it was).
    """
    target = Path(path)
    tensors: dict[str, Tensor] = {}
    tied: dict[str, str] = {}
    stored_by_identity: dict[tuple[Any, ...], str] = {}
    seen_storages: set[int] = set()
    for name, value in state_dict.items():
        if not isinstance(value, Tensor):
            raise CheckpointError(
                f"cannot save '{target}': '{name}' is a {type(value).__name__}, not a tensor"
            )
        identity = _tensor_identity(value)
        if identity in stored_by_identity:
            tied[name] = stored_by_identity[identity]
            continue
        stored_by_identity[identity] = name
        storage = identity[0]
        tensor = value.detach().cpu()
        # safetensors rejects any overlap in memory: copy a partial alias
        if storage in seen_storages or not tensor.is_contiguous():
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        seen_storages.add(storage)
        tensors[name] = tensor
    header = {"format": "pt", **(metadata or {})}  # "format" as transformers expects it
    if tied:
        header[TIED_METADATA_KEY] = json.dumps(tied, sort_keys=True)
    try:
        write_atomic(target, lambda tmp: save_file(tensors, str(tmp), metadata=header))
    except Exception as err:
        raise CheckpointError(f"cannot write weights to '{target}': {err}") from err
    return target


def _load_safetensors(path: Path) -> dict[str, Tensor]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            state = {name: f.get_tensor(name) for name in f.keys()}
            header = f.metadata() or {}
    except Exception as err:  # safetensors raises its own error types for corrupt files
        raise CheckpointError(f"'{path}' is not a readable safetensors file: {err}") from err
    for alias, stored in json.loads(header.get(TIED_METADATA_KEY, "{}")).items():
        state[alias] = state[stored]
    return state


def read_checkpoint(
    path: str | os.PathLike, mmap: bool = True, verify: bool = True
) -> dict[str, Any]:
    """A torch checkpoint (e.g. Lightning's ``.ckpt``) loaded on the CPU.

    With ``mmap`` the tensors are mapped from the file and read when used, so reading
    one entry does not load the rest; copy what must outlive the file. With ``verify``
    a file with a recorded checksum is checked against it first (once per process, see
    :func:`~recipes_lib.checkpoint.integrity.verify_checkpoint`).

    Raises:
        CheckpointError: the file is missing or is not a loadable torch checkpoint.
        CorruptCheckpointError: it differs from its recorded checksum.
    """
    source = Path(path)
    if not source.is_file():
        raise CheckpointError(f"no such checkpoint file '{source}'")
    if verify:
        verify_checkpoint(source)
    try:
        checkpoint = torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # torch raises pickle, zip and runtime errors here
        raise CheckpointError(f"'{source}' is not a loadable torch checkpoint: {err}") from err
    if not isinstance(checkpoint, dict):
        raise CheckpointError(
            f"'{source}' holds a {type(checkpoint).__name__}, not a checkpoint dictionary"
        )
    return checkpoint


def model_state_of(checkpoint: Mapping[str, Any]) -> dict[str, Tensor]:
    """The decoder's weights in a checkpoint dictionary.

    A Lightning checkpoint keeps them in ``state_dict`` under the ``model.`` prefix,
    which is removed; a plain state dict is returned as it is.
    """
    state = checkpoint.get("state_dict", checkpoint)
    if any(k.startswith(MODEL_PREFIX) for k in state):
        return {
            k.removeprefix(MODEL_PREFIX): v for k, v in state.items() if k.startswith(MODEL_PREFIX)
        }
    return {k: v for k, v in state.items() if isinstance(v, Tensor)}


def load_weights(path: str | os.PathLike) -> dict[str, Tensor]:
    """Model weights from a ``.safetensors`` file, a folder with ``model.safetensors``, a
    torch checkpoint (Lightning ``.ckpt`` or a plain state dict), or a sharded (FSDP)
    checkpoint folder, all on the CPU.

    Raises:
        CheckpointError: the path is missing or unreadable.
    """
    source = Path(path).expanduser()
    if is_sharded_checkpoint(source):
        return model_state_of({"state_dict": read_sharded_checkpoint(source)})
    if source.is_dir():
        source = source / WEIGHTS_NAME
    if not source.is_file():
        raise CheckpointError(f"no such checkpoint file '{source}'")
    if source.suffix == ".safetensors":
        return _load_safetensors(source)
    return model_state_of(read_checkpoint(source))


def mismatch_lines(shapes: list[str], missing: list[str], unexpected: list[str]) -> list[str]:
    """How a checkpoint does not fit a model, one phrase per kind of problem, each with
    its count and the first few names (``3 missing: a, b, c``)."""
    lines = []
    for what, items, sep in (
        ("shape mismatch(es)", shapes, "; "),
        ("missing", missing, ", "),
        ("unexpected", unexpected, ", "),
    ):
        if items:
            lines.append(f"{len(items)} {what}: " + sep.join(items[:_MAX_LISTED]))
    return lines


def _mismatches(expected: Mapping[str, Tensor], found: Mapping[str, Tensor]) -> list[str]:
    shapes = [
        f"{name}: checkpoint {tuple(found[name].shape)} vs model {tuple(t.shape)}"
        for name, t in expected.items()
        if name in found and tuple(found[name].shape) != tuple(t.shape)
    ]
    missing = [name for name in expected if name not in found]
    unexpected = [name for name in found if name not in expected]
    return mismatch_lines(shapes, missing, unexpected)


def load_state_into(
    model: nn.Module, state: Mapping[str, Tensor], source: str, keep: Collection[str] = ()
) -> None:
    """Copy ``state`` into ``model`` (strict), naming the first mismatches when it does not fit.

    Args:
        model: the module to load into.
        state: name -> tensor, names as in ``model.state_dict()``.
        source: how the caller names the weights in an error (``stage.init_from='...'``).
        keep: the model's tensors ``state`` does not hold, which keep their values (a
            reward model's fresh score head).

    Raises:
        CheckpointError: a name is missing or unexpected, or a shape differs.
    """
    expected = {k: v for k, v in model.state_dict().items() if k not in keep}
    problems = _mismatches(expected, state)
    if problems:
        raise CheckpointError(
            f"{source} does not fit the configured model: " + " | ".join(problems)
        )
    incompatible = model.load_state_dict(state, strict=False)
    assert set(incompatible.missing_keys) <= set(keep) and not incompatible.unexpected_keys


def average_checkpoints(paths: Iterable[str | os.PathLike]) -> dict[str, Tensor]:
    """The element-wise fp32 mean of the model weights of several checkpoints.

    Each path is a Lightning checkpoint of a :class:`~recipes_lib.training.CausalLMModule`
    (its ``model.`` weights are averaged, the prefix removed) or a plain state dict.
    Names that share one tensor in the first checkpoint (a tied head) share the mean
    too. Non-floating tensors are taken from the last checkpoint.

    Raises:
        CheckpointError: no paths, or the checkpoints hold different names or shapes.
    """
    sources = [Path(p) for p in paths]
    if not sources:
        raise CheckpointError("average_checkpoints needs at least one checkpoint")
    sums: dict[str, Tensor] = {}
    alias_of: dict[str, str] = {}  # tied name -> the name its mean is kept under
    reference: dict[str, Tensor] = {}
    for index, source in enumerate(sources):
        state = model_state_of(read_checkpoint(source))
        if index == 0:
            reference = state
            first_name: dict[tuple[Any, ...], str] = {}
            for name, tensor in state.items():
                key = _tensor_identity(tensor)
                if key in first_name:
                    alias_of[name] = first_name[key]
                else:
                    first_name[key] = name
        else:
            problems = _mismatches(reference, state)
            if problems:
                raise CheckpointError(
                    f"cannot average '{source}' with '{sources[0]}': " + " | ".join(problems)
                )
        for name, tensor in state.items():
            if name in alias_of:
                continue
            if not tensor.is_floating_point():
                sums[name] = tensor.clone()
            elif index == 0:
                sums[name] = tensor.to(torch.float32, copy=True)
            else:
                sums[name].add_(tensor.to(torch.float32))
        del state
    averaged = {
        name: t.div_(len(sources)) if t.is_floating_point() else t for name, t in sums.items()
    }
    for alias, name in alias_of.items():
        averaged[alias] = averaged[name]
    return {name: averaged[name] for name in reference}


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The ``global_step`` a Lightning checkpoint was saved at: a ``.ckpt`` file, or a
    sharded checkpoint folder. The checksum record names it (nothing else is read);
    a checkpoint without one is opened (a folder's ``meta.pt``, without the weights).

    Raises:
        CheckpointError: the checkpoint is missing or unreadable.
    """
    recorded = recorded_step(path)
    if recorded is not None:
        return recorded
    source = Path(path)
    if is_sharded_checkpoint(source):
        source = source / SHARDED_METADATA_NAME
    step = read_checkpoint(source, verify=False).get("global_step")
    return step if isinstance(step, int) else None


def _mtime_ns(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:  # moved aside or removed since it was listed
        return -1


def listed_step(path: Path) -> int | None:
    """The step of a checkpoint for listing: recorded, read, or else its name's, so one
    that cannot be read is still listed (and can be examined and moved aside)."""
    try:
        step = checkpoint_step(path)
    except CheckpointError:
        step = None
    return step if step is not None else step_in_name(path.name)


def list_step_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """The ``(global_step, path)`` of every step checkpoint in ``directory``, oldest first.

    Every ``*.ckpt`` file (or sharded ``*.ckpt`` folder) counts except ``last*.ckpt``
    and links; the step is the one recorded with its checksum, else read from the
    checkpoint, else the one in its name (a checkpoint with none is left out). Of two
    with the same step, the more recently written one is kept.
    """
    folder = Path(directory)
    by_step: dict[int, Path] = {}
    found = [p for p in folder.glob("*.ckpt") if not p.is_symlink()]
    for path in sorted(found, key=_mtime_ns):
        if path.stem.startswith("last"):
            continue
        step = listed_step(path)
        if step is not None:
            by_step[step] = path
    return sorted(by_step.items())


def consolidate_sharded_checkpoint(
    path: str | os.PathLike, out: str | os.PathLike | None = None
) -> Path:
    """Write the model weights of a sharded checkpoint folder as one ``model.safetensors``
    (default: beside the folder, named ``<folder>.safetensors``), keys as in the native
    model; returns the file written.

    Raises:
        CheckpointError: the folder cannot be read.
    """
    folder = Path(path)
    state = read_sharded_checkpoint(folder)
    weights = {k.removeprefix(MODEL_PREFIX): v for k, v in state.items()}
    target = Path(out) if out is not None else folder.with_suffix(".safetensors")
    save_weights(weights, target, metadata={"source": str(folder)})
    return target
