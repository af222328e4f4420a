"""The Qwen3 family (dense Qwen3): the Llama layout with an RMSNorm on each head's
queries and keys (``model.qk_norm=head``), applied after the projections and before
RoPE, with one gain of ``head_dim`` shared by the heads. No q/k/v biases (unlike
Qwen2); ``head_dim`` is its own setting (128 at every published size, whatever the
width); the small sizes tie their embeddings.

Llama's tensor names (:data:`~recipes_lib.models.families.llama.LLAMA_NAMES`) plus:

    model.layers.N.self_attn.q_norm <-> layers.N.attention.q_norm
    model.layers.N.self_attn.k_norm <-> layers.N.attention.k_norm

The optional sliding window is read as Qwen2's (``use_sliding_window`` with
``max_window_layers``, or ``layer_types``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from recipes_lib.config.schema import ModelConfig
from recipes_lib.models.families.base import (
    Family,
    TensorNames,
    common_from_hf,
    without_attention_bias,
)
from recipes_lib.models.families.llama import LLAMA_NAMES
from recipes_lib.models.families.qwen2 import qwen_sliding_window

QK_NORM_NAMES = {"self_attn.q_norm": "attention.q_norm", "self_attn.k_norm": "attention.k_norm"}
QWEN3_NAMES = TensorNames(layer={**LLAMA_NAMES.layer, **QK_NORM_NAMES}, top=LLAMA_NAMES.top)


def _from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    without_attention_bias("qwen3", config)
    return common_from_hf(config)


def _to_hf(config: ModelConfig) -> dict[str, Any]:
    return {
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": config.n_layers,
    }


QWEN3 = Family(
    name="qwen3",
    hf_model_types=("qwen3",),
    hf_architecture="Qwen3ForCausalLM",
    names=QWEN3_NAMES,
    from_hf=_from_hf,
    to_hf=_to_hf,
    fixed={"qk_norm": "head"},
    sliding_window=qwen_sliding_window,
)
