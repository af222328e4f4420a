"""Sampling on a GPU: the CUDA-graphed decoding step gives the eager step's tokens, also
under a trainer's autocast."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model_config

from recipes_lib.models import Transformer
from recipes_lib.models.graphed_decode import graphable
from recipes_lib.models.sampling import sample_completions

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11], [8, 9, 10, 200], [77, 1, 2, 3, 4, 5, 6, 7, 8, 9]]


def build() -> Transformer:
    config = tiny_model_config(
        vocab_size=300, dim=64, ffn_dim=96, max_seq_len=128, init_std=0.3, n_kv_heads=1
    )
    torch.manual_seed(0)
    return Transformer(config).cuda().eval()


def test_the_graphed_step_decodes_as_the_eager_one():
    model = build()
    assert graphable(model)
    eager = sample_completions(
        model, PROMPTS, 40, temperature=0.0, completions_per_prompt=3, graphed=False
    )
    graphed = sample_completions(model, PROMPTS, 40, temperature=0.0, completions_per_prompt=3)
    assert graphed.tokens == eager.tokens
    with torch.autocast("cuda", dtype=torch.bfloat16):  # as a trainer's bf16-mixed runs it
        first = sample_completions(
            model,
            PROMPTS,
            40,
            completions_per_prompt=3,
            generator=torch.Generator("cuda").manual_seed(1),
        )
        again = sample_completions(
            model,
            PROMPTS,
            40,
            completions_per_prompt=3,
            generator=torch.Generator("cuda").manual_seed(1),
        )
    assert first.tokens == again.tokens and all(len(t) == 40 for t in first.tokens)
