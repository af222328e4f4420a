"""Typed pipeline configuration: ordered stages, each a recipe plus where it starts from.

A pipeline YAML (``conf/pipeline/<name>.yaml``, a ``@package _global_`` overlay of
``conf/pipeline_root.yaml``) reads::

    name: demo
    on_change: error            # a completed stage whose config changed: error | rerun | keep
    stages:
      pretrain:
        recipe: pretrain/tiny
      anneal:
        recipe: anneal/tiny
        init: weights           # scratch | weights | weights+optimizer | full | upcycle
        from: pretrain          # an earlier stage, or a manifest / checkpoint path
        lr_from_previous: true
        optim: {weight_decay: 0.0}   # any other key: merged onto the stage's RunConfig

The reserved keys of a stage are :data:`STAGE_KEYS`; every other key is a partial
:class:`~recipes_lib.config.RunConfig` checked against the schema when the stage is
composed (``stages.anneal.optim.lrr`` fails naming that key). ``stages`` is left open
so that ``stages.anneal.optim.lr=1e-4`` works on the command line without a ``+``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, cast

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import MISSING, DictConfig, OmegaConf

from recipes_lib.config.schema import RunConfig
from recipes_lib.config.store import CONFIG_MODULE
from recipes_lib.config.widening import check_composed_widening, check_no_widening
from recipes_lib.errors import ConfigError
from recipes_lib.evaluation.settings import EvalSettings
from recipes_lib.pipeline.gates import Gate, parse_evaluate, parse_gates

PIPELINE_SCHEMA_NAME = "pipeline_schema"
PIPELINE_ROOT = "pipeline_root"
INIT_MODES = ("scratch", "weights", "weights+optimizer", "full", "upcycle")
ON_CHANGE = ("error", "rerun", "keep")
STAGE_KEYS = (
    "recipe",
    "init",
    "from",
    "overrides",
    "lr_from_previous",
    "replay_fraction",
    "kind",
    "evaluate",
    "gates",
    "candidates",
    "by",
    "mode",
)
# train: a recipe's run; eval: evaluate the source's weights (no training); promote: hand
# on the best of earlier stages by one metric
KINDS = ("train", "eval", "promote")
PROMOTE_MODES = ("max", "min")
RUN_CONFIG_KEYS = tuple(f.name for f in fields(RunConfig))
RESERVED_STAGE_NAMES = ("report", "multirun")
_STAGE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass
class PipelineConfig:
    """The root of ``recipes-pipeline``'s configuration (``conf/pipeline_root.yaml``).

    Attributes:
        name: the pipeline's name (folder name and manifest entry).
        dir: the pipeline's folder; stage ``s`` runs in ``<dir>/<s>``.
        on_change: what to do with a completed (or started) stage whose config no
            longer matches its manifest: ``error`` (stop, naming the changed keys),
            ``rerun`` (move its folder aside to ``<stage>.old-<time>`` and train it
            again) or ``keep`` (use its outputs as they are).
        overrides: Hydra overrides applied to every stage, before the stage's own.
        stages: stage name -> stage spec, in order (see the module docstring).
        dry_run: validate every stage and print the plan; train nothing.
    """

    name: str = MISSING
    dir: str = "outputs/pipelines/${name}"
    on_change: str = "error"
    overrides: list[str] = field(default_factory=list)
    stages: dict[str, Any] = field(default_factory=dict)
    dry_run: bool = False


@dataclass(frozen=True)
class StageSpec:
    """One stage of a pipeline, parsed from its YAML node.

    Attributes:
        name: the stage's name (its folder under the pipeline folder).
        recipe: the recipe composed for it, e.g. ``pretrain/tiny``.
        init: ``scratch`` | ``weights`` (the source's output weights) |
            ``weights+optimizer`` (its last checkpoint's weights and AdamW moments,
            this stage's LR schedule) | ``full`` (resume its last checkpoint: step,
            optimizer, schedule and data position continue; ``trainer.max_steps``
            counts from the start of the source stage) | ``upcycle`` (a mixture of
            experts from the dense source's output weights, each expert a copy of its
            layer's MLP: ``stage.upcycle``).
        source: the YAML ``from``: an earlier stage's name or a path to a manifest
            (or a stage folder holding one), a Lightning ``.ckpt``, a ``.safetensors``
            file or a folder holding ``model.safetensors``. ``None``: the stage before.
        overrides: Hydra overrides composed with the recipe.
        lr_from_previous: start from the source's last learning rate (``optim.lr``),
            unless the stage sets ``optim.lr`` itself.
        replay_fraction: share of the mixture drawn from the source stage's data
            sources (continued pretraining with replay); 0 for none.
        settings: every other key: a partial RunConfig merged onto the composed one.
        kind: ``train`` (a recipe's run), ``eval`` (evaluate ``source``'s weights and
            hand them on; no recipe) or ``promote`` (hand on the best of ``candidates``
            by the metric ``by``; no recipe).
        evaluate: tasks to evaluate the stage's output weights on
            (:mod:`recipes_lib.pipeline.gates`); required for ``eval``.
        gates: conditions the stage's metrics must meet, or the pipeline stops.
        candidates: the earlier stages a ``promote`` stage chooses from.
        by: the metric a ``promote`` stage chooses by; ``mode`` ``max`` or ``min``.
    """

    name: str
    recipe: str
    init: str = "scratch"
    source: str | None = None
    overrides: tuple[str, ...] = ()
    lr_from_previous: bool = False
    replay_fraction: float = 0.0
    settings: dict[str, Any] = field(default_factory=dict)
    kind: str = "train"
    evaluate: EvalSettings | None = None
    gates: tuple[Gate, ...] = ()
    candidates: tuple[str, ...] = ()
    by: str | None = None
    mode: str = "max"

    @property
    def trains(self) -> bool:
        return self.kind == "train"

    @property
    def key(self) -> str:
        """How config keys of this stage are named in messages: ``stages.<name>``."""
        return f"stages.{self.name}"


@dataclass(frozen=True)
class PipelineSpec:
    """A parsed pipeline: its folder, change policy, shared overrides and stages."""

    name: str
    dir: Path
    on_change: str
    overrides: tuple[str, ...]
    stages: tuple[StageSpec, ...]
    dry_run: bool = False

    def stage_names(self) -> list[str]:
        return [s.name for s in self.stages]

    def index(self, name: str) -> int:
        return self.stage_names().index(name)


def register_pipeline_schema() -> None:
    """Store :class:`PipelineConfig` as ``pipeline_schema`` (first in ``pipeline_root``).

    The ``stages`` node is left open (not in struct mode), so that a command-line
    override can add keys a stage's YAML does not spell out; those keys are checked
    against :class:`RunConfig` when the stage is composed.
    """
    node = OmegaConf.structured(PipelineConfig)
    OmegaConf.set_struct(node.stages, False)
    ConfigStore.instance().store(name=PIPELINE_SCHEMA_NAME, node=node)


def compose_pipeline(overrides: Sequence[str] = ()) -> DictConfig:
    """Compose a pipeline config exactly as ``recipes-pipeline`` would.

    Args:
        overrides: e.g. ``["pipeline=demo", "stages.anneal.optim.lr=1e-4"]``.

    Raises:
        ConfigError: the pipeline file sets a stage's ``run.allowed_targets``
            (:mod:`recipes_lib.config.widening`).
    """
    register_pipeline_schema()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_module(CONFIG_MODULE, version_base="1.3"):
        cfg = compose(PIPELINE_ROOT, list(overrides))
    check_composed_widening(cfg, overrides)  # a stage's run.allowed_targets: the caller's
    return cfg


def _as_bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} must be true or false")
    return value


def parse_stage(name: str, node: Any, position: int) -> StageSpec:
    """Parse one stage's YAML node into a :class:`StageSpec`.

    Raises:
        ConfigError: naming ``stages.<name>.<key>`` for a missing recipe, a key that
            is neither a stage key nor a RunConfig group, or a bad value.
    """
    key = f"stages.{name}"
    if not isinstance(name, str) or not _STAGE_NAME.match(name):
        raise ConfigError(f"{key}: a stage name is a folder name (letters, digits, '_', '-', '.')")
    if name in RESERVED_STAGE_NAMES:
        raise ConfigError(f"{key}: '{name}' is reserved for the pipeline's own folders")
    if not isinstance(node, Mapping):
        raise ConfigError(f"{key} must be a mapping with at least a recipe, got {node!r}")
    unknown = sorted(set(node) - set(STAGE_KEYS) - set(RUN_CONFIG_KEYS))
    if unknown:
        raise ConfigError(
            f"{key}.{unknown[0]} is neither a stage key ({', '.join(STAGE_KEYS)}) nor a "
            f"config group ({', '.join(RUN_CONFIG_KEYS)})"
        )
    kind = node.get("kind", "train")
    if kind not in KINDS:
        raise ConfigError(f"{key}.kind={kind!r} is not one of: {', '.join(KINDS)}")
    if kind != "train":
        return _parse_decision_stage(name, node, kind)
    recipe = node.get("recipe")
    if not isinstance(recipe, str) or not recipe:
        raise ConfigError(
            f"{key}.recipe is missing: every stage names a recipe (is '{name}' a misspelt "
            "stage name?)"
        )
    for only in ("candidates", "by", "mode"):
        if only in node:
            raise ConfigError(f"{key}.{only} belongs to a promote stage (kind: promote)")
    init = node.get("init")
    source = node.get("from")
    if init is None:
        init = "scratch" if position == 0 and source is None else "weights"
    if init not in INIT_MODES:
        raise ConfigError(f"{key}.init={init!r} is not one of: {', '.join(INIT_MODES)}")
    if source is not None and not isinstance(source, str):
        raise ConfigError(f"{key}.from must be a stage name or a path, got {source!r}")
    overrides = node.get("overrides") or []
    if isinstance(overrides, str) or not all(isinstance(o, str) for o in overrides):
        raise ConfigError(f"{key}.overrides must be a list of Hydra override strings")
    check_no_widening(overrides, f"{key}.overrides")
    replay = node.get("replay_fraction", 0.0)
    if isinstance(replay, bool) or not isinstance(replay, int | float) or not 0 <= replay < 1:
        raise ConfigError(f"{key}.replay_fraction={replay!r} must be a number in [0, 1)")
    lr_from_previous = _as_bool(f"{key}.lr_from_previous", node.get("lr_from_previous", False))
    if init == "scratch" and source is None and (lr_from_previous or replay > 0):
        what = "lr_from_previous" if lr_from_previous else "replay_fraction"
        raise ConfigError(f"{key}.{what} needs a stage to continue from, but {key}.init=scratch")
    settings = {k: v for k, v in node.items() if k not in STAGE_KEYS}
    return StageSpec(
        name=name,
        recipe=recipe,
        init=init,
        source=source,
        overrides=tuple(overrides),
        lr_from_previous=lr_from_previous,
        replay_fraction=float(replay),
        settings=settings,
        evaluate=parse_evaluate(node.get("evaluate"), f"{key}.evaluate"),
        gates=parse_gates(node.get("gates"), f"{key}.gates"),
    )


def _parse_decision_stage(name: str, node: Mapping, kind: str) -> StageSpec:
    """An ``eval`` or ``promote`` stage: no recipe, no training; what it reads."""
    key = f"stages.{name}"
    allowed = {"kind", "from", "evaluate", "gates"} | (
        {"candidates", "by", "mode"} if kind == "promote" else set()
    )
    extra = sorted(set(node) - allowed)
    if extra:
        raise ConfigError(
            f"{key}.{extra[0]}: {kind} stages train nothing; they take only "
            f"{', '.join(sorted(allowed))}"
        )
    source = node.get("from")
    evaluate = parse_evaluate(node.get("evaluate"), f"{key}.evaluate")
    gates = parse_gates(node.get("gates"), f"{key}.gates")
    if kind == "eval":
        if evaluate is None:
            raise ConfigError(f"{key}.evaluate: an eval stage names the tasks it evaluates")
        if source is not None and not isinstance(source, str):
            raise ConfigError(f"{key}.from must be a stage name or a path, got {source!r}")
        return StageSpec(name, "-", "weights", source, kind=kind, evaluate=evaluate, gates=gates)
    candidates = node.get("candidates")
    if (
        not isinstance(candidates, list | tuple)
        or len(candidates) < 2
        or not all(isinstance(c, str) for c in candidates)
    ):
        raise ConfigError(f"{key}.candidates: a promote stage chooses among two or more stages")
    if len(set(candidates)) != len(candidates):
        raise ConfigError(f"{key}.candidates names a stage twice")
    if source is not None:
        raise ConfigError(f"{key}.from: a promote stage starts from its candidates")
    by = node.get("by")
    if (
        not isinstance(by, str)
        or by.split("/")[0] not in ("eval", "val", "train")
        or (by.startswith("eval/") and by.count("/") != 2)
    ):
        raise ConfigError(
            f"{key}.by: the metric the candidates are compared by, e.g. eval/<task>/acc or val/loss"
        )
    lower_is_better = by.rsplit("/", 1)[-1] in ("loss", "ppl", "perplexity")
    mode = node.get("mode", "min" if lower_is_better else "max")
    if mode not in PROMOTE_MODES:
        raise ConfigError(f"{key}.mode={mode!r} is not one of: {', '.join(PROMOTE_MODES)}")
    return StageSpec(
        name,
        "-",
        "weights",
        candidates[0],
        kind=kind,
        evaluate=evaluate,
        gates=gates,
        candidates=tuple(candidates),
        by=by,
        mode=mode,
    )


def parse_pipeline(cfg: DictConfig | Mapping[str, Any]) -> PipelineSpec:
    """Parse a composed pipeline config (``compose_pipeline`` or the CLI's) into a spec.

    Stage settings are kept unresolved: their interpolations resolve against the
    stage's own RunConfig once it is composed.

    Raises:
        ConfigError: naming the key of the first problem found.
    """
    if isinstance(cfg, DictConfig):
        data = cast(dict[str, Any], OmegaConf.to_container(cfg, resolve=False))  # of a DictConfig
        name, directory = cfg.get("name"), cfg.get("dir")
    else:
        data = dict(cfg)
        name, directory = data.get("name"), data.get("dir")
    data.pop("hydra", None)
    if not isinstance(name, str) or not name or name == MISSING:
        raise ConfigError("name: the pipeline needs a name (choose one with pipeline=NAME)")
    on_change = data.get("on_change", "error")
    if on_change not in ON_CHANGE:
        raise ConfigError(f"on_change={on_change!r} is not one of: {', '.join(ON_CHANGE)}")
    overrides = data.get("overrides") or []
    if isinstance(overrides, str) or not all(isinstance(o, str) for o in overrides):
        raise ConfigError("overrides must be a list of Hydra override strings")
    check_no_widening(overrides, "overrides")
    stages_node = data.get("stages") or {}
    if not isinstance(stages_node, Mapping) or not stages_node:
        raise ConfigError("stages: a pipeline needs at least one stage")
    stages = tuple(
        parse_stage(stage, node, position)
        for position, (stage, node) in enumerate(stages_node.items())
    )
    return PipelineSpec(
        name=name,
        dir=Path(str(directory)).expanduser(),
        on_change=on_change,
        overrides=tuple(overrides),
        stages=stages,
        dry_run=_as_bool("dry_run", data.get("dry_run", False)),
    )
