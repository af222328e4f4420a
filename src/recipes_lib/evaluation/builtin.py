"""Built-in evaluation tasks, made from the embedded standard-library corpus.

``stdlib_bodies``: which of four bodies is the real one of a documented function? The
context is a function's ``def`` line and docstring, as written in the standard
library; the choices are its own body and the bodies of three other functions of
similar length (picked by a fixed seed). A model that reads the signature and the
docstring (argument names, what it says the function returns) picks the right body
more often than chance (0.25). The functions are those the built-in instruction data
is made from (``builtin: stdlib_sft``), in another order, so a model pretrained or
fine-tuned on the corpus may have seen some of them: the task measures what a model
learned of the library's code, not generalisation to unseen code.
"""

from __future__ import annotations

import ast
import random
from functools import cache

from recipes_lib.data.chat.instructions import stdlib_instruction_records
from recipes_lib.evaluation.choice import ChoiceExample, ChoiceTask

STDLIB_BODIES = "stdlib_bodies"
BUILTIN_TASKS = (STDLIB_BODIES,)
N_CHOICES = 4
MIN_BODY_CHARS, MAX_BODY_CHARS = 40, 400
_SEED = 1  # not the instruction data's order (seed 0)


def _split(source: str) -> tuple[str, str] | None:
    """(``def`` line and docstring, body) of one function's source, or None when it is
    not one function whose body starts on a line after its docstring."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef | ast.AsyncFunctionDef):
        return None
    node = tree.body[0]
    if ast.get_docstring(node) is None or len(node.body) < 2 or node.col_offset != 0:
        return None
    lines = source.splitlines(keepends=True)
    first_body_line = node.body[0].end_lineno  # the line after the docstring (0-based)
    if first_body_line >= len(lines) or node.body[1].lineno - 1 < first_body_line:
        return None
    head, body = "".join(lines[:first_body_line]), "".join(lines[first_body_line:])
    return head, body.rstrip("\n") + "\n"


@cache
def stdlib_bodies(n_examples: int = 200) -> ChoiceTask:
    """The ``stdlib_bodies`` task: ``n_examples`` examples, the same on the same
    interpreter."""
    rng = random.Random(_SEED)
    pool: list[tuple[str, str]] = []
    wanted = n_examples * 4
    for record in stdlib_instruction_records(wanted, seed=_SEED):
        parts = _split(record["response"])
        if parts is not None and MIN_BODY_CHARS <= len(parts[1]) <= MAX_BODY_CHARS:
            pool.append(parts)
    by_length = sorted(range(len(pool)), key=lambda i: len(pool[i][1]))
    rank = {index: r for r, index in enumerate(by_length)}
    examples = []
    for index, (head, body) in enumerate(pool[:n_examples]):
        # distractors: bodies of functions near this one in length, none equal to it
        near = by_length[max(0, rank[index] - 12) : rank[index] + 13]
        others = [pool[j][1] for j in near if j != index and pool[j][1] != body]
        distractors = rng.sample(sorted(set(others)), N_CHOICES - 1)
        answer = rng.randrange(N_CHOICES)
        choices = [*distractors[:answer], body, *distractors[answer:]]
        examples.append(ChoiceExample(head, tuple(choices), answer))
    return ChoiceTask(STDLIB_BODIES, tuple(examples), "built-in: standard library")


BUILDERS = {STDLIB_BODIES: stdlib_bodies}


def builtin_task(name: str) -> ChoiceTask:
    """A built-in task by name (see :data:`BUILTIN_TASKS`)."""
    return BUILDERS[name]()
