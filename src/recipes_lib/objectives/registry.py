"""Objectives declared once, each as one frozen :class:`ObjectiveSpec`, looked up by name.

Every objective module ends in its spec and hands it to :func:`register_objective`;
``stage.objective`` names one. What the rest of the library needs to know about an
objective, it asks the spec: the pre-flight (its head, its checks), the launch check
(sequences per example, the frozen models the memory estimate counts), the pipeline
planner and :func:`recipes_lib.train.run` (its module and data builders, whether its
batches vary in shape). Nothing outside this folder compares objective names.

Settings. An objective with settings names a dataclass (``settings``); they live under
``stage.<objective>`` (``stage.dpo.beta``). :func:`register_objective` declares the
dataclass to the schema (:func:`recipes_lib.config.objectives.declare_settings`), which
builds the run schema's stage node with one typed field per declared objective: YAML
and overrides under ``stage.dpo`` are merged onto ``OmegaConf.structured`` of that
dataclass while Hydra composes, so a misspelt key or a wrong type fails there, naming
its full key, and :func:`recipes_lib.config.to_run_config` gives the settings as the
dataclass itself. The schema names no objective: a new one (a plugin, or a test's toy
objective) needs only its module, calling :func:`register_objective` before composing,
and its YAML. The built-in objectives' settings live in :mod:`.settings`, which declares
them to the schema without importing torch, so a command composes, prints or refuses a
config before any objective's module is loaded (:data:`BUILTIN_MODULES`, imported when a
spec is first asked for).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from recipes_lib.config.model import ModelConfig
from recipes_lib.config.objectives import declare_settings
from recipes_lib.config.schema import RunConfig
from recipes_lib.errors import ConfigError


@dataclass(frozen=True)
class FrozenModel:
    """A model an objective keeps beside the policy without training it.

    Attributes:
        role: what it is (``reference``, ``teacher``), for messages.
        model: its shape (the policy's for a reference).
        sharded: split over the ranks as the policy is (else whole on each rank).
        forward_each_step: it runs a forward pass at every step.
        shares_policy: it is the policy itself with its adapters bypassed: it costs a
            forward pass but no memory of its own.
    """

    role: str
    model: ModelConfig
    sharded: bool
    forward_each_step: bool = True
    shares_policy: bool = False


def _nothing(cfg: RunConfig, settings: Any) -> None:
    return None


def _no_frozen_models(cfg: RunConfig, settings: Any) -> tuple[FrozenModel, ...]:
    return ()


def _fixed_shapes(cfg: RunConfig) -> bool:
    return False


def shapes_vary(cfg: RunConfig) -> bool:
    """``batches_vary`` of an objective whose examples come in every length (pairs,
    completions, rollouts), whatever the run's settings."""
    return True


@dataclass(frozen=True)
class ObjectiveSpec:
    """Everything the library needs to know about one training objective.

    Attributes:
        name: its ``stage.objective``.
        module: builds its LightningModule: ``module(cfg, total_steps=..., tokens_per_step=...,
            **extra)``, with ``settings=`` and ``varying_shapes=`` passed by
            :func:`build_module`.
        data: builds its data module: ``data(cfg, total_train_samples=...)``.
        batch: the batch contract, in words (the keys its batches carry).
        loss: its loss, in words (the function in :mod:`recipes_lib.losses`).
        settings: the dataclass of ``stage.<name>``, or None when it has none.
        sequences_per_example: rows of ``data.seq_len`` one example of a micro-batch is
            (a preference pair: two).
        second_sequence_without_gradient: the second sequence of each example runs
            without a gradient (KTO's mismatched twins), so its activations are not kept.
        example_noun: what one example is called in the launch check (``pairs``);
            None: rows of ``data.seq_len``.
        head: ``lm`` (the vocabulary) or ``score`` (one scalar per position).
        loss_inside_head: its loss is computed inside the head's forward (a head
            converted to float8 would be bypassed; a strategy must gather it).
        from_scratch: it is pretraining (a run without ``stage.init_from`` starts from
            random weights, which the token budget judges).
        batches_vary: ``batches_vary(cfg)``: its batches vary in shape, so compiled blocks
            keep a graph per shape kind (:mod:`recipes_lib.kernels.compiled`).
        frozen_models: ``frozen_models(cfg, settings)``: the frozen models a run runs
            through training (what the memory estimate and the step's FLOPs count).
        check: ``check(cfg, settings)``: its cross-key rules, raising ConfigError.
        context_parallel: its rows may be split over ranks
            (``strategy.context_parallel``): its loss is the module's next-token loss (a
            sum over the tokens its labels train, over their count), or is computed from
            sums over whole sequences that the ranks add up (the preference objectives:
            :func:`recipes_lib.parallel.context.group_sum`).
    """

    name: str
    module: Callable[..., Any]
    data: Callable[..., Any]
    batch: str
    loss: str
    settings: type | None = None
    sequences_per_example: int = 1
    second_sequence_without_gradient: bool = False
    example_noun: str | None = None
    head: str = "lm"
    loss_inside_head: bool = False
    from_scratch: bool = False
    batches_vary: Callable[[RunConfig], bool] = _fixed_shapes
    frozen_models: Callable[[RunConfig, Any], tuple[FrozenModel, ...]] = _no_frozen_models
    check: Callable[[RunConfig, Any], None] = _nothing
    context_parallel: bool = False

    def settings_of(self, cfg: RunConfig) -> Any:
        """This objective's settings in ``cfg`` (its defaults where ``cfg`` was built
        without them, e.g. a :class:`RunConfig` made in code); None when it has none."""
        if self.settings is None:
            return None
        value = getattr(cfg.stage, self.name, None)
        return value if isinstance(value, self.settings) else self.settings()


_REGISTRY: dict[str, ObjectiveSpec] = {}


def register_objective(spec: ObjectiveSpec) -> ObjectiveSpec:
    """Declare ``spec`` under its name (a later one of the same name replaces it) and
    its settings to the schema; returns it.

    The built-in objectives are imported on first use: a spec declared elsewhere has
    them imported first, so that one of theirs never replaces it afterwards."""
    if spec.head not in ("lm", "score"):
        raise ConfigError(f"objective {spec.name!r}: head={spec.head!r} is not lm or score")
    if not _loading:  # a spec declared outside the built-ins' own import
        _load_builtins()
    if spec.settings is not None:
        declare_settings(spec.name, spec.settings)
    _REGISTRY[spec.name] = spec
    return spec


# the built-in objectives' modules, each registering its spec when imported
BUILTIN_MODULES = ("distill", "dpo", "grpo", "kto", "orpo", "pretrain", "reward", "sft", "simpo")


_loading = False  # the built-ins are being imported (they register as they load)


def _load_builtins() -> None:
    """Import the built-in objectives (once): they import torch and Lightning, so the
    schema, which needs only their settings, never waits for them."""
    global _loading
    if _loading:
        return
    _loading = True
    try:
        for name in BUILTIN_MODULES:
            importlib.import_module(f"recipes_lib.objectives.{name}")
    finally:
        _loading = False


def objective_names() -> tuple[str, ...]:
    """The names ``stage.objective`` takes."""
    _load_builtins()
    return tuple(_REGISTRY)


def get_objective(name: str) -> ObjectiveSpec:
    """The spec called ``name``.

    Raises:
        ConfigError: no objective has that name (the names are listed).
    """
    _load_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(
            f"stage.objective={name!r} is not one of: {', '.join(_REGISTRY)}"
        ) from None


def objective_of(cfg: RunConfig) -> ObjectiveSpec:
    """The spec of ``cfg.stage.objective``."""
    return get_objective(cfg.stage.objective)


def build_module(cfg: RunConfig, *, total_steps: int, tokens_per_step: int, **extra: Any) -> Any:
    """The LightningModule of ``cfg``'s objective, given its settings and whether its
    batches vary in shape (``extra``: module arguments such as a rollback's
    ``lr_window``)."""
    spec = objective_of(cfg)
    if spec.settings is not None:
        extra["settings"] = spec.settings_of(cfg)
    return spec.module(
        cfg,
        total_steps=total_steps,
        tokens_per_step=tokens_per_step,
        varying_shapes=spec.batches_vary(cfg),
        **extra,
    )


def build_data(cfg: RunConfig, *, total_train_samples: int) -> Any:
    """The data module of ``cfg``'s objective."""
    spec = objective_of(cfg)
    return spec.data(cfg, total_train_samples=total_train_samples)
