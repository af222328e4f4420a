"""Where each assistant turn lies in the rendering of a whole conversation.

A conversation is rendered once, whole, because some templates write a turn
differently once later turns follow it: Qwen3 and gpt-oss keep an assistant's reasoning
only after the last user turn, and gpt-oss ends the closing answer with ``<|return|>``
but an earlier one with ``<|end|>``. Rendering turn by turn and adding the pieces up
would not give the text the model is trained on. Each assistant turn's trained span
is then found in the whole text from a few more renderings of the same template:

- **its own text**: the characters that change when the turn's strings change (each
  string gets a private-use mark appended, which no template writes itself);
- **its start**: where the whole text stops agreeing with the prompt that asks for the
  turn, which is the turns before it rendered with the generation prompt. What the
  generation prompt writes is prompt; what the template writes after it (Qwen3's
  ``<think>`` block, gpt-oss's channel header, the call syntax) is the model's to
  write, so it is trained. A template that rewrites an earlier turn once this one
  follows is compared from the end of the previous message's own text instead;
- **its end**: the end of the first special token after its own text (the end-of-turn
  token), or the end of its own text when no special token follows before the next
  message.

These are the spans a template's ``{% generation %}`` markers give where it has them:
the generation prompt is outside the markers, the end-of-turn token inside.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2

Message = dict[str, Any]
# (messages, add_generation_prompt) -> the template's text
Render = Callable[[Sequence[Message], bool], str]

MARK = "\ue000"  # a private-use character: appended to a turn's strings to find them
_STRUCTURE = frozenset({"role", "id", "type", "tool_call_id"})  # not text a turn says


@dataclass(frozen=True)
class TurnSpan:
    """The trained characters ``[start, end)`` of message ``turn`` in the whole text,
    and ``cut``: where the text may be cut after it (past the whitespace that follows)."""

    turn: int
    start: int
    end: int
    cut: int


def marked(value: Any) -> Any:
    """``value`` with :data:`MARK` appended to every non-empty string in it, keys that
    name structure (role, ids) left alone."""
    if isinstance(value, str):
        return value + MARK if value else value
    if isinstance(value, Mapping):
        return {k: v if k in _STRUCTURE else marked(v) for k, v in value.items()}
    if isinstance(value, list):
        return [marked(v) for v in value]
    return value


def _common_prefix(a: str, b: str) -> int:
    """The length of the longest common start of ``a`` and ``b``, by bisection over
    slice comparisons (a whole conversation's text is long; a character loop is slow)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str) -> int:
    return _common_prefix(a[::-1], b[::-1])


def _changed(text: str, other: str) -> tuple[int, int]:
    """``(first, last)``: the characters of ``text`` that ``other`` differs in (an
    insertion has ``first == last``; ``first > last`` when nothing differs)."""
    return _common_prefix(text, other), len(text) - _common_suffix(text, other)


class SpanFinder:
    """Finds the assistant turns' spans in the whole rendering of ``messages``.

    Args:
        render: the template, as ``render(messages, add_generation_prompt)``.
        messages: the conversation.
        specials: a pattern matching any special token of the tokenizer.
    """

    def __init__(self, render: Render, messages: Sequence[Message], specials: re.Pattern) -> None:
        self.render = render
        self.messages = list(messages)
        self.specials = specials
        self.text = render(self.messages, False)
        self._own: dict[int, tuple[int, int]] = {}

    def own(self, i: int) -> tuple[int, int] | None:
        """Message ``i``'s own characters in the whole text (None: none show)."""
        if i not in self._own:
            changed = list(self.messages)
            changed[i] = marked(self.messages[i])
            self._own[i] = _changed(self.text, self.render(changed, False))
        first, last = self._own[i]
        return (first, last) if first <= last else None

    def start(self, i: int) -> int:
        """Where assistant turn ``i``'s trained text starts (module docstring)."""
        if i == 0:
            own = self.own(0)
            try:
                prompt = self.render([], True)
            except (jinja2.TemplateError, IndexError, KeyError, TypeError):
                return own[0] if own else 0
            return min(_common_prefix(self.text, prompt), own[0] if own else len(self.text))
        prompt = self.render(self.messages[:i], True)
        agreed = _common_prefix(self.text, prompt)
        previous = self.own(i - 1)
        if previous is None or agreed >= previous[1]:
            return agreed
        # an earlier turn is written otherwise now that this one follows: compare the
        # two from the end of the previous message's own text on each side
        changed = list(self.messages[:i])
        changed[i - 1] = marked(self.messages[i - 1])
        after = _changed(prompt, self.render(changed, True))[1]
        floor = previous[1]
        return floor + _common_prefix(self.text[floor:], prompt[after:])

    def span(self, i: int) -> TurnSpan:
        """Assistant turn ``i``'s trained span (empty when none of its text shows)."""
        start = self.start(i)
        own = self.own(i)
        if own is None:
            return TurnSpan(i, start, start, start)
        last = max(own[1], start)
        bound = len(self.text)
        if i + 1 < len(self.messages):
            following = self.own(i + 1)
            if following is not None:
                bound = max(last, following[0])
        found = self.specials.search(self.text, last, bound)
        end = found.end() if found else last
        rest = self.text[end:bound]
        return TurnSpan(i, start, end, end + len(rest) - len(rest.lstrip()))


def specials_pattern(tokens: Sequence[str]) -> re.Pattern:
    """A pattern matching any of ``tokens``, the longest first (matches nothing when
    there are none)."""
    if not tokens:
        return re.compile(r"(?!x)x")
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))
