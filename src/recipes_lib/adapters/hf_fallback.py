"""LoRA on a model of the transformers fallback (``model.family=hf``), and its adapter in
PEFT's format.

The fallback's modules carry transformers' own names, so ``adapter.target_modules``
are taken as transformers names (the native names ``wq``, ``w1``, ... are read as
``q_proj``, ``gate_proj``, ...): every linear inside a decoder layer whose last name is
a target gets a PEFT LoRA layer. A linear is an ``nn.Linear`` or transformers'
``Conv1D`` (GPT-2 and its kin, whose weights are stored transposed: PEFT's
``fan_in_fan_out``). A model none of whose linears has those names (each architecture
names its own) gets one on every linear of its decoder layers, said in one line.
Merging for export is the library's own (:func:`recipes_lib.adapters.merge_adapter`),
and the adapter folder is PEFT's, over the folder the run started from.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

from safetensors.torch import save_file
from torch import Tensor, nn

from recipes_lib.adapters.lora import (
    _LORA_MARK,
    ADAPTER_NAME,
    HF_TO_NATIVE_TARGET,
    check_adapter_config,
    lora_config,
    lora_factors,
    lora_layers,
    quantized_linear,
)
from recipes_lib.config.schema import AdapterConfig
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.files import chmod_as_umask
from recipes_lib.models.hf_fallback import HFCausalLM

log = logging.getLogger(__name__)
_NATIVE_TO_HF = {native: hf for hf, native in HF_TO_NATIVE_TARGET.items()}
PEFT_PREFIX = "base_model.model."


def is_projection(module: nn.Module) -> bool:
    """Whether LoRA adapts ``module``: an ``nn.Linear``, or transformers' ``Conv1D``
    (GPT-2's projections: a linear whose weight is stored ``(in, out)``)."""
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, nn.Linear | Conv1D)


def stores_transposed(model: nn.Module, targets: list[str]) -> bool:
    """Whether every target is a ``Conv1D`` (PEFT's ``fan_in_fan_out``)."""
    from transformers.pytorch_utils import Conv1D

    modules = dict(model.named_modules())
    return all(isinstance(modules[name], Conv1D) for name in targets)


def fallback_targets(model: HFCausalLM, config: AdapterConfig) -> list[str]:
    """The full names of the linears LoRA adapts (see the module docstring).

    Raises:
        ConfigError: the decoder layers hold no linear (``nn.Linear`` or ``Conv1D``).
    """
    wanted = {_NATIVE_TO_HF.get(name, name) for name in config.target_modules}
    layers = {id(layer) for layer in model.blocks}
    inside: list[str] = []
    for name, module in model.named_modules():
        if id(module) in layers:
            prefix = f"{name}."
            inside += [
                f"{prefix}{child}"
                for child, sub in module.named_modules()
                if child and is_projection(sub)
            ]
    named = [name for name in inside if name.rsplit(".", 1)[-1] in wanted]
    if named:
        return named
    if not inside:
        raise ConfigError(
            f"adapter.kind={config.kind}: {type(model.hf).__name__}'s decoder layers hold no "
            "nn.Linear or Conv1D for LoRA to adapt (its projections are another kind of "
            "layer); train it in full (adapter.kind=none)"
        )
    kinds = sorted({name.rsplit(".", 1)[-1] for name in inside})
    log.warning(
        "adapter.target_modules=%s name no linear of %s; adapting every linear of its "
        "decoder layers: %s",
        list(config.target_modules),
        type(model.hf).__name__,
        kinds,
    )
    return inside


def apply_fallback_adapter(model: HFCausalLM, config: AdapterConfig) -> HFCausalLM:
    """Put LoRA adapters on ``model`` in place and freeze everything else; with QLoRA,
    over its targets quantized to NF4 first (:func:`quantize_targets`).

    Raises:
        ConfigError: a bad adapter config, no linear to adapt, or QLoRA that cannot
            quantize them (off CUDA, or a ``Conv1D``).
    """
    if config.kind == "none":
        return model
    check_adapter_config(config)
    from peft import inject_adapter_in_model

    targets = fallback_targets(model, config)
    if config.kind == "qlora":
        quantize_targets(model, targets, config)
    peft_config = lora_config(config, targets)
    peft_config.fan_in_fan_out = stores_transposed(model, targets)
    inject_adapter_in_model(peft_config, model, adapter_name=ADAPTER_NAME)
    for name, param in model.named_parameters():
        param.requires_grad_(_LORA_MARK in name)
    return model


def quantize_targets(model: HFCausalLM, targets: list[str], config: AdapterConfig) -> None:
    """Replace each target (a full module name) by a frozen NF4 ``Linear4bit``, the
    bases QLoRA trains its adapters over; nothing changes unless every one can be.

    Raises:
        ConfigError: a target is transformers' ``Conv1D`` (bitsandbytes quantizes
            ``nn.Linear`` only), or the model is not on a CUDA device.
    """
    modules = dict(model.named_modules())
    for name in targets:
        module = modules[name]
        if not isinstance(module, nn.Linear):
            raise ConfigError(
                f"adapter.kind=qlora: {name} is a {type(module).__name__}, not an nn.Linear "
                "bitsandbytes can quantize; use adapter.kind=lora"
            )
        if module.weight.device.type != "cuda":
            raise ConfigError(
                f"adapter.kind=qlora quantizes on a CUDA device, but the model was built on "
                f"{module.weight.device}; run with trainer.accelerator=gpu"
            )
    for name in targets:
        parent, _, child = name.rpartition(".")
        linear = modules[name]
        assert isinstance(linear, nn.Linear)
        setattr(modules[parent], child, quantized_linear(linear, config))
    # peft wraps Linear4bit bases in its 4-bit LoRA layer
    model.is_loaded_in_4bit = True  # type: ignore[assignment]


def save_fallback_adapter(
    model: HFCausalLM,
    out_dir: str | os.PathLike,
    config: AdapterConfig,
    *,
    state: Mapping[str, Tensor] | None = None,
) -> Path:
    """Write ``model``'s adapters as a PEFT folder for ``PeftModel.from_pretrained``
    over the transformers model it was trained from (``state``: the adapted state dict
    to take the factors from instead of the model's own).

    Raises:
        CheckpointError: ``model`` has no adapters.
    """
    layers = lora_layers(model)
    if not layers:
        raise CheckpointError(f"cannot save an adapter to {out_dir}: the model has no LoRA layers")
    given = dict(state or {})
    tensors: dict[str, Tensor] = {}
    for name, layer in layers.items():
        for factor, own in zip("AB", lora_factors(layer), strict=True):
            key = f"{name}.lora_{factor}.{ADAPTER_NAME}.weight"
            value = given.get(key, own)
            tensors[f"{PEFT_PREFIX}{name}.lora_{factor}.weight"] = value.detach().cpu().contiguous()
    folder = Path(out_dir).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    peft_config = lora_config(config, sorted({name.rsplit(".", 1)[-1] for name in layers}))
    peft_config.fan_in_fan_out = all(
        getattr(layer, "fan_in_fan_out", False) for layer in layers.values()
    )
    peft_config.task_type = "CAUSAL_LM"
    peft_config.inference_mode = True
    weights = folder / "adapter_model.safetensors"
    save_file(tensors, str(weights), metadata={"format": "pt"})
    chmod_as_umask(weights)  # safetensors creates it 0600
    peft_config.save_pretrained(str(folder))  # adapter_config.json
    return folder
