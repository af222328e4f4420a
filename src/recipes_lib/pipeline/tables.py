"""What a pipeline prints: its plan before anything runs, and the summary table after.

The summary shows, per stage, the train loss from the first to the last logged step,
the held-out metrics from the first to the last validation, and what it measured after
training (its evaluation, each gate's outcome, a promote stage's choice).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from recipes_lib.pipeline.report import HELD_OUT_METRICS, PREFERENCE_METRICS, RL_METRICS
from recipes_lib.pipeline.spec import PipelineSpec
from recipes_lib.pipeline.stage_plan import StagePlan


def print_plan(pipeline: PipelineSpec, plans: Sequence[StagePlan], console: Console | None = None):
    """The plan as a Rich table: stage, recipe, init, source, action and why."""
    table = Table(title=f"pipeline {pipeline.name}: {pipeline.dir}")
    for column in ("stage", "recipe", "init", "from", "action", "reason"):
        table.add_column(column)
    for plan in plans:
        source = plan.source_stage or (plan.source_file.label if plan.source_file else "-")
        recipe, init = plan.spec.recipe, plan.spec.init
        if not plan.spec.trains:  # eval: its source; promote: the best of its candidates
            recipe, init, source = f"({plan.spec.kind})", "-", ", ".join(plan.sources)
        table.add_row(plan.spec.name, recipe, init, source, plan.action, plan.reason)
    console = console or Console(width=max(Console().width, 120))
    console.print(table)


def _fmt(value: float | None, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def _fmt_tokens(tokens: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if tokens >= size:
            return f"{tokens / size:.2f}{unit}"
    return str(tokens)


def _change(first: float | None, last: float | None, spec: str = ".3f") -> str:
    return f"{_fmt(first, spec)} → {_fmt(last, spec)}"


def _held_out_text(held_out: dict[str, dict[str, Any]], val_loss: float | None) -> str:
    """``loss 2.512 → 1.873``, or for a preference stage ``accuracy 0.00 → 0.81,
    margin 0.00 → 0.42``, or for an RL stage ``reward 0.06 → 0.41``; the last validation
    loss alone when only that is known."""
    names = (
        [n for n in PREFERENCE_METRICS if n in held_out]
        or [n for n in RL_METRICS if n in held_out]
        or [n for n in ("val/loss",) if n in held_out]
    )
    if not names:
        return f"loss {_fmt(val_loss)}" if val_loss is not None else "-"
    parts = []
    for name in names:
        spec = ".3f" if name == "val/loss" else ".2f"
        change = held_out[name]
        parts.append(f"{HELD_OUT_METRICS[name]} {_change(change['first'], change['last'], spec)}")
    return ", ".join(parts)


def _decision_text(summary: dict[str, Any]) -> str:
    """``stdlib_bodies acc 0.412 acc_norm 0.455; gates passed 2/2``, a promote stage's
    choice, or ``-``."""
    parts = []
    by_task: dict[str, list[str]] = {}
    for name, value in (summary.get("evaluation") or {}).items():
        _, task, metric = name.split("/", 2)
        by_task.setdefault(task, []).append(f"{metric} {_fmt(value)}")
    parts += [f"{task} {' '.join(metrics)}" for task, metrics in by_task.items()]
    promotion = summary.get("promotion")
    if promotion:
        scores = promotion["candidates"]
        parts.append(
            f"promoted {promotion['winner']} by {promotion['by']} ("
            + ", ".join(f"{n} {_fmt(v)}" for n, v in scores.items())
            + ")"
        )
    gates = summary.get("gates") or []
    failed = [g for g in gates if not g["passed"]]
    if failed:
        g = failed[0]
        parts.append(f"gate {g['metric']} {_fmt(g['value'])} {g['condition']}: FAILED")
    elif gates:
        parts.append(f"gates passed {len(gates)}/{len(gates)}")
    return "; ".join(parts) or "-"


def print_summary_table(
    pipeline: str, stages: list[dict[str, Any]], console: Console | None = None
):
    """The per-stage summary as a Rich table on stdout: the train loss from the first to
    the last logged step, and the held-out metrics from the first to the last
    validation (the loss; accuracy and reward margin for a preference stage)."""
    table = Table(title=f"pipeline {pipeline}")
    for column, justify in (
        ("stage", "left"),
        ("recipe", "left"),
        ("status", "left"),
        ("steps", "right"),
        ("train loss", "right"),
        ("held-out: first → last validation", "left"),
        ("evaluation · gates", "left"),
        ("tokens", "right"),
        ("time", "right"),
    ):
        # fold a long name onto a second line rather than cut it, on a narrow terminal
        table.add_column(column, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for s in stages:
        table.add_row(
            s["stage"],
            s["recipe"],
            s["status"],
            str(s["steps"]),
            _change(s["train_loss_start"], s["train_loss_end"]),
            _held_out_text(s.get("held_out") or {}, s.get("val_loss")),
            _decision_text(s),
            _fmt_tokens(int(s["tokens"])),
            f"{s['seconds']:.1f}s",
        )
    if console is None:
        # a terminal's own width (Rich wraps the cells); a file or pipe gets room for
        # every column on one line
        console = Console()
        if not console.is_terminal:
            console = Console(width=max(console.width, 132))
    console.print(table)
