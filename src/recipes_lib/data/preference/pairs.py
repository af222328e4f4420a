"""Preference records: validation, tokenization and truncation of (prompt, chosen, rejected).

A preference record holds a prompt and two responses, ``chosen`` and ``rejected``
(field names from ``data.chat``). Each field is plain text or a list of chat messages
(``{"role", "content"}``); the prompt may also come as a ``messages`` conversation,
and a record with only ``chosen``/``rejected`` conversations takes their common
leading turns as its prompt. Plain text is read as one user turn (the prompt) and one
assistant turn (a response), as supervised fine-tuning reads prompt/response records,
and every pair is rendered with the run's chat template
(:class:`recipes_lib.data.chat.template.ChatRenderer`). Only response tokens are trained on:
the rendered prompt, and the template's headers, get label ``-100``.

A malformed record stops loading with a :class:`~recipes_lib.errors.DataError` that
names the source, the record index and the field, or, with
``data.chat.on_bad_record=skip``, is skipped and counted. ``data.chat.truncation``
says what happens to a pair longer than ``data.seq_len + 1`` tokens (``seq_len``
inputs and their next-token labels):

- ``right``: the end of each response is cut (the prompt is kept whole; a pair whose
  prompt alone fills the window, or whose responses become identical, is skipped and
  counted);
- ``left``: the start of the prompt is cut, by the same amount for both responses
  (a pair whose longer response alone exceeds the window is skipped and counted);
- ``drop``: the pair is skipped and counted.

A pair whose two responses render to the same tokens (a template that does not write
the tool calls or reasoning that tell them apart, such as the built-in ``plain``) is
skipped and counted too: it could only teach nothing.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from recipes_lib.config.schema import ChatFormatConfig
from recipes_lib.data.chat.messages import TOOLS_FIELD, BadRecord, Text, parse_tools, text_field
from recipes_lib.data.chat.template import RENDER_BATCH, ChatRenderer, RenderedChat
from recipes_lib.data.chat_records import bad_record_error, check_chat_format
from recipes_lib.data.encoded import flatten, unflatten
from recipes_lib.data.records import RecordSource, record_where
from recipes_lib.errors import DataError


@dataclass(frozen=True)
class PreferenceRecord:
    """One validated pair: each part is plain text or a list of ``{role, content}``."""

    prompt: Text
    chosen: Text
    rejected: Text
    tools: list[dict] | None = None  # the tool schemas the template is given


@dataclass(frozen=True)
class EncodedPair:
    """Token ids of a pair's two full sequences (prompt + response) and, per token,
    whether it is a response token that counts towards the log-probability."""

    chosen_ids: np.ndarray  # (n_c,) int64
    chosen_mask: np.ndarray  # (n_c,) bool
    rejected_ids: np.ndarray  # (n_r,) int64
    rejected_mask: np.ndarray  # (n_r,) bool
    desirable: bool | None = None  # KTO: the completion (``chosen``) is desirable

    @property
    def max_len(self) -> int:
        return max(len(self.chosen_ids), len(self.rejected_ids))


def _common_prefix(a: list[dict], b: list[dict]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def parse_record(record: Mapping, chat: ChatFormatConfig, where: str) -> PreferenceRecord:
    """Validate one raw record (``where`` names it in messages, e.g. ``... record 7``).

    Raises:
        BadRecord: a missing or empty field, a wrong type, an unknown role, or chosen and
            rejected that are identical.
    """
    if not isinstance(record, Mapping):
        raise BadRecord(f"{where}: is a {type(record).__name__}, not a mapping", "not a mapping")
    chosen = text_field(record, chat.chosen_field, where)
    rejected = text_field(record, chat.rejected_field, where)
    prompt = text_field(record, chat.prompt_field, where, required=False)
    if prompt is None:
        prompt = text_field(record, chat.messages_field, where, required=False)
    if prompt is None:
        if not (isinstance(chosen, list) and isinstance(rejected, list)):
            raise BadRecord(
                f"{where}: field {chat.prompt_field!r} is missing",
                f"missing field {chat.prompt_field!r}",
            )
        # full conversations: the shared leading turns are the prompt
        shared = _common_prefix(chosen, rejected)
        if shared == 0:
            raise BadRecord(
                f"{where}: field {chat.prompt_field!r} is missing and {chat.chosen_field!r} and "
                f"{chat.rejected_field!r} share no leading turns to take as the prompt",
                f"missing field {chat.prompt_field!r}",
            )
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        for field, part in ((chat.chosen_field, chosen), (chat.rejected_field, rejected)):
            if not part:
                raise BadRecord(
                    f"{where}: field {field!r} has no turns after the shared prompt",
                    f"empty field {field!r}",
                )
    if chosen == rejected:
        raise BadRecord(
            f"{where}: fields {chat.chosen_field!r} and {chat.rejected_field!r} are identical",
            "identical responses",
        )
    try:
        tools = parse_tools(record.get(TOOLS_FIELD))
    except ValueError as err:
        problem = f"{where}: field {TOOLS_FIELD!r} {err}"
        raise BadRecord(problem, f"malformed field {TOOLS_FIELD!r}") from None
    return PreferenceRecord(prompt=prompt, chosen=chosen, rejected=rejected, tools=tools)


class PairEncoder:
    """Tokenizes validated records into :class:`EncodedPair` and applies truncation.

    Args:
        renderer: renders conversations with the run's chat template and tokenizer.
        seq_len: ``data.seq_len``; a full sequence may hold ``seq_len + 1`` tokens.
        chat: field names and policies.
        twin: the rejected response is a stand-in that must not decide whether or how
            the chosen sequence is kept (KTO's mismatched completion).
        shifted: sequences are split into inputs and next-token labels, so a full one may
            hold ``seq_len + 1`` tokens; False: the model reads every token (a reward
            model's score), so at most ``seq_len``.
    """

    def __init__(
        self,
        renderer: ChatRenderer,
        seq_len: int,
        chat: ChatFormatConfig,
        *,
        twin: bool = False,
        shifted: bool = True,
    ) -> None:
        check_chat_format(chat)
        self.renderer = renderer
        self.max_tokens = seq_len + 1 if shifted else seq_len
        self.limit = (
            f"data.seq_len + 1 = {self.max_tokens}" if shifted else f"data.seq_len = {seq_len}"
        )
        self.seq_len = seq_len
        self.chat = chat
        self.twin = twin

    def conversations(self, record: PreferenceRecord) -> list[tuple]:
        """What :meth:`split` renders of ``record``, as :meth:`ChatRenderer.render_many`
        takes it: the prompt, then the prompt with each response."""
        prompt = _as_messages(record.prompt, "user")
        return [
            (prompt, record.tools, None),
            (prompt + _as_messages(record.chosen, "assistant"), record.tools, None),
            (prompt + _as_messages(record.rejected, "assistant"), record.tools, None),
        ]

    def split(
        self, record: PreferenceRecord, where: str, rendered: Sequence | None = None
    ) -> tuple[list[int], tuple, tuple]:
        """``prompt_ids`` and, per response, ``(ids, counted_mask)`` after the prompt.

        Args:
            rendered: :meth:`conversations` of ``record`` already rendered (None: render
                them now).
        """
        if rendered is None:
            rendered = self.renderer.render_many(self.conversations(record))

        def checked(result: RenderedChat | DataError) -> RenderedChat:
            if isinstance(result, DataError):
                raise BadRecord(f"{where}: {result}", "template failed to render") from result
            return result

        # checked in order: the prompt, then each response (its rendering, then its prompt)
        prompt_ids = list(checked(rendered[0]).input_ids)
        responses = []
        for field, result in zip(
            (self.chat.chosen_field, self.chat.rejected_field), rendered[1:], strict=True
        ):
            whole = checked(result)
            ids, mask = list(whole.input_ids), [bool(m) for m in whole.assistant_mask]
            if ids[: len(prompt_ids)] != prompt_ids:
                raise BadRecord(
                    f"{where}: field {field!r}: the chat template renders the prompt differently "
                    "when a response follows it",
                    "template failed to render",
                )
            responses.append((ids[len(prompt_ids) :], mask[len(prompt_ids) :]))
        return prompt_ids, responses[0], responses[1]

    def encode(
        self, record: PreferenceRecord, where: str, rendered: Sequence | None = None
    ) -> EncodedPair:
        """Token ids and counted-token masks of both sequences, truncated to fit.

        With ``twin`` (see the class), only the chosen sequence decides the truncation;
        the rejected one is then cut on the right to the room left after the prompt.

        Raises:
            BadRecord: the template fails, a response has no counted token, or the pair
                does not fit under the truncation policy.
        """
        prompt, (chosen, chosen_mask), (rejected, rejected_mask) = self.split(
            record, where, rendered
        )
        if not self.twin and chosen == rejected:
            raise BadRecord(
                f"{where}: fields {self.chat.chosen_field!r} and {self.chat.rejected_field!r} "
                f"render to the same tokens: the chat template "
                f"({self.renderer.template_name}) does not write what tells them apart "
                "(tool calls and reasoning need a template that renders them)",
                "identical once rendered",
            )
        checked = [(self.chat.chosen_field, chosen_mask)]
        if not self.twin:
            checked.append((self.chat.rejected_field, rejected_mask))
        for field, mask in checked:
            if not any(mask):
                raise BadRecord(
                    f"{where}: field {field!r} has no response tokens", f"empty field {field!r}"
                )
        sized = (
            [(chosen, chosen_mask)]
            if self.twin
            else [(chosen, chosen_mask), (rejected, rejected_mask)]
        )
        prompt, sized = self._fit(prompt, sized, where)
        chosen, chosen_mask = sized[0]
        if self.twin:
            room = self.max_tokens - len(prompt)
            rejected, rejected_mask = rejected[:room], rejected_mask[:room]
            if not any(rejected_mask):
                raise BadRecord(
                    f"{where}: no token of field {self.chat.rejected_field!r} fits after the "
                    f"prompt in {self.limit}",
                    f"no room for field {self.chat.rejected_field!r}",
                )
        else:
            rejected, rejected_mask = sized[1]
        if not prompt:
            raise BadRecord(
                f"{where}: the prompt renders to no tokens",
                f"empty field {self.chat.prompt_field!r}",
            )
        return EncodedPair(
            chosen_ids=np.asarray(prompt + chosen, dtype=np.int64),
            chosen_mask=np.asarray([False] * len(prompt) + chosen_mask, dtype=bool),
            rejected_ids=np.asarray(prompt + rejected, dtype=np.int64),
            rejected_mask=np.asarray([False] * len(prompt) + rejected_mask, dtype=bool),
        )

    def _fit(self, prompt: list[int], responses: list[tuple], where: str) -> tuple[list, list]:
        """The prompt and responses cut by ``data.chat.truncation`` to fit together."""
        longest = len(prompt) + max(len(ids) for ids, _ in responses)
        limit = self.max_tokens
        if longest <= limit:
            return prompt, responses
        policy = self.chat.truncation
        if policy in ("drop", "turn"):  # a pair is not cut between turns: dropped
            raise BadRecord(
                f"{where}: {longest} tokens, longer than {self.limit}",
                f"too long (data.chat.truncation={policy})",
            )
        if policy == "right":
            if len(prompt) >= limit:
                raise BadRecord(
                    f"{where}: the prompt alone has {len(prompt)} tokens, no room for a "
                    f"response in {self.limit}",
                    "prompt too long (data.chat.truncation=right)",
                )
            room = limit - len(prompt)
            responses = [(ids[:room], mask[:room]) for ids, mask in responses]
            # the first response token is predicted from the last prompt token
            if not all(any(mask) for _, mask in responses):
                raise BadRecord(
                    f"{where}: no response token is left after truncating to {limit} tokens",
                    "prompt too long (data.chat.truncation=right)",
                )
        else:  # left: cut the shared prompt's start
            response = max(len(ids) for ids, _ in responses)
            if response >= limit:
                raise BadRecord(
                    f"{where}: a response alone has {response} tokens, more than fit after a "
                    f"prompt token in {limit}",
                    "response too long (data.chat.truncation=left)",
                )
            prompt = prompt[longest - limit :]
        if len(responses) == 2 and responses[0][0] == responses[1][0]:
            raise BadRecord(
                f"{where}: the responses are identical once truncated to {limit} tokens",
                f"identical after truncation (data.chat.truncation={policy})",
            )
        return prompt, responses


def _as_messages(part: Text, role: str) -> list[dict]:
    return part if isinstance(part, list) else [{"role": role, "content": part}]


@dataclass
class EncodedPairs:
    """The pairs of a source that survived validation, and what was skipped and why."""

    pairs: list[EncodedPair]
    total: int
    skipped: Counter
    kept: list[int] = dataclasses.field(default_factory=list)  # the source positions of ``pairs``

    def skip_summary(self) -> str:
        reasons = ", ".join(f"{n} {reason}" for reason, n in self.skipped.most_common())
        return f"skipped {sum(self.skipped.values())} of {self.total} records: {reasons}"


_SEQUENCES = ("chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask")


def pairs_to_arrays(encoded: EncodedPairs) -> tuple[dict[str, np.ndarray], dict]:
    """``encoded`` as flat arrays and a JSON-able rest, for
    :class:`~recipes_lib.data.encoded.EncodedCache` (:func:`pairs_from_arrays` reads
    them back)."""
    arrays: dict[str, np.ndarray] = {}
    for name in _SEQUENCES:
        values, offsets = flatten([getattr(p, name) for p in encoded.pairs])
        arrays[name], arrays[f"{name}_offsets"] = values, offsets
    arrays["desirable"] = np.asarray(
        [-1 if p.desirable is None else int(p.desirable) for p in encoded.pairs], dtype=np.int8
    )
    arrays["kept"] = np.asarray(encoded.kept, dtype=np.int64)
    return arrays, {"total": encoded.total, "skipped": dict(encoded.skipped)}


def pairs_from_arrays(arrays: Mapping[str, np.ndarray], meta: Mapping) -> EncodedPairs:
    """The :class:`EncodedPairs` :func:`pairs_to_arrays` wrote."""
    columns = {name: unflatten(arrays[name], arrays[f"{name}_offsets"]) for name in _SEQUENCES}
    pairs = [
        EncodedPair(
            chosen_ids=columns["chosen_ids"][i].astype(np.int64),
            chosen_mask=columns["chosen_mask"][i].astype(bool),
            rejected_ids=columns["rejected_ids"][i].astype(np.int64),
            rejected_mask=columns["rejected_mask"][i].astype(bool),
            desirable=None if flag < 0 else bool(flag),
        )
        for i, flag in enumerate(arrays["desirable"].tolist())
    ]
    return EncodedPairs(
        pairs, int(meta["total"]), Counter(meta["skipped"]), arrays["kept"].tolist()
    )


def encode_records(
    records: Iterable[Mapping],
    encoder: PairEncoder,
    key: RecordSource,
    indices: Iterable[int] | None = None,
) -> EncodedPairs:
    """Validate and encode every record of one source (``key`` names it); ``indices``
    are the records' positions in the source (default ``0, 1, ...``), named in errors.

    A malformed record raises with its index and field unless
    ``data.chat.on_bad_record=skip``; truncation skips are always counted.

    Raises:
        DataError: a bad record (in ``error`` mode).
    """
    chat = encoder.chat
    pairs: list[EncodedPair] = []
    skipped: Counter = Counter()
    kept: list[int] = []
    total = 0
    positions = iter(indices) if indices is not None else None
    parsed: list[tuple[int, str, PreferenceRecord]] = []

    def encode_parsed() -> None:
        """Encode the records parsed so far, their conversations rendered together."""
        wanted = [c for _, _, record in parsed for c in encoder.conversations(record)]
        rendered = encoder.renderer.render_many(wanted)
        for k, (index, where, record) in enumerate(parsed):
            try:
                pairs.append(encoder.encode(record, where, rendered[3 * k : 3 * k + 3]))
                kept.append(index)
            except BadRecord as bad:
                truncation = "data.chat.truncation" in bad.reason
                if chat.on_bad_record == "error" and not truncation:
                    raise bad_record_error(bad) from None
                skipped[bad.reason] += 1
        parsed.clear()

    for count, raw in enumerate(records):
        index = next(positions) if positions is not None else count
        total += 1
        where = record_where(key, index)
        try:
            parsed.append((index, where, parse_record(raw, chat, where)))
        except BadRecord as bad:
            if chat.on_bad_record == "error":
                encode_parsed()  # an earlier record's error is the one to name
                raise bad_record_error(bad) from None
            skipped[bad.reason] += 1
            continue
        if len(parsed) >= RENDER_BATCH:
            encode_parsed()
    encode_parsed()
    return EncodedPairs(pairs=pairs, total=total, skipped=skipped, kept=kept)
