"""Chat templates: rendering a conversation to token ids and its assistant-token mask.

A conversation is rendered with a Jinja chat template, one turn at a time: the text a
turn adds is the difference between rendering the turns up to it and the turns before
it, so every character (and, tokenizing turn by turn, every token) is known to belong
to one turn. The mask marks an assistant turn's content and the end-of-turn special
token that follows it; headers, user and system turns are not trained on.

The template is ``data.chat.chat_template`` (Jinja text, or the name of a built-in
one), else the tokenizer's own, else the built-in ``chatml``:

    <|im_start|>user\\n{content}<|im_end|>\\n<|im_start|>assistant\\n{content}<|im_end|>\\n

which needs ``<|im_start|>`` and ``<|im_end|>`` as special tokens of the tokenizer (a
tokenizer trained for a chat run gets them). The built-in ``plain`` needs only the
end-of-document token: ``### {role}\\n{content}{eos_token}\\n`` per turn.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from recipes_lib.config.schema import DataConfig
from recipes_lib.data.chat.messages import Message
from recipes_lib.data.records import RecordSource, record_where
from recipes_lib.data.tokenizer import CHATML_TOKENS
from recipes_lib.errors import ConfigError, DataError

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PLAIN_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '### ' + message['role'] + '\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant\n' }}{% endif %}"
)
BUILTIN_TEMPLATES = {"chatml": CHATML_TEMPLATE, "plain": PLAIN_TEMPLATE}
_TEMPLATE_KEY = "data.chat.chat_template"

log = logging.getLogger(__name__)


class _GenerationTag(Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` (used by some Hugging Face
    templates to mark assistant text) and renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
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


def _special_tokens(tokenizer: Tokenizer) -> list[str]:
    return [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special]


@dataclass(frozen=True)
class RenderedChat:
    """A conversation as token ids and, per token, whether it is assistant output."""

    input_ids: list[int]
    assistant_mask: list[bool]

    def __len__(self) -> int:
        return len(self.input_ids)


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
    ) -> None:
        self.tokenizer = tokenizer
        self.template_name, self.template_text = resolve_template(
            template, tokenizer_template, tokenizer_source
        )
        self._template = compile_template(self.template_text)
        self.eos_token = eos_token
        self.bos_token = bos_token or ""
        self._check_tokens()
        self._specials = sorted(_special_tokens(tokenizer), key=len, reverse=True)

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
        names a tokenizer the run did not train (see :func:`resolve_template`)."""
        return cls(
            tokenizer,
            config.chat.chat_template,
            tokenizer_template=tokenizer_template,
            eos_token=config.tokenizer.eos_token,
            tokenizer_source=tokenizer_source,
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
    def text(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """The template's rendering of ``messages`` (raises ``jinja2.TemplateError``)."""
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            eos_token=self.eos_token,
            bos_token=self.bos_token,
        )

    def _assistant_span(self, delta: str, content: str) -> tuple[int, int]:
        """Where, in the text an assistant turn adds, its trained part starts and ends:
        from its content through the first special token after it (the end of turn),
        or through the content's end when no special token follows."""
        start = delta.find(content) if content else -1
        if start < 0 and content.strip():
            start = delta.find(content.strip())
            content = content.strip()
        if start < 0:  # the template rewrote the content: train on the whole turn
            return 0, len(delta.rstrip())
        end = start + len(content)
        rest = delta[end:]
        stripped = rest.lstrip()
        for token in self._specials:
            if stripped.startswith(token):
                return start, end + (len(rest) - len(stripped)) + len(token)
        return start, end

    def segments(self, messages: Sequence[Message]) -> list[tuple[str, bool]]:
        """The rendered text of ``messages`` cut into ``(text, is_assistant)`` pieces.

        Raises:
            jinja2.TemplateError: the template fails on these messages.
            ValueError: the template is not incremental (rendering the first k turns is
                not a prefix of rendering k + 1 turns), so turns cannot be told apart.
        """
        pieces: list[tuple[str, bool]] = []
        previous = ""
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                head = self.text(messages[:i], add_generation_prompt=True)
                full = self.text(messages[: i + 1])
                _check_prefix(previous, head, i)
                _check_prefix(head, full, i)
                pieces.append((head[len(previous) :], False))
                delta = full[len(head) :]
                start, end = self._assistant_span(delta, message["content"])
                pieces += [(delta[:start], False), (delta[start:end], True), (delta[end:], False)]
            else:
                full = self.text(messages[: i + 1])
                _check_prefix(previous, full, i)
                pieces.append((full[len(previous) :], False))
            previous = full
        return [(text, flag) for text, flag in pieces if text]

    # ---------------------------------------------------------------- tokens
    def render(
        self,
        messages: Sequence[Message],
        *,
        index: int | None = None,
        source: RecordSource = "data",
    ) -> RenderedChat:
        """Token ids of the conversation and the mask of its assistant tokens.

        Raises:
            DataError: the template fails to render the conversation (naming record
                ``index`` of ``source`` when given).
        """
        try:
            pieces = self.segments(messages)
        except (jinja2.TemplateError, ValueError, TypeError) as err:
            label = source if isinstance(source, str) else "data"
            where = record_where(source, index) if index is not None else f"{label}: a conversation"
            raise DataError(
                f"{where}, field 'messages': the chat template "
                f"({self.template_name}) failed to render it: {err}"
            ) from err
        encoded = self.tokenizer.encode_batch(
            [text for text, _ in pieces], add_special_tokens=False
        )
        ids: list[int] = []
        mask: list[bool] = []
        for (_, is_assistant), encoding in zip(pieces, encoded, strict=True):
            ids.extend(encoding.ids)
            mask.extend([is_assistant] * len(encoding.ids))
        return RenderedChat(ids, mask)

    def render_prompt(self, messages: Sequence[Message]) -> list[int]:
        """Token ids of ``messages`` followed by the assistant header (for generation)."""
        text = self.text(messages, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def _check_prefix(prefix: str, text: str, turn: int) -> None:
    if not text.startswith(prefix):
        raise ValueError(
            f"the template is not incremental: rendering turns 0..{turn} does not start with "
            "the rendering of the turns before it, so turns cannot be masked separately"
        )


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
