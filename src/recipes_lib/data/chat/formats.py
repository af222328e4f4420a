"""The shapes a chat record comes in, declared once: ``data.chat.format``.

Each format says how to recognise a record of its shape and how to read it into
OpenAI-style turns (``{"role", "content", ...}``), which
:mod:`recipes_lib.data.chat.messages` then checks. ``auto`` (the default) takes the
first format of :data:`FORMATS` whose fields the record holds:

- ``messages``: a ``data.chat.messages_field`` list of turns, as given;
- ``prompt_response``: ``data.chat.prompt_field``/``response_field`` text, one user
  turn and one assistant turn;
- ``sharegpt``: a ``conversations`` list of ``{"from", "value"}`` turns; ``human``/
  ``user``, ``gpt``/``assistant``/``model``, ``system``; ``function_call`` (the value a
  JSON call ``{"name", "arguments"}``, or a list of them) becomes an assistant turn's
  ``tool_calls``, and ``observation``/``function``/``tool`` its result;
- ``alpaca``: ``instruction`` with an optional ``input`` (joined by a blank line) as the
  user turn, ``output`` as the assistant's, and an optional ``system``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from recipes_lib.config.schema import ChatFormatConfig
from recipes_lib.data.records import RecordSource, record_where
from recipes_lib.errors import ConfigError, DataError

FORMAT_KEY = "data.chat.format"
SHAREGPT_FIELD = "conversations"
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "model": "assistant",
    "chatgpt": "assistant",
    "function_call": "assistant",
    "observation": "tool",
    "function": "tool",
    "tool": "tool",
}


@dataclass(frozen=True)
class RecordFormat:
    """One shape of chat record: whether a record has it, and its turns.

    ``read`` returns the turns and the field named in messages about them; it raises
    ``ValueError`` naming the field on a record of this shape that is malformed."""

    name: str
    detect: Callable[[Mapping, ChatFormatConfig], bool]
    read: Callable[[Mapping, ChatFormatConfig], tuple[Any, str]]


def _has(record: Mapping, *fields: str) -> bool:
    return all(record.get(f) is not None for f in fields)


def _messages(record: Mapping, chat: ChatFormatConfig) -> tuple[Any, str]:
    return record.get(chat.messages_field), chat.messages_field


def _prompt_response(record: Mapping, chat: ChatFormatConfig) -> tuple[Any, str]:
    for field in (chat.prompt_field, chat.response_field):
        value = record.get(field)
        if not isinstance(value, str) or not value.strip():
            got = "missing" if value is None else f"empty or not text: {value!r:.80}"
            raise ValueError(f"{field!r}: {got}")
    turns = [
        {"role": "user", "content": record[chat.prompt_field]},
        {"role": "assistant", "content": record[chat.response_field]},
    ]
    return turns, chat.prompt_field


def _sharegpt_calls(value: Any, where: str) -> list[dict]:
    """The tool calls of a ShareGPT ``function_call`` turn (its value JSON text)."""
    try:
        calls = json.loads(value) if isinstance(value, str) else value
    except ValueError as err:
        raise ValueError(f"{where + '.value'!r}: a function_call that is not JSON: {err}") from None
    calls = calls if isinstance(calls, list) else [calls]
    out = []
    for call in calls:
        if not isinstance(call, Mapping) or not isinstance(call.get("name"), str):
            raise ValueError(f"{where + '.value'!r}: a call needs a name, got {call!r:.80}")
        out.append(
            {
                "type": "function",
                "function": {"name": call["name"], "arguments": call.get("arguments", {})},
            }
        )
    return out


def _sharegpt(record: Mapping, chat: ChatFormatConfig) -> tuple[Any, str]:
    turns = record.get(SHAREGPT_FIELD)
    if not isinstance(turns, list):
        raise ValueError(f"{SHAREGPT_FIELD!r}: must be a list of {{from, value}} turns")
    out: list[dict] = []
    for j, turn in enumerate(turns):
        where = f"{SHAREGPT_FIELD}[{j}]"
        if not isinstance(turn, Mapping):
            raise ValueError(f"{where!r}: must be a mapping with from and value")
        speaker = turn.get("from")
        role = SHAREGPT_ROLES.get(str(speaker).lower()) if speaker is not None else None
        if role is None:
            raise ValueError(
                f"{where + '.from'!r}: unknown speaker {speaker!r}; "
                f"speakers: {list(SHAREGPT_ROLES)}"
            )
        value = turn.get("value")
        if speaker == "function_call":
            calls = _sharegpt_calls(value, where)
            if out and out[-1]["role"] == "assistant" and not out[-1].get("tool_calls"):
                out[-1]["tool_calls"] = calls  # the text before the call is the same turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": calls})
        else:
            out.append({"role": role, "content": value})
    return out, SHAREGPT_FIELD


def _alpaca(record: Mapping, chat: ChatFormatConfig) -> tuple[Any, str]:
    instruction, extra, output = (
        record.get("instruction"),
        record.get("input"),
        record.get("output"),
    )
    for field, value in (("instruction", instruction), ("output", output)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{field!r}: {'missing' if value is None else 'empty or not text'}")
    prompt = (
        f"{instruction}\n\n{extra}" if isinstance(extra, str) and extra.strip() else instruction
    )
    turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": output}]
    system = record.get("system")
    if isinstance(system, str) and system.strip():
        turns.insert(0, {"role": "system", "content": system})
    return turns, "instruction"


FORMATS: dict[str, RecordFormat] = {
    f.name: f
    for f in (
        RecordFormat("messages", lambda r, c: _has(r, c.messages_field), _messages),
        RecordFormat(
            "prompt_response",
            lambda r, c: _has(r, c.prompt_field) or _has(r, c.response_field),
            _prompt_response,
        ),
        RecordFormat("sharegpt", lambda r, c: _has(r, SHAREGPT_FIELD), _sharegpt),
        RecordFormat("alpaca", lambda r, c: _has(r, "instruction", "output"), _alpaca),
    )
}
AUTO = "auto"


def check_format(chat: ChatFormatConfig) -> None:
    """Raise :class:`ConfigError` on an unknown ``data.chat.format``."""
    if chat.format != AUTO and chat.format not in FORMATS:
        raise ConfigError(f"{FORMAT_KEY}={chat.format!r} is not one of {[AUTO, *FORMATS]}")


def record_format(record: Mapping, chat: ChatFormatConfig) -> RecordFormat | None:
    """The format of ``record``: ``data.chat.format``, else the first whose fields it has."""
    if chat.format != AUTO:
        return FORMATS[chat.format]
    return next((f for f in FORMATS.values() if f.detect(record, chat)), None)


def record_turns(
    record: Mapping, index: int, chat: ChatFormatConfig, source: RecordSource = "data"
) -> tuple[Any, str]:
    """``(turns, field)`` of one record read by its format, not yet checked.

    Raises:
        DataError: no format's fields are present, or the record is malformed for its
            format; the message names the record and field.
    """
    found = record_format(record, chat)
    if found is None:
        present = sorted(k for k, v in record.items() if v is not None)
        raise DataError(
            f"{record_where(source, index)} has neither field {chat.messages_field!r} nor "
            f"{chat.prompt_field!r}/{chat.response_field!r}, {SHAREGPT_FIELD!r} (ShareGPT) or "
            f"'instruction'/'output' (Alpaca) (fields: {present}); set data.chat.messages_field "
            f"or data.chat.prompt_field/response_field, or {FORMAT_KEY}"
        )
    try:
        return found.read(record, chat)
    except ValueError as err:
        raise DataError(f"{record_where(source, index)}, field {err}") from None
