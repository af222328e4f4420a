"""Tiny tokenizers carrying the chat formats of today's model families, and records in
each shape a chat set holds (plain, multi-turn, tool calls, reasoning).

Each family's Jinja template is in ``tests/fixtures/chat_templates/`` (written for the
tests in the family's published format). :func:`write_family_tokenizer` saves a
byte-level BPE with the family's special tokens (and its added non-special ones, such
as Qwen's ``<think>``) and a ``tokenizer_config.json`` holding the template, as a
Hugging Face folder: what ``AutoTokenizer.from_pretrained`` and the library both read.
Nothing is downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from recipes_lib.data.tokenizer import save_tokenizer, train_bpe_tokenizer

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
VOCAB = 600


@dataclass(frozen=True)
class ChatFamily:
    """One family's chat format: its template file, tokens and what its records use."""

    name: str
    template: str  # file name under TEMPLATES
    eos: str
    specials: tuple[str, ...]  # special tokens (the EOS and BOS among them)
    added: tuple[str, ...] = ()  # added tokens that are not special
    bos: str | None = None
    reasoning_field: str | None = "reasoning_content"  # where a turn's reasoning goes
    tools: bool = True  # renders tool calls and results
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return (TEMPLATES / self.template).read_text()


QWEN_ADDED = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

FAMILIES = {
    family.name: family
    for family in (
        ChatFamily("qwen3", "qwen3.jinja", "<|im_end|>", CHATML, QWEN_ADDED),
        ChatFamily(
            "qwen3_no_think",
            "qwen3.jinja",
            "<|im_end|>",
            CHATML,
            QWEN_ADDED,
            template_kwargs={"enable_thinking": False},
        ),
        ChatFamily("qwen3_5", "qwen3_5.jinja", "<|im_end|>", CHATML, QWEN_ADDED),
        ChatFamily(
            "llama3_1",
            "llama3_1.jinja",
            "<|eot_id|>",
            (
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
                "<|eom_id|>",
                "<|python_tag|>",
            ),
            bos="<|begin_of_text|>",
            reasoning_field=None,
        ),
        ChatFamily(
            "gemma3",
            "gemma3.jinja",
            "<eos>",
            ("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"),
            bos="<bos>",
            reasoning_field=None,
            tools=False,
        ),
        ChatFamily(
            "mistral",
            "mistral.jinja",
            "</s>",
            (
                "<s>",
                "</s>",
                "[INST]",
                "[/INST]",
                "[SYSTEM_PROMPT]",
                "[/SYSTEM_PROMPT]",
                "[AVAILABLE_TOOLS]",
                "[/AVAILABLE_TOOLS]",
                "[TOOL_CALLS]",
                "[TOOL_RESULTS]",
                "[/TOOL_RESULTS]",
            ),
            bos="<s>",
            reasoning_field=None,
        ),
        ChatFamily(
            "gpt_oss",
            "gpt_oss.jinja",
            "<|return|>",
            (
                "<|endoftext|>",
                "<|start|>",
                "<|end|>",
                "<|message|>",
                "<|channel|>",
                "<|constrain|>",
                "<|return|>",
                "<|call|>",
            ),
            reasoning_field="thinking",
        ),
        ChatFamily("smollm3", "smollm3.jinja", "<|im_end|>", CHATML, QWEN_ADDED),
        ChatFamily(
            "smollm3_no_think",
            "smollm3.jinja",
            "<|im_end|>",
            CHATML,
            QWEN_ADDED,
            template_kwargs={"enable_thinking": False},
        ),
    )
}

_WORDS = (
    "the weather in paris is mild today so take a light coat and walk along the river "
    "while the model reads tokens and thinks step by step before it answers a question "
    "about numbers such as two plus two which makes four"
).split()


@cache
def _trained_tokenizer_json() -> str:
    """One byte-level BPE for every family (trained once per process), as JSON."""
    texts = [" ".join(_WORDS[i:] + _WORDS[:i]) for i in range(len(_WORDS))]
    texts += [json.dumps(r) for r in all_records(None)]
    tokenizer = train_bpe_tokenizer(texts * 4, VOCAB, "<|endoftext|>")
    return tokenizer.to_str()


def write_family_tokenizer(folder: Path, family: ChatFamily, template: str | None = None) -> Path:
    """A Hugging Face tokenizer folder for ``family`` (``template`` replaces its own)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(_trained_tokenizer_json())
    tokenizer.add_special_tokens([t for t in family.specials if tokenizer.token_to_id(t) is None])
    if family.added:
        tokenizer.add_tokens(list(family.added))
    folder.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tokenizer, folder / "tokenizer.json")
    settings: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": family.eos,
        "pad_token": family.eos,
        "chat_template": template if template is not None else family.text,
    }
    if family.bos is not None:
        settings["bos_token"] = family.bos
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    return folder


# ------------------------------------------------------------------------- records
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city today.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def _call(city: str, call_id: str) -> dict:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": city}},
    }


def plain_records() -> list[dict]:
    return [
        {"prompt": "what is two plus two", "response": "two plus two makes four"},
        {
            "messages": [
                {"role": "user", "content": "the weather in paris"},
                {"role": "assistant", "content": "mild today, take a light coat"},
            ]
        },
    ]


def multi_turn_records() -> list[dict]:
    return [
        {
            "messages": [
                {"role": "system", "content": "answer in few words"},
                {"role": "user", "content": "what is two plus two"},
                {"role": "assistant", "content": "four"},
                {"role": "user", "content": "and the weather in paris"},
                {"role": "assistant", "content": "mild, walk along the river"},
            ]
        }
    ]


def tool_records() -> list[dict]:
    return [
        {
            "tools": [WEATHER_TOOL],
            "messages": [
                {"role": "user", "content": "the weather in paris"},
                {"role": "assistant", "content": "", "tool_calls": [_call("paris", "call00001")]},
                {
                    "role": "tool",
                    "tool_call_id": "call00001",
                    "name": "get_weather",
                    "content": "sunny and 21 degrees",
                },
                {"role": "assistant", "content": "it is mild in paris today"},
                {"role": "user", "content": "and in rome"},
                {"role": "assistant", "content": "", "tool_calls": [_call("rome", "call00002")]},
                {
                    "role": "tool",
                    "tool_call_id": "call00002",
                    "name": "get_weather",
                    "content": "clear and 25 degrees",
                },
                {"role": "assistant", "content": "warm in rome"},
            ],
        }
    ]


def reasoning_records(field: str) -> list[dict]:
    """Conversations whose assistant turns carry reasoning in ``field``."""
    return [
        {
            "messages": [
                {"role": "user", "content": "what is two plus two"},
                {"role": "assistant", "content": "four", field: "two and two make four"},
            ]
        },
        {
            "messages": [
                {"role": "user", "content": "what is two plus two"},
                {"role": "assistant", "content": "four", field: "add them step by step"},
                {"role": "user", "content": "and the weather in paris"},
                {"role": "assistant", "content": "mild", field: "paris is mild today"},
            ]
        },
    ]


def all_records(family: ChatFamily | None) -> list[dict]:
    """Every record shape ``family`` renders (every shape for None)."""
    records = plain_records() + multi_turn_records()
    if family is None or family.tools:
        records += tool_records()
    if family is None:
        records += reasoning_records("reasoning_content") + reasoning_records("thinking")
    elif family.reasoning_field is not None:
        records += reasoning_records(family.reasoning_field)
    return records


def write_records(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path
