"""Checkpoint files are ``torch.save`` archives written in large writes: torch.load reads
them (memory-mapped too) with their shared storages shared, every record holds the
bytes torch.save would write, and a layout torch might change falls back to torch.save."""

from __future__ import annotations

import io
import struct
import zipfile

import pytest
import torch
import xxhash
from damage import truncate

from recipes_lib.checkpoint import integrity, torch_file
from recipes_lib.checkpoint.integrity import (
    forget_verified,
    read_checksums,
    save_torch_checkpoint,
    verify_checkpoint,
)
from recipes_lib.checkpoint.resume import newest_good_checkpoint
from recipes_lib.checkpoint.torch_file import plan_layout, save_torch_file
from recipes_lib.errors import CorruptCheckpointError


def _checkpoint(step: int = 3) -> dict:
    """Tied and viewed weights, bf16, empty and integer tensors, and plain state."""
    generator = torch.Generator().manual_seed(step)
    embed = torch.randn(512, 256, generator=generator)
    return {
        "global_step": step,
        "state_dict": {
            "embed": embed,
            "head": embed,
            "row": embed[7],
            "norm": torch.randn(300, generator=generator).bfloat16(),
            "empty": torch.empty(0),
            "also_empty": torch.empty(0, 4),
        },
        "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": []}],
        "loops": {"fit_loop": {"seen": [1, 2, 3]}, "ids": torch.arange(5)},
    }


def _records(data: bytes) -> dict[str, tuple[int, bytes, int]]:
    """Each member of a zip archive: its header's offset, its bytes and its CRC-32 (read
    raw: zipfile would check the CRC-32)."""
    records = {}
    for info in zipfile.ZipFile(io.BytesIO(data)).infolist():
        header = info.header_offset
        name_len, extra_len = struct.unpack("<HH", data[header + 26 : header + 30])
        start = header + 30 + name_len + extra_len
        stored = data[start : start + info.file_size]
        records[info.filename.split("/", 1)[1]] = (header, stored, info.CRC)
    return records


def _assert_same_state(found: dict, expected: dict) -> None:
    for name, tensor in expected["state_dict"].items():
        assert found["state_dict"][name].dtype == tensor.dtype, name
        assert torch.equal(found["state_dict"][name], tensor), name
    assert torch.equal(found["loops"]["ids"], expected["loops"]["ids"])
    assert found["loops"]["fit_loop"] == expected["loops"]["fit_loop"]
    weights = found["state_dict"]
    assert weights["head"].data_ptr() == weights["embed"].data_ptr()  # still tied
    assert weights["row"].data_ptr() == weights["embed"].data_ptr() + 7 * 256 * 4


@pytest.mark.parametrize("mmap", [False, True])
def test_torch_load_reads_the_file_with_its_shared_storage_shared(tmp_path, mmap):
    checkpoint = _checkpoint()
    path = tmp_path / "a.ckpt"
    save_torch_checkpoint(checkpoint, path)
    _assert_same_state(torch.load(path, weights_only=True, mmap=mmap), checkpoint)


def test_every_record_holds_the_bytes_torch_save_writes_at_the_same_offset(tmp_path):
    checkpoint = _checkpoint()
    ours, theirs = io.BytesIO(), io.BytesIO()
    save_torch_file(checkpoint, ours)
    torch.save(checkpoint, theirs)
    assert len(ours.getvalue()) == len(theirs.getvalue())
    found, expected = _records(ours.getvalue()), _records(theirs.getvalue())
    assert found.keys() == expected.keys()
    storages = [name for name in found if name.startswith("data/")]
    assert len(storages) == 6  # embed (with head and row), norm, two empty, step, ids
    for name, (offset, data, crc) in found.items():
        if name == ".data/serialization_id":  # torch derives it from the CRC-32 fields
            continue
        assert (offset, data) == expected[name][:2], name
        # the storages' zip CRC-32 is left unset (the checkpoint's xxh3 covers them)
        assert crc == (0 if name in storages else expected[name][2]), name


def test_a_storage_larger_than_a_piece_is_written_in_pieces(tmp_path, monkeypatch):
    monkeypatch.setattr(torch_file, "PIECE", 64 << 10)
    checkpoint = _checkpoint()
    writes: list[int] = []

    class Recording(io.BytesIO):
        def write(self, data) -> int:
            writes.append(memoryview(data).nbytes)
            return super().write(data)

    sink = Recording()
    save_torch_file(checkpoint, sink)
    assert max(writes) == 64 << 10 and writes.count(64 << 10) == 512 * 256 * 4 // (64 << 10)
    sink.seek(0)
    _assert_same_state(torch.load(sink, weights_only=True), checkpoint)


def test_a_layout_that_does_not_match_its_storages_is_left_to_torch_save(tmp_path, monkeypatch):
    checkpoint = _checkpoint()
    assert plan_layout(checkpoint) is not None
    monkeypatch.setattr(torch_file, "_storage_order", lambda obj: [])  # a torch that differs
    assert plan_layout(checkpoint) is None
    path = tmp_path / "a.ckpt"
    save_torch_checkpoint(checkpoint, path)
    expected = io.BytesIO()
    torch.save(checkpoint, expected)
    assert path.read_bytes() == expected.getvalue()  # torch.save's own file, CRC-32 and all
    forget_verified()
    assert verify_checkpoint(path)


def test_the_checksum_is_computed_beside_the_write_and_covers_every_byte(tmp_path, monkeypatch):
    def no_second_read(*args, **kwargs):
        raise AssertionError("the checkpoint was read back to hash it")

    monkeypatch.setattr(integrity, "file_digest", no_second_read)
    path = tmp_path / "step000003.ckpt"
    save_torch_checkpoint(_checkpoint(), path)
    monkeypatch.undo()
    [entry] = read_checksums(path).files.values()
    assert entry.digest == xxhash.xxh3_128(path.read_bytes()).hexdigest()
    assert entry.bytes == path.stat().st_size


def test_a_truncated_file_is_named_and_the_run_falls_back_to_the_one_before(tmp_path):
    older, newer = tmp_path / "step000002.ckpt", tmp_path / "step000003.ckpt"
    save_torch_checkpoint(_checkpoint(2), older)
    save_torch_checkpoint(_checkpoint(3), newer)
    truncate(newer)
    forget_verified()
    with pytest.raises(CorruptCheckpointError, match=r"step000003\.ckpt' is truncated: "):
        verify_checkpoint(newer)
    assert newest_good_checkpoint(tmp_path) == older


def test_each_gap_is_filled_by_the_storage_its_record_names_in_any_record_order(monkeypatch):
    """Gaps are matched to storages by the record name before them, not by position:
    torch 2.6 wrote records in string order of their keys (0, 1, 10, 11, 2, ...), and
    twelve storages of one size filled in numeric order would pass a size check
    swapped."""
    checkpoint = {f"w{i}": torch.full((64,), float(i)) for i in range(12)}
    storages = torch_file._storage_order(checkpoint)
    layout = plan_layout(checkpoint)
    assert layout is not None
    keys = [
        torch_file._record_key(before)
        for before, gap in zip(layout.pieces, layout.pieces[1:], strict=False)
        if isinstance(before, bytes) and isinstance(gap, int)
    ]
    assert keys == [str(i) for i in range(12)]  # this torch writes them in numeric order
    sink = io.BytesIO()
    save_torch_file(checkpoint, sink)
    sink.seek(0)
    loaded = torch.load(sink, weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in checkpoint.items())

    # records named in string order, as torch 2.6 wrote them: each gap takes its named one
    named = iter(sorted(keys))
    monkeypatch.setattr(torch_file, "_record_key", lambda before: next(named))
    by_name = plan_layout(checkpoint)
    assert by_name is not None
    assert [s._cdata for s in by_name.storages] == [storages[int(k)]._cdata for k in sorted(keys)]
