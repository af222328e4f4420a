"""The one place that turns ``_target_`` config nodes into objects.

Only targets under an allowlisted prefix are built (hydra-core 1.4 deprecates
unrestricted instantiate). Before building, every key of the node is bound to the
target's signature, so a misspelt argument fails with the config key named.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from hydra.utils import instantiate as hydra_instantiate
from omegaconf import DictConfig, OmegaConf

from recipes_lib.errors import ConfigError

ALLOWED_TARGET_PREFIXES: tuple[str, ...] = (
    "recipes_lib.",
    "lightning.pytorch.callbacks.",
    "lightning.pytorch.loggers.",
    "torch.optim.",
)


def _import_target(path: str, key: str) -> Any:
    module_name, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{key}._target_: cannot import '{path}' ({err})") from err


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


def instantiate(node: DictConfig | Mapping[str, Any], key: str, **kwargs: Any) -> Any:
    """Build the object a ``_target_`` node describes.

    Args:
        node: a config node with ``_target_`` and the target's arguments.
        key: the node's dotted path in the run config, used in error messages.
        **kwargs: extra arguments supplied by the caller (not from config).

    Raises:
        ConfigError: the target is not allowlisted, cannot be imported, or an argument
            is not in its signature.
    """
    if isinstance(node, DictConfig):
        data = OmegaConf.to_container(node, resolve=True)
    else:
        data = dict(node)
    target = data.get("_target_")
    if not isinstance(target, str):
        raise ConfigError(f"{key}: expected a node with a '_target_' string, got {data!r}")
    if not target.startswith(ALLOWED_TARGET_PREFIXES):
        raise ConfigError(
            f"{key}._target_: '{target}' is outside the allowed prefixes "
            f"{', '.join(ALLOWED_TARGET_PREFIXES)}"
        )
    obj = _import_target(target, key)
    args = {k: v for k, v in data.items() if not k.startswith("_")}
    _check_signature(obj, {**args, **kwargs}, key)
    return hydra_instantiate(data, **kwargs, _convert_="all")


def instantiate_dict(nodes: Mapping[str, Any] | None, key: str) -> list[Any]:
    """Instantiate a named dict of ``_target_`` nodes; ``null`` entries are skipped."""
    if not nodes:
        return []
    return [instantiate(node, f"{key}.{name}") for name, node in nodes.items() if node is not None]
