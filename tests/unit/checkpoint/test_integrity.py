"""Checkpoint files carry a checksum, are verified when read, and a resume takes the
newest one that verifies, moving a bad newer one aside (never deleting it)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import xxhash
from damage import flip_byte, truncate

from recipes_lib.checkpoint.integrity import (
    read_checksums,
    save_torch_checkpoint,
    verify_checkpoint,
)
from recipes_lib.checkpoint.layout import checksum_sidecar
from recipes_lib.checkpoint.resume import (
    check_checkpoint,
    newest_good_checkpoint,
    remove_unfinished_writes,
    resume_checkpoint,
)
from recipes_lib.checkpoint.weights import list_step_checkpoints, read_checkpoint
from recipes_lib.errors import CheckpointError, CorruptCheckpointError


def _checkpoint(step: int) -> dict:
    """A Lightning-like checkpoint dictionary with a few hundred KB of tensor data."""
    generator = torch.Generator().manual_seed(step)
    return {"global_step": step, "state_dict": {"w": torch.randn(256, 256, generator=generator)}}


def _save(folder, step: int, name: str | None = None):
    path = folder / (name or f"step{step:06d}.ckpt")
    save_torch_checkpoint(_checkpoint(step), path)
    return path


def test_a_saved_checkpoint_records_its_size_digest_and_step(tmp_path):
    path = _save(tmp_path, 8)
    record = json.loads(checksum_sidecar(path).read_text())
    assert record["global_step"] == 8
    entry = record["files"][path.name]
    assert entry["bytes"] == path.stat().st_size
    assert record["format"] == 2
    assert entry["xxh3_128"] == xxhash.xxh3_128(path.read_bytes()).hexdigest()  # as written
    assert verify_checkpoint(path) is True
    assert torch.equal(read_checkpoint(path)["state_dict"]["w"], _checkpoint(8)["state_dict"]["w"])
    assert not list(tmp_path.glob(".*"))  # no temporary file left


@pytest.mark.parametrize(
    ("damage", "problem"),
    [(flip_byte, "differs from the xxh3_128 checksum recorded"), (truncate, "is truncated: ")],
)
def test_a_damaged_file_is_refused_wherever_it_is_read(tmp_path, damage, problem):
    path = _save(tmp_path, 8)
    verify_checkpoint(path)  # verified once: a change afterwards is still caught
    damage(path)
    for read in (verify_checkpoint, read_checkpoint, check_checkpoint):
        with pytest.raises(CorruptCheckpointError, match=problem) as caught:
            read(path)
        assert str(path) in str(caught.value) and "\n" not in str(caught.value)


def test_a_checkpoint_without_a_record_is_checked_by_loading_it(tmp_path):
    good, bad = tmp_path / "old.ckpt", tmp_path / "torn.ckpt"
    torch.save(_checkpoint(4), good)  # as written before checksums
    torch.save(_checkpoint(4), bad)
    truncate(bad)
    assert verify_checkpoint(good) is False
    assert check_checkpoint(good) is False  # loadable: accepted, without a checksum
    with pytest.raises(CorruptCheckpointError, match="has no checksum and does not load"):
        check_checkpoint(bad)


def test_rewriting_a_checkpoint_replaces_its_record(tmp_path):
    path = _save(tmp_path, 8, name="last.ckpt")
    save_torch_checkpoint(_checkpoint(12), path)
    assert read_checksums(path).global_step == 12
    assert verify_checkpoint(path)


def test_resume_takes_the_newest_that_verifies_and_moves_a_bad_one_aside(tmp_path, caplog):
    for step in (4, 8, 12):
        _save(tmp_path, step)
    (tmp_path / "last.ckpt").symlink_to("step000012.ckpt")
    flip_byte(tmp_path / "last.ckpt")  # through the link: the step-12 file
    with caplog.at_level(logging.WARNING, logger="recipes_lib"):
        chosen = newest_good_checkpoint(tmp_path)
    assert chosen == tmp_path / "step000008.ckpt"
    moved = sorted(p.name for p in tmp_path.glob("step000012.ckpt*"))
    assert moved[0].startswith("step000012.ckpt.corrupt-")  # kept, under another name
    assert moved[1].startswith("step000012.ckpt.sha256.json.corrupt-")
    assert not (tmp_path / "step000012.ckpt").exists()
    [line] = [r.getMessage() for r in caplog.records]
    assert "step000012.ckpt differs from the xxh3_128" in line
    assert "moved aside to step000012.ckpt.corrupt-" in line
    assert "resuming from" in line and "step000008.ckpt (step 8)" in line
    assert [s for s, _ in list_step_checkpoints(tmp_path)] == [4, 8]


def test_a_truncated_last_copy_falls_back_to_the_step_checkpoint(tmp_path, caplog):
    _save(tmp_path, 8)
    _save(tmp_path, 12)
    _save(tmp_path, 12, name="last.ckpt")  # save_last=true: a copy
    truncate(tmp_path / "last.ckpt")
    with caplog.at_level(logging.WARNING, logger="recipes_lib"):
        assert newest_good_checkpoint(tmp_path) == tmp_path / "step000012.ckpt"
    assert "last.ckpt is truncated" in caplog.text and "step000012.ckpt (step 12)" in caplog.text


def test_a_checkpoint_without_a_record_still_resumes(tmp_path):
    torch.save(_checkpoint(4), tmp_path / "step000004.ckpt")
    torch.save(_checkpoint(8), tmp_path / "step000008.ckpt")
    assert newest_good_checkpoint(tmp_path) == tmp_path / "step000008.ckpt"


def test_a_rollback_asks_for_the_newest_good_one_up_to_a_step(tmp_path):
    for step in (4, 8, 12):
        _save(tmp_path, step)
    flip_byte(tmp_path / "step000008.ckpt")
    assert newest_good_checkpoint(tmp_path, at_most_step=10) == tmp_path / "step000004.ckpt"
    assert (tmp_path / "step000012.ckpt").exists()  # after the step asked for: not examined


def test_only_rank_zero_moves_anything(tmp_path):
    _save(tmp_path, 4)
    flip_byte(_save(tmp_path, 8))
    assert newest_good_checkpoint(tmp_path, move_bad=False) == tmp_path / "step000004.ckpt"
    assert (tmp_path / "step000008.ckpt").exists()


def test_no_checkpoint_that_verifies_is_an_error_naming_them(tmp_path):
    truncate(_save(tmp_path, 4))
    with pytest.raises(CorruptCheckpointError, match="no checkpoint that verifies .*step000004"):
        newest_good_checkpoint(tmp_path)
    assert newest_good_checkpoint(tmp_path / "missing") is None


def test_what_an_interrupted_write_left_is_removed_and_never_resumed(tmp_path):
    _save(tmp_path, 4)
    (tmp_path / ".step000008.ckpt.123.abcd.partial").write_bytes(b"half")
    (tmp_path / ".step000008.ckpt.partial").mkdir()  # a sharded folder never renamed
    assert resume_checkpoint(tmp_path) == tmp_path / "step000004.ckpt"
    assert len(remove_unfinished_writes(tmp_path)) == 2  # by the run, holding its folder
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step000004.ckpt",
        "step000004.ckpt.sha256.json",
    ]
    assert remove_unfinished_writes(tmp_path) == []


def test_a_missing_checkpoint_is_not_called_corrupt(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint") as caught:
        verify_checkpoint(tmp_path / "nope.ckpt")
    assert not isinstance(caught.value, CorruptCheckpointError)
