"""A damaged newest checkpoint is moved aside and the run resumes from the one before
it, naming both; a run killed while writing a checkpoint resumes to the same weights,
and its torn write is removed; a checkpoint written before checksums still resumes; a
checkpoint that is a link is resumed through and never replaced; a run with nothing
left to resume says it starts from step 0 and why; sharded FSDP folders (two gloo
processes, written in the background) fall back the same way."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from damage import flip_byte, truncate
from integration_helpers import checkpoint_tensors, tiny_overrides
from lightning.pytorch.callbacks import Callback
from run_helpers import torchrun
from tiny import StopAtStep

from recipes_lib.checkpoint.integrity import save_torch_checkpoint, verify_checkpoint
from recipes_lib.checkpoint.weights import list_step_checkpoints, load_weights
from recipes_lib.config import compose_config
from recipes_lib.errors import CheckpointError, CorruptCheckpointError
from recipes_lib.train import run

EVERY = ("run.checkpoint_every_n_steps=4",)  # 16 steps: step checkpoints 12 and 16 stay


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_weights(run_dir / "model.safetensors")


def _assert_same_weights(found: dict, expected: dict) -> None:
    assert found.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(found[name], tensor), name


@pytest.fixture(scope="module")
def straight(tmp_path_factory, shared_cache) -> Path:
    """An uninterrupted 16-step run: the weights every resumed run must reach."""
    root = tmp_path_factory.mktemp("straight")
    result = run(compose_config(tiny_overrides(root, shared_cache, *EVERY)))
    assert result.global_step == 16
    assert [s for s, _ in list_step_checkpoints(root / "run" / "checkpoints")] == [12, 16]
    return root / "run"


def _copy(straight: Path, tmp_path: Path) -> Path:
    """The straight run's folder as another run's (its links kept as links)."""
    shutil.copytree(straight, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def _resume(tmp_path: Path, cache: Path, *extra: str):
    overrides = tiny_overrides(tmp_path, cache, *EVERY, "run.ckpt_path=last", *extra)
    return run(compose_config(overrides))


def test_a_flipped_byte_in_the_newest_checkpoint_falls_back_to_the_one_before(
    straight, tmp_path, shared_cache, caplog
):
    ckpts = _copy(straight, tmp_path) / "checkpoints"
    assert os.readlink(ckpts / "last.ckpt") == "step000016.ckpt"
    flip_byte(ckpts / "step000016.ckpt")  # still loads: only the checksum can tell
    with caplog.at_level(logging.WARNING, logger="recipes_lib"):
        resumed = _resume(tmp_path, shared_cache)
    [line] = [r.getMessage() for r in caplog.records if "resuming from" in r.getMessage()]
    assert "step000016.ckpt differs from the xxh3_128 checksum recorded" in line
    assert "moved aside to step000016.ckpt.corrupt-" in line
    assert f"resuming from {ckpts / 'step000012.ckpt'} (step 12)" in line
    assert resumed.global_step == 16
    _assert_same_weights(_weights(tmp_path / "run"), _weights(straight))
    assert len(list(ckpts.glob("step000016.ckpt.corrupt-*"))) == 1  # kept, under its new name
    assert verify_checkpoint(ckpts / "step000016.ckpt")  # written again, whole


def test_a_truncated_last_copy_falls_back_and_the_run_goes_on(
    straight, tmp_path, shared_cache, caplog
):
    ckpts = _copy(straight, tmp_path) / "checkpoints"
    (ckpts / "last.ckpt").unlink()  # the layout of save_last=true: a copy of the newest
    shutil.copyfile(ckpts / "step000016.ckpt", ckpts / "last.ckpt")
    truncate(ckpts / "last.ckpt")
    with caplog.at_level(logging.WARNING, logger="recipes_lib"):
        resumed = _resume(tmp_path, shared_cache, "trainer.max_steps=20")
    [line] = [r.getMessage() for r in caplog.records if "resuming from" in r.getMessage()]
    assert "last.ckpt has no checksum and does not load" in line
    assert "moved aside to last.ckpt.corrupt-" in line and "step000016.ckpt (step 16)" in line
    assert resumed.global_step == 20


def test_a_checkpoint_without_a_checksum_still_resumes(straight, tmp_path, shared_cache):
    ckpts = _copy(straight, tmp_path) / "checkpoints"
    for path in [*ckpts.glob("*.sha256.json"), ckpts / "step000016.ckpt", ckpts / "last.ckpt"]:
        path.unlink()  # step 12 as a run before checksums left it
    resumed = _resume(tmp_path, shared_cache)
    assert resumed.global_step == 16
    _assert_same_weights(_weights(tmp_path / "run"), _weights(straight))


class PluginSeen(Callback):
    """Records whether the run's checkpoint plugin writes in the background."""

    asynchronous: bool | None = None

    def on_train_start(self, trainer, pl_module):
        self.asynchronous = trainer.strategy.checkpoint_io.asynchronous


def test_a_run_saved_in_the_background_resumes_to_the_uninterrupted_weights(
    straight, tmp_path, shared_cache
):
    background = ("strategy.async_checkpoint=true",)
    plugin = PluginSeen()
    first = run(
        compose_config(tiny_overrides(tmp_path, shared_cache, *EVERY, *background)),
        callbacks=[StopAtStep(8), plugin],
    )
    assert first.global_step == 8
    assert plugin.asynchronous is True
    ckpts = tmp_path / "run" / "checkpoints"
    assert verify_checkpoint(ckpts / "step000008.ckpt")  # landed before fit returned
    resumed = _resume(tmp_path, shared_cache, *background)
    assert resumed.global_step == 16
    _assert_same_weights(_weights(tmp_path / "run"), _weights(straight))
    for step in (12, 16):  # the same weights and optimizer state as a foreground save's
        name = f"step{step:06d}.ckpt"
        assert verify_checkpoint(ckpts / name)
        found, expected = (
            checkpoint_tensors(ckpts / name),
            checkpoint_tensors(straight / "checkpoints" / name),
        )
        assert len(found) == len(expected)
        assert all(torch.equal(a, b) for a, b in zip(found, expected, strict=True))


KILLER = """
import os, signal, sys
import recipes_lib.checkpoint.integrity as integrity
import recipes_lib.checkpoint.io as io

writing = {}
save, write = integrity.save_torch_checkpoint, integrity.HashingWriter.write

def tracked_save(checkpoint, path):
    writing["name"] = os.path.basename(str(path))
    return save(checkpoint, path)

def killing_write(self, data):  # SIGKILL halfway through writing step 12
    written = write(self, data)
    if writing.get("name") == "step000012.ckpt" and self.size > 1_000_000:
        os.kill(os.getpid(), signal.SIGKILL)
    return written

io.save_torch_checkpoint, integrity.HashingWriter.write = tracked_save, killing_write
from recipes_lib.config import compose_config
from recipes_lib.train import run
run(compose_config(sys.argv[1:]))
"""


def test_a_run_killed_while_writing_a_checkpoint_resumes_to_the_same_weights(
    straight, tmp_path, shared_cache
):
    overrides = tiny_overrides(tmp_path, shared_cache, *EVERY)
    killed = subprocess.run(
        [sys.executable, "-c", KILLER, *overrides], capture_output=True, text=True, timeout=300
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    ckpts = tmp_path / "run" / "checkpoints"
    assert [s for s, _ in list_step_checkpoints(ckpts)] == [4, 8]
    assert list(ckpts.glob(".step000012.ckpt.*.partial"))  # the torn write, never renamed
    resumed = _resume(tmp_path, shared_cache)
    assert resumed.global_step == 16
    assert not list(ckpts.glob(".*.partial"))
    _assert_same_weights(_weights(tmp_path / "run"), _weights(straight))


def test_a_kill_during_the_first_checkpoint_leaves_nothing_behind_after_the_rerun(
    straight, tmp_path, shared_cache, caplog
):
    killer = KILLER.replace("step000012.ckpt", "step000004.ckpt").replace("1_000_000", "100_000")
    overrides = tiny_overrides(tmp_path, shared_cache, *EVERY)
    killed = subprocess.run(
        [sys.executable, "-c", killer, *overrides], capture_output=True, text=True, timeout=300
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    ckpts = tmp_path / "run" / "checkpoints"
    [torn] = ckpts.glob(".step000004.ckpt.*.partial")  # no checkpoint yet, only the torn one
    with caplog.at_level(logging.INFO, logger="recipes_lib"):
        rerun = run(compose_config(overrides))  # a plain rerun: nothing to resume
    assert rerun.global_step == 16
    [line] = [r.getMessage() for r in caplog.records if "interrupted write" in r.getMessage()]
    assert torn.name in line and str(ckpts) in line
    assert not list(ckpts.glob(".*.partial"))
    assert [r for r in caplog.records if "taking over the lock" in r.getMessage()]  # kill -9
    _assert_same_weights(_weights(tmp_path / "run"), _weights(straight))


def test_checkpoints_that_are_links_are_resumed_through_and_never_replaced(
    straight, tmp_path, shared_cache
):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for name in ("step000012.ckpt", "step000012.ckpt.sha256.json"):
        shutil.copyfile(straight / "checkpoints" / name, elsewhere / name)
    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    shutil.copyfile(straight / "config.yaml", tmp_path / "run" / "config.yaml")
    (ckpts / "step000012.ckpt").symlink_to(elsewhere / "step000012.ckpt")
    before = (elsewhere / "step000012.ckpt").read_bytes()
    seen = {}

    class FirstStep(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.setdefault("step", trainer.global_step)

    resumed = run(
        compose_config(tiny_overrides(tmp_path, shared_cache, *EVERY)), callbacks=[FirstStep()]
    )
    assert seen["step"] == 12 and resumed.global_step == 16  # a plain rerun, through the link
    _assert_same_weights(_weights(tmp_path / "run"), _weights(straight))
    assert (ckpts / "step000012.ckpt").is_symlink()
    assert (elsewhere / "step000012.ckpt").read_bytes() == before


def test_a_checkpoint_name_that_is_a_placed_link_is_refused_by_name(tmp_path):
    other = tmp_path / "other.ckpt"
    other.write_bytes(b"someone else's")
    (tmp_path / "step000004.ckpt").symlink_to(other)
    with pytest.raises(CheckpointError, match="step000004.ckpt' is a link to .*other.ckpt"):
        save_torch_checkpoint({"global_step": 4}, tmp_path / "step000004.ckpt")
    assert other.read_bytes() == b"someone else's"
    assert (tmp_path / "step000004.ckpt").is_symlink()
    # the run's own last.ckpt, a link to a checkpoint beside it, is replaced as before
    (tmp_path / "last.ckpt").symlink_to("other.ckpt")
    save_torch_checkpoint({"global_step": 4}, tmp_path / "last.ckpt")
    assert not (tmp_path / "last.ckpt").is_symlink()
    assert other.read_bytes() == b"someone else's"


def test_a_rerun_after_every_checkpoint_was_moved_aside_says_it_starts_from_step_zero(
    straight, tmp_path, shared_cache, caplog
):
    ckpts = _copy(straight, tmp_path) / "checkpoints"
    for step in (12, 16):
        flip_byte(ckpts / f"step{step:06d}.ckpt")
    with pytest.raises(CorruptCheckpointError, match="no checkpoint that verifies"):
        run(compose_config(tiny_overrides(tmp_path, shared_cache, *EVERY)))
    assert (ckpts / "last.ckpt").is_symlink() and not (ckpts / "last.ckpt").exists()
    seen = {}

    class FirstStep(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.setdefault("step", trainer.global_step)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="recipes_lib"):
        again = run(
            compose_config(tiny_overrides(tmp_path, shared_cache, *EVERY)),
            callbacks=[FirstStep()],
        )
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "resuming" in m]
    [line] = [m for m in messages if "starting from step 0" in m]
    assert "moved aside as corrupt (step000012.ckpt.corrupt-" in line
    assert "last.ckpt links to step000016.ckpt, which is not there" in line
    assert seen["step"] == 0 and again.global_step == 16
    _assert_same_weights(_weights(tmp_path / "run"), _weights(straight))


# ------------------------------------------------------------------ sharded (FSDP)
FSDP = (
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "run.checkpoint_every_n_steps=3",
    "scheduler.warmup=2",
    "strategy=fsdp",
    "data.batch_size=2",
    "trainer.devices=2",
)


def _fsdp(run_dir: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    items = tiny_overrides(run_dir.parent, cache, *FSDP, *extra)
    items = [o if not o.startswith("run.dir=") else f"run.dir={run_dir}" for o in items]
    return torchrun(2, "-m", "recipes_lib.cli", *items, omp_threads=1)


@pytest.mark.slow
@pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)
def test_a_damaged_sharded_folder_falls_back_under_fsdp_written_in_the_background(
    tmp_path, shared_cache
):
    first = tmp_path / "fsdp"
    _fsdp(first, shared_cache, "strategy.async_checkpoint=true")
    ckpts = first / "checkpoints"
    assert [s for s, _ in list_step_checkpoints(ckpts)] == [3, 6]
    for step in (3, 6):
        assert verify_checkpoint(ckpts / f"step{step:06d}.ckpt")  # whole, with checksums
    assert not list(ckpts.glob(".*"))
    reference = _weights(first)

    again = tmp_path / "again"
    shutil.copytree(first, again, symlinks=True)
    flip_byte(again / "checkpoints" / "step000006.ckpt")  # a byte of one shard
    proc = _fsdp(again, shared_cache, "strategy.async_checkpoint=true", "run.ckpt_path=last")
    log = (again / "cli.log").read_text()
    [line] = [text for text in log.splitlines() if "resuming from" in text]
    assert "step000006.ckpt has __" in line and "which differs from the xxh3_128" in line
    assert "moved aside to step000006.ckpt.corrupt-" in line and "(step 3)" in line
    assert "resuming from" in proc.stdout  # on the console too, once (rank 0)
    assert proc.stdout.count("resuming from") == 1
    found = _weights(again)
    for name, tensor in reference.items():
        torch.testing.assert_close(found[name], tensor, rtol=0, atol=1e-6, msg=name)
