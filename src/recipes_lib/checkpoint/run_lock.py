"""One run at a time in a run folder: :func:`hold_run_dir` holds its ``run.lock``.

Two runs writing one ``run.dir`` would each exit 0 and leave one run's ``config.yaml``
beside a mix of both runs' checkpoints. So a run holds an ``fcntl.flock`` on
``<run.dir>/run.lock`` for its whole life, and a second run is refused in one line
naming the holder's process id and host, read from the file's JSON body
(``{"pid", "host", "started"}``).

The operating system keeps the lock and drops it when the process ends, however it
ends: an exception, the exit after a SIGTERM checkpoint, kill -9. A run that ends
normally removes the file; one found whose lock nobody holds was left by a process
that died without releasing it, and is taken over with a line saying so.

Only global rank 0 of a multi-process launch takes it: the other ranks of the same run
write into the same folder by design. A pipeline holds its own folder's lock while each
stage's run holds the stage folder's; they are different files, so one process holds
both without conflict. The pre-launch check trains in a scratch folder and takes none.

flock reaches other hosts where the file system carries it (local disks, NFS on
Linux); where it does not, two hosts could both hold the folder.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from recipes_lib.checkpoint.layout import RunDir
from recipes_lib.errors import RunDirInUse
from recipes_lib.files import disk_full, global_rank, is_disk_full

log = logging.getLogger(__name__)

# what flock fails with on a file system that keeps no locks (some FUSE and network mounts)
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)


class RunLock:
    """The held lock of one run folder (see the module docstring); :meth:`release` it."""

    def __init__(self, path: Path, fd: int | None):
        self.path = path
        self._fd = fd  # None: a file system without locks, nothing held

    @classmethod
    def take(cls, folder: str | os.PathLike) -> RunLock:
        """Hold ``folder``'s lock, taking over one left by a dead process.

        Raises:
            RunDirInUse: a live process holds it (named by its pid and host).
        """
        path = RunDir(folder).lock
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno in _NO_LOCKS:
                    log.warning(
                        "%s: its file system takes no locks (%s); a second run there would "
                        "not be stopped",
                        folder,
                        os.strerror(err.errno),
                    )
                    with contextlib.suppress(OSError):
                        if path.stat().st_size == 0:  # only made by the open above
                            path.unlink()
                    return cls(path, None)
                if err.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                    raise
                raise RunDirInUse(_in_use(Path(folder), _read(path))) from None
            # the holder may have released and removed the file between our open and our
            # lock: then we hold a file nobody else will open, so open the path again
            if _same_file(fd, path):
                break
            os.close(fd)
        left = _read_fd(fd)
        if left:  # a body nobody holds: its process died without releasing
            log.warning(
                "%s: taking over the lock of process %s on %s (started %s), which ended "
                "without releasing it",
                folder,
                left.get("pid", "?"),
                left.get("host", "?"),
                left.get("started", "?"),
            )
        body = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        # written in place, not renamed: the lock belongs to this inode, and a reader
        # that finds the body short says so rather than misreading it
        data = (json.dumps(body) + "\n").encode()
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
            os.fsync(fd)
        except BaseException as err:  # never left holding a lock no run will release
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            if is_disk_full(err):
                raise disk_full(path, len(data)) from err
            raise
        return cls(path, fd)

    def release(self) -> None:
        """Remove the file and drop the lock (once; later calls do nothing)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            # removed while still held, so that no one takes the lock of a file that a
            # newcomer after them would create again beside it
            if _same_file(fd, self.path):
                self.path.unlink(missing_ok=True)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


@contextlib.contextmanager
def hold_run_dir(folder: str | os.PathLike) -> Iterator[RunLock | None]:
    """Hold ``folder``'s lock for the ``with`` block on global rank 0 (None elsewhere),
    released however the block ends.

    Raises:
        RunDirInUse: another live process holds it.
    """
    if global_rank() != 0:
        yield None
        return
    lock = RunLock.take(folder)
    try:
        yield lock
    finally:
        lock.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        held, now = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


def _read_fd(fd: int) -> dict[str, Any]:
    try:
        body = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def _read(path: Path) -> dict[str, Any]:
    try:
        body = json.loads(path.read_bytes() or b"{}")
    except (OSError, ValueError):
        return {}
    return body if isinstance(body, dict) else {}


def _in_use(folder: Path, holder: dict[str, Any]) -> str:
    """The refusal, in one line."""
    if "pid" in holder:
        who = f"process {holder['pid']} on {holder.get('host', 'an unknown host')}"
        since = f" since {holder['started']}" if "started" in holder else ""
    else:  # the holder has just opened it and not yet written its body
        who, since = "another process", ""
    return (
        f"{folder} is in use by {who}{since}, which holds {RunDir(folder).lock.name}; wait "
        "for that run to end, or give this one another folder (run.dir)"
    )
