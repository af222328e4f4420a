"""Chat templates: rendering a conversation to token ids and its assistant-token mask.

A conversation is rendered whole with a Jinja chat template, as transformers'
``apply_chat_template`` renders it (the tokenizer's BOS and EOS tokens, the record's
tools and the run's template switches given to the template), and tokenized once
(many conversations in one call of the tokenizer: :meth:`ChatRenderer.render_many`).
The trained tokens are the assistant turns' spans in that text (see
:mod:`recipes_lib.data.chat.spans`): from the end of the generation prompt through the
end-of-turn token, so what the model writes itself (a think block, a channel header,
a tool call) is trained and the prompt, user turns and tool results are not. A template
that marks assistant text with ``{% generation %}`` blocks decides it itself, as
transformers' ``return_assistant_tokens_mask`` reads it.

The template is ``data.chat.chat_template`` (Jinja text, or the name of a built-in
one), else the tokenizer's own, else the built-in ``chatml``:

    <|im_start|>user\\n{content}<|im_end|>\\n<|im_start|>assistant\\n{content}<|im_end|>\\n

which needs ``<|im_start|>`` and ``<|im_end|>`` as special tokens of the tokenizer (a
tokenizer trained for a chat run gets them). The built-in ``plain`` needs only the
end-of-document token: ``### {role}\\n{content}{eos_token}\\n`` per turn, the tools
first as JSON lines, reasoning in a ``<think>`` block before the content and tool
calls after it as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``. Both
built-ins write tools, tool calls and reasoning, so none is silently dropped.

One concept: the template's environment, its choice and the renderer
that turns a conversation into ids and a mask are one path that every chat, pair and
prompt source calls; finding the spans in the rendered text is its own module
(:mod:`recipes_lib.data.chat.spans`).
"""

from __future__ import annotations

import json
import logging
import re
from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jinja2
import numpy as np
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from recipes_lib.config.schema import DataConfig
from recipes_lib.data.chat.messages import REASONING_FIELDS, Message, reasoning_of, trainable
from recipes_lib.data.chat.spans import Render, SpanFinder, specials_pattern
from recipes_lib.data.chat_records import tokenizer_bos_token
from recipes_lib.data.records import RecordSource, record_where
from recipes_lib.data.tokenizer import CHATML_TOKENS
from recipes_lib.errors import ConfigError, DataError

CHATML_TEMPLATE = (
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% endif %}"
    "{{ '# Tools\nYou may call these functions, each call in <tool_call></tool_call>:\n' }}"
    "{% for tool in tools %}{{ (tool | tojson) + '\n' }}{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.get('tool_calls') or message.get('reasoning_content') %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message.get('reasoning_content') %}"
    "{{ '<think>\n' + message['reasoning_content'] + '\n</think>\n\n' }}"
    "{% endif %}"
    "{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    "{% set arguments = call['function'].get('arguments') or {} %}"
    "{{ '<tool_call>\n{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' }}"
    "{{ arguments if arguments is string else (arguments | tojson) }}"
    "{{ '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\n' }}"
    "{% elif not (tools and loop.first and message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PLAIN_TEMPLATE = (
    "{% if tools %}{{ '### tools\n' }}"
    "{% for tool in tools %}{{ (tool | tojson) + '\n' }}{% endfor %}"
    "{{ eos_token + '\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '### ' + message['role'] + '\n' }}"
    "{% if message.get('reasoning_content') %}"
    "{{ '<think>\n' + message['reasoning_content'] + '\n</think>\n' }}"
    "{% endif %}"
    "{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    "{% set arguments = call['function'].get('arguments') or {} %}"
    "{{ '<tool_call>{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' }}"
    "{{ arguments if arguments is string else (arguments | tojson) }}"
    "{{ '}</tool_call>' }}"
    "{% endfor %}"
    "{{ eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant\n' }}{% endif %}"
)
BUILTIN_TEMPLATES = {"chatml": CHATML_TEMPLATE, "plain": PLAIN_TEMPLATE}
_TEMPLATE_KEY = "data.chat.chat_template"

# data.chat.train_on: which assistant turns carry loss
TRAIN_ON_KEY = "data.chat.train_on"
TRAIN_ON_ALL, TRAIN_ON_LAST, TRAIN_ON_WITHOUT_REASONING = "all", "last", "without_reasoning"
TRAIN_ON = {
    TRAIN_ON_ALL: "every assistant turn: its content, reasoning and tool calls",
    TRAIN_ON_LAST: "the last assistant turn only",
    TRAIN_ON_WITHOUT_REASONING: "every assistant turn, its reasoning left untrained",
}

log = logging.getLogger(__name__)


# around a {% generation %} block's output when the renderer asks where those blocks are
GENERATION_OPEN, GENERATION_CLOSE = "\ue001", "\ue002"
_MARK_GENERATION = "__recipes_lib_mark_generation"
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


class _GenerationTag(Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` (used by some Hugging Face
    templates to mark assistant text) and renders its body unchanged, or between
    :data:`GENERATION_OPEN` and :data:`GENERATION_CLOSE` when the render asks for it."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body", [nodes.ContextReference()])
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, context, caller):
        if context.get(_MARK_GENERATION):
            return GENERATION_OPEN + caller() + GENERATION_CLOSE
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


@lru_cache(maxsize=16)
def compile_template(text: str) -> jinja2.Template:
    """A Jinja chat template compiled the way ``transformers`` compiles one.

    Raises:
        ConfigError: the template does not parse.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii
    )
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(text)
    except jinja2.TemplateError as err:
        raise ConfigError(f"{_TEMPLATE_KEY}: the chat template does not parse: {err}") from err


def resolve_template(
    configured: str | None, tokenizer_template: str | None, tokenizer_source: str | None = None
) -> tuple[str, str]:
    """``(name, Jinja text)`` of the template to use.

    ``configured`` (``data.chat.chat_template``) is Jinja text or a built-in name; when
    it is None, the tokenizer's template is used, else the built-in ``chatml``. A
    tokenizer from ``tokenizer_source`` (a user's folder) without a template of its own
    gets ``chatml`` with one log line saying so.

    Raises:
        ConfigError: ``configured`` is neither Jinja nor a built-in name.
    """
    if configured is None:
        if tokenizer_template is not None:
            return "tokenizer", tokenizer_template
        if tokenizer_source is not None:
            log.info(
                "the tokenizer at %s has no chat template of its own: the built-in chatml is "
                "used and saved with the output (set %s to choose another)",
                tokenizer_source,
                _TEMPLATE_KEY,
            )
        return "chatml", CHATML_TEMPLATE
    if configured in BUILTIN_TEMPLATES:
        chosen = configured, BUILTIN_TEMPLATES[configured]
    elif "{{" in configured or "{%" in configured:
        chosen = "configured", configured
    else:
        chosen = None
    if chosen is not None:
        if tokenizer_template is not None and chosen[1] != tokenizer_template:
            log.info(
                "%s=%s is used instead of the tokenizer's own chat template (set it to null "
                "to use the tokenizer's)",
                _TEMPLATE_KEY,
                chosen[0] if chosen[0] != "configured" else "<a Jinja template>",
            )
        return chosen
    raise ConfigError(
        f"{_TEMPLATE_KEY}={configured!r} is neither a Jinja template nor a built-in one "
        f"({', '.join(BUILTIN_TEMPLATES)})"
    )


def check_train_on(train_on: str) -> None:
    """Raise :class:`ConfigError` on an unknown ``data.chat.train_on``."""
    if train_on not in TRAIN_ON:
        raise ConfigError(f"{TRAIN_ON_KEY}={train_on!r} is not one of {list(TRAIN_ON)}")


def _special_tokens(tokenizer: Tokenizer) -> list[str]:
    return [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special]


@dataclass(frozen=True)
class RenderedChat:
    """A conversation as token ids and, per token, whether it is assistant output."""

    input_ids: list[int]
    assistant_mask: list[bool]
    # token offsets where the conversation may be cut: after a turn that ends no tool
    # round mid-way (see ``data.chat.truncation=turn``)
    cuts: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.input_ids)


# conversations rendered, then tokenized in one call (ChatRenderer.render_many), at a time
RENDER_BATCH = 256


class ChatRenderer:
    """Renders conversations to token ids and an exact assistant-token mask.

    Args:
        tokenizer: the tokenizer of the model being trained.
        template: ``data.chat.chat_template`` (Jinja text, a built-in name, or None).
        tokenizer_template: the tokenizer's own chat template, if it has one.
        eos_token: the end-of-document token, ``eos_token`` inside templates.
        bos_token: ``bos_token`` inside templates (None: empty).
        tokenizer_source: where a tokenizer the run did not train came from (named when
            it has no chat template and ``chatml`` is used).

    Raises:
        ConfigError: the template does not parse, or a built-in template needs special
            tokens (or the EOS token) that the tokenizer lacks.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        template: str | None = None,
        *,
        tokenizer_template: str | None = None,
        eos_token: str = "<|endoftext|>",
        bos_token: str | None = None,
        tokenizer_source: str | None = None,
        train_on: str = TRAIN_ON_ALL,
        enable_thinking: bool | None = None,
    ) -> None:
        check_train_on(train_on)
        self.tokenizer = tokenizer
        self.train_on = train_on
        # the template's own switches, given as transformers' apply_chat_template gives them
        self.switches: dict[str, Any] = {}
        if enable_thinking is not None:
            self.switches["enable_thinking"] = enable_thinking
        self.template_name, self.template_text = resolve_template(
            template, tokenizer_template, tokenizer_source
        )
        self._template = compile_template(self.template_text)
        self.eos_token = eos_token
        self.bos_token = bos_token or ""
        self._check_tokens()
        self._specials = specials_pattern(_special_tokens(tokenizer))
        # the field this template reads an assistant's reasoning from (None: neither)
        self.reasoning_field = next((f for f in REASONING_FIELDS if f in self.template_text), None)
        # the template marks assistant text itself with {% generation %} blocks
        self.tagged = bool(_GENERATION.search(self.template_text))

    @classmethod
    def from_config(
        cls,
        tokenizer: Tokenizer,
        config: DataConfig,
        tokenizer_template: str | None,
        tokenizer_source: str | None = None,
    ) -> ChatRenderer:
        """The renderer of a run: ``data.chat.chat_template`` (else ``tokenizer_template``,
        the tokenizer's own) with ``data.tokenizer.eos_token``; ``tokenizer_source``
        names a tokenizer the run did not train (see :func:`resolve_template`), whose
        ``tokenizer_config.json`` gives the BOS token templates write."""
        return cls(
            tokenizer,
            config.chat.chat_template,
            tokenizer_template=tokenizer_template,
            eos_token=config.tokenizer.eos_token,
            bos_token=tokenizer_bos_token(tokenizer_source),
            tokenizer_source=tokenizer_source,
            train_on=config.chat.train_on,
            enable_thinking=config.chat.enable_thinking,
        )

    def _check_tokens(self) -> None:
        needed: tuple[str, ...] = ()
        if self.template_name == "chatml":
            needed = CHATML_TOKENS
        elif self.template_name == "plain":
            needed = (self.eos_token,)
        specials = set(_special_tokens(self.tokenizer))
        missing = [t for t in needed if t not in specials]
        if missing:
            raise ConfigError(
                f"{_TEMPLATE_KEY}: the built-in {self.template_name!r} template needs the "
                f"special token(s) {missing}, which the tokenizer lacks; use a tokenizer that "
                "has them (one trained for this run with data.tokenizer.path=null gets the chat "
                "tokens), set data.chat.chat_template=plain (needs only the EOS token, "
                "data.tokenizer.eos_token), or give a Jinja template"
            )

    # ------------------------------------------------------------------ text
    def text(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = False,
        tools: Sequence[Mapping] | None = None,
    ) -> str:
        """The template's rendering of ``messages`` (raises ``jinja2.TemplateError``),
        given ``tools`` and the run's switches as ``apply_chat_template`` gives them."""
        return self._template.render(
            messages=list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            eos_token=self.eos_token,
            bos_token=self.bos_token,
            **self.switches,
        )

    def _render(self, tools: Sequence[Mapping] | None) -> Render:
        def render(messages: Sequence[Message], add_generation_prompt: bool) -> str:
            return self.text(messages, add_generation_prompt, tools)

        return render

    def _layout(
        self, messages: Sequence[Message], tools: Sequence[Mapping] | None = None
    ) -> tuple[str, list[tuple[int, int]], list[int]]:
        """The whole conversation's text, its trained character ranges and the points
        it may be cut at (after an assistant turn that leaves no tool call open).

        The trained ranges are the spans of the assistant turns ``train_on`` chooses
        (see :mod:`recipes_lib.data.chat.spans`), without their reasoning under
        ``train_on=without_reasoning``. A template with ``{% generation %}`` blocks
        gives them itself, as transformers' ``return_assistant_tokens_mask`` reads them:
        each block that falls within a chosen assistant turn is trained whole (a block
        around a user turn, in a template that tags every turn, is not).
        """
        finder = SpanFinder(self._render(tools), messages, self._specials)
        text = finder.text
        spans = {i: finder.span(i) for i, m in enumerate(messages) if m["role"] == "assistant"}
        cuts = [s.cut for i, s in spans.items() if not messages[i].get("tool_calls")]
        turns = [i for i in spans if trainable(messages[i])]
        if self.train_on == TRAIN_ON_LAST:
            turns = turns[-1:]
        trained = [(spans[i].start, spans[i].end) for i in turns]
        if self.train_on == TRAIN_ON_WITHOUT_REASONING:
            trained = [
                (min(a + _reasoning_end(text[a:b], messages[i]), b), b)
                for i, (a, b) in zip(turns, trained, strict=True)
            ]
        elif self.tagged:
            blocks = self._generation_blocks(messages, tools, text)
            if blocks is not None:  # those within the chosen turns: no prompt is trained
                trained = [(a, b) for a, b in blocks if any(a < e and b > s for s, e in trained)]
        return text, trained, cuts

    def _generation_blocks(
        self, messages: Sequence[Message], tools: Sequence[Mapping] | None, text: str
    ) -> list[tuple[int, int]] | None:
        """Where the template's ``{% generation %}`` blocks lie in ``text`` (None when
        marking them changes the rest of the text, so they cannot be placed)."""
        marked = self._template.render(
            messages=list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=False,
            eos_token=self.eos_token,
            bos_token=self.bos_token,
            **{**self.switches, _MARK_GENERATION: True},
        )
        blocks: list[tuple[int, int]] = []
        plain: list[str] = []
        length = 0
        for piece in re.split(f"([{GENERATION_OPEN}{GENERATION_CLOSE}])", marked):
            if piece == GENERATION_OPEN:
                blocks.append((length, -1))
            elif piece == GENERATION_CLOSE and blocks and blocks[-1][1] < 0:
                blocks[-1] = (blocks[-1][0], length)
            elif piece:
                plain.append(piece)
                length += len(piece)
        if "".join(plain) != text or any(b < 0 for _, b in blocks):
            return None
        return [(a, b) for a, b in blocks if a < b]

    def segments(
        self, messages: Sequence[Message], tools: Sequence[Mapping] | None = None
    ) -> list[tuple[str, bool]]:
        """The rendered text of ``messages`` cut into ``(text, is_trained)`` pieces.

        Raises:
            jinja2.TemplateError: the template fails on these messages.
        """
        text, trained, _ = self._layout(messages, tools)
        pieces: list[tuple[str, bool]] = []
        at = 0
        for start, end in sorted(trained):
            pieces += [(text[at:start], False), (text[start:end], True)]
            at = end
        pieces.append((text[at:], False))
        return [(piece, trained) for piece, trained in pieces if piece]

    def template_messages(self, messages: Sequence[Message]) -> list[Message]:
        """``messages`` with each assistant turn's reasoning in the field the template
        reads (``reasoning_content`` or ``thinking``), a ``<think>...</think>`` block
        opening its content moved there too; as given when the template reads neither."""
        field = self.reasoning_field
        if field is None:
            return list(messages)
        return [_reasoning_in(m, field) for m in messages]

    # ---------------------------------------------------------------- tokens
    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping] | None = None,
        index: int | None = None,
        source: RecordSource = "data",
    ) -> RenderedChat:
        """Token ids of the conversation and the mask of its trained tokens (the
        assistant turns ``train_on`` chooses), with the points it may be cut at.

        Raises:
            DataError: the template fails to render the conversation (naming record
                ``index`` of ``source`` when given).
        """
        (rendered,) = self.render_many([(messages, tools, index)], source=source)
        if isinstance(rendered, DataError):
            raise rendered
        return rendered

    def render_many(
        self,
        conversations: Sequence[tuple[Sequence[Message], Sequence[Mapping] | None, int | None]],
        *,
        source: RecordSource = "data",
    ) -> list[RenderedChat | DataError]:
        """:meth:`render` of each ``(messages, tools, index)``, the texts tokenized in
        one call (the Rust tokenizer spreads a batch over the CPU's cores, where one
        conversation at a time kept it to one); a conversation the template fails on
        gets its :class:`DataError` in its place, so the others are still rendered."""
        layouts: list[tuple[str, list[tuple[int, int]], list[int]] | DataError] = []
        for messages, tools, index in conversations:
            try:
                layouts.append(self._layout(self.template_messages(messages), tools))
            except (jinja2.TemplateError, ValueError, TypeError) as err:
                label = source if isinstance(source, str) else "data"
                where = (
                    record_where(source, index) if index is not None else f"{label}: a conversation"
                )
                failed = DataError(
                    f"{where}, field 'messages': the chat template "
                    f"({self.template_name}) failed to render it: {err}"
                )
                failed.__cause__ = err
                layouts.append(failed)
        texts = [layout[0] for layout in layouts if not isinstance(layout, DataError)]
        encodings = iter(self.tokenizer.encode_batch(texts, add_special_tokens=False))
        rendered: list[RenderedChat | DataError] = []
        for layout in layouts:
            if isinstance(layout, DataError):
                rendered.append(layout)
                continue
            _, trained, cuts = layout
            encoding = next(encodings)
            starts = [a for a, _ in encoding.offsets]
            rendered.append(
                RenderedChat(
                    list(encoding.ids),
                    trained_tokens(encoding.offsets, trained),
                    tuple(bisect_left(starts, c) for c in cuts),
                )
            )
        return rendered

    def render_prompt(
        self, messages: Sequence[Message], tools: Sequence[Mapping] | None = None
    ) -> list[int]:
        """Token ids of ``messages`` followed by the generation prompt, ``tools`` given to
        the template.

        Raises:
            DataError: the template fails to render the conversation.
        """
        try:
            text = self.text(self.template_messages(messages), True, tools)
        except (jinja2.TemplateError, ValueError, TypeError) as err:
            raise DataError(
                f"the chat template ({self.template_name}) failed to render the prompt: {err}"
            ) from err
        return self.tokenizer.encode(text, add_special_tokens=False).ids


_THINK = re.compile(r"\s*<think>(.*?)</think>\s*", re.DOTALL)
_THINK_END = re.compile(r"\s*</think>\s*")


def _reasoning_in(message: Message, field: str) -> Message:
    """An assistant turn with its reasoning in ``field`` alone: moved from the other
    reasoning field, or from a ``<think>...</think>`` block opening its content."""
    if message["role"] != "assistant":
        return message
    reasoning = reasoning_of(message)
    content = message.get("content")
    found = None
    if not reasoning and isinstance(content, str):
        found = _THINK.match(content)
        if found is not None:
            reasoning, content = found.group(1).strip("\n"), content[found.end() :]
    if not reasoning or (message.get(field) == reasoning and found is None):
        return message
    moved = {k: v for k, v in message.items() if k not in REASONING_FIELDS}
    return {**moved, "content": content, field: reasoning}


def _reasoning_end(delta: str, message: Message) -> int:
    """Where a turn's reasoning ends in the text it adds (past a ``</think>`` that
    closes it and the space after): 0 when the turn shows no reasoning."""
    reasoning = reasoning_of(message)
    at = delta.find(reasoning) + len(reasoning) if reasoning.strip() else -1
    if reasoning.strip() and at < len(reasoning):
        at = -1
    close = _THINK_END.search(delta, max(at, 0))
    if close is not None and (at < 0 or delta[at : close.start()].strip() == ""):
        return close.end()
    return max(at, 0)


def trained_tokens(
    offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> list[bool]:
    """Per token (its ``(start, end)`` characters), whether it overlaps a trained span:
    a token holding any trained character is trained, as transformers' assistant mask
    marks every token holding a character of a generation block."""
    union: list[list[int]] = []  # the spans merged into disjoint, ordered ranges
    for start, end in sorted(s for s in spans if s[0] < s[1]):
        if union and start <= union[-1][1]:
            union[-1][1] = max(union[-1][1], end)
        else:
            union.append([start, end])
    if not union or not offsets:
        return [False] * len(offsets)
    ranges = np.asarray(union, dtype=np.int64)
    tokens = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    starts, ends = tokens[:, 0], tokens[:, 1]
    # the first range ending after the token starts overlaps it if it begins before its end
    k = np.searchsorted(ranges[:, 1], starts, side="right")
    inside = k < len(ranges)
    begins = ranges[np.minimum(k, len(ranges) - 1), 0]
    return (inside & (begins < ends) & (ends > starts)).tolist()


def render_chat(
    messages: Sequence[Message],
    template: str | None,
    tokenizer: Tokenizer,
    *,
    tokenizer_template: str | None = None,
    eos_token: str = "<|endoftext|>",
) -> tuple[list[int], list[bool]]:
    """``(token_ids, assistant_mask)`` of one conversation (see :class:`ChatRenderer`)."""
    renderer = ChatRenderer(
        tokenizer, template, tokenizer_template=tokenizer_template, eos_token=eos_token
    )
    rendered = renderer.render(messages)
    return rendered.input_ids, rendered.assistant_mask
