"""The arguments of the library's plain ``key=value`` console scripts
(``recipes-generate``, ``recipes-eval``, ``recipes-export``): parsed over their
defaults, and the usage ``--help`` prints."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from recipes_lib.errors import ConfigError

DTYPE_NAMES = ("float32", "bfloat16", "float16")  # what dtype= takes besides auto


def key_value_args(argv: Sequence[str], defaults: dict[str, Any]) -> dict[str, Any]:
    """``key=value`` arguments over ``defaults`` (values as text), as the library's
    plain console scripts (``recipes-generate``, ``recipes-eval``) take them.

    Raises:
        ConfigError: an argument without ``=`` or a key ``defaults`` does not have.
    """
    args = dict(defaults)
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"argument {item!r} is not key=value")
        if key not in defaults:
            raise ConfigError(f"unknown argument {key!r}; choose from: {', '.join(defaults)}")
        args[key] = value
    return args


HELP_ARGS = ("-h", "--help", "help")


def wants_help(argv: Sequence[str]) -> bool:
    """Whether ``argv`` asks for the usage (``-h``, ``--help`` or ``help`` anywhere)."""
    return any(item in HELP_ARGS for item in argv)


def usage(
    script: str, defaults: dict[str, Any], examples: Sequence[str], required: Sequence[str] = ()
) -> str:
    """The usage of a ``key=value`` console script: its keys with their defaults, then
    ``examples``."""

    def shown(key: str) -> str:
        value = defaults[key]
        if key in required:
            return "(required)"
        return "-" if value is None else repr(value) if value == "" else str(value)

    width = max(map(len, defaults))
    lines = [f"usage: {script} key=value ...", "", "keys (default):"]
    lines += [f"  {key:<{width}}  {shown(key)}" for key in defaults]
    lines += ["", "examples:", *(f"  {example}" for example in examples)]
    return "\n".join(lines)


def dtype_arg(value: str) -> torch.dtype | None:
    """``dtype=``: ``auto`` (None: as the weights are stored) or a floating dtype by name.

    Raises:
        ConfigError: any other name.
    """
    if value == "auto":
        return None
    if value not in DTYPE_NAMES:
        raise ConfigError(f"dtype={value!r}; choose from: auto, {', '.join(DTYPE_NAMES)}")
    return getattr(torch, value)
