"""Float8 training of Linear layers through torchao (``precision=fp8``).

:func:`convert_to_fp8` swaps each large ``nn.Linear`` of a built model for torchao's
``Float8Linear``, which casts its input, weight and output gradient to float8 with
dynamic scales (one per tensor for ``tensorwise``, one per row for ``rowwise``) and runs
the forward matmul and both backward matmuls on the float8 tensor cores; weights,
gradients and optimizer state stay in their own precision. Conversion comes after the
adapter and before activation checkpointing, ``torch.compile`` and ``fully_shard``::

    weights -> adapter -> convert_to_fp8 -> activation checkpointing -> compile -> FSDP2

A layer stays in bf16 when its name matches a ``precision.fp8_skip`` pattern (by
default the output head, whose logits are sensitive to rounding), when either
dimension is below ``precision.fp8_min_features`` (the float8 casts cost more than the
smaller matmul saves) or is not a multiple of 16 (a requirement of the float8 kernels),
and for LoRA's own low-rank factors. :func:`fp8_plan` tells, for each Linear, whether it
is converted and if not why; it is plain Python and needs no torchao.

Under FSDP2 with ``tensorwise`` scaling the weights are all-gathered in float8 (half
the bytes of bf16). Their scales are then computed ahead, for all layers in one
all-reduce, after each optimizer step: :class:`Float8ScaleSync` does it, and
:func:`fp8_callbacks` returns it exactly when it is needed.

LoRA over float8 base layers works (peft wraps ``Float8Linear`` as it wraps any
``nn.Linear``), but torchao computes the weight gradient of the frozen base layers all
the same, so the speed-up is smaller than in full training. QLoRA's 4-bit base layers
cannot be converted (:func:`recipes_lib.preflight.check_precision` refuses it).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterable
from fnmatch import fnmatchcase
from typing import Any, TypeGuard

import lightning as L
from torch import nn

from recipes_lib.callbacks.step import OptimizerStepCallback
from recipes_lib.config.schema import PrecisionConfig
from recipes_lib.errors import ConfigError
from recipes_lib.models.head import OutputHead

FP8_RECIPES = ("tensorwise", "rowwise")
FP8_ALIGNMENT = 16  # both dimensions of a float8 matmul must be multiples of this
_WRAPPER_SUFFIX = ".base_layer"  # where peft keeps the adapted Linear
_LORA_PREFIX = "lora_"  # peft's lora_A / lora_B factors


def matches_skip(name: str, patterns: Iterable[str]) -> bool:
    """Whether module ``name`` matches one of the ``fp8_skip`` patterns.

    A pattern (``fnmatch`` syntax, case-sensitive) matches a module when it matches the
    module's full name or a trailing part of it at a dot, so ``output`` matches
    ``output`` and ``model.output``, ``wo`` every attention output projection and
    ``layers.0.*`` everything in the first block. A peft wrapper's ``.base_layer`` is
    looked through: ``wq`` also matches ``layers.0.attention.wq.base_layer``.
    """
    if name.endswith(_WRAPPER_SUFFIX):
        name = name[: -len(_WRAPPER_SUFFIX)]
    parts = name.split(".")
    suffixes = [".".join(parts[i:]) for i in range(len(parts))]
    return any(fnmatchcase(suffix, pattern) for pattern in patterns for suffix in suffixes)


def fp8_skip_reason(
    name: str, in_features: int, out_features: int, precision: PrecisionConfig
) -> str | None:
    """Why the Linear ``name`` of this shape stays in bf16; None when it is converted."""
    if any(part.startswith(_LORA_PREFIX) for part in name.split(".")):
        return "a LoRA factor"
    if matches_skip(name, precision.fp8_skip):
        return f"matches precision.fp8_skip={list(precision.fp8_skip)}"
    for label, size in (("in_features", in_features), ("out_features", out_features)):
        if size < precision.fp8_min_features:
            return (
                f"{label}={size} is below precision.fp8_min_features={precision.fp8_min_features}"
            )
        if size % FP8_ALIGNMENT != 0:
            return f"{label}={size} is not a multiple of {FP8_ALIGNMENT}"
    return None


def _plain_linear(module: nn.Module) -> TypeGuard[nn.Linear]:
    # not other subclasses: bitsandbytes' 4-bit layers and converted Float8Linear are ones
    return type(module) in (nn.Linear, OutputHead)


def fp8_plan(model: nn.Module, precision: PrecisionConfig) -> dict[str, str | None]:
    """Each Linear of ``model`` -> None if :func:`convert_to_fp8` converts it, else why not.

    Works on any device, ``meta`` included, and without torchao.
    """
    plan: dict[str, str | None] = {}
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if not _plain_linear(module):
            plan[name] = f"a {type(module).__name__}, not a plain nn.Linear"
            continue
        plan[name] = fp8_skip_reason(name, module.in_features, module.out_features, precision)
    return plan


def fp8_module_filter(precision: PrecisionConfig) -> Callable[[nn.Module, str], bool]:
    """torchao's ``module_filter_fn``: True for the Linear layers to convert."""

    def convert(module: nn.Module, name: str) -> bool:
        if not _plain_linear(module):
            return False
        return fp8_skip_reason(name, module.in_features, module.out_features, precision) is None

    return convert


def float8_all_gather(precision: PrecisionConfig, *, fsdp: bool) -> bool:
    """Whether FSDP2 all-gathers the converted weights in float8 (tensorwise scaling only)."""
    return fsdp and precision.name == "fp8" and precision.fp8_recipe == "tensorwise"


def check_fp8_recipe(precision: PrecisionConfig) -> None:
    """Raise :class:`ConfigError` for an unknown ``precision.fp8_recipe``."""
    if precision.fp8_recipe not in FP8_RECIPES:
        recipes = ", ".join(FP8_RECIPES)
        raise ConfigError(f"precision.fp8_recipe={precision.fp8_recipe!r} is not one of: {recipes}")


def check_fp8_settings(precision: PrecisionConfig) -> None:
    """Refuse float8 settings that make no sense on their own: an unknown recipe, a
    minimum layer size below the float8 kernels' alignment, an empty skip pattern."""
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


def _torchao_float8() -> Any:
    try:
        return importlib.import_module("torchao.float8")
    except ImportError as err:
        raise ConfigError(
            "precision=fp8 needs torchao's float8 training (pip install 'recipes-lib[fp8]'), "
            f"which cannot be imported: {err}"
        ) from err


def float8_linear_config(
    precision: PrecisionConfig, *, fsdp: bool = False, emulate: bool = False
) -> Any:
    """torchao's ``Float8LinearConfig`` for ``precision.fp8_recipe``.

    Args:
        precision: the ``precision`` config.
        fsdp: the model will be sharded with FSDP2 (enables float8 all-gather under
            ``tensorwise`` scaling).
        emulate: compute the float8 matmuls in fp32 from the float8 values, for
            machines without float8 tensor cores (tests on CPU); slow.

    Raises:
        ConfigError: an unknown ``precision.fp8_recipe``, or torchao missing.
    """
    check_fp8_recipe(precision)
    config = _torchao_float8().Float8LinearConfig.from_recipe_name(precision.fp8_recipe)
    return dataclasses.replace(
        config,
        enable_fsdp_float8_all_gather=float8_all_gather(precision, fsdp=fsdp),
        emulate=emulate,
    )


def convert_to_fp8(
    model: nn.Module, precision: PrecisionConfig, *, fsdp: bool = False, emulate: bool = False
) -> list[str]:
    """Swap the eligible Linear layers of ``model`` for torchao ``Float8Linear``, in place.

    Does nothing unless ``precision.name`` is ``fp8``. Call after the weights are loaded
    and any adapter is applied, and before activation checkpointing, ``torch.compile``
    and ``fully_shard`` (see the module docstring); a model on the ``meta`` device is
    fine. With ``fsdp`` and ``tensorwise`` scaling, train with :func:`fp8_callbacks`.

    Args:
        model: the built model.
        precision: the ``precision`` config (recipe, skip patterns, minimum size).
        fsdp: the model will be sharded with FSDP2.
        emulate: see :func:`float8_linear_config`.

    Returns:
        The names of the model's ``Float8Linear`` modules, in ``named_modules()`` order
        (a second call converts nothing more and returns the same names).

    Raises:
        ConfigError: an unknown ``precision.fp8_recipe``, or torchao missing.
    """
    if precision.name != "fp8":
        return []
    config = float8_linear_config(precision, fsdp=fsdp, emulate=emulate)
    float8 = _torchao_float8()
    float8.convert_to_float8_training(
        model, module_filter_fn=fp8_module_filter(precision), config=config
    )
    return float8_layers(model)


def float8_layers(model: nn.Module) -> list[str]:
    """The names of the torchao ``Float8Linear`` modules of ``model``."""
    names = []
    for name, module in model.named_modules():
        cls = type(module)
        if cls.__name__ == "Float8Linear" and cls.__module__.startswith("torchao."):
            names.append(name)
    return names


class Float8ScaleSync(OptimizerStepCallback):
    """Precompute the float8 scales of FSDP2-sharded weights after each optimizer step.

    With float8 all-gather each shard is cast to float8 before the all-gather, so all
    ranks must agree on each weight's scale. torchao's
    ``precompute_float8_dynamic_scale_for_fsdp`` computes every layer's scale from the
    updated weights in a single all-reduce; without it each layer pays its own
    all-reduce in the next forward. Its result holds until the weights change, so it
    runs once per optimizer step, not once per accumulated micro-batch.
    """

    def on_optimizer_step_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, step: int
    ) -> None:
        _torchao_float8().precompute_float8_dynamic_scale_for_fsdp(pl_module)


def fp8_callbacks(precision: PrecisionConfig, *, fsdp: bool) -> list[L.Callback]:
    """The callbacks a model converted by :func:`convert_to_fp8` trains with."""
    return [Float8ScaleSync()] if float8_all_gather(precision, fsdp=fsdp) else []
