"""Chat records: validation, turn-by-turn rendering, the assistant mask, truncation, packing."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
import torch
from data_helpers import synthetic_documents

from recipes_lib.config.schema import ChatFormatConfig, DataConfig, SourceConfig, TokenizerConfig
from recipes_lib.data.chat.examples import (
    IGNORE_INDEX,
    ChatExample,
    next_token_labels,
    truncate,
)
from recipes_lib.data.chat.instructions import stdlib_instruction_records
from recipes_lib.data.chat.messages import record_messages
from recipes_lib.data.chat.module import ChatDataModule
from recipes_lib.data.chat.packing import PackedChatDataset, pack_examples, pad_collate
from recipes_lib.data.chat.template import (
    ChatRenderer,
    RenderedChat,
    render_chat,
    trained_tokens,
)
from recipes_lib.data.tokenizer import CHATML_TOKENS, save_tokenizer, train_bpe_tokenizer
from recipes_lib.errors import ConfigError, DataError

CONVERSATION = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What does the model read?"},
    {"role": "assistant", "content": "The model reads tokens."},
    {"role": "user", "content": "And then?"},
    {"role": "assistant", "content": "It predicts the next one, while loss falls."},
]
ASSISTANT_TEXTS = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
ZEPHYR_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>\n' }}{% generation %}{{ m['content'] + eos_token }}"
    "{% endgeneration %}{{ '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def chat_tokenizer():
    tokenizer = train_bpe_tokenizer(synthetic_documents(200), vocab_size=400)
    tokenizer.add_special_tokens(list(CHATML_TOKENS))
    return tokenizer


@pytest.fixture(scope="module")
def plain_tokenizer():
    return train_bpe_tokenizer(synthetic_documents(200), vocab_size=400)


def masked_spans(tokenizer, ids: list[int], mask: list[bool]) -> list[str]:
    """The decoded text of each maximal run of masked tokens."""
    spans, run = [], []
    for token, flag in zip([*ids, None], [*mask, False], strict=True):
        if flag:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run, skip_special_tokens=False))
            run = []
    return spans


# ---------------------------------------------------------------- the mask
def test_chatml_mask_covers_exactly_the_assistant_tokens(chat_tokenizer):
    renderer = ChatRenderer(chat_tokenizer)
    rendered = renderer.render(CONVERSATION)
    assert renderer.template_name == "chatml"
    text = chat_tokenizer.decode(rendered.input_ids, skip_special_tokens=False)
    assert text == renderer.text(CONVERSATION)
    assert text.startswith("<|im_start|>system\nYou answer in one line.<|im_end|>\n")
    spans = masked_spans(chat_tokenizer, rendered.input_ids, rendered.assistant_mask)
    assert spans == [f"{content}<|im_end|>" for content in ASSISTANT_TEXTS]
    # labels: the next token wherever that token is assistant output, nothing else
    labels = next_token_labels(rendered)
    for t, label in enumerate(labels):
        if t + 1 < len(rendered) and rendered.assistant_mask[t + 1]:
            assert label == rendered.input_ids[t + 1]
        else:
            assert label == IGNORE_INDEX
    assert render_chat(CONVERSATION, None, chat_tokenizer) == (
        rendered.input_ids,
        rendered.assistant_mask,
    )


def test_tokenizer_template_with_generation_tags(chat_tokenizer):
    tokenizer = chat_tokenizer
    tokenizer.add_special_tokens(["</s>", "<s>", "<|user|>", "<|assistant|>", "<|system|>"])
    renderer = ChatRenderer(
        tokenizer, tokenizer_template=ZEPHYR_TEMPLATE, eos_token="</s>", bos_token="<s>"
    )
    assert renderer.template_name == "tokenizer"
    rendered = renderer.render(CONVERSATION)
    assert tokenizer.decode(rendered.input_ids, skip_special_tokens=False).startswith(
        "<s><|system|>"
    )
    spans = masked_spans(tokenizer, rendered.input_ids, rendered.assistant_mask)
    assert spans == [f"{content}</s>" for content in ASSISTANT_TEXTS]


def test_plain_template_needs_only_the_eos_token(plain_tokenizer):
    renderer = ChatRenderer(plain_tokenizer, "plain")
    rendered = renderer.render(CONVERSATION)
    spans = masked_spans(plain_tokenizer, rendered.input_ids, rendered.assistant_mask)
    assert spans == [f"{content}<|endoftext|>" for content in ASSISTANT_TEXTS]
    prompt = renderer.render_prompt(CONVERSATION[:2])
    assert plain_tokenizer.decode(prompt, skip_special_tokens=False).endswith("### assistant\n")


def test_builtin_chatml_without_its_tokens_fails_clearly(plain_tokenizer):
    with pytest.raises(ConfigError, match=r"'chatml' template needs .*<\|im_start\|>.*plain"):
        ChatRenderer(plain_tokenizer)
    with pytest.raises(ConfigError, match="neither a Jinja template nor a built-in"):
        ChatRenderer(plain_tokenizer, "vicuna")


def test_template_that_fails_to_render_names_the_record(chat_tokenizer):
    failing = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system turns') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    renderer = ChatRenderer(chat_tokenizer, failing)
    with pytest.raises(DataError, match="data.sources.x: record 7, field 'messages'.*no system"):
        renderer.render(CONVERSATION, index=7, source="data.sources.x")
    with pytest.raises(ConfigError, match="does not parse"):
        ChatRenderer(chat_tokenizer, "{% for m in messages %}{{ m }")


def test_rendering_many_at_once_gives_each_conversations_own_tokens(chat_tokenizer):
    failing = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system turns') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    renderer = ChatRenderer(chat_tokenizer, failing)
    talks = [
        [
            {"role": "user", "content": f"question {i} " * (i + 1)},
            {"role": "assistant", "content": f"answer {i} " * (3 * i + 1)},
        ]
        for i in range(5)
    ]
    talks[2] = [{"role": "system", "content": "be brief"}, *talks[2]]
    together = renderer.render_many([(t, None, i) for i, t in enumerate(talks)], source="s")
    assert isinstance(together[2], DataError) and "s: record 2" in str(together[2])
    for i, talk in enumerate(talks):
        if i != 2:  # the one the template fails on changes none of the others
            alone = renderer.render(talk)
            assert together[i] == alone and any(alone.assistant_mask)


def test_a_template_that_rewrites_earlier_turns_still_trains_each_answer_exactly(chat_tokenizer):
    """Puts the number of turns first, so no rendering of fewer turns starts the whole
    one: the conversation is rendered once and each answer found in it."""
    counting = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    renderer = ChatRenderer(chat_tokenizer, counting)
    segments = renderer.segments(CONVERSATION)
    assert "".join(text for text, _ in segments) == "5" + "".join(
        m["content"] for m in CONVERSATION
    )
    assert [text for text, trained in segments if trained] == ASSISTANT_TEXTS


# ------------------------------------------------------------- bad records
CHAT = ChatFormatConfig()


@pytest.mark.parametrize(
    "record,message",
    [
        ({"messages": "hello"}, "field 'messages': must be a non-empty list"),
        ({"messages": []}, "field 'messages': must be a non-empty list"),
        ({"messages": ["hi"]}, r"field 'messages\[0\]': must be a mapping"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]},
            r"field 'messages\[1\].role': unknown role 'bot'",
        ),
        ({"messages": [{"role": "user"}]}, r"field 'messages\[0\].content': missing"),
        ({"messages": [{"role": "user", "content": 3}]}, r"messages\[0\].content': int, not text"),
        ({"messages": [{"role": "user", "content": "a"}]}, "'messages': has no assistant turn"),
        ({"prompt": "a"}, "field 'response': missing"),
        ({"prompt": "", "response": "b"}, "field 'prompt': empty"),
        ({"text": "a"}, "has neither field 'messages' nor 'prompt'/'response'"),
    ],
)
def test_bad_records_name_the_index_and_field(record, message):
    with pytest.raises(DataError, match=f"data.sources.chat: record 3\\b.*{message}"):
        record_messages(record, 3, CHAT, "data.sources.chat")


def test_prompt_response_and_custom_field_names():
    chat = ChatFormatConfig(prompt_field="question", response_field="answer")
    assert record_messages({"question": "q?", "answer": "a."}, 0, chat) == [
        {"role": "user", "content": "q?"},
        {"role": "assistant", "content": "a."},
    ]


# -------------------------------------------------------------- truncation
def test_truncation_policies():
    rendered = RenderedChat(list(range(10)), [False] * 4 + [True] * 6)
    assert truncate(rendered, 10, "drop") is rendered
    assert truncate(rendered, 6, "right").input_ids == [0, 1, 2, 3, 4, 5]
    left = truncate(rendered, 6, "left")
    assert left.input_ids == [4, 5, 6, 7, 8, 9] and all(left.assistant_mask)
    assert truncate(rendered, 6, "drop") is None
    with pytest.raises(ConfigError, match="data.chat.truncation='middle'"):
        truncate(rendered, 6, "middle")


# ----------------------------------------------------------------- packing
def _examples(lengths: list[int]) -> list[ChatExample]:
    examples = []
    for i, n in enumerate(lengths):
        ids = torch.arange(n) + 100 * i
        labels = ids.clone()
        labels[-1] = IGNORE_INDEX
        examples.append(ChatExample(ids.numpy(), labels.numpy()))
    return examples


def test_packing_places_every_example_once_with_doc_ids():
    lengths = [5, 9, 3, 12, 7, 2, 16, 4, 8, 6]
    dataset = PackedChatDataset(_examples(lengths), seq_len=16, pad_id=0, seed=3)
    rows = pack_examples(lengths, 16, seed=3)
    assert rows == dataset.rows
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert len(rows) < len(lengths)  # several conversations share rows
    for index, row in enumerate(rows):
        item = dataset[index]
        assert item["input_ids"].shape == item["labels"].shape == item["doc_ids"].shape == (16,)
        position = 0
        for doc, example in enumerate(row):
            n = lengths[example]
            span = slice(position, position + n)
            assert torch.equal(item["input_ids"][span], torch.arange(n) + 100 * example)
            assert (item["doc_ids"][span] == doc).all()
            assert item["labels"][position + n - 1] == IGNORE_INDEX  # never across documents
            position += n
        assert (item["doc_ids"][position:] == len(row)).all()
        assert (item["labels"][position:] == IGNORE_INDEX).all()
        assert (item["input_ids"][position:] == 0).all()


def test_unpacked_batches_pad_to_the_longest():
    examples = _examples([3, 6])
    collate = pad_collate(pad_id=9)
    batch = collate(
        [
            {"input_ids": torch.from_numpy(e.input_ids), "labels": torch.from_numpy(e.labels)}
            for e in examples
        ]
    )
    assert batch["input_ids"].shape == (2, 6)
    assert batch["input_ids"][0].tolist() == [0, 1, 2, 9, 9, 9]
    assert batch["labels"][0].tolist() == [0, 1, IGNORE_INDEX] + [IGNORE_INDEX] * 3
    assert batch["doc_ids"][0].tolist() == [0, 0, 0, 1, 1, 1]


# ------------------------------------------------------------- data module
def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _chat_config(tmp_path: Path, tokenizer_path, **chat) -> DataConfig:
    return DataConfig(
        sources={"chat": SourceConfig(path=str(tmp_path / "chat.jsonl"))},
        tokenizer=TokenizerConfig(
            path=str(tokenizer_path) if tokenizer_path else None, vocab_size=400
        ),
        seq_len=64,
        batch_size=2,
        val_fraction=0.0,
        cache_dir=str(tmp_path / "cache"),
        seed=0,
        chat=ChatFormatConfig(**chat),
    )


@pytest.fixture
def chat_tokenizer_file(tmp_path, chat_tokenizer):
    return save_tokenizer(chat_tokenizer, tmp_path / "tok")


def test_bad_records_fail_or_are_counted_and_skipped(tmp_path, chat_tokenizer_file, caplog):
    good = {"prompt": "What does the model read?", "response": "Tokens."}
    records = [good, good, {"prompt": "x"}, good, {"messages": [{"role": "robot", "content": "y"}]}]
    _write_jsonl(tmp_path / "chat.jsonl", records)
    module = ChatDataModule(_chat_config(tmp_path, chat_tokenizer_file), 512, 128)
    bad = r"data.sources.chat: .*chat\.jsonl:3, field 'response': missing"
    with pytest.raises(DataError, match=bad):
        module.setup()
    module = ChatDataModule(
        _chat_config(tmp_path, chat_tokenizer_file, on_bad_record="skip"), 512, 128
    )
    with caplog.at_level(logging.WARNING, logger="recipes_lib"):
        module.setup()
    assert re.search(r"skipped 2 malformed record.*chat\.jsonl:3.*chat\.jsonl:5", caplog.text)
    stats = module.stats["chat"]
    assert (stats.records, stats.skipped, stats.train) == (5, 2, 3)
    with pytest.raises(ConfigError, match="data.chat.on_bad_record='ignore'"):
        ChatDataModule(
            _chat_config(tmp_path, chat_tokenizer_file, on_bad_record="ignore"), 512, 128
        )


def test_records_over_max_record_bytes_fail_or_are_skipped_before_tokenizing(
    tmp_path, chat_tokenizer_file, caplog
):
    good = {"prompt": "What does the model read?", "response": "Tokens."}
    huge = {"prompt": "word " * 1_000, "response": "Tokens."}  # 5,000 bytes of prompt
    _write_jsonl(tmp_path / "chat.jsonl", [good, huge, good, good])
    config = _chat_config(tmp_path, chat_tokenizer_file, max_record_bytes=4_000)
    with pytest.raises(
        DataError,
        match=r"chat\.jsonl:2: 5,\d{3} bytes of text, over data\.chat\.max_record_bytes=4000 "
        r"\(set data\.chat\.on_bad_record=skip",
    ):
        ChatDataModule(config, 512, 128).setup()
    config.chat.on_bad_record = "skip"
    module = ChatDataModule(config, 512, 128)
    with caplog.at_level(logging.WARNING, logger="recipes_lib"):
        module.setup()
    assert re.search(r"skipped 1 record.*max_record_bytes.*chat\.jsonl:2", caplog.text)
    assert module.stats["chat"].train == 3
    assert module.skipped_records() == {
        "over data.chat.max_record_bytes (data.chat.on_bad_record=skip)": 1
    }
    with pytest.raises(ConfigError, match="data.chat.max_record_bytes=0"):
        ChatDataModule(_chat_config(tmp_path, chat_tokenizer_file, max_record_bytes=0), 512, 128)


def test_a_record_of_megabytes_is_refused_by_default(tmp_path, chat_tokenizer_file):
    # 5 MB of text in one line: refused as it is read, before the seconds and gigabytes
    # that tokenizing it would take
    huge = {
        "messages": [
            {"role": "user", "content": "x" * 5_000_000},
            {"role": "assistant", "content": "ok"},
        ]
    }
    _write_jsonl(tmp_path / "chat.jsonl", [huge])
    module = ChatDataModule(_chat_config(tmp_path, chat_tokenizer_file), 512, 128)
    with pytest.raises(
        DataError,
        match=r"chat\.jsonl:1: 5,000,\d+ bytes of text, over data\.chat\.max_record_bytes=4000000",
    ):
        module.setup()


def test_over_long_conversations_by_policy(tmp_path, chat_tokenizer_file):
    long = {"prompt": "the model reads " * 40, "response": "tokens and predicts " * 40}
    short = {"prompt": "read?", "response": "tokens."}
    _write_jsonl(tmp_path / "chat.jsonl", [short, long, short])
    counts = {}
    for policy in ("right", "left", "drop"):
        module = ChatDataModule(
            _chat_config(tmp_path, chat_tokenizer_file, truncation=policy), 512, 128
        )
        module.setup()
        s = module.stats["chat"]
        counts[policy] = (s.train, s.truncated, s.dropped)
    # right keeps the prompt's head, which holds no assistant token: nothing left to learn
    assert counts == {"right": (2, 1, 1), "left": (3, 1, 0), "drop": (2, 0, 1)}


def test_stdlib_sft_module_batches_split_and_resume(tmp_path):
    config = DataConfig(
        sources={"sft": SourceConfig(builtin="stdlib_sft", max_documents=120)},
        tokenizer=TokenizerConfig(vocab_size=512),
        seq_len=512,
        batch_size=4,
        val_fraction=0.1,
        cache_dir=str(tmp_path / "cache"),
        seed=5,
        chat=ChatFormatConfig(truncation="left"),
    )
    module = ChatDataModule(config, model_vocab_size=512, model_max_seq_len=512)
    module.prepare_data()
    module.setup()
    assert module.renderer.template_name == "chatml"  # a fresh tokenizer gets the chat tokens
    assert all(module.tokenizer.token_to_id(t) is not None for t in CHATML_TOKENS)
    assert module.vocab_size <= 512
    stats = module.stats["sft"]
    assert stats.train + stats.val + stats.dropped == 120 and stats.val >= 1
    batch = next(iter(module.train_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 512)
    assert (batch["labels"] != IGNORE_INDEX).any()
    assert batch["doc_ids"].dtype == torch.int32
    assert max(len(row) for row in module.train_dataset.rows) >= 2  # packed
    val = next(iter(module.val_dataloader()))
    assert val["input_ids"].shape[1] == 512

    stream = iter(module.train_dataloader())
    batches = [next(stream)["input_ids"] for _ in range(3)]
    resumed = ChatDataModule(config, model_vocab_size=512, model_max_seq_len=512)
    resumed.load_state_dict({"consumed_samples": 8})  # two batches of four
    resumed.setup()
    assert torch.equal(next(iter(resumed.train_dataloader()))["input_ids"], batches[2])


def test_stdlib_instruction_records_are_deterministic():
    records = stdlib_instruction_records(30, seed=1)
    assert records == stdlib_instruction_records(30, seed=1)
    assert len(records) == 30 and records != stdlib_instruction_records(30, seed=2)
    for record in records:
        name = record["source"].split(":")[1].split(".")[-1]
        assert f"def {name}(" in record["prompt"] and '"""' in record["prompt"]
        assert record["response"].lstrip().startswith(("def ", "async def "))
        compile(record["response"], record["source"], "exec")  # a whole, dedented function


def test_tokenizer_template_is_picked_up_from_a_hugging_face_folder(tmp_path, chat_tokenizer):
    folder = tmp_path / "hf"
    save_tokenizer(chat_tokenizer, folder)
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>"
        "{% endfor %}"
    )
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    _write_jsonl(tmp_path / "chat.jsonl", [{"prompt": "read?", "response": "tokens."}] * 3)
    module = ChatDataModule(_chat_config(tmp_path, folder), 512, 128)
    module.setup()
    assert module.renderer.template_name == "tokenizer"
    assert module.renderer.template_text == template


@pytest.mark.parametrize(
    "spans",
    [[], [(3, 9)], [(0, 4), (2, 12)], [(5, 6), (0, 20)], [(1, 2), (7, 7), (9, 30)], [(4, 4)]],
)
def test_trained_tokens_mark_each_token_holding_a_trained_character(spans):
    offsets = [(0, 2), (2, 5), (5, 5), (5, 8), (8, 13), (13, 20), (20, 31)]
    expected = [
        end > start and any(a < end and b > start for a, b in spans if a < b)
        for start, end in offsets
    ]
    assert trained_tokens(offsets, spans) == expected
    assert trained_tokens([], spans) == []


def test_next_token_labels_are_the_next_tokens_that_are_trained():
    ids, mask = [5, 6, 7, 8, 9], [False, True, True, False, True]
    labels = next_token_labels(RenderedChat(ids, mask))
    assert labels == [6, 7, IGNORE_INDEX, 9, IGNORE_INDEX]
    assert next_token_labels(RenderedChat([], [])) == []
