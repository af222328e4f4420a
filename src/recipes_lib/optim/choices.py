"""The ``optim`` group: each optimizer choice declared once, with what it supports and the
state it keeps.

==============  ==============================================================
``adamw``       ``torch.optim.AdamW`` (the default), fused where it can be
``adamw_8bit``  bitsandbytes' ``AdamW8bit``: moments in 8 bits (the ``qlora`` extra)
``adafactor``   ``torch.optim.Adafactor``: factored second moments, no first
``muon``        ``torch.optim.Muon`` for the blocks' weight matrices (2-D: the attention
                and MLP projections, a router), AdamW for the rest (embeddings, the
                output head, norms, biases, a mixture's stacked 3-D experts), as Muon's
                authors prescribe. Its update is scaled to AdamW's RMS
                (``adjust_lr_fn=match_rms_adamw``) unless ``optim.args`` says otherwise,
                so ``optim.lr`` and ``optim.weight_decay`` serve both
==============  ==============================================================

Any other ``optim.name`` that is a ``torch.optim`` class (``SGD``, ``RAdam``, ...) gets a
spec made for it, its state measured on a probe (:func:`~.state.measured_state`).

An :class:`OptimizerSpec` says how its optimizer is built over the weight-decay groups
(:func:`recipes_lib.optim.optimizer.split_parameters`), what it works with (torch's fused
and for-each kernels, FSDP2's sharded parameters, a DeepSpeed engine's step, AdamW's
moments from another run) and its state bytes per parameter, which the memory estimate of
the pre-launch check reads. Adding an optimizer is one spec in :data:`OPTIMIZERS` and one
``conf/optim/<name>.yaml``.

``optim.args`` are the chosen class's further keyword arguments (Muon's for ``muon``),
bound to its signature before anything trains: an unknown one is refused naming it and
listing the class's own. ``optim.betas``, ``optim.eps`` and ``optim.fused`` go to the
classes that take them.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from recipes_lib.config.schema import OptimConfig
from recipes_lib.errors import ConfigError
from recipes_lib.optim.combined import CombinedOptimizer
from recipes_lib.optim.state import (
    ParameterInfo,
    adafactor_state,
    adamw_8bit_shared,
    adamw_8bit_state,
    adamw_state,
    measured_state,
    muon_state,
    takes_muon,
)

FUSED_DEVICE_TYPES = {"cuda", "cpu"}  # where torch's fused AdamW kernel runs

StateBytes = Callable[[ParameterInfo, Mapping[str, Any]], int]
SharedStateBytes = Callable[[list[ParameterInfo], Mapping[str, Any]], int]
Build = Callable[[nn.Module, list[dict[str, Any]], OptimConfig], torch.optim.Optimizer]


@dataclass(frozen=True)
class OptimizerSpec:
    """One choice of the ``optim`` group and what it supports.

    Attributes:
        name: ``optim.name``.
        load: the optimizer class (for ``muon``: Muon, whose partner is AdamW); imports
            its package only when called.
        state: bytes of optimizer state for one trainable parameter and ``optim.args``
            (:mod:`recipes_lib.optim.state`).
        shared_state: bytes kept once per optimizer beside the per-parameter state
            (8-bit quantization maps), or None.
        build: the optimizer over the weight-decay groups of a module (None: the class
            over the groups, with the common settings it takes and ``optim.args``).
        kernels: the torch kernels its AdamW steps with, of ``fused`` and ``foreach``;
            ``optim.fused`` picks one, else fused where every parameter is on one kind
            of device that has it.
        sharded_params: it steps FSDP2's sharded (DTensor) parameters.
        engine_steps: a strategy that steps its own optimizer (DeepSpeed) can step it.
        adam_moments: its state is AdamW's moments, which ``stage.init_optimizer`` can
            start from another run's.
        needs_package: the package it imports, with its install hint.
        needs_cuda: its state and step run on CUDA GPUs only.
    """

    name: str
    load: Callable[[], type[torch.optim.Optimizer]]
    state: StateBytes
    shared_state: SharedStateBytes | None = None
    build: Build | None = None
    kernels: tuple[str, ...] = ()
    sharded_params: bool = True
    engine_steps: bool = True
    adam_moments: bool = False
    needs_package: tuple[str, str] | None = None
    needs_cuda: bool = False

    def state_bytes(self, params: Sequence[ParameterInfo], args: Mapping[str, Any]) -> int:
        """Bytes of ``optimizer.state`` after a step over ``params``, for ``optim.args``."""
        total = sum(self.state(p, args) for p in params)
        if self.shared_state is not None:
            total += self.shared_state(list(params), args)
        return total

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        """The class, after checking that its package is installed.

        Raises:
            ConfigError: the package is missing, with its install hint.
        """
        if self.needs_package is not None:
            package, hint = self.needs_package
            if importlib.util.find_spec(package) is None:
                raise ConfigError(f"optim.name={self.name} needs {package}: {hint}")
        return self.load()

    def make(
        self, module: nn.Module, groups: list[dict[str, Any]], config: OptimConfig
    ) -> torch.optim.Optimizer:
        """The optimizer over ``groups`` (the weight-decay groups of ``module``)."""
        if self.build is not None:
            return self.build(module, groups, config)
        kwargs = common_kwargs(config, groups, self.kernels)
        return bind(self.optimizer_class(), groups, kwargs, dict(config.args))


def bind(cls: type, groups: list[dict[str, Any]], kwargs: dict[str, Any], args: dict[str, Any]):
    """``cls(groups, **kwargs, **args)`` after checking every argument against its
    signature; of ``kwargs`` (the common settings) only those it takes are passed.

    Raises:
        ConfigError: an ``optim.args`` key the class does not take, or a value it refuses.
    """
    accepted = check_args(cls, args)
    taken = {k: v for k, v in kwargs.items() if k in accepted and _fits(accepted[k].default, v)}
    try:
        return cls(groups, **{**taken, **args})
    except (TypeError, ValueError) as err:
        raise ConfigError(f"optim.name={cls.__name__} refused its arguments: {err}") from err


def check_args(cls: type, args: Mapping[str, Any]) -> dict[str, inspect.Parameter]:
    """``cls``'s signature, after refusing an ``optim.args`` key it does not take.

    Raises:
        ConfigError: naming the key and listing the class's arguments.
    """
    accepted = inspect.signature(cls).parameters
    unknown = [k for k in args if k not in accepted or k == "params"]
    if unknown:
        own = ", ".join(k for k in accepted if k not in ("self", "params"))
        raise ConfigError(
            f"optim.args.{unknown[0]} is not an argument of {cls.__name__} (its arguments: {own})"
        )
    return dict(accepted)


def _fits(default: Any, value: Any) -> bool:
    """Whether a common setting is of the kind the class's own default is (Adafactor's
    ``eps`` is a pair, not AdamW's one number)."""
    if default is inspect.Parameter.empty or default is None:
        return True
    return isinstance(value, tuple) == isinstance(default, tuple)


def common_kwargs(
    config: OptimConfig, groups: list[dict[str, Any]], kernels: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The settings every class gets where its signature has them of that kind, and
    the kernel of one that has torch's fused and for-each kernels (``kernels``)."""
    common = {
        "lr": config.lr,
        "betas": (float(config.betas[0]), float(config.betas[1])),
        "eps": config.eps,
        "weight_decay": config.weight_decay,
    }
    if not kernels:
        return common
    fused = config.fused
    if fused is None:
        kinds = {p.device.type for group in groups for p in group["params"]}
        fused = "fused" in kernels and len(kinds) == 1 and kinds <= FUSED_DEVICE_TYPES
    return {**common, **({"fused": True} if fused else {"foreach": True})}


def muon_and_adamw(
    module: nn.Module, groups: list[dict[str, Any]], config: OptimConfig
) -> CombinedOptimizer:
    """Muon over the blocks' 2-D weight matrices of the decayed group, AdamW over the
    rest (the embedding and output head included, whatever their group)."""
    outside = outer_matrices(module)
    muon_params: list[nn.Parameter] = []
    adamw_groups: list[dict[str, Any]] = []
    for group in groups:
        keep: list[nn.Parameter] = []
        for p in group["params"]:
            (muon_params if takes_muon(p.ndim, group["name"], id(p) in outside) else keep).append(p)
        if keep:
            adamw_groups.append({**group, "params": keep})
    parts: dict[str, torch.optim.Optimizer] = {}
    if muon_params:
        kwargs = {
            "lr": config.lr,
            "weight_decay": config.weight_decay,
            "adjust_lr_fn": "match_rms_adamw",
        }
        muon_group = [{"params": muon_params, "name": "muon"}]
        parts["muon"] = bind(torch.optim.Muon, muon_group, kwargs, dict(config.args))
    if adamw_groups:
        adamw_kwargs = common_kwargs(config, adamw_groups, ADAMW_KERNELS)
        parts["adamw"] = bind(torch.optim.AdamW, adamw_groups, adamw_kwargs, {})
    return CombinedOptimizer(parts)


def outer_matrices(module: nn.Module) -> set[int]:
    """The ids of the embedding tables and output heads of ``module``."""
    found: set[int] = set()
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Embedding) or name.rsplit(".", 1)[-1] == "output":
            found.update(id(p) for p in sub.parameters(recurse=False))
    return found


def _adamw_8bit() -> type[torch.optim.Optimizer]:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit


ADAMW_KERNELS = ("fused", "foreach")

OPTIMIZERS: dict[str, OptimizerSpec] = {
    spec.name: spec
    for spec in (
        OptimizerSpec(
            name="adamw",
            load=lambda: torch.optim.AdamW,
            state=adamw_state,
            kernels=ADAMW_KERNELS,
            adam_moments=True,
        ),
        OptimizerSpec(
            name="adamw_8bit",
            load=_adamw_8bit,
            state=adamw_8bit_state,
            shared_state=adamw_8bit_shared,
            # its kernels take the plain tensors of whole parameters, not DTensor shards
            sharded_params=False,
            needs_package=("bitsandbytes", "pip install 'recipes-lib[qlora]'"),
            needs_cuda=True,
        ),
        OptimizerSpec(
            name="adafactor",
            load=lambda: torch.optim.Adafactor,
            state=adafactor_state,
        ),
        OptimizerSpec(
            name="muon",
            load=lambda: torch.optim.Muon,
            state=muon_state,
            build=muon_and_adamw,
            kernels=ADAMW_KERNELS,
            # Newton-Schulz needs each whole matrix; DeepSpeed hands it flat partitions
            engine_steps=False,
        ),
    )
}


def get_optimizer_spec(name: str) -> OptimizerSpec:
    """The spec ``optim.name`` names: one of :data:`OPTIMIZERS`, or one made for another
    ``torch.optim`` class (its state measured on a probe).

    Raises:
        ConfigError: any other name, listing the choices.
    """
    if name in OPTIMIZERS:
        return OPTIMIZERS[name]
    found = getattr(torch.optim, name, None)
    if isinstance(found, type) and issubclass(found, torch.optim.Optimizer):
        return OptimizerSpec(name=name, load=lambda: found, state=_measured(found))
    raise ConfigError(
        f"optim.name={name!r} is not one of {', '.join(OPTIMIZERS)} or a torch.optim "
        "optimizer class (SGD, RAdam, NAdam, ...)"
    )


def _measured(cls: type[torch.optim.Optimizer]) -> StateBytes:
    """The state function of ``cls``, measured once per set of ``optim.args``."""
    measured: dict[str, StateBytes] = {}

    def state(param: ParameterInfo, args: Mapping[str, Any]) -> int:
        key = repr(sorted(args.items()))
        if key not in measured:
            measured[key] = measured_state(cls, args)
        return measured[key](param, args)

    return state


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The class ``optim.name`` names (for ``muon``: Muon, whose partner is AdamW).

    Raises:
        ConfigError: an unknown name, or a choice whose package is missing.
    """
    return get_optimizer_spec(name).optimizer_class()


def check_optimizer(config: OptimConfig) -> None:
    """Refuse an unknown ``optim.name`` or ``optim.args`` key before anything is built."""
    check_args(optimizer_class(config.name), dict(config.args))
