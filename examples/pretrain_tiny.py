"""Pretrain the tiny recipe on the embedded corpus from Python, then sample from it greedily.

python examples/pretrain_tiny.py                      # the full recipe (~2 min on a CPU)
python examples/pretrain_tiny.py trainer.max_steps=20 # any Hydra override
"""

from __future__ import annotations

import sys

import torch

from recipes_lib.config import compose_config, to_run_config
from recipes_lib.data.tokenizer import load_tokenizer
from recipes_lib.train import run
from recipes_lib.training import CausalLMModule


def main(overrides: list[str]) -> None:
    cfg = to_run_config(compose_config(["recipe=pretrain/tiny", *overrides]))
    result = run(cfg)
    print(f"trained {result.global_step} steps, {result.tokens_seen:,} tokens")
    val_loss, val_ppl = result.metrics["val/loss"], result.metrics["val/ppl"]
    print(f"validation loss {val_loss:.3f}, perplexity {val_ppl:.1f}")

    module = CausalLMModule.load_from_checkpoint(result.last_checkpoint, map_location="cpu")
    module.configure_model()
    state = torch.load(result.last_checkpoint, map_location="cpu", weights_only=True)
    module.load_state_dict(state["state_dict"])
    tokenizer = load_tokenizer(result.tokenizer_path)
    ids = tokenizer.encode("def ").ids
    with torch.no_grad():
        for _ in range(24):  # greedy decoding, no cache: fine for a tiny model
            logits = module(torch.tensor([ids]))
            ids.append(int(logits[0, -1].argmax()))
    print(repr(tokenizer.decode(ids)))


if __name__ == "__main__":
    main(sys.argv[1:])
