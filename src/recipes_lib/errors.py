"""Errors raised for bad input. Each message names the key, path, value or record at fault."""


class RecipesError(Exception):
    """Base class of every error recipes-lib raises for bad input."""


class ConfigError(RecipesError):
    """A config value, or a combination of values, that cannot run."""


class DataError(RecipesError):
    """A missing path, an empty dataset, a malformed record or a corrupt shard."""


class CheckpointError(RecipesError):
    """A checkpoint that is missing, corrupt or does not fit the configured model."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint whose bytes differ from the checksum recorded when it was written, or
    that cannot be read whole (truncated, a shard missing).

    Attributes:
        path: the checkpoint (file or folder).
        problem: what is wrong, as a phrase after the path ("is truncated: ...").
    """

    def __init__(self, path: object, problem: str):
        super().__init__(f"checkpoint '{path}' {problem}")
        self.path = path
        self.problem = problem

    def __reduce__(self):  # pickled with its two arguments, not the joined message
        return type(self), (self.path, self.problem)


class UnsupportedKernelError(ConfigError):
    """A kernel backend asked to do what it does not support, or that is not installed."""


class RewardError(RecipesError):
    """A reward function that raised, or returned something other than a finite number,
    for a completion (named with the function and the record)."""


class GateFailed(RecipesError):
    """A pipeline stage whose metrics did not meet one of its gates: the pipeline stops
    after recording the stage's outcome (``recipes-pipeline`` exits with status 3)."""


class RunDirInUse(RecipesError):
    """A run folder another live process is writing (it holds the folder's ``run.lock``)."""


class DiskFullError(RecipesError):
    """No space left on the device while writing a file; what was there before is kept.

    Attributes:
        path: the file being written.
        needed: its size in bytes; with ``at_least``, only what was written before the
            disk filled.
        free: the bytes free on its file system once the torn write was removed.
    """

    def __init__(self, path: object, needed: int, free: int, at_least: bool = False):
        size = f"{'at least ' if at_least else ''}{_bytes(needed)}"
        super().__init__(
            f"no space left on device while writing {path} ({size} needed, {_bytes(free)} free)"
        )
        self.path = path
        self.needed = needed
        self.free = free
        self.at_least = at_least

    def __reduce__(self):  # pickled with its arguments, not the joined message
        return type(self), (self.path, self.needed, self.free, self.at_least)


def _bytes(n: int) -> str:
    """A size in B, KiB, MiB, GiB or TiB with one decimal."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
