"""Retention keeps the last K step checkpoints and every M-th, never the newest; the
CheckpointIO plugin applies it as each checkpoint lands, and only in the run's folder."""

from __future__ import annotations

import os

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel
from tiny import quiet_trainer

from recipes_lib.checkpoint.integrity import save_torch_checkpoint, verify_checkpoint
from recipes_lib.checkpoint.io import VerifiedCheckpointIO
from recipes_lib.checkpoint.retention import Retention, apply_retention, retention_of
from recipes_lib.checkpoint.weights import list_step_checkpoints
from recipes_lib.config.schema import RunInfoConfig


def _steps(folder) -> list[int]:
    return [step for step, _ in list_step_checkpoints(folder)]


def _save(folder, step: int):
    path = folder / f"step{step:06d}.ckpt"
    save_torch_checkpoint({"global_step": step, "state_dict": {}}, path)
    return path


@pytest.mark.parametrize(
    ("retention", "kept"),
    [
        (Retention(keep_last=2), [9, 10]),
        (Retention(keep_last=2, keep_every=4), [4, 8, 9, 10]),
        (Retention(keep_last=1, keep_every=3), [3, 6, 9, 10]),
        (Retention(keep_last=-1), list(range(1, 11))),
    ],
)
def test_keeps_the_last_k_and_every_m_th(tmp_path, retention, kept):
    for step in range(1, 11):
        apply_retention(tmp_path, retention, _save(tmp_path, step))
    assert _steps(tmp_path) == kept
    # each removal took the checksum sidecar with it
    assert sorted(p.name for p in tmp_path.glob("*.sha256.json")) == [
        f"step{step:06d}.ckpt.sha256.json" for step in kept
    ]


def test_never_removes_the_newest_or_later_steps(tmp_path):
    for step in (2, 4, 6, 8):
        _save(tmp_path, step)
    # a resumed attempt writes step 5 while steps 6 and 8 of an earlier attempt remain
    removed = apply_retention(tmp_path, Retention(keep_last=1), _save(tmp_path, 5))
    assert [p.name for p in removed] == ["step000002.ckpt", "step000004.ckpt"]
    assert _steps(tmp_path) == [5, 6, 8]


def test_average_last_k_raises_k_and_save_top_k_1_is_deprecated(caplog):
    run = RunInfoConfig(keep_last_checkpoints=2, keep_every_n_steps=50)
    assert retention_of(run, average_last_k=3) == Retention(keep_last=3, keep_every=50)
    assert retention_of(RunInfoConfig(keep_last_checkpoints=-1), 3).keeps_all
    retention_of(RunInfoConfig(save_top_k=1))
    assert "run.save_top_k=1 is deprecated" in caplog.text


def test_the_plugin_writes_checksummed_files_and_prunes_only_the_run_folder(tmp_path):
    folder = tmp_path / "checkpoints"
    io = VerifiedCheckpointIO(folder, Retention(keep_last=2))
    saver = ModelCheckpoint(
        dirpath=folder,
        filename="step{step:06d}",
        auto_insert_metric_name=False,
        every_n_train_steps=2,
        save_top_k=-1,
        save_last="link",
        enable_version_counter=False,
    )
    trainer = quiet_trainer(8, [saver], limit_val_batches=0, plugins=[io])
    trainer.fit(BoringModel())
    assert _steps(folder) == [6, 8]
    assert os.readlink(folder / "last.ckpt") == "step000008.ckpt"
    for path in folder.glob("step*.ckpt"):
        assert verify_checkpoint(path)
    trainer.save_checkpoint(tmp_path / "elsewhere" / "step000001.ckpt")
    trainer.save_checkpoint(tmp_path / "elsewhere" / "step000002.ckpt")
    elsewhere = sorted(p.name for p in (tmp_path / "elsewhere").glob("*.ckpt"))
    assert elsewhere == ["step000001.ckpt", "step000002.ckpt"]  # not the run's folder: kept
    # a load verifies first
    state = io.load_checkpoint(folder / "last.ckpt")
    assert state["global_step"] == 8
    with open(folder / "step000006.ckpt", "r+b") as f:
        f.truncate(100)
    with pytest.raises(Exception, match="is truncated"):
        io.load_checkpoint(folder / "step000006.ckpt")
    io.remove_checkpoint(folder / "step000006.ckpt")
    assert sorted(p.name for p in folder.glob("step000006*")) == []
    assert isinstance(torch.load(folder / "step000008.ckpt", weights_only=False), dict)
