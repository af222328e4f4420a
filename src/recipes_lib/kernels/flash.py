"""FlashAttention-2 backends, over the documents of packed rows and within a window:
``varlen`` (PyTorch's own kernel, the one under :mod:`torch.nn.attention.varlen`, no
extra package) and ``flash_attn`` (the ``flash_attn`` package). Both take a flattened batch
with the documents' offsets (:class:`VarlenMask`), so a packed row costs what its
documents cost and no mask is ever built or compiled. ``kernels.attention=auto`` takes
``varlen`` for the global layers of short packed rows on a CUDA GPU in bf16
(:func:`recipes_lib.kernels.choice.packed_rows_backend`)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import Tensor

from recipes_lib.errors import UnsupportedKernelError
from recipes_lib.kernels.attention import _HALF_DTYPES, AttentionBackend, AttentionCapabilities

# The flash_attn module once imported (kept at module level: a model holding a backend
# must stay deep-copyable, and a module object is not).
_flash_attn_module: ModuleType | None = None


def _load_flash_attn() -> tuple[ModuleType | None, str | None]:
    """The flash_attn module and None, or None and why it cannot be imported."""
    global _flash_attn_module
    if _flash_attn_module is None:
        try:
            _flash_attn_module = importlib.import_module("flash_attn")
        except Exception as err:  # a broken build raises more than ImportError
            return None, f"{type(err).__name__}: {err}"
    return _flash_attn_module, None


@dataclass(frozen=True)
class VarlenMask:
    """Document boundaries of a flattened batch, and the window.

    ``cu_seqlens`` (int32, ``(n_docs + 1,)``) holds the offsets of each document in the
    ``B * T`` tokens, or is None for whole rows; ``max_seqlen`` bounds every document's
    length; ``window`` is the keys a query sees (None: every earlier one).
    """

    cu_seqlens: Tensor | None
    max_seqlen: int
    window: int | None = None


_FLASH_CAPABILITIES = AttentionCapabilities(
    document_mask=True,
    gqa=True,
    dtypes=_HALF_DTYPES,
    devices=("cuda",),
    min_cuda_capability=(8, 0),
)


class _FlashBackend(AttentionBackend):
    """What the two FlashAttention-2 backends share: the mask, the layout and the window.

    A document is a run of consecutive equal ids within a row. Subclasses run the kernel
    on whole rows (:meth:`_rows`) and on documents laid end to end (:meth:`_documents`).
    """

    capabilities = _FLASH_CAPABILITIES

    def build_mask(
        self,
        doc_ids: Tensor | None,
        seq_len: int,
        *,
        device: torch.device | str | None = None,
        window: int | None = None,
    ) -> VarlenMask | None:
        if doc_ids is None:
            return None if window is None else VarlenMask(None, seq_len, window)
        if doc_ids.ndim != 2 or doc_ids.shape[1] != seq_len:
            raise ValueError(f"doc_ids must be (B, {seq_len}), got {tuple(doc_ids.shape)}")
        # A document starts at each row's first token and wherever the id changes.
        starts = torch.ones_like(doc_ids, dtype=torch.bool)  # (B, T)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        offsets = starts.flatten().nonzero().flatten()  # (n_docs,)
        total = torch.tensor([doc_ids.numel()], device=doc_ids.device)
        cu_seqlens = torch.cat([offsets, total]).to(torch.int32)  # (n_docs + 1,)
        # No document is longer than a row; an upper bound avoids a host sync.
        return VarlenMask(cu_seqlens=cu_seqlens, max_seqlen=seq_len, window=window)

    def row_tensors(self, mask: object | None) -> list[Tensor]:
        # the documents' offsets: how many a batch holds varies as its rows do
        if isinstance(mask, VarlenMask) and mask.cu_seqlens is not None:
            return [mask.cu_seqlens]
        return []

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: object | None,
        scale: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        if sinks is not None:  # refused when the model is built; here for any other caller
            raise UnsupportedKernelError(
                f"kernels.attention={self.name} cannot add attention sinks"
            )
        if mask is not None and not isinstance(mask, VarlenMask):
            raise TypeError(
                f"kernels.attention={self.name} needs None or the VarlenMask from "
                f"build_mask(), got {type(mask).__name__}"
            )
        B, H, T, D = q.shape
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, T, heads, D)
        # keys up to window - 1 before the query, and none after it
        window = mask.window if mask is not None else None
        if mask is None or mask.cu_seqlens is None:
            y = self._rows(q, k, v, scale=scale, window=window)  # (B, T, H, D)
        else:
            # (B * T, heads, D): documents laid end to end
            q, k, v = (x.reshape(B * T, x.shape[2], D) for x in (q, k, v))
            y = self._documents(q, k, v, mask, scale=scale).view(B, T, H, D)
        return y.transpose(1, 2)  # (B, H, T, D)

    def _rows(self, q: Tensor, k: Tensor, v: Tensor, *, scale, window) -> Tensor:
        raise NotImplementedError

    def _documents(self, q: Tensor, k: Tensor, v: Tensor, mask: VarlenMask, *, scale) -> Tensor:
        raise NotImplementedError


class FlashAttention(_FlashBackend):
    """The ``flash_attn`` package (FlashAttention 2): CUDA, fp16/bf16, causal;
    ``flash_attn_varlen_func`` over the documents of the flattened batch."""

    name = "flash_attn"

    def unavailable_reason(self) -> str | None:
        _, error = _load_flash_attn()
        if error is None:
            return None
        return (
            f"the flash_attn package cannot be imported ({error}); "
            "install it with `pip install recipes-lib[flash]`"
        )

    def _module(self) -> ModuleType:
        flash_attn = _flash_attn_module or _load_flash_attn()[0]
        if flash_attn is None:
            raise UnsupportedKernelError(
                f"kernels.attention={self.name}: {self.unavailable_reason()}"
            )
        return flash_attn

    @staticmethod
    def _kwargs(scale: float | None, window: int | None) -> dict[str, object]:
        kwargs: dict[str, object] = {"causal": True}
        if scale is not None:
            kwargs["softmax_scale"] = scale
        if window is not None:
            kwargs["window_size"] = (window - 1, 0)
        return kwargs

    def _rows(self, q, k, v, *, scale, window):
        return self._module().flash_attn_func(q, k, v, **self._kwargs(scale, window))

    def _documents(self, q, k, v, mask, *, scale):
        cu, n = mask.cu_seqlens, mask.max_seqlen
        kwargs = self._kwargs(scale, mask.window)
        return self._module().flash_attn_varlen_func(q, k, v, cu, cu, n, n, **kwargs)


def _torch_varlen_reason() -> str | None:
    """Why this torch cannot run its FlashAttention-2 kernel, or None."""
    if not torch.backends.cuda.is_flash_attention_available():
        return f"this torch ({torch.__version__}) was built without its flash attention kernel"
    return None


class TorchVarlenAttention(_FlashBackend):
    """PyTorch's own FlashAttention-2 kernel over variable-length rows: CUDA, fp16/bf16,
    causal, within documents and windows, grouped-query heads. Whole rows are one
    document each.

    It calls ``aten._flash_attention_forward``, the operator under both
    :func:`torch.nn.attention.varlen.varlen_attn` and SDPA's flash path: differentiable,
    traced by ``torch.compile``, and with the same arguments in every torch this
    library supports, where ``varlen_attn``'s own keywords (``scale``, ``window_size``,
    ``enable_gqa``) arrived release by release.
    """

    name = "varlen"

    def unavailable_reason(self) -> str | None:
        return _torch_varlen_reason()

    def _rows(self, q, k, v, *, scale, window):
        B, T = q.shape[:2]
        starts = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device)
        fq, fk, fv = (x.reshape(B * T, *x.shape[2:]) for x in (q, k, v))
        y = self._documents(fq, fk, fv, VarlenMask(starts, T, window), scale=scale)
        return y.view(B, T, *q.shape[2:])

    def _documents(self, q, k, v, mask, *, scale):
        cu, n = mask.cu_seqlens, mask.max_seqlen
        kwargs: dict[str, object] = {"scale": scale}
        if mask.window is not None:  # keys up to window - 1 before the query
            kwargs.update(window_size_left=mask.window - 1, window_size_right=0)
        # (output, log-sum-exp, RNG state, unused, debug mask); the kernel takes fewer
        # key/value heads than query heads as they are
        out = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, n, n, 0.0, True, False, **kwargs
        )
        return out[0]
