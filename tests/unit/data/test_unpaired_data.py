"""Unpaired (KTO) examples: label checks with the record's file:line, mismatched twins,
labels carried through encoding and batching."""

from __future__ import annotations

import json
import re

import pytest
import torch
from data_helpers import data_config

from recipes_lib.config.schema import ChatFormatConfig, SourceConfig
from recipes_lib.data.chat.template import ChatRenderer
from recipes_lib.data.preference.pairs import PairEncoder
from recipes_lib.data.preference.unpaired import (
    UnpairedDataModule,
    encode_unpaired,
    stdlib_unpaired_records,
)
from recipes_lib.data.tokenizer import load_tokenizer
from recipes_lib.errors import DataError

KEY = "data.sources.examples"


@pytest.fixture(scope="module")
def encoder(small_tokenizer_path):
    settings = ChatFormatConfig(chat_template="plain", packing=False)
    renderer = ChatRenderer(load_tokenizer(small_tokenizer_path), settings.chat_template)
    return PairEncoder(renderer, 64, settings)


def example(i: int, label=True, **fields) -> dict:
    return {"prompt": f"Question {i}?", "completion": f"Answer {i}.", "label": label, **fields}


def test_each_example_gets_another_prompts_completion_as_its_twin_and_keeps_its_label(encoder):
    records = [example(0), example(1, False), example(1, True, completion="Yes 1."), example(2)]
    encoded = encode_unpaired(records, encoder, KEY, [10, 11, 12, 13])
    assert encoded.kept == [10, 11, 12, 13] and not encoded.skipped
    assert [p.desirable for p in encoded.pairs] == [True, False, True, True]
    tokenizer = encoder.renderer.tokenizer
    text = [
        (tokenizer.decode(p.chosen_ids.tolist()), tokenizer.decode(p.rejected_ids.tolist()))
        for p in encoded.pairs
    ]
    # the twin follows the same prompt with the next example of another prompt
    assert "Question 0?" in text[0][1] and "Answer 1." in text[0][1]
    assert "Question 1?" in text[1][1] and "Answer 2." in text[1][1]  # skips its own prompt
    assert "Question 2?" in text[3][1] and "Answer 0." in text[3][1]  # wraps around


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        (example(2, "yes"), "field 'label' is 'yes' (str), not true or false"),
        (example(2, 1), "field 'label' is 1 (int), not true or false"),
        ({"prompt": "p", "completion": "c"}, "field 'label' is missing"),
        ({"prompt": "p", "label": True}, "field 'completion' is missing"),
        ({"completion": "c", "label": True}, "field 'prompt' is missing"),
    ],
)
def test_a_bad_example_is_named_with_its_field(encoder, bad, problem):
    records = [example(0), example(1), bad, example(3)]
    with pytest.raises(DataError, match=re.escape(f"{KEY}: record 2: {problem}")):
        encode_unpaired(records, encoder, KEY, range(4))
    skipping = PairEncoder(encoder.renderer, 64, ChatFormatConfig(on_bad_record="skip"))
    encoded = encode_unpaired(records, skipping, KEY, list(range(4)))
    assert encoded.kept == [0, 1, 3] and sum(encoded.skipped.values()) == 1


def test_a_jsonl_file_names_the_bad_line_and_batches_carry_the_labels(
    tmp_path, small_tokenizer_path
):
    path = tmp_path / "examples.jsonl"
    rows = [example(i, i % 3 != 0) for i in range(12)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = data_config(
        tmp_path / "cache",
        {"examples": SourceConfig(path=str(path))},
        small_tokenizer_path,
        seq_len=96,
        batch_size=4,
        val_fraction=0.25,
    )
    config.chat.chat_template, config.chat.packing = "plain", False
    module = UnpairedDataModule(config, 512, 1024, total_train_samples=8)
    module.setup()
    assert (module.prepared.num_train, module.prepared.num_val) == (9, 3)
    batch = next(iter(module.train_dataloader()))
    assert batch["desirable"].dtype == torch.bool
    assert batch["desirable"].shape == batch["pair_index"].shape == (4,)
    wanted = [module.train_dataset.pairs[i].desirable for i in batch["pair_index"].tolist()]
    assert batch["desirable"].tolist() == wanted

    rows[7]["label"] = "yes"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"examples\.jsonl:8: field 'label' is 'yes'"):
        UnpairedDataModule(config, 512, 1024).setup()


def test_builtin_examples_are_the_pairs_two_sides_unpaired():
    records = stdlib_unpaired_records(6)
    assert len(records) == 6
    assert [r["label"] for r in records] == [True, False] * 3
    assert records[0]["prompt"] == records[1]["prompt"]
    assert records[0]["completion"] != records[1]["completion"]


def test_only_the_examples_own_sequence_decides_its_truncation(small_tokenizer_path):
    """A long twin neither drops an example that fits nor cuts its prompt: the twin is cut
    to the room left after the example's prompt."""
    renderer = ChatRenderer(load_tokenizer(small_tokenizer_path), "plain")
    long_answer = " ".join(["word"] * 200)
    for policy in ("left", "drop", "right"):
        settings = ChatFormatConfig(chat_template="plain", packing=False, truncation=policy)
        encoder = PairEncoder(renderer, 48, settings)
        records = [example(0), example(1, completion=long_answer), example(2)]
        encoded = encode_unpaired(records, encoder, KEY, [0, 1, 2])
        first = encoded.pairs[encoded.kept.index(0)]  # its twin is the long answer
        alone = encode_unpaired([example(0), example(2)], encoder, KEY, [0, 2]).pairs[0]
        assert first.chosen_ids.tolist() == alone.chosen_ids.tolist(), policy
        assert len(first.rejected_ids) <= 49 and first.rejected_mask.any()
