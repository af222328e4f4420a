"""What an evaluation runs: :class:`EvalSettings` (no torch here: pipeline specs and
configs import it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from recipes_lib.errors import ConfigError

METRIC_PREFIX = "eval"  # metrics are named eval/<task>/<metric>


@dataclass(frozen=True)
class EvalSettings:
    """What to evaluate and how (``recipes-eval``'s arguments, a stage's ``evaluate``).

    Attributes:
        tasks: task names, ``.jsonl`` files or task folders (see
            :mod:`recipes_lib.evaluation.tasks`).
        task_dirs: folders of lm-eval task YAMLs whose tasks ``tasks`` may name.
        limit: the first examples of each task only (None: all).
        batch_size: the most rows per forward pass.
        batch_tokens: the most padded tokens per forward pass of log-likelihoods.
        num_fewshot: few-shot examples of lm-eval tasks (None: each task's own).
        chat_template: render lm-eval prompts with the model's chat template.
        seed: lm-eval's seeds (few-shot sampling).
    """

    tasks: tuple[str, ...]
    task_dirs: tuple[str, ...] = ()
    limit: int | None = None
    batch_size: int = 256
    batch_tokens: int = 32768
    num_fewshot: int | None = None
    chat_template: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"limit={self.limit} must be at least 1 (or null for all)")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size={self.batch_size} must be at least 1")
        if self.batch_tokens < 1:
            raise ConfigError(f"batch_tokens={self.batch_tokens} must be at least 1")


def flat_metrics(results: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """``{"eval/<task>/<metric>": value}`` of task -> metric -> value: how logs,
    manifests and gates name evaluation results."""
    return {
        f"{METRIC_PREFIX}/{task}/{metric}": value
        for task, metrics in results.items()
        for metric, value in metrics.items()
    }


def evaluation_values(evaluation: Mapping[str, Any] | None) -> dict[str, float]:
    """``eval/<task>/<metric>`` values of a stage manifest's ``evaluation``."""
    return flat_metrics((evaluation or {}).get("results", {}))
