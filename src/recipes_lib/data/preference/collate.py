"""Batches of preference pairs: the pair dataset and its collation, packed or padded.

A batch of ``P`` pairs (``collate_pairs``) is::

    input_ids     (R, T) int64   token ids; padding is the EOS id
    labels        (R, T) int64   next token, -100 on prompt tokens and padding
    doc_ids       (R, T) int32   which sequence of its row each token belongs to
    sequence_ids  (R, T) int64   j for a token of pair j's chosen sequence, P + j for its
                                 rejected one, -1 on padding
    pair_index    (P,)   int64   the pairs' indices in their dataset
    num_tokens    int            real (non-padding) input tokens of the batch
    reference_logps (P, 2) fp32  precomputed reference log-probs (chosen, rejected),
                                 when the dataset holds them
    desirable     (P,)   bool    KTO: whether each completion (the "chosen" sequence;
                                 the "rejected" one is its mismatched twin) is desirable
    twin_rows     int            KTO: the first row of the twins, which share no row
                                 with a completion (their log-ratios take no gradient,
                                 so the policy runs them apart, without one)

Unshifted (``shifted=False``, a reward model's batches) every token of a sequence is an
input, its labels are all -100, and ``score_index (2P,) int64`` holds where each
sequence's score is read, as a flat index into ``(R * T)``: its last token that is not
the padding id (as transformers' ``...ForSequenceClassification`` reads it), chosen
sequences first.

Without packing (``data.chat.packing=false``) every sequence has its own row, padded
to the longest of the batch (with compiled blocks, rounded up to a few widths): rows
``0..P-1`` are the chosen sequences and ``P..2P-1`` the rejected ones, so one forward
pass sees both. With packing, sequences share rows of ``seq_len`` (first fit, longest
first; as wide as the fullest row, or with compiled blocks ``seq_len`` wide and at
least two rows per pass, an empty one where all fit in one) and ``doc_ids`` keeps them
apart, which needs ``data.document_mask=true``. The data module packs compiled rows
as wide as its data's longest sequence, one width for the run
(:meth:`~recipes_lib.data.preference.module.PreferenceDataModule.packed_width`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset

from recipes_lib.data.preference.pairs import EncodedPair
from recipes_lib.kernels.compiled import MIN_ROWS, bucketed_length


class PreferencePairDataset(Dataset):
    """Encoded pairs; item ``i`` carries its index and, once computed, its reference
    log-probs (``reference_logps``, a ``(N, 2)`` table indexed by pair)."""

    def __init__(self, pairs: Sequence[EncodedPair]) -> None:
        self.pairs = list(pairs)
        self.reference_logps: Tensor | None = None

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> dict[str, Tensor | int]:
        pair = self.pairs[index]
        item: dict[str, Tensor | int] = {
            "index": index,
            "chosen_ids": torch.from_numpy(pair.chosen_ids),
            "chosen_mask": torch.from_numpy(pair.chosen_mask),
            "rejected_ids": torch.from_numpy(pair.rejected_ids),
            "rejected_mask": torch.from_numpy(pair.rejected_mask),
        }
        if self.reference_logps is not None:
            item["reference_logps"] = self.reference_logps[index]
        if pair.desirable is not None:
            item["desirable"] = pair.desirable
        return item


def score_position(ids: Sequence[int], pad_id: int | None) -> int:
    """Where a sequence's score is read: its last token that is not ``pad_id`` (the
    last token when every one is), as transformers' ``...ForSequenceClassification``
    reads a row's."""
    return max((i for i, token in enumerate(ids) if token != pad_id), default=len(ids) - 1)


def _first_fit_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Sequence indices per row: longest first, each into the first row with room."""
    rows: list[list[int]] = []
    room: list[int] = []
    for s in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[s] <= free:
                rows[r].append(s)
                room[r] -= lengths[s]
                break
        else:
            rows.append([s])
            room.append(capacity - lengths[s])
    return rows


def _at_least(rows: list[list[int]], count: int) -> list[list[int]]:
    """``rows`` and empty ones after them, ``count`` in all."""
    return rows + [[] for _ in range(count - len(rows))]


def collate_pairs(
    items: Sequence[Mapping],
    pad_id: int,
    packing: bool = False,
    seq_len: int | None = None,
    shifted: bool = True,
    fixed_width: bool = False,
) -> dict[str, Tensor | int]:
    """Batch pairs as described in the module docstring.

    Args:
        items: dataset items of :class:`PreferencePairDataset`.
        pad_id: token id of padding (labels there are -100).
        packing: share rows of ``seq_len`` between sequences.
        seq_len: the row length when packing.
        shifted: inputs and next-token labels; False: every token an input, and each
            sequence's ``score_index``.
        fixed_width: shapes for compiled blocks: packed rows are ``seq_len`` wide (not as
            wide as the fullest row) and at least ``MIN_ROWS`` of them, padded rows as
            wide as :func:`~recipes_lib.kernels.compiled.bucketed_length` makes the
            longest.
    """
    n_pairs = len(items)
    sequences = [(it["chosen_ids"], it["chosen_mask"]) for it in items]
    sequences += [(it["rejected_ids"], it["rejected_mask"]) for it in items]
    lengths = [len(ids) - int(shifted) for ids, _ in sequences]  # inputs per sequence
    kto = n_pairs > 0 and all("desirable" in it for it in items)
    if packing:
        if seq_len is None:
            raise ValueError("packing needs seq_len")
        # empty rows pad a pass of one row to two: dynamo would specialise a single
        # row, one more graph (recipes_lib.kernels.compiled)
        min_rows = MIN_ROWS if fixed_width else 1
        if kto:  # completions' rows, then the twins' own (each pass of the policy's)
            rows = _at_least(_first_fit_rows(lengths[:n_pairs], seq_len), min_rows)
            twins = _at_least(_first_fit_rows(lengths[n_pairs:], seq_len), min_rows)
            twin_rows = len(rows)
            rows += [[n_pairs + s for s in row] for row in twins]
        else:
            rows = _at_least(_first_fit_rows(lengths, seq_len), min_rows)
    else:
        rows = [[s] for s in range(len(sequences))]
        twin_rows = n_pairs
    width = max(sum(lengths[s] for s in row) for row in rows)
    if packing and fixed_width:
        # one row width whatever the pairs' lengths: compiled blocks traced a graph per
        # width (recipes_lib.kernels.compiled); first fit leaves the last row part empty
        assert seq_len is not None  # packing needs it (checked above)
        width = seq_len
    elif fixed_width:  # a few widths (recipes_lib.kernels.compiled)
        width = bucketed_length(width, seq_len)
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, -100, dtype=torch.long)
    sequence_ids = torch.full(shape, -1, dtype=torch.long)
    doc_ids = torch.zeros(shape, dtype=torch.int32)
    score_index = torch.zeros(len(sequences), dtype=torch.long)
    for r, row in enumerate(rows):
        offset = 0
        for k, s in enumerate(row):
            ids, mask = sequences[s]
            n = lengths[s]
            cols = slice(offset, offset + n)
            if shifted:
                input_ids[r, cols] = ids[:-1]
                labels[r, cols] = torch.where(mask[1:], ids[1:], torch.full_like(ids[1:], -100))
            else:
                input_ids[r, cols] = ids
                score_index[s] = r * width + offset + score_position(ids.tolist(), pad_id)
            sequence_ids[r, cols] = s
            doc_ids[r, cols] = k
            offset += n
        doc_ids[r, offset:] = len(row)  # padding is a document of its own
    batch: dict[str, Tensor | int] = {
        "input_ids": input_ids,
        "labels": labels,
        "doc_ids": doc_ids,
        "sequence_ids": sequence_ids,
        "pair_index": torch.tensor([int(it["index"]) for it in items], dtype=torch.long),
        "num_tokens": sum(lengths),  # an int: counting needs no device sync
    }
    if not shifted:
        batch["score_index"] = score_index
    if kto:
        batch["desirable"] = torch.tensor([bool(it["desirable"]) for it in items])
        batch["twin_rows"] = twin_rows
    if n_pairs and all("reference_logps" in it for it in items):
        batch["reference_logps"] = torch.stack([it["reference_logps"] for it in items]).float()
    return batch


class PairCollator:
    """:func:`collate_pairs` with the run's padding id and packing (picklable for workers)."""

    def __init__(
        self,
        pad_id: int,
        packing: bool,
        seq_len: int,
        shifted: bool = True,
        fixed_width: bool = False,
    ) -> None:
        self.pad_id, self.packing, self.seq_len = pad_id, packing, seq_len
        self.shifted, self.fixed_width = shifted, fixed_width

    def __call__(self, items: Sequence[Mapping]) -> dict[str, Tensor | int]:
        return collate_pairs(
            items, self.pad_id, self.packing, self.seq_len, self.shifted, self.fixed_width
        )
