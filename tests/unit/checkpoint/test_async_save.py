"""Checkpoint files are checksummed with xxh3 as they are written (older SHA-256 records
still verify), and a background save writes the same bytes a foreground one does, from
a host copy taken when it was asked for, and never loses a failure."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
import xxhash
from damage import flip_byte

from recipes_lib.checkpoint import integrity
from recipes_lib.checkpoint.integrity import save_torch_checkpoint, verify_checkpoint
from recipes_lib.checkpoint.io import VerifiedCheckpointIO
from recipes_lib.checkpoint.layout import checksum_sidecar
from recipes_lib.checkpoint.resume import newest_good_checkpoint
from recipes_lib.checkpoint.staging import HostStaging
from recipes_lib.errors import CheckpointError, CorruptCheckpointError


def _checkpoint(step: int) -> dict:
    """A Lightning-like checkpoint: 4 MB of weights (hashed beside the write), a tied
    head sharing the embedding's storage, a view, and plain state."""
    generator = torch.Generator().manual_seed(step)
    embed = torch.randn(1024, 1024, generator=generator)
    return {
        "global_step": step,
        "state_dict": {"embed": embed, "head": embed, "row": embed[3]},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(64, generator=generator)}}}],
        "loops": {"fit_loop": {"step": step, "seen": [1, 2, 3]}},
    }


def _write_sha256_record(path):
    """Rewrite ``path``'s record as a format-1 record (SHA-256), as older runs wrote it."""
    record = {
        "format": 1,
        "global_step": 8,
        "files": {
            path.name: {
                "bytes": path.stat().st_size,
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            }
        },
    }
    checksum_sidecar(path).write_text(json.dumps(record))
    integrity.forget_verified()


def test_the_record_names_xxh3_and_matches_the_bytes_written(tmp_path):
    path = tmp_path / "step000008.ckpt"
    save_torch_checkpoint(_checkpoint(8), path)
    record = json.loads(checksum_sidecar(path).read_text())
    assert record["format"] == 2
    entry = record["files"][path.name]
    assert set(entry) == {"bytes", "xxh3_128"}
    assert entry["xxh3_128"] == xxhash.xxh3_128(path.read_bytes()).hexdigest()


def test_an_older_sha256_record_still_verifies_and_still_catches_damage(tmp_path):
    path = tmp_path / "step000008.ckpt"
    save_torch_checkpoint(_checkpoint(8), path)
    _write_sha256_record(path)
    assert verify_checkpoint(path) is True
    flip_byte(path)
    with pytest.raises(CorruptCheckpointError, match="sha256 checksum recorded"):
        verify_checkpoint(path)


def test_a_damaged_xxh3_checkpoint_falls_back_to_the_newest_good_one(tmp_path):
    older, newer = tmp_path / "step000004.ckpt", tmp_path / "step000008.ckpt"
    save_torch_checkpoint(_checkpoint(4), older)
    _write_sha256_record(older)  # an older run's checkpoint beside a new one
    save_torch_checkpoint(_checkpoint(8), newer)
    integrity.forget_verified()
    flip_byte(newer)
    assert newest_good_checkpoint(tmp_path) == older


def test_a_record_naming_no_known_checksum_is_refused(tmp_path):
    path = tmp_path / "step000008.ckpt"
    save_torch_checkpoint(_checkpoint(8), path)
    checksum_sidecar(path).write_text(
        json.dumps({"format": 3, "files": {path.name: {"bytes": 1, "md5": "00"}}})
    )
    with pytest.raises(CorruptCheckpointError, match="is not a checksum record"):
        verify_checkpoint(path)


def test_a_background_save_writes_the_bytes_a_foreground_save_writes(tmp_path):
    checkpoint = _checkpoint(8)
    expected = torch.clone(checkpoint["state_dict"]["embed"])
    sync_path, async_path = tmp_path / "sync" / "a.ckpt", tmp_path / "async" / "a.ckpt"
    sync_path.parent.mkdir()
    async_path.parent.mkdir()
    VerifiedCheckpointIO().save_checkpoint(checkpoint, sync_path)
    io = VerifiedCheckpointIO(asynchronous=True)
    io.save_checkpoint(checkpoint, async_path)
    checkpoint["state_dict"]["embed"].add_(1.0)  # the next optimizer step, mid-write
    checkpoint["loops"]["fit_loop"]["seen"].append(4)
    io.teardown()
    assert async_path.read_bytes() == sync_path.read_bytes()
    assert verify_checkpoint(async_path) is True
    loaded = io.load_checkpoint(async_path)
    assert torch.equal(loaded["state_dict"]["embed"], expected)
    assert loaded["state_dict"]["head"].data_ptr() == loaded["state_dict"]["embed"].data_ptr()


def test_a_failed_background_save_raises_at_the_next_save_and_at_the_end(tmp_path, monkeypatch):
    io = VerifiedCheckpointIO(asynchronous=True)

    def full_disk(checkpoint, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("recipes_lib.checkpoint.io.save_torch_checkpoint", full_disk)
    io.save_checkpoint(_checkpoint(4), tmp_path / "step000004.ckpt")
    with pytest.raises(CheckpointError, match="background save of .*step000004.ckpt.*No space"):
        io.save_checkpoint(_checkpoint(8), tmp_path / "step000008.ckpt")
    io.save_checkpoint(_checkpoint(8), tmp_path / "step000008.ckpt")  # the error was reported
    with pytest.raises(CheckpointError, match="background save of .*step000008.ckpt"):
        io.teardown()
    assert not list(tmp_path.iterdir())


def test_staging_reuses_its_buffers_and_keeps_shared_storage_shared():
    staging = HostStaging()
    first = staging.stage(_checkpoint(1))
    pointer = first["state_dict"]["embed"].data_ptr()
    assert first["state_dict"]["head"].data_ptr() == pointer
    assert first["state_dict"]["row"].data_ptr() == pointer + 3 * 1024 * 4
    second = staging.stage(_checkpoint(2))
    assert second["state_dict"]["embed"].data_ptr() == pointer  # the same host buffer
    assert torch.equal(second["state_dict"]["embed"], _checkpoint(2)["state_dict"]["embed"])
