"""Sharded folders appear whole, with every file's checksum inside, hashed as DCP writes
it (never read back), in the foreground or in the background (one and two gloo
processes here; two under FSDP in tests/integration/test_checkpoint_integrity.py)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import xxhash
from damage import flip_byte, truncate

from recipes_lib.checkpoint import integrity
from recipes_lib.checkpoint.integrity import forget_verified, read_checksums, verify_checkpoint
from recipes_lib.checkpoint.resume import check_checkpoint, newest_good_checkpoint
from recipes_lib.checkpoint.sharded import read_sharded_checkpoint
from recipes_lib.checkpoint.sharded_save import ShardedSaver
from recipes_lib.checkpoint.weights import checkpoint_step
from recipes_lib.errors import CorruptCheckpointError

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo"
)


def _one_process(tmp_path) -> None:
    store = f"file://{tmp_path / 'store'}"
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_sharded_folder_lands_whole_with_its_checksums(tmp_path, asynchronous):
    _one_process(tmp_path)
    landed = []
    saver = ShardedSaver(timedelta(minutes=1), on_landed=landed.append)
    weight = torch.randn(64, 64)
    saved = weight.clone()
    path = tmp_path / "step000003.ckpt"
    saver.save({"state_dict": {"w": weight}}, {"global_step": 3}, path, asynchronous=asynchronous)
    weight.add_(1.0)  # training goes on; the checkpoint keeps the weights it was given
    saver.close()
    assert landed == [path]
    assert not list(tmp_path.glob(".*partial"))
    record = read_checksums(path)
    assert record.global_step == 3 == checkpoint_step(path)
    assert {".metadata", "meta.pt"} <= set(record.files)
    assert verify_checkpoint(path)
    assert torch.equal(read_sharded_checkpoint(path)["w"], saved)
    [timing] = saver.timings
    assert timing.asynchronous is asynchronous and timing.bytes > 64 * 64 * 4
    assert 0 <= timing.blocked_s <= timing.finished_s
    flip_byte(path)
    with pytest.raises(CorruptCheckpointError, match=r"has __0_0\.distcp, which differs"):
        verify_checkpoint(path)


def test_a_failed_background_save_fails_the_next_wait(tmp_path, monkeypatch):
    _one_process(tmp_path)
    saver = ShardedSaver(timedelta(minutes=1))

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("recipes_lib.checkpoint.sharded_save.write_checksums", broken)
    path = tmp_path / "step000001.ckpt"
    saver.save({"state_dict": {"w": torch.ones(4)}}, {"global_step": 1}, path, asynchronous=True)
    with pytest.raises(Exception, match="background save of .*step000001.ckpt' failed: disk full"):
        saver.wait()
    assert not path.exists()  # never renamed into place
    saver.close()


def test_a_sharded_folder_without_checksums_is_checked_by_its_metadata(tmp_path):
    _one_process(tmp_path)
    saver = ShardedSaver(timedelta(minutes=1))
    path = tmp_path / "step000002.ckpt"
    saver.save({"state_dict": {"w": torch.ones(256)}}, {"global_step": 2}, path, False)
    (path / "sha256.json").unlink()  # as written before checksums
    assert check_checkpoint(path) is False  # loadable: accepted without a checksum
    assert newest_good_checkpoint(tmp_path) == path
    truncate(path)
    with pytest.raises(CorruptCheckpointError, match=r"has __0_0\.distcp truncated"):
        check_checkpoint(path)


def _no_second_read(*args, **kwargs):
    raise AssertionError("a checkpoint file was read back to hash it")


def _assert_record_matches_the_files(path: Path) -> None:
    record = read_checksums(path)
    for name, entry in record.files.items():
        data = (path / name).read_bytes()
        assert (entry.bytes, entry.digest) == (len(data), xxhash.xxh3_128(data).hexdigest()), name
    forget_verified()
    assert verify_checkpoint(path)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_every_file_is_hashed_as_it_is_written(tmp_path, monkeypatch, asynchronous):
    _one_process(tmp_path)
    monkeypatch.setattr(integrity, "file_digest", _no_second_read)
    saver = ShardedSaver(timedelta(minutes=1))
    path = tmp_path / "step000004.ckpt"
    state = {"state_dict": {"w": torch.randn(512, 512), "b": torch.randn(3)}}
    saver.save(state, {"global_step": 4, "loops": {"seen": [1]}}, path, asynchronous)
    saver.close()
    monkeypatch.undo()
    assert set(read_checksums(path).files) == {"__0_0.distcp", ".metadata", "meta.pt"}
    _assert_record_matches_the_files(path)


def _save_on_rank(rank: int, store: str, path: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        integrity.file_digest = _no_second_read  # this process only
        saver = ShardedSaver(timedelta(minutes=1))
        weights = torch.full((256, 256), float(rank))  # a tensor of each rank's own
        saver.save({"state_dict": {f"w{rank}": weights}}, {"global_step": 5}, Path(path), True)
        weights.add_(1.0)  # training goes on while the shard is written
        saver.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes import the library: about 40 s on two cores
def test_two_ranks_hash_their_own_shards_as_they_write_them_in_the_background(tmp_path):
    path = tmp_path / "step000005.ckpt"
    mp.spawn(_save_on_rank, args=(str(tmp_path / "store"), str(path)), nprocs=2, join=True)
    files = set(read_checksums(path).files)
    assert files == {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"}
    _assert_record_matches_the_files(path)
    weights = read_sharded_checkpoint(path)
    assert torch.equal(weights["w0"], torch.zeros(256, 256))
    assert torch.equal(weights["w1"], torch.ones(256, 256))
