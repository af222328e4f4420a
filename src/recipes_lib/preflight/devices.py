"""The pre-flight's checks of the machine a run trains on: the precision (and float8),
the optimizer, expert parallelism and the strategy."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Literal

import torch

from recipes_lib.config.schema import RunConfig
from recipes_lib.errors import ConfigError
from recipes_lib.objectives import objective_of
from recipes_lib.optim.choices import check_optimizer, get_optimizer_spec
from recipes_lib.parallel.fp8 import check_fp8_settings, float8_all_gather, fp8_plan
from recipes_lib.parallel.precision import (
    FP8_INSTALL_HINT,
    FP8_MIN_CAPABILITY,
    check_precision_name,
    detect_cpu_bf16,
    detect_cuda_capability,
    device_type,
)
from recipes_lib.parallel.strategy import STRATEGIES, get_strategy

Detect = Literal["detect"]


def check_precision(
    cfg: RunConfig,
    *,
    cuda_capability: tuple[int, int] | None | Detect = "detect",
    cpu_bf16: bool | Detect = "detect",
) -> None:
    """Refuse a precision that cannot run here (``trainer.accelerator``: ``auto`` is a
    GPU when one is visible) or with the rest of the config: an unknown name, bf16 on a
    CPU without native bf16 (``cpu_bf16``), fp8 on a CPU, below compute capability 8.9
    (``cuda_capability``; both detected unless given), without torchao, with QLoRA or a
    strategy without float8, with bad float8 settings or no Linear to convert; a
    sigmoid router's bias steps in bf16."""
    precision = cfg.precision
    check_precision_name(precision.name)
    if precision.name == "bf16-true" and cfg.model.moe_bias_update_rate:
        raise ConfigError(
            "model.moe_bias_update_rate with precision=bf16-true: the router's bias would be "
            "bf16, which rounds its small steps away; use precision=bf16-mixed"
        )
    detect = cuda_capability == "detect"
    # the capability is read only for fp8: reading it initialises CUDA in this process
    gpu_visible = torch.cuda.is_available() if detect else cuda_capability is not None
    device = device_type(cfg.trainer.accelerator, gpu_visible)
    if precision.name.startswith("bf16") and device == "cpu":
        has_bf16 = detect_cpu_bf16() if cpu_bf16 == "detect" else cpu_bf16
        if not has_bf16:
            raise ConfigError(
                f"precision={precision.name} with trainer.accelerator={cfg.trainer.accelerator} "
                "runs on a CPU without native bf16 kernels (x86 needs AVX-512 or AMX, Arm the "
                "BF16 extension): torch would emulate bf16 several times slower than fp32; "
                "use precision=32-true"
            )
    if precision.name == "fp8":
        capability = detect_cuda_capability() if cuda_capability == "detect" else cuda_capability
        _check_fp8(cfg, device, capability)


def _check_fp8(cfg: RunConfig, device: str, capability: tuple[int, int] | None) -> None:
    precision = cfg.precision
    check_fp8_settings(precision)
    if cfg.adapter.kind == "qlora":
        raise ConfigError(
            "precision=fp8 with adapter.kind=qlora: QLoRA's frozen base weights are stored in "
            "4-bit NF4 and cannot also be cast to float8; use precision=bf16-mixed with "
            "QLoRA, or adapter.kind=lora with precision=fp8"
        )
    if not get_strategy(cfg.strategy.name).float8:
        raise ConfigError(
            f"precision=fp8 with strategy.name={cfg.strategy.name}: torchao's float8 layers "
            "compose with FSDP2, not with DeepSpeed's partitioned parameters and its own bf16 "
            "mode; use strategy=fsdp (or single, ddp)"
        )
    gpu_hint = "float8 tensor cores (compute capability 8.9+: L4, RTX 4090, H100, H200)"
    if device != "cuda":
        raise ConfigError(
            f"precision=fp8 needs a CUDA GPU with {gpu_hint}, but trainer.accelerator="
            f"{cfg.trainer.accelerator} runs on {device}; use precision=bf16-mixed or 32-true"
        )
    if capability is None:
        raise ConfigError(
            f"precision=fp8 with trainer.accelerator={cfg.trainer.accelerator}: no CUDA GPU "
            "is visible on this machine"
        )
    if tuple(capability) < FP8_MIN_CAPABILITY:
        major, minor = capability
        raise ConfigError(
            f"precision=fp8 needs a GPU with {gpu_hint}; this one has compute capability "
            f"{major}.{minor}: use precision=bf16-mixed"
        )
    try:
        importlib.import_module("torchao.float8")
    except ImportError as err:
        raise ConfigError(
            f"precision=fp8 needs torchao's float8 training ({FP8_INSTALL_HINT}), which "
            f"cannot be imported: {err}"
        ) from err
    _check_fp8_layers(cfg)


def _check_fp8_layers(cfg: RunConfig) -> None:
    """Refuse a float8 conversion that would change nothing or be bypassed."""
    from recipes_lib.models import Transformer

    precision = cfg.precision
    with torch.device("meta"):  # shapes only
        model = Transformer(cfg.model)
    plan = fp8_plan(model, precision)
    converted = [name for name, reason in plan.items() if reason is None]
    if not converted:
        reasons = sorted({reason for reason in plan.values() if reason is not None})
        raise ConfigError(
            f"precision=fp8 would convert no Linear layer of model.name={cfg.model.name} "
            f"(precision.fp8_min_features={precision.fp8_min_features}, "
            f"precision.fp8_skip={list(precision.fp8_skip)}): {'; '.join(reasons)}. "
            "Lower precision.fp8_min_features or use precision=bf16-mixed"
        )
    if "output" not in converted:
        return
    inside_head = objective_of(cfg).loss_inside_head
    if cfg.kernels.loss_chunk_size is not None or inside_head:
        fused = (
            f"stage.objective={cfg.stage.objective} computes its loss inside the head"
            if cfg.kernels.loss_chunk_size is None
            else f"kernels.loss_chunk_size={cfg.kernels.loss_chunk_size} computes the head "
            "inside the loss"
        )
        raise ConfigError(
            f"precision.fp8_skip={list(precision.fp8_skip)} lets the output head be converted "
            f"to float8, but {fused}, bypassing it; add 'output' to precision.fp8_skip"
        )
    spec = get_strategy(cfg.strategy.name)
    if cfg.model.tie_embeddings and float8_all_gather(precision, fsdp=spec.float8_all_gather):
        raise ConfigError(
            "model.tie_embeddings=true shares the output head's weight with the embedding, "
            f"which float8 all-gather under strategy={spec.name} "
            "(precision.fp8_recipe=tensorwise) would wrap; add 'output' to precision.fp8_skip"
        )


def _device_count(devices: object) -> int | None:
    """How many devices ``trainer.devices`` names, when that is known without hardware."""
    if isinstance(devices, int) and devices > 0:
        return devices
    if isinstance(devices, list | tuple):
        return len(devices)
    if isinstance(devices, str) and devices.strip().isdigit():
        return int(devices)
    if isinstance(devices, str) and "," in devices:
        return len([d for d in devices.split(",") if d.strip()])
    return None


def check_optimizer_choice(cfg: RunConfig, spec) -> None:
    """The optimizer and its arguments, and what its spec says it works with: a strategy
    that steps its own optimizer, sharded parameters, moments to carry over."""
    optimizer = get_optimizer_spec(cfg.optim.name)
    if not optimizer.engine_steps and spec.steps_in_engine:
        able = ", ".join(s for s, other in STRATEGIES.items() if not other.steps_in_engine)
        raise ConfigError(
            f"optim.name={optimizer.name} cannot be stepped by strategy={spec.name}, which "
            f"steps its own optimizer; use strategy={able}"
        )
    if not optimizer.sharded_params and spec.shard is not None:
        able = ", ".join(s for s, other in STRATEGIES.items() if other.shard is None)
        raise ConfigError(
            f"optim.name={optimizer.name} steps whole tensors, and strategy={spec.name} "
            f"shards the parameters; use strategy={able}"
        )
    if cfg.stage.init_optimizer and not optimizer.adam_moments:
        raise ConfigError(
            f"stage.init_optimizer=true carries AdamW's moments; optim.name={cfg.optim.name}"
        )
    check_optimizer(cfg.optim)


def check_expert_parallel(cfg: RunConfig, spec, devices: int | None) -> None:
    """A strategy that can, a mixture of experts, experts that divide over the ranks."""
    if not spec.expert_parallel:
        able = ", ".join(s for s, other in STRATEGIES.items() if other.expert_parallel)
        raise ConfigError(
            f"strategy.expert_parallel=true needs strategy={able}; strategy={spec.name} "
            "keeps every expert on every rank"
        )
    experts = cfg.model.moe_experts
    if not experts:
        raise ConfigError(
            "strategy.expert_parallel=true needs a mixture of experts (model.moe_experts)"
        )
    ranks = None if devices is None else devices * cfg.trainer.num_nodes
    if ranks and experts % ranks:
        raise ConfigError(
            f"strategy.expert_parallel=true: model.moe_experts={experts} does not divide over "
            f"{ranks} ranks (trainer.devices x trainer.num_nodes)"
        )


def check_replicas(cfg: RunConfig, devices: int | None) -> None:
    """``strategy.replicas``: hsdp's only, and dividing the ranks."""
    replicas = cfg.strategy.replicas
    if replicas is not None and cfg.strategy.name != "hsdp":
        raise ConfigError(
            f"strategy.replicas={replicas} is hsdp's (copies of a model sharded within each); "
            f"strategy={cfg.strategy.name} has none"
        )
    ranks = None if devices is None else devices * cfg.trainer.num_nodes
    copies = replicas or cfg.trainer.num_nodes
    if cfg.strategy.name == "hsdp" and ranks and (copies < 1 or ranks % copies):
        raise ConfigError(
            f"strategy.replicas={copies} does not divide the {ranks} ranks "
            "(trainer.devices x trainer.num_nodes) of strategy=hsdp"
        )


def check_strategy(cfg: RunConfig) -> None:
    """Refuse a strategy that cannot run as set, from what its spec declares."""
    spec = get_strategy(cfg.strategy.name)
    name = spec.name
    count = _device_count(cfg.trainer.devices)
    if not spec.multi_device and (count is not None and count > 1 or cfg.trainer.num_nodes > 1):
        raise ConfigError(
            f"strategy={name} runs on one device, but trainer.devices={cfg.trainer.devices} "
            f"and trainer.num_nodes={cfg.trainer.num_nodes}; use strategy=ddp or strategy=fsdp"
        )
    if cfg.strategy.cpu_offload and not spec.cpu_offload:
        offloading = ", ".join(s for s, other in STRATEGIES.items() if other.cpu_offload)
        raise ConfigError(
            f"strategy.cpu_offload=true needs a sharded strategy ({offloading}); "
            f"strategy={name} keeps everything on the device"
        )
    if cfg.strategy.async_checkpoint and not spec.async_checkpoint:
        writers = ", ".join(s for s, other in STRATEGIES.items() if other.async_checkpoint)
        raise ConfigError(
            f"strategy.async_checkpoint=true writes checkpoints in the background "
            f"({writers}); strategy={name} saves its checkpoints in the foreground"
        )
    check_optimizer_choice(cfg, spec)
    check_replicas(cfg, count)
    if cfg.strategy.expert_parallel:
        check_expert_parallel(cfg, spec, count)
    if spec.needs_package is not None:
        package, hint = spec.needs_package
        if importlib.util.find_spec(package) is None:
            raise ConfigError(f"strategy={name} needs {package}, which is not installed: {hint}")
    if spec.needs_cuda and device_type(cfg.trainer.accelerator, torch.cuda.is_available()) == "cpu":
        raise ConfigError(f"strategy={name} needs CUDA GPUs (trainer.accelerator=gpu)")
    if cfg.adapter.kind == "qlora" and not spec.quantized_weights:
        raise ConfigError(
            f"adapter.kind=qlora with strategy={name}: it cannot partition 4-bit weights; "
            "use strategy=single, ddp or fsdp"
        )
    if cfg.kernels.loss_chunk_size is not None and not spec.fused_head:
        raise ConfigError(
            f"kernels.loss_chunk_size={cfg.kernels.loss_chunk_size}: the fused head loss is "
            f"not supported with strategy={name}; set it to null or use strategy=fsdp"
        )
    if not spec.shards:
        return
    for key, value in (
        ("stage.average_last_k", cfg.stage.average_last_k),
        ("stage.ema_decay", cfg.stage.ema_decay),
    ):
        if value is not None:
            raise ConfigError(
                f"{key}={value} averages whole weights on one process; with strategy={name} "
                "they are sharded: run the averaging stage with strategy=single or ddp"
            )
