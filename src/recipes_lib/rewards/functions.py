"""Built-in reward functions for online RL with verifiable rewards (GRPO).

Each is ``fn(completion, record, **settings) -> float``: ``completion`` is the sampled
text (its stop token left out), ``record`` the prompt's data record, whose fields
(``answer``, ``tests``, ``name``, ...) say what a right completion is. A run names them
with their settings under ``grpo.rewards`` (:mod:`recipes_lib.rewards.registry`).

``unit_tests`` runs code in a separate Python process in its own session, in a fresh
temporary folder, with a wall-clock limit, limits on CPU time, memory and file size, and
the whole session killed when it ends (POSIX only; elsewhere it scores 0): the process
can still do what its user may do (read files, open sockets), so give it tests and
completions you would run yourself, or run the trainer in a container.
"""

from __future__ import annotations

import ast
import os
import re
import secrets
import signal
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


MAX_PARSED_CHARS = 100_000  # a longer completion is no answer


def _parses(code: str) -> ast.Module | None:
    if len(code) > MAX_PARSED_CHARS:
        return None
    try:
        return ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # deep nesting too
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


# Runs in the test process before the program: the resource limits (POSIX), the program
# itself, then a token only a program that ran to its end prints (so an early exit with
# status 0, os._exit(0) or SystemExit, does not pass).
_RUNNER = """
import os, resource, runpy, sys
seconds, memory, token, script = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
for limit, value in ((resource.RLIMIT_CPU, seconds), (resource.RLIMIT_AS, memory),
                     (resource.RLIMIT_FSIZE, 1 << 20)):
    resource.setrlimit(limit, (value, value))
runpy.run_path(script, run_name="__main__")
sys.stdout.write(token)
sys.stdout.flush()
"""


def _kill_group(process: subprocess.Popen) -> None:
    """End the test process and everything it started (its own session's group)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


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
    process within ``timeout`` seconds; else 0.0 (a failure, an error, a timeout, or an
    exit before the end). The process runs in its own session, which is killed whole
    when it ends or times out, under limits on CPU time, memory and file size (POSIX)."""
    prefix = str(record[prefix_field]) if prefix_field else ""
    program = f"{prefix}{completion}\n\n{record[field]}\n"
    if _parses(program) is None or os.name != "posix":
        return 0.0
    token = secrets.token_hex(16)
    cpu = str(max(1, int(timeout) + 1))
    with tempfile.TemporaryDirectory(prefix="recipes-reward-") as folder:
        script = Path(folder) / "program.py"
        script.write_text(program)
        command = [sys.executable, "-I", "-c", _RUNNER, cpu, str(MEMORY_LIMIT_BYTES), token]
        process = subprocess.Popen(
            [*command, str(script)],  # isolated: no site, environment or cwd paths
            cwd=folder,
            env={"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0"},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            out, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            process.communicate()
            return 0.0
        finally:
            _kill_group(process)
    return float(process.returncode == 0 and out.endswith(token.encode()))
