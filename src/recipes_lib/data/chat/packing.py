"""Rows of SFT examples: packed several to a row of ``data.seq_len`` tokens, or one per
row and padded to the longest of its batch.

With ``data.chat.packing`` the examples of a row are told apart by ``doc_ids``, for
document masking; padded rows give ``doc_ids`` 0 on the example and 1 on its padding.
Both kinds of batch mark their padding in ``padding`` (True there): a mixture of
experts' balance loss and load leave it out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from recipes_lib.data.chat.examples import IGNORE_INDEX, ChatExample
from recipes_lib.kernels.compiled import bucketed_length

_OPEN_ROWS = 64  # packing looks for room in the most recent rows only


def pack_examples(lengths: Sequence[int], seq_len: int, seed: int) -> list[list[int]]:
    """Rows of example indices whose lengths fit ``seq_len``: examples in a seeded
    order, each placed in the first of the recent rows with room for it (first fit)."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    rows: list[list[int]] = []
    room: list[int] = []
    first_open = 0
    for index in order.tolist():
        length = lengths[index]
        for r in range(first_open, len(rows)):
            if room[r] >= length:
                rows[r].append(index)
                room[r] -= length
                break
        else:
            rows.append([index])
            room.append(seq_len - length)
            first_open = max(first_open, len(rows) - _OPEN_ROWS)
    return rows


class PackedChatDataset(Dataset):
    """Rows of ``seq_len`` tokens, each holding whole examples and then padding.

    Item ``i``: ``input_ids``, ``labels`` ``(T,)`` int64 and ``doc_ids`` ``(T,)`` int32,
    where ``doc_ids`` numbers the examples of the row ``0, 1, ...`` and the padding
    after them gets the next number (its labels are ``-100``); ``padding`` ``(T,)`` bool,
    True there.
    """

    def __init__(self, examples: list[ChatExample], seq_len: int, pad_id: int, seed: int):
        self.examples = examples
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.rows = pack_examples([len(e) for e in examples], seq_len, seed)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        T = self.seq_len
        input_ids = np.full(T, self.pad_id, np.int64)
        labels = np.full(T, IGNORE_INDEX, np.int64)
        doc_ids = np.empty(T, np.int32)
        position = 0
        row = self.rows[index]
        for doc, example_index in enumerate(row):
            example = self.examples[example_index]
            end = position + len(example)
            input_ids[position:end] = example.input_ids
            labels[position:end] = example.labels
            doc_ids[position:end] = doc
            position = end
        doc_ids[position:] = len(row)
        return {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "doc_ids": torch.from_numpy(doc_ids),
            "padding": torch.arange(T) >= position,
        }


class ChatExampleDataset(Dataset):
    """One example per item, unpadded; batch them with :func:`pad_collate`."""

    def __init__(self, examples: list[ChatExample]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        example = self.examples[index]
        return {
            "input_ids": torch.from_numpy(example.input_ids),
            "labels": torch.from_numpy(example.labels),
        }


def pad_collate(
    pad_id: int, bucket_within: int | None = None
) -> Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]]:
    """A collate function padding examples on the right to the longest of the batch
    (inputs with ``pad_id``, labels with ``-100``; ``doc_ids`` 0, then 1 on padding;
    ``padding`` True there). With ``bucket_within`` (``data.seq_len``, for compiled
    blocks) the longest is rounded up to a bucket of
    :func:`~recipes_lib.kernels.compiled.bucketed_length`."""

    def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(len(item["input_ids"]) for item in items)
        if bucket_within is not None:
            longest = bucketed_length(longest, bucket_within)
        batch = len(items)
        input_ids = torch.full((batch, longest), pad_id, dtype=torch.int64)
        labels = torch.full((batch, longest), IGNORE_INDEX, dtype=torch.int64)
        doc_ids = torch.ones((batch, longest), dtype=torch.int32)
        for row, item in enumerate(items):
            n = len(item["input_ids"])
            input_ids[row, :n] = item["input_ids"]
            labels[row, :n] = item["labels"]
            doc_ids[row, :n] = 0
        padding = doc_ids.bool()
        return {"input_ids": input_ids, "labels": labels, "doc_ids": doc_ids, "padding": padding}

    return collate
