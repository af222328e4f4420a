"""THE build order of a model, for the policy a stage trains and for any frozen model
beside it (DPO's reference, later a teacher). Every strategy, precision and adapter is
applied here and nowhere else, in this order:

1. the decoder, initialised under the run's seed in a forked RNG (so every strategy
   starts from the same weights and the global random streams are left as they were);
2. its starting weights (``stage.init_from``, or a reference's own source);
3. the adapter: LoRA or QLoRA (the policy only); a frozen model is frozen here, its
   blocks' projections stored in bf16 under bf16-mixed as a LoRA base's are (autocast
   computes them in bf16 anyway: :mod:`recipes_lib.adapters.frozen_base`);
4. float8 Linear layers (a model that trains);
5. activation checkpointing of every block, or of every N-th (a model that trains;
   ``auto`` is resolved before the build, :mod:`recipes_lib.launch_check.autofit`),
   their inputs kept in host memory with ``kernels.activation_offload``;
6. ``torch.compile`` of each block, in place (parameter names stay as they are);
7. sharding over the data-parallel mesh, as the strategy declares.

Compilation must see the final modules (after the adapter and float8), and sharding
comes last, so FSDP's hooks wrap compiled, checkpointed blocks.

A model of the transformers fallback (``model.family=hf``) follows the same order
(:func:`_build_fallback`): transformers' own model with the folder's weights, its
adapter (:mod:`recipes_lib.adapters.hf_fallback`), checkpointing and compilation of
its decoder layers, sharding per decoder layer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import nn

from recipes_lib.adapters import apply_adapter
from recipes_lib.adapters.frozen_base import base_storage_dtype, narrow_frozen_linears
from recipes_lib.checkpoint.source import load_model_weights
from recipes_lib.checkpoint.upcycle import load_upcycled_weights
from recipes_lib.config.schema import (
    AdapterConfig,
    KernelsConfig,
    ModelConfig,
    PrecisionConfig,
    StrategyConfig,
)
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.kernels import AttentionChoice
from recipes_lib.kernels.compiled import compile_blocks
from recipes_lib.kernels.offload import ActivationOffload
from recipes_lib.models import Transformer, TransformerBlock
from recipes_lib.models.hf_fallback import HFCausalLM, build_hf_model, is_fallback
from recipes_lib.models.moe import set_expert_path
from recipes_lib.models.windows import attention_choice
from recipes_lib.parallel.strategy import get_strategy


@dataclass(frozen=True)
class ModelBuild:
    """What :func:`build_model` makes.

    Attributes:
        model, kernels, precision, strategy: the run's config groups.
        init_from: the weights to start from (any source ``stage.init_from`` takes).
        init_label: how errors name ``init_from`` (default ``stage.init_from='...'``).
        adapter: the adapter to apply (None: none; a frozen model has none).
        trains: the model is trained (float8 and activation checkpointing apply).
        varying_shapes: its batches vary in shape: compiled blocks may keep more
            graphs (:func:`recipes_lib.kernels.compiled.compile_blocks`).
        document_mask: its rows are packed with a document mask (``data.document_mask``),
            which ``kernels.attention=auto`` gives every layer a backend for.
    """

    model: ModelConfig
    kernels: KernelsConfig
    precision: PrecisionConfig
    strategy: StrategyConfig
    init_from: str | None = None
    init_label: str | None = None
    upcycle: bool = False  # init_from is dense: each expert starts as its layer's MLP
    adapter: AdapterConfig | None = None
    trains: bool = True
    varying_shapes: bool = False  # batches vary in shape (recipes_lib.kernels.compiled)
    document_mask: bool = False  # rows packed with a document mask (data.document_mask)


def _seeded_decoder(config: ModelConfig, backend: AttentionChoice) -> Transformer:
    """The decoder initialised under the run's seed (``PL_GLOBAL_SEED``, set by
    ``lightning.seed_everything``), in a forked RNG."""
    seed = os.environ.get("PL_GLOBAL_SEED")
    device = torch.get_default_device()
    cuda_devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda_devices, enabled=seed is not None):
        if seed is not None:
            torch.manual_seed(int(seed))
        return Transformer(config, attention=backend)


def build_model(
    plan: ModelBuild,
    *,
    device: torch.device,
    mesh=None,
    attention: AttentionChoice | None = None,
) -> Transformer:
    """The model ``plan`` describes, built in the order of the module docstring.

    Args:
        plan: what to build.
        device: where the decoder is built (the strategy's root device, or the CPU
            when FSDP offloads it).
        mesh: the data-parallel device mesh when the strategy shards the model.
        attention: the attention backend of each kind of layer (default: new ones, as
            ``kernels.attention`` and its per-kind keys name them; a reference shares its
            policy's).

    Raises:
        CheckpointError: ``init_from`` is missing, unreadable or does not fit.
    """
    if is_fallback(plan.model):  # the native decoder's interface, transformers' model
        return cast(Transformer, _build_fallback(plan, device=device, mesh=mesh))
    backend = attention or attention_choice(
        plan.kernels, plan.model, document_mask=plan.document_mask
    )
    with torch.device(device):
        model = _seeded_decoder(plan.model, backend)  # 1
    set_expert_path(model, plan.kernels.experts)
    if plan.init_from is not None:  # 2
        if any(p.is_meta for p in model.parameters()):
            raise CheckpointError(
                f"stage.init_from={plan.init_from!r} cannot load into a model built on the "
                "meta device (deferred sharded init); use a strategy that builds it on device"
            )
        if plan.upcycle:
            label = plan.init_label or f"stage.init_from={plan.init_from!r}"
            load_upcycled_weights(model, plan.init_from, label)
        else:
            load_model_weights(model, plan.init_from, plan.init_label)
    if plan.adapter is not None:  # 3
        model = apply_adapter(model, plan.adapter, plan.precision.name)
    elif not plan.trains:
        model.requires_grad_(False)
        dtype = base_storage_dtype("auto", plan.precision.name)
        if dtype is not None:
            narrow_frozen_linears(model, dtype)
    spec = get_strategy(plan.strategy.name)
    if plan.trains and plan.precision.name == "fp8":  # 4
        from recipes_lib.parallel.fp8 import convert_to_fp8

        all_gather = mesh is not None and spec.float8_all_gather
        convert_to_fp8(model, plan.precision, fsdp=all_gather)
    stride = plan.kernels.checkpoint_stride()  # 0: none; N: blocks 0, N, 2N, ...
    if plan.trains and stride:  # 5
        for index, block in enumerate(_blocks(model)):
            block.checkpoint_activations = index % stride == 0
        if plan.kernels.activation_offload:  # their inputs kept in host memory
            _decoder(model).activation_offload = ActivationOffload()
    if plan.kernels.compile:  # 6
        compile_blocks(_blocks(model), varying_shapes=plan.varying_shapes)
    if mesh is not None and spec.shard is not None:  # 7
        spec.shard(model, mesh, plan.strategy, plan.precision)
    return model


def _build_fallback(plan: ModelBuild, *, device: torch.device, mesh=None) -> HFCausalLM:
    """transformers' own model of ``plan.model`` (``family=hf``), in the order of the
    module docstring."""
    from recipes_lib.adapters.hf_fallback import apply_fallback_adapter
    from recipes_lib.checkpoint.hf_files import is_hf_folder

    label = plan.init_label or f"stage.init_from={plan.init_from!r}"
    folder = None
    if plan.init_from is not None and is_hf_folder(plan.init_from):
        folder = Path(plan.init_from).expanduser()
    seed = os.environ.get("PL_GLOBAL_SEED")
    with torch.random.fork_rng(enabled=seed is not None), torch.device(device):  # 1
        if seed is not None:
            torch.manual_seed(int(seed))
        # transformers' flex attention has no CPU backward: sdpa there
        attention = plan.kernels.attention if device.type == "cuda" else "sdpa"
        model = build_hf_model(plan.model, folder=folder, attention=attention, where=label)
    if plan.init_from is not None and folder is None:  # 2: a stage's or a run's weights
        load_model_weights(model, plan.init_from, plan.init_label)
    if plan.upcycle:
        raise ConfigError(f"{label}: stage.upcycle needs a native model family")
    if plan.adapter is not None:  # 3
        apply_fallback_adapter(model, plan.adapter)
    elif not plan.trains:
        model.requires_grad_(False)
    model.train(plan.trains)  # a trained model as transformers trains it (its dropout on)
    if plan.trains and plan.precision.name == "fp8":  # 4
        raise ConfigError("precision=fp8 needs a native model family (model.family=hf has none)")
    stride = plan.kernels.checkpoint_stride()
    if plan.trains and stride:  # 5
        if plan.kernels.activation_offload:
            raise ConfigError(
                "kernels.activation_offload needs a native model family (model.family=hf has none)"
            )
        model.set_activation_checkpointing(True, stride)
    if plan.kernels.compile:  # 6
        compile_blocks(model.blocks, varying_shapes=plan.varying_shapes)
    spec = get_strategy(plan.strategy.name)
    if mesh is not None and spec.shard is not None:  # 7
        spec.shard(model, mesh, plan.strategy, plan.precision)
    return model


def _decoder(model: nn.Module) -> Transformer:
    """The decoder, also under a peft wrapper."""
    for module in model.modules():
        if isinstance(module, Transformer):
            return module
    raise ValueError(f"{type(model).__name__} holds no Transformer")


def _blocks(model: nn.Module) -> list[TransformerBlock]:
    """The decoder's transformer blocks, also under a peft wrapper."""
    return _decoder(model).blocks
