"""recipes_lib.console: Lightning's records once, no advertisements, library warnings hidden."""

import io
import logging
import warnings

import pytest

from recipes_lib import console


@pytest.fixture
def lightning_loggers():
    """Restore the handlers, propagation and filters the tests change."""
    names = console.LIGHTNING_LOGGERS + console.LIGHTNING_RANK_ZERO_LOGGERS
    saved = {}
    for name in names:
        logger = logging.getLogger(name)
        saved[name] = (list(logger.handlers), logger.propagate, list(logger.filters))
    yield
    for name, (handlers, propagate, filters) in saved.items():
        logger = logging.getLogger(name)
        logger.handlers[:], logger.propagate, logger.filters[:] = handlers, propagate, filters


def _warn_from(module: str, category: type[Warning]) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        console.quiet_library_warnings()
        warnings.warn_explicit("old API", category, f"{module}.py", 1, module=module)
    return caught


@pytest.mark.parametrize(
    "module", ["lightning.pytorch.utilities._pytree", "torch.utils._pytree", "lightning_fabric"]
)
@pytest.mark.parametrize("category", [DeprecationWarning, FutureWarning, UserWarning])
def test_library_warnings_are_hidden(monkeypatch, module, category):
    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    monkeypatch.setattr("sys.warnoptions", [])
    assert _warn_from(module, category) == []


def test_our_warnings_and_other_kinds_still_show(monkeypatch):
    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    monkeypatch.setattr("sys.warnoptions", [])
    assert len(_warn_from("recipes_lib.train", UserWarning)) == 1
    assert len(_warn_from("torchvision_like", DeprecationWarning)) == 1  # not torch itself
    assert len(_warn_from("torch.cuda", RuntimeWarning)) == 1


def test_verbose_or_a_warnings_option_shows_everything(monkeypatch):
    monkeypatch.setenv(console.VERBOSE_ENV, "1")
    monkeypatch.setattr("sys.warnoptions", [])
    assert console.verbose()
    assert len(_warn_from("lightning.pytorch.trainer", DeprecationWarning)) == 1
    monkeypatch.setenv(console.VERBOSE_ENV, "0")
    assert not console.verbose()
    monkeypatch.setattr("sys.warnoptions", ["default"])
    assert len(_warn_from("lightning.pytorch.trainer", DeprecationWarning)) == 1


def test_lightning_records_reach_the_root_handlers_once(lightning_loggers, monkeypatch):
    import lightning  # noqa: F401 - its import attaches the handlers being removed

    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    console.route_lightning_logs()
    console.route_lightning_logs()  # idempotent: one filter, no handler
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(console.ConsoleFormatter())
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
        assert len(rank_zero.filters) == 1
        rank_zero.info("GPU available: False, used: False")
        rank_zero.info("💡 Tip: For seamless cloud logging ... try installing [litlogger]")
        logging.getLogger("lightning.pytorch.trainer").warning("something to know")
    finally:
        root.removeHandler(handler)
    assert stream.getvalue() == "GPU available: False, used: False\nwarning: something to know\n"
    assert all(not logging.getLogger(n).handlers for n in console.LIGHTNING_LOGGERS)


def test_console_handler_writes_to_the_stdout_of_the_moment(monkeypatch):
    handler = console.ConsoleHandler()
    handler.setFormatter(console.ConsoleFormatter())
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr("sys.stdout", first)
    handler.emit(logging.makeLogRecord({"msg": "one", "levelno": logging.INFO}))
    monkeypatch.setattr("sys.stdout", second)  # e.g. the live progress line's proxy
    handler.handle(
        logging.makeLogRecord({"msg": "two", "levelno": logging.ERROR, "levelname": "ERROR"})
    )
    handler.handle(logging.makeLogRecord({"msg": "file only", "console": False}))
    assert first.getvalue() == "one\n" and second.getvalue() == "error: two\n"


def test_a_warning_is_one_line(monkeypatch):
    monkeypatch.delenv(console.VERBOSE_ENV, raising=False)
    skipped = UserWarning("data.sources.x: skipped 3 of 20 records")
    assert console.format_warning(skipped, UserWarning, "/a/b.py", 7, "warn(...)") == (
        "data.sources.x: skipped 3 of 20 records"
    )
    assert console.format_warning("old", FutureWarning, "/a/b.py", 7) == "FutureWarning: old"
    monkeypatch.setenv(console.VERBOSE_ENV, "1")
    assert console.format_warning("old", FutureWarning, "/a/b.py", 7) == (
        "/a/b.py:7: FutureWarning: old"
    )
