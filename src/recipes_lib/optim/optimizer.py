"""The optimizer, with decoupled weight decay applied only to weight matrices.

Norm weights, biases and (unless ``decay_embeddings``) embedding tables are left
undecayed; ``optim.name`` chooses the optimizer (:mod:`recipes_lib.optim.choices`), whose
spec also tells the bytes of state it will keep (:func:`optimizer_state_bytes`).
Parameters are classified by the module that owns them, not only by their shape, so
the split stays right when a sharding strategy flattens parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from recipes_lib.config.schema import OptimConfig
from recipes_lib.errors import ConfigError
from recipes_lib.optim.choices import get_optimizer_spec, outer_matrices
from recipes_lib.optim.state import ParameterInfo

DECAY_GROUP = "decay"
NO_DECAY_GROUP = "no_decay"


@dataclass
class ParameterGroups:
    """Trainable parameters of a module split by whether weight decay applies."""

    decay: list[nn.Parameter] = field(default_factory=list)
    no_decay: list[nn.Parameter] = field(default_factory=list)
    decay_names: list[str] = field(default_factory=list)
    no_decay_names: list[str] = field(default_factory=list)


def _is_norm(module: nn.Module) -> bool:
    if isinstance(module, nn.LayerNorm | nn.GroupNorm | nn.RMSNorm):
        return True
    return "norm" in type(module).__name__.lower()


def split_parameters(module: nn.Module, decay_embeddings: bool = False) -> ParameterGroups:
    """Split the trainable parameters of ``module`` into decay and no-decay groups.

    A parameter is decayed when it is a weight matrix (2-D or more) of a module that is
    neither a norm nor an embedding (embeddings are decayed when ``decay_embeddings``).
    Biases, norm weights and other 1-D parameters are never decayed. A parameter shared
    between modules (a tied output projection) appears once, classified as an embedding
    when any of its owners is one. Frozen parameters (``requires_grad=False``) are left out.
    """
    embedding_ids = {
        id(p)
        for m in module.modules()
        if isinstance(m, nn.Embedding)
        for p in m.parameters(recurse=False)
    }
    groups = ParameterGroups()
    seen: set[int] = set()
    for module_name, owner in module.named_modules():
        for param_name, param in owner.named_parameters(recurse=False):
            if id(param) in seen or not param.requires_grad:
                continue
            seen.add(id(param))
            full_name = f"{module_name}.{param_name}" if module_name else param_name
            if id(param) in embedding_ids:
                decayed = decay_embeddings
            elif param_name.endswith("bias") or _is_norm(owner) or param.ndim < 2:
                decayed = False
            else:
                decayed = True
            if decayed:
                groups.decay.append(param)
                groups.decay_names.append(full_name)
            else:
                groups.no_decay.append(param)
                groups.no_decay_names.append(full_name)
    return groups


def build_optimizer(module: nn.Module, config: OptimConfig) -> torch.optim.Optimizer:
    """Build the optimizer ``optim.name`` chooses (:mod:`recipes_lib.optim.choices`)
    over the trainable parameters of ``module``.

    The parameters come in up to two groups, named by their ``"name"`` key: ``"decay"``
    (weight decay ``config.weight_decay``) and ``"no_decay"`` (weight decay 0); an empty
    group is left out. ``fused=None`` picks AdamW's fused kernel when every parameter is
    on one kind of device that has it (CUDA, or the CPU: offloaded optimizer steps run
    there), the for-each one otherwise.

    Args:
        module: The module whose parameters to optimize (under a distributed strategy,
            the wrapped model, so the optimizer sees the parameters that are trained).
        config: the optimizer, its learning rate, decay and further arguments.

    Raises:
        ConfigError: ``optim.betas`` is not two values, ``module`` has no trainable
            parameter, or the optimizer or one of its arguments is unknown.
    """
    if len(config.betas) != 2:
        raise ConfigError(f"optim.betas must hold two values, got {list(config.betas)}")
    spec = get_optimizer_spec(config.name)
    spec.optimizer_class()  # a missing package is named before the groups are made
    param_groups = [
        {"params": params, "weight_decay": weight_decay, "name": name}
        for name, params, weight_decay in _groups(module, config)
        if params
    ]
    if not param_groups:
        raise ConfigError(
            f"{type(module).__name__} has no trainable parameter (requires_grad=True) to optimize"
        )
    return spec.make(module, param_groups, config)


def _groups(module: nn.Module, config: OptimConfig) -> list[tuple[str, list[nn.Parameter], float]]:
    groups = split_parameters(module, decay_embeddings=config.decay_embeddings)
    return [
        (DECAY_GROUP, groups.decay, config.weight_decay),
        (NO_DECAY_GROUP, groups.no_decay, 0.0),
    ]


def describe_parameters(module: nn.Module, config: OptimConfig) -> list[ParameterInfo]:
    """What the optimizer state depends on, for each trainable parameter of ``module``
    (which may be on the meta device), grouped as :func:`build_optimizer` groups them."""
    outside = outer_matrices(module)
    return [
        ParameterInfo(tuple(p.shape), p.dtype, name, id(p) in outside)
        for name, params, _ in _groups(module, config)
        for p in params
    ]


def optimizer_state_bytes(module: nn.Module, config: OptimConfig) -> int:
    """Bytes of state the optimizer ``config`` chooses keeps for ``module``'s trainable
    parameters after its first step (``module`` may be on the meta device)."""
    spec = get_optimizer_spec(config.name)
    return spec.state_bytes(describe_parameters(module, config), dict(config.args))
