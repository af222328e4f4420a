"""Flex attention's BlockMask built from positions and document ids, block by block.

A :class:`~torch.nn.attention.flex_attention.BlockMask` tells the flex kernel, for each
128-query block, which 128-key blocks to compute (``partial``: the ``mask_mod`` is
evaluated inside) and which to take whole (``full``: every pair allowed, no
``mask_mod``). ``create_block_mask`` finds them by evaluating the ``mask_mod`` on every
(query, key) pair. Eager, that materializes a ``(B, T, T)`` mask; compiled, inductor
emits a kernel whose size grows with the number of blocks, and at 16,384 tokens
(128 blocks a row) its persistent sort kernel took ``ptxas`` minutes to assemble.

The masks of this library are all of one form: a query may attend a key at or before
its own position, within a window (a local layer's), and within its own document (a
packed row). For that form the block tables follow from each block's extremes, with
no pair evaluated (:func:`block_mask`), at ``O(B * (T / 128) ** 2)`` small tensor ops:

- a block pair has an allowed pair only if the latest query is at or after the
  earliest key, the nearest pair is within the window, and the blocks' document-id
  ranges overlap (two blocks sharing a document share a value, so their ``[min,
  max]`` ranges meet). These conditions are necessary, so no allowed pair is ever
  left out; for packed rows (each document one contiguous run, ids increasing) they
  are also sufficient, so no block is computed in vain;
- a block pair is full only if every query is at or after every key, the farthest
  pair is within the window, and both blocks hold one and the same document: exact
  for any ids, which is what a full block (no ``mask_mod``) needs. A block cut short
  by the end of the row is never full, as in ``create_block_mask``.

The ``mask_mod`` given is kept for the partial blocks, so the kernel's result is
exactly the mask's, whatever the tables.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

BLOCK = 128  # flex_attention's default block size


def pad_documents(doc_ids: Tensor, length: int) -> Tensor:
    """``doc_ids`` (``(B, T)``) widened to ``length`` positions, the padding one document
    of its own with the largest id of their dtype: the rows' ids stay in order, so the
    padding's blocks stay out of every real query's tables, and it attends only to
    itself."""
    pad_id = torch.iinfo(doc_ids.dtype).max
    tail = doc_ids.new_full((doc_ids.shape[0], length - doc_ids.shape[1]), pad_id)
    return torch.cat([doc_ids, tail], dim=1)


def _block_extremes(values: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """Each ``block``-long run's min and max along the last dim of ``values``
    (``(..., T)``), the last run padded with its own last value."""
    length = values.shape[-1]
    padded = -(-length // block) * block
    if padded != length:  # integer ids: repeat the last value (no replicate pad for ints)
        tail = values[..., -1:].expand(*values.shape[:-1], padded - length)
        values = torch.cat([values, tail], dim=-1)
    runs = values.reshape(*values.shape[:-1], padded // block, block)
    return runs.amin(-1), runs.amax(-1)


def _ordered(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """``(count, indices)`` of a ``(B, H, Q, K)`` boolean block table, as a BlockMask
    keeps them: each query block's chosen key blocks first, in ascending order."""
    count = blocks.sum(-1, dtype=torch.int32)
    indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)
    return count, indices.to(torch.int32)


def block_mask(
    mask_mod,
    q_positions: Tensor,
    k_positions: Tensor,
    *,
    q_docs: Tensor | None = None,
    k_docs: Tensor | None = None,
    window: int | None = None,
    block: int = BLOCK,
) -> BlockMask:
    """The BlockMask of causal attention from queries at ``q_positions`` (``(Tq,)``,
    global positions) to keys at ``k_positions`` (``(Tk,)``), within ``window`` keys
    and, with ``q_docs``/``k_docs`` (``(B, Tq)``/``(B, Tk)``), within a document.

    ``mask_mod`` must allow exactly that (it is evaluated in the partial blocks); the
    tables are built from each block's extremes (module docstring). Without documents
    the mask has one row for the whole batch.
    """
    q_lo, q_hi = _block_extremes(q_positions, block)  # (Q,)
    k_lo, k_hi = _block_extremes(k_positions, block)  # (K,)
    some = q_hi[:, None] >= k_lo[None, :]  # (Q, K): a query at or after a key
    every = q_lo[:, None] >= k_hi[None, :]
    if window is not None:
        some = some & (q_lo[:, None] - k_hi[None, :] < window)
        every = every & (q_hi[:, None] - k_lo[None, :] < window)
    # a block cut short by the row's end is never taken whole (as create_block_mask
    # does: the kernel then checks the mask, not only the bounds, at the row's end)
    if q_positions.shape[0] % block:
        every[-1, :] = False
    if k_positions.shape[0] % block:
        every[:, -1] = False
    some, every = some[None], every[None]  # (1, Q, K)
    if q_docs is not None and k_docs is not None:
        qd_lo, qd_hi = _block_extremes(q_docs, block)  # (B, Q)
        kd_lo, kd_hi = _block_extremes(k_docs, block)  # (B, K)
        overlap = (qd_lo[:, :, None] <= kd_hi[:, None, :]) & (
            kd_lo[:, None, :] <= qd_hi[:, :, None]
        )
        one_document = (
            (qd_lo == qd_hi)[:, :, None]
            & (kd_lo == kd_hi)[:, None, :]
            & (qd_lo[:, :, None] == kd_lo[:, None, :])
        )
        some, every = some & overlap, every & one_document  # (B, Q, K)
    full = every
    partial = some & ~every
    kv_num, kv_indices = _ordered(partial[:, None])
    full_num, full_indices = _ordered(full[:, None])
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_indices,
        full_num,
        full_indices,
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=(q_positions.shape[0], k_positions.shape[0]),
    )
