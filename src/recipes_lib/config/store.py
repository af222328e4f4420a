"""Hydra wiring: the schema in the ConfigStore, composing a run, and typed conversion."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from recipes_lib.config.schema import RunConfig
from recipes_lib.errors import ConfigError

CONFIG_MODULE = "recipes_lib.conf"
SCHEMA_NAME = "run_schema"


def register_schema() -> None:
    """Store :class:`RunConfig` as ``run_schema``; ``conf/config.yaml`` lists it first.

    Every YAML merged after it is checked against the dataclasses, so an unknown key or
    a wrongly typed value fails at compose time with its full key in the message.
    """
    ConfigStore.instance().store(name=SCHEMA_NAME, node=RunConfig)


def conf_dir() -> Path:
    """The directory of the shipped config groups (inside the installed package)."""
    import recipes_lib.conf

    return Path(next(iter(recipes_lib.conf.__path__)))


def recipes_dir() -> Path:
    """The directory of the curated recipes (``conf/recipe`` in the installed package)."""
    return conf_dir() / "recipe"


def list_recipes() -> list[str]:
    """Names accepted by ``recipe=...``, e.g. ``pretrain/tiny``."""
    root = recipes_dir()
    return sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.yaml"))


def list_group_options(group: str) -> list[str]:
    """Options of one config group, e.g. ``list_group_options("model")``."""
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def compose_config(
    overrides: Sequence[str] = (), config_name: str = "config", return_hydra_config: bool = False
) -> DictConfig:
    """Compose a run config exactly as ``recipes-train`` would, without starting a job.

    Args:
        overrides: Hydra overrides, e.g. ``["recipe=pretrain/tiny", "optim.lr=1e-3"]``.
        config_name: the primary config under ``conf/``.
        return_hydra_config: keep the ``hydra`` node (needed for ``${hydra:...}``).

    Returns:
        The composed, typed (but unresolved) config.
    """
    register_schema()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        return compose(config_name, list(overrides), return_hydra_config=return_hydra_config)


def to_run_config(cfg: DictConfig | RunConfig) -> RunConfig:
    """Resolve interpolations and convert a composed config to typed dataclasses.

    The composed values are merged afresh onto the schema, which also rejects keys that
    a ``+key=value`` override or an untyped source slipped past composition.

    Raises:
        ConfigError: a key that the schema does not have, or a value of the wrong type.
    """
    if isinstance(cfg, RunConfig):
        return cfg
    data = OmegaConf.to_container(cfg, resolve=False)
    data.pop("hydra", None)
    try:
        typed = OmegaConf.merge(OmegaConf.structured(RunConfig), data)
        return OmegaConf.to_object(typed)  # type: ignore[return-value]
    except (OmegaConfBaseException, ValueError) as err:
        raise ConfigError(f"invalid config: {err}") from err
