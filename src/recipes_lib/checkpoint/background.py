"""One checkpoint written at a time in the background, and its failure never lost.

A save that returns before its files are on disk hands the writing to
:class:`BackgroundWrite`: one thread, at most one write in flight. The next save, a
load or the end of the run waits for it first (:meth:`BackgroundWrite.wait`), and a
write that failed raises there, naming the checkpoint. Both the single-file checkpoints
(:mod:`recipes_lib.checkpoint.io`) and the sharded folders
(:mod:`recipes_lib.checkpoint.sharded_save`) write through it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from recipes_lib.errors import CheckpointError


class BackgroundWrite:
    """A single writer thread and the one checkpoint it may be writing."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._pending: tuple[Future, Path] | None = None

    def submit(self, path: Path, write: Callable[..., Any], *args: Any) -> None:
        """Start ``write(*args)``, which writes the checkpoint ``path``, on the thread.
        The caller has waited for any earlier write (:meth:`wait`)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._pending = (self._executor.submit(write, *args), path)

    def wait(self) -> None:
        """Block until the write in flight (if any) is done.

        Raises:
            CheckpointError: it failed (naming the checkpoint and the error).
        """
        if self._pending is None:
            return
        (pending, path), self._pending = self._pending, None
        try:
            pending.result()
        except Exception as err:
            raise CheckpointError(f"the background save of '{path}' failed: {err}") from err

    def close(self) -> None:
        """Wait for the write in flight, then stop the thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
