"""What the console scripts print: each log record once, no library noise.

Three things reach the terminal during a run: log records, Python warnings and the
progress line (:class:`recipes_lib.callbacks.TokenProgressBar`). The console scripts
(:mod:`recipes_lib.cli`) set up the first two here, once per job:

* Log records. Hydra's job logging (``conf/hydra/job_logging/console.yaml``) gives the
  root logger two handlers: :class:`ConsoleHandler` (the message alone, ``warning:`` or
  ``error:`` in front of those) and the job's log file (time and logger name too).
  Lightning adds handlers of its own when it is imported, so each of its records was
  printed twice; :func:`configure_console` removes them, and Lightning's records reach
  the root's handlers like everyone else's.
* Lightning's advertisements ("Tip: ... try installing litlogger / litmodels"), logged
  at every Trainer: dropped.
* Warnings raised inside Lightning's and torch's own code (one library's deprecations
  hit by the other, hints about Lightning's defaults): hidden. Nothing a user of a
  recipe can act on; warnings raised from recipes_lib's code, or attributed to it, show,
  as one ``warning: ...`` line (and in the log file).

``RECIPES_VERBOSE=1`` shows every warning and the full log format again (the
advertisements stay off). A ``-W`` option or ``PYTHONWARNINGS`` also leaves the
warnings alone: the user chose a policy.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from typing import TextIO

VERBOSE_ENV = "RECIPES_VERBOSE"
DETAILED_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"

# Module names whose own warnings are hidden (matched at the start of the name of the
# module a warning is attributed to, as `warnings.filterwarnings(module=...)` does).
LIBRARY_MODULES = r"(lightning|lightning_fabric|lightning_utilities|pytorch_lightning|torch)(\.|$)"
QUIET_CATEGORIES: tuple[type[Warning], ...] = (
    DeprecationWarning,
    PendingDeprecationWarning,
    FutureWarning,
    UserWarning,
)
# Loggers Lightning attaches handlers to when imported (lightning/__init__.py adds an
# "INFO: ..." console handler unconditionally; lightning.pytorch and lightning.fabric
# add one, and stop propagating, when the root logger has none yet).
LIGHTNING_LOGGERS = (
    "lightning",
    "lightning.pytorch",
    "lightning.fabric",
    "pytorch_lightning",
    "lightning_fabric",
)
# Where Lightning's rank_zero_info() logs, advertisements included.
LIGHTNING_RANK_ZERO_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "pytorch_lightning.utilities.rank_zero",
)
ADVERTISEMENT_PREFIX = "💡 Tip:"
# Loggers whose warnings are deprecations or environment notes from library internals:
# peft imports torchao just to probe it, and torchao's import warns about optional
# kernels this interpreter or GPU cannot load and registers types torch has deprecated.
QUIET_LOGGERS = ("torchao", "torch.utils._pytree")


def verbose() -> bool:
    """Whether ``RECIPES_VERBOSE`` asks for everything (any value but empty, 0, false, no, off)."""
    return os.environ.get(VERBOSE_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


class ConsoleHandler(logging.StreamHandler):
    """A handler writing to whatever ``sys.stdout`` is when a record arrives.

    The live progress line replaces ``sys.stdout`` with a proxy that prints above it; a
    handler holding the stream it was built with would print through the line.
    Records logged with ``extra={"console": False}`` (already shown another way) go to
    the other handlers (the log file) only.
    """

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property
    def stream(self) -> TextIO:
        return sys.stdout

    @stream.setter
    def stream(self, value: TextIO) -> None:  # StreamHandler.__init__ assigns one: ignored
        pass

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "console", True) is not False and bool(super().filter(record))


class ConsoleFormatter(logging.Formatter):
    """The message alone; ``warning:`` / ``error:`` in front of warnings and errors.

    With ``RECIPES_VERBOSE=1``, the log file's format (time, logger name, level).
    """

    def __init__(self) -> None:
        self.detailed = verbose()
        super().__init__(DETAILED_FORMAT if self.detailed else "%(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if not self.detailed and record.levelno >= logging.WARNING:
            text = f"{record.levelname.lower()}: {text}"
        return text


class _DropAdvertisements(logging.Filter):
    """Drops Lightning's "Tip: try installing litlogger / litmodels" records.

    Lightning 2.6 logs them at every Trainer it builds, with no switch to turn them off
    (Lightning-AI/pytorch-lightning#21294): the litlogger tip unless a LitLogger is among
    the loggers (logger_connector.py), the litmodels tip whenever it adds its default
    ModelCheckpoint (callback_connector.py). Both go through rank_zero_info(), so they
    are stopped at its logger, by the prefix both share.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(ADVERTISEMENT_PREFIX)


def quiet_library_warnings() -> None:
    """Hide deprecation and user warnings attributed to Lightning's and torch's own modules.

    Does nothing with ``RECIPES_VERBOSE=1`` or when ``-W`` / ``PYTHONWARNINGS`` is given.
    Calling it again moves the filters back to the front (Lightning's import puts one of
    its own there).
    """
    if verbose() or sys.warnoptions:
        return
    for category in QUIET_CATEGORIES:
        warnings.filterwarnings("ignore", category=category, module=LIBRARY_MODULES)


def route_lightning_logs() -> None:
    """Send Lightning's records to the root logger's handlers only, advertisements dropped."""
    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
        logger.propagate = True
    for name in LIGHTNING_RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropAdvertisements) for f in logger.filters):
            logger.addFilter(_DropAdvertisements())


def format_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    line: str | None = None,
) -> str:
    """A warning as one line: its message, the category in front unless a plain
    UserWarning; with ``RECIPES_VERBOSE=1`` where it was raised too. (Python's default
    adds the source line below; Lightning's, installed on import, the file in front.)"""
    text = str(message).strip()
    if verbose():
        return f"{filename}:{lineno}: {category.__name__}: {text}"
    return text if category is UserWarning else f"{category.__name__}: {text}"


def route_warnings() -> None:
    """Shown warnings become log records (``py.warnings``): one line on the console, and
    in the job's log file. Without job logging (other ranks) Python prints them as usual."""
    if logging.getLogger().handlers:
        warnings.formatwarning = format_warning
        logging.captureWarnings(True)


def configure_console() -> None:
    """Set up logging and warnings for a console script's job (after Hydra's job logging)."""
    quiet_library_warnings()  # before the import below: its own warnings too
    import lightning  # noqa: F401 - installs handlers, a warnings filter and format: undone

    route_lightning_logs()
    quiet_library_warnings()
    route_warnings()
    if not verbose():
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
