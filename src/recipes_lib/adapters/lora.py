"""LoRA (through ``peft``) and QLoRA (LoRA over 4-bit NF4 base linears, ``bitsandbytes``).

``peft.inject_adapter_in_model`` wraps each targeted ``nn.Linear`` of the native model in
place: ``layers.0.attention.wq`` becomes a LoRA layer whose frozen ``base_layer`` is the
original linear (or, for QLoRA, a ``bitsandbytes.nn.Linear4bit`` holding it in NF4) and
whose ``lora_A``/``lora_B`` are the only trainable weights. Its output is
``base(x) + scale * B(A(dropout(x)))`` with ``scale = alpha / r``, so merging is
``W + scale * B @ A``.

The target ``experts`` adapts a mixture's stacked experts (``w1``, ``w3`` and ``w2`` of
every mixture layer) through PEFT's ``target_parameters``: each expert gets its own
rank-``r`` update of each weight, added to the weight for the call (so it takes no
dropout), and merging adds it the same way.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar, cast

import torch
from torch import Tensor, nn

from recipes_lib.adapters.frozen_base import (
    NarrowedLinear,
    base_storage_dtype,
    check_base_dtype,
    export_dtype,
    narrow_frozen_linears,
)
from recipes_lib.config.schema import AdapterConfig
from recipes_lib.errors import ConfigError
from recipes_lib.models.families import get_family
from recipes_lib.models.moe import moe_layers

if TYPE_CHECKING:
    from peft.tuners.lora import LoraLayer

ADAPTER_KINDS = ("none", "lora", "qlora")
EXPERTS_TARGET = "experts"  # a mixture's stacked experts: their w1, w3 and w2
# the blocks' linears (wq_a .. wkv_b: multi-head latent attention's; in_qkv .. out_proj:
# linear attention's)
NATIVE_TARGETS = (
    *("wq", "wk", "wv", "wo", "w1", "w2", "w3"),
    *("wq_a", "wq_b", "wkv_a", "wkv_b"),
    *("in_qkv", "in_z", "in_b", "in_a", "out_proj"),
    EXPERTS_TARGET,
)
HF_TO_NATIVE_TARGET = {
    "q_proj": "wq",
    "k_proj": "wk",
    "v_proj": "wv",
    "o_proj": "wo",
    "q_a_proj": "wq_a",
    "q_b_proj": "wq_b",
    "kv_a_proj_with_mqa": "wkv_a",
    "kv_b_proj": "wkv_b",
    "in_proj_qkv": "in_qkv",
    "in_proj_z": "in_z",
    "in_proj_b": "in_b",
    "in_proj_a": "in_a",
    "gate_proj": "w1",
    "down_proj": "w2",
    "up_proj": "w3",
}
ADAPTER_NAME = "default"
COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_LORA_MARK = ".lora_"


def native_targets(config: AdapterConfig) -> list[str]:
    """``adapter.target_modules`` as native names (Hugging Face names are accepted).

    Raises:
        ConfigError: an empty list or a name that is not a linear of the decoder.
    """
    targets = []
    for name in config.target_modules:
        native = HF_TO_NATIVE_TARGET.get(name, name)
        if native not in NATIVE_TARGETS:
            raise ConfigError(
                f"adapter.target_modules: {name!r} is not a linear layer of the model; choose "
                f"from {list(NATIVE_TARGETS)} (or {list(HF_TO_NATIVE_TARGET)})"
            )
        if native not in targets:
            targets.append(native)
    if not targets:
        raise ConfigError(f"adapter.kind={config.kind} needs adapter.target_modules")
    return targets


def check_adapter_config(config: AdapterConfig) -> None:
    """Fail before training on adapter settings that cannot work (QLoRA's CUDA GPU is
    the pre-flight's: :func:`recipes_lib.preflight.check_adapter`).

    Raises:
        ConfigError: an unknown kind or bad rank, alpha, dropout or target, or QLoRA
            without ``bitsandbytes``.
    """
    if config.kind not in ADAPTER_KINDS:
        raise ConfigError(f"adapter.kind={config.kind!r} is not one of {list(ADAPTER_KINDS)}")
    if config.kind == "none":
        return
    if config.r < 1:
        raise ConfigError(f"adapter.r={config.r} must be a positive rank")
    if config.alpha <= 0:
        raise ConfigError(f"adapter.alpha={config.alpha} must be positive")
    if not 0.0 <= config.dropout < 1.0:
        raise ConfigError(f"adapter.dropout={config.dropout} must be in [0, 1)")
    check_base_dtype(config.base_dtype, precision=None)
    if EXPERTS_TARGET in native_targets(config) and config.dropout:
        raise ConfigError(
            f"adapter.dropout={config.dropout} with adapter.target_modules: {EXPERTS_TARGET}: "
            "an expert's adapter is added to its weight, which takes no dropout; set "
            "adapter.dropout=0"
        )
    if config.kind != "qlora":
        return
    if config.compute_dtype not in COMPUTE_DTYPES:
        raise ConfigError(
            f"adapter.compute_dtype={config.compute_dtype!r} is not one of {list(COMPUTE_DTYPES)}"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(
            "adapter.kind=qlora needs the bitsandbytes package, which is not installed "
            "(pip install 'recipes-lib[qlora]'); use adapter=lora instead"
        )


def lora_config(
    config: AdapterConfig,
    targets: list[str] | None = None,
    parameters: list[str] | None = None,
):
    """The ``peft.LoraConfig`` of ``config`` (over native module names by default; with
    ``parameters``, those stacked expert weights too)."""
    from peft import LoraConfig

    return LoraConfig(
        r=config.r,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=targets if targets is not None else native_targets(config),
        target_parameters=parameters or None,
        bias="none",
    )


def _quantize_base_linears(model: nn.Module, targets: list[str], config: AdapterConfig) -> None:
    """Replace each targeted ``nn.Linear`` by a frozen NF4 ``bitsandbytes.nn.Linear4bit``."""
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if child_name not in targets or not isinstance(child, nn.Linear):
                continue
            setattr(parent, child_name, quantized_linear(child, config))
    # peft wraps Linear4bit bases in its 4-bit LoRA layer (torch types a module's
    # attributes as tensors or modules: a flag is neither)
    model.is_loaded_in_4bit = True  # type: ignore[assignment]


def quantized_linear(linear: nn.Linear, config: AdapterConfig) -> nn.Module:
    """A frozen NF4 ``bitsandbytes.nn.Linear4bit`` holding ``linear``'s weights, on its
    CUDA device (moving it there quantizes it).

    Raises:
        ConfigError: ``linear`` is not on a CUDA device.
    """
    import bitsandbytes as bnb

    device = linear.weight.device
    if device.type != "cuda":
        raise ConfigError(
            f"adapter.kind=qlora quantizes on a CUDA device, but the model was built on "
            f"{device}; run with trainer.accelerator=gpu"
        )
    quantized = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=COMPUTE_DTYPES[config.compute_dtype],
        compress_statistics=config.double_quant,
        quant_type="nf4",
    )
    quantized.weight = bnb.nn.Params4bit(
        linear.weight.data,
        requires_grad=False,
        compress_statistics=config.double_quant,
        quant_type="nf4",
    )
    if linear.bias is not None:
        quantized.bias = nn.Parameter(linear.bias.data, requires_grad=False)
    return quantized.to(device)


ModelT = TypeVar("ModelT", bound=nn.Module)


def _mixer_linears(model: nn.Module) -> list[str]:
    """The native names of the token mixers' linears ``model`` has (a latent attention's
    or a linear attention's where it has them), in :data:`NATIVE_TARGETS` order."""
    found = {
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.rsplit(".", 2)[-2:-1] == ["attention"]
    }
    return [target for target in NATIVE_TARGETS if target in found]


def apply_adapter(model: ModelT, config: AdapterConfig, precision: str | None = None) -> ModelT:
    """Put LoRA (or QLoRA) adapters on ``model`` in place and freeze everything else.

    Call after the base weights are loaded. ``kind=none`` returns ``model`` untouched.
    With LoRA, the frozen projections of the blocks are then stored in
    ``adapter.base_dtype`` (``auto``: bf16 under ``precision=bf16-mixed``; see
    :mod:`recipes_lib.adapters.frozen_base`).

    Returns:
        ``model``, whose only trainable parameters are the ``lora_A``/``lora_B`` weights
        (and a score head, ``model.head=score``: a reward model's head is trained whole).

    Raises:
        ConfigError: a bad adapter config (see :func:`check_adapter_config`) or a model
            built on the meta device (deferred init cannot hold adapters).
    """
    if config.kind == "none":
        return model
    check_adapter_config(config)
    if any(p.is_meta for p in model.parameters()):
        raise ConfigError(
            f"adapter.kind={config.kind} cannot be applied to a model built on the meta device "
            "(deferred sharded init); use a strategy that builds the model on its device"
        )
    from peft import inject_adapter_in_model

    targets = native_targets(config)
    if config.kind == "qlora":
        _quantize_base_linears(model, targets, config)
    # by full name: the stacked experts of a mixture (GroupedLinear, not nn.Linear) share
    # the MLP's names and take no adapter; they stay frozen
    linears = [
        name
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in targets
        and isinstance(module, nn.Linear)  # bnb Linear4bit is one
    ]
    mlp = [name for name in linears if name.rsplit(".", 1)[-1] in ("w1", "w2", "w3")]
    layers = moe_layers(model)
    if mlp and layers:
        raise ConfigError(
            f"adapter.target_modules: {mlp[0]} is a dense MLP of a mixture of experts, "
            "whose adapter PEFT would read as one on the experts (transformers fuses them "
            f"under the MLP's names); target the attention: [{', '.join(_mixer_linears(model))}] "
            f"(and {EXPERTS_TARGET} for the routed experts)"
        )
    check_expert_target(config, has_experts=bool(layers))
    experts = _expert_weights(model) if EXPERTS_TARGET in targets else []
    family = getattr(getattr(model, "config", None), "family", None)
    if experts and family is not None and not get_family(family).names.experts_module:
        raise ConfigError(
            f"adapter.target_modules: {EXPERTS_TARGET} on model.family={family}: its Hugging "
            "Face experts have no layout here that a PEFT adapter could be saved in; target "
            "the attention: [wq, wk, wv, wo]"
        )
    if not linears and not experts:
        raise ConfigError(
            f"adapter.target_modules={list(config.target_modules)} match no linear layer of "
            "this model (a mixture's routed experts are the target "
            f"{EXPERTS_TARGET}); target the attention: [wq, wk, wv, wo]"
        )
    peft_config = lora_config(config, linears, experts)
    inject_adapter_in_model(peft_config, model, adapter_name=ADAPTER_NAME)
    trained_head = SCORE_HEAD if has_score_head(model) else None  # a reward model's head
    for name, param in model.named_parameters():
        param.requires_grad_(_LORA_MARK in name or name == trained_head)
    if config.kind == "lora":  # QLoRA's bases are NF4, computed in adapter.compute_dtype
        dtype = base_storage_dtype(config.base_dtype, precision)
        if dtype is not None:
            narrow_frozen_linears(model, dtype)
    return model


SCORE_HEAD = "output.weight"


def check_expert_target(config: AdapterConfig, has_experts: bool) -> None:
    """Refuse the target ``experts`` on a model without routed experts."""
    if config.kind != "none" and EXPERTS_TARGET in native_targets(config) and not has_experts:
        raise ConfigError(
            f"adapter.target_modules: {EXPERTS_TARGET} adapts a mixture's routed experts, "
            "and this model has none (model.moe_experts=0)"
        )


def _expert_weights(model: nn.Module) -> list[str]:
    """The full names of every mixture layer's stacked expert weights."""
    return [
        f"{name}.{part}.weight"
        for name, module in model.named_modules()
        if name.endswith("feed_forward.experts")
        for part in ("w1", "w3", "w2")
        if hasattr(module, part)
    ]


def has_expert_adapter(model: nn.Module) -> bool:
    """Whether ``model``'s adapters include a mixture's stacked experts."""
    return any(_is_expert_adapter(layer) for layer in lora_layers(model).values())


def _is_expert_adapter(layer: LoraLayer) -> bool:
    return hasattr(layer, "parameter_name")  # PEFT's ParamWrapper: a targeted parameter


def has_score_head(model: nn.Module) -> bool:
    """Whether ``model``'s head is a score head (a reward model's), which an adapter
    leaves trainable: it starts fresh, so no adapter over it could learn it."""
    config = getattr(model, "config", None)
    return getattr(config, "head", "lm") == "score"


def lora_layers(model: nn.Module) -> dict[str, LoraLayer]:
    """Module name -> peft LoRA layer, for every adapted linear of ``model``."""
    if "peft" not in sys.modules:
        # no model carries a peft layer before peft is imported; importing it just to
        # find none costs a second and torchao's import-time warnings on every run
        return {}
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def has_adapter(model: nn.Module) -> bool:
    """Whether ``model`` carries LoRA layers."""
    return bool(lora_layers(model))


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Run ``model`` as its frozen base: every LoRA layer is bypassed inside the block.

    With adapters, the base model is the reference of preference optimisation without
    a second copy. ``requires_grad`` of every parameter is as before afterwards.
    """
    layers = list(lora_layers(model).values())
    trainable = {name: p.requires_grad for name, p in model.named_parameters()}
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)
        for name, param in model.named_parameters():
            param.requires_grad_(trainable[name])


def lora_factors(layer: LoraLayer) -> tuple[Tensor, Tensor]:
    """The A and B weights of a LoRA layer's adapter (its parameters, not copies)."""
    # peft holds each factor as an nn.Linear in a ModuleDict, which types it as a Module
    a = cast(nn.Linear, layer.lora_A[ADAPTER_NAME]).weight
    b = cast(nn.Linear, layer.lora_B[ADAPTER_NAME]).weight
    return a, b


def _base_weight(layer: LoraLayer) -> Tensor:
    """The dense weight of a LoRA layer's base linear (dequantized from NF4 for QLoRA)."""
    base = layer.get_base_layer()
    weight = cast(Tensor, base.weight)  # a linear's, or the stacked experts' parameter
    quant_state = getattr(weight, "quant_state", None)
    if quant_state is not None:
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(weight.data, quant_state).to(quant_state.dtype)
    return weight.detach()


def _merged(
    model: nn.Module, state: Mapping[str, Tensor] | None, with_adapters: bool
) -> dict[str, Tensor]:
    layers = lora_layers(model)
    source = dict(state) if state is not None else {}
    narrowed = {  # frozen linears stored narrower than the model: exported as they were
        f"{name}.{part}": module.source_dtype
        for name, module in model.named_modules()
        if isinstance(module, NarrowedLinear)
        for part in ("weight", "bias")
    }
    out: dict[str, Tensor] = {}
    copies: dict[int, Tensor] = {}  # one CPU copy per tensor: tied weights stay tied
    for name, value in model.state_dict(keep_vars=True).items():
        if _LORA_MARK in name or any(name.startswith(f"{layer}.base_layer.") for layer in layers):
            continue  # LoRA factors, and the (possibly 4-bit) base tensors: merged below
        value = source.get(name, value)
        if id(value) not in copies:
            copies[id(value)] = value.detach().cpu().to(narrowed.get(name, value.dtype))
        out[name] = copies[id(value)]
    for layer_name, layer in layers.items():
        # a float base weight given in ``state`` (whole, where the model's may be an
        # FSDP shard); 4-bit bases are dequantized from the model (never sharded)
        given = source.get(f"{layer_name}.base_layer.weight")
        weight = given if given is not None and given.is_floating_point() else _base_weight(layer)
        dtype = export_dtype(layer.get_base_layer(), weight)
        if with_adapters:
            prefix = f"{layer_name}.lora_{{}}.{ADAPTER_NAME}.weight"
            own_a, own_b = lora_factors(layer)
            a = source.get(prefix.format("A"), own_a).detach().float()
            b = source.get(prefix.format("B"), own_b).detach().float()
            scale = layer.scaling[ADAPTER_NAME]
            if _is_expert_adapter(layer):
                a, b = expert_factors(a, b, weight.shape[0])
                delta = torch.einsum("ore,eri->eoi", b, a) * scale  # (E, out, in)
            else:
                delta = (b @ a) * scale  # (out, in)
                if getattr(layer, "fan_in_fan_out", False):  # a Conv1D's (in, out) weight
                    delta = delta.T
            weight = weight.float() + delta.to(weight.device)
        out[f"{layer_name}.weight"] = weight.to(dtype).cpu()  # one layer at a time on the device
        bias = getattr(layer.get_base_layer(), "bias", None)
        if bias is not None:
            bias = source.get(f"{layer_name}.base_layer.bias", bias)
            out[f"{layer_name}.bias"] = bias.detach().to(dtype).cpu()
    return out


def expert_factors(a: Tensor, b: Tensor, experts: int) -> tuple[Tensor, Tensor]:
    """PEFT's factors of stacked ``(E, out, in)`` expert weights, ``A`` ``(E * r, in)``
    and ``B`` ``(out, r * E)`` (expert ``e`` takes rows ``e * r ..`` of ``A`` and the
    columns ``e, e + E, ..`` of ``B``), as ``(E, r, in)`` and ``(out, r, E)``: expert
    ``e``'s update is ``B[:, :, e] @ A[e]``."""
    return a.reshape(experts, -1, a.shape[-1]), b.reshape(b.shape[0], -1, experts)


def merge_adapter(model: nn.Module, state: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """A plain :class:`~recipes_lib.models.Transformer` state dict: ``W + scale * B @ A``.

    The tensors are on the CPU (merged one layer at a time, so a 4-bit model never
    holds all its dense weights on the GPU at once); QLoRA bases are dequantized.

    Args:
        model: an adapted model (one without adapters gives its own state dict).
        state: the adapted model's state dict to merge instead of its current weights
            (e.g. an average of checkpoints or an EMA); missing entries come from
            ``model``. Base weights are frozen, so only the adapters can differ.
    """
    return _merged(model, state, with_adapters=True)


def base_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The plain state dict (on the CPU) of the base model under the adapters (QLoRA:
    dequantized)."""
    return _merged(model, None, with_adapters=False)
