"""The one place that turns ``_target_`` config nodes into objects.

Each place that builds from config says which kind of object it builds (a
:class:`TargetKind`: callbacks, loggers, reward functions), and a kind declares the
targets it accepts: classes or functions made to be built from config, not whatever a
package happens to hold (a file writer or a code runner of the same package would pass a
package prefix). Hydra builds nested ``_target_`` nodes too (an argument of a callback,
an item of a list, an entry of ``_args_``), and no kind takes an object built from config
as an argument, so a nested target must be code the run trusts itself.
:func:`check_targets` walks the whole node and refuses the first target not accepted,
naming its full key, before anything outside the kind's modules is imported or built.

A run trusts code of its own through ``run.allowed_targets`` (``[mypkg.callbacks.]``: a
module prefix or one exact target) or ``RECIPES_ALLOWED_TARGETS``, both given only where
the run is started (:mod:`recipes_lib.config.widening`); such a target is accepted at any
depth when the object found there is defined under that prefix too (so a trusted module
cannot hand out something it merely imported, such as ``os.system``). Before building,
every key of every node is bound to its target's signature, so a misspelt argument fails
with the config key named.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hydra.utils import instantiate as hydra_instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from recipes_lib.config.widening import widened_targets
from recipes_lib.errors import ConfigError

TARGET_KEY = "_target_"
WIDEN_HINT = "to build code of your own, widen run.allowed_targets on the command line"


@dataclass(frozen=True)
class TargetKind:
    """What one config key builds, and the targets it accepts.

    Attributes:
        name: what an object of this kind is called in errors ("callback").
        modules: where an accepted target is defined; nothing else is imported.
        accepts: whether the object found at an allowed path is one of this kind.
        described: the accepted targets in a few words, for errors.
    """

    name: str
    modules: tuple[str, ...]
    accepts: Callable[[Any], bool]
    described: str


def subclass_of(module: str, name: str) -> Callable[[Any], bool]:
    """``accepts`` for a family of classes: subclasses of ``module.name`` (imported only
    when a target is checked, so declaring a kind imports nothing)."""

    def accepts(obj: Any) -> bool:
        base = getattr(importlib.import_module(module), name)
        return inspect.isclass(obj) and issubclass(obj, base)

    return accepts


CALLBACKS = TargetKind(
    "callback",
    ("recipes_lib.callbacks.", "lightning.pytorch.callbacks."),
    subclass_of("lightning.pytorch.callbacks", "Callback"),
    "the Callback classes of recipes_lib.callbacks and lightning.pytorch.callbacks",
)
LOGGERS = TargetKind(
    "logger",
    ("lightning.pytorch.loggers.",),
    subclass_of("lightning.pytorch.loggers", "Logger"),
    "the Logger classes of lightning.pytorch.loggers",
)


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


def _import(path: str, key: str) -> Any:
    module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"{key}.{TARGET_KEY}: cannot import '{path}' ({err})") from err


def _defined_at(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"


def _resolve_target(path: Any, key: str, kind: TargetKind | None, trusted: tuple[str, ...]) -> Any:
    """The object a ``_target_`` path names, when ``kind`` accepts it (``None``: a nested
    node, which only trusted code may be) or the run trusts it; refused before anything
    outside those modules is imported."""
    if not isinstance(path, str):
        raise ConfigError(f"{key}.{TARGET_KEY}: expected a dotted path string, got {path!r}")
    if trusted and path.startswith(trusted):
        obj = _import(path, key)
        if not _defined_at(obj).startswith(trusted):
            raise ConfigError(
                f"{key}.{TARGET_KEY}: '{path}' is '{_defined_at(obj)}', defined outside "
                f"run.allowed_targets ({', '.join(trusted)})"
            )
        return obj
    if kind is None:
        raise ConfigError(
            f"{key}.{TARGET_KEY}: '{path}': objects built from config take no objects "
            f"built from config as arguments; {WIDEN_HINT}"
        )
    refused = f"{key}.{TARGET_KEY}: '{path}' is not a {kind.name} ({kind.described}); {WIDEN_HINT}"
    if not path.startswith(kind.modules):
        raise ConfigError(refused)
    obj = _import(path, key)
    if not _defined_at(obj).startswith(kind.modules) or not kind.accepts(obj):
        raise ConfigError(refused)
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


def check_targets(
    node: Any,
    key: str,
    kind: TargetKind,
    extra_prefixes: Sequence[str] | None = None,
    **kwargs: Any,
) -> None:
    """Refuse any ``_target_`` in ``node``, at any depth, that ``kind`` does not accept
    and the run does not trust, that cannot be imported, or that is given an argument
    its signature lacks.

    Nothing outside the kind's modules and the trusted prefixes is imported, and
    nothing is built.

    Args:
        node: a config node (or a plain mapping or list) that builds one ``kind``.
        key: the node's dotted path in the run config, used in error messages.
        kind: what the node builds.
        extra_prefixes: the run's own ``run.allowed_targets``.
        **kwargs: arguments the caller adds to the top-level node when building it.

    Raises:
        ConfigError: naming the full key of the first target refused.
    """
    trusted = widened_targets(extra_prefixes)
    for where, target_node in iter_target_nodes(node, key):
        top = where == key
        obj = _resolve_target(target_node[TARGET_KEY], where, kind if top else None, trusted)
        args = {k: v for k, v in target_node.items() if not k.startswith("_")}
        _check_signature(obj, {**args, **(kwargs if top else {})}, where)


def instantiate(
    node: DictConfig | Mapping[str, Any],
    key: str,
    kind: TargetKind,
    extra_prefixes: Sequence[str] | None = None,
    **kwargs: Any,
) -> Any:
    """Build the object a ``_target_`` node describes (and the nodes nested in it).

    Args:
        node: a config node with ``_target_`` and the target's arguments.
        key: the node's dotted path in the run config, used in error messages.
        kind: what the node builds.
        extra_prefixes: the run's own ``run.allowed_targets``.
        **kwargs: extra arguments supplied by the caller (not from config).

    Raises:
        ConfigError: a target at any depth is not accepted, cannot be imported, or an
            argument is not in its signature.
    """
    data = _plain(node)
    if not isinstance(data, Mapping) or not isinstance(data.get(TARGET_KEY), str):
        raise ConfigError(f"{key}: expected a node with a '{TARGET_KEY}' string, got {data!r}")
    check_targets(data, key, kind, extra_prefixes, **kwargs)
    return hydra_instantiate(dict(data), **kwargs, _convert_="all")


def instantiate_dict(
    nodes: Mapping[str, Any] | None,
    key: str,
    kind: TargetKind,
    extra_prefixes: Sequence[str] | None = None,
) -> list[Any]:
    """Instantiate a named dict of ``_target_`` nodes of one kind; ``null`` entries are
    skipped.

    Every node is checked before the first one is built."""
    if not nodes:
        return []
    live = {name: node for name, node in nodes.items() if node is not None}
    for name, node in live.items():
        check_targets(node, f"{key}.{name}", kind, extra_prefixes)
    return [instantiate(node, f"{key}.{name}", kind, extra_prefixes) for name, node in live.items()]
