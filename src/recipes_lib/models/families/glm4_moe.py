"""The GLM-4.5 family (``model_type`` ``glm4_moe``, ``Glm4MoeForCausalLM``: GLM-4.5,
GLM-4.5-Air, GLM-4.6).

The Llama layout (RMSNorm before each sublayer, grouped-query attention, untied
embeddings, SwiGLU) with, each a model option it reads:

- ``attention_bias``: biases on the query, key and value projections, none on the
  output (``model.qkv_bias``);
- ``use_qk_norm``: an RMSNorm on each head's queries and keys (``model.qk_norm=head``);
- partial rotation: RoPE turns the first ``partial_rotary_factor`` of each head's dims
  (``model.partial_rotary_factor``; 0.5 when the file names none, as transformers reads it);
- DeepSeek-V3's mixture, as that family reads it
  (:func:`~recipes_lib.models.families.experts.deepseek_moe_from_hf`): the first
  ``first_k_dense_replace`` layers dense, the sigmoid router with its
  ``e_score_correction_bias``, group limit and ``routed_scaling_factor``, shared experts.

Tensor names are Qwen3-MoE's (with ``self_attn.q_norm``/``k_norm``) plus DeepSeek-V3's
router bias and shared experts (:func:`~recipes_lib.models.families.experts.with_deepseek_experts`).
The published folders' multi-token-prediction layer is skipped with one logged line. A
quantized folder is read as :mod:`recipes_lib.checkpoint.dequantize` reads any family's
(fp8 blocks dequantized at load; another method refused in one line).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from recipes_lib.config.schema import ModelConfig
from recipes_lib.models.families.base import (
    Family,
    common_from_hf,
    refuse,
    rope_to_hf,
    skip_prediction_layers,
)
from recipes_lib.models.families.experts import (
    DEEPSEEK_MOE_READS,
    check_deepseek_moe,
    deepseek_moe_from_hf,
    deepseek_moe_hf_fields,
    with_deepseek_experts,
)
from recipes_lib.models.families.qwen3 import QWEN3_NAMES

PARTIAL_ROTARY = 0.5  # Glm4MoeConfig's default


# transformers' own defaults for the mixture's keys a config.json leaves out
MOE_DEFAULTS = {
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 1.0,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
}


def _from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    skip_prediction_layers("glm4_moe", config)
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    partial = params.pop("partial_rotary_factor", None)
    if partial is None:
        partial = config.get("partial_rotary_factor", PARTIAL_ROTARY)
    # the rest is read as every family's (which refuses a partial rotation of its own)
    rest = {k: v for k, v in config.items() if k != "partial_rotary_factor"}
    if config.get("rope_parameters"):
        rest["rope_parameters"] = params
    elif config.get("rope_scaling"):
        rest["rope_scaling"] = params
    return {
        **common_from_hf(rest),
        "qkv_bias": bool(config.get("attention_bias", False)),
        "qk_norm": "head" if config.get("use_qk_norm") else "none",
        "partial_rotary_factor": float(partial),
        **deepseek_moe_from_hf(config, MOE_DEFAULTS),
    }


def _to_hf(config: ModelConfig) -> dict[str, Any]:
    scaling = rope_to_hf(config.rope_scaling) or {"rope_type": "default"}
    rope = {k: v for k, v in scaling.items() if k != "type"}  # transformers 4's spelling
    return {
        "attention_bias": config.qkv_bias,
        "use_qk_norm": config.qk_norm == "head",
        "rope_parameters": {
            **rope,
            "rope_theta": config.rope_theta,
            "partial_rotary_factor": config.partial_rotary_factor,
        },
        # also at the top: Glm4MoeConfig puts its default of 0.5 there otherwise, which
        # wins over the one inside rope_parameters
        "partial_rotary_factor": config.partial_rotary_factor,
        "pad_token_id": None,  # a padding row of the embeddings would take no gradient
        **deepseek_moe_hf_fields(config),
    }


def _check(config: ModelConfig) -> None:
    if config.qk_norm not in ("none", "head"):
        why = "GLM-4.5 normalises each head's queries and keys (use_qk_norm) or none"
        raise refuse("glm4_moe", "qk_norm", config.qk_norm, why)
    if config.rope_scaling.type == "longrope":
        why = "GLM-4.5's folders are read and written without longrope"
        raise refuse("glm4_moe", "rope_scaling.type", "longrope", why)
    check_deepseek_moe("glm4_moe", config)


GLM4_MOE = Family(
    name="glm4_moe",
    hf_model_types=("glm4_moe",),
    hf_architecture="Glm4MoeForCausalLM",
    names=with_deepseek_experts(QWEN3_NAMES),
    from_hf=_from_hf,
    to_hf=_to_hf,
    fixed={"moe_router": "sigmoid"},
    reads=("qkv_bias", "qk_norm", "partial_rotary_factor", *DEEPSEEK_MOE_READS),
    check=_check,
    extended_rope=True,  # partial rotation (longrope is refused by its check)
    hf_score_class="",  # transformers has no Glm4MoeForSequenceClassification
)
