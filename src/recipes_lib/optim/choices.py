"""The optimizers ``optim.name`` chooses, each built over the same weight-decay groups
(:func:`recipes_lib.optim.optimizer.split_parameters`):

- ``adamw`` (the default): ``torch.optim.AdamW``, fused where it can be;
- ``adamw_8bit``: bitsandbytes' ``AdamW8bit`` (moments in 8 bits; the ``qlora`` extra);
- ``adafactor``: ``torch.optim.Adafactor`` (factored second moments, no first);
- ``muon``: ``torch.optim.Muon`` for the blocks' weight matrices (2-D: the attention and
  MLP projections, a router), AdamW for the rest (embeddings, the output head, norms,
  biases, a mixture's stacked 3-D experts), as Muon's authors prescribe. Muon takes
  ``optim.lr`` and ``optim.weight_decay`` too: its update is scaled to AdamW's RMS
  (``adjust_lr_fn=match_rms_adamw``) unless ``optim.args`` says otherwise;
- any other name: the ``torch.optim`` class of that name (``SGD``, ``RAdam``, ...).

``optim.args`` are the chosen class's further keyword arguments (Muon's for ``muon``),
bound to its signature before anything trains: an unknown one is refused naming it and
listing the class's own. ``optim.betas``, ``optim.eps`` and ``optim.fused`` go to the
classes that take them.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

import torch
from torch import nn

from recipes_lib.config.schema import OptimConfig
from recipes_lib.errors import ConfigError

NAMED = ("adamw", "adamw_8bit", "adafactor", "muon")
FUSED_DEVICE_TYPES = {"cuda", "cpu"}  # where torch's fused AdamW kernel runs


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The class ``optim.name`` names (for ``muon``: Muon, whose partner is AdamW).

    Raises:
        ConfigError: a name that is neither one of :data:`NAMED` nor a ``torch.optim``
            optimizer class, or ``adamw_8bit`` without bitsandbytes.
    """
    if name == "adamw":
        return torch.optim.AdamW
    if name == "adafactor":
        return torch.optim.Adafactor
    if name == "muon":
        return torch.optim.Muon
    if name == "adamw_8bit":
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ConfigError(
                "optim.name=adamw_8bit needs bitsandbytes: pip install 'recipes-lib[qlora]'"
            )
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit
    found = getattr(torch.optim, name, None)
    if isinstance(found, type) and issubclass(found, torch.optim.Optimizer):
        return found
    raise ConfigError(
        f"optim.name={name!r} is not one of {', '.join(NAMED)} or a torch.optim optimizer "
        "class (SGD, RAdam, NAdam, ...)"
    )


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


def check_args(cls: type, args: dict[str, Any]) -> dict[str, inspect.Parameter]:
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


def check_optimizer(config: OptimConfig) -> None:
    """Refuse an unknown ``optim.name`` or ``optim.args`` key before anything is built."""
    check_args(optimizer_class(config.name), dict(config.args))


def _fits(default: Any, value: Any) -> bool:
    """Whether a common setting is of the kind the class's own default is (Adafactor's
    ``eps`` is a pair, not AdamW's one number)."""
    if default is inspect.Parameter.empty or default is None:
        return True
    return isinstance(value, tuple) == isinstance(default, tuple)


def common_kwargs(config: OptimConfig, groups: list[dict[str, Any]]) -> dict[str, Any]:
    """The settings every class gets where its signature has them of that kind; AdamW
    also its kernel (:func:`recipes_lib.optim.build_optimizer`)."""
    common = {
        "lr": config.lr,
        "betas": (float(config.betas[0]), float(config.betas[1])),
        "eps": config.eps,
        "weight_decay": config.weight_decay,
    }
    if config.name not in ("adamw", "muon"):
        return common
    fused = config.fused
    if fused is None:
        kinds = {p.device.type for group in groups for p in group["params"]}
        fused = len(kinds) == 1 and kinds <= FUSED_DEVICE_TYPES
    return {**common, **({"fused": True} if fused else {"foreach": True})}


class _PartsState(MutableMapping):
    """The parts' ``state`` as one mapping; an entry set goes to the part that owns the
    parameter (Lightning moves restored state to the device through it)."""

    def __init__(self, parts: dict[str, torch.optim.Optimizer]):
        self.parts = list(parts.values())

    def _owner(self, param: Any) -> torch.optim.Optimizer:
        for part in self.parts:
            if any(p is param for g in part.param_groups for p in g["params"]):
                return part
        raise KeyError(param)

    def __getitem__(self, param: Any) -> Any:
        for part in self.parts:
            if param in part.state:
                return part.state[param]
        raise KeyError(param)

    def __setitem__(self, param: Any, value: Any) -> None:
        self._owner(param).state[param] = value

    def __delitem__(self, param: Any) -> None:
        del self._owner(param).state[param]

    def __iter__(self) -> Iterator[Any]:
        return (param for part in self.parts for param in part.state)

    def __len__(self) -> int:
        return sum(len(part.state) for part in self.parts)


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, stepped as one (Muon and AdamW).

    Its ``param_groups`` are the parts' own group dicts, so a learning-rate schedule
    sets both; its ``state`` reads and writes through to the part that owns a parameter.
    """

    def __init__(self, parts: dict[str, torch.optim.Optimizer]):
        params = [p for part in parts.values() for g in part.param_groups for p in g["params"]]
        self.parts: dict[str, torch.optim.Optimizer] = {}
        super().__init__(params, {})
        self.parts = parts

    # read through to the parts every time: loading a state dict gives them new ones
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [group for part in self.parts.values() for group in part.param_groups]

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        pass  # the base class's own, set while it is built

    @property
    def state(self) -> _PartsState:  # type: ignore[override]
        return _PartsState(self.parts)

    @state.setter
    def state(self, value: Any) -> None:
        pass

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts.values():
            part.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        """One optimizer's layout over the parts' groups in order (``state`` by parameter
        index, ``param_groups``), which ``torch.distributed.checkpoint`` reads under
        FSDP as any optimizer's."""
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Each part gets its groups (in :meth:`state_dict`'s order) and their state,
        indexed from 0 again; a state dict of one entry per part (earlier checkpoints)
        is read too."""
        if set(state_dict) == set(self.parts):
            for name, part in self.parts.items():
                part.load_state_dict(state_dict[name])
            return
        groups, state, start = state_dict["param_groups"], state_dict["state"], 0
        for part in self.parts.values():
            own = groups[start : start + len(part.param_groups)]
            start += len(own)
            local = {index: i for i, index in enumerate(p for g in own for p in g["params"])}
            part.load_state_dict(
                {
                    "state": {local[k]: v for k, v in state.items() if k in local},
                    "param_groups": [{**g, "params": [local[p] for p in g["params"]]} for g in own],
                }
            )


def muon_and_adamw(
    module: nn.Module, groups: list[dict[str, Any]], config: OptimConfig
) -> CombinedOptimizer:
    """Muon over the blocks' 2-D weight matrices of the decayed group, AdamW over the
    rest (the embedding and output head included, whatever their group)."""
    outside = _outer_matrices(module)
    muon_params, adamw_groups = [], []
    for group in groups:
        keep = []
        for p in group["params"]:
            is_matrix = group["name"] == "decay" and p.ndim == 2 and id(p) not in outside
            (muon_params if is_matrix else keep).append(p)
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
        adamw_kwargs = common_kwargs(config, adamw_groups)
        parts["adamw"] = bind(torch.optim.AdamW, adamw_groups, adamw_kwargs, {})
    return CombinedOptimizer(parts)


def _outer_matrices(module: nn.Module) -> set[int]:
    """The ids of the embedding tables and output heads of ``module``."""
    found = set()
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Embedding) or name.rsplit(".", 1)[-1] == "output":
            found.update(id(p) for p in sub.parameters(recurse=False))
    return found
