"""Encoded examples kept between runs: a second data module over the same records,
tokenizer and settings reads what the first encoded (nothing is rendered again), gives
the same examples and reports the same skips; a changed file, a changed setting or an
unreadable cache file is encoded afresh."""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

import numpy as np
import pytest
from data_helpers import data_config

from recipes_lib.config.schema import SourceConfig
from recipes_lib.data.chat.module import ChatDataModule
from recipes_lib.data.chat.template import ChatRenderer
from recipes_lib.data.preference.module import PreferenceDataModule
from recipes_lib.data.preference.unpaired import UnpairedDataModule


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _pairs(tmp_path: Path) -> Path:
    rows = [
        {"prompt": f"Question {i}?", "chosen": f"Answer {i} is long.", "rejected": f"No {i}."}
        for i in range(16)
    ]
    rows[5] = {"prompt": "p", "chosen": "c"}  # no rejected: skipped
    return _write(tmp_path / "pairs.jsonl", rows)


def _config(tmp_path, tokenizer_path, path: Path, **overrides):
    settings = {"seq_len": 96, "batch_size": 2, "val_fraction": 0.25, **overrides}
    config = data_config(
        tmp_path / "cache", {"src": SourceConfig(path=str(path))}, tokenizer_path, **settings
    )
    config.chat.chat_template = "plain"
    config.chat.packing = False
    config.chat.on_bad_record = "skip"
    return config


@pytest.fixture
def count_renders(monkeypatch):
    """How many conversations the chat template rendered."""
    calls = {"n": 0}
    render_many = ChatRenderer.render_many

    def counted(self, conversations, *args, **kwargs):
        calls["n"] += len(conversations)
        return render_many(self, conversations, *args, **kwargs)

    monkeypatch.setattr(ChatRenderer, "render_many", counted)
    return calls


def _pairs_of(module) -> list[tuple]:
    return [
        (
            p.chosen_ids.tolist(),
            p.chosen_mask.tolist(),
            p.rejected_ids.tolist(),
            p.rejected_mask.tolist(),
            p.desirable,
        )
        for dataset in (module.train_dataset, module.val_dataset)
        for p in dataset.pairs
    ]


def test_a_second_preference_module_reads_the_first_ones_pairs(
    tmp_path, small_tokenizer_path, count_renders, caplog
):
    config = _config(tmp_path, small_tokenizer_path, _pairs(tmp_path))
    first = PreferenceDataModule(config, 512, 1024)
    first.setup()
    assert count_renders["n"] > 0
    assert list((tmp_path / "cache" / "encoded").glob("*.npz"))
    count_renders["n"] = 0
    second = PreferenceDataModule(config, 512, 1024)
    with caplog.at_level(logging.WARNING, logger="recipes_lib"):
        second.setup()
    assert count_renders["n"] == 0  # nothing rendered or tokenized again
    assert _pairs_of(second) == _pairs_of(first)
    assert second.skipped == first.skipped and sum(second.skipped.values()) == 1
    assert "skipped 1 of 16 records: 1 missing field 'rejected'" in caplog.text
    assert second.prepared == first.prepared


def test_kto_examples_keep_their_labels(tmp_path, small_tokenizer_path, count_renders):
    rows = [{"prompt": f"Q {i}?", "completion": f"A {i}.", "label": i % 3 == 0} for i in range(12)]
    config = _config(tmp_path, small_tokenizer_path, _write(tmp_path / "kto.jsonl", rows))
    first = UnpairedDataModule(config, 512, 1024)
    first.setup()
    count_renders["n"] = 0
    second = UnpairedDataModule(config, 512, 1024)
    second.setup()
    assert count_renders["n"] == 0
    assert _pairs_of(second) == _pairs_of(first)
    assert {p[-1] for p in _pairs_of(second)} == {True, False}


def test_a_changed_file_or_setting_is_encoded_again(tmp_path, small_tokenizer_path, count_renders):
    path = _pairs(tmp_path)
    PreferenceDataModule(_config(tmp_path, small_tokenizer_path, path), 512, 1024).setup()
    count_renders["n"] = 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[0]["chosen"] = "A different, longer answer."
    _write(path, rows)
    os.utime(path, ns=(1, 1))  # another modification time, whatever the clock says
    changed = PreferenceDataModule(_config(tmp_path, small_tokenizer_path, path), 512, 1024)
    changed.setup()
    assert count_renders["n"] > 0
    texts = [p[0] for p in _pairs_of(changed)]
    assert len(set(map(tuple, texts))) == len(texts)
    count_renders["n"] = 0
    shorter = _config(tmp_path, small_tokenizer_path, path, seq_len=64)
    PreferenceDataModule(shorter, 512, 1024).setup()
    assert count_renders["n"] > 0  # data.seq_len decides truncation: not the same examples


def test_an_unreadable_cache_file_is_named_and_encoded_again(
    tmp_path, small_tokenizer_path, caplog
):
    config = _config(tmp_path, small_tokenizer_path, _pairs(tmp_path))
    first = PreferenceDataModule(config, 512, 1024)
    first.setup()
    for file in (tmp_path / "cache" / "encoded").glob("*.npz"):
        file.write_bytes(b"not a zip file")
    second = PreferenceDataModule(config, 512, 1024)
    with caplog.at_level(logging.WARNING, logger="recipes_lib"):
        second.setup()
    assert "cannot be read" in caplog.text and "encoding them again" in caplog.text
    assert _pairs_of(second) == _pairs_of(first)
    third = PreferenceDataModule(config, 512, 1024)  # the second wrote them whole again
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="recipes_lib"):
        third.setup()
    assert "cannot be read" not in caplog.text


def test_a_cache_folder_that_cannot_be_written_costs_one_line(
    tmp_path, small_tokenizer_path, caplog, monkeypatch
):
    config = _config(tmp_path, small_tokenizer_path, _pairs(tmp_path))
    module = PreferenceDataModule(config, 512, 1024)
    encoded = tmp_path / "cache" / "encoded"
    encoded.parent.mkdir(parents=True, exist_ok=True)
    encoded.write_text("a file where the folder would go")
    with caplog.at_level(logging.WARNING, logger="recipes_lib"):
        module.setup()
    assert "could not be cached" in caplog.text
    assert module.prepared.num_train + module.prepared.num_val == 15


def test_a_second_chat_module_reads_the_first_ones_examples(
    tmp_path, small_tokenizer_path, count_renders, caplog
):
    good = [{"prompt": f"What is {i}?", "response": f"It is {i}."} for i in range(10)]
    rows = [*good[:3], {"prompt": "x"}, *good[3:]]  # record 4 lacks its response
    config = _config(tmp_path, small_tokenizer_path, _write(tmp_path / "chat.jsonl", rows))
    first = ChatDataModule(config, 512, 1024)
    first.setup()
    count_renders["n"] = 0
    second = ChatDataModule(config, 512, 1024)
    with caplog.at_level(logging.WARNING, logger="recipes_lib"):
        second.setup()
    assert count_renders["n"] == 0
    assert second.stats == first.stats and second.stats["src"].skipped == 1
    assert re.search(r"skipped 1 malformed record.*chat\.jsonl:4", caplog.text)
    assert _examples_of(second) == _examples_of(first)
    assert len(_examples_of(first)) == 10


def _examples_of(module: ChatDataModule) -> list[tuple]:
    held_out = module.val_dataset.datasets if module.val_dataset is not None else []
    return [
        (np.asarray(e.input_ids).tolist(), np.asarray(e.labels).tolist())
        for dataset in (module.train_dataset, *held_out)
        for e in dataset.examples
    ]


def test_another_eos_token_is_encoded_again(tmp_path, small_tokenizer_path):
    """The templates write ``data.tokenizer.eos_token`` after every turn: the same
    tokenizer, template and records with another end token are other examples."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(small_tokenizer_path))
    tokenizer.add_special_tokens(["<|end|>"])
    two_ends = tmp_path / "tokenizer.json"
    tokenizer.save(str(two_ends))
    rows = [{"prompt": f"What is {i}?", "response": f"It is {i}."} for i in range(6)]
    path = _write(tmp_path / "chat.jsonl", rows)
    first = ChatDataModule(_config(tmp_path, two_ends, path), 520, 1024)
    first.setup()
    config = _config(tmp_path, two_ends, path)
    config.tokenizer.eos_token = "<|end|>"
    second = ChatDataModule(config, 520, 1024)
    second.setup()
    end = tokenizer.token_to_id("<|end|>")
    assert all(end in ids for ids, _ in _examples_of(second))
    assert _examples_of(second) != _examples_of(first)
