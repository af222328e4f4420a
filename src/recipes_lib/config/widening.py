"""Who may widen what a run builds from config: the person starting it, never a file.

``run.allowed_targets`` (module prefixes such as ``mypkg.callbacks.``, or exact targets)
lets a run build code of its own (:mod:`recipes_lib.config.instantiate`). A recipe or
pipeline file that widened it could run anything it names, so the value must come from
the command line (or the override list given to ``compose_config``) or from the
``RECIPES_ALLOWED_TARGETS`` environment variable (comma-separated); a composed value that
the overrides did not set is refused. A run prints what was widened (:func:`widening_line`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from recipes_lib.errors import ConfigError

ALLOWED_TARGETS_KEY = "run.allowed_targets"
ENV_VAR = "RECIPES_ALLOWED_TARGETS"


def _checked(prefixes: Sequence[Any], key: str) -> tuple[str, ...]:
    for index, prefix in enumerate(prefixes):
        if not isinstance(prefix, str) or not prefix.strip("."):
            # an empty prefix would trust everything
            raise ConfigError(
                f"{key}[{index}]={prefix!r}: a prefix is a dotted module path such as "
                "'mypkg.callbacks.'"
            )
    return tuple(prefixes)


def environment_targets() -> tuple[str, ...]:
    """The prefixes of ``RECIPES_ALLOWED_TARGETS`` (comma-separated; unset: none)."""
    entries = [e.strip() for e in os.environ.get(ENV_VAR, "").split(",")]
    return _checked([e for e in entries if e], ENV_VAR)


def widened_targets(allowed_targets: Sequence[str] | None) -> tuple[str, ...]:
    """What a run trusts beyond the declared kinds: its ``run.allowed_targets`` and
    ``RECIPES_ALLOWED_TARGETS``.

    Raises:
        ConfigError: an entry that is empty or not a string (it would trust all).
    """
    return _checked(tuple(allowed_targets or ()), ALLOWED_TARGETS_KEY) + environment_targets()


def widening_line(allowed_targets: Sequence[str] | None) -> str | None:
    """The line a run prints when it trusts code of its own; ``None`` when it does not."""
    trusted = widened_targets(allowed_targets)
    if not trusted:
        return None
    return f"built from config beyond the declared kinds ({ALLOWED_TARGETS_KEY}, {ENV_VAR}): " + (
        ", ".join(trusted)
    )


def overridden_value(overrides: Sequence[str], key: str) -> Any:
    """The value the last of ``overrides`` that sets ``key`` gives it (``[]`` if none
    does, or it is deleted); sweeps are left to each job's own overrides."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    value: Any = []
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    for override in parsed:
        if override.key_or_group != key or override.is_sweep_override():
            continue
        value = [] if override.is_delete() else override.value()
    return value


def check_widening_source(
    cfg: DictConfig, overrides: Sequence[str], key: str = ALLOWED_TARGETS_KEY, source: str = ""
) -> None:
    """Refuse a composed ``key`` that ``overrides`` did not set: a config file set it.

    Args:
        cfg: the config composed with ``overrides``.
        overrides: the command line's (or ``compose_config``'s) overrides.
        key: where the allowlist is widened in ``cfg``.
        source: the files composed, for the error (``recipe=grpo/mine``).

    Raises:
        ConfigError: naming ``key`` and the files.
    """
    composed = OmegaConf.select(cfg, key, default=None)
    if isinstance(composed, DictConfig | ListConfig):
        composed = OmegaConf.to_container(composed, resolve=False)
    composed = composed or []
    given = overridden_value(overrides, key)
    if composed != given:
        files = f" ({source})" if source else ""
        raise ConfigError(
            f"{key}={composed!r} is set by a config file{files}: only the command line or "
            f"{ENV_VAR} may widen what a run builds from config"
        )


def choice(overrides: Sequence[str], group: str) -> str:
    """``group=value`` as the overrides choose it (the last one), or ``""``."""
    chosen = [o for o in overrides if o.lstrip("+").split("=", 1)[0] == group]
    return chosen[-1].lstrip("+") if chosen else ""


def check_composed_widening(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """:func:`check_widening_source` for a run's config (``run.allowed_targets``) or a
    pipeline's (each stage's ``stages.<name>.run.allowed_targets``).

    Raises:
        ConfigError: naming the key and the file chosen.
    """
    choices = OmegaConf.select(cfg, "hydra.runtime.choices", default=None) or {}
    if "stages" in cfg and "run" not in cfg:
        source = f"pipeline={choices['pipeline']}" if choices.get("pipeline") else ""
        for stage in cfg.stages or {}:
            key = f"stages.{stage}.{ALLOWED_TARGETS_KEY}"
            check_widening_source(cfg, overrides, key, source or choice(overrides, "pipeline"))
        return
    source = f"recipe={choices['recipe']}" if choices.get("recipe") else ""
    check_widening_source(
        cfg, overrides, ALLOWED_TARGETS_KEY, source or choice(overrides, "recipe")
    )


def check_no_widening(overrides: Sequence[str], key: str) -> None:
    """Refuse an override in a list a file may hold (a pipeline's ``overrides``) that
    sets ``run.allowed_targets``: composing them would count it as the command line's.

    Raises:
        ConfigError: naming ``key[<index>]``.
    """
    for index, line in enumerate(overrides):
        name, _, value = line.lstrip("+~").partition("=")
        if name == ALLOWED_TARGETS_KEY or (name == "run" and "allowed_targets" in value):
            raise ConfigError(
                f"{key}[{index}]={line!r}: a pipeline's overrides may not widen "
                f"{ALLOWED_TARGETS_KEY}; give it to the stage on the command line "
                f"(stages.<name>.{ALLOWED_TARGETS_KEY}=[...]) or in {ENV_VAR}"
            )
