"""Unpaired preference data for the ``kto`` objective: completions labelled desirable or not.

A record holds a prompt (``data.chat.prompt_field``, text or chat messages, or a
``messages_field`` conversation), one completion (``completion_field``, text or
assistant messages) and a label (``label_field``): JSON ``true`` where the completion
is desirable, ``false`` where it is not. Nothing pairs a desirable completion with an
undesirable one.

Each example becomes a pair of the preference pipeline
(:mod:`recipes_lib.data.preference.pairs`): its own completion in the ``chosen`` slot
and, in the ``rejected`` slot, the completion of the next example of its split that has
another prompt and another completion, after this example's prompt. That mismatched
twin is what KTO's estimate of ``KL(policy || reference)`` reads. Only the example's own
sequence decides whether and how it is truncated; the twin is cut to the room left. So truncation,
packing, the held-out split, precomputed reference log-probs and resuming work as for
DPO, and the label travels with the encoded pair (``EncodedPair.desirable``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence

from recipes_lib.config.schema import ChatFormatConfig, DataConfig, RunConfig, SourceConfig
from recipes_lib.data.chat_records import bad_record_error
from recipes_lib.data.preference.module import PreferenceDataModule
from recipes_lib.data.preference.pairs import (
    BadRecord,
    EncodedPairs,
    PairEncoder,
    Text,
    encode_records,
    text_field,
)
from recipes_lib.data.preference.stdlib_pairs import stdlib_preference_records
from recipes_lib.data.records import RecordBuiltin, RecordSource, record_where
from recipes_lib.data.tokenizer import init_tokenizer_path

NO_TWIN = "no other example's completion for the KL estimate"


def parse_unpaired(record: Mapping, chat: ChatFormatConfig, where: str) -> tuple[Text, Text, bool]:
    """``(prompt, completion, desirable)`` of one raw record.

    Raises:
        BadRecord: a missing or malformed field, or a label that is not a boolean.
    """
    if not isinstance(record, Mapping):
        raise BadRecord(f"{where}: is a {type(record).__name__}, not a mapping", "not a mapping")
    completion = text_field(record, chat.completion_field, where)
    prompt = text_field(record, chat.prompt_field, where, required=False)
    if prompt is None:
        prompt = text_field(record, chat.messages_field, where, required=False)
    if prompt is None:
        raise BadRecord(
            f"{where}: field {chat.prompt_field!r} is missing",
            f"missing field {chat.prompt_field!r}",
        )
    label = record.get(chat.label_field)
    if label is None:
        raise BadRecord(
            f"{where}: field {chat.label_field!r} is missing", f"missing field {chat.label_field!r}"
        )
    if not isinstance(label, bool):
        raise BadRecord(
            f"{where}: field {chat.label_field!r} is {label!r} ({type(label).__name__}), not "
            "true or false",
            f"non-boolean field {chat.label_field!r}",
        )
    return prompt, completion, label


def encode_unpaired(
    records: Sequence[Mapping],
    encoder: PairEncoder,
    key: RecordSource,
    indices: Sequence[int],
) -> EncodedPairs:
    """Validate the records of one split (``indices``: their positions in the source),
    give each its mismatched twin and encode them as pairs carrying their label.

    Raises:
        DataError: a malformed record (unless ``data.chat.on_bad_record=skip``).
    """
    chat = encoder.chat
    parsed: list[tuple[int, Text, Text, bool]] = []
    skipped: Counter = Counter()
    for raw, index in zip(records, indices, strict=True):
        try:
            parsed.append((index, *parse_unpaired(raw, chat, record_where(key, index))))
        except BadRecord as bad:
            if chat.on_bad_record == "error":
                raise bad_record_error(bad) from None
            skipped[bad.reason] += 1
    # the example's completion is the "chosen" sequence; the twin only fills the room left
    # after the example's prompt, and messages name them as the user's record does
    pair_chat = dataclasses.replace(
        chat,
        chosen_field=chat.completion_field,
        rejected_field=f"{chat.completion_field} (of the next example: the KL twin)",
    )
    twin_encoder = PairEncoder(encoder.renderer, encoder.seq_len, pair_chat, twin=True)
    as_pairs, positions, desirable = [], [], {}
    n = len(parsed)
    for k, (index, prompt, completion, label) in enumerate(parsed):
        others = (parsed[(k + step) % n] for step in range(1, n))
        twin = next((o[2] for o in others if o[1] != prompt and o[2] != completion), None)
        if twin is None:
            skipped[NO_TWIN] += 1
            continue
        as_pairs.append(
            {
                pair_chat.prompt_field: prompt,
                pair_chat.chosen_field: completion,
                pair_chat.rejected_field: twin,
            }
        )
        positions.append(index)
        desirable[index] = label
    encoded = encode_records(as_pairs, twin_encoder, key, positions)
    pairs = [
        dataclasses.replace(pair, desirable=desirable[index])
        for pair, index in zip(encoded.pairs, encoded.kept, strict=True)
    ]
    return EncodedPairs(
        pairs=pairs, total=len(records), skipped=skipped + encoded.skipped, kept=encoded.kept
    )


def stdlib_unpaired_records(max_records: int | None = None, seed: int = 0) -> list[dict]:
    """Unpaired examples from the built-in preference pairs: each pair's real function
    body is a desirable completion of its prompt and the corrupted copy an undesirable
    one (two records per pair; ``max_records`` caps the count)."""
    pairs = None if max_records is None else (max_records + 1) // 2
    records = []
    for pair in stdlib_preference_records(pairs, seed):
        records.append({"prompt": pair["prompt"], "completion": pair["chosen"], "label": True})
        records.append({"prompt": pair["prompt"], "completion": pair["rejected"], "label": False})
    return records if max_records is None else records[:max_records]


class UnpairedDataModule(PreferenceDataModule):
    """:class:`PreferenceDataModule` over unpaired, labelled completions (objective
    ``kto``); batches as pairs' (completion, mismatched twin) plus ``desirable``."""

    default_sources = {"stdlib_kto": SourceConfig(builtin="stdlib_kto")}
    builtin_records: dict[str, RecordBuiltin] = {"stdlib_kto": stdlib_unpaired_records}

    def _text_fields(self) -> tuple[str, ...]:
        chat = self.config.chat
        return (chat.prompt_field, chat.messages_field, chat.completion_field)

    def encode(
        self, records: list, encoder: PairEncoder, where: RecordSource, indices: list[int]
    ) -> EncodedPairs:
        return encode_unpaired(records, encoder, where, indices)


def build_unpaired_data(cfg: RunConfig, *, total_train_samples: int) -> UnpairedDataModule:
    """The data module of the ``kto`` objective (tokenizer as for ``dpo``)."""
    data: DataConfig = cfg.data
    module = UnpairedDataModule(
        data,
        model_vocab_size=cfg.model.vocab_size,
        model_max_seq_len=cfg.model.max_seq_len,
        total_train_samples=total_train_samples,
        tokenizer_path=init_tokenizer_path(data, cfg.stage.init_from),
    )
    module.fixed_width = bool(cfg.kernels.compile)  # one row width for compiled blocks
    return module
