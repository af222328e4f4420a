"""Each objective's settings as the schema sees them: one typed node, ``stage.<objective>``.

The settings dataclasses belong to the objectives (each :class:`ObjectiveSpec` in
:mod:`recipes_lib.objectives` carries its own); their registry hands each one here with
:func:`declare_settings`. The run schema's stage node is then :func:`stage_schema`: the
plain :class:`~recipes_lib.config.schema.StageConfig` with one field per declared
objective, so ``stage.dpo.beta`` is typed and a misspelt ``stage.dpo.betaa`` fails at
compose time, naming its full key, like any other key. The schema hard-codes no
objective: a new one declares its settings and the stage node grows a field.

The built-in objectives' settings are declared by :mod:`recipes_lib.objectives.settings`,
which imports neither torch nor Lightning; :func:`declared_settings` imports it by name
on first use (as a ``_target_`` is imported), so composing a config does not depend on
what its caller imported first, and reads no objective's module.

The settings once held by root nodes (``preference``, ``distill``, ``reward``,
``grpo``), and keys renamed in place (:data:`MOVED_KEYS`), are refused with one line
naming where each key went (:func:`moved_line`), from the command line
(:mod:`recipes_lib.config.overrides`) and from a config file
(:func:`recipes_lib.config.store.to_run_config`).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from recipes_lib.config.schema import StageConfig
from recipes_lib.errors import ConfigError

BUILTIN_SETTINGS = "recipes_lib.objectives.settings"

_SETTINGS: dict[str, type] = {}
_SCHEMAS: dict[tuple[tuple[str, type], ...], type] = {}


def declare_settings(name: str, settings: type) -> None:
    """Make ``settings`` (a dataclass) the schema of ``stage.<name>``.

    Raises:
        ConfigError: ``name`` is a key the stage node already has, ``settings`` is
            not a dataclass, or it is already another objective's.
    """
    if name in {f.name for f in dataclasses.fields(StageConfig)}:
        raise ConfigError(f"objective {name!r}: stage.{name} is already a stage setting")
    if not dataclasses.is_dataclass(settings):
        raise ConfigError(f"objective {name!r}: its settings must be a dataclass")
    other = next((n for n, cls in _SETTINGS.items() if cls is settings and n != name), None)
    if other is not None:
        raise ConfigError(
            f"objective {name!r}: {settings.__name__} is already stage.{other}'s settings"
        )
    _SETTINGS[name] = settings


def declared_settings() -> dict[str, type]:
    """``{objective: settings dataclass}`` of every objective that has settings."""
    importlib.import_module(BUILTIN_SETTINGS)
    return dict(_SETTINGS)


def stage_schema() -> type:
    """:class:`StageConfig` with a ``stage.<objective>`` field per declared objective
    (built once per set of declarations)."""
    declared = tuple(sorted(declared_settings().items()))
    schema = _SCHEMAS.get(declared)
    if schema is None:
        fields = [(name, cls, dataclasses.field(default_factory=cls)) for name, cls in declared]
        schema = dataclasses.make_dataclass("StageConfig", fields, bases=(StageConfig,))
        schema.__module__, schema.__doc__ = StageConfig.__module__, StageConfig.__doc__
        _SCHEMAS[declared] = schema
    return schema


# ------------------------------------------------------------------ moved keys
# keys refused with the one key that replaces them
MOVED_KEYS = {"run.preflight": "run.launch_check"}
MOVED_ROOTS = ("preference", "distill", "reward", "grpo")
_PREFERENCE_KEYS = {
    "beta": "stage.dpo.beta (stage.kto.beta, stage.simpo.beta; ORPO's weight is "
    "stage.orpo.odds_ratio_weight)",
    "gamma": "stage.simpo.gamma",
    "desirable_weight": "stage.kto.desirable_weight",
    "undesirable_weight": "stage.kto.undesirable_weight",
    "reference_from": "stage.dpo.reference_from (stage.kto.reference_from)",
    "precompute_reference": "stage.dpo.precompute_reference (stage.kto.precompute_reference)",
}
_PREFERENCE_LOSSES = {"simpo": "simpo", "orpo": "orpo", "kto": "kto"}


def moved_line(key: str, value: Any = None) -> str | None:
    """The line refusing ``key`` (dotted; ``value`` as given, if any) when it is one of
    the objective settings that moved under ``stage.<objective>`` or in
    :data:`MOVED_KEYS`, else None."""
    if key in MOVED_KEYS:
        return f"{key}: moved to {MOVED_KEYS[key]}"
    root, _, rest = key.partition(".")
    if root not in MOVED_ROOTS:
        return None
    if root != "preference":
        target = f"stage.{root}.{rest}" if rest else f"stage.{root}"
        return f"{key}: moved to {target}"
    if not rest:
        return (
            "preference: moved under stage.<objective>: stage.dpo (loss sigmoid | ipo | hinge), "
            "stage.simpo, stage.orpo or stage.kto, with stage.objective naming which"
        )
    if rest == "loss":
        objective = _PREFERENCE_LOSSES.get(str(value))
        if objective is not None:
            return f"{key}={value}: {objective} is an objective: stage.objective={objective}"
        return f"{key}: moved to stage.dpo.loss"
    return f"{key}: moved to {_PREFERENCE_KEYS.get(rest, f'stage.dpo.{rest}')}"
