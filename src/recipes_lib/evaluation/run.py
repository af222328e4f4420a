"""Evaluate a model on tasks: the one entry behind ``recipes-eval``, a pipeline's
evaluation and the benchmarks.

:func:`evaluate_checkpoint` resolves the tasks first (every bad name, folder or record
is refused before a weight is read), loads the checkpoint and its tokenizer (a stage
folder, manifest, ``.safetensors`` or ``.ckpt``, or a Hugging Face folder: what
``recipes-generate`` reads), then scores the native tasks itself and hands the lm-eval
tasks to lm-evaluation-harness through :class:`~recipes_lib.evaluation.harness.RecipesLM`.
Results are ``eval/<task>/<metric>`` values, printed as a table and written as JSON.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from rich.console import Console
from rich.table import Table

from recipes_lib.checkpoint.hf_tokenizer import read_json, token_text
from recipes_lib.errors import ConfigError
from recipes_lib.evaluation.choice import score_choice_task
from recipes_lib.evaluation.scoring import score_requests
from recipes_lib.evaluation.settings import EvalSettings, flat_metrics
from recipes_lib.evaluation.tasks import EVAL_EXTRA, TaskRef, resolve_tasks
from recipes_lib.files import write_json_atomic

if TYPE_CHECKING:
    from recipes_lib.models.transformer import Transformer


@dataclass
class EvalReport:
    """Results: task -> metric -> value, how many examples each native task scored,
    and the seconds the scoring took."""

    results: dict[str, dict[str, float]]
    examples: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def flat(self) -> dict[str, float]:
        """``{"eval/<task>/<metric>": value}``: how logs, manifests and gates name them."""
        return flat_metrics(self.results)

    def to_json(self) -> dict[str, Any]:
        return {"results": self.results, "examples": self.examples, "seconds": self.seconds}


def evaluate_model(
    model: Transformer,
    tokenizer: Any,
    eos_ids: Sequence[int],
    refs: Sequence[TaskRef],
    settings: EvalSettings,
    *,
    prefix_id: int | None = None,
    chat_template: str | None = None,
) -> EvalReport:
    """Evaluate a loaded model on resolved tasks (see :func:`resolve_tasks`)."""
    start = time.perf_counter()
    results: dict[str, dict[str, float]] = {}
    examples: dict[str, int] = {}
    score = partial(
        score_requests, model, batch_size=settings.batch_size, max_tokens=settings.batch_tokens
    )
    for ref in refs:
        if ref.kind == "choice" and ref.task is not None:
            task = ref.task.head(settings.limit)
            results[ref.name] = score_choice_task(task, tokenizer, score)
            examples[ref.name] = len(task.examples)
    harness = [r for r in refs if r.kind == "lm_eval"]
    if harness:
        try:
            from recipes_lib.evaluation.harness import RecipesLM, build_lm_eval_tasks, run_lm_eval
        except ImportError as err:
            raise ConfigError(f"lm-eval tasks need lm-evaluation-harness: {EVAL_EXTRA}") from err
        built: list[Any] = []
        for folder in dict.fromkeys(r.folder for r in harness):
            names = [r.name for r in harness if r.folder == folder]
            built += list(build_lm_eval_tasks(names, folder).values())
        lm = RecipesLM(
            model,
            tokenizer,
            eos_ids,
            prefix_id=prefix_id,
            chat_template=chat_template,
            batch_size=settings.batch_size,
            max_tokens=settings.batch_tokens,
        )
        results.update(
            run_lm_eval(
                lm,
                built,
                limit=settings.limit,
                num_fewshot=settings.num_fewshot,
                chat_template=settings.chat_template,
                seed=settings.seed,
            )
        )
    return EvalReport(results, examples, time.perf_counter() - start)


def prefix_id_of(loaded: Any) -> int | None:
    """The BOS id of a Hugging Face folder that names one (lm-eval's prefix token)."""
    if loaded.kind != "hf":
        return None
    bos = token_text(read_json(Path(loaded.source) / "tokenizer_config.json").get("bos_token"))
    return loaded.tokenizer.token_to_id(bos) if bos else None


def evaluate_checkpoint(
    checkpoint: str | Path,
    settings: EvalSettings,
    *,
    tokenizer: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> EvalReport:
    """Resolve the tasks, then load ``checkpoint`` and evaluate it.

    Raises:
        RecipesError: a bad task (before loading), a checkpoint or tokenizer that cannot
            be read.
    """
    from recipes_lib.generate import load_for_generation

    refs = resolve_tasks(settings.tasks, settings.task_dirs)
    loaded = load_for_generation(checkpoint, tokenizer, device=device, dtype=dtype)
    return evaluate_model(
        cast("Transformer", loaded.model),  # the transformers fallback answers the same calls
        loaded.tokenizer,
        loaded.eos_ids,
        refs,
        settings,
        prefix_id=prefix_id_of(loaded),
        chat_template=loaded.chat_template,
    )


def results_table(report: EvalReport, title: str = "evaluation") -> Table:
    table = Table(title=title)
    for column in ("task", "metric", "value", "examples"):
        table.add_column(column)
    for task, metrics in report.results.items():
        for metric, value in metrics.items():
            shown = str(report.examples[task]) if task in report.examples else "-"
            table.add_row(task, metric, f"{value:.4f}", shown)
    return table


def print_report(report: EvalReport, console: Console | None = None, title: str = "evaluation"):
    (console or Console()).print(results_table(report, title))


def write_report(report: EvalReport, path: str | Path, **extra: Any) -> Path:
    """The report as JSON (``extra`` keys beside it, e.g. the checkpoint evaluated)."""
    target = Path(path).expanduser()
    write_json_atomic(target, {**extra, **report.to_json()})
    return target
