"""Console-script runs a test signals or lets hang: callbacks they load from this folder
(``PYTHONPATH`` and ``run.allowed_targets``), and the loop that waits for a step and
sends the signal."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import lightning as L

HERE = Path(__file__).resolve().parent
ALLOWED = "run.allowed_targets=[signal_helpers.]"


class SlowSteps(L.Callback):
    """Writes each finished step to ``marker``, then sleeps ``seconds``: the step a test
    reads there is still running when its signal arrives. Each rank writes its process
    id beside it (:func:`rank_pid`)."""

    def __init__(self, marker: str, seconds: float = 0.1):
        self.marker = Path(marker)
        self.seconds = seconds

    def on_train_start(self, trainer, pl_module):
        _pid_file(self.marker, trainer.global_rank).write_text(str(os.getpid()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.marker.write_text(str(trainer.global_step))
        time.sleep(self.seconds)


def _pid_file(marker: Path, rank: int) -> Path:
    return marker.with_name(f"{marker.name}.rank{rank}.pid")


def rank_pid(marker: Path, rank: int) -> int:
    """The process id of ``rank`` of a run whose :class:`SlowSteps` writes ``marker``."""
    return int(_pid_file(marker, rank).read_text())


class HangAt(L.Callback):
    """Stops making progress after optimizer step ``step``, as a rank stuck in a collective."""

    def __init__(self, step: int, seconds: float = 120.0):
        self.step = step
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            time.sleep(self.seconds)


def slow_steps_override(marker: Path, key: str = "callbacks") -> str:
    """The override that adds :class:`SlowSteps` writing to ``marker`` under ``key``."""
    return f"+{key}.slow={{_target_: signal_helpers.SlowSteps, marker: '{marker}'}}"


def env_with_helpers(**extra: str) -> dict[str, str]:
    """This environment with this folder on ``PYTHONPATH`` (and ``extra`` variables)."""
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "HYDRA_FULL_ERROR": "0", **extra}


def signal_at_step(
    command: list[str],
    marker: Path,
    step: int,
    log: Path,
    signum: int = signal.SIGTERM,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.Popen:
    """Run ``command``, send ``signum`` once ``marker`` shows step ``step``, and wait."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            command, env=env or env_with_helpers(), stdout=out, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                try:
                    reached = int(marker.read_text() or 0) >= step
                except (OSError, ValueError):
                    reached = False
                if reached:
                    proc.send_signal(signum)
                    break
                time.sleep(0.02)
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return proc
