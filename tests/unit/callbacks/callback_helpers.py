"""The run the callback tests watch: a one-layer decoder that fits a few steps in a fraction
of a second, and random token batches for it."""

from __future__ import annotations

import torch
from tiny import tiny_model_config

from recipes_lib.config.schema import KernelsConfig, OptimConfig, SchedulerConfig
from recipes_lib.training import CausalLMModule

BATCH, SEQ_LEN, VOCAB = 2, 8, 32
# one layer, two heads: these tests watch the training loop, not the model
MODEL = tiny_model_config(
    vocab_size=VOCAB, dim=16, n_layers=1, n_heads=2, n_kv_heads=None, ffn_dim=32, max_seq_len=16
)


def tiny_causal_lm(total_steps: int, schedule: SchedulerConfig, lr: float = 1e-2, **kwargs):
    """A :class:`CausalLMModule` of :data:`MODEL` that sees ``BATCH * SEQ_LEN`` tokens a step
    (``kwargs``: further module arguments, such as ``gradient_clip_val``)."""
    return CausalLMModule(
        MODEL,
        KernelsConfig(),
        OptimConfig(lr=lr),
        schedule,
        total_steps=total_steps,
        tokens_per_step=BATCH * SEQ_LEN,
        **kwargs,
    )


def random_batches(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` batches of ``BATCH`` rows of random tokens, the labels the inputs shifted by one."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ_LEN + 1), generator=gen)
        batches.append({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]})
    return batches
