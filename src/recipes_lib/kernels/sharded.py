"""Attention over a sequence split across the ranks of a context-parallel group.

Context parallelism splits each row's ``T`` positions over the ``N`` ranks of a group.
The sequence is cut into ``2N`` equal chunks and rank ``i`` holds chunks ``i`` and
``2N - 1 - i`` (load-balanced causal sharding: an early chunk has few keys before it,
a late one many, so each rank's pair does the same causal work). Every layer keeps its
queries local, all-gathers the keys and values of the group (an autograd collective:
the backward pass sums their gradients back onto the rank that holds them), and
attends from its queries to the keys of the whole sequence under a mask built from
global positions: causal, within a local layer's window, and within the document of a
packed row, so documents that straddle two shards are respected.

Why not ``torch.distributed.tensor.experimental.context_parallel``: its ring attention
replaces SDPA's flash, memory-efficient and cuDNN CUDA kernels, so it does not run on
CPU over gloo, and it takes no document mask. The all-gather holds the whole
sequence's keys and values on each rank (of the key/value heads only).

The mask: with ``kernels.attention=flex`` on CUDA, where each chunk is a whole number
of flex attention's 128-token blocks, a BlockMask over the ``(T / N, T)`` scores whose
``mask_mod`` looks the global positions (and document ids) up, so no dense mask exists
and blocks outside the causal, window and document masks are skipped
(:func:`uses_block_mask`). Otherwise (``sdpa``, the CPU, other lengths) SDPA with a
dense ``(T / N, T)`` boolean mask per row: a reference, correct under any mask, which
SDPA turns into an additive mask of the compute dtype per call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

from recipes_lib.errors import UnsupportedKernelError
from recipes_lib.kernels import block_masks
from recipes_lib.kernels.attention import (
    FLEX_BLOCK,
    AttentionBackend,
    FlexAttention,
    block_mask_row_tensors,
    compiled_flex,
)


class _GatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` within ``group``; the backward sums each part's gradient
    over the group onto the rank it came from (a reduce-scatter: on NCCL one call, else an
    all-reduce and this rank's slice, which gloo runs on any subgroup).

    Written here because ``torch.distributed.nn.functional.all_gather``'s backward on
    gloo addresses a subgroup's ranks by their global number and fails on a group that
    does not start at rank 0."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: dist.ProcessGroup | None) -> Tensor:
        ctx.dim, ctx.group = dim, group
        ctx.size, ctx.rank = dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        parts = [p.contiguous() for p in grad.chunk(ctx.size, dim=ctx.dim)]
        if dist.get_backend(ctx.group) == dist.Backend.NCCL:
            mine = torch.empty_like(parts[ctx.rank])
            dist.reduce_scatter(mine, parts, group=ctx.group)
            return mine, None, None
        summed = grad.contiguous()
        dist.all_reduce(summed, group=ctx.group)
        return summed.chunk(ctx.size, dim=ctx.dim)[ctx.rank].contiguous(), None, None


def load_balanced_positions(seq_len: int, degree: int, rank: int) -> Tensor:
    """The positions of a ``seq_len`` row held by ``rank`` of ``degree``: chunks
    ``rank`` and ``2 * degree - 1 - rank`` of its ``2 * degree`` equal chunks, in order.

    Raises:
        ValueError: ``seq_len`` is not a multiple of ``2 * degree``.
    """
    if seq_len % (2 * degree) != 0:
        raise ValueError(f"a row of {seq_len} tokens does not split into {2 * degree} chunks")
    chunk = seq_len // (2 * degree)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second_start = (2 * degree - 1 - rank) * chunk
    second = torch.arange(second_start, second_start + chunk)
    return torch.cat([first, second])


def uses_block_mask(attention: str, device_type: str, seq_len: int, degree: int) -> bool:
    """Whether split rows attend through a flex BlockMask (no dense mask): ``flex`` on
    CUDA with chunks of ``seq_len / (2 x degree)`` tokens, a whole number of blocks."""
    chunk = seq_len // (2 * degree)
    return attention == FlexAttention.name and device_type == "cuda" and chunk % FLEX_BLOCK == 0


@dataclass
class ContextShard:
    """One rank's share of each row under context parallelism.

    Attributes:
        seq_len: the whole row's length ``T``.
        degree: the ranks of the group, ``N``.
        rank: this rank's index in the group.
        group: the process group of the ``N`` ranks (None: the default group).
    """

    seq_len: int
    degree: int
    rank: int
    group: dist.ProcessGroup | None = None
    positions: Tensor = field(init=False)  # (T / N,) global positions held here
    key_positions: Tensor = field(init=False)  # (T,) global positions in gathered order

    def __post_init__(self) -> None:
        self.positions = load_balanced_positions(self.seq_len, self.degree, self.rank)
        self.key_positions = torch.cat(
            [load_balanced_positions(self.seq_len, self.degree, r) for r in range(self.degree)]
        )

    def shard(self, rows: Tensor) -> Tensor:
        """This rank's positions of ``rows`` (``(B, T, ...)`` -> ``(B, T / N, ...)``)."""
        return rows[:, self.positions.to(rows.device)]

    def gather(self, x: Tensor, dim: int) -> Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order; gradients flow back
        to the rank each part came from (summed over the group)."""
        if self.degree == 1:
            return x
        return _GatherSequence.apply(x, dim, self.group)


class ShardedAttention(AttentionBackend):
    """An attention backend run over a :class:`ContextShard`: queries local, keys and
    values gathered from the group, masks built from global positions.

    ``inner`` is the configured backend; it must declare ``context_parallel`` in its
    capabilities. ``build_mask`` takes this rank's ``doc_ids`` (``(B, T / N)``) and
    gathers the others' (integers: no gradient).
    """

    def __init__(self, inner: AttentionBackend, shard: ContextShard):
        if not inner.capabilities.context_parallel:
            raise UnsupportedKernelError(
                f"kernels.attention={inner.name} cannot run with its sequence split over "
                "ranks (strategy.context_parallel > 1); use kernels.attention=flex or sdpa"
            )
        self.inner = inner
        self.shard = shard
        self.name = inner.name
        self.capabilities = inner.capabilities

    def build_mask(
        self,
        doc_ids: Tensor | None,
        seq_len: int,
        *,
        device: torch.device | str | None = None,
        window: int | None = None,
    ) -> Tensor | BlockMask:
        """Where a local query may attend a gathered key: a BlockMask over the
        ``(T / N, T)`` scores (:func:`uses_block_mask`), else ``(B | 1, 1, T / N, T)``,
        True where allowed."""
        shard = self.shard
        if seq_len != len(shard.positions):
            raise ValueError(
                f"a shard of {len(shard.positions)} tokens was expected, got {seq_len} "
                f"(a row of {shard.seq_len} over {shard.degree} ranks)"
            )
        if doc_ids is not None:
            device = doc_ids.device
        device = torch.device(device if device is not None else "cpu")
        key_docs = None if doc_ids is None else self._gathered(doc_ids)  # (B, T)
        if uses_block_mask(self.name, device.type, shard.seq_len, shard.degree):
            return self.block_mask(doc_ids, key_docs, device, window)
        q_pos = shard.positions.to(device)[:, None]  # (T / N, 1)
        k_pos = shard.key_positions.to(device)[None, :]  # (1, T)
        allowed = q_pos >= k_pos
        if window is not None:
            allowed = allowed & (q_pos - k_pos < window)
        if doc_ids is None or key_docs is None:
            return allowed[None, None]  # (1, 1, T / N, T)
        same = doc_ids[:, :, None] == key_docs[:, None, :]  # (B, T / N, T)
        return (allowed[None] & same)[:, None]  # (B, 1, T / N, T)

    def _gathered(self, doc_ids: Tensor) -> Tensor:
        """Every rank's ``doc_ids`` in gathered order (integers, no gradient: a plain
        all-gather)."""
        if self.shard.degree == 1:
            return doc_ids
        parts = [torch.empty_like(doc_ids) for _ in range(self.shard.degree)]
        dist.all_gather(parts, doc_ids.contiguous(), group=self.shard.group)
        return torch.cat(parts, dim=1)

    def block_mask(
        self,
        doc_ids: Tensor | None,
        key_docs: Tensor | None,
        device: torch.device,
        window: int | None = None,
    ) -> BlockMask:
        """The BlockMask of the ``(T / N, T)`` scores: its ``mask_mod`` looks up the global
        positions of a local query and a gathered key (and their documents)."""
        shard = self.shard
        q_pos, k_pos = shard.positions.to(device), shard.key_positions.to(device)

        def sharded_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            q, k = q_pos[q_idx], k_pos[kv_idx]
            allowed = q >= k
            if window is not None:
                allowed = allowed & (q - k < window)
            if doc_ids is not None and key_docs is not None:
                allowed = allowed & (doc_ids[b, q_idx] == key_docs[b, kv_idx])
            return allowed

        # what the mask_mod reads per row, traced dynamic with the rows (row_tensors)
        sharded_causal.row_tensors = [  # type: ignore[attr-defined]
            t for t in (doc_ids, key_docs) if t is not None
        ]
        return block_masks.block_mask(
            sharded_causal, q_pos, k_pos, q_docs=doc_ids, k_docs=key_docs, window=window
        )

    def row_tensors(self, mask: object | None) -> list[Tensor]:
        """Per-row tensors of a mask from :meth:`build_mask`: a block mask's tables and the
        document ids its ``mask_mod`` reads (compiled blocks take flex into their graph,
        so these are traced there), or a dense mask with a row each."""
        if isinstance(mask, BlockMask):
            return block_mask_row_tensors(mask)
        if isinstance(mask, Tensor) and mask.shape[0] >= 2:
            return [mask]
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
            raise UnsupportedKernelError("context parallelism cannot add attention sinks")
        # q (B, H, T / N, D); k, v (B, Hkv, T / N, D) -> (B, H, T / N, D)
        if not isinstance(mask, Tensor | BlockMask):
            raise TypeError(f"sharded attention needs its own mask, got {type(mask).__name__}")
        # one collective for both, so that every rank runs the backward's in one order
        k_all, v_all = self.shard.gather(torch.stack([k, v]), dim=3).unbind(0)  # (B, Hkv, T, D)
        gqa = k.shape[1] != q.shape[1]
        if isinstance(mask, BlockMask):  # lengths of whole blocks: no padding
            return compiled_flex()(q, k_all, v_all, block_mask=mask, enable_gqa=gqa, scale=scale)
        return F.scaled_dot_product_attention(
            q, k_all, v_all, attn_mask=mask, enable_gqa=gqa, scale=scale
        )
