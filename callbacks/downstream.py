"""Downstream tasks during training: multiple-choice accuracy every N optimizer steps.

:class:`DownstreamEval` scores a small suite of multiple-choice tasks (built-in ones such
as ``stdlib_bodies``, or ``.jsonl`` choice files) by log-likelihood with the model being
trained, and logs ``eval/<task>/acc`` and ``eval/<task>/acc_norm`` to the run's loggers
at the step, beside the validation loss, with ``eval/seconds`` (what the call cost).

Cost per call: one forward pass, no backward, over every (context, choice) pair of
``limit`` examples per task, in batches of ``batch_size`` rows; only the choices' rows
of logits are formed. ``stdlib_bodies`` has four choices of about 100-250 tokens after a
context of about as many, so 100 examples are 400 rows of up to ~500 tokens: about
100 forward passes' worth of a training micro-batch of 16 x 256 tokens, or a fraction
of a second for a 1B model on one H100 and a few seconds for the tiny model on a CPU
(``eval/seconds`` logs the real figure). Examples are split over the ranks; under
FSDP every rank runs the same number of batches (the model's forward gathers the
weights), and the counts are summed across ranks before logging.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import lightning as L
import torch

from recipes_lib.callbacks.step import OptimizerStepCallback
from recipes_lib.errors import ConfigError

if TYPE_CHECKING:
    from recipes_lib.evaluation.choice import ChoiceTask
    from recipes_lib.models.transformer import Transformer

# recipes_lib.evaluation is imported when the callback is built: the tasks it reads pull
# in the data package, which a run without this callback need not import


class DownstreamEval(OptimizerStepCallback):
    """Scores choice tasks every ``every_n_steps`` optimizer steps (and before the first
    one of a fresh run, with ``at_start``).

    Args:
        tasks: built-in task names or ``.jsonl`` choice files (lm-eval tasks are for
            ``recipes-eval`` and pipeline evaluation; they are refused here).
        every_n_steps: how often, in optimizer steps.
        limit: the first examples of each task (None: all).
        batch_size: rows per forward pass.
        at_start: also score the starting weights before the first step of a fresh run
            (logged at step 0).

    Raises:
        ConfigError: a task that cannot be used in the loop, or bad numbers; named
            when the callback is built, before training.
    """

    def __init__(
        self,
        tasks: Sequence[str],
        every_n_steps: int = 100,
        limit: int | None = 100,
        batch_size: int = 64,
        at_start: bool = True,
    ) -> None:
        super().__init__()
        if every_n_steps < 1:
            raise ConfigError(f"DownstreamEval every_n_steps={every_n_steps} must be >= 1")
        if batch_size < 1 or (limit is not None and limit < 1):
            raise ConfigError("DownstreamEval batch_size and limit must be >= 1")
        from recipes_lib.evaluation.tasks import resolve_tasks

        refs = resolve_tasks([str(t) for t in tasks])
        harness = [r.name for r in refs if r.kind != "choice"]
        if harness:
            raise ConfigError(
                f"DownstreamEval scores built-in and .jsonl choice tasks; {harness[0]!r} is "
                "an lm-eval task: evaluate it with recipes-eval or a pipeline stage's evaluate"
            )
        self.tasks: list[ChoiceTask] = [r.task.head(limit) for r in refs if r.task is not None]
        self.every_n_steps = every_n_steps
        self.batch_size = batch_size
        self.at_start = at_start

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if self.at_start and trainer.ckpt_path is None:
            self.evaluate(trainer, pl_module)

    def on_optimizer_step_end(self, trainer: L.Trainer, pl_module: L.LightningModule, step: int):
        if step % self.every_n_steps == 0:
            self.evaluate(trainer, pl_module)

    # --------------------------------------------------------------- scoring
    def _rank_share(self, trainer: L.Trainer, task: ChoiceTask) -> tuple[ChoiceTask, int, int]:
        """This rank's examples, how many of its requests count, and how many requests
        every rank scores (the most any rank has: the rest repeat its first one).

        Under a sharded model every forward pass is a collective, so every rank must run
        as many: the same number of requests, in batches of rows only (no token budget,
        which would depend on each rank's lengths)."""
        rank, world = trainer.global_rank, trainer.world_size
        mine = task.examples[rank::world]
        requests = [sum(len(e.choices) for e in task.examples[r::world]) for r in range(world)]
        return dataclasses.replace(task, examples=mine), requests[rank], max(requests)

    @torch.no_grad()
    def evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, float]:
        """Score every task now and log it; returns what was logged."""
        from recipes_lib.evaluation.choice import choice_outcomes, choice_requests
        from recipes_lib.evaluation.scoring import DEFAULT_BATCH_TOKENS, score_requests

        start = time.perf_counter()
        # Lightning's data connector sets Trainer.datamodule, which the class does not declare
        tokenizer = trainer.datamodule.tokenizer  # type: ignore[attr-defined]
        model = cast("Transformer", pl_module.model)  # the policy the objective's module trains
        metrics: dict[str, float] = {}
        for task in self.tasks:
            share, counted, rows = self._rank_share(trainer, task)
            requests = choice_requests(share, tokenizer)
            requests += requests[:1] * (rows - counted)  # as many as every other rank
            with trainer.precision_plugin.forward_context():
                scores = score_requests(
                    model,
                    requests,
                    batch_size=self.batch_size,
                    max_tokens=None if trainer.world_size > 1 else DEFAULT_BATCH_TOKENS,
                    greedy=False,  # through the model's forward: a sharded model gathers
                )
            outcomes = choice_outcomes(share, scores[:counted])
            totals = torch.tensor(
                [sum(a for a, _ in outcomes), sum(b for _, b in outcomes), len(outcomes)],
                dtype=torch.float64,
                device=pl_module.device,
            )
            totals = trainer.strategy.reduce(totals, reduce_op="sum")
            right, right_norm, n = totals.tolist()
            metrics[f"eval/{task.name}/acc"] = right / n
            metrics[f"eval/{task.name}/acc_norm"] = right_norm / n
        metrics["eval/seconds"] = time.perf_counter() - start
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        return metrics
