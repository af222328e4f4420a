"""The pre-flight: every check a run needs before data or weights are touched, once.

A single value is checked where it is consumed (a constructor checks its own arguments;
:mod:`recipes_lib.config.validate` the schema's plain numbers). What depends on two
keys, or on a key and this machine, is checked here, in this order, and the first
problem stops the run with one line naming the keys:

1. every ``_target_`` at any depth against the allowlist (before anything is imported);
2. the model against the weights ``stage.init_from`` holds (every difference at once;
   upcycling: a dense model);
3. the schema's single values (:func:`recipes_lib.config.validate.check_values`);
4. what the stage starts from and what it writes (``init_optimizer``, ``ckpt_path``,
   ``average_last_k`` / ``ema_decay``);
5. the data against the model (sequence length, a new tokenizer's vocabulary) and the
   attention kernel (document masking);
6. the adapter, the precision and the strategy on this machine;
7. the training guard and the batch ramp against the strategy.

Domains declare what they support (:class:`~recipes_lib.parallel.StrategySpec`,
:class:`~recipes_lib.kernels.AttentionCapabilities`); these checks read those
declarations instead of comparing names.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from pathlib import Path
from typing import Literal

import torch

from recipes_lib.adapters import check_adapter_config
from recipes_lib.checkpoint.source import init_model_mismatches, read_init_source
from recipes_lib.checkpoint.upcycle import upcycle_mismatches
from recipes_lib.config.instantiate import check_targets
from recipes_lib.config.schema import RunConfig
from recipes_lib.config.validate import check_values
from recipes_lib.errors import ConfigError
from recipes_lib.kernels import get_attention_backend
from recipes_lib.optim.batch_ramp import check_batch_ramp as check_ramp_config
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
from recipes_lib.stages.guard import check_guard_config

Detect = Literal["detect"]


def check_run(cfg: RunConfig, objectives: tuple[str, ...]) -> None:
    """Every check of a run, in the order of the module docstring.

    Args:
        cfg: the typed run config (``precision=auto`` and ``kernels.compile=null``
            already resolved for the device).
        objectives: the objectives a LightningModule exists for (``stage.objective``).

    Raises:
        ConfigError: the first problem found, naming its keys.
        CheckpointError: ``stage.init_from`` is missing or unreadable.
    """
    check_targets(dataclasses.asdict(cfg), "", cfg.run.allowed_targets)
    check_init_source(cfg)
    check_values(cfg, objectives)
    check_stage_io(cfg)
    check_data_and_kernels(cfg)
    check_adapter(cfg)
    check_precision(cfg)
    check_strategy(cfg)
    check_guard(cfg)
    check_batch_ramp(cfg)


def check_init_source(cfg: RunConfig) -> None:
    """Read what ``stage.init_from`` holds and refuse a model that does not fit it, with
    every difference named at once."""
    if cfg.stage.init_from is None:
        return
    source = read_init_source(cfg.stage.init_from)
    if cfg.stage.upcycle:
        differences = upcycle_mismatches(cfg.model, source.model)
        if differences:
            raise ConfigError(
                f"stage.upcycle=true from stage.init_from={cfg.stage.init_from!r}: "
                + "; ".join(differences)
            )
        return
    differences = init_model_mismatches(cfg.model, source)
    if differences:
        raise ConfigError(
            f"stage.init_from={cfg.stage.init_from!r}: the configured model does not fit it "
            f"({len(differences)} difference(s)): {'; '.join(differences)}; set those model "
            "keys to its values, or take its whole shape with model=from_init"
        )


def check_stage_io(cfg: RunConfig) -> None:
    """What a stage starts from and what it writes as its output weights."""
    stage = cfg.stage
    if stage.average_last_k is not None and stage.ema_decay is not None:
        raise ConfigError(
            f"stage.average_last_k={stage.average_last_k} and stage.ema_decay={stage.ema_decay} "
            "both choose the stage's output weights; set one of them"
        )
    if stage.upcycle and (stage.init_from is None or stage.init_optimizer):
        raise ConfigError(
            "stage.upcycle=true starts a mixture of experts from a dense model's weights: "
            "it needs stage.init_from and no stage.init_optimizer (the moments do not fit)"
        )
    if stage.init_optimizer:
        source = stage.init_from
        if source is None:
            raise ConfigError(
                "stage.init_optimizer=true needs stage.init_from, a Lightning .ckpt whose "
                "optimizer state starts this stage"
            )
        if Path(source).suffix == ".safetensors" or Path(source).expanduser().is_dir():
            raise ConfigError(
                f"stage.init_optimizer=true needs a Lightning .ckpt as stage.init_from; "
                f"{source!r} holds weights only"
            )
    if cfg.run.ckpt_path is not None and stage.init_from is not None:
        raise ConfigError(
            "run.ckpt_path (resume this stage) and stage.init_from (start from other weights) "
            "are both set; choose one"
        )


def check_data_and_kernels(cfg: RunConfig) -> None:
    """The sequences against the model, a new tokenizer against the vocabulary, and the
    document mask against the attention kernel."""
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} is above model.max_seq_len={cfg.model.max_seq_len}"
        )
    # a stage that starts from weights uses their tokenizer (checked against the model
    # when it is loaded); vocab_size only sizes a tokenizer trained from scratch
    trains_tokenizer = cfg.data.tokenizer.path is None and cfg.stage.init_from is None
    if trains_tokenizer and cfg.data.tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"data.tokenizer.vocab_size={cfg.data.tokenizer.vocab_size} does not fit "
            f"model.vocab_size={cfg.model.vocab_size}"
        )
    backend = get_attention_backend(cfg.kernels.attention)
    if cfg.data.document_mask and not backend.capabilities.document_mask:
        raise ConfigError(
            f"data.document_mask=true needs an attention backend with document masking; "
            f"kernels.attention={cfg.kernels.attention} has none (use kernels.attention=flex)"
        )


def check_adapter(cfg: RunConfig) -> None:
    """The adapter's own settings, and QLoRA's CUDA GPU."""
    adapter = cfg.adapter
    check_adapter_config(adapter)
    if adapter.kind != "qlora":
        return
    if not torch.cuda.is_available():
        raise ConfigError(
            "adapter.kind=qlora needs a CUDA GPU (bitsandbytes 4-bit kernels), and none is "
            "available; use adapter=lora on this machine"
        )
    if cfg.trainer.accelerator not in ("auto", "cuda", "gpu"):
        raise ConfigError(
            f"adapter.kind=qlora needs a CUDA GPU, but trainer.accelerator="
            f"{cfg.trainer.accelerator}"
        )


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
        capability = detect_cuda_capability() if detect else cuda_capability
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
    if cfg.kernels.loss_chunk_size is not None:
        raise ConfigError(
            f"precision.fp8_skip={list(precision.fp8_skip)} lets the output head be converted "
            f"to float8, but kernels.loss_chunk_size={cfg.kernels.loss_chunk_size} computes the "
            "head inside the loss, bypassing it; add 'output' to precision.fp8_skip"
        )
    spec = get_strategy(cfg.strategy.name)
    if cfg.model.tie_embeddings and float8_all_gather(precision, fsdp=spec.float8_all_gather):
        raise ConfigError(
            "model.tie_embeddings=true shares the output head's weight with the embedding, "
            f"which float8 all-gather under strategy={spec.name} "
            "(precision.fp8_recipe=tensorwise) would wrap; add 'output' to precision.fp8_skip"
        )


def check_guard(cfg: RunConfig) -> None:
    """The guard's own settings, and a strategy that lets it skip updates."""
    check_guard_config(cfg.guard)
    spec = get_strategy(cfg.strategy.name)
    if cfg.guard.policy not in ("off", "auto") and spec.steps_in_engine:
        raise ConfigError(
            f"guard.policy={cfg.guard.policy} with strategy={cfg.strategy.name}: DeepSpeed "
            "keeps the gradients and the optimizer step inside its engine, so bad updates "
            "cannot be judged or skipped; set guard.policy=off"
        )


def check_batch_ramp(cfg: RunConfig) -> None:
    """A batch ramp's own settings, and a strategy whose accumulation Lightning runs."""
    check_ramp_config(cfg.stage.batch_ramp, cfg.trainer.accumulate_grad_batches)
    if cfg.stage.batch_ramp.tokens and get_strategy(cfg.strategy.name).steps_in_engine:
        raise ConfigError(
            f"stage.batch_ramp.tokens with strategy={cfg.strategy.name}: DeepSpeed fixes "
            "its gradient accumulation when its engine is built; ramp the batch under "
            "ddp or fsdp, or set stage.batch_ramp.tokens=0"
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
            f"strategy.async_checkpoint=true writes sharded checkpoint folders in the "
            f"background ({writers}); strategy={name} saves its checkpoints in the foreground"
        )
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
    if not spec.shards:
        return
    if cfg.kernels.loss_chunk_size is not None:
        raise ConfigError(
            f"kernels.loss_chunk_size={cfg.kernels.loss_chunk_size} reads the output weight "
            f"outside the model's forward, which strategy={name} shards; set it to null"
        )
    for key, value in (
        ("stage.average_last_k", cfg.stage.average_last_k),
        ("stage.ema_decay", cfg.stage.ema_decay),
    ):
        if value is not None:
            raise ConfigError(
                f"{key}={value} averages whole weights on one process; with strategy={name} "
                "they are sharded: run the averaging stage with strategy=single or ddp"
            )
