"""Built-in instruction data made from the standard library: ``builtin: stdlib_sft``.

Each record pairs a function's signature and docstring (the instruction) with the
function's source (the response), parsed with :mod:`ast` from this interpreter's
standard library, so fine-tuning runs anywhere with no download.
"""

from __future__ import annotations

import ast
import random
import textwrap
from functools import cache
from pathlib import Path

from recipes_lib.data.corpus import stdlib_files, stdlib_root

MAX_RESPONSE_CHARS = 1200  # longer functions are left out: they would mostly be truncated
MIN_DOCSTRING_CHARS = 20
MAX_DOCSTRING_CHARS = 600


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"{prefix} {node.name}({ast.unparse(node.args)}){returns}:"


def _functions(tree: ast.Module) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Module-level functions and methods of module-level classes, with qualified names."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found.append((node.name, node))
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    found.append((f"{node.name}.{item.name}", item))
    return found


@cache
def _file_records(path: str) -> tuple[dict[str, str], ...]:
    """The instruction records of one standard-library file (parsed once per process)."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return ()
    relative = file.relative_to(stdlib_root()).with_suffix("")
    module = ".".join(p for p in relative.parts if p != "__init__")
    lines = text.splitlines(keepends=True)
    records = []
    for qualname, node in _functions(tree):
        if node.name.startswith("_") or node.end_lineno is None:
            continue
        doc = ast.get_docstring(node)
        if doc is None or not MIN_DOCSTRING_CHARS <= len(doc) <= MAX_DOCSTRING_CHARS:
            continue
        # a def spans whole lines, from its own (decorators left out) to its last
        source = textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno])).strip("\n")
        if len(source) > MAX_RESPONSE_CHARS:
            continue
        quoted = f'"""{doc}"""' if "\n" not in doc else f'"""{doc}\n"""'
        docstring = textwrap.indent(quoted, "    ")
        prompt = (
            f"Write the function `{qualname}` of the Python standard library module "
            f"`{module}`.\n\n{_signature(node)}\n{docstring}"
        )
        records.append({"prompt": prompt, "response": source, "source": f"{module}:{qualname}"})
    return tuple(records)


def documented_function(source: str) -> tuple[ast.FunctionDef | ast.AsyncFunctionDef, int] | None:
    """``(node, body_start)`` of one function's source when it is a single documented
    function at column 0 with statements after its docstring, starting on a line of
    their own (``body_start``: the 0-based index of the first line after the
    docstring); else None."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    node = tree.body[0]
    if ast.get_docstring(node) is None or len(node.body) < 2 or node.col_offset != 0:
        return None
    body_start = node.body[0].end_lineno or 0
    if body_start >= len(source.splitlines()) or node.body[1].lineno - 1 < body_start:
        return None  # a statement shares the docstring's line
    return node, body_start


def stdlib_instruction_records(
    max_records: int | None = None, seed: int = 0
) -> list[dict[str, str]]:
    """Instruction records ``{"prompt", "response", "source"}`` from the standard library.

    Files are read in an order shuffled by ``seed`` until ``max_records`` records were
    found (``None``: every file), so a small request parses only a few files. The
    same arguments give the same records on the same interpreter.
    """
    files = [str(p) for p in stdlib_files()]
    random.Random(seed).shuffle(files)
    records: list[dict[str, str]] = []
    for file in files:
        records.extend(dict(r) for r in _file_records(file))
        if max_records is not None and len(records) >= max_records:
            return records[:max_records]
    return records
