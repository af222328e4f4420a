"""Fixtures shared by the data tests: a 2 MB standard-library sample and a small tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from data_helpers import SMALL_VOCAB, STDLIB_TEST_BYTES, write_jsonl

from recipes_lib.data.corpus import iter_stdlib_documents
from recipes_lib.data.tokenizer import save_tokenizer, train_bpe_tokenizer


@pytest.fixture(scope="session")
def stdlib_texts() -> list[str]:
    """About 2 MB of the standard library's source, one text per file."""
    return [doc.text for doc in iter_stdlib_documents(max_bytes=STDLIB_TEST_BYTES)]


@pytest.fixture(scope="session")
def stdlib_jsonl(tmp_path_factory, stdlib_texts) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("stdlib") / "stdlib.jsonl", stdlib_texts)


@pytest.fixture(scope="session")
def small_tokenizer_path(tmp_path_factory, stdlib_texts) -> Path:
    """A byte-level BPE with a 512-token vocabulary, trained on the 2 MB stdlib sample."""
    tokenizer = train_bpe_tokenizer(stdlib_texts, vocab_size=SMALL_VOCAB)
    return save_tokenizer(tokenizer, tmp_path_factory.mktemp("tokenizer"))
