"""Multiple-choice tasks scored by log-likelihood, with no harness needed.

A choice task is a list of examples, each a context, its choices and the index of the
right one. A model picks the choice of highest log-likelihood after the context:
``acc`` counts how often that is the right one, and ``acc_norm`` does the same after
dividing each log-likelihood by its choice's length in characters (lm-evaluation-
harness's two multiple-choice metrics, computed the same way). A choice is appended to
the context as written: put any space or newline between them in the data.

Tasks come from the built-in corpus (:mod:`recipes_lib.evaluation.builtin`) or from a
JSON-lines file whose records read ``{"context": str, "choices": [str, ...],
"answer": int}``. These are what the in-loop evaluation scores during training and
what a pipeline's evaluation runs without lm-eval installed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from recipes_lib.errors import DataError
from recipes_lib.evaluation.scoring import Request, Score

CHOICE_METRICS = ("acc", "acc_norm")


@dataclass(frozen=True)
class ChoiceExample:
    context: str
    choices: tuple[str, ...]
    answer: int


@dataclass(frozen=True)
class ChoiceTask:
    """A named multiple-choice task; ``source`` says where its examples came from."""

    name: str
    examples: tuple[ChoiceExample, ...]
    source: str

    def head(self, limit: int | None) -> ChoiceTask:
        """The task's first ``limit`` examples (all of them for None)."""
        if limit is None or limit >= len(self.examples):
            return self
        return ChoiceTask(self.name, self.examples[:limit], self.source)


def parse_choice_record(record: object, where: str) -> ChoiceExample:
    """One ``{"context", "choices", "answer"}`` record; ``where`` is its file:line.

    Raises:
        DataError: one line naming ``where`` and the field at fault.
    """
    if not isinstance(record, dict):
        raise DataError(f"{where}: a choice record is a JSON object, got {type(record).__name__}")
    missing = [k for k in ("context", "choices", "answer") if k not in record]
    if missing:
        raise DataError(f"{where}: the record has no field {missing[0]!r}")
    context, choices, answer = record["context"], record["choices"], record["answer"]
    if not isinstance(context, str) or not context:
        raise DataError(f"{where}: field 'context' must be non-empty text")
    if (
        not isinstance(choices, list)
        or len(choices) < 2
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise DataError(f"{where}: field 'choices' must be a list of at least two texts")
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise DataError(
            f"{where}: field 'answer'={answer!r} must be the index of a choice (0 to "
            f"{len(choices) - 1})"
        )
    return ChoiceExample(context, tuple(choices), answer)


def read_choice_file(path: str | Path, name: str | None = None) -> ChoiceTask:
    """A choice task from a JSON-lines file (named after the file unless ``name``).

    Raises:
        DataError: a missing file, a line that is not JSON or a malformed record, named
            as ``file:line``; an empty file.
    """
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"choice task '{file}': no such file")
    examples = []
    with open(file, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{file}:{number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: not a JSON record ({err.msg})") from err
            examples.append(parse_choice_record(record, where))
    if not examples:
        raise DataError(f"choice task '{file}': no records")
    return ChoiceTask(name or file.stem, tuple(examples), str(file))


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> Request:
    """Token ids of a context and its continuation, split as lm-evaluation-harness
    splits them: spaces ending the context move to the continuation, the whole text is
    encoded once, and the continuation is what follows the context's own encoding."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False).ids
    context_ids = tokenizer.encode(context, add_special_tokens=False).ids
    return Request(tuple(context_ids), tuple(whole[len(context_ids) :]))


def choice_requests(task: ChoiceTask, tokenizer: Tokenizer) -> list[Request]:
    """Every (context, choice) pair of the task, example by example."""
    return [
        encode_pair(tokenizer, example.context, choice)
        for example in task.examples
        for choice in example.choices
    ]


def choice_outcomes(task: ChoiceTask, scores: Sequence[Score]) -> list[tuple[bool, bool]]:
    """Per example: (right by log-likelihood, right by length-normalised log-likelihood)."""
    outcomes, at = [], 0
    for example in task.examples:
        part = [s for s, _ in scores[at : at + len(example.choices)]]
        at += len(example.choices)
        normed = [s / len(c) for s, c in zip(part, example.choices, strict=True)]
        best = max(range(len(part)), key=part.__getitem__)
        best_norm = max(range(len(normed)), key=normed.__getitem__)
        outcomes.append((best == example.answer, best_norm == example.answer))
    return outcomes


def choice_metrics(outcomes: Sequence[tuple[bool, bool]]) -> dict[str, float]:
    """``acc`` and ``acc_norm`` of per-example outcomes."""
    n = max(len(outcomes), 1)
    return {
        "acc": sum(a for a, _ in outcomes) / n,
        "acc_norm": sum(b for _, b in outcomes) / n,
    }


def score_choice_task(
    task: ChoiceTask,
    tokenizer: Tokenizer,
    score: Callable[[Sequence[Request]], Sequence[Score]],
) -> dict[str, float]:
    """``acc`` and ``acc_norm`` of a task, with ``score`` the log-likelihood engine
    (``functools.partial(score_requests, model, ...)``)."""
    return choice_metrics(choice_outcomes(task, score(choice_requests(task, tokenizer))))
