"""Packed training sequences: fixed-length windows over a shard's token stream.

Documents are concatenated (each ending in EOS) and cut into windows of ``seq_len + 1``
tokens that overlap by one, so window ``i`` yields inputs ``tokens[i*T : i*T + T]`` and
their next-token labels ``tokens[i*T + 1 : i*T + T + 1]``. No token is padding, and
``doc_ids`` tells which document each input token came from, for document masking.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

from recipes_lib.data.text.shards import TokenShard
from recipes_lib.errors import DataError


class PackedSequenceDataset(Dataset):
    """Map-style dataset of packed ``seq_len`` windows over one shard.

    Item ``i`` is ``{"input_ids": (T,) int64, "labels": (T,) int64, "doc_ids": (T,)
    int32}`` where ``doc_ids[t]`` is the index (in the shard) of the document that input
    token ``t`` belongs to; a document's EOS belongs to that document.

    Raises:
        DataError: the shard is too small for one sequence (naming the source and both
            sizes).
    """

    def __init__(self, shard: TokenShard, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if shard.n_tokens < seq_len + 1:
            raise DataError(
                f"source {shard.source}: shard {shard.path} has {shard.n_tokens} tokens, "
                f"too few for one sequence of data.seq_len={seq_len} (needs {seq_len + 1})"
            )
        self.shard = shard
        self.seq_len = seq_len
        self._length = (shard.n_tokens - 1) // seq_len

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(f"index {index} out of range for {self._length} sequences")
        start = index * self.seq_len
        window = torch.from_numpy(
            np.asarray(self.shard.tokens[start : start + self.seq_len + 1], dtype=np.int64)
        )  # (T + 1,)
        positions = np.arange(start, start + self.seq_len)
        doc_ids = np.searchsorted(self.shard.doc_offsets, positions, side="right") - 1  # (T,)
        return {
            "input_ids": window[:-1],
            "labels": window[1:],
            "doc_ids": torch.from_numpy(doc_ids.astype(np.int32)),
        }
