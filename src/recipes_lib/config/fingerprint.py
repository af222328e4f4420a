"""What a run computes, as a comparable payload, and how two payloads differ.

A run's payload is its resolved config less the keys that say where it runs, how it
reports or how it is watched (:data:`LOCATION_KEYS`), with its own folder written as
``${run.dir}`` wherever it appears. Two runs with equal payloads compute the same thing.

Two places compare payloads: a rerun of ``recipes-train`` in a folder that holds
checkpoints resumes them only when its payload matches the ``config.yaml`` the folder
records (:func:`recorded_config_changes`), and a pipeline stage's fingerprint
(``recipes_lib.pipeline.fingerprint``) is this payload plus the checksums of its inputs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

from omegaconf import OmegaConf

from recipes_lib.config.schema import RunConfig
from recipes_lib.errors import ConfigError

# Keys that say where a run runs, how it reports or how it is watched, not what it
# computes: left out of every comparison.
LOCATION_KEYS = (
    "run.dir",
    "run.ckpt_path",
    "data.cache_dir",
    "kernels.compile_cache",
    "data.num_proc",
    "data.num_workers",
    "trainer.enable_progress_bar",
    "trainer.enable_model_summary",
    "callbacks.watchdog",  # a longer hang timeout after a hang is still the same run
    "stage.export_hf",  # a Hugging Face copy of the output is written, not computed
    "data.chat.prove_masks",  # checks of the data, not what trains on it
    "data.chat.show",
)


def _drop(data: dict[str, Any], dotted: str) -> None:
    *parents, last = dotted.split(".")
    node: Any = data
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            return
    if isinstance(node, dict):
        node.pop(last, None)


def _replace_text(value: Any, old: str, new: str) -> Any:
    if isinstance(value, str):
        return value.replace(old, new)
    if isinstance(value, dict):
        return {k: _replace_text(v, old, new) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_replace_text(v, old, new) for v in value]
    return value


def config_payload(
    config: Mapping[str, Any], run_dir: str, drop: Sequence[str] = LOCATION_KEYS
) -> dict[str, Any]:
    """``config`` (a run config as plain data) less the ``drop`` keys, with ``run_dir``
    written as ``${run.dir}`` wherever it appears."""
    payload = _replace_text(dict(config), str(run_dir), "${run.dir}")
    for key in drop:
        _drop(payload, key)
    return payload


def _plain(cfg: RunConfig) -> dict[str, Any]:
    """``cfg`` as the plain data its ``config.yaml`` reads back as (lists, not tuples)."""
    text = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    # the YAML of a dataclass is a mapping, whose container is a dict of its field names
    return cast(dict[str, Any], OmegaConf.to_container(OmegaConf.create(text), resolve=False))


def recorded_config_changes(cfg: RunConfig, recorded: str | Path) -> list[str]:
    """How ``cfg`` differs from the config a run recorded in ``recorded`` (its
    ``config.yaml``), less :data:`LOCATION_KEYS`; empty when it computes the same.

    Raises:
        ConfigError: ``recorded`` is missing or is not a config.
    """
    path = Path(recorded)
    try:
        old = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(f"cannot read the config a run recorded in '{path}': {err}") from err
    if not isinstance(old, dict):
        raise ConfigError(f"'{path}' does not hold a run config")
    record = cast(dict[str, Any], old)  # a config's keys are strings
    old_dir = str((record.get("run") or {}).get("dir", cfg.run.dir))
    ours = config_payload(_plain(cfg), cfg.run.dir)
    return describe_changes(config_payload(record, old_dir), ours)


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out or {prefix.rstrip("."): {}}
    return {prefix.rstrip("."): value}


def describe_changes(
    old: Mapping[str, Any],
    new: Mapping[str, Any],
    limit: int = 8,
    names: Mapping[str, str] | None = None,
) -> list[str]:
    """``key: old -> new`` for each differing key of two payloads (``names``: keys told
    in words instead, as ``<name> changed``), at most ``limit`` and a count of the rest.

    A key the recorded payload lacks whose new value is the schema's default is no
    change: the schema gained it after the run was recorded (``model.family``,
    ``data.path``), and at its default it computes what the recorded run computed."""
    flat_old, flat_new = _flatten(dict(old)), _flatten(dict(new))
    names = names or {}
    defaults = _flatten(asdict(RunConfig()))
    changes = []
    for key in sorted(set(flat_old) | set(flat_new)):
        a, b = flat_old.get(key, "<unset>"), flat_new.get(key, "<unset>")
        if a == b:
            continue
        if key not in flat_old and key in defaults and b == defaults[key]:
            continue  # a key the schema gained since the run was recorded, at its default
        if key in names:
            changes.append(f"{names[key]} changed")
        else:
            changes.append(f"{key}: {a!r} -> {b!r}")
    if len(changes) > limit:
        changes = [*changes[:limit], f"... and {len(changes) - limit} more"]
    return changes
