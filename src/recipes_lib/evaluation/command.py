"""``recipes-eval``: evaluate a checkpoint on tasks, print a table, write JSON (its keys:
:class:`~recipes_lib.config.commands.EvalConfig`).

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

import torch

from recipes_lib.config.commands import EvalConfig
from recipes_lib.errors import ConfigError
from recipes_lib.evaluation.run import (
    EvalSettings,
    evaluate_checkpoint,
    print_report,
    write_report,
)


def command(cfg: EvalConfig) -> None:
    """The body of ``recipes-eval`` (a Hydra app in :mod:`recipes_lib.cli`): print the
    table, and write the JSON to ``cfg.output`` when it is set.

    Raises:
        RecipesError: a bad setting, task, checkpoint or tokenizer.
    """
    settings = EvalSettings(
        tasks=tuple(cfg.tasks),
        task_dirs=tuple(cfg.task_dirs),
        limit=cfg.limit,
        batch_size=cfg.batch_size,
        batch_tokens=cfg.batch_tokens,
        num_fewshot=cfg.num_fewshot,
        chat_template=cfg.chat_template,
        seed=cfg.seed,
    )
    if not settings.tasks:
        raise ConfigError("tasks: required; pass tasks=NAME[,NAME...]")
    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch.device(device)
    except RuntimeError as err:
        raise ConfigError(f"device={device!r} is not a device (cpu, cuda, cuda:1)") from err
    dtype = cfg.dtype.torch_dtype()
    if dtype is None and device != "cpu":
        dtype = torch.bfloat16
    report = evaluate_checkpoint(
        cfg.checkpoint, settings, tokenizer=cfg.tokenizer, device=device, dtype=dtype
    )
    print_report(report, title=f"evaluation of {cfg.checkpoint}")
    if cfg.output:
        path = write_report(report, cfg.output, checkpoint=cfg.checkpoint)
        print(f"results written to {path}")
