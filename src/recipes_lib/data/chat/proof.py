"""Proof of masks: a sample of records rendered by transformers and by the library, token
for token and trained token for trained token.

``recipes-check data.chat.prove_masks=N`` (and ``recipes-prepare`` with the same key)
takes N records of each chat source, seeded, and renders each twice:

- by the library, as training does (the records' examples, their labels turned back
  into "this token is trained"), without truncation;
- by ``transformers``' ``apply_chat_template`` with the same template, tools and
  template switches (the reference).

The reference's trained tokens are found without the library's code. A template that
marks assistant text with ``{% generation %}`` gives them itself
(``return_assistant_tokens_mask``). For any other, each assistant turn's span in the
whole conversation's text is found from transformers renderings alone: it starts where
the conversation stops agreeing with the prompt that asks for that turn (the turns
before it and the generation prompt), and ends at the first special token after the
last character that changes when the turn's own text changes (its end-of-turn token).
The training policy decides which of those spans count (all assistant turns, or the
last).

The first record whose token ids or trained tokens differ stops the proof with its
file:line and the tokens around the difference, decoded, each side's trained tokens in
``[[...]]``.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from recipes_lib.config.schema import DataConfig
from recipes_lib.data.chat.examples import ChatSourceStats, tokenize_records
from recipes_lib.data.chat.messages import record_messages
from recipes_lib.data.chat.module import ChatDataModule
from recipes_lib.data.chat.show import marked_tokens, trained_positions
from recipes_lib.data.chat.template import ChatRenderer
from recipes_lib.data.records import RecordSource, record_where
from recipes_lib.data.sources import source_key
from recipes_lib.errors import ConfigError, DataError

PROOF_KEY = "data.chat.prove_masks"
TRAIN_ON_ALL, TRAIN_ON_LAST = "all", "last"
_CONTEXT = 8  # tokens shown on each side of a difference
_MARK = "\u2603"  # appended to a turn's text to see where that text lands
_UNMARKED = {"role", "id", "type", "tool_call_id"}  # structure, not text the turn says
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


class MaskProofError(DataError):
    """A record that the library renders or masks differently from transformers."""


@dataclass(frozen=True)
class Rendering:
    """One side's rendering of a conversation: token ids and, per token, whether it is
    trained on."""

    input_ids: list[int]
    trained: list[bool]


@dataclass(frozen=True)
class ProofResult:
    """What a proof compared: records rendered equal on both sides, and those the
    library left out (skipped as bad or with nothing to train)."""

    proved: int
    left_out: int

    def line(self) -> str:
        extra = f"; {self.left_out} left out by the library" if self.left_out else ""
        return (
            f"{self.proved} record(s): token ids and trained tokens equal to transformers'{extra}"
        )


# ----------------------------------------------------------------- the reference side
def hf_tokenizer(tokenizer_file: str | Path, eos_token: str) -> Any:
    """The transformers tokenizer of ``tokenizer_file``: from its folder when a
    tokenizer_config.json lies beside it (BOS, EOS and the rest as the folder says),
    else the file alone with ``eos_token``.

    Raises:
        ConfigError: transformers is not installed.
    """
    try:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
    except ImportError as err:
        raise ConfigError(
            f"{PROOF_KEY}: the mask proof renders with transformers, which is not "
            "installed (pip install transformers)"
        ) from err
    file = Path(tokenizer_file)
    if (file.parent / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(file.parent))
    return PreTrainedTokenizerFast(tokenizer_file=str(file), eos_token=eos_token)


def conversation_of(record: Mapping[str, Any], config: DataConfig) -> tuple[list[dict], Any]:
    """``(messages, tools)`` of a record as transformers takes them: its messages field
    as written, or its prompt/response pair as a user and an assistant turn. A record
    in another shape is read into turns as the library reads it: the proof is of the
    rendering and the masks, not of how a format maps to turns. (The proof then moves
    each turn's reasoning to the field the template reads, as the library does.)"""
    chat = config.chat
    messages = record.get(chat.messages_field)
    if messages is None and record.get(chat.prompt_field) is not None:
        messages = [
            {"role": "user", "content": record.get(chat.prompt_field)},
            {"role": "assistant", "content": record.get(chat.response_field)},
        ]
    elif messages is None:
        messages = record_messages(record, 0, chat)
    clean = [_without_none(m) for m in messages]
    tools = record.get("tools")
    if isinstance(tools, str):
        tools = json.loads(tools)
    return clean, tools


def _without_none(message: Mapping[str, Any]) -> dict:
    return {k: v for k, v in dict(message).items() if v is not None}


def _marked(value: Any) -> Any:
    """``value`` with the mark appended to every non-empty string in it (keys naming
    structure left alone), so its text can be found in a rendering."""
    if isinstance(value, str):
        return value + _MARK if value else value
    if isinstance(value, Mapping):
        return {k: v if k in _UNMARKED else _marked(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_marked(v) for v in value]
    return value


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _common_suffix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[-1 - i] == b[-1 - i]:
        i += 1
    return i


class ReferenceRenderer:
    """Renders conversations with transformers and finds their trained tokens (module
    docstring) without the library's rendering code.

    Args:
        tokenizer: a transformers tokenizer.
        template: the Jinja chat template (the one the library renders with).
        template_kwargs: the template's switches (``enable_thinking``...).
        train_on: ``all`` assistant turns or the ``last`` one.
    """

    def __init__(
        self,
        tokenizer: Any,
        template: str,
        template_kwargs: Mapping[str, Any] | None = None,
        train_on: str = TRAIN_ON_ALL,
    ) -> None:
        if train_on not in (TRAIN_ON_ALL, TRAIN_ON_LAST):
            raise ConfigError(f"{PROOF_KEY}: no reference for the train-on policy {train_on!r}")
        self.tokenizer = tokenizer
        self.template = template
        self.kwargs = dict(template_kwargs or {})
        self.train_on = train_on
        self.tagged = bool(_GENERATION.search(template))
        specials = {str(t) for t in tokenizer.all_special_tokens}
        specials |= {str(t.content) for t in tokenizer.added_tokens_decoder.values() if t.special}
        self._specials = re.compile("|".join(re.escape(t) for t in sorted(specials, key=len)[::-1]))

    def text(self, messages: Sequence[Mapping], tools: Any, generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages),
            tools=tools,
            chat_template=self.template,
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **self.kwargs,
        )

    def render(self, messages: Sequence[Mapping], tools: Any) -> Rendering:
        """The conversation's token ids as transformers gives them and its trained tokens."""
        encoded = self.tokenizer.apply_chat_template(
            list(messages),
            tools=tools,
            chat_template=self.template,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=self.tagged,
            **self.kwargs,
        )
        ids = [int(i) for i in encoded["input_ids"]]
        full = self.text(messages, tools)
        offsets = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        if [int(i) for i in offsets["input_ids"]] != ids:
            raise DataError("transformers' tokens of the rendered text differ from its chat tokens")
        ranges = [(int(s), int(e)) for s, e in offsets["offset_mapping"]]
        turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        if self.train_on == TRAIN_ON_LAST:
            turns = turns[-1:]
        if self.tagged:
            tagged = [bool(x) for x in encoded["assistant_masks"]]
            if self.train_on == TRAIN_ON_LAST and turns:
                begin = self._turn_start(messages, tools, full, turns[0])
                tagged = [flag and e > begin for flag, (_, e) in zip(tagged, ranges, strict=True)]
            return Rendering(ids, tagged)
        spans = [self._span(messages, tools, full, i) for i in turns]
        # a token is trained where it overlaps a span: one that starts before a turn's
        # start but differs from the prompt's token there is the turn's own
        trained = [any(s < b and e > a for a, b in spans) for s, e in ranges]
        return Rendering(ids, trained)

    def _turn_start(self, messages: Sequence[Mapping], tools: Any, full: str, i: int) -> int:
        """Where turn ``i``'s own text starts: past the prompt that asks for it.

        That is where the conversation stops agreeing with the prompt, unless the
        template renders earlier turns otherwise once later ones follow (Qwen's
        reasoning, for one): then past the longest start of the generation prompt found
        between the previous message's text and this turn's."""
        if i == 0:
            return 0
        before = self.text(messages[:i], tools)
        prompt = self.text(messages[:i], tools, generation_prompt=True)
        agreed = _common_prefix(full, prompt)
        floor = self._changed(messages, tools, full, i - 1)[1]
        if agreed >= floor:
            return agreed
        first = self._changed(messages, tools, full, i)[0]
        opening = prompt[len(before) :] if prompt.startswith(before) else ""
        between = full[floor:first]
        for k in range(len(opening), 0, -1):
            at = between.rfind(opening[:k])
            if at >= 0:
                return floor + at + k
        return first

    def _changed(
        self, messages: Sequence[Mapping], tools: Any, full: str, i: int
    ) -> tuple[int, int]:
        """The characters of ``full`` that change when turn ``i``'s text changes."""
        marked = list(messages)
        marked[i] = _marked(messages[i])
        other = self.text(marked, tools)
        return _common_prefix(full, other), len(full) - _common_suffix(full, other)

    def _span(self, messages: Sequence[Mapping], tools: Any, full: str, i: int) -> tuple[int, int]:
        """Turn ``i``'s trained characters: from its start through its end-of-turn token."""
        start = self._turn_start(messages, tools, full, i)
        first, last = self._changed(messages, tools, full, i)
        if first > last:  # nothing of the turn shows (an insertion has first == last)
            return start, start
        bound = len(full)
        if i + 1 < len(messages):
            bound = max(last, self._changed(messages, tools, full, i + 1)[0])
        end_of_turn = self._specials.search(full, last, bound)
        return start, end_of_turn.end() if end_of_turn else last


# ------------------------------------------------------------------ the library side
def library_rendering(
    records: Sequence[Mapping[str, Any]],
    index: int,
    renderer: ChatRenderer,
    config: DataConfig,
    source: RecordSource,
) -> Rendering | None:
    """Record ``index`` as training sees it, untruncated: its example's input ids and,
    from its labels, which tokens are trained (None: the library left it out)."""
    whole = replace(config, seq_len=1 << 40)
    examples = tokenize_records(records, [index], renderer, whole, source, ChatSourceStats())
    if not examples:
        return None
    example = examples[0]
    return Rendering([int(i) for i in example.input_ids], trained_positions(example))


# ----------------------------------------------------------------------- comparing
def difference(
    library: Rendering, reference: Rendering, decode: Callable[[list[int]], str]
) -> str | None:
    """None when both sides agree, else the first difference as a few readable lines:
    where it is and the tokens around it on each side, trained ones in ``[[...]]``.
    The first token is never a target, so whether it is trained is not compared."""
    ids_a, ids_b = library.input_ids, reference.input_ids
    n = min(len(ids_a), len(ids_b))
    at = next((t for t in range(n) if ids_a[t] != ids_b[t]), None)
    what = "token ids"
    if at is None and len(ids_a) != len(ids_b):
        at = n
    if at is None:
        at = next((t for t in range(1, n) if library.trained[t] != reference.trained[t]), None)
        what = "trained tokens"
    if at is None:
        return None
    lo = max(0, at - _CONTEXT)

    def window(side: Rendering) -> str:
        hi = min(len(side.input_ids), at + _CONTEXT + 1)
        text = marked_tokens(side.input_ids[lo:hi], side.trained[lo:hi], decode, color=False)
        return ("..." if lo else "") + text + ("..." if hi < len(side.input_ids) else "")

    return (
        f"the {what} differ at token {at} (library {len(ids_a)} tokens, transformers "
        f"{len(ids_b)}); trained tokens in [[...]]\n"
        f"  transformers: {window(reference)}\n"
        f"  library:      {window(library)}"
    )


def sample_indices(count: int, n: int, seed: int) -> list[int]:
    """``n`` of ``range(count)`` (all when fewer), seeded, in order."""
    if n >= count:
        return list(range(count))
    return sorted(random.Random(seed).sample(range(count), n))


def prove_records(
    records: Sequence[Mapping[str, Any]],
    indices: Sequence[int],
    renderer: ChatRenderer,
    reference: ReferenceRenderer,
    config: DataConfig,
    source: RecordSource,
) -> ProofResult:
    """Compare the library and transformers on ``records[i]`` for ``i`` in ``indices``.

    Raises:
        MaskProofError: the first record whose ids or trained tokens differ, named by
            file:line, with the difference.
        DataError: a record the library refuses (``data.chat.on_bad_record=error``).
    """
    proved = left_out = 0
    tokenizer = reference.tokenizer
    for index in indices:
        ours = library_rendering(records, index, renderer, config, source)
        if ours is None:
            left_out += 1
            continue
        messages, tools = conversation_of(records[index], config)
        # reasoning in the field the template reads, as the library gives it
        messages = [_without_none(m) for m in renderer.template_messages(messages)]
        try:
            theirs = reference.render(messages, tools)
        except Exception as err:  # transformers' own failure on a record the library took
            raise MaskProofError(
                f"{record_where(source, index)}: transformers fails to render what the "
                f"library rendered: {type(err).__name__}: {err}"
            ) from err
        diff = difference(ours, theirs, tokenizer.decode)
        if diff is not None:
            raise MaskProofError(f"{record_where(source, index)}: {PROOF_KEY}: {diff}")
        proved += 1
    return ProofResult(proved, left_out)


# ------------------------------------------------------------------- a run's data
def template_switches(chat: Any) -> dict[str, Any]:
    """The keyword arguments a run gives its chat template (``enable_thinking``...)."""
    switches = dict(getattr(chat, "template_kwargs", None) or {})
    thinking = getattr(chat, "enable_thinking", None)
    if thinking is not None:
        switches["enable_thinking"] = thinking
    return switches


def prove_chat_data(datamodule: ChatDataModule, n: int) -> list[str]:
    """Prove ``n`` seeded records of each source of a set-up SFT data module (module
    docstring); one line per source of what was proved.

    Raises:
        ConfigError: ``n`` is negative, or transformers is missing.
        MaskProofError: a record differs (its file:line and the difference).
    """
    if n < 0:
        raise ConfigError(f"{PROOF_KEY}={n} must be 0 or more")
    renderer, prepared = datamodule.renderer, datamodule.prepared
    if renderer is None or prepared is None:
        raise RuntimeError("the data module is not set up")
    config = datamodule.config
    reference = ReferenceRenderer(
        hf_tokenizer(prepared.tokenizer_path, config.tokenizer.eos_token),
        renderer.template_text,
        template_switches(config.chat),
        getattr(config.chat, "train_on", TRAIN_ON_ALL),
    )
    lines = []
    for name in datamodule.sources:
        records = datamodule._source_records(name)
        indices = sample_indices(len(records), n, config.seed)
        result = prove_records(
            records, indices, renderer, reference, config, datamodule._record_source(name)
        )
        lines.append(f"{source_key(name)}: {result.line()}")
    return lines
