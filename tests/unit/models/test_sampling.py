"""Batched sampling with the KV cache: left-padded rows of different prompts decode as
each prompt does alone, stop where they should, and sample reproducibly."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model_config

from recipes_lib.errors import ConfigError
from recipes_lib.generate import generate
from recipes_lib.models import Transformer
from recipes_lib.models.sampling import sample_completions

VOCAB = 300
PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11], [8, 9, 10, 200], [77, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]


def build(**changes) -> Transformer:
    config = tiny_model_config(
        **{"vocab_size": VOCAB, "dim": 64, "ffn_dim": 96, "max_seq_len": 96, "init_std": 0.3}
        | changes
    )
    torch.manual_seed(0)
    model = Transformer(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


VARIANTS = {
    "gqa": {},
    "tied-mqa": {"n_kv_heads": 1, "tie_embeddings": True},
    "windows": {  # Gemma 3's local layers: a window shorter than the rows
        "family": "gemma3",
        "norm_placement": "both",
        "norm_gain_offset": 1.0,
        "activation": "gelu_tanh",
        "scale_embeddings": True,
        "qk_norm": "head",
        "sliding_window": 6,
        "window_layers": [0],
        "local_rope_theta": 10000.0,
        "tie_embeddings": True,
    },
}


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_batched_greedy_rows_equal_each_prompt_decoded_alone(variant, static):
    """Eager steps, and the static step a CUDA graph captures (run eagerly here)."""
    model = build(**VARIANTS[variant])
    batched = sample_completions(
        model, PROMPTS, 24, temperature=0.0, completions_per_prompt=2, graphed=static
    )
    alone = [generate(model, prompt, 24) for prompt in PROMPTS]
    assert batched.tokens == [tokens for tokens in alone for _ in range(2)]
    assert len(set(map(tuple, alone))) == len(alone)  # the prompts lead different ways
    assert not any(batched.finished)


def test_rows_stop_at_their_own_stop_token_and_sampling_is_seeded():
    model = build()
    alone = [generate(model, prompt, 24) for prompt in PROMPTS]
    stop = alone[2][5]  # the sixth token of the third prompt's greedy completion
    greedy = sample_completions(model, PROMPTS, 24, temperature=0.0, stop_ids=[stop])
    for tokens, finished, full in zip(greedy.tokens, greedy.finished, alone, strict=True):
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert tokens == full[:cut] and finished == (stop in full)
    assert greedy.finished[2] and len(greedy.tokens[2]) == 6

    def draw(seed):
        generator = torch.Generator().manual_seed(seed)
        return sample_completions(
            model, PROMPTS, 16, completions_per_prompt=3, top_p=0.9, generator=generator
        ).tokens

    first = draw(1)
    assert first == draw(1) and first != draw(2)
    assert len({tuple(t) for t in first[:3]}) > 1  # a prompt's completions differ


def test_bad_sampling_requests_are_refused():
    model = build()
    with pytest.raises(ConfigError, match="max_seq_len=96"):
        sample_completions(model, PROMPTS, 90)
    with pytest.raises(ConfigError, match="top_p"):
        sample_completions(model, PROMPTS, 4, top_p=0.0)
    with pytest.raises(ConfigError, match="at least one token"):
        sample_completions(model, [[1], []], 4)


def test_the_static_step_under_autocast_draws_as_the_eager_one():
    """A trainer's autocast computes keys in a lower dtype than the cache's."""
    model = build()

    def draw(static: bool):
        generator = torch.Generator().manual_seed(0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return sample_completions(
                model, PROMPTS, 12, completions_per_prompt=2, generator=generator, graphed=static
            ).tokens

    assert draw(True) == draw(False)


def test_label_logprobs_at_a_temperature_are_those_of_sampling_at_it():
    """GRPO's ratio compares log-probs of the distribution the completions came from."""
    model = build()
    ids = torch.tensor([PROMPTS[0]])
    labels = torch.roll(ids, -1, dims=1)
    expected = torch.log_softmax(model(ids).float() / 0.7, dim=-1)
    expected = expected.gather(-1, labels[..., None])[..., 0]
    for chunk in (None, 3):
        got = model(ids, labels=labels, per_token=True, loss_chunk_size=chunk, temperature=0.7)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
