"""Seeing what is trained: rendered examples with trained tokens marked, and the counts."""

from __future__ import annotations

import io
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from chat_families import (
    FAMILIES,
    multi_turn_records,
    plain_records,
    write_family_tokenizer,
    write_records,
)

from recipes_lib.config.schema import DataConfig, TokenizerConfig
from recipes_lib.data.chat.examples import IGNORE_INDEX, ChatExample
from recipes_lib.data.chat.module import ChatDataModule
from recipes_lib.data.chat.show import (
    ANSI_RESET,
    ANSI_TRAINED,
    mark_trained,
    marked_tokens,
    show_chat_data,
    trained_counts,
    trained_positions,
)
from recipes_lib.errors import ConfigError

FAMILY = FAMILIES["smollm3"]


def _data_module(tmp_path: Path, seq_len: int = 1024, **chat) -> ChatDataModule:
    folder = write_family_tokenizer(tmp_path / "tokenizer", FAMILY)
    path = write_records(tmp_path / "chat.jsonl", plain_records() + multi_turn_records())
    config = DataConfig(
        path=str(path),
        tokenizer=TokenizerConfig(path=str(folder), eos_token=FAMILY.eos),
        seq_len=seq_len,
        val_fraction=0.0,
        cache_dir=str(tmp_path / "cache"),
        seed=0,
    )
    datamodule = ChatDataModule(config, model_vocab_size=1024, model_max_seq_len=4096)
    datamodule.setup("fit")
    return datamodule


def test_trained_positions_read_the_next_token_labels():
    example = ChatExample(np.array([5, 6, 7, 8]), np.array([IGNORE_INDEX, 7, 8, IGNORE_INDEX]))
    assert trained_positions(example) == [False, False, True, True]


def test_marking_wraps_runs_of_trained_tokens():
    pieces = ["<u>", "hi\n", "<a>", "yes", "<e>", "\n"]
    trained = [False, False, False, True, True, False]
    assert mark_trained(pieces, trained, color=False) == "<u>hi\\n\n<a>[[yes<e>]]\\n\n"
    colored = mark_trained(pieces, trained, color=True)
    assert f"{ANSI_TRAINED}yes<e>{ANSI_RESET}" in colored and "[[" not in colored


def test_runs_of_tokens_alike_are_decoded_together():
    seen: list[list[int]] = []

    def decode(ids: list[int]) -> str:
        seen.append(ids)
        return "".join(chr(ord("a") + i) for i in ids)

    text = marked_tokens([0, 1, 2, 3, 4], [False, False, True, True, False], decode, False)
    assert text == "ab[[cd]]e" and seen == [[0, 1], [2, 3], [4]]
    # a character whose bytes span two tokens decodes whole
    tokenizer = _data_module_tokenizer()
    ids = tokenizer.encode("é", add_special_tokens=False).ids
    assert marked_tokens(ids, [True] * len(ids), tokenizer.decode, False) == "[[é]]"


def _data_module_tokenizer():
    from recipes_lib.data.tokenizer import train_bpe_tokenizer

    return train_bpe_tokenizer(["plain ascii text only"] * 4, 300)


def test_show_prints_records_with_their_trained_tokens_and_the_counts(tmp_path):
    datamodule = _data_module(tmp_path)
    out = io.StringIO()
    counts = show_chat_data(datamodule, 2, out)
    text = out.getvalue()
    assert text.count("--- data.path: ") == 2 and "chat.jsonl:1: " in text
    assert "[[two plus two makes four<|im_end|>]]" in text
    assert "[[what is two plus two" not in text  # the user's turn is not trained
    assert "\x1b[" not in text  # not a terminal: no colour
    labels = [e.labels for e in datamodule.train_dataset.examples]  # type: ignore[union-attr]
    trained = sum(int((np.asarray(x) != IGNORE_INDEX).sum()) for x in labels)
    total = sum(len(e) for e in datamodule.train_dataset.examples)  # type: ignore[union-attr]
    assert (counts.examples, counts.trained_tokens) == (3, trained)
    assert counts.untrained_tokens == total - trained
    assert text.rstrip().endswith(counts.line())
    assert "0 truncated, 0 dropped, 0 skipped" in counts.line()
    colored = io.StringIO()
    show_chat_data(datamodule, 1, colored, color=True)
    assert f"{ANSI_TRAINED}two plus two makes four<|im_end|>{ANSI_RESET}" in colored.getvalue()


def test_show_counts_truncated_records_and_says_so(tmp_path):
    datamodule = _data_module(tmp_path, seq_len=99)  # the longer records lose their end
    out = io.StringIO()
    counts = show_chat_data(datamodule, 3, out)
    assert counts.truncated == trained_counts(datamodule).truncated > 0
    assert "(truncated to data.seq_len=99)" in out.getvalue()


def test_a_negative_count_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.chat\.show=-1"):
        show_chat_data(_data_module(tmp_path), -1, io.StringIO())


def _script(name: str) -> str:
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else (shutil.which(name) or name)


def test_recipes_prepare_shows_and_proves_chat_data(tmp_path):
    write_family_tokenizer(tmp_path / "tok", FAMILY)
    write_records(tmp_path / "chat.jsonl", plain_records() + multi_turn_records())
    command = [
        _script("recipes-prepare"),
        "stage=sft",
        "data=chat",
        "data.path=chat.jsonl",
        "data.tokenizer.path=tok",
        "model.vocab_size=1024",
        f"data.tokenizer.eos_token='{FAMILY.eos}'",
        "data.val_fraction=0",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.chat.show=1",
        "data.chat.prove_masks=3",
    ]
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    proc = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "[[two plus two makes four<|im_end|>]]" in proc.stdout
    assert "3 examples: " in proc.stdout
    assert "mask proof: data.path: 3 record(s): token ids and trained tokens equal" in proc.stdout


def test_a_run_logs_its_trained_token_counts_as_it_sets_up(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        datamodule = _data_module(tmp_path)
    counts = trained_counts(datamodule)
    total = counts.trained_tokens + counts.untrained_tokens
    assert f"{counts.trained_tokens:,} of their {total:,} tokens trained" in caplog.text
