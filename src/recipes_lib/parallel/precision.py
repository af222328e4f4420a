"""The ``precision`` config group: its Lightning precision string and its checks.

``32-true``, ``bf16-mixed`` and ``bf16-true`` are Lightning precisions as they stand.
``fp8`` is ``bf16-mixed`` (bf16 autocast over fp32 weights) whose large Linear layers
are swapped for torchao's ``Float8Linear`` by :func:`recipes_lib.parallel.fp8.convert_to_fp8`
when the model is built, so their three matmuls (output, input gradient, weight
gradient) run in float8 with dynamic scales.

:func:`check_precision` refuses, before any data or weights are touched, what cannot
run: float8 without a GPU that has float8 tensor cores (compute capability 8.9: L4,
RTX 4090, H100, H200 and newer) or without torchao, float8 over QLoRA's frozen 4-bit
weights, and bf16 on a CPU without native bf16 kernels.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Literal

import torch

from recipes_lib.config.schema import PrecisionConfig, RunConfig
from recipes_lib.errors import ConfigError

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "fp8")
AUTO = "auto"  # resolved by resolve_device_choices before anything else reads it
FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first CUDA cards with float8 tensor cores
FP8_INSTALL_HINT = "pip install 'recipes-lib[fp8]'"

_LIGHTNING_PRECISION = {
    "32-true": "32-true",
    "bf16-mixed": "bf16-mixed",
    "bf16-true": "bf16-true",
    "fp8": "bf16-mixed",  # float8 matmuls inside bf16 autocast (see the module docstring)
}
_GPU_ACCELERATORS = ("gpu", "cuda")

Detect = Literal["detect"]


def resolve_device_choices(cfg: RunConfig, *, gpu_visible: bool | None = None) -> RunConfig:
    """``cfg`` with the choices left to the device made: ``precision=auto`` becomes
    ``bf16-mixed`` on a CUDA GPU with bf16 support and ``32-true`` elsewhere, and
    ``kernels.compile=null`` compiles each block on CUDA only (on a CPU compiling costs
    more than it saves on a tiny model). Other values are returned as they are.

    Args:
        cfg: the typed run config.
        gpu_visible: whether a CUDA GPU is visible; detected unless given.
    """
    if cfg.precision.name != AUTO and cfg.kernels.compile is not None:
        return cfg
    if gpu_visible is None:
        gpu_visible = torch.cuda.is_available()
    cuda = device_type(cfg.trainer.accelerator, gpu_visible) == "cuda"
    precision, kernels = cfg.precision, cfg.kernels
    if precision.name == AUTO:
        bf16 = cuda and gpu_visible and torch.cuda.is_bf16_supported()
        precision = dataclasses.replace(precision, name="bf16-mixed" if bf16 else "32-true")
    if kernels.compile is None:
        kernels = dataclasses.replace(kernels, compile=cuda)
    return dataclasses.replace(cfg, precision=precision, kernels=kernels)


def lightning_precision(precision: PrecisionConfig) -> str:
    """The ``precision`` argument of ``lightning.Trainer`` for ``precision``.

    Raises:
        ConfigError: ``precision.name`` is not one of :data:`PRECISIONS`.
    """
    _check_name(precision.name)
    return _LIGHTNING_PRECISION[precision.name]


def detect_cuda_capability() -> tuple[int, int] | None:
    """The lowest compute capability among the visible CUDA GPUs; None without one."""
    if not torch.cuda.is_available():
        return None
    return min(torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count()))


def detect_cpu_bf16() -> bool:
    """Whether this CPU has native bf16 matmul kernels (oneDNN's).

    oneDNN provides them on x86 CPUs with AVX-512 (bf16 dot products, AMX) and on Arm
    CPUs with the BF16 extension. Elsewhere torch still computes in bf16, but through
    generic fallback kernels several times slower than its fp32 ones.
    """
    if not torch.backends.mkldnn.is_available():
        return False
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def check_precision(
    cfg: RunConfig,
    *,
    cuda_capability: tuple[int, int] | None | Detect = "detect",
    cpu_bf16: bool | Detect = "detect",
) -> None:
    """Raise :class:`ConfigError`, naming the keys, for a precision that cannot run.

    The device follows ``trainer.accelerator`` as everywhere else: ``cpu``, ``gpu``
    (``cuda``), or ``auto``, which is a GPU when one is visible.

    Args:
        cfg: the run config.
        cuda_capability: compute capability of the GPU the run trains on, None where
            there is none; detected from the machine unless given.
        cpu_bf16: whether the CPU has native bf16 kernels; detected unless given.

    Raises:
        ConfigError: an unknown ``precision.name``; bf16 on a CPU without native bf16;
            fp8 on a CPU, on a GPU older than compute capability 8.9, without torchao,
            with ``adapter.kind=qlora`` or a DeepSpeed strategy, with a bad
            ``precision.fp8_recipe``, ``fp8_min_features`` or ``fp8_skip``, or where no
            Linear layer of the model would be converted.
    """
    precision = cfg.precision
    _check_name(precision.name)
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


def _check_name(name: str) -> None:
    if name == AUTO:
        raise ConfigError(
            "precision=auto is resolved by recipes_lib.parallel.precision."
            "resolve_device_choices before the run is checked or built"
        )
    if name not in PRECISIONS:
        raise ConfigError(f"precision.name={name!r} is not one of: {', '.join(PRECISIONS)}")


def device_type(accelerator: str, gpu_visible: bool) -> str:
    """``cpu``, ``cuda`` or the accelerator's own name (``mps``, ...) of a run."""
    if accelerator == "cpu" or (accelerator == "auto" and not gpu_visible):
        return "cpu"
    if accelerator == "auto" or accelerator in _GPU_ACCELERATORS:
        return "cuda"
    return accelerator


def _check_fp8(cfg: RunConfig, device: str, capability: tuple[int, int] | None) -> None:
    from recipes_lib.parallel.fp8 import FP8_ALIGNMENT, check_fp8_recipe

    precision = cfg.precision
    check_fp8_recipe(precision)
    if precision.fp8_min_features < FP8_ALIGNMENT:
        raise ConfigError(
            f"precision.fp8_min_features={precision.fp8_min_features} must be at least "
            f"{FP8_ALIGNMENT}: float8 matmuls need both dimensions to be multiples of "
            f"{FP8_ALIGNMENT}, and smaller layers gain nothing from float8"
        )
    for pattern in precision.fp8_skip:
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(
                f"precision.fp8_skip holds {pattern!r}; each entry is a module-name pattern "
                "such as 'output' or 'layers.0.*'"
            )
    if cfg.adapter.kind == "qlora":
        raise ConfigError(
            "precision=fp8 with adapter.kind=qlora: QLoRA's frozen base weights are stored in "
            "4-bit NF4 and cannot also be cast to float8; use precision=bf16-mixed with "
            "QLoRA, or adapter.kind=lora with precision=fp8"
        )
    if cfg.strategy.name.startswith("deepspeed"):
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
    from recipes_lib.parallel.fp8 import float8_all_gather, fp8_plan

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
    fsdp = cfg.strategy.name == "fsdp"
    if cfg.model.tie_embeddings and float8_all_gather(precision, fsdp=fsdp):
        raise ConfigError(
            "model.tie_embeddings=true shares the output head's weight with the embedding, "
            "which float8 all-gather under strategy=fsdp (precision.fp8_recipe=tensorwise) "
            "would wrap; add 'output' to precision.fp8_skip"
        )
