"""Seeing what is trained: rendered conversations with their trained tokens marked.

``recipes-prepare data.chat.show=N`` prints the first N training examples of each chat
source as the model sees them, the tokens whose loss counts highlighted (reverse video
on a terminal, ``[[...]]`` around them otherwise), and then the counts of the run's
examples: trained and untrained tokens, records truncated, dropped and skipped. The
counts are the data module's own (:class:`~recipes_lib.data.chat.examples.ChatSourceStats`
and the examples' labels), so they are what training reads.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from recipes_lib.data.chat.examples import (
    IGNORE_INDEX,
    ChatExample,
    ChatSourceStats,
    tokenize_records,
)
from recipes_lib.data.chat.module import ChatDataModule
from recipes_lib.data.records import record_where
from recipes_lib.errors import ConfigError

OPEN, CLOSE = "[[", "]]"  # around trained tokens in plain text
ANSI_TRAINED, ANSI_RESET = "\x1b[7m", "\x1b[0m"  # reverse video: visible on any palette
_VISIBLE = {"\n": "\\n\n", "\t": "\\t", "\r": "\\r"}  # line breaks shown, and kept


def trained_positions(example: ChatExample) -> list[bool]:
    """Per input token, whether its prediction is trained: token ``t`` is a target when
    ``labels[t - 1]`` is set (labels are next-token targets; the first token never is)."""
    labels = np.asarray(example.labels)
    return [False] + (labels[:-1] != IGNORE_INDEX).tolist()


def visible(text: str) -> str:
    """``text`` with line breaks and tabs written out (a break still ends the line)."""
    return "".join(_VISIBLE.get(c, c) for c in text)


def marked_tokens(
    ids: Sequence[int], trained: Sequence[bool], decode: Callable[[list[int]], str], color: bool
) -> str:
    """Token ``ids`` as text, trained ones highlighted (see :func:`mark_trained`); each
    run of tokens alike is decoded at once, so a character split over tokens shows whole."""
    pieces: list[str] = []
    flags: list[bool] = []
    start = 0
    for t in range(1, len(ids) + 1):
        if t == len(ids) or trained[t] != trained[start]:
            pieces.append(decode([int(i) for i in ids[start:t]]))
            flags.append(bool(trained[start]))
            start = t
    return mark_trained(pieces, flags, color)


def mark_trained(pieces: Sequence[str], trained: Sequence[bool], color: bool) -> str:
    """The decoded ``pieces`` (each trained or not) joined, trained runs highlighted:
    ANSI reverse video when ``color``, else ``[[...]]`` around each run."""
    out: list[str] = []
    inside = False
    for piece, flag in zip(pieces, trained, strict=True):
        if flag != inside:
            out.append(
                (ANSI_TRAINED if flag else ANSI_RESET) if color else (OPEN if flag else CLOSE)
            )
            inside = flag
        out.append(visible(piece))
    if inside:
        out.append(ANSI_RESET if color else CLOSE)
    return "".join(out)


@dataclass
class TrainedCounts:
    """What a run's chat examples hold: tokens trained on and not, and what became of
    records (truncated, dropped as too long or with nothing to train, skipped as bad)."""

    examples: int = 0
    trained_tokens: int = 0
    untrained_tokens: int = 0
    truncated: int = 0
    dropped: int = 0
    skipped: int = 0

    def add_examples(self, examples: Iterable[ChatExample]) -> None:
        for example in examples:
            trained = int(sum(trained_positions(example)))
            self.examples += 1
            self.trained_tokens += trained
            self.untrained_tokens += len(example) - trained

    def add_stats(self, stats: ChatSourceStats) -> None:
        self.truncated += stats.truncated
        self.dropped += stats.dropped
        self.skipped += stats.skipped

    def line(self) -> str:
        total = self.trained_tokens + self.untrained_tokens
        share = f" ({self.trained_tokens / total:.1%})" if total else ""
        return (
            f"{self.examples:,} examples: {self.trained_tokens:,} trained tokens of "
            f"{total:,}{share}, {self.untrained_tokens:,} untrained; records "
            f"{self.truncated:,} truncated, {self.dropped:,} dropped, {self.skipped:,} skipped"
        )


def show_example(
    example: ChatExample, decode: Callable[[list[int]], str], *, title: str, color: bool
) -> str:
    """One example as text: a title line with its counts, then its tokens marked."""
    trained = trained_positions(example)
    n = int(sum(trained))
    head = f"--- {title}: {len(example)} tokens, {n} trained, {len(example) - n} untrained"
    return f"{head}\n{marked_tokens(example.input_ids.tolist(), trained, decode, color)}"


def use_color(stream: IO[str] | None = None) -> bool:
    """Whether ``stream`` (default stdout) is a terminal that takes ANSI colour."""
    stream = stream or sys.stdout
    return bool(getattr(stream, "isatty", lambda: False)())


def _examples(dataset: Any) -> list[ChatExample]:
    """The examples inside a data module's dataset (a mixture or concatenation of packed
    or unpacked example datasets)."""
    if dataset is None:
        return []
    if hasattr(dataset, "examples"):
        return list(dataset.examples)
    return [e for part in getattr(dataset, "datasets", []) for e in _examples(part)]


def trained_counts(datamodule: ChatDataModule) -> TrainedCounts:
    """The counts of a set-up SFT data module's examples, training and held-out."""
    counts = TrainedCounts()
    counts.add_examples(_examples(datamodule.train_dataset))
    counts.add_examples(_examples(datamodule.val_dataset))
    for stats in datamodule.stats.values():
        counts.add_stats(stats)
    return counts


def show_chat_data(
    datamodule: ChatDataModule, n: int, stream: IO[str] | None = None, color: bool | None = None
) -> TrainedCounts:
    """Print the first ``n`` training examples of each source of a set-up SFT data
    module, trained tokens highlighted (module docstring), then the counts; returns them.

    Raises:
        ConfigError: ``n`` is negative.
    """
    if n < 0:
        raise ConfigError(f"data.chat.show={n} must be 0 or more")
    stream = stream or sys.stdout
    color = use_color(stream) if color is None else color
    renderer, tokenizer = datamodule.renderer, datamodule.tokenizer
    if renderer is None or tokenizer is None:
        raise RuntimeError("the data module is not set up")
    config = datamodule.config

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    for name in datamodule.sources:
        records = datamodule._source_records(name)
        where = datamodule._record_source(name)
        train, _ = datamodule._split(name)
        shown = 0
        for index in train:
            if shown >= n:
                break
            stats = ChatSourceStats()
            examples = tokenize_records(records, [index], renderer, config, where, stats)
            if not examples:
                continue
            title = record_where(where, index)
            if stats.truncated:
                title += f" (truncated to data.seq_len={config.seq_len})"
            print(show_example(examples[0], decode, title=title, color=color), file=stream)
            shown += 1
    counts = trained_counts(datamodule)
    print(counts.line(), file=stream)
    return counts
