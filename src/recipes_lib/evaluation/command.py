"""``recipes-eval``: evaluate a checkpoint on tasks, print a table, write JSON.

    recipes-eval checkpoint=outputs/pipelines/demo/anneal tasks=stdlib_bodies
    recipes-eval checkpoint=HF_FOLDER tasks=hellaswag,arc_easy limit=500 batch_size=64
    recipes-eval checkpoint=runs/sft/model.safetensors tasks=my_tasks/ chat_template=true \\
        output=results.json

``tasks`` is a comma-separated list of built-in tasks, ``.jsonl`` choice files, task
folders and lm-eval task names (:mod:`recipes_lib.evaluation.tasks`); lm-eval tasks
need ``pip install 'recipes-lib[eval]'``. Every task is checked before the checkpoint
is read; a bad argument, task or checkpoint is one line on stderr and exit status 2.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from recipes_lib.cli_args import dtype_arg, key_value_args, usage, wants_help
from recipes_lib.errors import ConfigError, RecipesError
from recipes_lib.evaluation.run import (
    EvalSettings,
    evaluate_checkpoint,
    print_report,
    write_report,
)

_DEFAULTS: dict[str, Any] = {
    "checkpoint": None,
    "tasks": None,
    "task_dirs": "",
    "limit": None,
    "batch_size": "256",
    "batch_tokens": "32768",
    "num_fewshot": None,
    "chat_template": "false",
    "tokenizer": None,
    "device": "auto",
    "dtype": "auto",
    "output": None,
    "seed": "0",
}
_BOOLS = {"true": True, "false": False, "1": True, "0": False}
_EXAMPLES = (
    "recipes-eval checkpoint=outputs/pipelines/demo/anneal tasks=stdlib_bodies",
    "recipes-eval checkpoint=HF_FOLDER tasks=hellaswag,arc_easy limit=500 batch_size=64",
)


def _optional_int(key: str, value: Any) -> int | None:
    if value in (None, "", "null", "none"):
        return None
    try:
        return int(value)
    except ValueError as err:
        raise ConfigError(f"{key}={value!r} is not a whole number") from err


def _required_int(key: str, value: Any) -> int:
    number = _optional_int(key, value)
    if number is None:
        raise ConfigError(f"{key} needs a whole number")
    return number


def parse_args(argv: Sequence[str]) -> tuple[EvalSettings, dict[str, Any]]:
    """``key=value`` arguments: the evaluation's settings and the rest (checkpoint,
    tokenizer, device, dtype, output).

    Raises:
        ConfigError: an argument without ``=``, an unknown key, a bad value, or no
            ``checkpoint`` or ``tasks``.
    """
    args = key_value_args(argv, _DEFAULTS)
    if not args["checkpoint"]:
        raise ConfigError("checkpoint=PATH is required")
    if not args["tasks"]:
        raise ConfigError("tasks=NAME[,NAME...] is required")
    dtype_arg(args["dtype"])  # a bad name fails here
    chat = str(args["chat_template"]).lower()
    if chat not in _BOOLS:
        raise ConfigError(f"chat_template={args['chat_template']!r} must be true or false")
    split = lambda text: tuple(t.strip() for t in str(text).split(",") if t.strip())  # noqa: E731
    settings = EvalSettings(
        tasks=split(args["tasks"]),
        task_dirs=split(args["task_dirs"]),
        limit=_optional_int("limit", args["limit"]),
        batch_size=_required_int("batch_size", args["batch_size"]),
        batch_tokens=_required_int("batch_tokens", args["batch_tokens"]),
        num_fewshot=_optional_int("num_fewshot", args["num_fewshot"]),
        chat_template=_BOOLS[chat],
        seed=_optional_int("seed", args["seed"]) or 0,
    )
    return settings, args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``recipes-eval``.

    Returns:
        0 (also after printing the usage for ``--help``), or 2 after printing the
        one-line error of a bad argument, task, checkpoint or tokenizer.
    """
    argv = sys.argv[1:] if argv is None else argv
    if wants_help(argv):
        print(usage("recipes-eval", _DEFAULTS, _EXAMPLES, required=["checkpoint", "tasks"]))
        return 0
    try:
        settings, args = parse_args(argv)
        device = args["device"]
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            torch.device(device)
        except RuntimeError as err:
            raise ConfigError(f"device={device!r} is not a device (cpu, cuda, cuda:1)") from err
        dtype = dtype_arg(args["dtype"])
        if dtype is None and device != "cpu":
            dtype = torch.bfloat16
        report = evaluate_checkpoint(
            args["checkpoint"], settings, tokenizer=args["tokenizer"], device=device, dtype=dtype
        )
    except RecipesError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print_report(report, title=f"evaluation of {args['checkpoint']}")
    if args["output"]:
        path = write_report(report, args["output"], checkpoint=str(args["checkpoint"]))
        print(f"results written to {path}")
    return 0


def cli_main() -> None:
    """Entry point of ``recipes-eval``."""
    sys.exit(main())
