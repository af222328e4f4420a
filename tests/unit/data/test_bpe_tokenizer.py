import json

import pytest
from data_helpers import SMALL_VOCAB

from recipes_lib.data.tokenizer import (
    check_vocab_fits,
    eos_token_id,
    load_tokenizer,
    save_tokenizer,
    tokenizer_sha256,
    tokenizer_vocab_size,
    train_bpe_tokenizer,
)
from recipes_lib.errors import ConfigError, DataError

SAMPLES = [
    "def f(x):\n    return x ** 2  # square\n",
    "  leading spaces, tabs\tand unicode: naïve café, 日本語, emoji 🙂\n",
    "",
    "<|endoftext|> inside text stays text",
]


def test_trained_tokenizer_round_trips_text(small_tokenizer_path):
    tokenizer = load_tokenizer(small_tokenizer_path)
    for text in SAMPLES:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_vocab_and_eos(small_tokenizer_path):
    tokenizer = load_tokenizer(small_tokenizer_path)
    assert tokenizer.get_vocab_size() == SMALL_VOCAB
    assert eos_token_id(tokenizer, "<|endoftext|>") == 0
    # Even 255 merges compress Python source well below one token per byte.
    text = "import os\nimport sys\n\ndef main():\n    return 0\n"
    assert len(tokenizer.encode(text).ids) < 0.6 * len(text.encode())


def test_load_from_directory_or_file_and_missing(tmp_path, small_tokenizer_path):
    by_dir = load_tokenizer(small_tokenizer_path.parent)
    assert tokenizer_sha256(by_dir) == tokenizer_sha256(load_tokenizer(small_tokenizer_path))
    with pytest.raises(DataError, match=r"data\.tokenizer\.path.*nowhere"):
        load_tokenizer(tmp_path / "nowhere")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match=r"bad\.json is not a valid tokenizer"):
        load_tokenizer(tmp_path / "bad.json")


def test_max_bytes_caps_training_text_and_training_is_deterministic():
    texts = [f"word{i} " * 50 for i in range(200)]
    a = train_bpe_tokenizer(texts, vocab_size=300, max_bytes=2_000)
    b = train_bpe_tokenizer(texts, vocab_size=300, max_bytes=2_000)
    full = train_bpe_tokenizer(texts, vocab_size=300)
    assert tokenizer_sha256(a) == tokenizer_sha256(b)
    assert tokenizer_sha256(a) != tokenizer_sha256(full)
    # word150 only appears beyond the first 2000 bytes
    assert "word150" not in json.dumps(a.get_vocab())


def test_save_is_atomic_and_makes_directories(tmp_path, small_tokenizer_path):
    tokenizer = load_tokenizer(small_tokenizer_path)
    path = save_tokenizer(tokenizer, tmp_path / "deep" / "dir")
    assert path.name == "tokenizer.json"
    assert [p.name for p in path.parent.iterdir()] == ["tokenizer.json"]


def test_vocab_larger_than_model_names_both_sizes_and_keys(small_tokenizer_path):
    tokenizer = load_tokenizer(small_tokenizer_path)
    assert tokenizer_vocab_size(tokenizer) == SMALL_VOCAB
    check_vocab_fits(tokenizer, SMALL_VOCAB)
    with pytest.raises(ConfigError, match=r"data\.tokenizer.*512.*model\.vocab_size=500"):
        check_vocab_fits(tokenizer, 500)


def test_bad_training_inputs():
    with pytest.raises(ConfigError, match=r"data\.tokenizer\.vocab_size=100"):
        train_bpe_tokenizer(["abc"], vocab_size=100)
    with pytest.raises(DataError, match="empty"):
        train_bpe_tokenizer([], vocab_size=300)
