"""A watchdog that ends a run whose training has stopped moving.

A run can hang without failing: one rank waits in a collective that another never
joins (a rank that died, took another branch, or is stuck in I/O), a data-loader
worker deadlocks, a file system stops answering. Nothing raises; the job burns its
allocation until the scheduler kills it, and says nothing about where it stood.

:class:`HangWatchdog` runs a daemon thread beside training. Every batch that ends,
training or validation, and every checkpoint save that starts counts as progress; if
none comes for ``minutes``, the thread writes the Python stack of every thread of the
process to stderr and to ``stacks_file`` (``{rank}`` filled in) and ends the process
with :data:`EXIT_HUNG`. It has to be ``os._exit``: the main thread is the one that is
stuck. Every rank runs its own, so each leaves its stacks, and the one that differs
shows where the hang is. The watch starts with the first training step (the sanity
check, data preparation and model building before it are not watched) and ends with
training.

``minutes`` must cover the slowest single piece of progress: the first step (with
compilation), one validation batch, one checkpoint save. A hang that holds the GIL (a
C extension that never releases it) stops this thread too; what torch waits on, the
GPU and collectives, releases it.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

# as timeout(1) exits when its command runs too long
EXIT_HUNG = 124


class HangWatchdog(Callback):
    """Dumps every thread's stack and exits when no training progress is seen in time.

    Args:
        minutes: how long training may go without progress; None turns the watch off.
        stacks_file: where the stacks go besides stderr, ``{rank}`` replaced by the
            global rank; None: stderr only.
    """

    def __init__(self, minutes: float | None = 30.0, stacks_file: str | None = None):
        if minutes is not None and minutes <= 0:
            raise ValueError(f"minutes={minutes} must be positive (or null to turn it off)")
        self.minutes = minutes
        self.stacks_file = stacks_file
        self._last_progress = time.monotonic()
        self._step = 0
        self._rank = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._exit = os._exit  # tests replace it

    @property
    def timeout_s(self) -> float | None:
        return self.minutes * 60.0 if self.minutes is not None else None

    # ------------------------------------------------------------- progress
    def _progress(self, trainer: L.Trainer) -> None:
        self._last_progress = time.monotonic()
        self._step = trainer.global_step

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._progress(trainer)

    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: Any,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._progress(trainer)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: Any, checkpoint: Any) -> None:
        self._progress(trainer)  # the save that follows gets the whole timeout

    # ---------------------------------------------------------- the thread
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.timeout_s is None:
            return
        self._stop_watching()
        self._rank = trainer.global_rank
        self._progress(trainer)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name="recipes-hang-watchdog", daemon=True
        )
        self._thread.start()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._stop_watching()

    def on_exception(self, trainer: L.Trainer, pl_module: Any, exception: BaseException) -> None:
        self._stop_watching()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._stop_watching()

    def _stop_watching(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def _watch(self) -> None:
        timeout = self.timeout_s
        assert timeout is not None
        poll = min(max(timeout / 10, 0.05), 10.0)
        while not self._stop.wait(poll):
            if time.monotonic() - self._last_progress > timeout:
                self._fire()
                return

    def _fire(self) -> None:
        """Stacks to stderr and the file, then exit; without locks the stuck thread may
        hold (no logging, no buffered streams)."""
        message = (
            f"error: no training progress for {self.minutes:g} minutes (rank {self._rank}, "
            f"after step {self._step}): the run looks hung; the Python stack of every thread "
            f"follows; exiting with status {EXIT_HUNG}\n"
        )
        targets = [sys.__stderr__.fileno() if sys.__stderr__ is not None else 2]
        stacks = None
        if self.stacks_file is not None:
            path = Path(self.stacks_file.format(rank=self._rank))
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                stacks = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                targets.append(stacks)
                message += f"(stacks also in {path})\n"
            except OSError:
                pass
        for fd in targets:
            try:
                os.write(fd, message.encode())
                faulthandler.dump_traceback(file=fd, all_threads=True)
            except (OSError, ValueError):
                pass
        if stacks is not None:
            os.fsync(stacks)
            os.close(stacks)
        self._exit(EXIT_HUNG)
