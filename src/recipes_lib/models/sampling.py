"""Batched sampling with the KV cache: several completions of each of several prompts.

The rows (each prompt ``k`` times) are left-padded to the longest prompt and decoded
together: the prompts run once into a :class:`~recipes_lib.models.kv_cache.KVCache`
whose ``key_mask`` keeps every row to its own tokens, then each step feeds one token per
row. A row that produced a stop token is finished: its later positions are padding,
masked like the prompt's, and the loop ends when every row is finished or
``max_new_tokens`` were drawn. Sampling runs on the model's device (with a generator
there), so one seed gives the same completions on the same device.

Shapes: B rows (prompts times ``k``), P the longest prompt, N new tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from recipes_lib.errors import ConfigError
from recipes_lib.models.graphed_decode import GraphedDecoder, graphable
from recipes_lib.models.hf_fallback import FallbackCache, HFCausalLM
from recipes_lib.models.kv_cache import KVCache
from recipes_lib.models.rope import longrope_restarts
from recipes_lib.models.transformer import Transformer


@dataclass
class Completions:
    """What :func:`sample_completions` drew.

    Attributes:
        tokens: each row's new tokens (a stop token it produced included); row
            ``i * k + j`` is prompt ``i``'s ``j``-th completion.
        finished: whether each row ended with a stop token (else it was cut at
            ``max_new_tokens``).
    """

    tokens: list[list[int]]
    finished: list[bool]


def check_sampling(temperature: float, top_p: float, max_new_tokens: int) -> None:
    """Refuse sampling settings out of range, naming the setting."""
    if temperature < 0:
        raise ConfigError(f"temperature={temperature} must be >= 0 (0: greedy)")
    if not 0 < top_p <= 1:
        raise ConfigError(f"top_p={top_p} must be in (0, 1]")
    if max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens={max_new_tokens} must be >= 0")


def sample_next(
    logits: Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> Tensor:
    """One token per row of next-token ``logits`` ``(B, V)``: the most likely at
    ``temperature == 0``, else drawn from ``softmax(logits / temperature)`` cut to its
    nucleus (the most likely tokens whose probabilities first reach ``top_p``)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (B, V)
    if top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass of the more likely tokens
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)  # the first stays
        choice = torch.multinomial(sorted_probs, 1, generator=generator)  # (B, 1)
        return order.gather(-1, choice)[:, 0]
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def decoding_cache(
    model: Transformer | HFCausalLM, batch_size: int, max_len: int
) -> KVCache | FallbackCache:
    """An empty cache for ``model`` to decode ``batch_size`` rows of up to ``max_len``
    positions: a :class:`KVCache`, or transformers' own cache for the transformers
    fallback."""
    if isinstance(model, HFCausalLM):
        return model.new_cache(batch_size, max_len)
    return KVCache.for_model(model, batch_size=batch_size, max_len=max_len)


def _all_rows(done: Tensor) -> bool:
    return bool(done.all())


@torch.no_grad()
def sample_completions(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    completions_per_prompt: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    stop_ids: Collection[int] = (),
    generator: torch.Generator | None = None,
    all_finished: Callable[[Tensor], bool] | None = None,
    graphed: bool | None = None,
) -> Completions:
    """Up to ``max_new_tokens`` new tokens for each prompt, ``completions_per_prompt``
    times, decoded together (see the module docstring).

    Args:
        model: the decoder (in eval mode for the call; an FSDP-sharded one too: it runs
            through the model's forward, which gathers the weights).
        prompts: token ids, at least one per prompt; lengths may differ.
        max_new_tokens: the most tokens a completion gets.
        completions_per_prompt: ``k``, the completions of each prompt.
        temperature, top_p: as :func:`sample_next`.
        stop_ids: token ids that finish a completion (the one drawn is kept).
        generator: draws the samples (on the model's device); None: torch's global one.
        all_finished: whether decoding may end, given the rows' finished flags ``(B,)``;
            default: when every row finished. Processes that shard one model must agree
            (each step is a forward pass that gathers weights): pass one that combines
            every process's flags.
        graphed: decode each step as one static step
            (:class:`~recipes_lib.models.graphed_decode.GraphedDecoder`: a CUDA graph on
            CUDA); None: where :func:`~recipes_lib.models.graphed_decode.graphable`.

    Raises:
        ConfigError: an empty prompt, bad sampling settings, or rows longer than
            ``model.max_seq_len``.
    """
    check_sampling(temperature, top_p, max_new_tokens)
    if completions_per_prompt < 1:
        raise ConfigError(f"completions per prompt must be >= 1, got {completions_per_prompt}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("sampling needs prompts of at least one token each")
    rows = [list(map(int, p)) for p in prompts for _ in range(completions_per_prompt)]
    B, P = len(rows), max(map(len, rows))
    positions = P + max(max_new_tokens - 1, 0)  # the last new token is never fed back
    if positions > model.config.max_seq_len:
        raise ConfigError(
            f"prompts of up to {P} tokens and {max_new_tokens} new tokens need {positions} "
            f"positions, more than model.max_seq_len={model.config.max_seq_len}"
        )
    if longrope_restarts(model.config, 0, positions):
        raise ConfigError(
            f"batched sampling of a longrope model stays within rope_scaling."
            f"original_max_seq_len={model.config.rope_scaling.original_max_seq_len} "
            f"positions ({positions} asked)"
        )
    if max_new_tokens == 0:
        return Completions([[] for _ in rows], [False] * B)
    device = model.tok_embeddings.weight.device
    ids = torch.zeros(B, P, dtype=torch.long)
    cache = decoding_cache(model, B, positions)
    key_mask = torch.zeros(B, positions, dtype=torch.bool)
    for r, row in enumerate(rows):
        ids[r, P - len(row) :] = torch.tensor(row)
        key_mask[r, P - len(row) : P] = True
    cache.key_mask = key_mask.to(device)
    stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    new = torch.zeros(B, max_new_tokens, dtype=torch.long, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    lengths = torch.zeros(B, dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        # the model's own forward: a sharded model gathers its weights for it
        logits = model(ids.to(device), cache=cache, last_only=True)[:, -1]  # (B, V)
        static = graphable(model) if graphed is None else graphed
        # transformers' model (the fallback's cache) decodes step by step, never graphed
        decoder = GraphedDecoder(model, cache) if static and isinstance(cache, KVCache) else None
        for step in range(max_new_tokens):
            token = sample_next(logits, temperature, top_p, generator)  # (B,)
            going = ~done
            token = token.masked_fill(done, 0)
            new[:, step] = token
            lengths += going
            done = done | (torch.isin(token, stop) & going)
            if step == max_new_tokens - 1 or (all_finished or _all_rows)(done):
                break
            cache.key_mask[:, P + step] = going  # a real position for rows still going
            if decoder is not None:
                logits = decoder.step(token, P + step)  # (B, V)
            else:
                logits = model(token[:, None], cache=cache, last_only=True)[:, -1]
    finally:
        model.train(was_training)
    lengths_list, new_rows = lengths.tolist(), new.tolist()
    tokens = [row[:n] for row, n in zip(new_rows, lengths_list, strict=True)]
    return Completions(tokens, done.tolist())
