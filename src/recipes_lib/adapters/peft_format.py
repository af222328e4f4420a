"""LoRA adapters written in PEFT's format, for the matching ``transformers`` model.

A PEFT adapter folder holds ``adapter_config.json`` (a ``LoraConfig`` whose target
modules are Hugging Face names: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
``gate_proj``, ``up_proj``, ``down_proj``) and ``adapter_model.safetensors`` with keys
such as ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, so

    base = AutoModelForCausalLM.from_pretrained(exported_base)   # export_hf_checkpoint
    model = PeftModel.from_pretrained(base, "<run.dir>/adapter")

gives the same outputs as the adapted native model.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from safetensors.torch import save_file
from torch import Tensor, nn

from recipes_lib.adapters.lora import (
    ADAPTER_NAME,
    HF_TO_NATIVE_TARGET,
    lora_config,
    lora_layers,
    native_targets,
)
from recipes_lib.config.schema import AdapterConfig
from recipes_lib.errors import CheckpointError
from recipes_lib.files import chmod_as_umask
from recipes_lib.models import Transformer
from recipes_lib.models.families import get_family

ADAPTER_CONFIG_NAME = "adapter_config.json"
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
_NATIVE_TO_HF_TARGET = {native: hf for hf, native in HF_TO_NATIVE_TARGET.items()}


def hf_target_modules(config: AdapterConfig) -> list[str]:
    """``adapter.target_modules`` as Hugging Face module names."""
    return [_NATIVE_TO_HF_TARGET[name] for name in native_targets(config)]


def peft_state_dict(
    model: nn.Module, state: Mapping[str, Tensor] | None = None
) -> dict[str, Tensor]:
    """The LoRA factors of ``model`` (or of ``state``) under PEFT's Hugging Face keys."""
    source = state if state is not None else {}
    decoder = next(m for m in model.modules() if isinstance(m, Transformer))
    names = get_family(decoder.config.family).names
    out: dict[str, Tensor] = {}
    for layer_name, layer in lora_layers(model).items():
        hf_name = names.to_hf(f"{layer_name}.weight")
        if hf_name is None:
            raise CheckpointError(f"adapter on {layer_name!r}, which has no Hugging Face name")
        hf_layer = hf_name.removesuffix(".weight")
        for factor, modules in (("A", layer.lora_A), ("B", layer.lora_B)):
            native_key = f"{layer_name}.lora_{factor}.{ADAPTER_NAME}.weight"
            weight = source.get(native_key, modules[ADAPTER_NAME].weight)
            key = f"{PEFT_PREFIX}{hf_layer}.lora_{factor}.weight"
            out[key] = weight.detach().to("cpu").contiguous()
    return out


def save_adapter(
    model: nn.Module,
    out_dir: str | os.PathLike,
    config: AdapterConfig,
    *,
    state: Mapping[str, Tensor] | None = None,
    base_model_name_or_path: str | None = None,
) -> Path:
    """Write ``model``'s adapters as a PEFT folder loadable by ``PeftModel.from_pretrained``.

    Args:
        model: the adapted native model.
        out_dir: the folder to write (created if needed).
        config: the ``adapter`` config the model was adapted with.
        state: the adapted model's state dict to take the LoRA factors from instead of
            the model's own (an average or EMA).
        base_model_name_or_path: recorded in ``adapter_config.json``.

    Raises:
        CheckpointError: ``model`` has no adapters.
    """
    tensors = peft_state_dict(model, state)
    if not tensors:
        raise CheckpointError(f"cannot save an adapter to {out_dir}: the model has no LoRA layers")
    folder = Path(out_dir).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    peft_config = lora_config(config, hf_target_modules(config))
    peft_config.task_type = "CAUSAL_LM"
    peft_config.base_model_name_or_path = base_model_name_or_path
    peft_config.inference_mode = True
    save_file(tensors, str(folder / ADAPTER_WEIGHTS_NAME), metadata={"format": "pt"})
    chmod_as_umask(folder / ADAPTER_WEIGHTS_NAME)  # safetensors creates it 0600
    peft_config.save_pretrained(str(folder))  # adapter_config.json
    return folder
