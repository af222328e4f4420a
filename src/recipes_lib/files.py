"""Files written so that a reader never sees half of one, and which process writes them.

Every file the library writes goes through :func:`write_atomic`: the content goes to a
hidden temporary name in the target's folder, is flushed to disk, takes the mode a
plain ``open(path, "w")`` would give it (the umask's), and is renamed into place; the
folder is then synced so the rename survives a crash. An interrupted write leaves the
old file, or none, never a torn one; a disk that fills meanwhile is one
:class:`~recipes_lib.errors.DiskFullError` naming the file, its size and the space free.

:func:`global_rank` says which process of a multi-process launch this is, before and
after the process group exists: only rank 0 writes configs, manifests and reports.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import secrets
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from recipes_lib.errors import DiskFullError

# what a write fails with when its file system is full, or its owner's quota is spent
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _umask() -> int:
    # /proc reports the umask without changing it; os.umask() can only read it by setting
    # it, and another thread creating a file meanwhile would get the temporary mask
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o077)  # the strictest mask for the moment it is read
    os.umask(mask)
    return mask


def chmod_as_umask(path: str | os.PathLike) -> None:
    """Give ``path`` the mode a plain ``open(path, "w")`` would: 0o666 less the umask.

    safetensors and ``tempfile`` create their files readable by their owner only (0600);
    without this an output would be private whatever the umask says.
    """
    os.chmod(path, 0o666 & ~_umask())


def fsync_dir(directory: str | os.PathLike) -> None:
    """Make a rename inside ``directory`` durable (where the platform allows it)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # not possible on every platform; the rename is still atomic
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(
    path: str | os.PathLike, write: Callable[[Path], object], size: int | None = None
) -> Path:
    """Write ``path`` atomically: ``write(temporary)`` fills a hidden file beside it,
    which is synced, given the umask's mode and renamed into place.

    Args:
        path: the file to write; its folder is created if needed.
        write: writes the whole content to the path it is given.
        size: the bytes it will write, where known: what a full disk is said to need.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        DiskFullError: the file system filled (or a quota ran out) during the write.
        whatever else ``write`` or the file system raises. ``path`` is then left as it
            was and the temporary file removed.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.partial")
    try:
        write(partial)
        with open(partial, "rb+") as f:
            os.fsync(f.fileno())
        chmod_as_umask(partial)
        os.replace(partial, target)
    except BaseException as err:
        written = 0
        with contextlib.suppress(OSError):  # the write's own error is the one to tell
            written = partial.stat().st_size if partial.is_file() else 0
            partial.unlink(missing_ok=True)
        if is_disk_full(err):
            raise disk_full(target, size if size is not None else written, size is None) from err
        raise
    fsync_dir(target.parent)
    return target


def disk_full(path: Path, needed: int, at_least: bool = False) -> DiskFullError:
    """The error of a write to ``path`` that filled its disk: ``needed`` bytes, and the
    space free on its file system now (0 where even that cannot be read)."""
    free = 0
    with contextlib.suppress(OSError):
        free = shutil.disk_usage(path.parent).free
    return DiskFullError(path, needed, free, at_least=at_least)


def is_disk_full(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) says the disk is full.

    ``torch.save`` into a file reports a short write from its zip writer as a
    ``RuntimeError`` ("... unexpected pos N vs M") rather than the ``OSError`` below it.
    """
    seen: BaseException | None = err
    for _ in range(8):  # the chain of causes is short; never follow a cycle for ever
        if seen is None:
            return False
        if isinstance(seen, OSError) and seen.errno in _DISK_FULL:
            return True
        if isinstance(seen, RuntimeError) and "unexpected pos" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """:func:`write_atomic` of ``text`` (UTF-8)."""
    data = text.encode("utf-8")
    return write_atomic(path, lambda tmp: tmp.write_bytes(data), size=len(data))


def write_json_atomic(path: str | os.PathLike, data: Any, **dumps: Any) -> Path:
    """:func:`write_atomic` of ``data`` as indented JSON and a final newline; ``dumps``
    are :func:`json.dumps` arguments (``default=str``, ``allow_nan=False``...)."""
    return write_text_atomic(path, json.dumps(data, indent=2, **dumps) + "\n")


# how transformers' config.json spells the floats JSON has no literal for
FLOAT_TAG = "__float__"
_TAGGED = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def tag_floats(value: Any) -> Any:
    """``value`` with every infinite or nan float (inside dicts, lists and tuples) as
    ``{"__float__": "Infinity"}`` (``-Infinity``, ``NaN``): strict JSON, read back by
    :func:`untag_float`."""
    if isinstance(value, float) and not math.isfinite(value):
        return {
            FLOAT_TAG: "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
        }
    if isinstance(value, dict):
        return {key: tag_floats(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [tag_floats(item) for item in value]
    return value


def untag_float(value: dict[str, Any]) -> Any:
    """A ``json.loads`` ``object_hook``: the float of a ``{"__float__": ...}`` object
    (transformers' and :func:`tag_floats`'), every other object as it is."""
    if len(value) == 1 and value.get(FLOAT_TAG) in _TAGGED:
        return _TAGGED[value[FLOAT_TAG]]
    return value


def copy_atomic(source: str | os.PathLike, path: str | os.PathLike) -> Path:
    """:func:`write_atomic` of a copy of ``source``'s bytes."""
    size = os.path.getsize(source)
    return write_atomic(path, lambda tmp: shutil.copyfile(source, tmp), size=size)


def move_aside(path: str | os.PathLike, tag: str = "old") -> Path:
    """Rename ``path`` (a file or folder) to ``<name>.<tag>-<time>`` beside it, never
    over anything (``-2``, ``-3``... when that name is taken); nothing is deleted.
    Returns the new path."""
    import time

    source = Path(path)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = source.with_name(f"{source.name}.{tag}-{stamp}")
    counter = 1
    while target.exists():
        counter += 1
        target = source.with_name(f"{source.name}.{tag}-{stamp}-{counter}")
    source.rename(target)
    return target


def global_rank() -> int:
    """This process's global rank: the process group's when it exists, else the one a
    launcher exported (``RANK``, SLURM's ``SLURM_PROCID``; ``LOCAL_RANK`` on node 0); 0
    for a process started alone, -1 on another node of a launcher that exports none.
    A process that never imported torch has no process group and does not import it
    here (a refused command stays quick)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for variable in ("RANK", "SLURM_PROCID"):
        value = os.environ.get(variable, "").strip()
        if value.isdigit():
            return int(value)
    if os.environ.get("NODE_RANK", "0") == "0":
        return int(os.environ.get("LOCAL_RANK", "0"))
    return -1
