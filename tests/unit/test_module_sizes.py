"""A module holds one concept; size alone is no reason to split it, but a long one says why
it is one concept.

Every module under ``src/recipes_lib/`` and ``callbacks/`` longer than
:data:`LIMIT` lines has, in its module docstring, a sentence starting ``One concept:``
that says why it stays one module (see docs/contributing.md, House rules).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
LIMIT = 500
MARK = "One concept:"


def modules() -> list[Path]:
    return sorted(
        [*(ROOT / "src" / "recipes_lib").rglob("*.py"), *(ROOT / "callbacks").rglob("*.py")]
    )


def unexplained(source: str) -> bool:
    """Whether ``source`` is over :data:`LIMIT` lines without a docstring saying why."""
    if len(source.splitlines()) <= LIMIT:
        return False
    docstring = ast.get_docstring(ast.parse(source)) or ""
    return MARK not in docstring


def test_long_modules_say_why_they_are_one_concept():
    found = [p for p in modules() if unexplained(p.read_text())]
    names = ", ".join(str(p.relative_to(ROOT)) for p in found)
    assert not found, (
        f"over {LIMIT} lines with no '{MARK}' sentence in the module docstring: {names}; "
        "split the module, or say in its docstring why it is one concept"
    )


@pytest.mark.parametrize(
    ("docstring", "expected"),
    [("A long module.", True), (f"A long module.\n\n{MARK} the one table of X.", False)],
)
def test_the_rule_reads_the_docstring(docstring, expected):
    body = "x = 1\n" * (LIMIT + 1)
    assert unexplained(f'"""{docstring}"""\n{body}') is expected
    assert not unexplained(f'"""{docstring}"""\n' + "x = 1\n" * (LIMIT - 2))
