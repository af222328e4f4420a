"""Decoding through the transformers fallback (model.family=hf): transformers' own cache
behind the library's generation, batched sampling and GRPO rollouts."""

from __future__ import annotations

import pytest
import torch
from hf_folders import write_tokenizer
from safetensors.torch import load_file

from recipes_lib.checkpoint.hf_files import read_folder_config
from recipes_lib.data.chat.instructions import stdlib_instruction_records
from recipes_lib.errors import ConfigError
from recipes_lib.generate import generate, load_for_generation
from recipes_lib.models.hf_fallback import (
    FallbackCache,
    HFCausalLM,
    build_hf_model,
    fallback_model_config,
)
from recipes_lib.models.sampling import sample_completions

transformers = pytest.importorskip("transformers")

# each type under the names its config reads; the others are ignored
TINY = dict(
    vocab_size=256,
    hidden_size=32,
    n_embd=32,
    intermediate_size=64,
    num_hidden_layers=2,
    n_layer=2,
    num_attention_heads=4,
    n_head=4,
    max_position_embeddings=128,
    n_positions=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
PROMPT = [5, 17, 33, 9, 100]
MATCH = "recipes_lib.rewards.format_match"


def tiny_folder(path, model_type, vocab_size=256, **config):
    cfg = transformers.AutoConfig.for_model(
        model_type, **{**TINY, "vocab_size": vocab_size, **config}
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def built(folder) -> HFCausalLM:
    return build_hf_model(fallback_model_config(read_folder_config(folder)), folder=folder).eval()


@pytest.mark.parametrize(
    ("model_type", "config"),
    [
        ("gpt2", {}),  # absolute position embeddings
        ("gpt_neox", {}),
        ("falcon", {}),
        ("mamba", {}),  # a state-space model's own cache
        # soft-capped logits (not the head's product) and a sliding window's cache
        ("gemma2", dict(head_dim=8, final_logit_softcapping=2.0, sliding_window=4)),
    ],
)
def test_greedy_generation_gives_transformers_tokens(tmp_path, model_type, config):
    model = built(tiny_folder(tmp_path, model_type, **config))
    prompt = torch.tensor([PROMPT])
    theirs = model.hf.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=24,
        min_new_tokens=24,
        do_sample=False,
    )[0, len(PROMPT) :].tolist()
    assert generate(model, PROMPT, 24) == theirs
    assert generate(model, PROMPT, 24, use_cache=False) == theirs


@pytest.mark.parametrize("model_type", ["gpt2", "mamba"])
def test_left_padded_rows_decode_as_each_alone(tmp_path, model_type):
    """GPT-2's absolute positions count each row's real tokens, as transformers'
    generate counts them under its attention mask; a state-space model's state skips
    the padding."""
    model = built(tiny_folder(tmp_path, model_type))
    prompts = [PROMPT, [7, 8], [40, 41, 42]]
    together = sample_completions(model, prompts, 12, temperature=0.0)
    alone = [sample_completions(model, [p], 12, temperature=0.0).tokens[0] for p in prompts]
    assert together.tokens == alone
    assert all(len(tokens) == 12 for tokens in alone)


def test_the_cache_holds_what_was_decoded_and_restarts_only_at_zero(tmp_path):
    model = built(tiny_folder(tmp_path, "gpt_neox"))
    cache = model.new_cache(1, 16)
    assert isinstance(cache, FallbackCache) and cache.max_len == 16
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        first = model(ids, cache=cache, last_only=True)
        assert cache.length == len(PROMPT)
        again = model(ids, cache=cache, start_pos=0, last_only=True)  # starting again
        torch.testing.assert_close(first, again)
        whole = model(ids)
        torch.testing.assert_close(first[:, -1], whole[:, -1], atol=1e-5, rtol=1e-5)
        with pytest.raises(ConfigError, match="restarts at 0 or continues"):
            model(ids[:, :1], cache=cache, start_pos=2)
        with pytest.raises(ConfigError, match="do not fit the KV cache of 16"):
            model(torch.ones(1, 12, dtype=torch.long), cache=cache)
    with pytest.raises(ConfigError, match="does not fit model.max_seq_len=128"):
        model.new_cache(1, 129)


def test_recipes_generate_loads_a_folder_without_a_native_family(tmp_path):
    folder = tiny_folder(tmp_path / "gpt2", "gpt2", vocab_size=512)
    write_tokenizer(folder, stdlib_instruction_records(50))
    loaded = load_for_generation(folder)
    assert isinstance(loaded.model, HFCausalLM) and loaded.kind == "hf"
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    prompt = torch.tensor([PROMPT])
    expected = theirs.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, min_new_tokens=8
    )[0, len(PROMPT) :].tolist()
    assert generate(loaded.model, PROMPT, 8) == expected


def test_grpo_trains_a_model_of_the_fallback(tmp_path):
    """Rollouts sampled with transformers' cache, then the clipped objective's updates."""
    from tiny import QUIET_OVERRIDES

    from recipes_lib.config import compose_config
    from recipes_lib.train import run

    folder = tiny_folder(tmp_path / "neox", "gpt_neox", vocab_size=512)
    write_tokenizer(folder, stdlib_instruction_records(50))
    overrides = [
        "recipe=grpo/tiny",
        "model=hf",
        f"stage.init_from={folder}",
        "model.vocab_size=512",
        "data.tokenizer.vocab_size=512",
        "data.seq_len=128",
        "data.batch_size=2",
        "data.sources.stdlib_grpo.max_documents=40",
        "stage.grpo.max_new_tokens=8",
        "stage.grpo.completions_per_prompt=4",
        "trainer.max_steps=3",
        "trainer.limit_val_batches=0",
        "callbacks=minimal",
        *QUIET_OVERRIDES,
        f"run.dir={tmp_path / 'run'}",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    cfg = compose_config(overrides)
    # random text earns it in some completions and not others: advantages that differ
    cfg.stage.grpo.rewards = {
        "an_e": {"weight": 1.0, "fn": {"_target_": MATCH, "pattern": ".*e.*"}},
    }
    result = run(cfg)
    assert result.global_step == 3
    start = load_file(folder / "model.safetensors")
    trained = load_file(result.output_dir / "model.safetensors")
    shared = set(start) & set(trained)  # a tied head is saved once
    assert len(shared) >= len(start) - 1
    changed = [k for k in shared if not torch.equal(start[k], trained[k])]
    assert changed and all(torch.isfinite(trained[k]).all() for k in changed)
    # recipes-generate reads the run's weights under transformers' names
    loaded = load_for_generation(result.output_dir)
    assert isinstance(loaded.model, HFCausalLM) and loaded.kind == "native"
    prompt = loaded.tokenizer.encode("def ").ids
    assert generate(loaded.model, prompt, 8) == generate(loaded.model, prompt, 8, use_cache=False)


def test_evaluation_scores_a_model_of_the_fallback(tmp_path):
    """recipes-eval's log-likelihoods read the hidden states through the model's head."""
    from recipes_lib.evaluation.scoring import Request, score_requests

    model = built(tiny_folder(tmp_path, "gpt_neox"))
    requests = [Request((5, 17, 33), (9, 100)), Request((7,), (8, 9, 10))]
    got = score_requests(model, requests, batch_size=2)
    for request, (logprob, greedy) in zip(requests, got, strict=True):
        tokens = [*request.context, *request.continuation]
        with torch.no_grad():
            logits = model.hf(input_ids=torch.tensor([tokens[:-1]])).logits[0]
        logprobs = torch.log_softmax(logits.float(), -1)
        rows = range(len(request.context) - 1, len(tokens) - 1)
        pairs = list(zip(rows, request.continuation, strict=True))
        assert logprob == pytest.approx(sum(logprobs[r, t].item() for r, t in pairs), abs=1e-4)
        assert greedy == all(logprobs[r].argmax().item() == t for r, t in pairs)
