"""Chat records as conversations: validating a record's turns.

A chat record is either a ``messages`` list of ``{"role", "content"}`` turns (roles
``system``, ``user``, ``assistant``) or a ``prompt``/``response`` pair, read as one user
turn and one assistant turn. Field names come from ``data.chat``
(:class:`~recipes_lib.config.schema.ChatFormatConfig`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, overload

from recipes_lib.config.schema import ChatFormatConfig
from recipes_lib.data.records import RecordSource, record_where
from recipes_lib.errors import DataError

ROLES = ("system", "user", "assistant")

Message = dict[str, str]
Text = str | list[dict]  # plain text, or chat messages


def _bad(source: RecordSource, index: int, field: str, problem: str) -> DataError:
    return DataError(f"{record_where(source, index)}, field {field!r}: {problem}")


def validate_messages(
    value: Any, index: int, field: str, source: RecordSource = "data"
) -> list[Message]:
    """A ``messages`` list as plain ``{"role", "content"}`` dicts.

    Raises:
        DataError: not a non-empty list, a turn that is not a mapping, an unknown role
            or a content that is not text; the message names ``source``, the record
            ``index`` and the field (``messages[2].role``).
    """
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) == 0:
        raise _bad(source, index, field, f"must be a non-empty list of turns, got {value!r:.80}")
    turns = []
    for j, turn in enumerate(value):
        where = f"{field}[{j}]"
        if not isinstance(turn, Mapping):
            raise _bad(
                source, index, where, f"must be a mapping with role and content, got {turn!r:.80}"
            )
        role, content = turn.get("role"), turn.get("content")
        if role not in ROLES:
            raise _bad(
                source, index, f"{where}.role", f"unknown role {role!r}; roles: {list(ROLES)}"
            )
        if not isinstance(content, str):
            got = "missing" if content is None else f"{type(content).__name__}, not text"
            raise _bad(source, index, f"{where}.content", got)
        turns.append({"role": role, "content": content})
    return turns


def record_messages(
    record: Any, index: int, chat: ChatFormatConfig, source: RecordSource = "data"
) -> list[Message]:
    """The turns of one chat record: its ``messages`` list or its prompt/response pair.

    Raises:
        DataError: a malformed record (see :func:`validate_messages`), a missing or
            empty prompt or response, or a conversation with no assistant turn with
            content to train on; the message names the record index and field.
    """
    if not isinstance(record, Mapping):
        raise DataError(f"{record_where(source, index)} is not a mapping: {record!r:.80}")
    if record.get(chat.messages_field) is not None:
        messages = validate_messages(
            record[chat.messages_field], index, chat.messages_field, source
        )
        if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
            raise _bad(source, index, chat.messages_field, "has no assistant turn with content")
        return messages
    if record.get(chat.prompt_field) is None and record.get(chat.response_field) is None:
        raise DataError(
            f"{record_where(source, index)} has neither field {chat.messages_field!r} nor "
            f"{chat.prompt_field!r}/{chat.response_field!r} (fields: {_present(record)}); set "
            "data.chat.messages_field or data.chat.prompt_field/response_field"
        )
    for field in (chat.prompt_field, chat.response_field):
        value = record.get(field)
        if not isinstance(value, str) or not value.strip():
            got = "missing" if value is None else f"empty or not text: {value!r:.80}"
            raise _bad(source, index, field, got)
    return [
        {"role": "user", "content": record[chat.prompt_field]},
        {"role": "assistant", "content": record[chat.response_field]},
    ]


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
        if not isinstance(content, str):
            raise BadRecord(
                f"{where}: field {field!r} message {i} has no text content",
                f"malformed field {field!r}",
            )
    return [{"role": m["role"], "content": m["content"]} for m in value]


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
