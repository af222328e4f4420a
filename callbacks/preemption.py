"""Preemption: on SIGTERM or SIGUSR1, finish the step, save a checkpoint, exit 75.

A scheduler that takes the machines back sends SIGTERM (SLURM at preemption or at the
time limit, Kubernetes, torchrun passing it on), or, asked with ``#SBATCH
--signal=USR1@120``, SIGUSR1 a while before. Lightning's own handling does not survive
either: on SIGTERM it raises ``SIGTERMException`` after the current batch, a
``SystemExit`` without a status, so the run ends with status 0 (a preemption recorded
as a success) and saves nothing (every step since the last checkpoint is lost). It
stops after any batch, also one in the middle of a gradient accumulation, and under
several processes it follows rank 0's flag, broadcast from inside the signal handler at
whatever point each process happens to be. On SLURM with auto-requeue, SIGUSR1 saves
``hpc_ckpt_N.ckpt`` from inside the handler, in the middle of a step, and training
goes on until the job is killed; SIGUSR1 elsewhere kills the process.

:class:`Preemption` takes both signals over while the training loop runs (Lightning
puts the earlier handlers back when the fit ends) and only records them. After each
optimizer step it checks the flag: the process finishes the step, writes the same step
checkpoint a ``ModelCheckpoint`` would (``trainer.save_checkpoint``, so a file or a
sharded folder; ``last.ckpt`` linked to it), and raises :class:`Preempted`, which
exits with :data:`EXIT_PREEMPTED` where nobody catches it. Under SLURM with Lightning's
auto-requeue (its ``SLURMEnvironment``, the default there), the requeue signal also
requeues the job, as Lightning does (``scontrol requeue`` from rank 0), once the
checkpoint is written. The last step is never preempted: the run ends there anyway.

Under several processes every rank must stop at the same step, or the others wait in
the next step's collectives forever. After each step the ranks all-reduce (max) their
flags through the strategy; the result is read one step later, from host memory the
GPU copied it to meanwhile, so the check adds one small all-reduce per step and no
wait of the host for the GPU, and every rank stops one step after the first signal
arrived. One process needs no collective and stops at the end of the step it was in.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Checkpoint, ModelCheckpoint

from recipes_lib.callbacks.step import OptimizerStepCallback

log = logging.getLogger(__name__)

# sysexits.h EX_TEMPFAIL, "try again later": the run stopped at a checkpoint and the same
# command resumes it
EXIT_PREEMPTED = 75
PREEMPTION_SIGNALS = tuple(
    s for s in (signal.SIGTERM, getattr(signal, "SIGUSR1", None)) if s is not None
)


class Preempted(SystemExit):
    """Training stopped for a signal; uncaught, the process exits with
    :data:`EXIT_PREEMPTED`.

    Attributes:
        signal_name: ``SIGTERM``, ``SIGUSR1``, ...
        step: the optimizer step the run stopped after.
        checkpoint: the checkpoint written at ``step``; None when the signal came before
            the first step of this fit (nothing to save since the one it started from).
        requeued: whether this process asked SLURM to requeue the job.
    """

    def __init__(self, signal_name: str, step: int, checkpoint: Path | None, requeued: bool):
        super().__init__(EXIT_PREEMPTED)
        self.signal_name = signal_name
        self.step = step
        self.checkpoint = checkpoint
        self.requeued = requeued

    def __str__(self) -> str:
        saved = (
            f"checkpoint {self.checkpoint}"
            if self.checkpoint is not None
            else "no step trained since the checkpoint it started from"
        )
        then = "the job is requeued" if self.requeued else "run the same command again to resume"
        return f"preempted by {self.signal_name} at step {self.step}: {saved}; {then}"

    def __reduce__(self):
        return type(self), (self.signal_name, self.step, self.checkpoint, self.requeued)


class Preemption(OptimizerStepCallback, Checkpoint):
    """Stops every rank at the same step on SIGTERM or SIGUSR1, with a checkpoint.

    A ``Checkpoint`` callback, so Lightning runs it after the others (it moves checkpoint
    callbacks to the end, keeping their order): the step's work, a ``ModelCheckpoint``
    save included, is done before it saves.

    Args:
        step_checkpoint: the path of the checkpoint saved after a given step (the name the
            run's ``ModelCheckpoint`` gives it, e.g. ``RunDir.step_checkpoint``).
        last_checkpoint: linked to that checkpoint (``last.ckpt``), as ``ModelCheckpoint``
            links it with ``save_last="link"``; None: no link.
    """

    def __init__(
        self, step_checkpoint: Callable[[int], str | os.PathLike], last_checkpoint: Path | None
    ):
        super().__init__()
        self.step_checkpoint = step_checkpoint
        self.last_checkpoint = last_checkpoint
        self._reset()

    def _reset(self) -> None:
        self._signum: int | None = None  # the first signal this process received
        self._requeue_asked = False  # one of the signals was SLURM's requeue signal
        self._requeue_signal: int | None = None
        self._launcher: Any = None
        self._pending: tuple[torch.Tensor, Any] | None = None  # last step's reduced flags
        self._installed = False

    # ------------------------------------------------------------- the signals
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._reset()

    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._take_over(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._take_over(trainer)

    def _take_over(self, trainer: L.Trainer) -> None:
        """Replace Lightning's handlers, which it installs just before the sanity check."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        self._requeue_signal = _slurm_requeue_signal(trainer)
        self._launcher = trainer.strategy.launcher
        signals = set(PREEMPTION_SIGNALS)
        if self._requeue_signal is not None:
            signals.add(self._requeue_signal)
        for signum in signals:
            signal.signal(signum, self._record)
        self._installed = True
        if trainer.received_sigterm:  # Lightning's handler had it first: nothing trained yet
            raise Preempted("SIGTERM", trainer.global_step, None, requeued=False)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if signum == self._requeue_signal:
            self._requeue_asked = True
        if self._signum is None:
            self._signum = signum
            if self._launcher is not None:  # processes Lightning started get it too, as
                self._launcher.kill(signum)  # its own handler does

    # ------------------------------------------------------- after each step
    def on_optimizer_step_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, step: int
    ) -> None:
        stop = self._agreed_stop(trainer)
        if stop is None or step >= trainer.max_steps:
            return
        signum, requeue = stop
        name = signal.Signals(signum).name
        if trainer.is_global_zero:
            log.warning("%s received: saving a checkpoint at step %d and stopping", name, step)
        checkpoint = self._save(trainer, step)
        _finish_background_save(trainer)
        requeued = requeue and trainer.is_global_zero and _requeue_slurm_job()
        raise Preempted(name, step, checkpoint, requeued)

    def _agreed_stop(self, trainer: L.Trainer) -> tuple[int, bool] | None:
        """(signal, requeue) when every rank stops after this step, else None."""
        flags = (self._signum or 0, int(self._requeue_asked))
        if trainer.world_size == 1:
            return (flags[0], bool(flags[1])) if flags[0] else None
        decided = None
        if self._pending is not None:  # reduced after the previous step, read now
            reduced, copied = self._pending
            if copied is not None:
                copied.synchronize()  # recorded a step ago: long done
            signum, requeue = (int(v) for v in reduced.tolist())
            decided = (signum, bool(requeue)) if signum else None
        local = torch.tensor(flags, dtype=torch.int32, device=trainer.strategy.root_device)
        reduced = trainer.strategy.reduce(local, reduce_op="max")
        if reduced.is_cuda:  # to pinned host memory behind the step's work, no host wait
            host = torch.empty(reduced.shape, dtype=reduced.dtype, pin_memory=True)
            host.copy_(reduced, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            self._pending = (host, copied)
        else:
            self._pending = (reduced, None)
        return decided

    def _save(self, trainer: L.Trainer, step: int) -> Path:
        """The step's checkpoint: the one a ``ModelCheckpoint`` wrote at this step, else a
        new one, with ``last.ckpt`` linked to it (every rank takes part)."""
        for saver in trainer.checkpoint_callbacks:
            if not isinstance(saver, ModelCheckpoint):
                continue
            saved = getattr(saver, "_last_checkpoint_saved", "")
            if getattr(saver, "_last_global_step_saved", None) == step and saved:
                return Path(saved)
        path = Path(self.step_checkpoint(step))
        trainer.save_checkpoint(path)
        if self.last_checkpoint is not None:
            ModelCheckpoint._link_checkpoint(trainer, str(path), str(self.last_checkpoint))
        return path


def _slurm_requeue_signal(trainer: L.Trainer) -> int | None:
    """The signal that requeues the job: SLURM with Lightning's auto-requeue on.

    A strategy over several processes holds the run's cluster environment. One device's
    strategy holds none; there Lightning uses a default ``SLURMEnvironment`` (auto-requeue
    on) when it detects SLURM, which is what is made here.
    """
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if environment is None and SLURMEnvironment.detect():
        environment = SLURMEnvironment()
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
        return environment.requeue_signal
    return None


def _requeue_slurm_job() -> bool:
    """``scontrol requeue`` this job (an array task by its array id), as Lightning does."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None:
        job = f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}"
    else:
        job = os.environ.get("SLURM_JOB_ID", "")
    if not job.replace("_", "").isdigit():
        log.warning("cannot requeue: no SLURM job id in the environment")
        return False
    try:
        status = subprocess.call(["scontrol", "requeue", job])
    except OSError as err:
        log.warning("cannot requeue SLURM job %s: %s", job, err)
        return False
    if status != 0:
        log.warning("scontrol requeue %s failed with status %d", job, status)
        return False
    log.info("requeued SLURM job %s", job)
    return True


def _finish_background_save(trainer: L.Trainer) -> None:
    """Wait for a checkpoint the checkpoint plugin writes in the background (an
    asynchronous save), so a preempted job stops with its checkpoint on disk and a
    failed write raises here."""
    wait = getattr(trainer.strategy.checkpoint_io, "wait", None)
    if callable(wait):
        wait()
