"""Every ``_target_`` of a run, checked against the kind of object its key builds.

Three keys build objects from config: ``callbacks.<name>`` (callbacks), ``logger.<name>``
(loggers) and ``stage.<objective>.rewards.<name>.fn`` (reward functions, of an objective
whose settings have ``rewards``: GRPO's). A ``_target_`` anywhere
else is built by nothing, so it is refused too rather than left to look meaningful.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from recipes_lib.config.instantiate import (
    CALLBACKS,
    LOGGERS,
    TARGET_KEY,
    TargetKind,
    check_targets,
    iter_target_nodes,
)
from recipes_lib.config.schema import RunConfig
from recipes_lib.errors import ConfigError
from recipes_lib.rewards.registry import FN_KEY, REWARDS


def _sites(cfg: Mapping[str, Any]) -> list[tuple[tuple[str, ...], TargetKind]]:
    """The path of every node of ``cfg`` that is built, with what it builds."""
    sites: list[tuple[tuple[str, ...], TargetKind]]
    sites = [(("callbacks", name), CALLBACKS) for name in cfg.get("callbacks") or {}]
    sites += [(("logger", name), LOGGERS) for name in cfg.get("logger") or {}]
    for objective, settings in (cfg.get("stage") or {}).items():
        rewards = settings.get("rewards") if isinstance(settings, Mapping) else None
        sites += [
            (("stage", objective, "rewards", name, FN_KEY), REWARDS)
            for name, node in (rewards or {}).items()
            if isinstance(node, Mapping) and FN_KEY in node  # else the registry says what lacks
        ]
    return sites


def check_run_targets(cfg: RunConfig, key: str = "") -> None:
    """Refuse the first ``_target_`` of ``cfg`` that the key holding it does not build.

    Args:
        cfg: the typed run config.
        key: the run's own key in error messages (``stages.anneal`` in a pipeline).

    Raises:
        ConfigError: naming the full key of the first target refused.
    """
    data = dataclasses.asdict(cfg)
    extra: Sequence[str] = cfg.run.allowed_targets
    built = set()
    for path, kind in _sites(data):
        node: Any = data
        for part in path:
            node = node[part]
        where = ".".join((key, *path) if key else path)
        if node is not None:
            check_targets(node, where, kind, extra)
        built.add(where)
    for where, _ in iter_target_nodes(data, key):
        if not any(where == site or where.startswith((f"{site}.", f"{site}[")) for site in built):
            raise ConfigError(
                f"{where}.{TARGET_KEY}: nothing is built from config here (objects are built "
                "under callbacks, logger and stage.grpo.rewards.<name>.fn)"
            )
