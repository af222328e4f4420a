"""A pipeline's report: a summary table per stage and ``<dir>/report/`` with plots.

Each stage's CSV logs (``<stage>/logs/version_*/metrics.csv``; a resumed run adds a
version) are read, a later version's value winning for a step logged twice, and laid
end to end on one axis of pipeline steps: a stage that continues its source's step
counter (``init: full``) starts where its source ended, every other stage after the
previous stage's last step. The report folder holds ``loss.png`` (train and
validation loss), ``lr.png`` (learning rate), ``throughput.png`` (tokens per second),
for a pipeline with a preference stage (DPO) ``preference.png`` (preference accuracy
and reward margin, each on its own axes), for a pipeline that evaluates
``evaluation.png`` (downstream metrics in the loop and after each stage), and
``summary.json``.

Each stage's entry in the summary also says what it changed on held-out data: its
validation loss and, for a preference stage, its reward accuracy and margin, at its
first and at its last validation (:func:`held_out_changes`).
"""

from __future__ import annotations

import csv
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recipes_lib.checkpoint.layout import RunDir
from recipes_lib.checkpoint.manifest import StageManifest
from recipes_lib.evaluation.settings import evaluation_values
from recipes_lib.files import write_atomic, write_json_atomic

# held-out metrics compared at a stage's first and last validation, by short name
HELD_OUT_METRICS = {
    "val/loss": "loss",
    "val/rewards/accuracy": "accuracy",
    "val/rewards/margin": "margin",
    "val/reward": "reward",
}
PREFERENCE_METRICS = ("val/rewards/accuracy", "val/rewards/margin")
RL_METRICS = ("val/reward",)  # an RL stage's (GRPO's) mean held-out reward
PLOTS = {
    "loss.png": ("loss", ("train/loss", "val/loss")),
    "lr.png": ("learning rate", ("train/lr/",)),
    "throughput.png": ("tokens / s", ("perf/tokens_per_sec",)),
}
# preference.png, for preference stages: one axes per (y label, metrics)
PREFERENCE_PLOT = "preference.png"
# evaluation.png, for pipelines that evaluate: downstream metrics in the loop and after
EVALUATION_PLOT = "evaluation.png"
PREFERENCE_PANELS = (
    ("preference accuracy", ("train/rewards/accuracy", "val/rewards/accuracy")),
    ("reward margin", ("train/rewards/margin", "val/rewards/margin")),
)


@dataclass
class StageSeries:
    """Logged values of one stage: metric name -> [(step, value)], sorted by step."""

    stage: str
    start_step: int
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def first(self, name: str) -> float | None:
        values = self.series.get(name)
        return values[0][1] if values else None

    def last(self, name: str) -> float | None:
        values = self.series.get(name)
        return values[-1][1] if values else None


def held_out_changes(series: StageSeries) -> dict[str, dict[str, float | int]]:
    """Each held-out metric the stage logged (:data:`HELD_OUT_METRICS`) at its first
    and its last validation: ``{name: {"first", "first_step", "last", "last_step"}}``.

    A stage validated before its first step (``recipes_lib.callbacks.ValidateAtStart``)
    has its starting weights as ``first``; otherwise ``first`` is its first validation.
    """
    changes: dict[str, dict[str, float | int]] = {}
    for name in HELD_OUT_METRICS:
        values = series.series.get(name)
        if values:
            (first_step, first), (last_step, last) = values[0], values[-1]
            changes[name] = {
                "first": first,
                "first_step": first_step,
                "last": last,
                "last_step": last_step,
            }
    return changes


def _version(path: Path) -> int:
    match = re.search(r"version_(\d+)$", path.parent.name)
    return int(match.group(1)) if match else -1


def read_stage_logs(stage_dir: Path, stage: str, start_step: int = 0) -> StageSeries:
    """Every metric a stage logged to CSV, later log versions overriding earlier ones."""
    by_metric: dict[str, dict[int, float]] = {}
    files = sorted(RunDir(stage_dir).logs.glob("version_*/metrics.csv"), key=_version)
    for path in files:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                step_text = row.get("step")
                if not step_text:
                    continue
                step = int(float(step_text))
                for name, text in row.items():
                    if name in ("step", "epoch") or not text:
                        continue
                    try:
                        value = float(text)
                    except ValueError:
                        continue
                    by_metric.setdefault(name, {})[step] = value
    series = {name: sorted(values.items()) for name, values in by_metric.items()}
    return StageSeries(stage=stage, start_step=start_step, series=series)


def _matching(series: StageSeries, prefix: str) -> list[str]:
    """``prefix`` if it was logged; for a ``.../`` prefix, the first name under it (one
    learning rate per stage: the parameter groups share the schedule)."""
    if prefix.endswith("/"):
        return sorted(n for n in series.series if n.startswith(prefix))[:1]
    return [prefix] if prefix in series.series else []


def _stage_offsets(stages: Sequence[StageSeries]) -> list[int]:
    """Where each stage starts on the pipeline's step axis (stages laid end to end)."""
    offsets: list[int] = []
    position = 0
    for series in stages:
        offsets.append(position)
        steps = [s for values in series.series.values() for s, _ in values]
        length = (max(steps) + 1 - series.start_step) if steps else 0
        position += max(length, 0)
    return offsets


def _draw_panel(
    ax: Any,
    stages: Sequence[StageSeries],
    offsets: Sequence[int],
    colors: Sequence[str],
    prefixes: Sequence[str],
    ylabel: str,
) -> None:
    """One axes: every stage's ``prefixes`` metrics on the pipeline's step axis in the
    stage's color (validation dashed with markers), a dotted line where each later
    stage starts."""
    plotted = False
    for index, (series, offset, color) in enumerate(zip(stages, offsets, colors, strict=True)):
        for prefix in prefixes:
            for name in _matching(series, prefix):
                points = series.series[name]
                is_val = name.startswith("val/")
                ax.plot(
                    [offset + step - series.start_step for step, _ in points],
                    [value for _, value in points],
                    marker="o" if is_val else None,
                    linestyle="--" if is_val else "-",
                    color=color,
                    label=f"{series.stage} {name}",
                )
                plotted = True
        if index > 0:
            ax.axvline(offset, color="grey", linestyle=":", linewidth=1)
    if plotted:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "nothing logged", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def _save(fig: Any, path: Path) -> Path:
    return write_atomic(
        path, lambda tmp: fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
    )


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _stage_colors(plt: Any, count: int) -> list[str]:
    """One color per stage, the same in every plot."""
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return [cycle[i % len(cycle)] for i in range(count)]


def preference_figure(stages: Sequence[StageSeries]) -> Any | None:
    """The preference stages' panels: accuracy and reward margin, each on its own axes
    over the pipeline's steps (training solid, held-out dashed); None without any.

    Accuracy is a share in [0, 1], the margin a difference of log-ratios that grows
    without bound: on one y-axis one of them would be flattened.
    """
    plt = _pyplot()
    wanted = {name for _, names in PREFERENCE_PANELS for name in names}
    shown = [i for i, series in enumerate(stages) if wanted & series.series.keys()]
    if not shown:
        return None
    offsets, colors = _stage_offsets(stages), _stage_colors(plt, len(stages))
    shown_stages = [stages[i] for i in shown]
    shown_offsets, shown_colors = [offsets[i] for i in shown], [colors[i] for i in shown]
    fig, axes = plt.subplots(len(PREFERENCE_PANELS), 1, figsize=(8, 7), sharex=True)
    for ax, (ylabel, names) in zip(axes, PREFERENCE_PANELS, strict=True):
        _draw_panel(ax, shown_stages, shown_offsets, shown_colors, names, ylabel)
    axes[0].set_ylim(-0.05, 1.05)
    axes[1].axhline(0.0, color="grey", linewidth=1)
    axes[0].set_title("preference stages: training (solid) and held-out (dashed)")
    axes[-1].set_xlabel("pipeline step")
    return fig


def evaluation_figure(
    stages: Sequence[StageSeries], evaluations: Sequence[dict[str, float]]
) -> Any | None:
    """Downstream metrics over the pipeline's steps: what a stage scored in its loop
    (``eval/...`` logged by ``DownstreamEval``: lines) and its evaluation when done
    (markers at its last step); None when nothing was evaluated."""
    logged = [
        sorted(n for n in s.series if n.startswith("eval/") and n != "eval/seconds") for s in stages
    ]
    if not any(logged) and not any(evaluations):
        return None
    plt = _pyplot()
    offsets, colors = _stage_offsets(stages), _stage_colors(plt, len(stages))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ends = [*offsets[1:], None]
    for series, names, evaluation, offset, end, color in zip(
        stages, logged, evaluations, offsets, ends, colors, strict=True
    ):
        for name in names:
            points = series.series[name]
            ax.plot(
                [offset + step - series.start_step for step, _ in points],
                [value for _, value in points],
                color=color,
                linestyle="-" if name.endswith("/acc") else ":",
                label=f"{series.stage} {name} (in the loop)",
            )
        x = (
            end
            if end is not None
            else offset
            + max(
                (
                    step - series.start_step
                    for values in series.series.values()
                    for step, _ in values
                ),
                default=0,
            )
        )
        for name, value in sorted(evaluation.items()):
            marker = "o" if name.endswith("/acc") else "s"
            ax.scatter([x], [value], color=color, marker=marker, label=f"{series.stage} {name}")
    ax.set_xlabel("pipeline step")
    ax.set_ylabel("downstream metric")
    ax.set_title("downstream evaluation: in the loop (lines) and after each stage (markers)")
    ax.legend(fontsize="x-small")
    ax.grid(alpha=0.3)
    return fig


def write_plots(
    stages: Sequence[StageSeries],
    out_dir: Path,
    evaluations: Sequence[dict[str, float]] | None = None,
) -> list[Path]:
    """Write the loss, learning-rate and throughput plots, and ``preference.png``
    (:func:`preference_figure`) when a stage logged preference metrics; returns their paths.

    A plot of :data:`PLOTS` with nothing logged (e.g. a run without the throughput
    callback) still gets its file, saying so, so the report's layout does not depend on
    the callbacks; the preference panels belong to preference stages (DPO) only.
    """
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    offsets, colors = _stage_offsets(stages), _stage_colors(plt, len(stages))
    written = []
    for filename, (ylabel, prefixes) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(8, 4.5))
        _draw_panel(ax, stages, offsets, colors, prefixes, ylabel)
        ax.set_xlabel("pipeline step")
        ax.set_title(f"{ylabel} by stage")
        written.append(_save(fig, out_dir / filename))
        plt.close(fig)
    fig = preference_figure(stages)
    if fig is not None:
        written.append(_save(fig, out_dir / PREFERENCE_PLOT))
        plt.close(fig)
    fig = evaluation_figure(stages, evaluations or [{} for _ in stages])
    if fig is not None:
        written.append(_save(fig, out_dir / EVALUATION_PLOT))
        plt.close(fig)
    return written


def stage_summary(
    manifest: StageManifest,
    status: str,
    manifest_path: Path,
    init: str,
    source: str | None,
    held_out: dict[str, dict[str, float | int]] | None = None,
) -> dict[str, Any]:
    """One stage's entry of ``summary.json``; ``held_out`` is :func:`held_out_changes`."""
    m = manifest.metrics
    return {
        "stage": manifest.stage,
        "recipe": manifest.recipe,
        "status": status,
        "init": init,
        "from": source,
        "start_step": manifest.start_step,
        "global_step": manifest.global_step,
        "steps": m.steps,
        "tokens": m.tokens,
        "seconds": m.seconds,
        "train_loss_start": m.train_loss_start,
        "train_loss_end": m.train_loss_end,
        "val_loss": m.val_loss,
        "val_ppl": m.val_ppl,
        "held_out": held_out or {},
        "evaluation": evaluation_values(manifest.evaluation),
        "gates": manifest.gates,
        "promotion": manifest.promotion,
        "last_lr": manifest.last_lr,
        "weights": str(manifest.weights_path),
        "manifest": str(manifest_path),
    }


def write_summary(
    path: Path, pipeline: str, directory: Path, stages: list[dict[str, Any]], plots: list[Path]
) -> Path:
    """``summary.json``: the pipeline, one entry per stage and the plots, atomically."""
    data = {
        "pipeline": pipeline,
        "dir": str(directory),
        "stages": stages,
        "plots": [p.name for p in plots],
    }
    return write_json_atomic(path, data, default=_json_number)


def _json_number(value: Any) -> Any:
    return str(value)
