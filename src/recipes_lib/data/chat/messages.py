"""Chat records as conversations: validating a record's turns.

A chat record is a ``messages`` list of ``{"role", "content"}`` turns (roles ``system``,
``user``, ``assistant``, ``tool``), a ``prompt``/``response`` pair read as one user turn
and one assistant turn, or one of the shapes of :mod:`recipes_lib.data.chat.formats`
(ShareGPT, Alpaca). Field names come from ``data.chat``
(:class:`~recipes_lib.config.schema.ChatFormatConfig`).

Tool use is OpenAI's: a record's ``tools`` list of JSON schemas (or that list as JSON
text), assistant turns with ``tool_calls`` (``{"id", "type": "function", "function":
{"name", "arguments"}}``, arguments a JSON object or its text), and ``tool`` turns with
a call's result, answering it by ``tool_call_id`` (else calls are answered in order).
An assistant turn may carry its reasoning in ``reasoning_content`` (Qwen's, SmolLM's
field) or ``thinking`` (gpt-oss's); the renderer gives it to the template in the field
the template reads. A conversation is
checked whole: every call answered, no result without a call, something to train.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

from recipes_lib.config.schema import ChatFormatConfig
from recipes_lib.data.records import RecordSource, record_where
from recipes_lib.errors import DataError

ROLES = ("system", "user", "assistant", "tool")
TOOLS_FIELD = "tools"
REASONING_FIELDS = ("reasoning_content", "thinking")  # where templates read reasoning
_TURN_KEYS = (*REASONING_FIELDS, "tool_call_id", "name")  # kept as given when text

Message = dict[str, Any]
Text = str | list[dict]  # plain text, or chat messages


@dataclass(frozen=True)
class Conversation:
    """A record's turns and the tool schemas its template is given (None: no tools)."""

    messages: list[Message]
    tools: list[dict] | None = None


def _bad(source: RecordSource, index: int, field: str, problem: str) -> DataError:
    return DataError(f"{record_where(source, index)}, field {field!r}: {problem}")


def _tool_call(call: Any, where: str) -> dict:
    """One ``tool_calls`` entry checked: a function name, arguments a JSON object or
    its text (raises ``ValueError`` naming the problem)."""
    if not isinstance(call, Mapping):
        raise ValueError(f"{where!r}: must be a mapping with a function, got {call!r:.80}")
    function = call.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where + '.function'!r} must be a mapping with a name (text)")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except ValueError as err:
            raise ValueError(f"{where + '.function.arguments'!r} is not JSON: {err}") from None
    elif arguments is not None and not isinstance(arguments, Mapping):
        raise ValueError(f"{where + '.function.arguments'!r} must be a JSON object or its text")
    return {k: v for k, v in call.items() if v is not None}


def _turn(turn: Any, where: str) -> Message:
    """One turn as the template is given it: role, content (text; empty on an assistant
    turn that only calls tools), and its tool calls, reasoning and call id when present
    (raises ``ValueError`` naming the field)."""
    if not isinstance(turn, Mapping):
        raise ValueError(f"{where!r}: must be a mapping with role and content, got {turn!r:.80}")
    role, content = turn.get("role"), turn.get("content")
    if role not in ROLES:
        raise ValueError(f"{where + '.role'!r}: unknown role {role!r}; roles: {list(ROLES)}")
    calls = turn.get("tool_calls")
    if calls is not None and role != "assistant":
        raise ValueError(f"{where + '.tool_calls'!r}: only an assistant turn calls tools")
    if content is None and calls:
        content = ""
    if not isinstance(content, str):
        got = "missing" if content is None else f"{type(content).__name__}, not text"
        raise ValueError(f"{where + '.content'!r}: {got}")
    message: Message = {"role": role, "content": content}
    for key in _TURN_KEYS:
        value = turn.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise ValueError(f"{where + '.' + key!r}: {type(value).__name__}, not text")
        message[key] = value
    if calls:
        if not isinstance(calls, Sequence) or isinstance(calls, str):
            raise ValueError(f"{where + '.tool_calls'!r} must be a list of calls")
        message["tool_calls"] = [
            _tool_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls)
        ]
    return message


def check_tool_rounds(messages: Sequence[Message], field: str) -> None:
    """Every tool call answered by a ``tool`` turn, and every ``tool`` turn answering a
    call made before it: by ``tool_call_id`` where the turn gives one, else the oldest
    call still open (raises ``ValueError`` naming the turn)."""
    open_calls: list[str | None] = []
    opened_at: dict[str | None, int] = {}
    for j, message in enumerate(messages):
        if message["role"] == "assistant":
            _unanswered(open_calls, opened_at, field)
            open_calls = [c.get("id") for c in message.get("tool_calls", ())]
            opened_at = {c: j for c in open_calls}
        elif message["role"] == "tool":
            answered = message.get("tool_call_id")
            if not open_calls:
                raise ValueError(f"'{field}[{j}]': a tool turn with no tool call before it")
            if answered is not None and answered in open_calls:
                open_calls.remove(answered)
            elif answered is not None and any(c is not None for c in open_calls):
                raise ValueError(
                    f"'{field}[{j}].tool_call_id': {answered!r} answers no open tool call "
                    f"(open: {[c for c in open_calls if c is not None]})"
                )
            else:
                open_calls.pop(0)
        elif message["role"] == "user":
            _unanswered(open_calls, opened_at, field)
            open_calls = []
    _unanswered(open_calls, opened_at, field)


def _unanswered(open_calls: list[str | None], opened_at: dict, field: str) -> None:
    if open_calls:
        call = open_calls[0]
        name = f"tool call {call!r}" if call is not None else "a tool call"
        raise ValueError(f"'{field}[{opened_at[call]}]': {name} that no tool turn answers")


def trainable(message: Message) -> bool:
    """Whether an assistant turn says anything: content, tool calls or reasoning."""
    return message["role"] == "assistant" and bool(
        message["content"].strip() or message.get("tool_calls") or reasoning_of(message)
    )


def reasoning_of(message: Message) -> str:
    """An assistant turn's reasoning, in whichever of :data:`REASONING_FIELDS` it is."""
    return next((message[k] for k in REASONING_FIELDS if message.get(k)), "")


def parse_tools(value: Any) -> list[dict] | None:
    """A record's ``tools``: a list of JSON schemas, or that list as JSON text (None
    when absent; raises ``ValueError`` when neither)."""
    if value is None:
        return None
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except ValueError as err:
            raise ValueError(f"is not JSON: {err}") from None
    if not isinstance(value, Sequence) or not all(isinstance(t, Mapping) for t in value):
        raise ValueError(f"must be a list of JSON schemas, got {value!r:.80}")
    return [dict(t) for t in value] or None


def validate_messages(
    value: Any, index: int, field: str, source: RecordSource = "data"
) -> list[Message]:
    """A ``messages`` list as plain turn dicts (see :func:`_turn`), tool rounds checked.

    Raises:
        DataError: not a non-empty list, a turn that is not a mapping, an unknown role,
            a content that is not text, a malformed tool call, a tool call no tool turn
            answers or a tool turn with no call; the message names ``source``, the
            record ``index`` and the field (``messages[2].role``).
    """
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) == 0:
        raise _bad(source, index, field, f"must be a non-empty list of turns, got {value!r:.80}")
    try:
        turns = [_turn(turn, f"{field}[{j}]") for j, turn in enumerate(value)]
        check_tool_rounds(turns, field)
    except ValueError as err:
        raise DataError(f"{record_where(source, index)}, field {err}") from None
    return turns


def record_conversation(
    record: Any, index: int, chat: ChatFormatConfig, source: RecordSource = "data"
) -> Conversation:
    """The turns and tools of one chat record, in any format of ``data.chat.format``.

    Raises:
        DataError: a malformed record (see :func:`validate_messages`), a ``tools`` field
            that is not a list of JSON schemas, or a conversation with no assistant turn
            to train on; the message names the record and field.
    """
    from recipes_lib.data.chat.formats import record_turns

    if not isinstance(record, Mapping):
        raise DataError(f"{record_where(source, index)} is not a mapping: {record!r:.80}")
    raw, field = record_turns(record, index, chat, source)
    messages = validate_messages(raw, index, field, source)
    if not any(trainable(m) for m in messages):
        raise _bad(source, index, field, "has no assistant turn with content")
    try:
        tools = parse_tools(record.get(TOOLS_FIELD))
    except ValueError as err:
        raise _bad(source, index, TOOLS_FIELD, str(err)) from None
    return Conversation(messages, tools)


def record_messages(
    record: Any, index: int, chat: ChatFormatConfig, source: RecordSource = "data"
) -> list[Message]:
    """The turns of one chat record (see :func:`record_conversation`)."""
    return record_conversation(record, index, chat, source).messages


def _present(record: Mapping) -> list[str]:
    """The fields a record holds: ``datasets`` gives every record of a file every field
    any of them has, set to None where it lacks it."""
    return sorted(k for k, v in record.items() if v is not None)


class BadRecord(Exception):
    """A record that cannot be used; ``reason`` is what a skip is counted under."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def _check_messages(value: list, field: str, where: str) -> list[dict]:
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise BadRecord(
                f"{where}: field {field!r} message {i} is a {type(message).__name__}, not a "
                "{role, content} mapping",
                f"malformed field {field!r}",
            )
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise BadRecord(
                f"{where}: field {field!r} message {i} has unknown role {role!r} "
                f"(expected one of {list(ROLES)})",
                f"unknown role in field {field!r}",
            )
        if not isinstance(content, str) and not (role == "assistant" and message.get("tool_calls")):
            raise BadRecord(
                f"{where}: field {field!r} message {i} has no text content",
                f"malformed field {field!r}",
            )
    try:
        return [_turn(m, f"{field}[{i}]") for i, m in enumerate(value)]
    except ValueError as err:
        raise BadRecord(f"{where}: field {err}", f"malformed field {field!r}") from None


@overload
def text_field(
    record: Mapping, field: str, where: str, *, required: Literal[True] = True
) -> Text: ...
@overload
def text_field(record: Mapping, field: str, where: str, *, required: bool) -> Text | None: ...
def text_field(record: Mapping, field: str, where: str, *, required: bool = True) -> Text | None:
    value = record.get(field)
    if value is None:
        if required:
            raise BadRecord(f"{where}: field {field!r} is missing", f"missing field {field!r}")
        return None
    if isinstance(value, str):
        if not value.strip():
            raise BadRecord(f"{where}: field {field!r} is empty", f"empty field {field!r}")
        return value
    if isinstance(value, list):
        if not value:
            raise BadRecord(f"{where}: field {field!r} is empty", f"empty field {field!r}")
        return _check_messages(value, field, where)
    raise BadRecord(
        f"{where}: field {field!r} holds {type(value).__name__}, not text or a list of messages",
        f"malformed field {field!r}",
    )
