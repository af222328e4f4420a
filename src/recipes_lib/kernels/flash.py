"""The ``flash_attn`` backend (FlashAttention 2): causal attention on CUDA in fp16/bf16,
over the documents of packed rows (``flash_attn_varlen_func``) and within a window."""

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
    """Document boundaries of a flattened batch for ``flash_attn_varlen_func``, and the
    window.

    ``cu_seqlens`` (int32, ``(n_docs + 1,)``) holds the offsets of each document in the
    ``B * T`` tokens, or is None for whole rows; ``max_seqlen`` bounds every document's
    length; ``window`` is the keys a query sees (None: every earlier one).
    """

    cu_seqlens: Tensor | None
    max_seqlen: int
    window: int | None = None


class FlashAttention(AttentionBackend):
    """The ``flash_attn`` package (FlashAttention 2): CUDA, fp16/bf16, causal.

    With ``doc_ids`` it runs ``flash_attn_varlen_func`` over the documents of the
    flattened batch. A document is a run of consecutive equal ids within a row.
    """

    name = "flash_attn"
    capabilities = AttentionCapabilities(
        document_mask=True,
        gqa=True,
        dtypes=_HALF_DTYPES,
        devices=("cuda",),
        min_cuda_capability=(8, 0),
    )

    def unavailable_reason(self) -> str | None:
        _, error = _load_flash_attn()
        if error is None:
            return None
        return (
            f"the flash_attn package cannot be imported ({error}); "
            "install it with `pip install recipes-lib[flash]`"
        )

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
        flash_attn = _flash_attn_module or _load_flash_attn()[0]
        if flash_attn is None:
            raise UnsupportedKernelError(
                f"kernels.attention={self.name}: {self.unavailable_reason()}"
            )
        B, H, T, D = q.shape
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, T, heads, D)
        window = mask.window if isinstance(mask, VarlenMask) else None
        # flash_attn's window: keys up to window - 1 before the query; (-1, -1) for all
        kwargs: dict[str, object] = {"causal": True}
        if scale is not None:
            kwargs["softmax_scale"] = scale
        if window is not None:
            kwargs["window_size"] = (window - 1, 0)
        if mask is None or (isinstance(mask, VarlenMask) and mask.cu_seqlens is None):
            y = flash_attn.flash_attn_func(q, k, v, **kwargs)  # (B, T, H, D)
        elif isinstance(mask, VarlenMask):
            # (B * T, heads, D): documents laid end to end
            q, k, v = (x.reshape(B * T, x.shape[2], D) for x in (q, k, v))
            cu, n = mask.cu_seqlens, mask.max_seqlen
            y = flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, n, n, **kwargs)
            y = y.view(B, T, H, D)
        else:
            raise TypeError(
                f"kernels.attention={self.name} needs None or the VarlenMask from "
                f"build_mask(), got {type(mask).__name__}"
            )
        return y.transpose(1, 2)  # (B, H, T, D)
