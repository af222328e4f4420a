"""FSDP2 for the native decoder: shard each block, gather whole weights, read sharded
checkpoints back as one state dict.

The order of model transforms is fixed (see ``CausalLMModule.configure_model``):
weights -> adapter -> float8 -> activation checkpointing -> compile -> ``shard_model``.
Sharded checkpoints are read back whole by
:func:`recipes_lib.checkpoint.sharded.read_sharded_checkpoint`.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from recipes_lib.config.schema import PrecisionConfig, StrategyConfig
from recipes_lib.errors import ConfigError
from recipes_lib.models.moe import ExpertParallel, moe_layers

log = logging.getLogger(__name__)
_MIXED = ("bf16-mixed", "fp8")  # precisions whose compute runs in bf16 over fp32 weights


def mixed_precision_policy(precision: PrecisionConfig) -> MixedPrecisionPolicy:
    """bf16 parameters in compute and fp32 gradient reduction for the mixed precisions;
    otherwise parameters are used (and reduced) in their stored dtype."""
    if precision.name in _MIXED:
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def _quantized_params(model: nn.Module) -> set[nn.Parameter]:
    """Parameters stored in an integer dtype (QLoRA's 4-bit base weights): frozen and
    small, they stay whole on every rank instead of being sharded."""
    return {p for p in model.parameters() if not (p.is_floating_point() or p.is_complex())}


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder's transformer blocks, also under a peft wrapper; a model that names
    its own (``blocks``: the transformers fallback's decoder layers) is asked."""
    declared = getattr(model, "blocks", None)
    if isinstance(declared, list) and declared:
        return declared
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return list(layers)
    raise ValueError(f"{type(model).__name__} has no transformer blocks (a `layers` ModuleList)")


def shard_model(
    model: nn.Module,
    mesh: DeviceMesh,
    strategy: StrategyConfig,
    precision: PrecisionConfig,
) -> nn.Module:
    """Apply ``fully_shard`` to each block, then to the whole model (embeddings, final
    norm, output head), in place; returns ``model``.

    Each block is one unit of all-gather and reduce-scatter, so only one block's full
    parameters exist at a time (two with prefetching). Integer-typed parameters
    (4-bit QLoRA weights) are left unsharded.

    Args:
        model: the built decoder (or its peft wrapper), on the device or the CPU.
        mesh: the one-dimensional data-parallel device mesh.
        strategy: ``strategy.reshard_after_forward`` and ``strategy.cpu_offload``.
        precision: the mixed-precision policy (:func:`mixed_precision_policy`).
    """
    kwargs: dict[str, Any] = {"mesh": mesh, "mp_policy": mixed_precision_policy(precision)}
    if strategy.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    ignored = _quantized_params(model)
    if strategy.expert_parallel:  # the experts stay on their rank, outside FSDP
        ignored |= shard_experts(model, mesh)
    if ignored:
        kwargs["ignored_params"] = ignored
    blocks = _blocks(model)
    for index, block in enumerate(blocks):
        # the last block's parameters are needed again at once by the backward pass
        reshard = strategy.reshard_after_forward and index < len(blocks) - 1
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=strategy.reshard_after_forward, **kwargs)
    return model


def shard_experts(model: nn.Module, mesh: DeviceMesh) -> set[nn.Parameter]:
    """Expert parallelism over ``mesh``: each mixture layer's stacked expert weights
    become ``DTensor`` shards along the experts (``Shard(0)``: rank ``r`` keeps its
    ``E / ranks`` experts whole) and its tokens travel to them by all-to-all
    (:class:`recipes_lib.models.moe.ExpertParallel`); returns those parameters, which
    ``fully_shard`` must leave alone (it would gather them).

    Raises:
        ConfigError: a layer's experts do not divide over the ranks.
    """
    size = mesh.size()
    moved: set[nn.Parameter] = set()
    # the exchange gets a communicator of its own: its all-to-alls would otherwise share
    # one with FSDP's all-gathers and reduce-scatters, which run on other CUDA streams
    # and NCCL does not order between streams (a collective call on every rank)
    group = torch.distributed.new_group(mesh.mesh.flatten().tolist()) if moe_layers(model) else None
    for layer in moe_layers(model):
        if layer.n_experts % size:
            raise ConfigError(
                f"strategy.expert_parallel=true: model.moe_experts={layer.n_experts} does not "
                f"divide over {size} ranks"
            )
        experts = layer.experts
        for linear in (experts.w1, experts.w3, experts.w2):
            for name in ("weight", "bias"):  # a bias (model.moe_bias) is one row per expert
                param = getattr(linear, name)
                if param is None:
                    continue
                shard = distribute_tensor(param.detach(), mesh, [Shard(0)])
                setattr(linear, name, nn.Parameter(shard, requires_grad=param.requires_grad))
                moved.add(getattr(linear, name))
        experts.parallel = ExpertParallel(group, size)
    if moved:
        experts_per_rank = moe_layers(model)[0].n_experts // size
        log.info("expert parallelism: each of %d ranks holds %d experts", size, experts_per_rank)
    return moved


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is an FSDP2 shard (a ``DTensor``)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The whole, unsharded state dict of ``model`` on the CPU.

    With sharded parameters this is a collective (every rank must call it) and only
    global rank 0 receives the tensors; other ranks get an empty dict. Plain models
    return their state dict as it is.
    """
    if not is_sharded(model):
        return model.state_dict()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # a full state dict holds plain tensors; the declared value type also allows the
    # DTensors and nested state of a sharded one
    return cast(dict[str, Tensor], get_model_state_dict(model, options=options))
