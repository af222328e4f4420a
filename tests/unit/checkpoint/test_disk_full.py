"""A disk that fills while a checkpoint is written is one error naming the file, the size it
needed and the space free, whether the file system's ENOSPC or torch's zip writer's
"unexpected pos" reports it; the older checkpoint and nothing torn stay behind."""

from __future__ import annotations

import collections
import errno
import os
import shutil

import pytest
import torch

import recipes_lib.checkpoint.integrity as integrity
from recipes_lib.checkpoint.integrity import save_torch_checkpoint, tensor_bytes, verify_checkpoint
from recipes_lib.errors import DiskFullError
from recipes_lib.files import is_disk_full, write_text_atomic

Usage = collections.namedtuple("Usage", "total used free")
FREE = 5 * 2**20


def _checkpoint(step: int) -> dict:
    return {"global_step": step, "state_dict": {"w": torch.randn(512, 512)}}  # 1 MiB


@pytest.fixture
def small_disk(monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(2**30, 2**30 - FREE, FREE))


def _full_from_the_file_system(self, data):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _full_from_torch(checkpoint, file):  # what torch.save raises over a short write
    file.write(b"PK\x03\x04")
    raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


@pytest.mark.parametrize("where", ["file system", "torch"])
def test_a_full_disk_names_the_file_its_size_and_the_space_left(
    tmp_path, small_disk, monkeypatch, where
):
    older = tmp_path / "step000004.ckpt"
    save_torch_checkpoint(_checkpoint(4), older)
    if where == "torch":
        monkeypatch.setattr(integrity.torch, "save", _full_from_torch)
    else:
        monkeypatch.setattr(integrity.HashingWriter, "write", _full_from_the_file_system)
    target = tmp_path / "step000008.ckpt"
    with pytest.raises(DiskFullError) as full:
        save_torch_checkpoint(_checkpoint(8), target)
    assert str(full.value) == (
        f"no space left on device while writing {target} (1.0 MiB needed, 5.0 MiB free)"
    )
    monkeypatch.undo()
    assert verify_checkpoint(older)
    assert sorted(p.name for p in tmp_path.iterdir()) == [older.name, f"{older.name}.sha256.json"]


def test_another_write_error_is_left_as_it_is(tmp_path, monkeypatch):
    def broken(checkpoint, file):
        raise RuntimeError("something else")

    monkeypatch.setattr(integrity.torch, "save", broken)
    with pytest.raises(RuntimeError, match="something else"):
        save_torch_checkpoint(_checkpoint(8), tmp_path / "step000008.ckpt")
    assert not list(tmp_path.iterdir())


def test_any_file_written_atomically_says_at_least_what_it_had_written(tmp_path, small_disk):
    def half_then_full(path):
        path.write_bytes(b"x" * 3000)
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))  # a quota spent reads the same

    target = tmp_path / "config.yaml"
    write_text_atomic(target, "old\n")
    with pytest.raises(DiskFullError, match=r"config.yaml \(at least 2.9 KiB needed, 5.0 MiB"):
        integrity.write_atomic(target, half_then_full)
    assert target.read_text() == "old\n" and len(list(tmp_path.iterdir())) == 1


def test_a_text_file_names_its_own_size(tmp_path, small_disk, monkeypatch):
    def full(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(type(tmp_path), "write_bytes", full)
    with pytest.raises(DiskFullError, match=r"record.json \(2.0 KiB needed, 5.0 MiB free\)"):
        write_text_atomic(tmp_path / "record.json", "x" * 2048)


def test_torch_reports_enospc_as_a_zip_writer_error_which_is_recognised():
    class FillingFile:  # takes 2 KB, then the disk is full
        size = 0

        def write(self, data):
            self.size += len(data)
            if self.size > 2000:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return len(data)

        def flush(self):
            pass

    with pytest.raises(RuntimeError, match="unexpected pos") as raised:
        torch.save({"w": torch.zeros(100_000)}, FillingFile())
    assert is_disk_full(raised.value)
    assert not is_disk_full(RuntimeError("shape mismatch")) and not is_disk_full(OSError(13, "x"))


def test_the_size_needed_is_about_the_file_written(tmp_path):
    state = {"global_step": 1, "state_dict": {"w": torch.randn(256, 256)}, "opt": [torch.ones(99)]}
    path = tmp_path / "a.ckpt"
    save_torch_checkpoint(state, path)
    assert tensor_bytes(state) == (256 * 256 + 99) * 4
    assert 0.9 < tensor_bytes(state) / path.stat().st_size <= 1.0
