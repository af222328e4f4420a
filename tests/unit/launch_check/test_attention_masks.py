"""The estimate of split rows' attention masks counts a dense mask for each kind of
layer whose backend takes one, and none for a kind on flex's BlockMask."""

from __future__ import annotations

import pytest
from tiny import family_overrides

from recipes_lib.config import compose_config, to_run_config
from recipes_lib.launch_check.activations import DecoderShape
from recipes_lib.launch_check.memory import _sharded_attention

# a Gemma-3-like `small` decoder split over two GPUs, chunks of 256 tokens (two blocks)
SPLIT = (
    "recipe=pretrain/tiny",
    "model=small",
    *family_overrides("gemma3"),
    "model.sliding_window=128",
    "model.window_layers=[0,1,2,3,4]",
    "strategy=ddp",
    "trainer=gpu",
    "trainer.devices=2",
    "strategy.context_parallel=2",
    "data.seq_len=1024",
)


def _masks(*overrides: str) -> tuple[float, float]:
    cfg = to_run_config(compose_config([*SPLIT, *overrides]))
    return _sharded_attention(cfg, DecoderShape.of(cfg), 2, 4, 2)


@pytest.mark.parametrize(
    ("attention", "dense_windows"),
    [("flex", 0), ("sdpa", 2), ("auto", 1), ("flex kernels.attention_global=sdpa", 1)],
)
def test_each_dense_kind_counts_one_mask(attention, dense_windows):
    bias, masks = _masks(*f"kernels.attention={attention}".split())
    one_mask = (1024 // 2) * 1024  # (1, T / N, T) booleans
    assert masks == dense_windows * one_mask
    assert bias == (2 * one_mask if dense_windows else 0)
