"""The BlockMask built from block extremes (recipes_lib.kernels.block_masks) against
torch's create_block_mask, which evaluates the mask_mod on every pair (eager, CPU):
the same partial and full block tables for causal, windowed and packed rows and for a
context-parallel shard's queries; for document ids that are not in order, no allowed
pair's block is left out and no block is taken as full that is not."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from recipes_lib.kernels.attention import FlexAttention
from recipes_lib.kernels.block_masks import block_mask, pad_documents
from recipes_lib.kernels.sharded import load_balanced_positions


def tables(mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) as dense (B, Q, K) booleans from a BlockMask's kv tables."""

    def dense(num, indices):
        b, _, q, k = indices.shape
        out = torch.zeros(b, q, k, dtype=torch.bool)
        for row in range(b):
            for qb in range(q):
                n = int(num[row, 0, qb])
                out[row, qb, indices[row, 0, qb, :n].long()] = True
        return out

    return dense(mask.kv_num_blocks, mask.kv_indices), dense(
        mask.full_kv_num_blocks, mask.full_kv_indices
    )


def mask_mod_of(q_pos, k_pos, q_docs=None, k_docs=None, window=None):
    def mod(b, h, q_idx, kv_idx):
        q, k = q_pos[q_idx], k_pos[kv_idx]
        allowed = q >= k
        if window is not None:
            allowed = allowed & (q - k < window)
        if q_docs is not None:
            allowed = allowed & (q_docs[b, q_idx] == k_docs[b, kv_idx])
        return allowed

    return mod


def packed_doc_ids(rows: int, length: int, seed: int) -> torch.Tensor:
    """Rows of documents in order, of lengths from a few tokens to several blocks."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(rows, length, dtype=torch.long)
    for r in range(rows):
        pos, doc = 0, 0
        while pos < length:
            n = int(torch.randint(1, 400, (1,), generator=gen))
            out[r, pos : pos + n] = doc
            pos, doc = pos + n, doc + 1
    return out


def reference(mod, rows, q_len, k_len):
    return create_block_mask(mod, rows, None, q_len, k_len, device="cpu")


@pytest.mark.parametrize("length", [512, 700])
@pytest.mark.parametrize("window", [None, 100, 300])
def test_causal_and_windowed_rows_give_the_exact_tables(length, window):
    pos = torch.arange(length)
    mod = mask_mod_of(pos, pos, window=window)
    ours = tables(block_mask(mod, pos, pos, window=window))
    theirs = tables(reference(mod, None, length, length))
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.mark.parametrize("length", [1024, 1000])
def test_packed_rows_give_the_exact_tables(length):
    docs = packed_doc_ids(3, length, seed=length)
    pos = torch.arange(length)
    mod = mask_mod_of(pos, pos, docs, docs)
    ours = tables(block_mask(mod, pos, pos, q_docs=docs, k_docs=docs))
    theirs = tables(reference(mod, 3, length, length))
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.mark.parametrize("window", [50, 200, 700])
def test_packed_rows_in_a_window_give_the_exact_tables(window):
    length = 1024
    docs = packed_doc_ids(2, length, seed=3)
    pos = torch.arange(length)
    mod = mask_mod_of(pos, pos, docs, docs, window)
    ours = tables(block_mask(mod, pos, pos, q_docs=docs, k_docs=docs, window=window))
    theirs = tables(reference(mod, 2, length, length))
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.mark.parametrize("window", [None, 300])
@pytest.mark.parametrize(("degree", "rank"), [(2, 0), (2, 1), (4, 3)])
def test_a_shards_queries_against_the_whole_row_give_the_exact_tables(degree, rank, window):
    length = 2048
    docs = packed_doc_ids(2, length, seed=7)
    q_pos = load_balanced_positions(length, degree, rank)
    k_pos = torch.cat([load_balanced_positions(length, degree, r) for r in range(degree)])
    q_docs, k_docs = docs[:, q_pos], docs[:, k_pos]
    mod = mask_mod_of(q_pos, k_pos, q_docs, k_docs, window)
    ours = tables(block_mask(mod, q_pos, k_pos, q_docs=q_docs, k_docs=k_docs, window=window))
    theirs = tables(reference(mod, 2, len(q_pos), len(k_pos)))
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


def test_document_ids_out_of_order_lose_no_allowed_pair():
    """A document id used by two runs of a row, and ids that fall: the tables are a
    superset of the exact ones, and nothing is full that is not."""
    length = 768
    gen = torch.Generator().manual_seed(0)
    docs = torch.randint(0, 3, (2, length // 64), generator=gen).repeat_interleave(64, dim=1)
    pos = torch.arange(length)
    mod = mask_mod_of(pos, pos, docs, docs)
    partial, full = tables(block_mask(mod, pos, pos, q_docs=docs, k_docs=docs))
    ref_partial, ref_full = tables(reference(mod, 2, length, length))
    assert not ((ref_partial | ref_full) & ~(partial | full)).any()
    assert not (full & ~ref_full).any()


def test_the_flex_backend_builds_create_block_masks_mask():
    docs = packed_doc_ids(2, 300, seed=1)
    mask = FlexAttention().build_mask(docs, 300, device="cpu")
    ref = create_block_mask(mask.mask_mod, 2, None, 300, 300, device="cpu")
    assert torch.equal(mask.to_dense(), ref.to_dense())
    ours, theirs = tables(mask), tables(ref)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_a_row_padded_as_the_flex_backend_pads_it_gives_the_exact_tables(dtype):
    """On CUDA the backend pads a row to whole blocks with pad_documents: its tables are
    create_block_mask's, and the padding attends only to itself."""
    docs = pad_documents(packed_doc_ids(2, 300, seed=1).to(dtype), 384)
    assert docs.shape == (2, 384) and (docs[:, 300:] == torch.iinfo(dtype).max).all()
    pos = torch.arange(384)
    mod = mask_mod_of(pos, pos, docs, docs)
    ours = tables(block_mask(mod, pos, pos, q_docs=docs, k_docs=docs))
    theirs = tables(reference(mod, 2, 384, 384))
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
