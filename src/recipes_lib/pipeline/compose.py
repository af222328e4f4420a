"""Composing a stage's :class:`~recipes_lib.config.RunConfig`: its recipe, the pipeline's
and the stage's overrides, its keys, and ``model=from_init`` filled from its source."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from recipes_lib.config import compose_config, list_recipes
from recipes_lib.config.overrides import check_overrides, did_you_mean, unknown_key
from recipes_lib.config.schema import RunConfig
from recipes_lib.config.store import fill_from_init, run_schema_node
from recipes_lib.errors import ConfigError
from recipes_lib.pipeline.spec import PipelineSpec, StageSpec

# Keys the runner sets from the stage's ``init`` and ``from``.
RUNNER_KEYS = ("run.dir", "run.ckpt_path", "stage.init_from", "stage.init_optimizer")


def compose_stage(
    pipeline: PipelineSpec,
    stage: StageSpec,
    source_model: Mapping[str, Any] | None = None,
    source_label: str = "no source",
) -> RunConfig:
    """The stage's RunConfig before any hand-off: recipe + overrides + stage keys, with
    ``model=from_init`` fields taken from ``source_model`` (the model of what the stage
    starts from, named ``source_label`` in errors).

    Raises:
        ConfigError: naming the stage for an unknown recipe, an override that does not
            compose, or a stage key the schema does not have (``stages.<s>.<key>``).
    """
    recipes = list_recipes()
    if stage.recipe not in recipes:
        raise ConfigError(
            f"{stage.key}.recipe={stage.recipe!r}: no such recipe"
            + did_you_mean(stage.recipe, recipes)
        )
    for key in RUNNER_KEYS:
        if sets_key(pipeline, stage, key):
            raise ConfigError(
                f"{stage.key}.{key} is set by the pipeline (from the stage's init and from "
                "keys and its folder); do not set it"
            )
    overrides = [f"recipe={stage.recipe}", *pipeline.overrides, *stage.overrides]
    try:
        check_overrides(overrides[1:], RunConfig)
    except ConfigError as err:
        raise ConfigError(f"stage {stage.name}: {err}") from err
    try:
        composed = compose_config(overrides)
    except Exception as err:  # Hydra's composition errors carry the key at fault
        raise ConfigError(
            f"stage {stage.name}: recipe {stage.recipe} with overrides {list(overrides[1:])} "
            f"does not compose: {err}"
        ) from err
    typed = run_schema_node()
    try:
        container = OmegaConf.to_container(composed, resolve=False)
        # merged onto the schema's DictConfig, each result is a DictConfig
        typed = cast(DictConfig, OmegaConf.merge(typed, container))
        typed = cast(DictConfig, OmegaConf.merge(typed, stage.settings))
    except OmegaConfBaseException as err:
        full_key = getattr(err, "full_key", None) or ""
        reason = unknown_key(full_key, RunConfig) or str(err).splitlines()[0]
        raise ConfigError(f"{stage.key}.{full_key}: {reason}") from err
    typed.run.dir = str(pipeline.dir / stage.name)
    try:
        fill_from_init(typed.model, source_model, f"{stage.key}: {source_label}")
    except ConfigError as err:
        raise ConfigError(f"stage {stage.name}: {err}") from err
    try:
        return OmegaConf.to_object(typed)  # type: ignore[return-value]
    except (OmegaConfBaseException, ValueError) as err:
        full_key = getattr(err, "full_key", None) or ""
        raise ConfigError(f"{stage.key}.{full_key}: {str(err).splitlines()[0]}") from err


def sets_key(pipeline: PipelineSpec, stage: StageSpec, key: str) -> bool:
    """Whether the stage itself (its keys or overrides, or the pipeline's) sets ``key``."""
    node: Any = stage.settings
    for part in key.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    if node is not None:
        return True
    overrides = (*pipeline.overrides, *stage.overrides)
    return any(o.lstrip("+").split("=")[0] == key for o in overrides)
