"""Tool use, reasoning and the common record formats: read, rendered through the chat
template as transformers renders them, trained as data.chat.train_on says, cut between
turns, and refused with one line when malformed."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from data_helpers import synthetic_documents

from recipes_lib.config.schema import ChatFormatConfig
from recipes_lib.data.chat.examples import truncate
from recipes_lib.data.chat.formats import check_format
from recipes_lib.data.chat.messages import record_conversation
from recipes_lib.data.chat.template import CHATML_TEMPLATE, ChatRenderer
from recipes_lib.data.tokenizer import CHATML_TOKENS, train_bpe_tokenizer
from recipes_lib.errors import ConfigError, DataError

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
        },
    }
]
TOOL_RECORD = {
    "tools": TOOLS,
    "messages": [
        {"role": "system", "content": "You use tools."},
        {"role": "user", "content": "What is 2 plus 3?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "assistant", "content": "It is 5."},
        {"role": "user", "content": "And 1 plus 1?"},
        {
            "role": "assistant",
            "content": "Let me add.",
            "tool_calls": [
                {"id": "c2", "type": "function", "function": {"name": "add", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "2"},
        {"role": "assistant", "content": "It is 2."},
    ],
}
REASONING_RECORD = {
    "messages": [
        {"role": "user", "content": "Is 7 prime?"},
        {"role": "assistant", "reasoning_content": "7 has no divisors but 1.", "content": "Yes."},
    ]
}


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = train_bpe_tokenizer(synthetic_documents(200), vocab_size=400)
    tokenizer.add_special_tokens(list(CHATML_TOKENS))
    return tokenizer


def _hf(tokenizer, tmp_path):
    from transformers import PreTrainedTokenizerFast

    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>")


def _trained_text(tokenizer, rendered) -> list[str]:
    spans, run = [], []
    for token, flag in zip(
        [*rendered.input_ids, None], [*rendered.assistant_mask, False], strict=True
    ):
        if flag:
            run.append(token)
        elif run:
            spans.append(tokenizer.decode(run, skip_special_tokens=False))
            run = []
    return spans


@pytest.mark.parametrize("record", [TOOL_RECORD, REASONING_RECORD], ids=["tools", "reasoning"])
def test_token_ids_equal_transformers_apply_chat_template(tokenizer, tmp_path, record):
    conversation = record_conversation(record, 0, ChatFormatConfig())
    rendered = ChatRenderer(tokenizer).render(conversation.messages, tools=conversation.tools)
    hf = _hf(tokenizer, tmp_path)
    expected = hf.apply_chat_template(
        record["messages"], tools=record.get("tools"), chat_template=CHATML_TEMPLATE, tokenize=True
    )
    expected = expected if isinstance(expected, list) else expected["input_ids"]
    assert rendered.input_ids == list(expected)


def test_tool_calls_are_trained_and_tool_results_and_prompts_are_not(tokenizer):
    conversation = record_conversation(TOOL_RECORD, 0, ChatFormatConfig())
    rendered = ChatRenderer(tokenizer).render(conversation.messages, tools=conversation.tools)
    spans = _trained_text(tokenizer, rendered)
    assert len(spans) == 4
    assert spans[0].startswith("<tool_call>") and '"add"' in spans[0]
    assert spans[0].endswith("<|im_end|>")
    assert spans[1] == "It is 5.<|im_end|>"
    assert spans[2].startswith("Let me add.\n<tool_call>")
    assert not any("What is 2" in s or s.startswith("5") or "You use tools" in s for s in spans)


def test_train_on_last_and_without_reasoning(tokenizer):
    conversation = record_conversation(TOOL_RECORD, 0, ChatFormatConfig())
    last = ChatRenderer(tokenizer, train_on="last").render(
        conversation.messages, tools=conversation.tools
    )
    assert _trained_text(tokenizer, last) == ["It is 2.<|im_end|>"]
    messages = record_conversation(REASONING_RECORD, 0, ChatFormatConfig()).messages
    whole = _trained_text(tokenizer, ChatRenderer(tokenizer).render(messages))
    assert whole == ["<think>\n7 has no divisors but 1.\n</think>\n\nYes.<|im_end|>"]
    bare = ChatRenderer(tokenizer, train_on="without_reasoning").render(messages)
    assert _trained_text(tokenizer, bare) == ["Yes.<|im_end|>"]


def test_a_think_block_in_content_goes_where_the_template_reads_reasoning(tokenizer):
    template = CHATML_TEMPLATE  # reads reasoning_content
    in_content = [
        {"role": "user", "content": "Is 7 prime?"},
        {"role": "assistant", "content": "<think>\n7 has no divisors but 1.\n</think>\n\nYes."},
    ]
    renderer = ChatRenderer(tokenizer, template, train_on="without_reasoning")
    fielded = record_conversation(REASONING_RECORD, 0, ChatFormatConfig()).messages
    assert renderer.render(in_content) == renderer.render(fielded)


def test_the_thinking_switch_reaches_the_template(tokenizer):
    template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
        "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
        "{% if enable_thinking is defined and not enable_thinking %}{{ 'no think\n' }}{% endif %}"
        "{% endif %}"
    )
    messages = record_conversation(REASONING_RECORD, 0, ChatFormatConfig()).messages[:1]
    off = ChatRenderer(tokenizer, template, enable_thinking=False).render_prompt(messages)
    on = ChatRenderer(tokenizer, template, enable_thinking=True).render_prompt(messages)
    assert tokenizer.decode(off, skip_special_tokens=False).endswith("no think\n")
    assert len(on) < len(off)


def test_sharegpt_and_alpaca_read_as_messages():
    chat = ChatFormatConfig()
    sharegpt = {
        "conversations": [
            {"from": "human", "value": "add 2 and 3"},
            {"from": "function_call", "value": json.dumps({"name": "add", "arguments": {"a": 2}})},
            {"from": "observation", "value": "5"},
            {"from": "gpt", "value": "5"},
        ],
        "tools": json.dumps(TOOLS),
    }
    read = record_conversation(sharegpt, 0, chat)
    assert [m["role"] for m in read.messages] == ["user", "assistant", "tool", "assistant"]
    assert read.messages[1]["tool_calls"][0]["function"]["name"] == "add"
    assert read.tools == TOOLS
    alpaca = {"instruction": "Sum", "input": "2 3", "output": "5", "system": "Be brief."}
    assert record_conversation(alpaca, 0, chat).messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Sum\n\n2 3"},
        {"role": "assistant", "content": "5"},
    ]
    named = replace(chat, format="alpaca")
    with pytest.raises(DataError, match="record 0, field 'instruction': missing"):
        record_conversation({"messages": []}, 0, named)
    with pytest.raises(ConfigError, match="data.chat.format='vicuna'"):
        check_format(replace(chat, format="vicuna"))


def _with(messages=None, **fields):
    return {"messages": messages or TOOL_RECORD["messages"][:5], **fields}


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (_with(TOOL_RECORD["messages"][:3]), r"'messages\[2\]': tool call 'c1' that no tool turn"),
        (
            _with([{"role": "user", "content": "a"}, {"role": "tool", "content": "5"}]),
            r"'messages\[1\]': a tool turn with no tool call before it",
        ),
        (_with(tools="{not json"), "field 'tools': is not JSON"),
        (
            _with(
                [
                    {"role": "user", "content": "a"},
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}],
                    },
                    {"role": "tool", "content": "1"},
                ]
            ),
            r"arguments' is not JSON",
        ),
        (
            _with([{"role": "user", "content": "a"}, {"role": "critic", "content": "b"}]),
            r"'messages\[1\].role': unknown role 'critic'",
        ),
        (
            _with([{"role": "user", "content": "a"}, {"role": "assistant", "content": " "}]),
            "has no assistant turn with content",
        ),
    ],
)
def test_bad_tool_records_name_the_record_and_the_reason(record, message):
    with pytest.raises(DataError, match=f"chat.jsonl:4.*{message}"):
        record_conversation(record, 3, ChatFormatConfig(), lambda i: f"chat.jsonl:{i + 1}")


def test_a_role_the_template_cannot_render_is_one_line(tokenizer):
    template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('no tool role') }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    messages = record_conversation(TOOL_RECORD, 0, ChatFormatConfig()).messages
    with pytest.raises(DataError, match="record 3.*no tool role"):
        ChatRenderer(tokenizer, template).render(messages, index=3, source="data.path")


def test_turn_truncation_never_cuts_inside_a_tool_round(tokenizer):
    conversation = record_conversation(TOOL_RECORD, 0, ChatFormatConfig())
    rendered = ChatRenderer(tokenizer).render(conversation.messages, tools=conversation.tools)
    assert len(rendered.cuts) == 2  # after "It is 5." and "It is 2."
    first = rendered.cuts[0]
    kept = truncate(rendered, rendered.cuts[1] - 1, "turn")
    assert kept is not None and kept.input_ids == rendered.input_ids[:first]
    text = tokenizer.decode(kept.input_ids, skip_special_tokens=False)
    assert text.endswith("It is 5.<|im_end|>\n") and "c2" not in text
    assert truncate(rendered, first - 1, "turn") is None
