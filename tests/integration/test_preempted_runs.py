"""Long runs: SIGTERM stops ``recipes-train`` at a checkpoint with exit status 75, the same
command resumes it to the weights of a run that never stopped, a changed config is
refused naming its keys, and the hang watchdog ends a run that stopped moving."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from integration_helpers import metric_series, read_metrics, tiny_overrides
from lightning.pytorch.callbacks import Callback
from signal_helpers import ALLOWED, env_with_helpers, signal_at_step, slow_steps_override
from tiny import StopAtStep

from recipes_lib.callbacks import EXIT_HUNG, EXIT_PREEMPTED
from recipes_lib.checkpoint.layout import RunDir
from recipes_lib.checkpoint.weights import load_weights, read_checkpoint
from recipes_lib.config import compose_config
from recipes_lib.errors import ConfigError
from recipes_lib.train import run

TRAIN = str(Path(sys.executable).parent / "recipes-train")
STEPS = ("trainer.max_steps=14", "trainer.val_check_interval=7", "run.checkpoint_every_n_steps=7")


class FirstStep(Callback):
    def __init__(self):
        self.step: int | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.step is None:
            self.step = trainer.global_step


def _assert_same_weights(found: dict, expected: dict) -> None:
    assert found.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(found[name], tensor), name


def test_sigterm_saves_exits_75_and_the_same_command_resumes_bitwise(tmp_path, shared_cache):
    straight = run(compose_config(tiny_overrides(tmp_path / "straight", shared_cache, *STEPS)))
    marker = tmp_path / "step.txt"
    command = [
        TRAIN,
        *tiny_overrides(tmp_path / "split", shared_cache, *STEPS),
        slow_steps_override(marker),
        ALLOWED,
    ]
    target = random.Random().randint(2, 6)  # any step after the first few
    log = tmp_path / "first.log"
    proc = signal_at_step(command, marker, target, log)
    output = log.read_text()
    assert proc.returncode == EXIT_PREEMPTED, output[-3000:]
    lines = [line for line in output.splitlines() if line.startswith("error: preempted")]
    assert len(lines) == 1, output[-3000:]
    step = int(lines[0].split(" at step ")[1].split(":")[0])
    assert target <= step < 14
    run_dir = RunDir(tmp_path / "split" / "run")
    assert str(run_dir.step_checkpoint(step)) in lines[0]
    assert read_checkpoint(run_dir.step_checkpoint(step))["global_step"] == step
    assert run_dir.last_checkpoint.resolve() == run_dir.step_checkpoint(step).resolve()
    assert not run_dir.weights.exists()  # an unfinished run has no output
    assert not run_dir.lock.exists()  # released on the way out, not left to look stale

    rerun = subprocess.run(
        command, env=env_with_helpers(), capture_output=True, text=True, timeout=300
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    losses = metric_series(read_metrics(run_dir.root), "train/loss")
    resumed_from = [s for s, _ in losses].index(step)  # the second attempt starts there
    assert [s for s, _ in losses[resumed_from:]] == list(range(step, 14))
    _assert_same_weights(load_weights(run_dir.weights), load_weights(straight.weights_path))


def test_a_rerun_resumes_the_same_config_and_refuses_a_changed_one(tiny_cfg, tmp_path):
    first = run(tiny_cfg(*STEPS), callbacks=[StopAtStep(7)])
    assert first.global_step == 7

    with pytest.raises(ConfigError) as info:
        run(tiny_cfg(*STEPS, "optim.lr=0.0123"))
    message = str(info.value)
    assert "holds checkpoints of another config (optim.lr: " in message
    assert "-> 0.0123)" in message and "run.ckpt_path=last" in message
    assert len(message.splitlines()) == 1

    # keys that say where it runs or how it reports or is watched are no change
    start = FirstStep()
    quieter = ("data.num_workers=0", "callbacks.watchdog.minutes=60")
    resumed = run(tiny_cfg(*STEPS, *quieter), callbacks=[start])
    assert start.step == 7 and resumed.global_step == 14


def test_watchdog_ends_a_hung_run_with_every_stack(tmp_path, shared_cache):
    hang = "+callbacks.hang={_target_: signal_helpers.HangAt, step: 3}"
    command = [
        TRAIN,
        *tiny_overrides(tmp_path, shared_cache, *STEPS),
        "callbacks.watchdog.minutes=0.04",  # 2.4 s
        hang,
        ALLOWED,
    ]
    proc = subprocess.run(
        command, env=env_with_helpers(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == EXIT_HUNG, proc.stderr[-3000:]
    assert "error: no training progress for 0.04 minutes (rank 0, after step 3)" in proc.stderr
    stacks = RunDir(tmp_path / "run").hang_stacks(0).read_text()
    for text in (proc.stderr, stacks):  # every thread; the main one where it is stuck
        assert "Thread 0x" in text
        assert "signal_helpers.py" in text and "in on_train_batch_end" in text
