"""The built-in verifiable task, ``builtin: stdlib_grpo``, made from the standard library.

Each record asks for one documented standard-library function, with the instruction of
``stdlib_sft`` (its signature and docstring), so a model after SFT on ``stdlib_sft``
answers in the expected form. A completion is checked by parsing it (``defines_function``
of :mod:`recipes_lib.rewards`): it must be Python that defines a function, and the one
asked for; that needs no reference answer, no network and no code execution. A short
run of GRPO from the demo pipeline's SFT weights raises the share of completions that do.
"""

from __future__ import annotations

from typing import Any

from recipes_lib.data.chat.instructions import stdlib_instruction_records


def stdlib_task_records(max_records: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """Records ``{"prompt", "name", "source"}``: the instruction of a standard-library
    function and the name its completion must define (as ``stdlib_sft`` picks them)."""
    return [
        {
            "prompt": record["prompt"],
            "name": record["source"].rsplit(":", 1)[1].rsplit(".", 1)[-1],
            "source": record["source"],
        }
        for record in stdlib_instruction_records(max_records, seed)
    ]
