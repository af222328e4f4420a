"""Load-balanced causal sharding: every position held once, equal causal work per rank,
and a backend that cannot run sharded refused by name."""

from __future__ import annotations

import pytest
import torch

from recipes_lib.errors import UnsupportedKernelError
from recipes_lib.kernels import FlashAttention, FlexAttention
from recipes_lib.kernels.sharded import ContextShard, ShardedAttention, load_balanced_positions


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_each_rank_holds_a_pair_of_chunks_with_equal_causal_work(degree):
    T = 16 * degree
    held = [load_balanced_positions(T, degree, r) for r in range(degree)]
    assert sorted(torch.cat(held).tolist()) == list(range(T))
    assert load_balanced_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    # a query at position p attends p + 1 keys: the same total on every rank
    work = {int((positions + 1).sum()) for positions in held}
    assert len(work) == 1


def test_rows_that_do_not_split_into_two_chunks_per_rank_are_refused():
    with pytest.raises(ValueError, match="4 chunks"):
        load_balanced_positions(10, 2, 0)


def test_a_backend_without_sharded_support_is_refused():
    shard = ContextShard(seq_len=8, degree=1, rank=0)
    with pytest.raises(UnsupportedKernelError, match="kernels.attention=flash_attn"):
        ShardedAttention(FlashAttention(), shard)
    mask = ShardedAttention(FlexAttention(), shard).build_mask(None, 8)
    assert torch.equal(mask[0, 0], torch.ones(8, 8, dtype=torch.bool).tril())


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("window", [None, 200])
def test_the_block_mask_of_split_rows_is_the_dense_mask(rank, window):
    """The flex BlockMask (CUDA's path) allows exactly what the dense mask does: causal
    by global position, within a window, within each packed document."""
    from torch.nn.attention.flex_attention import create_mask

    T, degree = 512, 2  # chunks of 128: whole flex blocks
    shard = ContextShard(seq_len=T, degree=degree, rank=rank)
    attention = ShardedAttention(FlexAttention(), shard)
    docs = torch.tensor([[0] * 100 + [1] * 300 + [2] * 112, [0] * 512])  # (B, T)
    local, gathered = shard.shard(docs), docs[:, shard.key_positions]
    block = attention.block_mask(local, gathered, torch.device("cpu"), window)
    allowed = create_mask(block.mask_mod, 2, 1, T // degree, T, "cpu")  # (B, 1, T / N, T)
    q, k = shard.positions[:, None], shard.key_positions[None, :]
    expected = (q >= k) & (local[:, :, None] == gathered[:, None, :])
    if window is not None:
        expected = expected & (q - k < window)
    assert torch.equal(allowed[:, 0], expected)
    # the blocks outside the mask are skipped: fewer than all of them are computed
    assert int(block.kv_num_blocks.sum()) < 2 * (T // degree // 128) * (T // 128)


def test_split_rows_use_the_block_mask_only_for_flex_on_cuda_in_whole_blocks():
    from recipes_lib.kernels.sharded import uses_block_mask

    assert uses_block_mask("flex", "cuda", 131072, 4)
    assert not uses_block_mask("flex", "cpu", 131072, 4)
    assert not uses_block_mask("sdpa", "cuda", 131072, 4)
    assert not uses_block_mask("flex", "cuda", 1000, 2)  # chunks of 250 tokens


def test_the_per_row_tensors_of_split_rows_masks_are_named():
    """Compiled blocks take flex into their graph, the mask's tensors with it: those with
    a row each (the block tables, the documents the mask_mod reads, a dense mask) are
    what the rows' dynamic dimension must cover, or a batch with more rows compiles the
    blocks again."""
    T, degree = 512, 2
    shard = ContextShard(seq_len=T, degree=degree, rank=0)
    attention = ShardedAttention(FlexAttention(), shard)
    docs = torch.tensor([[0] * 100 + [1] * 412, [0] * 512])  # (B, T)
    local, gathered = shard.shard(docs), docs[:, shard.key_positions]
    block = attention.block_mask(local, gathered, torch.device("cpu"), None)
    named = attention.row_tensors(block)
    assert any(t is local for t in named) and any(t is gathered for t in named)
    assert all(t.shape[0] == 2 for t in named) and len(named) > 2  # the tables too
    one_row = attention.block_mask(None, None, torch.device("cpu"), None)
    assert attention.row_tensors(one_row) == []  # one mask for every row
    alone = ShardedAttention(FlexAttention(), ContextShard(seq_len=64, degree=1, rank=0))
    dense = alone.build_mask(docs[:, :64], 64)  # the CPU's mask: (B, 1, T / N, T)
    assert [t.shape for t in alone.row_tensors(dense)] == [(2, 1, 64, 64)]
