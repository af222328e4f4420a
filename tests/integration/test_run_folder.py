"""What a run folder stands for end to end: one run (or pipeline) at a time in it, a second
refused in one line naming the holder; a disk that fills during a checkpoint is one line
naming the file and the space, with the older checkpoints kept."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from integration_helpers import tiny_overrides
from lightning.pytorch.callbacks import Callback

from recipes_lib.checkpoint.integrity import verify_checkpoint
from recipes_lib.checkpoint.layout import RunDir
from recipes_lib.checkpoint.run_lock import RunLock
from recipes_lib.checkpoint.weights import list_step_checkpoints
from recipes_lib.config import compose_config
from recipes_lib.errors import RunDirInUse
from recipes_lib.pipeline import compose_pipeline, run_pipeline
from recipes_lib.train import run

EVERY = ("run.checkpoint_every_n_steps=4",)

# another process holding the lock of argv[1] until it is killed
HOLDER = """
import sys, time
from recipes_lib.checkpoint.run_lock import RunLock
RunLock.take(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


class SecondRun(Callback):
    """Starts a second run on the same config once the first is training."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.refused: Exception | None = None

    def on_train_start(self, trainer, pl_module):
        try:
            run(self.cfg)
        except RunDirInUse as err:
            self.refused = err


def _cli(*args: str, script: str | None = None, cwd: Path) -> subprocess.CompletedProcess:
    """``recipes-train ARGS`` (or ``script`` then recipes-train) in a fresh process."""
    code = (script or "") + "\nimport sys\nfrom recipes_lib.cli import train_main\ntrain_main()\n"
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_second_run_on_a_held_run_dir_is_refused_and_the_first_goes_on(tmp_path, shared_cache):
    overrides = tiny_overrides(tmp_path, shared_cache, *EVERY)
    second = SecondRun(compose_config(overrides))
    first = run(compose_config(overrides), callbacks=[second])
    assert first.global_step == 16
    message = str(second.refused)
    assert f"in use by process {os.getpid()} on {socket.gethostname()}" in message
    assert str(tmp_path / "run") in message and "\n" not in message
    assert [s for s, _ in list_step_checkpoints(tmp_path / "run" / "checkpoints")] == [12, 16]
    assert not RunDir(tmp_path / "run").lock.exists()  # released at the end


def test_recipes_train_on_a_folder_another_process_holds_exits_with_one_line(
    tmp_path, shared_cache
):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = _cli(*tiny_overrides(tmp_path, shared_cache), cwd=tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert proc.returncode == 2, proc.stderr[-3000:]
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert f"is in use by process {holder.pid} on {socket.gethostname()}" in line
    assert "Traceback" not in proc.stderr
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "config.yaml").exists()


def test_a_pipeline_holds_its_folder_and_a_dry_run_takes_nothing(tmp_path, shared_cache):
    directory = tmp_path / "pipe"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RECIPES_CACHE", str(shared_cache))
        cfg = compose_pipeline(["pipeline=three_stage", f"dir={directory}"])
    lock = RunLock.take(directory)
    try:
        assert run_pipeline(cfg, dry_run=True).stages == []  # plans only: no lock needed
        with pytest.raises(RunDirInUse, match=f"in use by process {os.getpid()}"):
            run_pipeline(cfg)
    finally:
        lock.release()
    assert sorted(p.name for p in directory.iterdir()) == []  # no stage began


# the disk fills halfway through writing step 8 (torch.save sees ENOSPC from the file)
DISK_FULL = """
import collections, errno, os, shutil
import recipes_lib.checkpoint.integrity as integrity
import recipes_lib.checkpoint.io as io

writing = {}
save, write = integrity.save_torch_checkpoint, integrity.HashingWriter.write

def tracked_save(checkpoint, path):
    writing["name"] = os.path.basename(str(path))
    return save(checkpoint, path)

def filling_write(self, data):
    if writing.get("name") == "step000008.ckpt" and self.size > 100_000:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return write(self, data)

usage = collections.namedtuple("usage", "total used free")
io.save_torch_checkpoint, integrity.HashingWriter.write = tracked_save, filling_write
shutil.disk_usage = lambda path: usage(2**30, 2**30 - 3 * 2**20, 3 * 2**20)
"""


def test_a_disk_that_fills_during_a_checkpoint_is_one_line_and_keeps_the_older_ones(
    tmp_path, shared_cache
):
    proc = _cli(*tiny_overrides(tmp_path, shared_cache, *EVERY), script=DISK_FULL, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "unexpected pos" not in proc.stderr
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    ckpts = tmp_path / "run" / "checkpoints"
    assert f"no space left on device while writing {ckpts / 'step000008.ckpt'} (" in line
    assert line.endswith("needed, 3.0 MiB free)")
    assert [s for s, _ in list_step_checkpoints(ckpts)] == [4]
    assert verify_checkpoint(ckpts / "step000004.ckpt")  # the older one, whole
    assert not list(ckpts.glob(".*.partial"))
    assert not RunDir(tmp_path / "run").lock.exists()
