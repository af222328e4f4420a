"""Experiment trackers among a run's loggers (``logger=wandb``, ``logger=mlflow``): the
files a run attaches to them, and the end of a tracker's run.

The run's resolved config is attached when a run ends; a pipeline attaches each stage's
manifest, and its report (plots and ``summary.json``) to the last stage's run. W&B takes
them as one artifact per call (kept offline until ``wandb sync`` with
``logger.wandb.offline=true``), MLflow as run artifacts. CSV and TensorBoard keep theirs
in the run folder; they are not trackers here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
TRACKERS = ("WandbLogger", "MLFlowLogger")


def trackers_of(loggers: Iterable[Any]) -> list[Any]:
    """The experiment trackers among ``loggers``."""
    return [logger for logger in loggers if type(logger).__name__ in TRACKERS]


def attach_files(trackers: Sequence[Any], files: Iterable[Path], what: str) -> None:
    """Attach the existing ``files`` to every tracker's run; ``what`` names them (the
    W&B artifact's type: ``config``, ``manifest``, ``report``). Call on rank 0."""
    files = [Path(f) for f in files if Path(f).is_file()]
    if not files:
        return
    for tracker in trackers:
        if type(tracker).__name__ == "WandbLogger":
            import wandb

            run = tracker.experiment
            artifact = wandb.Artifact(f"{what}-{run.id}", type=what)
            for path in files:
                artifact.add_file(str(path))
            run.log_artifact(artifact)
        else:  # MLFlowLogger
            for path in files:
                tracker.experiment.log_artifact(tracker.run_id, str(path), artifact_path=what)
        log.info("attached %s to %s", ", ".join(p.name for p in files), type(tracker).__name__)


def finish(trackers: Sequence[Any]) -> None:
    """End each W&B run (the next stage's logger would otherwise join it); MLflow's
    ends with its trainer."""
    for tracker in trackers:
        if type(tracker).__name__ == "WandbLogger":
            tracker.experiment.finish()
