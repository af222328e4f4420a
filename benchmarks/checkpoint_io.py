"""Checkpoint write speed against the disk's own, in one run.

Measures, on the same folder:

- the disk's sequential write speed: one large ``os.write`` stream and ``fsync``;
- checksum throughput on one core: xxh3_128 (what checkpoints record) and SHA-256;
- ``torch.save`` alone into a file, then fsync (how checkpoints were written before
  they were written in large writes: ``torch_save_gbps``);
- a foreground save (``save_torch_checkpoint``: the same file in large writes, checksum
  beside them, fsync, rename) in GB/s and as a ratio to the disk's speed;
- a background save (``VerifiedCheckpointIO(asynchronous=True)``): the seconds the
  training step is blocked (the copy to host memory) and until the file is in place.

The state is a full training state: bf16 weights plus fp32 AdamW moments and an fp32
master copy (about 15 GB for a 1B model, the default size). On a GPU the tensors live
on the GPU and the result goes to ``benchmarks/results/checkpoint_io_<card>.json``;
on the CPU it is a smoke test (``--size-gb 0.2``) and prints the JSON. With
``--repeat N`` the disk, ``torch.save`` and the foreground save are measured N times,
taking turns, and each figure is the median (a shared disk's speed varies).

    python benchmarks/checkpoint_io.py --size-gb 15
    python benchmarks/checkpoint_io.py --size-gb 0.2 --dir /tmp --repeat 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import xxhash

from recipes_lib.checkpoint.integrity import (
    forget_verified,
    save_torch_checkpoint,
    tensor_bytes,
    verify_checkpoint,
)
from recipes_lib.checkpoint.io import VerifiedCheckpointIO

GB = 1e9
_BLOCK = 64 << 20


def disk_write_gbps(folder: Path, size: int) -> float:
    """Sequential write speed of ``folder``'s disk: ``size`` bytes, then fsync."""
    block = os.urandom(_BLOCK)
    path = folder / "disk_speed.bin"
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = 0
        while written < size:
            written += os.write(fd, block[: min(_BLOCK, size - written)])
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - started
    path.unlink()
    return written / seconds / GB


def torch_save_gbps(folder: Path, state: dict) -> tuple[float, int]:
    """``torch.save`` into a file and fsync: GB/s and the file's size."""
    path = folder / "torch_save.ckpt"
    started = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    size = path.stat().st_size
    path.unlink()
    return size / seconds / GB, size


def save_seconds(folder: Path, state: dict) -> tuple[float, int]:
    """A foreground ``save_torch_checkpoint``: seconds and the file's size."""
    path = folder / "sync.ckpt"
    started = time.perf_counter()
    save_torch_checkpoint(state, path)
    seconds = time.perf_counter() - started
    size = path.stat().st_size
    path.unlink()
    return seconds, size


def hash_gbps(algorithm, size: int = 1 << 28) -> float:
    """One core's checksum throughput over ``size`` bytes."""
    data = os.urandom(size)
    started = time.perf_counter()
    algorithm(data).hexdigest()
    return size / (time.perf_counter() - started) / GB


def training_state(size_gb: float, device: torch.device) -> dict:
    """A Lightning-like checkpoint of about ``size_gb``: per parameter 2 bytes of bf16
    weights and 12 bytes of fp32 master weights and AdamW moments (14 bytes)."""
    params = int(size_gb * GB / 14)
    rows = 4096
    shapes = [(rows, params // rows // 16)] * 16
    state_dict = {f"w{i}": torch.randn(s, device=device).bfloat16() for i, s in enumerate(shapes)}
    optim = {
        i: {
            "step": torch.tensor(100.0),
            "master": torch.randn(s, device=device),
            "exp_avg": torch.randn(s, device=device),
            "exp_avg_sq": torch.rand(s, device=device),
        }
        for i, s in enumerate(shapes)
    }
    return {
        "global_step": 100,
        "state_dict": state_dict,
        "optimizer_states": [{"state": optim, "param_groups": [{"lr": 1e-4}]}],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=15.0, help="checkpoint size (GB)")
    parser.add_argument("--dir", default=None, help="folder on the disk to measure")
    parser.add_argument("--out", default=None, help="result JSON (GPU default: results/)")
    parser.add_argument("--repeat", type=int, default=1, help="measurements of each write")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    card = torch.cuda.get_device_name().replace(" ", "_") if cuda else "cpu"
    state = training_state(args.size_gb, device)
    size = tensor_bytes(state)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        disks, torch_saves, saves = [], [], []
        for _ in range(args.repeat):  # taking turns, so a slower spell hits all three
            disks.append(disk_write_gbps(folder, size))
            torch_saves.append(torch_save_gbps(folder, state)[0])
            seconds, file_bytes = save_seconds(folder, state)
            saves.append(seconds)
        disk = statistics.median(disks)
        sync_s = statistics.median(saves)

        plugin = VerifiedCheckpointIO(asynchronous=True)
        plugin.save_checkpoint(state, folder / "warm.ckpt")  # the host buffers, allocated once
        plugin.wait()
        started = time.perf_counter()
        plugin.save_checkpoint(state, folder / "async.ckpt")
        blocked_s = plugin.blocked_s
        plugin.teardown()
        async_s = time.perf_counter() - started

        started = time.perf_counter()
        forget_verified()
        assert verify_checkpoint(folder / "async.ckpt")
        verify_s = time.perf_counter() - started
    save_gbps = file_bytes / sync_s / GB
    result = {
        "card": card,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": f"python benchmarks/checkpoint_io.py --size-gb {args.size_gb}"
        + (f" --repeat {args.repeat}" if args.repeat > 1 else ""),
        "checkpoint_gb": file_bytes / GB,
        "disk_write_gbps": disk,
        "save_gbps": save_gbps,
        "save_to_disk_ratio": save_gbps / disk,
        "save_s": sync_s,
        "torch_save_gbps": statistics.median(torch_saves),
        "torch_save_to_disk_ratio": statistics.median(torch_saves) / disk,
        "repeat": args.repeat,
        "async_blocked_s": blocked_s,
        "async_total_s": async_s,
        "async_save_gbps": file_bytes / async_s / GB,
        "verify_s": verify_s,
        "xxh3_128_gbps_one_core": hash_gbps(xxhash.xxh3_128),
        "sha256_gbps_one_core": hash_gbps(hashlib.sha256),
    }
    text = json.dumps(result, indent=2)
    print(text)
    out = args.out or (f"benchmarks/results/checkpoint_io_{card}.json" if cuda else None)
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")


if __name__ == "__main__":
    main()
