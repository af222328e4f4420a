"""Helpers for the data tests (imported by name; kept apart from conftest.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from recipes_lib.config.schema import DataConfig, SourceConfig, TokenizerConfig

SMALL_VOCAB = 512
STDLIB_TEST_BYTES = 2_000_000

_WORDS = (
    "the model reads tokens and predicts the next one while gradients flow back through "
    "every layer of attention so that loss falls slowly over many steps of training data"
).split()


def synthetic_documents(
    n: int, seed: int = 0, min_words: int = 20, max_words: int = 120
) -> list[str]:
    """``n`` deterministic pseudo-English documents of varying length."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words))]
        docs.append(f"Document {i}. " + " ".join(words) + ".\n")
    return docs


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    with path.open("w") as f:
        for text in texts:
            f.write(json.dumps({field: text}) + "\n")
    return path


def data_config(
    cache_dir: Path,
    sources: dict[str, SourceConfig] | None = None,
    tokenizer_path: Path | None = None,
    **overrides,
) -> DataConfig:
    """A DataConfig for tests: its own cache, a small vocabulary, seed 0."""
    settings = {"seq_len": 64, "batch_size": 4, "val_fraction": 0.1, "seed": 0}
    settings.update(overrides)
    return DataConfig(
        sources=sources or {},
        tokenizer=TokenizerConfig(
            path=str(tokenizer_path) if tokenizer_path else None,
            vocab_size=SMALL_VOCAB,
            train_max_bytes=STDLIB_TEST_BYTES,
        ),
        cache_dir=str(cache_dir),
        **settings,
    )
