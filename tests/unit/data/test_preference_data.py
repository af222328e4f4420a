"""Preference pairs: validation messages, counted skips, masks, truncation and batches."""

from __future__ import annotations

import ast
import json
import logging
from collections import Counter
from itertools import islice

import pytest
import torch
from data_helpers import data_config

from recipes_lib.config.schema import ChatFormatConfig, SourceConfig
from recipes_lib.data.chat.instructions import stdlib_instruction_records
from recipes_lib.data.chat.template import ChatRenderer
from recipes_lib.data.preference.collate import collate_pairs
from recipes_lib.data.preference.module import PreferenceDataModule
from recipes_lib.data.preference.pairs import PairEncoder, encode_records, parse_record
from recipes_lib.data.preference.stdlib_pairs import corrupt_function, stdlib_preference_records
from recipes_lib.data.tokenizer import load_tokenizer
from recipes_lib.errors import ConfigError, DataError

KEY = "data.sources.pairs"
GOOD = {"prompt": "Add two numbers.", "chosen": "return a + b", "rejected": "return a - b"}


@pytest.fixture(scope="module")
def tokenizer(small_tokenizer_path):
    return load_tokenizer(small_tokenizer_path)


def make_encoder(tokenizer, seq_len=64, **chat) -> PairEncoder:
    settings = ChatFormatConfig(**{"chat_template": "plain", "packing": False, **chat})
    return PairEncoder(ChatRenderer(tokenizer, settings.chat_template), seq_len, settings)


@pytest.mark.parametrize(
    ("bad", "field", "problem"),
    [
        ({"prompt": "p", "rejected": "r"}, "chosen", "is missing"),
        ({"prompt": "p", "chosen": "c", "rejected": "  "}, "rejected", "is empty"),
        ({"chosen": "c", "rejected": "r"}, "prompt", "is missing"),
        ({"prompt": "", "chosen": "c", "rejected": "r"}, "prompt", "is empty"),
        ({"prompt": "p", "chosen": [], "rejected": "r"}, "chosen", "is empty"),
        ({"prompt": "p", "chosen": 3, "rejected": "r"}, "chosen", "holds int"),
        (
            {"prompt": "p", "chosen": [{"role": "bot", "content": "x"}], "rejected": "r"},
            "chosen",
            "unknown role 'bot'",
        ),
    ],
)
def test_a_bad_record_is_named_by_index_and_field(tokenizer, bad, field, problem):
    records = [GOOD, GOOD, bad, GOOD]
    with pytest.raises(DataError) as info:
        encode_records(records, make_encoder(tokenizer), KEY)
    message = str(info.value)
    assert f"{KEY}: record 2" in message
    assert f"field '{field}'" in message
    assert problem in message
    assert "on_bad_record=skip" in message


def test_skipped_records_are_counted_by_reason(tokenizer):
    records = [
        GOOD,
        {"prompt": "p", "rejected": "r"},
        {"prompt": "p", "chosen": "", "rejected": "r"},
        {"prompt": "p", "rejected": "r"},
        {"prompt": "same", "chosen": "x", "rejected": "x"},
        "not a record",
        GOOD,
    ]
    encoded = encode_records(records, make_encoder(tokenizer, on_bad_record="skip"), KEY)
    assert len(encoded.pairs) == 2
    assert encoded.total == 7
    assert encoded.skipped == Counter(
        {
            "missing field 'chosen'": 2,
            "empty field 'chosen'": 1,
            "identical responses": 1,
            "not a mapping": 1,
        }
    )
    assert "skipped 5 of 7 records" in encoded.skip_summary()


def test_unknown_policies_are_config_errors(tokenizer):
    with pytest.raises(ConfigError, match="data.chat.truncation='middle'"):
        make_encoder(tokenizer, truncation="middle")
    with pytest.raises(ConfigError, match="data.chat.on_bad_record='ignore'"):
        make_encoder(tokenizer, on_bad_record="ignore")


def labelled_text(tokenizer, ids, mask) -> str:
    return tokenizer.decode([int(i) for i, m in zip(ids, mask, strict=True) if m], False)


def test_only_response_tokens_count_and_the_prompt_is_masked(tokenizer):
    encoder = make_encoder(tokenizer)
    record = parse_record(GOOD, encoder.chat, "r")
    pair = encoder.encode(record, "r")
    prompt_ids = encoder.renderer.render([{"role": "user", "content": GOOD["prompt"]}]).input_ids
    for ids, mask, response in (
        (pair.chosen_ids, pair.chosen_mask, GOOD["chosen"]),
        (pair.rejected_ids, pair.rejected_mask, GOOD["rejected"]),
    ):
        assert list(ids[: len(prompt_ids)]) == prompt_ids  # a shared, fully masked prefix
        assert not mask[: len(prompt_ids)].any()
        # the plain template trains on the response and its end-of-turn EOS only
        assert labelled_text(tokenizer, ids, mask) == response + "<|endoftext|>"
    batch = collate_pairs([_item(0, pair)], pad_id=0)
    labels = batch["labels"]
    counted = labels != -100
    assert int(counted[0].sum()) == int(pair.chosen_mask[1:].sum())
    # labels are the next token where it counts: label t is input t + 1
    torch.testing.assert_close(
        labels[0, :-1][counted[0, :-1]], batch["input_ids"][0, 1:][counted[0, :-1]]
    )


def test_chat_form_masks_every_prompt_turn_including_earlier_assistant_turns(tokenizer):
    record = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello there"},
            {"role": "user", "content": "add a and b"},
        ],
        "chosen": [{"role": "assistant", "content": "a + b"}],
        "rejected": [{"role": "assistant", "content": "a - b"}],
    }
    encoder = make_encoder(tokenizer)
    pair = encoder.encode(parse_record(record, encoder.chat, "r"), "r")
    assert labelled_text(tokenizer, pair.chosen_ids, pair.chosen_mask) == "a + b<|endoftext|>"
    assert labelled_text(tokenizer, pair.rejected_ids, pair.rejected_mask) == "a - b<|endoftext|>"


def test_full_conversations_share_their_leading_turns_as_the_prompt(tokenizer):
    turn = {"role": "user", "content": "question"}
    record = {
        "chosen": [turn, {"role": "assistant", "content": "good"}],
        "rejected": [turn, {"role": "assistant", "content": "bad"}],
    }
    parsed = parse_record(record, ChatFormatConfig(), "r")
    assert parsed.prompt == [turn]
    assert parsed.chosen == [{"role": "assistant", "content": "good"}]


def long_record(words: int) -> dict:
    return {
        "prompt": " ".join(["the"] * 20),  # about 20 tokens
        "chosen": " ".join(["the"] * words),
        "rejected": " ".join(["no"] * (words // 2)),
    }


def test_truncation_policies(tokenizer):
    record = long_record(80)
    right = make_encoder(tokenizer, seq_len=48, truncation="right")
    pair = right.encode(parse_record(record, right.chat, "r"), "r")
    assert len(pair.chosen_ids) == 49  # seq_len inputs + 1
    full_prompt = right.split(parse_record(record, right.chat, "r"), "r")[0]
    assert list(pair.chosen_ids[: len(full_prompt)]) == full_prompt  # prompt kept whole

    left = make_encoder(tokenizer, seq_len=48, truncation="left")
    pair = left.encode(parse_record(long_record(36), left.chat, "r"), "r")
    assert max(len(pair.chosen_ids), len(pair.rejected_ids)) == 49
    assert labelled_text(tokenizer, pair.chosen_ids, pair.chosen_mask).startswith("the the")
    assert pair.chosen_ids[0] == pair.rejected_ids[0]  # the same prompt cut for both

    drop = make_encoder(tokenizer, seq_len=48, truncation="drop")
    encoded = encode_records([long_record(80), GOOD], drop, KEY)  # counted even in error mode
    assert len(encoded.pairs) == 1
    assert encoded.skipped == Counter({"too long (data.chat.truncation=drop)": 1})


def _item(index, pair, reference=None):
    item = {
        "index": index,
        "chosen_ids": torch.from_numpy(pair.chosen_ids),
        "chosen_mask": torch.from_numpy(pair.chosen_mask),
        "rejected_ids": torch.from_numpy(pair.rejected_ids),
        "rejected_mask": torch.from_numpy(pair.rejected_mask),
    }
    if reference is not None:
        item["reference_logps"] = torch.tensor(reference)
    return item


def test_packed_and_padded_batches_hold_the_same_sequences(tokenizer):
    encoder = make_encoder(tokenizer, seq_len=64)
    records = [
        GOOD,
        {"prompt": "Say hi.", "chosen": "hi", "rejected": "bye bye bye"},
        {"prompt": "Count.", "chosen": "1 2 3 4 5", "rejected": "5 4"},
    ]
    pairs = encode_records(records, encoder, KEY).pairs
    items = [_item(i, p, [float(i), -float(i)]) for i, p in enumerate(pairs)]
    padded = collate_pairs(items, pad_id=0)
    packed = collate_pairs(items, pad_id=0, packing=True, seq_len=64)
    assert padded["input_ids"].shape[0] == 6 and packed["input_ids"].shape[0] < 6
    assert packed["input_ids"].shape[1] <= 64
    for batch in (padded, packed):
        assert batch["pair_index"].tolist() == [0, 1, 2]
        torch.testing.assert_close(batch["reference_logps"][:, 0], torch.tensor([0.0, 1, 2]))
        assert batch["num_tokens"] == int((batch["sequence_ids"] >= 0).sum())
        for s in range(6):  # chosen j = sequence j, rejected j = sequence 3 + j
            where = batch["sequence_ids"] == s
            pair = pairs[s % 3]
            ids = pair.chosen_ids if s < 3 else pair.rejected_ids
            assert batch["input_ids"][where].tolist() == ids[:-1].tolist()
            rows = where.any(dim=1).nonzero().flatten()
            assert len(rows) == 1  # one row, one document of it
            assert batch["doc_ids"][rows[0]][where[rows[0]]].unique().numel() == 1
    assert padded["sequence_ids"][:, 0].tolist() == list(range(6))


def test_stdlib_pairs_extend_the_instruction_records_deterministically():
    first = stdlib_preference_records(max_records=60, seed=3)
    assert first == stdlib_preference_records(max_records=60, seed=3)
    assert len(first) == 60
    instructions = {r["source"]: r for r in stdlib_instruction_records(200, seed=3)}
    for record in first:
        # the prompt and the chosen response are the stdlib_sft record's
        assert record["prompt"] == instructions[record["source"]]["prompt"]
        assert record["chosen"] == instructions[record["source"]]["response"]
        assert record["rejected"] != record["chosen"]
        # only the body changes: the signature and docstring are kept
        docstring_end = ast.parse(record["chosen"]).body[0].body[0].end_lineno
        head = "".join(record["chosen"].splitlines(keepends=True)[:docstring_end])
        assert record["rejected"].startswith(head)
    kinds = Counter(r["corruption"] for r in stdlib_preference_records(max_records=400, seed=0))
    assert set(kinds) == {"shuffle", "drop", "operator", "return_none"}


def test_corruptions_edit_the_body_in_place():
    source = (
        'def f(a, b):\n    """Doc."""\n    total = a + b\n    # keep\n    if total == 0:\n'
        "        return True\n    return total\n"
    )
    seen = {}
    for seed in range(40):
        rejected, kind = corrupt_function(source, "f", seed)
        seen[kind] = rejected
    assert set(seen) == {"shuffle", "drop", "operator", "return_none"}
    assert seen["return_none"].count("return None") == 1
    assert "# keep" in seen["shuffle"] and sorted(seen["shuffle"]) == sorted(source)
    assert len(seen["drop"].splitlines()) < len(source.splitlines())
    flipped = [a != b for a, b in zip(seen["operator"], source, strict=False)]
    assert seen["operator"] != source and sum(flipped) <= 5


def test_pairs_that_truncation_makes_identical_are_skipped(tokenizer):
    encoder = make_encoder(tokenizer, seq_len=40, truncation="right")
    same_start = {
        "prompt": "Say it.",
        "chosen": " ".join(["the"] * 60) + " yes",
        "rejected": " ".join(["the"] * 60) + " no",
    }
    encoded = encode_records([same_start, GOOD], encoder, KEY)
    assert len(encoded.pairs) == 1
    assert encoded.skipped == Counter(
        {"identical after truncation (data.chat.truncation=right)": 1}
    )


def _calling(name: str) -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": name, "arguments": {"a": 1}}}
    return [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
        {"role": "assistant", "content": "It is 2."},
    ]


def test_pairs_that_render_the_same_are_skipped_and_named(tokenizer):
    """Responses told apart only by their tool call's name: a template that writes no
    tool calls renders both alike, so the pair is refused, or skipped with its reason;
    the built-in plain template writes the call and keeps it, the call's tokens trained."""
    pair = {"prompt": "Add one.", "chosen": _calling("add"), "rejected": _calling("subtract")}
    content_only = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + eos_token }}{% endfor %}"
    )
    with pytest.raises(DataError, match=r"record 0: fields 'chosen' and 'rejected' render to"):
        encode_records([pair, GOOD], make_encoder(tokenizer, chat_template=content_only), KEY)
    skipping = make_encoder(tokenizer, chat_template=content_only, on_bad_record="skip")
    encoded = encode_records([pair, GOOD], skipping, KEY)
    assert len(encoded.pairs) == 1
    assert encoded.skipped == Counter({"identical once rendered": 1})
    (kept,) = encode_records([pair], make_encoder(tokenizer, seq_len=256), KEY).pairs
    assert kept.chosen_ids.tolist() != kept.rejected_ids.tolist()
    text = tokenizer.decode(kept.rejected_ids[kept.rejected_mask].tolist())
    assert '"subtract"' in text and "It is 2." in text


def pairs_config(tmp_path, tokenizer_path, sources, **overrides):
    settings = {"seq_len": 96, "batch_size": 2, "val_fraction": 0.25}
    settings.update(overrides)
    config = data_config(tmp_path / "cache", sources, tokenizer_path, **settings)
    config.chat.chat_template = "plain"
    config.chat.packing = False
    return config


def test_data_module_reads_jsonl_holds_out_pairs_and_resumes(
    tmp_path, small_tokenizer_path, caplog
):
    path = tmp_path / "pairs.jsonl"
    rows = [
        {"prompt": f"Question {i}?", "chosen": f"Answer {i}.", "rejected": f"No {i}."}
        for i in range(20)
    ]
    rows[5] = {"prompt": "Question 5?", "chosen": "Answer 5."}  # no rejected
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sources = {"pairs": SourceConfig(path=str(path))}
    config = pairs_config(tmp_path, small_tokenizer_path, sources)
    with pytest.raises(DataError, match=r"data.sources.pairs: .*pairs\.jsonl:6: field 'rejected'"):
        PreferenceDataModule(config, 512, 1024).setup()

    config.chat.on_bad_record = "skip"
    module = PreferenceDataModule(config, 512, 1024, total_train_samples=12)
    with caplog.at_level(logging.WARNING, logger="recipes_lib"):
        module.setup()
    assert "skipped 1 of 20 records: 1 missing field 'rejected'" in caplog.text
    assert module.skipped == Counter({"missing field 'rejected'": 1})
    assert (module.prepared.num_train, module.prepared.num_val) == (14, 5)
    stream = [b["pair_index"].tolist() for b in islice(module.train_dataloader(), 6)]
    assert len(module.train_dataloader()) == 6  # the run's share: 12 pairs, 2 a batch

    resumed = PreferenceDataModule(config, 512, 1024, total_train_samples=12)
    resumed.load_state_dict({"consumed_samples": 4})
    assert [b["pair_index"].tolist() for b in islice(resumed.train_dataloader(), 4)] == stream[2:]

    table = torch.arange(28, dtype=torch.float32).view(14, 2)
    module.set_reference_logps("train", table)
    batch = next(iter(module.train_dataloader()))
    torch.testing.assert_close(batch["reference_logps"], table[batch["pair_index"]])
    ordered = [b["pair_index"] for b in module.reference_dataloader("val")]
    assert torch.cat(ordered).tolist() == list(range(5))


def test_pairs_over_max_record_bytes_fail_or_are_skipped(tmp_path, small_tokenizer_path):
    path = tmp_path / "pairs.jsonl"
    rows = [
        {"prompt": f"Question {i}?", "chosen": f"Answer {i}.", "rejected": f"No {i}."}
        for i in range(8)
    ]
    rows[3]["chosen"] = "long " * 400  # 2,000 bytes
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = pairs_config(tmp_path, small_tokenizer_path, {"pairs": SourceConfig(path=str(path))})
    config.chat.max_record_bytes = 1_000
    with pytest.raises(DataError, match=r"pairs\.jsonl:4: 2,\d+ bytes of text, over data\.chat"):
        PreferenceDataModule(config, 512, 1024).setup()
    config.chat.on_bad_record = "skip"
    module = PreferenceDataModule(config, 512, 1024)
    module.setup()
    assert module.prepared.num_train + module.prepared.num_val == 7
    assert module.skipped_records() == {
        "over data.chat.max_record_bytes (data.chat.on_bad_record=skip)": 1
    }


def test_packing_without_document_masking_is_refused(tmp_path, small_tokenizer_path):
    config = pairs_config(tmp_path, small_tokenizer_path, {})
    config.chat.packing = True
    with pytest.raises(ConfigError, match="data.document_mask=true"):
        PreferenceDataModule(config, 512, 1024)


def test_a_text_corpus_is_not_a_preference_source(tmp_path, small_tokenizer_path):
    config = pairs_config(tmp_path, small_tokenizer_path, {"web": SourceConfig(builtin="stdlib")})
    with pytest.raises(DataError, match="data.sources.web.builtin='stdlib'.*stdlib_dpo"):
        PreferenceDataModule(config, 512, 1024).setup()


def test_compiled_packed_rows_are_as_wide_as_the_longest_sequence_for_the_whole_run(
    tmp_path, small_tokenizer_path
):
    """Packed rows for compiled blocks take one width for the run (one graph), the
    data's longest sequence rounded up to a multiple of 128, not ``data.seq_len``: short
    pairs fill their rows instead of padding wide ones."""
    path = tmp_path / "pairs.jsonl"
    rows = [
        {"prompt": f"Question {i}?", "chosen": f"Answer {i}.", "rejected": f"No {i}."}
        for i in range(16)
    ]
    rows[3]["chosen"] = " ".join(["word"] * 150)  # the longest sequence, a few hundred tokens
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = pairs_config(tmp_path, small_tokenizer_path, {"pairs": SourceConfig(path=str(path))})
    config.chat.packing = True
    config.document_mask = True
    config.seq_len = 1024
    module = PreferenceDataModule(config, 512, 1024, total_train_samples=16)
    module.fixed_width = True  # compiled blocks
    module.setup()
    longest = max(p.max_len for p in module.train_dataset.pairs + module.val_dataset.pairs)
    width = module.packed_width()
    assert longest - 1 <= width < longest + 127 and width % 128 == 0 and width < 1024
    train = module.train_dataloader()  # a stream: one pass is its length
    widths = {tuple(b["input_ids"].shape[1:]) for b in islice(train, len(train))}
    widths |= {tuple(b["input_ids"].shape[1:]) for b in module.val_dataloader()}
    assert widths == {(width,)}
    module.fixed_width = False  # eager: as wide as each batch's fullest row
    assert module.collate_fn().seq_len == 1024
