"""The one place that turns ``_target_`` config nodes into objects.

Only allowlisted targets are built (hydra-core 1.4 deprecates unrestricted
instantiate), and the allowlist holds at every depth: Hydra builds nested ``_target_``
nodes too (an argument of a callback, an item of a list, an entry of ``_args_``), so
:func:`check_targets` walks the whole node and refuses the first target outside the
allowlist, naming its full key, before anything is imported from outside it or built.

A target is allowed when its dotted path starts with one of
:data:`ALLOWED_TARGET_PREFIXES` or a prefix the run adds in ``run.allowed_targets``
(``[mypkg.callbacks.]``), and the object found there is defined under such a prefix as
well (so an allowed module cannot hand out something it merely imported, such as
``os.system``). Before building, every key of every node is bound to its target's
signature, so a misspelt argument fails with the config key named.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from hydra.utils import instantiate as hydra_instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from recipes_lib.errors import ConfigError

ALLOWED_TARGET_PREFIXES: tuple[str, ...] = (
    "recipes_lib.",
    "lightning.pytorch.callbacks.",
    "lightning.pytorch.loggers.",
    "torch.optim.",
)
TARGET_KEY = "_target_"


def _plain(node: Any) -> Any:
    """``node`` as plain Python containers, interpolations resolved."""
    if isinstance(node, DictConfig | ListConfig):
        return OmegaConf.to_container(node, resolve=True)
    return node


def iter_target_nodes(node: Any, key: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every mapping holding a ``_target_`` key inside ``node``, at any depth, with its
    dotted key path (``callbacks.x.on_fit_start``; list items as ``name[2]``)."""
    node = _plain(node)
    if isinstance(node, Mapping):
        if TARGET_KEY in node:
            yield key, node
        for name, value in node.items():
            yield from iter_target_nodes(value, f"{key}.{name}" if key else str(name))
    elif isinstance(node, list | tuple):
        for index, value in enumerate(node):
            yield from iter_target_nodes(value, f"{key}[{index}]")


def _resolve_target(path: Any, key: str, prefixes: tuple[str, ...]) -> Any:
    """The object an allowed ``_target_`` path names; refused before it is imported when
    the path is outside ``prefixes``."""
    if not isinstance(path, str):
        raise ConfigError(f"{key}.{TARGET_KEY}: expected a dotted path string, got {path!r}")
    allowed = ", ".join(prefixes)
    hint = "add its prefix to run.allowed_targets if you trust that code"
    if not path.startswith(prefixes):
        raise ConfigError(
            f"{key}.{TARGET_KEY}: '{path}' is outside the allowed prefixes ({allowed}); {hint}"
        )
    module_name, _, attr = path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"{key}.{TARGET_KEY}: cannot import '{path}' ({err})") from err
    defined_at = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"
    if not defined_at.startswith(prefixes):
        raise ConfigError(
            f"{key}.{TARGET_KEY}: '{path}' is '{defined_at}', defined outside the allowed "
            f"prefixes ({allowed}); {hint}"
        )
    return obj


def _check_signature(target: Any, kwargs: Mapping[str, Any], key: str) -> None:
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return
    params = sig.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    accepted = {p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL}
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise ConfigError(
            f"{key}.{unknown[0]}: not an argument of {target.__module__}.{target.__qualname__} "
            f"(accepted: {', '.join(sorted(accepted))})"
        )


def allowed_prefixes(extra: Sequence[str] | None = None) -> tuple[str, ...]:
    """The built-in allowlist plus a run's own ``run.allowed_targets``.

    Raises:
        ConfigError: an extra prefix that is empty or not a string (it would allow all).
    """
    extra = tuple(extra or ())
    for index, prefix in enumerate(extra):
        if not isinstance(prefix, str) or not prefix.strip("."):
            raise ConfigError(
                f"run.allowed_targets[{index}]={prefix!r}: a prefix is a dotted module path "
                "such as 'mypkg.callbacks.'"
            )
    return ALLOWED_TARGET_PREFIXES + extra


def check_targets(
    node: Any, key: str, extra_prefixes: Sequence[str] | None = None, **kwargs: Any
) -> None:
    """Refuse any ``_target_`` in ``node``, at any depth, that is outside the allowlist,
    cannot be imported, or is given an argument its signature lacks.

    Nothing outside the allowlist is imported, and nothing is built.

    Args:
        node: a config node (or a plain mapping or list).
        key: the node's dotted path in the run config, used in error messages.
        extra_prefixes: the run's own ``run.allowed_targets``.
        **kwargs: arguments the caller adds to the top-level node when building it.

    Raises:
        ConfigError: naming the full key of the first target refused.
    """
    prefixes = allowed_prefixes(extra_prefixes)
    for where, target_node in iter_target_nodes(node, key):
        obj = _resolve_target(target_node[TARGET_KEY], where, prefixes)
        args = {k: v for k, v in target_node.items() if not k.startswith("_")}
        _check_signature(obj, {**args, **(kwargs if where == key else {})}, where)


def instantiate(
    node: DictConfig | Mapping[str, Any],
    key: str,
    extra_prefixes: Sequence[str] | None = None,
    **kwargs: Any,
) -> Any:
    """Build the object a ``_target_`` node describes (and the nodes nested in it).

    Args:
        node: a config node with ``_target_`` and the target's arguments.
        key: the node's dotted path in the run config, used in error messages.
        extra_prefixes: the run's own ``run.allowed_targets``.
        **kwargs: extra arguments supplied by the caller (not from config).

    Raises:
        ConfigError: a target at any depth is not allowlisted, cannot be imported, or an
            argument is not in its signature.
    """
    data = _plain(node)
    if not isinstance(data, Mapping) or not isinstance(data.get(TARGET_KEY), str):
        raise ConfigError(f"{key}: expected a node with a '{TARGET_KEY}' string, got {data!r}")
    check_targets(data, key, extra_prefixes, **kwargs)
    return hydra_instantiate(dict(data), **kwargs, _convert_="all")


def instantiate_dict(
    nodes: Mapping[str, Any] | None, key: str, extra_prefixes: Sequence[str] | None = None
) -> list[Any]:
    """Instantiate a named dict of ``_target_`` nodes; ``null`` entries are skipped.

    Every node is checked before the first one is built."""
    if not nodes:
        return []
    live = {name: node for name, node in nodes.items() if node is not None}
    for name, node in live.items():
        check_targets(node, f"{key}.{name}", extra_prefixes)
    return [instantiate(node, f"{key}.{name}", extra_prefixes) for name, node in live.items()]
