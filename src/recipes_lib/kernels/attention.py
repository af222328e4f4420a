"""Causal attention backends: ``sdpa`` | ``flex`` | ``flash_attn``.

Each backend declares what it supports in :class:`AttentionCapabilities`, and
:meth:`AttentionBackend.check` refuses a device, dtype or document mask it does not
support with an :class:`~recipes_lib.errors.UnsupportedKernelError`; no backend ever
falls back to another one silently.

A model calls :meth:`AttentionBackend.build_mask` once per batch and hands the result
to every layer's :meth:`AttentionBackend.__call__`, where ``q`` is ``(B, H, T, D)`` and
``k``/``v`` are ``(B, Hkv, T, D)`` with ``H`` a multiple of ``Hkv`` (grouped-query
attention). Every backend attends causally; with ``doc_ids`` (``(B, T)``, equal ids
in a row mark one document) a token also attends only within its own document.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import (
    BlockMask,
    create_block_mask,
    create_mask,
    flex_attention,
)

from recipes_lib.errors import ConfigError, UnsupportedKernelError

_ALL_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionCapabilities:
    """What an attention backend can do.

    Attributes:
        document_mask: attends within documents given ``doc_ids`` (packed sequences).
        gqa: accepts fewer key/value heads than query heads.
        dtypes: tensor dtypes it computes in.
        devices: device types it runs on (``"cpu"``, ``"cuda"``).
        min_cuda_capability: lowest CUDA compute capability, or None for any.
    """

    document_mask: bool
    gqa: bool
    dtypes: tuple[torch.dtype, ...]
    devices: tuple[str, ...]
    min_cuda_capability: tuple[int, int] | None = None


def _dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


class AttentionBackend:
    """Base class of the attention backends; see the module docstring for how one is used."""

    name: str = ""
    capabilities: AttentionCapabilities

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot be used in this environment, or None when it can."""
        return None

    def check(self, *, device: torch.device | str, dtype: torch.dtype, document_mask: bool) -> None:
        """Raise :class:`UnsupportedKernelError` unless this backend can run as asked.

        Every unmet requirement is named in one message, with the supported values.
        """
        device = torch.device(device)
        caps = self.capabilities
        problems: list[str] = []
        reason = self.unavailable_reason()
        if reason is not None:
            problems.append(reason)
        if device.type not in caps.devices:
            problems.append(
                f"it does not run on device '{device.type}' (supported devices: "
                f"{', '.join(caps.devices)})"
            )
        if dtype not in caps.dtypes:
            problems.append(
                f"it does not support dtype {_dtype_names((dtype,))} (supported dtypes: "
                f"{_dtype_names(caps.dtypes)})"
            )
        if document_mask and not caps.document_mask:
            problems.append(
                "it cannot mask attention to documents in packed sequences "
                "(data.document_mask=true); use kernels.attention=flex, or set "
                "data.document_mask=false"
            )
        if (
            device.type == "cuda"
            and caps.min_cuda_capability is not None
            and torch.cuda.is_available()
        ):
            capability = torch.cuda.get_device_capability(device)
            if capability < caps.min_cuda_capability:
                need = ".".join(map(str, caps.min_cuda_capability))
                problems.append(
                    f"it needs CUDA compute capability >= {need}, the GPU has "
                    f"{capability[0]}.{capability[1]}"
                )
        if problems:
            raise UnsupportedKernelError(
                f"kernels.attention={self.name} cannot run here: " + "; ".join(problems) + "."
            )

    def build_mask(
        self, doc_ids: Tensor | None, seq_len: int, *, device: torch.device | str | None = None
    ) -> object | None:
        """Build the per-batch mask shared by all layers (None: plain causal).

        Args:
            doc_ids: ``(B, T)`` document ids, or None for causal attention over the row.
            seq_len: ``T``.
            device: where the mask lives when ``doc_ids`` is None (default: cpu).
        """
        if doc_ids is not None:
            raise UnsupportedKernelError(
                f"kernels.attention={self.name} cannot mask attention to documents "
                "(doc_ids given); use kernels.attention=flex, or set data.document_mask=false."
            )
        return None

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: object | None) -> Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class SDPAAttention(AttentionBackend):
    """``torch.nn.functional.scaled_dot_product_attention``: causal, no document mask."""

    name = "sdpa"
    capabilities = AttentionCapabilities(
        document_mask=False, gqa=True, dtypes=_ALL_FLOAT_DTYPES, devices=("cpu", "cuda")
    )

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: object | None) -> Tensor:
        if mask is not None:
            raise UnsupportedKernelError(f"kernels.attention={self.name} takes no mask.")
        # q (B, H, T, D); k, v (B, Hkv, T, D) -> (B, H, T, D)
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1]
        )


# Compiled once per process, on first use. Eager flex_attention materializes the whole
# (T, T) score matrix: a reference path, far too slow on a GPU.
_compiled_flex_attention = None
_compiled_create_block_mask = None


def _compiled_flex():
    global _compiled_flex_attention
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention)
    return _compiled_flex_attention


def _create_block_mask_for(device_type: str):
    global _compiled_create_block_mask
    if device_type == "cpu":
        return create_block_mask
    if _compiled_create_block_mask is None:
        # Eager create_block_mask materializes a (B, T, T) mask; compiled it does not.
        _compiled_create_block_mask = torch.compile(create_block_mask)
    return _compiled_create_block_mask


_BLOCK = 128  # flex_attention's default block size


def _causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return q_idx >= kv_idx


class FlexAttention(AttentionBackend):
    """``torch.nn.attention.flex_attention``: causal, optionally within documents.

    On CUDA the kernel is ``torch.compile``-d once per process, and a sequence whose
    length is not a multiple of the 128-token block is padded up to one (the compiled
    kernel rejects some such lengths); causality keeps the padding out of every real
    token's attention. On CPU, where torch's flex_attention has no backward pass, the
    BlockMask's ``mask_mod`` is evaluated densely and applied by SDPA instead: the same
    attention, with autograd.
    """

    name = "flex"
    capabilities = AttentionCapabilities(
        document_mask=True, gqa=True, dtypes=_ALL_FLOAT_DTYPES, devices=("cpu", "cuda")
    )

    def __init__(self) -> None:
        self._causal_masks: dict[tuple[int, str], BlockMask] = {}

    def build_mask(
        self, doc_ids: Tensor | None, seq_len: int, *, device: torch.device | str | None = None
    ) -> BlockMask:
        if doc_ids is not None:
            device = doc_ids.device
        device = torch.device(device if device is not None else "cpu")
        padded_len = seq_len if device.type == "cpu" else -(-seq_len // _BLOCK) * _BLOCK
        build = _create_block_mask_for(device.type)

        if doc_ids is None:
            # The causal mask depends only on the length: build it once and keep it.
            key = (seq_len, str(device))
            if key not in self._causal_masks:
                self._causal_masks[key] = build(_causal, None, None, padded_len, padded_len, device)
            return self._causal_masks[key]

        if doc_ids.ndim != 2 or doc_ids.shape[1] != seq_len:
            raise ValueError(f"doc_ids must be (B, {seq_len}), got {tuple(doc_ids.shape)}")
        doc_ids = F.pad(doc_ids, (0, padded_len - seq_len), value=-1)  # (B, padded_len)

        def document_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            same_document = doc_ids[b, q_idx] == doc_ids[b, kv_idx]
            return (q_idx >= kv_idx) & same_document

        # The mask differs per row, so B is the batch size (H broadcasts).
        return build(document_causal, doc_ids.shape[0], None, padded_len, padded_len, device)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: object | None) -> Tensor:
        if not isinstance(mask, BlockMask):
            raise TypeError(
                f"kernels.attention={self.name} needs the BlockMask from build_mask(), "
                f"got {type(mask).__name__}"
            )
        gqa = k.shape[1] != q.shape[1]
        T = q.shape[2]
        if q.device.type == "cpu":
            # On CPU torch's flex_attention has no backward pass, and its eager forward
            # is several times slower than SDPA with a dense mask: evaluate the same
            # mask_mod densely and let SDPA apply it (same result, with autograd).
            dense = create_mask(mask.mask_mod, mask.shape[0], 1, T, T, q.device)  # (B|1, 1, T, T)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=gqa)
        padded_len = mask.seq_lengths[0]
        if padded_len != T:
            q, k, v = (F.pad(x, (0, 0, 0, padded_len - T)) for x in (q, k, v))
        # q (B, H, T', D); k, v (B, Hkv, T', D) -> (B, H, T', D)
        y = _compiled_flex()(q, k, v, block_mask=mask, enable_gqa=gqa)
        return y[:, :, :T]


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
    """Document boundaries of a flattened batch for ``flash_attn_varlen_func``.

    ``cu_seqlens`` (int32, ``(n_docs + 1,)``) holds the offsets of each document in the
    ``B * T`` tokens; ``max_seqlen`` bounds every document's length.
    """

    cu_seqlens: Tensor
    max_seqlen: int


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
        self, doc_ids: Tensor | None, seq_len: int, *, device: torch.device | str | None = None
    ) -> VarlenMask | None:
        if doc_ids is None:
            return None
        if doc_ids.ndim != 2 or doc_ids.shape[1] != seq_len:
            raise ValueError(f"doc_ids must be (B, {seq_len}), got {tuple(doc_ids.shape)}")
        # A document starts at each row's first token and wherever the id changes.
        starts = torch.ones_like(doc_ids, dtype=torch.bool)  # (B, T)
        starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
        offsets = starts.flatten().nonzero().flatten()  # (n_docs,)
        total = torch.tensor([doc_ids.numel()], device=doc_ids.device)
        cu_seqlens = torch.cat([offsets, total]).to(torch.int32)  # (n_docs + 1,)
        # No document is longer than a row; an upper bound avoids a host sync.
        return VarlenMask(cu_seqlens=cu_seqlens, max_seqlen=seq_len)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: object | None) -> Tensor:
        flash_attn = _flash_attn_module or _load_flash_attn()[0]
        if flash_attn is None:
            raise UnsupportedKernelError(
                f"kernels.attention={self.name}: {self.unavailable_reason()}"
            )
        B, H, T, D = q.shape
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # (B, T, heads, D)
        if mask is None:
            y = flash_attn.flash_attn_func(q, k, v, causal=True)  # (B, T, H, D)
        elif isinstance(mask, VarlenMask):
            # (B * T, heads, D): documents laid end to end
            q, k, v = (x.reshape(B * T, x.shape[2], D) for x in (q, k, v))
            cu, n = mask.cu_seqlens, mask.max_seqlen
            y = flash_attn.flash_attn_varlen_func(q, k, v, cu, cu, n, n, causal=True)
            y = y.view(B, T, H, D)
        else:
            raise TypeError(
                f"kernels.attention={self.name} needs None or the VarlenMask from "
                f"build_mask(), got {type(mask).__name__}"
            )
        return y.transpose(1, 2)  # (B, H, T, D)


_BACKENDS: dict[str, type[AttentionBackend]] = {
    SDPAAttention.name: SDPAAttention,
    FlexAttention.name: FlexAttention,
    FlashAttention.name: FlashAttention,
}
ATTENTION_BACKENDS: tuple[str, ...] = tuple(_BACKENDS)


def get_attention_backend(name: str) -> AttentionBackend:
    """A new instance of the attention backend called ``name``.

    Raises:
        ConfigError: ``name`` is not one of :data:`ATTENTION_BACKENDS`.
    """
    if name not in _BACKENDS:
        choices = " | ".join(ATTENTION_BACKENDS)
        raise ConfigError(
            f"kernels.attention={name!r} is not an attention backend; choose one of: {choices} "
            f"(e.g. kernels.attention=sdpa)"
        )
    return _BACKENDS[name]()
