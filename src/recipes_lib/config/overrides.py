"""Overrides checked before Hydra composes them: a group option or a key that does not
exist is named with the closest ones, and a value the key's declared type cannot hold is
refused.

Hydra's own message for ``recipe=sft/ful`` lists its search path, for ``optim.lrr=1``
suggests ``+optim.lrr=1``, which the typed schema then refuses as well, and for
``optim.lr=abc`` spans a dozen lines. Here each is one line::

    recipe=sft/ful: no such recipe (did you mean sft/full?)
    optim.lrr=1: no such key (did you mean optim.lr?)
    optim.lr=abc: Value 'abc' of type 'str' could not be converted to Float

Group options are the YAML files under the shipped ``conf/<group>/`` (and under
``--config-dir``); keys are the fields of the root schema's dataclasses, down to the
first field whose keys are open (``data.sources``, ``callbacks``, ``stages``). A value is
tried on the dataclass that declares its key, as OmegaConf checks it when Hydra merges
it (:func:`wrong_value`).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import typing
from collections.abc import Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from recipes_lib.config.objectives import moved_line, stage_schema
from recipes_lib.config.schema import StageConfig
from recipes_lib.config.store import conf_dir
from recipes_lib.errors import ConfigError

# What one option of a group is called in a message; other groups say "<group> option".
_NOUNS = {
    "recipe": "recipe",
    "pipeline": "pipeline",
    "model": "model",
    "strategy": "strategy",
    "optim": "optimizer",
    "scheduler": "scheduler",
    "adapter": "adapter",
    "logger": "logger",
}


def group_options(group: str, extra_dirs: Sequence[Path] = ()) -> list[str]:
    """The options of config group ``group`` (e.g. ``sft/full`` for ``recipe``), from the
    shipped ``conf/`` and ``extra_dirs``; empty if ``group`` is not a group."""
    names: set[str] = set()
    for root in (conf_dir(), *extra_dirs):
        folder = Path(root) / group
        if folder.is_dir():
            names.update(str(p.relative_to(folder).with_suffix("")) for p in folder.rglob("*.yaml"))
    return sorted(names)


def _is_group(group: str, extra_dirs: Sequence[Path]) -> bool:
    return any((Path(root) / group).is_dir() for root in (conf_dir(), *extra_dirs))


def _top_groups(extra_dirs: Sequence[Path]) -> list[str]:
    roots = (conf_dir(), *extra_dirs)
    return sorted(
        {p.name for root in roots for p in Path(root).iterdir() if p.is_dir()} - {"hydra"}
    )


def did_you_mean(word: str, options: Sequence[str]) -> str:
    """`` (did you mean X?)`` for the closest of ``options`` to ``word``, else
    `` (choose from: ...)``; empty when there are no options."""
    close = difflib.get_close_matches(word, options, n=1)
    if close:
        return f" (did you mean {close[0]}?)"
    return f" (choose from: {', '.join(options)})" if options else ""


def _dataclass_of(hint: Any) -> type | None:
    """The dataclass a field's type hint holds (``X | None`` unwrapped), else None."""
    if isinstance(hint, type) and is_dataclass(hint):
        return hint
    for arg in typing.get_args(hint):
        if isinstance(arg, type) and is_dataclass(arg):
            return arg
    return None


def _field_schema(node: type, name: str) -> type | None:
    """The dataclass field ``name`` of dataclass ``node`` holds, else None (open keys)."""
    inner = _dataclass_of(typing.get_type_hints(node)[name])
    return stage_schema() if inner is StageConfig else inner  # a field per objective


def unknown_key(key: str, schema: type, groups: Sequence[str] = ()) -> str | None:
    """Why dotted ``key`` is not in ``schema`` (a dataclass), with the closest field at
    the level it leaves the schema (or of ``groups``, for a top-level name); None when it
    is there or lies under open keys."""
    node: type | None = schema
    parts = key.split(".")
    for depth, part in enumerate(parts):
        if node is None:
            return None  # open keys (a dict or Any field): nothing to check against
        names = [f.name for f in fields(node)]
        if part not in names:
            candidates = [*names, *groups] if len(parts) == 1 else names
            close = difflib.get_close_matches(part, candidates, n=1)
            if close:
                spelled = ".".join([*parts[:depth], close[0], *parts[depth + 1 :]])
                return f"no such key (did you mean {spelled}?)"
            where = ".".join(parts[:depth]) or "the config"
            return f"no such key ({where} takes: {', '.join(names)})"
        node = _field_schema(node, part)
    return None


def first_line(err: Exception) -> str:
    """The first line of ``err``'s message (OmegaConf's and Hydra's go on with the full
    key and the object type), or its type's name when it has none."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def wrong_value(key: str, value: Any, schema: type) -> str | None:
    """Why ``value`` (as Hydra parsed it) cannot be held by dotted ``key`` of ``schema``,
    in one line; None when it can, or when the key is not a field of a dataclass in
    ``schema`` (open keys, or no such key).

    The value is merged into the field on the dataclass that declares it, as Hydra
    merges an override into the composed config, so OmegaConf converts it (``'1e-3'``
    to a float) or refuses it the same way. An interpolation (``${run.seed}``) is taken
    as it is.
    """
    node: type | None = schema
    *parents, leaf = key.split(".")
    for part in parents:
        if node is None or part not in {f.name for f in fields(node)}:
            return None
        node = _field_schema(node, part)
    if node is None or leaf not in {f.name for f in fields(node)}:
        return None
    try:
        OmegaConf.update(OmegaConf.structured(node), leaf, value, merge=True)
    except (OmegaConfBaseException, ValueError) as err:
        return first_line(err)
    return None


def _command_line(argv: Sequence[str]) -> argparse.Namespace | None:
    """Hydra's reading of ``argv``; None when Hydra would refuse it (Hydra says why)."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args, _ = parser.parse_known_args(list(argv))
    except (SystemExit, argparse.ArgumentError):
        return None
    return args


def check_overrides(
    overrides: Sequence[str], schema: type, extra_dirs: Sequence[Path] = ()
) -> None:
    """Refuse the first override that names a missing group option or schema key, or
    whose value the key's type cannot hold (each value of a choice sweep is tried).

    Overrides Hydra cannot parse, of ``hydra`` itself, with a package (``group@pkg``),
    deleting (``~key``) or sweeping a range are left to Hydra.

    Raises:
        ConfigError: ``<override>: no such <thing> (did you mean ...?)``, or
            ``<override>: <why the value does not fit>``.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return
    for override, text in zip(parsed, overrides, strict=True):
        key = override.key_or_group
        if key.split(".")[0].split("/")[0] == "hydra" or override.package or override.is_delete():
            continue
        if "." not in key and _is_group(key, extra_dirs):
            if override.is_sweep_override() and not override.is_choice_sweep():
                continue
            given = override.value()
            if override.is_choice_sweep():
                values = list(override.sweep_string_iterator())
            elif isinstance(given, list):  # several options (logger=[csv,mlflow])
                values = [str(v) for v in given]
            else:
                values = [override.get_value_element_as_str()]
            options = group_options(key, extra_dirs)
            for value in values:
                if value not in ("null", *options):
                    noun = _NOUNS.get(key, f"{key} option")
                    raise ConfigError(f"{text}: no such {noun}{did_you_mean(value, options)}")
            continue
        given = override.value()
        moved = moved_line(key, None if override.is_sweep_override() else given)
        if moved is not None:
            raise ConfigError(moved)
        groups = [] if "." in key else _top_groups(extra_dirs)
        reason = unknown_key(key, schema, groups)
        if reason is not None:
            raise ConfigError(f"{text}: {reason}")
        if isinstance(given, ChoiceSweep):
            typed: list[Any] = list(given.list)
        else:
            typed = [] if override.is_sweep_override() else [given]
        for one in typed:
            reason = wrong_value(key, one, schema)
            if reason is not None:
                raise ConfigError(f"{text}: {reason}")


def check_command_line(argv: Sequence[str], schema: type) -> None:
    """:func:`check_overrides` on a console script's arguments, as Hydra reads them.

    Left to Hydra: ``--help``, shell completion, another primary config
    (``--config-path``, ``--config-name``) or search path (``hydra.searchpath``).

    Raises:
        ConfigError: the first override naming a missing group option or key, or
            holding a value of the wrong type.
    """
    args = _command_line(argv)
    if args is None or args.help or args.hydra_help or args.shell_completion:
        return
    if args.config_path or args.config_name or args.experimental_rerun:
        return
    if any(o.lstrip("+").startswith("hydra.searchpath") for o in args.overrides):
        return
    extra = [Path(args.config_dir)] if args.config_dir else []
    check_overrides(args.overrides, schema, extra)
