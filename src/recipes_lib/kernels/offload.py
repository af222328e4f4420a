"""Activation offload: the inputs that activation checkpointing keeps, held in host memory.

A checkpointed block keeps only its input hidden states ``(B, T, C)`` for the backward
pass and recomputes the rest. At long sequence lengths those inputs are what remains
on the device: one ``(B, T, C)`` tensor per checkpointed block. With
``kernels.activation_offload=true`` they are copied to pinned host memory as the
forward pass saves them, and copied back when the backward pass recomputes the block.

How it overlaps with compute (CUDA): each copy runs on a side stream, which first
waits for the compute stream to have produced the tensor; the device tensor is
released to the allocator once that copy has run (``record_stream``), so the next
blocks compute while the previous inputs travel. In the backward pass, unpacking a
block's input also starts the copy back of the block before it (the next one the
backward needs), so its transfer runs while this block is recomputed. On a CPU the
same hooks make a plain copy (nothing to move): the CPU tests run the same path.

The hooks are :func:`torch.autograd.graph.saved_tensors_hooks`, entered around each
checkpointed block's call by the decoder (:func:`offloaded`), outside any compiled
region: ``torch.utils.checkpoint`` saves its inputs through them (and nothing else:
what the block computes inside is held by the checkpoint's own hooks), and a compiled
block saves what its graph keeps through them. Only floating-point tensors shaped like
the block's input go to the host; the RoPE tables and masks the blocks share stay.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator

import torch
from torch import Tensor


class _HostCopy:
    """One saved tensor in host memory, and its way back to the device."""

    def __init__(self, tensor: Tensor, stream: torch.cuda.Stream | None, previous) -> None:
        self.device = tensor.device
        # the copy saved just before this one: the backward pass needs it next
        self.previous: weakref.ref[_HostCopy] | None = previous
        self.back: Tensor | None = None  # on the device again, once fetched
        self.used = False  # handed to the backward pass once: a prefetch skips it
        self.arrived: torch.cuda.Event | None = None
        self.left: torch.cuda.Event | None = None
        if stream is None:  # a CPU tensor: a plain copy
            self.host = tensor.detach().clone()
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))  # tensor is written
        with torch.cuda.stream(stream):
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor.detach(), non_blocking=True)
            self.left = torch.cuda.Event()
            self.left.record(stream)
        # the allocator reuses the device memory only once the side stream has copied it
        tensor.record_stream(stream)

    def fetch(self, stream: torch.cuda.Stream | None, *, again: bool = False) -> None:
        """Start copying back to the device (on ``stream``), unless already started, or
        already used and not asked for ``again`` (a second backward pass over the same
        graph): a prefetch never brings back a copy the backward pass is done with."""
        if stream is None or self.back is not None or (self.used and not again):
            return
        with torch.cuda.stream(stream):
            if self.left is not None:
                stream.wait_event(self.left)
            self.back = self.host.to(self.device, non_blocking=True)
            self.arrived = torch.cuda.Event()
            self.arrived.record(stream)


class ActivationOffload:
    """Saved-tensor hooks that keep checkpointed blocks' inputs in host memory.

    One per model; the same two hook functions every call (``torch.compile`` guards
    on the hooks in place). See the module docstring for what goes to the host and
    how the copies overlap with compute.
    """

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._shape: torch.Size | None = None  # the current block input's
        self._last: weakref.ref[_HostCopy] | None = None
        self._hooks = (self._pack, self._unpack)
        self.copies = 0  # tensors sent to the host so far (what the tests count)

    @contextlib.contextmanager
    def block_inputs(self, hidden: Tensor) -> Iterator[None]:
        """Within: saved floating-point tensors shaped like ``hidden`` go to the host."""
        self._shape = hidden.shape
        try:
            with torch.autograd.graph.saved_tensors_hooks(*self._hooks):
                yield
        finally:
            self._shape = None

    def _stream(self, device: torch.device) -> torch.cuda.Stream | None:
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _pack(self, tensor: Tensor) -> Tensor | _HostCopy:
        if tensor.shape != self._shape or not tensor.is_floating_point():
            return tensor  # shared tables and masks, integer ids: kept as they are
        copy = _HostCopy(tensor, self._stream(tensor.device), self._last)
        self._last = weakref.ref(copy)
        self.copies += 1
        return copy

    def _unpack(self, packed: Tensor | _HostCopy) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        stream = self._stream(packed.device)
        if stream is None:
            return packed.host
        packed.fetch(stream, again=True)
        current = torch.cuda.current_stream(packed.device)
        assert packed.arrived is not None and packed.back is not None  # fetched just now
        current.wait_event(packed.arrived)
        back, packed.back, packed.used = packed.back, None, True
        back.record_stream(current)  # allocated on the side stream, used on this one
        previous = packed.previous() if packed.previous is not None else None
        if previous is not None:  # its transfer overlaps this block's recomputation
            previous.fetch(stream)
        return back


def offloaded(
    offload: ActivationOffload | None, hidden: Tensor, checkpointed: bool
) -> contextlib.AbstractContextManager[None]:
    """The context a block runs in: ``offload``'s hooks around a checkpointed block
    that builds a graph for the backward, else nothing."""
    if offload is None or not checkpointed or not torch.is_grad_enabled():
        return contextlib.nullcontext()
    return offload.block_inputs(hidden)


__all__ = ["ActivationOffload", "offloaded"]
