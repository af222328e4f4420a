"""The ``precision`` config group: its Lightning precision string and the device facts
its checks need.

``32-true``, ``bf16-mixed`` and ``bf16-true`` are Lightning precisions as they stand.
``fp8`` is ``bf16-mixed`` (bf16 autocast over fp32 weights) whose large Linear layers
are swapped for torchao's ``Float8Linear`` by :func:`recipes_lib.parallel.fp8.convert_to_fp8`
when the model is built, so their three matmuls (output, input gradient, weight
gradient) run in float8 with dynamic scales.

:func:`recipes_lib.preflight.check_precision` refuses, before any data or weights are
touched, what cannot run: float8 without a GPU that has float8 tensor cores (compute
capability 8.9: L4, RTX 4090, H100, H200 and newer) or without torchao, float8 over
QLoRA's frozen 4-bit weights, and bf16 on a CPU without native bf16 kernels.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch

from recipes_lib.config.model import head_width
from recipes_lib.config.schema import PrecisionConfig, RunConfig
from recipes_lib.errors import ConfigError
from recipes_lib.kernels.choice import AUTO as ATTENTION_AUTO
from recipes_lib.kernels.choice import packed_rows_backend
from recipes_lib.models.hf_fallback import is_fallback

PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "fp8")
AUTO = "auto"  # resolved by resolve_device_choices before anything else reads it
FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first CUDA cards with float8 tensor cores
FP8_INSTALL_HINT = "pip install 'recipes-lib[fp8]'"
_BF16_PRECISIONS = ("bf16-mixed", "bf16-true", "fp8")  # matmuls and attention in bf16

# the values of lightning.Trainer's precision argument this library passes
LightningPrecision = Literal["32-true", "bf16-mixed", "bf16-true"]
_LIGHTNING_PRECISION: dict[str, LightningPrecision] = {
    "32-true": "32-true",
    "bf16-mixed": "bf16-mixed",
    "bf16-true": "bf16-true",
    "fp8": "bf16-mixed",  # float8 matmuls inside bf16 autocast (see the module docstring)
}
_GPU_ACCELERATORS = ("gpu", "cuda")


def resolve_device_choices(cfg: RunConfig, *, gpu_visible: bool | None = None) -> RunConfig:
    """``cfg`` with the choices left to the device made: ``precision=auto`` becomes
    ``bf16-mixed`` on a CUDA GPU with bf16 support and ``32-true`` elsewhere, and
    ``kernels.compile=null`` compiles each block on CUDA only (on a CPU compiling costs
    more than it saves on a tiny model), and under ``kernels.attention=auto`` the global
    layers of short packed rows on a CUDA GPU in bf16 take ``varlen``
    (``kernels.attention_global``, :func:`recipes_lib.kernels.choice.packed_rows_backend`).
    Other values are returned as they are.

    Args:
        cfg: the typed run config.
        gpu_visible: whether a CUDA GPU is visible; detected unless given.
    """
    if gpu_visible is None:
        gpu_visible = torch.cuda.is_available()
    cuda = device_type(cfg.trainer.accelerator, gpu_visible) == "cuda"
    precision, kernels = cfg.precision, cfg.kernels
    if precision.name == AUTO:
        bf16 = cuda and gpu_visible and torch.cuda.is_bf16_supported()
        precision = dataclasses.replace(precision, name="bf16-mixed" if bf16 else "32-true")
    if kernels.compile is None:
        kernels = dataclasses.replace(kernels, compile=cuda)
    if _packed_rows_on_gpu(cfg, precision, cuda and gpu_visible):
        model = cfg.model
        head_dim = head_width(model)
        name = packed_rows_backend(cfg.data.seq_len, head_dim, detect_cuda_capability())
        if name is not None:
            kernels = dataclasses.replace(kernels, attention_global=name)
    if precision is cfg.precision and kernels is cfg.kernels:
        return cfg
    return dataclasses.replace(cfg, precision=precision, kernels=kernels)


def _packed_rows_on_gpu(cfg: RunConfig, precision: PrecisionConfig, gpu: bool) -> bool:
    """Whether ``auto`` picks the global layers' backend of ``cfg`` from its rows: packed
    with a document mask, on a CUDA GPU, in bf16, its attention plain (no sinks, no
    latent attention, no rows split across ranks, not the transformers fallback, no
    distillation teacher, whose shape is read later), the global layers' key left to
    ``kernels.attention=auto``."""
    kernels, model = cfg.kernels, cfg.model
    if not (gpu and cfg.data.document_mask and precision.name in _BF16_PRECISIONS):
        return False
    global_key = kernels.attention if kernels.attention_global is None else kernels.attention_global
    if global_key != ATTENTION_AUTO:
        return False
    if is_fallback(model) or model.attention_sinks or model.mla_kv_rank is not None:
        return False
    if cfg.stage.objective == "distill":  # its teacher runs these choices, unseen here
        return False
    return cfg.strategy.context_parallel <= 1


def lightning_precision(precision: PrecisionConfig) -> LightningPrecision:
    """The ``precision`` argument of ``lightning.Trainer`` for ``precision``.

    Raises:
        ConfigError: ``precision.name`` is not one of :data:`PRECISIONS`.
    """
    check_precision_name(precision.name)
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


def check_precision_name(name: str) -> None:
    """Refuse a ``precision.name`` that is not one of :data:`PRECISIONS`."""
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


def trains_on_cuda(cfg: RunConfig) -> bool:
    """Whether the run trains on a CUDA GPU: one is visible and ``trainer.accelerator``
    takes it."""
    visible = torch.cuda.is_available()
    return visible and device_type(cfg.trainer.accelerator, visible) == "cuda"


def compute_dtype(precision: str | int | None) -> torch.dtype:
    """The dtype matmuls run in under a Lightning ``precision`` setting."""
    text = str(precision)
    if "bf16" in text:
        return torch.bfloat16
    if text.startswith("16"):
        return torch.float16
    if text.startswith("64"):
        return torch.float64
    return torch.float32
