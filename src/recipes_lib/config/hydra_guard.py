"""What of Hydra's own config may run code, checked before Hydra acts on it.

Hydra builds every entry of ``hydra.callbacks`` and hands ``hydra.job_logging`` and
``hydra.hydra_logging`` to :func:`logging.config.dictConfig`, whose ``()`` factories,
``class`` keys and ``ext://`` values import and call what they name. It does so before
the task function starts, so a recipe, a pipeline file or an override could run code
before any check of the run. A console script therefore composes its config first, with
the same arguments (:func:`check_hydra_app`), and refuses, naming the key:

- a ``hydra.callbacks`` entry other than a shipped one (``sweep_check``) as shipped;
- in a logging config, a ``()`` factory that no shipped logging config uses (the
  project's ``hydra/job_logging/console`` or Hydra's own), a ``class`` that is not a
  handler, formatter or filter class of :mod:`logging`, an ``ext://`` value other than
  ``sys.stdout`` and ``sys.stderr`` (it imports what it names), and a log file elsewhere
  than the shipped configs put it or opened other than for appending (a log line
  written into a shell's start-up file is a command);
- any other ``_target_`` under ``hydra`` than the launcher's and the sweeper's, which
  Hydra builds only from its installed plugins.

Levels, formats and the handlers of :mod:`logging` stay the user's to change. A sweep's
jobs compose their own configs, so each choice of a swept group (``recipe=a,b``) is
composed and checked as well; swept values cannot reach ``hydra``. The same composition
checks that ``run.allowed_targets`` comes from the command line
(:mod:`recipes_lib.config.widening`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import io
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import yaml
from omegaconf import DictConfig, OmegaConf

from recipes_lib.config.store import conf_dir, moved_key_of
from recipes_lib.config.widening import check_composed_widening
from recipes_lib.errors import ConfigError

LOGGING_KEYS = ("hydra.job_logging", "hydra.hydra_logging")
PLUGIN_TARGETS = ("hydra.launcher._target_", "hydra.sweeper._target_")
SHIPPED_ROOTS = ("config.yaml", "pipeline_root.yaml")
STANDARD_STREAMS = ("ext://sys.stdout", "ext://sys.stderr")
LOGGING_BASES = (logging.Handler, logging.Formatter, logging.Filter)


@functools.cache
def shipped_callbacks() -> dict[str, Any]:
    """The ``hydra.callbacks`` entries of the shipped root configs, by name."""
    entries: dict[str, Any] = {}
    for name in SHIPPED_ROOTS:
        root = yaml.safe_load((conf_dir() / name).read_text()) or {}
        entries.update((root.get("hydra") or {}).get("callbacks") or {})
    return entries


@functools.cache
def _shipped_logging_values() -> dict[str, frozenset[Any]]:
    """The values of the shipped logging configs (ours and Hydra's), by last key."""
    import hydra

    folders = [conf_dir() / "hydra" / "job_logging"]
    folders += [
        Path(hydra.__file__).parent / "conf" / "hydra" / g for g in ("job_logging", "hydra_logging")
    ]
    values: dict[str, set[Any]] = {}
    for folder in folders:
        for file in folder.glob("*.yaml"):
            for key, value in _leaves(yaml.safe_load(file.read_text()) or {}, ""):
                values.setdefault(key.rsplit(".", 1)[-1], set()).add(value)
    return {key: frozenset(found) for key, found in values.items()}


def shipped_factories() -> frozenset[str]:
    """Every ``()`` and ``class`` value of the shipped logging configs."""
    values = _shipped_logging_values()
    return values.get("()", frozenset()) | values.get("class", frozenset())


def shipped_filenames() -> frozenset[str]:
    """Every log file name of the shipped logging configs (in the job's output folder)."""
    return _shipped_logging_values().get("filename", frozenset())


def _leaves(node: Any, key: str) -> Iterator[tuple[str, Any]]:
    """Every value of a nested mapping or list that is neither, with its dotted key."""
    if isinstance(node, Mapping):
        for name, value in node.items():
            yield from _leaves(value, f"{key}.{name}" if key else str(name))
    elif isinstance(node, list | tuple):
        for index, value in enumerate(node):
            yield from _leaves(value, f"{key}[{index}]")
    else:
        yield key, node


def _is_logging_class(path: Any) -> bool:
    """A handler, formatter or filter class of :mod:`logging` (only ``logging`` and
    ``logging.handlers`` are imported to tell)."""
    if not isinstance(path, str):
        return False
    module, _, name = path.rpartition(".")
    if module not in ("logging", "logging.handlers"):
        return False
    obj = getattr(importlib.import_module(module), name, None)
    return inspect.isclass(obj) and issubclass(obj, LOGGING_BASES)


def _check_logging(cfg: DictConfig, key: str) -> None:
    node = OmegaConf.select(cfg, key)
    if node is None:
        return
    for where, value in _leaves(OmegaConf.to_container(node, resolve=False), key):
        last = where.rsplit(".", 1)[-1]
        if last == "()" and value not in shipped_factories():
            raise ConfigError(
                f"{where}: {value!r} is not a factory of a shipped logging config; Hydra "
                "would call it before the run starts"
            )
        if last == "class" and value not in shipped_factories() and not _is_logging_class(value):
            raise ConfigError(
                f"{where}: {value!r} is not a handler, formatter or filter class of the "
                "logging module; Hydra would call it before the run starts"
            )
        if last == "filename" and value not in shipped_filenames():
            raise ConfigError(
                f"{where}: {value!r}: a log file stays where the shipped logging configs "
                "put it, in the job's output folder"
            )
        if last == "mode" and value != "a":
            raise ConfigError(f"{where}: {value!r}: a log file is only appended to")
        if isinstance(value, str) and "${" in value:
            try:  # what dictConfig would be given; runtime values do not resolve yet
                value = OmegaConf.select(cfg, where, throw_on_resolution_failure=True)
            except Exception:  # noqa: BLE001 - left to Hydra, which resolves it later
                continue
        if isinstance(value, str) and value.startswith("ext://") and value not in STANDARD_STREAMS:
            raise ConfigError(
                f"{where}: {value!r} imports what it names; a logging config may name "
                f"only {' or '.join(STANDARD_STREAMS)}"
            )


def _check_callbacks(cfg: DictConfig) -> None:
    node = OmegaConf.select(cfg, "hydra.callbacks")
    entries: dict[str, Any] = {}
    if node is not None:  # a mapping, whose container is a dict of names
        entries = cast(dict[str, Any], OmegaConf.to_container(node, resolve=False)) or {}
    shipped = shipped_callbacks()
    for name, entry in entries.items():
        if entry is not None and entry != shipped.get(name):
            raise ConfigError(
                f"hydra.callbacks.{name}: Hydra runs only the shipped callbacks "
                f"({', '.join(sorted(shipped))}), as shipped; it would build this one before "
                "the run starts"
            )


def _check_other_targets(cfg: DictConfig) -> None:
    hydra_node = OmegaConf.to_container(cfg.hydra, resolve=False)
    for where, _ in _leaves(hydra_node, "hydra"):
        if where.endswith("._target_") and where not in PLUGIN_TARGETS:
            if not where.startswith("hydra.callbacks."):
                raise ConfigError(f"{where}: Hydra would build it before the run starts")


def check_hydra_config(cfg: DictConfig) -> None:
    """Refuse what in ``cfg.hydra`` would run code that is not shipped (module docstring).

    Raises:
        ConfigError: naming the key.
    """
    _check_callbacks(cfg)
    for key in LOGGING_KEYS:
        _check_logging(cfg, key)
    _check_other_targets(cfg)


def _job_overrides(cfg: DictConfig, overrides: Sequence[str], loader: Any) -> list[list[str]]:
    """The overrides of each job of a sweep as far as ``hydra`` can differ between them:
    each combination of swept group choices (``recipe=a,b``). A swept value
    (``optim.lr=1e-3,1e-4``) cannot reach ``hydra`` (Hydra refuses sweeps of its own
    keys), so it is left out."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = OmegaConf.select(cfg, "hydra.sweeper.params") or {}
    lines = [*overrides, *(f"{key}={value}" for key, value in params.items())]
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(lines)
    kept = [o for o in parsed if not o.is_sweep_override() or "." not in o.key_or_group]
    if not any(o.is_sweep_override() for o in kept):
        return []
    return BasicSweeper.split_arguments(kept, None)[0]


def check_hydra_app(
    task_function: Callable[..., Any], config_path: str, config_name: str, argv: Sequence[str]
) -> None:
    """Compose a Hydra app's config from its command line as Hydra will, and refuse
    what in it would run code before the task function (:func:`check_hydra_config`) or
    widen ``run.allowed_targets`` from a file.

    Left to Hydra: shell completion (it composes, but configures and builds nothing) and
    a command line Hydra cannot read or compose (it says why, before acting on it).

    Raises:
        ConfigError: naming the key; ``--experimental-rerun`` (it unpickles a file).
    """
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import (
        create_automatic_config_search_path,
        detect_calling_file_or_module_from_task_function,
        detect_task_name,
        get_args_parser,
    )
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    try:
        with contextlib.redirect_stderr(io.StringIO()):  # Hydra prints its own usage
            args = get_args_parser().parse_args(list(argv))
    except SystemExit:
        return
    if args.shell_completion:
        return
    if args.experimental_rerun:
        raise ConfigError(
            "--experimental-rerun: a pickled config can run any code; run the command again"
        )
    calling_file, calling_module = detect_calling_file_or_module_from_task_function(task_function)
    search_path = create_automatic_config_search_path(
        calling_file, calling_module, args.config_path or config_path
    )
    if args.config_dir is not None:
        from hydra.core.config_search_path import SearchPathQuery

        search_path.prepend(
            provider="command-line",
            path=f"file://{Path(args.config_dir).resolve()}",
            anchor=SearchPathQuery(provider="schema"),
        )
    name = args.config_name or config_name
    try:
        hydra_app = Hydra.create_main_hydra2(
            detect_task_name(calling_file, calling_module), search_path
        )
        compose = functools.partial(hydra_app.compose_config, name, with_log_configuration=False)
        # composed as Hydra will compose it, so a config that fails here fails there too
        mode = RunMode.MULTIRUN if args.multirun else RunMode.RUN
        try:
            cfg = compose(list(args.overrides), mode, validate_sweep_overrides=False)
        except Exception as err:  # noqa: BLE001 - Hydra reports it, before acting on anything
            moved = moved_key_of(err)  # a key that moved: one line naming where it went
            if moved is not None:
                raise ConfigError(moved) from err
            return
        checked = [(cfg, list(args.overrides))]
        try:
            jobs = _job_overrides(cfg, args.overrides, hydra_app.config_loader)
        except Exception:  # noqa: BLE001 - Hydra's sweeper cannot expand them either
            jobs = []
        for job in jobs:
            try:
                checked.append((compose(job, RunMode.RUN), job))
            except Exception:  # noqa: BLE001 - that job fails in Hydra's own composition
                continue
        for composed, overrides in checked:
            check_hydra_config(composed)
            check_composed_widening(composed, overrides)
    finally:
        GlobalHydra.instance().clear()
