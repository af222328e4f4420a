"""Parameter-efficient fine-tuning as transforms of a built model: LoRA and QLoRA.

``apply_adapter(model, AdapterConfig)`` is called by
:meth:`~recipes_lib.training.module.CausalLMModule.configure_model` once the model is
built and its weights loaded; ``merge_adapter`` folds the adapters back into plain
:class:`~recipes_lib.models.Transformer` weights for export, and ``save_adapter``
writes them in PEFT's format for ``peft.PeftModel.from_pretrained``.
"""

from recipes_lib.adapters.lora import (
    ADAPTER_KINDS,
    NATIVE_TARGETS,
    adapters_disabled,
    apply_adapter,
    base_state_dict,
    check_adapter_config,
    has_adapter,
    has_expert_adapter,
    lora_layers,
    merge_adapter,
)
from recipes_lib.adapters.peft_format import hf_target_modules, save_adapter

__all__ = [
    "ADAPTER_KINDS",
    "NATIVE_TARGETS",
    "adapters_disabled",
    "apply_adapter",
    "base_state_dict",
    "check_adapter_config",
    "has_adapter",
    "has_expert_adapter",
    "hf_target_modules",
    "lora_layers",
    "merge_adapter",
    "save_adapter",
]
