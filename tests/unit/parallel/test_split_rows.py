"""A batch's rows split for context parallelism: rows whose length does not split into
``2 x degree`` chunks (padded SFT rows) are widened with padding that carries no loss."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from recipes_lib.parallel.context import split_rows

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"
)


@pytest.fixture
def one_process(tmp_path):
    store = f"file://{tmp_path / 'store'}"
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_whole_rows_without_context_parallelism():
    ids = torch.arange(6).view(1, 6)
    assert split_rows(SimpleNamespace(), ids, ids) is None


def test_rows_are_padded_to_split_and_the_padding_trains_nothing(one_process):
    # rank 0 of a group of two (the group's other rank is not needed to split)
    strategy = SimpleNamespace(context_parallel=2, context_group=None)
    ids = torch.arange(1, 7).view(1, 6)  # 6 tokens: widened to 8, chunks of 2
    labels = ids + 10
    docs = torch.zeros_like(ids)
    mask = torch.ones_like(ids, dtype=torch.bool)
    split = split_rows(strategy, ids, labels, docs, mask)
    assert split is not None
    shard, (local_ids, local_labels, local_docs, local_mask) = split
    assert shard.seq_len == 8 and shard.positions.tolist() == [0, 1, 6, 7]
    assert local_ids.tolist() == [[1, 2, 0, 0]]
    assert local_labels.tolist() == [[11, 12, -100, -100]]
    assert local_docs.tolist() == [[0, 0, -1, -1]]
    assert local_mask.tolist() == [[True, True, False, False]]
