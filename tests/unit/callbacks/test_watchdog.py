"""The hang watchdog: batches that end keep it quiet; without one for its timeout it writes
every thread's stack to stderr and the rank's file and exits 124."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from recipes_lib.callbacks import EXIT_HUNG, HangWatchdog

TIMEOUT_MIN = 0.005  # 0.3 s


def _watch(tmp_path) -> tuple[HangWatchdog, threading.Event, list[int], SimpleNamespace]:
    exited: list[int] = []
    done = threading.Event()
    dog = HangWatchdog(minutes=TIMEOUT_MIN, stacks_file=str(tmp_path / "stacks.rank{rank}.txt"))

    def record_exit(status: int) -> None:  # instead of os._exit
        exited.append(status)
        done.set()

    dog._exit = record_exit
    trainer = SimpleNamespace(global_rank=3, global_step=41)
    dog.on_train_start(trainer, None)
    return dog, done, exited, trainer


def test_no_progress_dumps_every_stack_and_exits_124(tmp_path, capfd):
    dog, done, exited, trainer = _watch(tmp_path)
    assert done.wait(10)
    dog.on_train_end(trainer, None)
    assert exited == [EXIT_HUNG]
    err = capfd.readouterr().err
    assert "error: no training progress for 0.005 minutes (rank 3, after step 41)" in err
    stacks = (tmp_path / "stacks.rank3.txt").read_text()
    for text in (err, stacks):
        assert "Thread 0x" in text and "test_no_progress_dumps_every_stack" in text


def test_progress_keeps_it_quiet_and_the_end_of_training_stops_it(tmp_path):
    dog, done, exited, trainer = _watch(tmp_path)
    deadline = time.monotonic() + 1.0  # over three timeouts
    while time.monotonic() < deadline:
        dog.on_train_batch_end(trainer, None, None, None, 0)
        time.sleep(0.02)
    dog.on_validation_batch_end(trainer, None, None, None, 0)
    dog.on_train_end(trainer, None)
    assert not done.wait(0.6) and exited == []
    assert not any(t.name == "recipes-hang-watchdog" for t in threading.enumerate())


def test_off_and_bad_timeouts():
    dog = HangWatchdog(minutes=None)
    dog.on_train_start(SimpleNamespace(global_rank=0, global_step=0), None)
    assert dog._thread is None
    with pytest.raises(ValueError, match="minutes=0"):
        HangWatchdog(minutes=0)
