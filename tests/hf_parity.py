"""What a family's parity test against transformers needs: a transformers model with
every weight nudged off its init (so a norm gain of one or zero proves nothing), token
batches, logits from either side and transformers' greedy decoding."""

from __future__ import annotations

from typing import Any

import torch

from recipes_lib.models import Transformer

PROMPT = [5, 17, 42, 99, 3, 250, 7]
VOCAB = 300
# the transformers config fields a family's tiny parity model starts from: width 64, 4
# query and 2 KV heads, 128 positions, no special tokens; each test sets the rest
TINY_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)


def nudged_hf_model(config_cls: Any, model_cls: Any, scale: float = 0.05, **settings: Any):
    """``model_cls(config_cls(**settings))`` from seed 0, eager attention, eval mode, each
    weight moved by ``scale`` times a standard normal draw."""
    torch.manual_seed(0)
    model = model_cls(config_cls(attn_implementation="eager", **settings)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return model


def tokens(vocab: int, B: int, T: int, seed: int = 0) -> torch.Tensor:
    """``(B, T)`` token ids below ``vocab``, from ``seed``."""
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def logits_of(model, x: torch.Tensor) -> torch.Tensor:
    """The logits of a native model or a transformers one, without gradients."""
    with torch.no_grad():
        return model(x) if isinstance(model, Transformer) else model(input_ids=x).logits


def hf_greedy(hf, n: int, prompt: list[int] = PROMPT) -> list[int]:
    """The ``n`` tokens transformers' greedy ``generate`` adds to ``prompt``."""
    out = hf.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()
