"""Causal attention backends: ``sdpa`` | ``flex`` | ``flash_attn`` (each kind of
layer may run its own: :mod:`recipes_lib.kernels.choice`).

Each backend declares what it supports in :class:`AttentionCapabilities`, and
:meth:`AttentionBackend.check` refuses a device, dtype or document mask it does not
support with an :class:`~recipes_lib.errors.UnsupportedKernelError`; no backend ever
falls back to another one silently.

A model calls :meth:`AttentionBackend.build_mask` once per batch and hands the result
to every layer's :meth:`AttentionBackend.__call__`, where ``q`` is ``(B, H, T, D)`` and
``k``/``v`` are ``(B, Hkv, T, D)`` with ``H`` a multiple of ``Hkv`` (grouped-query
attention). Every backend attends causally; with ``doc_ids`` (``(B, T)``, equal ids
in a row mark one document) a token also attends only within its own document, and
with a ``window`` only to the ``window`` keys ending at its own position (a local
layer's sliding window). A ``scale`` other than None replaces ``1 / sqrt(D)`` in the
softmax. ``sinks`` (``(H,)``, a backend with ``capabilities.sinks``) adds one learned
logit per query head to each softmax's denominator, with no value (gpt-oss): a query
may attend to nothing. SDPA takes it as one more key (:func:`sdpa_with_sinks`), flex
on CUDA through the log-sum-exp it returns: attention with a sink ``s`` is attention
without it times ``sigmoid(lse - s)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import (
    BlockMask,
    create_mask,
    flex_attention,
)

from recipes_lib.errors import UnsupportedKernelError
from recipes_lib.kernels.block_masks import BLOCK, block_mask, pad_documents

try:  # what flex_attention returns besides its output, since torch 2.9
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # an import inside a compiled region would break its graph
    AuxRequest = None  # type: ignore[assignment,misc]

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
        context_parallel: it may run with each row split over the ranks of a
            context-parallel group (:mod:`recipes_lib.kernels.sharded`).
        sinks: it takes a learned logit per query head in each softmax's
            denominator (``model.attention_sinks``).
        value_width: it takes values of another width than the queries and keys
            (multi-head latent attention's); without it they are padded to one width.
    """

    document_mask: bool
    gqa: bool
    dtypes: tuple[torch.dtype, ...]
    devices: tuple[str, ...]
    min_cuda_capability: tuple[int, int] | None = None
    context_parallel: bool = False
    sinks: bool = False
    value_width: bool = False


def _dtype_names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


class AttentionBackend:
    """Base class of the attention backends; see the module docstring for how one is used."""

    name: str = ""
    capabilities: AttentionCapabilities

    def unavailable_reason(self) -> str | None:
        """Why this backend cannot be used in this environment, or None when it can."""
        return None

    def check(
        self,
        *,
        device: torch.device | str,
        dtype: torch.dtype,
        document_mask: bool,
        key: str = "kernels.attention",
    ) -> None:
        """Raise :class:`UnsupportedKernelError` unless this backend can run as asked.

        Every unmet requirement is named in one message, with the supported values;
        ``key`` is the setting that chose this backend (``kernels.attention_local``, ...).
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
                f"(data.document_mask=true); use {key}=flex, or set "
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
                f"{key}={self.name} cannot run here: " + "; ".join(problems) + "."
            )

    def build_mask(
        self,
        doc_ids: Tensor | None,
        seq_len: int,
        *,
        device: torch.device | str | None = None,
        window: int | None = None,
    ) -> object | None:
        """Build the per-batch mask shared by the layers of one window (None: plain causal).

        Args:
            doc_ids: ``(B, T)`` document ids, or None for causal attention over the row.
            seq_len: ``T``.
            device: where the mask lives when ``doc_ids`` is None (default: cpu).
            window: the keys a query sees, its own included; None: every earlier one.
        """
        raise NotImplementedError

    def row_tensors(self, mask: object | None) -> list[Tensor]:
        """The tensors of a mask from :meth:`build_mask` whose dim 0 varies from batch to
        batch (one entry per row, or per document of a flattened batch): compiled blocks
        trace that dim dynamic with the rows' (:mod:`recipes_lib.kernels.compiled`).
        None here: a mask shared by every row."""
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
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class SDPAAttention(AttentionBackend):
    """``torch.nn.functional.scaled_dot_product_attention``: causal, no document mask; a
    window is a dense ``(T, T)`` mask (which rules out SDPA's flash kernel: a model with
    local layers trains faster with ``flex``)."""

    name = "sdpa"
    capabilities = AttentionCapabilities(
        document_mask=False,
        gqa=True,
        dtypes=_ALL_FLOAT_DTYPES,
        devices=("cpu", "cuda"),
        context_parallel=True,
        sinks=True,
        value_width=True,
    )

    def __init__(self) -> None:
        self._window_masks: dict[tuple[int, int, str], Tensor] = {}

    def build_mask(
        self,
        doc_ids: Tensor | None,
        seq_len: int,
        *,
        device: torch.device | str | None = None,
        window: int | None = None,
    ) -> Tensor | None:
        if doc_ids is not None:
            raise UnsupportedKernelError(
                f"kernels.attention={self.name} cannot mask attention to documents "
                "(doc_ids given); use kernels.attention=flex, or set data.document_mask=false."
            )
        if window is None or window >= seq_len:
            return None  # causal
        key = (seq_len, window, str(torch.device(device or "cpu")))
        if key not in self._window_masks:  # it depends only on these: build it once
            positions = torch.arange(seq_len, device=device)
            offset = positions[:, None] - positions[None, :]  # (T, T): query - key
            self._window_masks[key] = (offset >= 0) & (offset < window)
        return self._window_masks[key]

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: object | None,
        scale: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        # q (B, H, T, D); k, v (B, Hkv, T, D) -> (B, H, T, D)
        gqa = k.shape[1] != q.shape[1]
        if mask is not None and not isinstance(mask, Tensor):
            raise UnsupportedKernelError(
                f"kernels.attention={self.name} takes None or its window mask, "
                f"got {type(mask).__name__}."
            )
        if sinks is not None:
            return sdpa_with_sinks(q, k, v, mask, sinks, scale)
        if mask is None:
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=gqa, scale=scale
            )
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)


SINK_DIMS = 8  # the dims a sink adds to each query and key (a multiple of 8 keeps kernels)


def sdpa_with_sinks(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, sinks: Tensor, scale: float | None
) -> Tensor:
    """SDPA with a sink per query head: one more key, seen by every query, whose value is
    zero and whose logit is the head's sink.

    The sink's logit rides on ``SINK_DIMS`` extra dims of the queries and keys (the sink
    over the scale in each query's first one, a one in the sink key's, zeros elsewhere),
    so the gradient reaches ``sinks`` through the queries and the mask stays boolean and
    shared by the heads, not an additive ``(H, T, S)`` one.

    Args:
        q: ``(B, H, T, D)``; k, v: ``(B, Hkv, S, D)``, the last ``T`` keys the queries'
            own positions.
        mask: boolean, broadcastable to ``(B, H, T, S)``; None: causal (every key for a
            single query).
        sinks: ``(H,)`` logits.
        scale: the softmax scale; None: ``1 / sqrt(D)``.

    Returns:
        ``(B, H, T, D)``.
    """
    B, H, T, D = q.shape
    kv_heads, S = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    sink = (sinks / scale).to(q.dtype).view(1, H, 1, 1).expand(B, H, T, 1)
    q = torch.cat([q, sink, q.new_zeros(B, H, T, SINK_DIMS - 1)], dim=-1)  # (B, H, T, D + P)
    one = torch.zeros(D + SINK_DIMS, dtype=k.dtype, device=k.device)
    one[D] = 1.0
    sink_key = one.expand(B, kv_heads, 1, D + SINK_DIMS)
    k = torch.cat([F.pad(k, (0, SINK_DIMS)), sink_key], dim=2)  # (B, Hkv, S + 1, D + P)
    v = torch.cat([v, v.new_zeros(B, kv_heads, 1, D)], dim=2)  # (B, Hkv, S + 1, D)
    if mask is None and T > 1:  # causal, the queries at the last T positions
        positions = torch.arange(S, device=q.device)
        mask = positions[None, :] <= positions[S - T :, None]  # (T, S)
    if mask is not None:  # every query sees the sink
        mask = torch.cat([mask, mask.new_ones(*mask.shape[:-1], 1)], dim=-1)  # (..., T, S + 1)
    gqa = kv_heads != H
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=scale)


def flex_with_sinks(flex, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, **kwargs) -> Tensor:
    """``flex(q, k, v, **kwargs)`` (flex_attention, compiled or not) with a sink per query
    head, through the log-sum-exp it returns: ``out * sigmoid(lse - sink)``, which flex's
    backward differentiates (its gradient of the log-sum-exp)."""
    if AuxRequest is None:  # torch before 2.9 asks for it with a flag
        y, lse = flex(q, k, v, return_lse=True, **kwargs)
    else:
        y, aux = flex(q, k, v, return_aux=AuxRequest(lse=True), **kwargs)
        lse = aux.lse  # (B, H, T), float32
    weight = torch.sigmoid(lse - sinks.float().view(1, -1, 1))  # (B, H, T)
    return y * weight.unsqueeze(-1).to(y.dtype)


# Compiled once per process, on first use. Eager flex_attention materializes the whole
# (T, T) score matrix: a reference path, far too slow on a GPU.
_compiled_flex_attention = None


def compiled_flex():
    """``flex_attention`` as the caller runs: inside a compiled region (a compiled
    block) the operator itself, which that region's graph takes in and compiles with
    it; in eager code, ``flex_attention`` compiled once per process (shared by the
    sharded attention).

    A compiled block calling the separately compiled function instead broke its graph
    there (torch 2.11 on an H200, ``tests/gpu/test_late_row_count_gpu.py``): the code
    after the attention ran as frames of their own, traced with the rows static, and
    the first batch with more rows compiled them again inside the training steps.
    """
    global _compiled_flex_attention
    if torch.compiler.is_compiling():
        return flex_attention
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention)
    return _compiled_flex_attention


FLEX_BLOCK = BLOCK  # flex_attention's default block size


def block_mask_row_tensors(mask: BlockMask) -> list[Tensor]:
    """The tensors of a per-row BlockMask with a row each, which compiled blocks trace
    dynamic with the rows: its block tables ``(B, H, ...)`` and what its ``mask_mod``
    reads per row (the list its builder hangs on it as ``row_tensors``: document ids).
    None for a mask shared by every row (``B`` of 1)."""
    if mask.kv_num_blocks.shape[0] < 2:
        return []
    tables = [t for t in mask.as_tuple() if isinstance(t, Tensor) and t.ndim >= 3]
    return tables + list(getattr(mask.mask_mod, "row_tensors", []))


def _causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    return q_idx >= kv_idx


def _within(window: int):
    """The mask_mod of causal attention to the last ``window`` keys."""

    def windowed(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return windowed


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
        document_mask=True,
        gqa=True,
        dtypes=_ALL_FLOAT_DTYPES,
        devices=("cpu", "cuda"),
        context_parallel=True,
        sinks=True,
        value_width=True,
    )

    def __init__(self) -> None:
        self._causal_masks: dict[tuple[int, str, int | None], BlockMask] = {}

    def build_mask(
        self,
        doc_ids: Tensor | None,
        seq_len: int,
        *,
        device: torch.device | str | None = None,
        window: int | None = None,
    ) -> BlockMask:
        if doc_ids is not None:
            device = doc_ids.device
        device = torch.device(device if device is not None else "cpu")
        padded_len = seq_len if device.type == "cpu" else -(-seq_len // FLEX_BLOCK) * FLEX_BLOCK
        positions = torch.arange(padded_len, device=device)
        causal = _causal if window is None else _within(window)
        if doc_ids is None:
            # The causal mask depends only on the length: build it once and keep it.
            key = (seq_len, str(device), window)
            if key not in self._causal_masks:
                self._causal_masks[key] = block_mask(causal, positions, positions, window=window)
            return self._causal_masks[key]

        if doc_ids.ndim != 2 or doc_ids.shape[1] != seq_len:
            raise ValueError(f"doc_ids must be (B, {seq_len}), got {tuple(doc_ids.shape)}")
        doc_ids = pad_documents(doc_ids, padded_len)  # (B, padded_len)

        def document_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            same_document = doc_ids[b, q_idx] == doc_ids[b, kv_idx]
            return causal(b, h, q_idx, kv_idx) & same_document

        # The mask differs per row, so B is the batch size (H broadcasts).
        document_causal.row_tensors = [doc_ids]  # type: ignore[attr-defined]  # see row_tensors
        return block_mask(
            document_causal, positions, positions, q_docs=doc_ids, k_docs=doc_ids, window=window
        )

    def row_tensors(self, mask: object | None) -> list[Tensor]:
        return block_mask_row_tensors(mask) if isinstance(mask, BlockMask) else []

    def __call__(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: object | None,
        scale: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
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
            if sinks is not None:
                return sdpa_with_sinks(q, k, v, dense, sinks, scale)
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=dense, enable_gqa=gqa, scale=scale
            )
        padded_len = mask.seq_lengths[0]
        if padded_len != T:
            q, k, v = (F.pad(x, (0, 0, 0, padded_len - T)) for x in (q, k, v))
        # q (B, H, T', D); k, v (B, Hkv, T', D) -> (B, H, T', D)
        if sinks is None:
            y = compiled_flex()(q, k, v, block_mask=mask, enable_gqa=gqa, scale=scale)
        else:
            kwargs = {"block_mask": mask, "enable_gqa": gqa, "scale": scale}
            y = flex_with_sinks(compiled_flex(), q, k, v, sinks, **kwargs)
        return y[:, :, :T]
