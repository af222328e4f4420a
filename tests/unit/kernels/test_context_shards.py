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
