"""Flex attention's CUDA kernel on the block tables built from block extremes
(``recipes_lib.kernels.block_masks``) against ``create_block_mask``'s (``pytest -m
gpu``): the same output and gradients for packed rows at 1,024 and 16,384 tokens (a
row of 128 blocks, the length whose compiled ``create_block_mask`` stalled in
``ptxas``), and for one context-parallel shard's queries against a whole row."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from recipes_lib.kernels.attention import FlexAttention, compiled_flex
from recipes_lib.kernels.block_masks import block_mask
from recipes_lib.kernels.sharded import load_balanced_positions

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _packed(rows: int, length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(rows, length, dtype=torch.long)
    for r in range(rows):
        pos, doc = 0, 0
        while pos < length:
            n = int(torch.randint(50, min(6000, length // 2), (1,), generator=gen))
            out[r, pos : pos + n] = doc
            pos, doc = pos + n, doc + 1
    return out.cuda()


def _attend(mask, q_len: int, k_len: int, rows: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (rows, 4, q_len, 64)
    q = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (
        torch.randn((rows, 4, k_len, 64), device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(2)
    )
    for t in (q, k, v):
        t.requires_grad_(True)
    out = compiled_flex()(q, k, v, block_mask=mask)
    out.float().square().sum().backward()
    return out.detach(), [t.grad for t in (q, k, v)]


@pytest.mark.parametrize(
    ("length", "dtype"), [(1000, torch.int32), (1024, torch.int64), (16384, torch.int64)]
)
def test_packed_rows_attend_as_with_create_block_mask(length, dtype):
    """1,000 tokens: the row padded to whole blocks as the backend pads it, int32 ids
    as chat packing makes them."""
    docs = _packed(2, length, seed=length).to(dtype)
    ours = FlexAttention().build_mask(docs, length)
    n = ours.seq_lengths[0]  # the padded length
    theirs = create_block_mask(ours.mask_mod, 2, None, n, n, device="cuda")
    out, grads = _attend(ours, n, n, 2)
    ref, ref_grads = _attend(theirs, n, n, 2)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=1e-2)  # one kernel, bf16
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=2e-3, rtol=1e-2)


def test_a_shards_queries_attend_as_with_create_block_mask():
    length, degree, rank = 8192, 4, 1
    docs = _packed(1, length, seed=3)
    q_pos = load_balanced_positions(length, degree, rank).cuda()
    k_pos = torch.cat([load_balanced_positions(length, degree, r) for r in range(degree)]).cuda()
    q_docs, k_docs = docs[:, q_pos], docs[:, k_pos]

    def mod(b, h, q_idx, kv_idx):
        q, k = q_pos[q_idx], k_pos[kv_idx]
        return (q >= k) & (q_docs[b, q_idx] == k_docs[b, kv_idx])

    ours = block_mask(mod, q_pos, k_pos, q_docs=q_docs, k_docs=k_docs)
    theirs = create_block_mask(mod, 1, None, len(q_pos), length, device="cuda")
    out, grads = _attend(ours, len(q_pos), length, 1)
    ref, ref_grads = _attend(theirs, len(q_pos), length, 1)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=1e-2)  # one kernel, bf16
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=2e-3, rtol=1e-2)
