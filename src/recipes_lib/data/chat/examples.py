"""SFT records become training examples: rendered, truncated, labelled where the
assistant speaks.

Every record becomes one example: its conversation's token ids as inputs and, as
labels, the next token wherever that token is assistant output (``-100`` elsewhere,
and at the example's last position).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from recipes_lib.config.schema import DataConfig
from recipes_lib.data.chat.messages import record_conversation
from recipes_lib.data.chat.template import RENDER_BATCH, ChatRenderer, RenderedChat
from recipes_lib.data.chat_records import TRUNCATION_POLICIES, bad_record_error
from recipes_lib.data.encoded import flatten, unflatten
from recipes_lib.data.records import RecordSource
from recipes_lib.errors import ConfigError, DataError

IGNORE_INDEX = -100
_ERRORS_SHOWN = 3


@dataclass
class ChatExample:
    """One conversation: ``input_ids`` and next-token ``labels``, both ``(L,)`` int64."""

    input_ids: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class ChatSourceStats:
    """What became of one source's records."""

    records: int = 0
    train: int = 0
    val: int = 0
    skipped: int = 0  # malformed records, with data.chat.on_bad_record=skip
    truncated: int = 0
    dropped: int = 0  # over-long with truncation=drop, or no assistant token left
    errors: list[str] = field(default_factory=list)  # the first skipped records' errors


def examples_to_arrays(
    source: tuple[Sequence[ChatExample], Sequence[ChatExample], ChatSourceStats],
) -> tuple[dict[str, np.ndarray], dict]:
    """A source's training and held-out examples as flat arrays and its stats as a
    JSON-able rest, for :class:`~recipes_lib.data.encoded.EncodedCache`
    (:func:`examples_from_arrays` reads them back)."""
    train, held_out, stats = source
    arrays: dict[str, np.ndarray] = {}
    for split, examples in (("train", train), ("val", held_out)):
        for column in ("input_ids", "labels"):
            values, offsets = flatten([getattr(e, column) for e in examples])
            arrays[f"{split}_{column}"], arrays[f"{split}_{column}_offsets"] = values, offsets
    return arrays, dataclasses.asdict(stats)


def examples_from_arrays(
    arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]
) -> tuple[list[ChatExample], list[ChatExample], ChatSourceStats]:
    """The examples and stats :func:`examples_to_arrays` wrote."""

    def split(name: str) -> list[ChatExample]:
        columns = [
            unflatten(arrays[f"{name}_{c}"], arrays[f"{name}_{c}_offsets"])
            for c in ("input_ids", "labels")
        ]
        return [
            ChatExample(ids.astype(np.int64), labels.astype(np.int64))
            for ids, labels in zip(*columns, strict=True)
        ]

    return split("train"), split("val"), ChatSourceStats(**meta)


def tokenize_records(
    records: Sequence[Mapping[str, Any]],
    indices: Sequence[int],
    renderer: ChatRenderer,
    config: DataConfig,
    source: RecordSource,
    stats: ChatSourceStats,
) -> list[ChatExample]:
    """The training examples of ``records[i]`` for ``i`` in ``indices``.

    Args:
        source: the source's key, or a function naming a record by its place in a file
            (``Records.where``), for messages.

    Raises:
        DataError: a malformed record or a template that fails on it (naming the
            record's file and line, or index, and the field), unless
            ``data.chat.on_bad_record=skip``, which counts it in ``stats`` instead.
    """
    chat = config.chat
    examples = []
    for start in range(0, len(indices), RENDER_BATCH):
        chunk = indices[start : start + RENDER_BATCH]
        conversations: list[tuple] = []
        failed: dict[int, DataError] = {}
        for index in chunk:
            try:
                conversation = record_conversation(records[index], index, chat, source)
            except DataError as err:
                failed[index] = err
                continue
            conversations.append((conversation.messages, conversation.tools, index))
        rendered = iter(renderer.render_many(conversations, source=source))
        for index in chunk:
            result = failed.get(index) or next(rendered)
            if isinstance(result, DataError):
                if chat.on_bad_record == "error":
                    raise bad_record_error(result) from None
                stats.skipped += 1
                if len(stats.errors) < _ERRORS_SHOWN:
                    stats.errors.append(str(result))
                continue
            example = _example(result, config, stats)
            if example is not None:
                examples.append(example)
    return examples


def _example(
    rendered: RenderedChat, config: DataConfig, stats: ChatSourceStats
) -> ChatExample | None:
    """The training example of one rendered conversation, cut to ``data.seq_len``
    (None, counted in ``stats``, where nothing of it is left to train on)."""
    kept = truncate(rendered, config.seq_len, config.chat.truncation)
    if kept is not None and len(kept) < len(rendered):
        stats.truncated += 1
    if kept is None or not any(kept.assistant_mask[1:]):  # no next token is trained
        stats.dropped += 1
        return None
    return ChatExample(np.asarray(kept.input_ids, np.int64), _labels(kept))


def truncate(rendered: RenderedChat, max_len: int, policy: str) -> RenderedChat | None:
    """``rendered`` cut to at most ``max_len`` tokens.

    ``right`` keeps the first ``max_len`` tokens, ``left`` the last ``max_len`` (the
    end of the conversation), ``drop`` returns None for an over-long conversation, and
    ``turn`` keeps the turns before the last of its cut points that fits (never inside
    a tool round), None when even its first whole turn does not fit.
    """
    if len(rendered) <= max_len:
        return rendered
    if policy == "drop":
        return None
    if policy == "turn":
        cut = max((c for c in rendered.cuts if c <= max_len), default=0)
        if cut == 0:
            return None
        return RenderedChat(
            rendered.input_ids[:cut],
            rendered.assistant_mask[:cut],
            tuple(c for c in rendered.cuts if c <= cut),
        )
    if policy == "right":
        return RenderedChat(rendered.input_ids[:max_len], rendered.assistant_mask[:max_len])
    if policy == "left":
        return RenderedChat(rendered.input_ids[-max_len:], rendered.assistant_mask[-max_len:])
    raise ConfigError(f"data.chat.truncation={policy!r} is not one of {list(TRUNCATION_POLICIES)}")


def next_token_labels(rendered: RenderedChat) -> list[int]:
    """Labels aligned with the inputs: ``labels[t]`` is the token after ``t`` when that
    token is assistant output, else ``-100``; the last position has no next token."""
    return _labels(rendered).tolist()


def _labels(rendered: RenderedChat) -> np.ndarray:
    """:func:`next_token_labels` as an int64 array."""
    ids = np.asarray(rendered.input_ids, np.int64)
    labels = np.full_like(ids, IGNORE_INDEX)
    trained = np.asarray(rendered.assistant_mask[1:], bool)
    labels[:-1] = np.where(trained, ids[1:], IGNORE_INDEX)
    return labels
