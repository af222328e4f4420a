"""One copy of a checkpoint in host memory, so it can be written while training goes on.

An asynchronous save must not write tensors that the next optimizer step changes, so
:class:`HostStaging` copies the checkpoint once and the writer thread writes the copy.
Tensors are copied storage by storage into host buffers that are kept and reused from
one save to the next (pinned on a CUDA machine, so the copy from the GPU runs at the
link's speed and needs no second bounce through pageable memory). Tensors that share a
storage (tied weights, views) share the staged storage too, at the same offsets, and a
tensor met twice is staged once, so
``torch.save`` writes the staged checkpoint byte for byte as it would the original on
the CPU. Everything else (loop counters, callback states) is deep-copied.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


class HostStaging:
    """Copies checkpoints into reusable host buffers (see the module docstring)."""

    def __init__(self) -> None:
        self._buffers: list[torch.UntypedStorage] = []  # reused in the order they were met

    def stage(self, checkpoint: Any) -> Any:
        """A copy of ``checkpoint`` whose tensors live in this object's host buffers.

        The buffers are overwritten by the next ``stage``: write the copy first.
        """
        storages: dict[tuple[str, int], torch.UntypedStorage] = {}
        tensors: dict[
            int, torch.Tensor
        ] = {}  # one staged tensor per tensor object, as pickle memoizes
        cuda = False

        def copy_tensor(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal cuda
            source = tensor.untyped_storage()
            key = (str(source.device), source.data_ptr())
            if key not in storages:
                storages[key] = self._buffer(len(storages), source)
                storages[key].copy_(source, non_blocking=source.device.type == "cuda")
                cuda = cuda or source.device.type == "cuda"
            staged = torch.empty(0, dtype=tensor.dtype)
            staged.set_(storages[key], tensor.storage_offset(), tensor.size(), tensor.stride())
            return staged.requires_grad_(tensor.requires_grad)

        def walk(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if id(value) not in tensors:
                    tensors[id(value)] = copy_tensor(value)
                return tensors[id(value)]
            if isinstance(value, dict):
                out = copy.copy(value)  # keeps the mapping's own type
                for k, v in value.items():
                    out[k] = walk(v)
                return out
            if isinstance(value, list | tuple) and type(value) in (list, tuple):
                return type(value)(walk(v) for v in value)
            return copy.deepcopy(value)

        staged = walk(checkpoint)
        if cuda:
            torch.cuda.synchronize()  # the non-blocking copies have landed
        return staged

    def _buffer(self, index: int, source: torch.UntypedStorage) -> torch.UntypedStorage:
        """The ``index``-th buffer, reused when it has ``source``'s size."""
        if index < len(self._buffers) and self._buffers[index].nbytes() == source.nbytes():
            return self._buffers[index]
        pin = source.device.type == "cuda"
        buffer = torch.UntypedStorage(source.nbytes(), device="cpu")
        if pin:
            buffer = buffer.pin_memory()
        if index < len(self._buffers):
            self._buffers[index] = buffer
        else:
            self._buffers.append(buffer)
        return buffer

    def release(self) -> None:
        """Free the host buffers."""
        self._buffers.clear()
