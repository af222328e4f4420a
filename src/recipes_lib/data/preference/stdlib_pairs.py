"""Built-in preference pairs made from the Python standard library (``builtin: stdlib_dpo``).

The pairs extend the built-in instruction records (``builtin: stdlib_sft``,
:func:`recipes_lib.data.chat.instructions.stdlib_instruction_records`): the prompt is the
same request for a documented function (its module, signature and docstring), the
chosen response is the function's real source, as supervised fine-tuning saw it, and
the rejected response is that source with one deterministic corruption of its body,
chosen by the seed and the function's name:

- ``shuffle``: the body's top-level statements in another order;
- ``drop``: one top-level statement left out;
- ``operator``: one comparison, ``and``/``or``, ``+``/``-``, ``True``/``False`` or
  ``0``/``1`` token flipped;
- ``return_none``: one ``return <value>`` made to return ``None``.

Corruptions edit the source text in place (by the positions ``ast`` and ``tokenize``
report), so both responses keep the original's formatting, comments and docstring:
what tells them apart is the code, not its layout.
"""

from __future__ import annotations

import ast
import io
import random
import tokenize

from recipes_lib.data.chat.instructions import documented_function, stdlib_instruction_records

CORRUPTIONS = ("shuffle", "drop", "operator", "return_none")
_FLIPPED_OPS = {"==": "!=", "!=": "==", "<": ">=", ">": "<=", "<=": ">", ">=": "<", "+": "-"}
_FLIPPED_OPS["-"] = "+"
_FLIPPED_NAMES = {"and": "or", "or": "and", "True": "False", "False": "True"}
_FLIPPED_NUMBERS = {"0": "1", "1": "0"}

Span = tuple[int, int, int, int]  # (line, col, end_line, end_col), 0-based lines


def stdlib_preference_records(max_records: int | None = None, seed: int = 0) -> list[dict]:
    """Preference pairs from the standard library's documented functions.

    Args:
        max_records: stop after this many pairs (``None``: every function that has a
            corruptible body).
        seed: picks the functions (as for ``stdlib_sft``) and each one's corruption.

    Returns:
        Records ``{"prompt", "chosen", "rejected", "source", "corruption"}``; the same
        arguments give the same records on the same interpreter.
    """
    # a few functions have no corruptible body: ask for some spare instruction records
    wanted = None if max_records is None else max_records + max_records // 4 + 8
    while True:
        instructions = stdlib_instruction_records(wanted, seed)
        records = []
        for instruction in instructions:
            pair = corrupt_function(instruction["response"], instruction["source"], seed)
            if pair is None:
                continue
            rejected, kind = pair
            records.append(
                {
                    "prompt": instruction["prompt"],
                    "chosen": instruction["response"],
                    "rejected": rejected,
                    "source": instruction["source"],
                    "corruption": kind,
                }
            )
            if max_records is not None and len(records) >= max_records:
                return records
        if wanted is None or len(instructions) < wanted:
            return records  # every function was tried
        wanted *= 2


def corrupt_function(source: str, origin: str, seed: int) -> tuple[str, str] | None:
    """``(corrupted source, corruption)`` of one function's source, or ``None`` when it
    is not one documented function with a body after its docstring that a corruption
    changes. ``origin`` (its name) and ``seed`` choose the corruption."""
    found = documented_function(source)
    if found is None:
        return None
    node, body_start = found  # body_start: the 0-based index of the line after the docstring
    lines = source.splitlines(keepends=True)
    head, body = "".join(lines[:body_start]), "".join(lines[body_start:])
    terminated = body.endswith("\n")
    body = body if terminated else body + "\n"  # statements move as whole lines
    statements = [_span(s, body_start) for s in node.body[1:]]
    rng = random.Random(f"{seed}:{origin}")
    kinds = list(CORRUPTIONS)
    rng.shuffle(kinds)
    for kind in kinds:
        corrupted = _CORRUPT[kind](body, statements, node, body_start, rng)
        if corrupted is not None and corrupted != body:
            if not terminated:
                corrupted = corrupted.rstrip("\n")  # end as the original does
            return head + corrupted, kind
    return None


def _span(node: ast.AST, first_line: int) -> Span:
    return (
        node.lineno - 1 - first_line,  # type: ignore[attr-defined]
        node.col_offset,  # type: ignore[attr-defined]
        node.end_lineno - 1 - first_line,  # type: ignore[attr-defined]
        node.end_col_offset,  # type: ignore[attr-defined]
    )


def _whole_line_blocks(body: str, statements: list[Span]) -> list[tuple[int, int]] | None:
    """Each statement's ``[first, last]`` line range, if statements never share a line."""
    blocks = [(s[0], s[2]) for s in statements]
    for (_, end), (start, _) in zip(blocks, blocks[1:], strict=False):
        if start <= end:
            return None
    return blocks


def _shuffle(body, statements, node, first_line, rng) -> str | None:
    lines = body.splitlines(keepends=True)
    blocks = _whole_line_blocks(body, statements)
    if blocks is None or len(blocks) < 2:
        return None
    texts = ["".join(lines[a : b + 1]) for a, b in blocks]
    if len(set(texts)) < 2:
        return None
    order = list(range(len(texts)))
    while [texts[i] for i in order] == texts:
        rng.shuffle(order)
    out, cursor = [], 0
    for (a, b), i in zip(blocks, order, strict=True):
        out.append("".join(lines[cursor:a]))  # comments and blank lines stay where they were
        out.append(texts[i])
        cursor = b + 1
    out.append("".join(lines[cursor:]))
    return "".join(out)


def _drop(body, statements, node, first_line, rng) -> str | None:
    lines = body.splitlines(keepends=True)
    blocks = _whole_line_blocks(body, statements)
    if blocks is None or len(blocks) < 2:
        return None
    a, b = blocks[rng.randrange(len(blocks))]
    return "".join(lines[:a] + lines[b + 1 :])


def _operator(body, statements, node, first_line, rng) -> str | None:
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(body).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    candidates = []
    for tok in tokens:
        table = {
            tokenize.OP: _FLIPPED_OPS,
            tokenize.NAME: _FLIPPED_NAMES,
            tokenize.NUMBER: _FLIPPED_NUMBERS,
        }.get(tok.type)
        if table is not None and tok.string in table and tok.start[0] == tok.end[0]:
            candidates.append((tok.start[0] - 1, tok.start[1], tok.end[1], tok))
    if not candidates:
        return None
    line, col, end, tok = candidates[rng.randrange(len(candidates))]
    table = _FLIPPED_OPS if tok.type == tokenize.OP else _FLIPPED_NAMES
    table = _FLIPPED_NUMBERS if tok.type == tokenize.NUMBER else table
    return _replace(body, (line, col, line, end), table[tok.string])


def _return_none(body, statements, node, first_line, rng) -> str | None:
    returns = [
        r
        for stmt in node.body[1:]
        for r in ast.walk(stmt)
        if isinstance(r, ast.Return)
        and r.value is not None
        and not (isinstance(r.value, ast.Constant) and r.value.value is None)
    ]
    if not returns:
        return None
    value = returns[rng.randrange(len(returns))].value
    return _replace(body, _span(value, first_line), "None")


def _replace(body: str, span: Span, text: str) -> str | None:
    lines = body.splitlines(keepends=True)
    line, col, end_line, end_col = span
    if not (0 <= line <= end_line < len(lines)) or col < 0:
        return None
    head = lines[line][:col]
    tail = lines[end_line][end_col:]
    return "".join(lines[:line]) + head + text + tail + "".join(lines[end_line + 1 :])


_CORRUPT = {
    "shuffle": _shuffle,
    "drop": _drop,
    "operator": _operator,
    "return_none": _return_none,
}
