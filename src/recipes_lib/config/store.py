"""Hydra wiring: the schema in the ConfigStore, composing a run, and typed conversion."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, fields, is_dataclass
from pathlib import Path
from typing import Any, cast, get_type_hints

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from recipes_lib.config.fitted import register_fitted_resolvers
from recipes_lib.config.objectives import moved_line, stage_schema
from recipes_lib.config.schema import ModelConfig, RopeScalingConfig, RunConfig
from recipes_lib.config.widening import check_composed_widening
from recipes_lib.errors import ConfigError

CONFIG_MODULE = "recipes_lib.conf"
SCHEMA_NAME = "run_schema"


def run_schema_node() -> DictConfig:
    """:class:`RunConfig` as an OmegaConf node, ready for YAML and overrides to merge onto.

    ``data.sources`` is left open, so that a source named on the command line
    (``+data.sources.NAME={path: ...}``) and a key of an existing one
    (``data.sources.web.max_documents=100``) can be added; every entry is checked
    against :class:`~recipes_lib.config.schema.SourceConfig` when the run config is
    built (:func:`to_run_config`).
    """
    node = OmegaConf.structured(RunConfig(stage=stage_schema()()))
    OmegaConf.set_struct(node.data.sources, False)
    return node


# ``model=from_init`` marks each model field ``${from_init:<field>}``: a string that
# wins over the schema's defaults when merged, loses to any value set after it, and is
# replaced by the source's value before the config is resolved (fill_from_init).
FROM_INIT = "from_init"
_FROM_INIT_MARK = re.compile(r"^\$\{from_init:([\w.]+)\}$")


def _unfilled(field: str) -> Any:
    raise ConfigError(
        f"model.{field} is ${{from_init:{field}}}: model=from_init is filled from the weights "
        "a run starts from before the config is resolved (recipes_lib.train.run and the "
        "pipeline runner do it); choose a model (model=NAME) to resolve it yourself"
    )


def from_init_fields(node: DictConfig) -> dict[str, str]:
    """``{key path in node: source field}`` of every ``${from_init:...}`` value in ``node``."""
    marks: dict[str, str] = {}

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{prefix}{key}.")
        elif isinstance(value, str) and (match := _FROM_INIT_MARK.match(value)):
            marks[prefix.rstrip(".")] = match[1]

    walk(OmegaConf.to_container(node, resolve=False), "")
    return marks


# model fields whose None is a value (n_kv_heads None: as many as the query heads; no
# window; ...), which a source records as None
_NONE_MEANS_DEFAULT = {f.name for f in fields(ModelConfig) if f.default is None}
# a source that records no rope_scaling key (one written before the key existed) holds
# its default, so does one whose key is None (yarn's derived attention_factor)
_ROPE_DEFAULTS = {f"rope_scaling.{k}": v for k, v in asdict(RopeScalingConfig()).items()}
# a source that leaves a field out was written before the field existed: it held the
# field's default, which keeps what the models of that time computed. Its family is
# never guessed: a record without one is refused
_ADDED_FIELD_DEFAULTS = {
    f.name: f.default if f.default_factory is MISSING else f.default_factory()
    for f in fields(ModelConfig)
    if f.name != "family"
}


def fill_from_init(node: DictConfig, source: Mapping[str, Any] | None, label: str) -> None:
    """Replace, in place, every ``${from_init:...}`` value of the model ``node`` with the
    field of ``source`` (a ModelConfig as a dict) it names.

    Raises:
        ConfigError: naming ``label``, when ``source`` is None or lacks a field.
    """
    marks = from_init_fields(node)
    if marks and source is None:
        raise ConfigError(
            f"model=from_init: {label} records no model shape (no config.json, manifest, "
            "config.yaml or checkpoint hyperparameters); choose a model (model=NAME)"
        )
    for key, field in marks.items():
        value: Any = source
        for part in field.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        if value is None and field in _ROPE_DEFAULTS:
            value = _ROPE_DEFAULTS[field]
        elif field in _ADDED_FIELD_DEFAULTS and source is not None and field not in source:
            value = _ADDED_FIELD_DEFAULTS[field]  # OmegaConf copies it into the node
        elif value is None and field not in _NONE_MEANS_DEFAULT:
            raise ConfigError(f"model=from_init: {label} does not record model.{field}; set it")
        OmegaConf.update(node, key, value, merge=False)


# run_schema_node() per stage schema, built once: building it is a good part of a
# compose (0.05 of 0.4 s), and each compose and to_run_config needs one; read-only here,
# since OmegaConf.merge and the config store copy what they are given
_SCHEMA_NODES: dict[type, DictConfig] = {}
_STORED: list[DictConfig] = []  # the node last stored as run_schema


def _schema_node() -> DictConfig:
    stage = stage_schema()
    node = _SCHEMA_NODES.get(stage)
    if node is None:
        node = _SCHEMA_NODES[stage] = run_schema_node()
    return node


def register_schema() -> None:
    """Store :class:`RunConfig` as ``run_schema``; ``conf/config.yaml`` lists it first.

    Every YAML merged after it is checked against the dataclasses, so an unknown key or
    a wrongly typed value fails at compose time with its full key in the message. The
    store keeps it between composes: it is stored again only when an objective declared
    since has changed the schema.
    """
    node, store = _schema_node(), ConfigStore.instance()
    if not (_STORED and _STORED[0] is node) or f"{SCHEMA_NAME}.yaml" not in store.repo:
        store.store(name=SCHEMA_NAME, node=node)
        _STORED[:] = [node]
    if not OmegaConf.has_resolver(FROM_INIT):
        OmegaConf.register_new_resolver(FROM_INIT, _unfilled)
    register_fitted_resolvers()  # recipe defaults fitted to the model and the run


def conf_dir() -> Path:
    """The directory of the shipped config groups (inside the installed package)."""
    import recipes_lib.conf

    # mypy cannot follow the package-dir mapping of recipes_lib.conf (see pyproject.toml)
    return Path(next(iter(recipes_lib.conf.__path__)))  # type: ignore[attr-defined]


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

    Raises:
        ConfigError: a composed file sets ``run.allowed_targets``
            (:mod:`recipes_lib.config.widening`).
    """
    register_schema()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        try:
            cfg = compose(config_name, list(overrides), return_hydra_config=return_hydra_config)
        except Exception as err:
            line = moved_key_of(err)
            if line is None:
                raise
            raise ConfigError(line) from err
    check_composed_widening(cfg, overrides)  # the overrides are the caller's; files may not
    return cfg


def to_run_config(cfg: DictConfig | RunConfig) -> RunConfig:
    """Resolve interpolations and convert a composed config to typed dataclasses.

    The composed values are merged afresh onto the schema, which also rejects keys that
    a ``+key=value`` override or an untyped source slipped past composition.

    Raises:
        ConfigError: a key that the schema does not have, or a value of the wrong type.
    """
    if isinstance(cfg, RunConfig):
        return cfg
    data = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=False))  # of a DictConfig
    data.pop("hydra", None)
    try:
        typed = OmegaConf.merge(_schema_node(), data)
        return OmegaConf.to_object(typed)  # type: ignore[return-value]
    except (OmegaConfBaseException, ValueError) as err:
        line = moved_key_of(err)
        raise ConfigError(line or f"invalid config: {err}") from err


def moved_key_of(err: BaseException) -> str | None:
    """The line naming where a moved key went, when ``err`` (or what caused it) is the
    schema refusing one of the old objective roots (``preference``, ...), else None."""
    while err is not None:
        key = getattr(err, "full_key", None)
        if isinstance(err, OmegaConfBaseException) and key:
            return moved_line(str(key))
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    return None


def as_config(cls: type, value: Any, key: str) -> Any:
    """``value`` as a ``cls`` dataclass; mappings (saved hyperparameters) are converted."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{key} must be a {cls.__name__} or a mapping, got {type(value).__name__}"
        )
    hints = get_type_hints(cls)
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ConfigError(f"{key} has unknown keys {unknown}; {cls.__name__} takes {sorted(names)}")
    kwargs = {}
    for name, item in value.items():
        hint = hints.get(name)
        if isinstance(hint, type) and is_dataclass(hint) and isinstance(item, Mapping):
            item = as_config(hint, item, f"{key}.{name}")
        kwargs[name] = item
    return cls(**kwargs)
