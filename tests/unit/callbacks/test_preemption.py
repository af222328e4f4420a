"""Preemption in one process: a signal stops training after the optimizer step it came in
(never inside a gradient accumulation) with a step checkpoint and ``last.ckpt`` linked to
it; several ranks agree, one step later, through the strategy's all-reduce."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from callback_helpers import random_batches, tiny_causal_lm
from tiny import quiet_trainer, step_loader

from recipes_lib.callbacks import EXIT_PREEMPTED, Preempted, Preemption
from recipes_lib.checkpoint.layout import RunDir
from recipes_lib.config.schema import SchedulerConfig

STEPS = 8


class SignalAt(L.Callback):
    """Sends ``signum`` to this process at the start of batch ``batch_idx`` (None: when
    training starts, Lightning's own handler in place and before the first step)."""

    def __init__(self, batch_idx: int | None, signum: int):
        self.batch_idx = batch_idx
        self.signum = signum

    def on_train_start(self, trainer, pl_module):
        if self.batch_idx is None:
            os.kill(os.getpid(), self.signum)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.batch_idx:
            os.kill(os.getpid(), self.signum)


class SignalAtBackward(L.Callback):
    """Sends ``signum`` to this process at the backward pass of micro-batch ``index``
    (counted over the fit): inside its optimizer step when more micro-batches follow."""

    def __init__(self, index: int, signum: int):
        self.index = index
        self.signum = signum
        self.seen = 0

    def on_before_backward(self, trainer, pl_module, loss):
        if self.seen == self.index:
            os.kill(os.getpid(), self.signum)
        self.seen += 1


def _fit(tmp_path, callbacks, accumulate: int = 1) -> L.Trainer:
    run_dir = RunDir(tmp_path)
    preemption = Preemption(run_dir.step_checkpoint, run_dir.last_checkpoint)
    module = tiny_causal_lm(STEPS, SchedulerConfig(name="constant"))
    trainer = quiet_trainer(
        STEPS,
        [*callbacks, preemption],
        enable_checkpointing=True,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, step_loader(random_batches(STEPS * accumulate), accumulate))
    return trainer


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_inside_an_accumulation_stops_after_its_step_with_a_checkpoint(tmp_path, signum):
    before = signal.getsignal(signum)
    # micro-batch 4 is the first of step 3 (two per step): the second is still to come
    with pytest.raises(Preempted) as info:
        _fit(tmp_path, [SignalAtBackward(4, signum)], accumulate=2)
    stopped = info.value
    assert stopped.code == EXIT_PREEMPTED and stopped.step == 3
    assert stopped.signal_name == signal.Signals(signum).name and not stopped.requeued
    run_dir = RunDir(tmp_path)
    assert stopped.checkpoint == run_dir.step_checkpoint(3)
    saved = torch.load(stopped.checkpoint, map_location="cpu", weights_only=False)
    assert saved["global_step"] == 3
    assert run_dir.last_checkpoint.is_symlink()
    assert run_dir.last_checkpoint.resolve() == stopped.checkpoint.resolve()
    assert str(stopped) == (
        f"preempted by {stopped.signal_name} at step 3: checkpoint {stopped.checkpoint}; "
        "run the same command again to resume"
    )
    assert signal.getsignal(signum) == before  # Lightning put the handlers back


def test_sigterm_before_the_first_step_stops_without_a_checkpoint(tmp_path):
    with pytest.raises(Preempted) as info:
        _fit(tmp_path, [SignalAt(None, signal.SIGTERM)])
    assert info.value.step == 0 and info.value.checkpoint is None
    assert not RunDir(tmp_path).has_checkpoints()


@pytest.mark.parametrize("signalled", [False, True])
def test_the_last_step_is_never_preempted(tmp_path, signalled):
    callbacks = [SignalAt(STEPS - 1, signal.SIGTERM)] if signalled else []  # in the last step
    trainer = _fit(tmp_path, callbacks)
    assert trainer.global_step == STEPS
    assert not RunDir(tmp_path).has_checkpoints()


class _PeerStrategy:
    """Two ranks' all-reduce (max), the other rank's flags given."""

    root_device = torch.device("cpu")

    def __init__(self):
        self.peer = (0, 0)

    def reduce(self, tensor, reduce_op):
        assert reduce_op == "max"
        return torch.maximum(tensor, torch.tensor(self.peer, dtype=tensor.dtype))


def test_ranks_agree_one_step_after_any_of_them_was_signalled(tmp_path):
    preemption = Preemption(RunDir(tmp_path).step_checkpoint, None)
    strategy = _PeerStrategy()
    trainer = SimpleNamespace(world_size=2, strategy=strategy)
    assert preemption._agreed_stop(trainer) is None  # step 1: no one
    strategy.peer = (int(signal.SIGUSR1), 1)  # the other rank got the requeue signal
    assert preemption._agreed_stop(trainer) is None  # step 2: reduced, read next step
    assert preemption._agreed_stop(trainer) == (int(signal.SIGUSR1), True)  # step 3


def test_under_slurm_the_requeue_signal_also_requeues_the_job(tmp_path, monkeypatch):
    """Lightning's SLURM environment with auto-requeue: SIGUSR1 (``--signal=USR1@120``)
    saves, then asks ``scontrol`` to requeue the job, from rank 0."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol.txt"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1"}
    slurm.update(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_JOB_NAME="train")
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)

    run_dir = RunDir(tmp_path / "run")
    preemption = Preemption(run_dir.step_checkpoint, run_dir.last_checkpoint)
    trainer = quiet_trainer(
        STEPS,
        [SignalAt(2, signal.SIGUSR1), preemption],
        enable_checkpointing=True,
        default_root_dir=run_dir.root,
        plugins=[SLURMEnvironment(auto_requeue=True)],
    )
    module = tiny_causal_lm(STEPS, SchedulerConfig(name="constant"))
    with pytest.raises(Preempted) as info:
        trainer.fit(module, step_loader(random_batches(STEPS), 1))
    assert info.value.step == 3 and info.value.requeued
    assert str(info.value).endswith("the job is requeued")
    assert calls.read_text().split() == ["requeue", "4242"]
    assert not list(run_dir.root.glob("hpc_ckpt_*"))  # not Lightning's mid-step save
