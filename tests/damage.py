"""Damage a checkpoint the way a disk or an interrupted copy does, for the integrity tests:
one flipped byte (the file still loads, its weights are wrong) or a truncation. A
sharded folder is damaged in its largest shard. Imported as ``from damage import ...``."""

from __future__ import annotations

from pathlib import Path


def _target(path: Path) -> Path:
    """The file to damage: the checkpoint file itself (through a link), or a sharded
    folder's largest ``.distcp`` shard."""
    real = Path(path).resolve()
    if real.is_dir():
        return max(real.glob("*.distcp"), key=lambda p: p.stat().st_size)
    return real


def flip_byte(path: Path, at: float = 0.5) -> Path:
    """Invert one byte at fraction ``at`` of the file (tensor data, in a checkpoint of any
    size); returns the file changed."""
    target = _target(path)
    with open(target, "r+b") as f:
        f.seek(int(target.stat().st_size * at))
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    return target


def truncate(path: Path, keep: float = 0.6) -> Path:
    """Cut the file to fraction ``keep`` of its size; returns the file changed."""
    target = _target(path)
    with open(target, "r+b") as f:
        f.truncate(int(target.stat().st_size * keep))
    return target
