"""Built-in reward functions for online RL with verifiable rewards (GRPO).

Each is ``fn(completion, record, **settings) -> float``: ``completion`` is the sampled
text (its stop token left out), ``record`` the prompt's data record, whose fields
(``answer``, ``tests``, ``name``, ...) say what a right completion is. A run names them
with their settings under ``grpo.rewards`` (:mod:`recipes_lib.rewards.registry`).

``unit_tests`` runs code in a separate Python process, in a fresh temporary folder, with
a wall-clock limit and, on POSIX, limits on CPU time, memory and file size: the process
can still do what its user may do (read files, open sockets), so give it tests and
completions you would run yourself, or run the trainer in a container.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MEMORY_LIMIT_BYTES = 1 << 30  # the test process's address space, on POSIX


def _normalise(text: str) -> str:
    return " ".join(str(text).split())


def exact_match(
    completion: str, record: Mapping[str, Any], *, field: str = "answer", extract: str | None = None
) -> float:
    """1.0 when the completion (or the first group of the regex ``extract`` found in it)
    equals ``record[field]``, whitespace normalised; else 0.0."""
    text = completion
    if extract is not None:
        found = re.search(extract, completion, flags=re.DOTALL)
        if found is None:
            return 0.0
        text = found.group(1) if found.groups() else found.group(0)
    return float(_normalise(text) == _normalise(record[field]))


def format_match(completion: str, record: Mapping[str, Any], *, pattern: str) -> float:
    """1.0 when the whole completion (stripped) matches the regex ``pattern``; else 0.0."""
    return float(re.fullmatch(pattern, completion.strip(), flags=re.DOTALL) is not None)


def _parses(code: str) -> ast.Module | None:
    try:
        return ast.parse(code)
    except (SyntaxError, ValueError):
        return None


def python_syntax(
    completion: str, record: Mapping[str, Any], *, prefix_field: str | None = None
) -> float:
    """1.0 when the completion (after ``record[prefix_field]``, when given) parses as
    Python and holds a statement; else 0.0 (an empty completion is no answer)."""
    prefix = str(record[prefix_field]) if prefix_field else ""
    tree = _parses(prefix + completion)
    return float(tree is not None and bool(tree.body) and bool(completion.strip()))


def defines_function(
    completion: str, record: Mapping[str, Any], *, field: str | None = "name"
) -> float:
    """1.0 when the completion parses as Python and defines, at its top level, a function
    named ``record[field]`` (``field`` None: any function); else 0.0."""
    tree = _parses(completion)
    if tree is None:
        return 0.0
    name = None if field is None else str(record[field])
    return float(
        any(
            isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and (name is None or node.name == name)
            for node in tree.body
        )
    )


def function_header(completion: str, record: Mapping[str, Any]) -> float:
    """1.0 when the completion's first line is a function's ``def`` line that parses (as
    the header of a function with a body); else 0.0. A dense first step towards a whole
    function for a model that rarely writes one."""
    first = completion.lstrip().split("\n", 1)[0]
    if not first.startswith(("def ", "async def ")):
        return 0.0
    return float(_parses(f"{first}\n    pass\n") is not None)


def _limit_resources(seconds: float) -> None:  # in the child, before it runs Python code
    import resource

    cpu = max(1, int(seconds) + 1)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    os.setsid()  # its own process group: a timeout ends everything it started


def unit_tests(
    completion: str,
    record: Mapping[str, Any],
    *,
    field: str = "tests",
    prefix_field: str | None = None,
    timeout: float = 5.0,
) -> float:
    """1.0 when ``record[prefix_field]`` (if given), the completion and then the test code
    ``record[field]`` (``assert`` statements, say) run to the end in a separate Python
    process within ``timeout`` seconds; else 0.0 (a failure, an error, a timeout)."""
    prefix = str(record[prefix_field]) if prefix_field else ""
    program = f"{prefix}{completion}\n\n{record[field]}\n"
    if _parses(program) is None:
        return 0.0
    with tempfile.TemporaryDirectory(prefix="recipes-reward-") as folder:
        script = Path(folder) / "program.py"
        script.write_text(program)
        posix = os.name == "posix"
        try:
            done = subprocess.run(
                [sys.executable, "-I", str(script)],  # isolated: no site, env or cwd paths
                cwd=folder,
                env={"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0"},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                timeout=timeout,
                preexec_fn=(lambda: _limit_resources(timeout)) if posix else None,  # noqa: PLW1509
                check=False,
            )
        except subprocess.TimeoutExpired:
            return 0.0
    return float(done.returncode == 0)
