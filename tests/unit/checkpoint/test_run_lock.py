"""A run folder is held by one process at a time: a second is refused naming the holder's
process id and host; the lock goes however the holder ends, and one left by a process
that died is taken over with a line saying so. Only rank 0 takes it."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from recipes_lib.checkpoint.layout import RunDir
from recipes_lib.checkpoint.run_lock import RunLock, hold_run_dir
from recipes_lib.errors import RunDirInUse

# another process taking the lock of argv[1] and holding it until it is killed
HOLDER = """
import sys, time
from recipes_lib.checkpoint.run_lock import RunLock
RunLock.take(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """A live process holding ``tmp_path``'s lock (killed at the end of the test)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "held"
    yield proc
    proc.kill()
    proc.wait()


def test_a_second_holder_is_refused_naming_the_first(tmp_path):
    with hold_run_dir(tmp_path) as lock:
        assert lock is not None
        body = json.loads(RunDir(tmp_path).lock.read_text())
        assert body["pid"] == os.getpid() and body["host"] == socket.gethostname()
        with pytest.raises(RunDirInUse) as refused:
            RunLock.take(tmp_path)
    message = str(refused.value)
    assert f"process {os.getpid()} on {socket.gethostname()}" in message
    assert str(tmp_path) in message and "\n" not in message
    assert not RunDir(tmp_path).lock.exists()  # released: the file goes with it
    RunLock.take(tmp_path).release()


def test_another_live_process_is_named_and_its_lock_taken_over_once_it_is_killed(
    tmp_path, holder, caplog
):
    with pytest.raises(RunDirInUse, match=f"in use by process {holder.pid} on "):
        RunLock.take(tmp_path)
    holder.send_signal(signal.SIGKILL)  # dies holding it: the file stays, the lock goes
    holder.wait()
    assert RunDir(tmp_path).lock.exists()
    with caplog.at_level(logging.WARNING, logger="recipes_lib"):
        lock = RunLock.take(tmp_path)
    [line] = [r.getMessage() for r in caplog.records if "taking over" in r.getMessage()]
    assert f"process {holder.pid} on {socket.gethostname()}" in line
    assert json.loads(RunDir(tmp_path).lock.read_text())["pid"] == os.getpid()
    lock.release()


@pytest.mark.parametrize("ending", [RuntimeError("boom"), SystemExit(75)])
def test_the_lock_is_released_however_the_run_ends(tmp_path, ending, caplog):
    with pytest.raises(type(ending)), hold_run_dir(tmp_path):  # SystemExit(75): a preemption
        raise ending
    with caplog.at_level(logging.WARNING, logger="recipes_lib"):
        RunLock.take(tmp_path).release()
    assert not [r for r in caplog.records if "taking over" in r.getMessage()]


def test_only_rank_zero_takes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    with hold_run_dir(tmp_path) as lock:
        assert lock is None
        assert not RunDir(tmp_path).lock.exists()


def test_a_held_folder_refuses_quickly(tmp_path, holder):
    started = time.monotonic()
    with pytest.raises(RunDirInUse):
        RunLock.take(tmp_path)
    assert time.monotonic() - started < 60  # never waits for the holder (it sleeps 600 s)


def test_a_file_system_without_locks_is_said_once_and_the_run_goes_on(
    tmp_path, monkeypatch, caplog
):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level(logging.WARNING, logger="recipes_lib"), hold_run_dir(tmp_path):
        pass
    [line] = [r.getMessage() for r in caplog.records]
    assert str(tmp_path) in line and "takes no locks" in line
    assert not RunDir(tmp_path).lock.exists()
