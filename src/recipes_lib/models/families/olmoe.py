"""The OLMoE family: pre-norm blocks (as Llama) with OLMo 2's norm on the whole query
and key projections (``model.qk_norm=full``) and routed experts in every layer
(:mod:`recipes_lib.models.moe`): a softmax router over ``num_experts``, the top
``num_experts_per_tok`` taken, renormalised only with ``norm_topk_prob`` (false in the
published models); each expert's width is ``intermediate_size``.

Llama's tensor names plus:

    model.layers.N.self_attn.q_norm / k_norm   <-> layers.N.attention.q_norm / k_norm
    model.layers.N.mlp.gate                    <-> layers.N.feed_forward.router
    model.layers.N.mlp.experts.E.gate_proj     <-> layers.N.feed_forward.experts.w1[E]
    model.layers.N.mlp.experts.E.up_proj       <-> layers.N.feed_forward.experts.w3[E]
    model.layers.N.mlp.experts.E.down_proj     <-> layers.N.feed_forward.experts.w2[E]

``clip_qkv`` (clamping the projections) is refused: no published OLMoE sets it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from recipes_lib.config.schema import ModelConfig
from recipes_lib.errors import CheckpointError
from recipes_lib.models.families.base import (
    Family,
    TensorNames,
    common_from_hf,
    without_attention_bias,
)
from recipes_lib.models.families.experts import (
    MOE_READS,
    moe_from_hf,
    moe_hf_fields,
    needs_experts,
    with_experts,
)
from recipes_lib.models.families.llama import LLAMA_NAMES
from recipes_lib.models.families.qwen3 import QK_NORM_NAMES

OLMOE_NAMES = with_experts(
    TensorNames(layer={**LLAMA_NAMES.layer, **QK_NORM_NAMES}, top=LLAMA_NAMES.top),
    "mlp",
    "gate_proj",
    "up_proj",
    "down_proj",
)


def _from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    without_attention_bias("olmoe", config)
    if config.get("clip_qkv") is not None:
        raise CheckpointError(f"olmoe: clip_qkv={config['clip_qkv']!r} is not supported")
    return {
        **common_from_hf(config),
        **moe_from_hf(config, "num_experts", config.get("norm_topk_prob", False)),
    }


def _to_hf(config: ModelConfig) -> dict[str, Any]:
    return {
        "attention_bias": False,
        "clip_qkv": None,
        "pad_token_id": None,  # OlmoeConfig's default 1 would make a padding row
        **moe_hf_fields(config, "olmoe", "num_experts"),
        "intermediate_size": config.moe_ffn_dim or config.ffn_dim,
    }


OLMOE = Family(
    name="olmoe",
    hf_model_types=("olmoe",),
    hf_architecture="OlmoeForCausalLM",
    hf_score_class="",  # transformers has no OlmoeForSequenceClassification
    names=OLMOE_NAMES,
    from_hf=_from_hf,
    to_hf=_to_hf,
    fixed={"qk_norm": "full"},
    reads=MOE_READS,
    check=needs_experts("olmoe"),
)
