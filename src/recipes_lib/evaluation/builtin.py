"""Built-in evaluation tasks, made from the embedded standard-library corpus.

``stdlib_bodies``: which of four bodies is the real one of a documented function? The
context is a function's ``def`` line and docstring, as written in the standard
library; the choices are its own body, the same lines in two other orders (one
shuffled, one reversed) and the body of another function of similar length, in an
order a fixed seed picks. Chance is 0.25. Telling the real order from the reordered
ones takes knowing how code reads (definitions before uses, ``return`` last, blocks
after their headers); telling it from the other function's body takes reading the
signature and the docstring (argument names, what it says it returns). The tiny
demo model learns the first within its 300 pretraining steps, not the second.

The functions are those the built-in instruction data is made from (``builtin:
stdlib_sft``), in another order, so a model trained on the corpus may have seen some
of them: the task measures what a model learned of the library's code, not
generalisation to code it never saw.
"""

from __future__ import annotations

import random
from functools import cache

from recipes_lib.data.chat.instructions import documented_function, stdlib_instruction_records
from recipes_lib.evaluation.choice import ChoiceExample, ChoiceTask

STDLIB_BODIES = "stdlib_bodies"
BUILTIN_TASKS = (STDLIB_BODIES,)
N_CHOICES = 4
MIN_BODY_CHARS, MAX_BODY_CHARS = 40, 400
MIN_BODY_LINES = 3  # two other orders of its lines
_SEED = 1  # not the instruction data's order (seed 0)


def _split(source: str) -> tuple[str, str] | None:
    """(``def`` line and docstring, body) of one documented function's source, or None
    (:func:`~recipes_lib.data.chat.instructions.documented_function`)."""
    found = documented_function(source)
    if found is None:
        return None
    lines = source.splitlines(keepends=True)
    head, body = "".join(lines[: found[1]]), "".join(lines[found[1] :])
    return head, body.rstrip("\n") + "\n"


def _reordered(body: str, rng: random.Random) -> tuple[str, str] | None:
    """The body's lines shuffled (not in their order nor reversed) and reversed; None
    when the lines cannot give two other distinct texts."""
    lines = body.rstrip("\n").splitlines()
    original, backwards = list(range(len(lines))), list(reversed(range(len(lines))))
    order = original
    for _ in range(20):
        rng.shuffle(order := list(order))
        if order not in (original, backwards):
            break
    texts = ["\n".join(lines[i] for i in o) + "\n" for o in (order, backwards)]
    if len({body, *texts}) < 3:
        return None
    return texts[0], texts[1]


@cache
def stdlib_bodies(n_examples: int = 200) -> ChoiceTask:
    """The ``stdlib_bodies`` task: ``n_examples`` examples, the same on the same
    interpreter."""
    rng = random.Random(_SEED)
    pool: list[tuple[str, str]] = []
    wanted = n_examples * 4
    for record in stdlib_instruction_records(wanted, seed=_SEED):
        parts = _split(record["response"])
        if (
            parts is not None
            and MIN_BODY_CHARS <= len(parts[1]) <= MAX_BODY_CHARS
            and len(parts[1].splitlines()) >= MIN_BODY_LINES
        ):
            pool.append(parts)
    by_length = sorted(range(len(pool)), key=lambda i: len(pool[i][1]))
    rank = {index: r for r, index in enumerate(by_length)}
    examples = []
    for index, (head, body) in enumerate(pool):
        reordered = _reordered(body, rng)
        if reordered is None:
            continue
        # the other function: one near this one in length, with a different body
        near = by_length[max(0, rank[index] - 12) : rank[index] + 13]
        others = sorted({pool[j][1] for j in near if j != index} - {body, *reordered})
        if not others:
            continue
        distractors = [*reordered, rng.choice(others)]
        rng.shuffle(distractors)
        answer = rng.randrange(N_CHOICES)
        choices = [*distractors[:answer], body, *distractors[answer:]]
        examples.append(ChoiceExample(head, tuple(choices), answer))
        if len(examples) == n_examples:
            break
    return ChoiceTask(STDLIB_BODIES, tuple(examples), "built-in: standard library")


BUILDERS = {STDLIB_BODIES: stdlib_bodies}


def builtin_task(name: str) -> ChoiceTask:
    """A built-in task by name (see :data:`BUILTIN_TASKS`)."""
    return BUILDERS[name]()
