"""The DeepSeek-V3 family (``model_type`` ``deepseek_v3``, ``DeepseekV3ForCausalLM``;
Kimi K2's folders, ``model_type`` ``kimi_k2``, are read as the same model).

The Llama layout (RMSNorm before each sublayer, untied embeddings, SwiGLU) with, each a
model option it fixes or reads:

- multi-head latent attention (:mod:`recipes_lib.models.latent_attention`): the keys
  and values from a latent of ``kv_lora_rank`` (``model.mla_kv_rank``) plus a rotated
  key of ``qk_rope_head_dim`` (``model.mla_rope_dim``) shared by the heads; the queries
  from a latent of ``q_lora_rank`` (``model.mla_q_rank``; null: one projection); a
  query/key head of ``qk_nope_head_dim + qk_rope_head_dim`` (``model.head_dim``) and a
  value head of ``v_head_dim``; RoPE on adjacent pairs with ``rope_interleave``
  (``model.rope_interleave``); YaRN's ``mscale_all_dim`` in the softmax scale;
- ``attention_bias``: biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``
  (``model.qkv_bias`` and ``model.attention_out_bias`` together);
- DeepSeek-V3's mixture (:func:`~recipes_lib.models.families.experts.deepseek_moe_from_hf`):
  the first ``first_k_dense_replace`` layers dense (``intermediate_size``), the others
  ``n_routed_experts`` experts of ``moe_intermediate_size`` and ``n_shared_experts``
  shared ones; the sigmoid router whose ``e_score_correction_bias`` only chooses
  (``model.moe_router=sigmoid``; its bias moves in training with
  ``model.moe_bias_update_rate``), limited to the ``topk_group`` best of ``n_group``
  groups, the chosen weights renormalised (``norm_topk_prob``) and scaled by
  ``routed_scaling_factor``.

Tensor names beside Llama's norms and dense MLP, in layer ``N``:

    model.layers.N.self_attn.q_proj              <-> layers.N.attention.wq
    model.layers.N.self_attn.q_a_proj            <-> layers.N.attention.wq_a
    model.layers.N.self_attn.q_a_layernorm       <-> layers.N.attention.q_norm
    model.layers.N.self_attn.q_b_proj            <-> layers.N.attention.wq_b
    model.layers.N.self_attn.kv_a_proj_with_mqa  <-> layers.N.attention.wkv_a
    model.layers.N.self_attn.kv_a_layernorm      <-> layers.N.attention.kv_norm
    model.layers.N.self_attn.kv_b_proj           <-> layers.N.attention.wkv_b
    model.layers.N.self_attn.o_proj              <-> layers.N.attention.wo
    model.layers.N.mlp.gate                      <-> layers.N.feed_forward.router
    model.layers.N.mlp.gate.e_score_correction_bias <-> layers.N.feed_forward.expert_bias
    model.layers.N.mlp.experts.E.gate_proj       <-> layers.N.feed_forward.experts.w1[E]
    model.layers.N.mlp.shared_experts.gate_proj  <-> layers.N.feed_forward.shared.w1
    (up_proj: w3, down_proj: w2 alike)

The published folders keep their weights in FP8 blocks (``quantization_config``): each
is multiplied by its block's ``weight_scale_inv`` at load, into the model's dtype
(:mod:`recipes_lib.checkpoint.dequantize`). Their multi-token-prediction layer
(``num_nextn_predict_layers``, stored as layer ``num_hidden_layers``) is skipped with
one logged line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from recipes_lib.config.model import head_width
from recipes_lib.config.schema import ModelConfig
from recipes_lib.errors import CheckpointError
from recipes_lib.models.families.base import (
    Family,
    TensorNames,
    common_from_hf,
    refuse,
    required,
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
from recipes_lib.models.families.llama import LLAMA_NAMES

_LATENT_NAMES = {
    "self_attn.q_proj": "attention.wq",
    "self_attn.q_a_proj": "attention.wq_a",
    "self_attn.q_a_layernorm": "attention.q_norm",
    "self_attn.q_b_proj": "attention.wq_b",
    "self_attn.kv_a_proj_with_mqa": "attention.wkv_a",
    "self_attn.kv_a_layernorm": "attention.kv_norm",
    "self_attn.kv_b_proj": "attention.wkv_b",
    "self_attn.o_proj": "attention.wo",
}
_LLAMA_REST = {hf: n for hf, n in LLAMA_NAMES.layer.items() if not hf.startswith("self_attn.")}
DEEPSEEK_V3_NAMES = with_deepseek_experts(
    TensorNames(layer={**_LATENT_NAMES, **_LLAMA_REST}, top=LLAMA_NAMES.top)
)


# transformers' own defaults for the mixture's keys a config.json leaves out
MOE_DEFAULTS = {
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "n_shared_experts": 1,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
}


def _from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    skip_prediction_layers("deepseek_v3", config)
    rope_dim = int(required(config, "qk_rope_head_dim"))
    nope_dim = int(required(config, "qk_nope_head_dim"))
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "yarn") and params.get("mscale_all_dim"):
        raise CheckpointError(
            f"deepseek_v3: rope type {rope_type!r} with mscale_all_dim is not supported (YaRN's is)"
        )
    # its config.json's head_dim is the rotated width; the query/key head is wider
    fields = common_from_hf({k: v for k, v in config.items() if k != "head_dim"})
    bias = bool(config.get("attention_bias", False))
    q_rank = config.get("q_lora_rank")
    return {
        **fields,
        "head_dim": nope_dim + rope_dim,
        "mla_kv_rank": int(required(config, "kv_lora_rank")),
        "mla_q_rank": None if q_rank is None else int(q_rank),
        "mla_rope_dim": rope_dim,
        "v_head_dim": int(required(config, "v_head_dim")),
        "rope_interleave": bool(config.get("rope_interleave", True)),
        "qkv_bias": bias,
        "attention_out_bias": bias,
        **deepseek_moe_from_hf(config, MOE_DEFAULTS),
    }


def _to_hf(config: ModelConfig) -> dict[str, Any]:
    head_dim = head_width(config)
    scaling = rope_to_hf(config.rope_scaling) or {"rope_type": "default"}
    rope = {k: v for k, v in scaling.items() if k != "type"}  # transformers 4's spelling
    return {
        "head_dim": config.mla_rope_dim,  # as DeepseekV3Config sets it
        "q_lora_rank": config.mla_q_rank,
        "kv_lora_rank": config.mla_kv_rank,
        "qk_rope_head_dim": config.mla_rope_dim,
        "qk_nope_head_dim": head_dim - config.mla_rope_dim,
        "v_head_dim": config.v_head_dim or head_dim,
        "rope_interleave": config.rope_interleave,
        "attention_bias": config.qkv_bias,
        "rope_parameters": {**rope, "rope_theta": config.rope_theta},
        "pad_token_id": None,  # a padding row of the embeddings would take no gradient
        **deepseek_moe_hf_fields(config),
    }


def _check(config: ModelConfig) -> None:
    if config.mla_kv_rank is None:
        why = "DeepSeek-V3 attends through a latent (kv_lora_rank)"
        raise refuse("deepseek_v3", "mla_kv_rank", None, why)
    if config.attention_out_bias != config.qkv_bias:
        why = "deepseek_v3 has biases on q_a, kv_a and o together or on none (attention_bias)"
        raise refuse("deepseek_v3", "attention_out_bias", config.attention_out_bias, why)
    check_deepseek_moe("deepseek_v3", config)


DEEPSEEK_V3 = Family(
    name="deepseek_v3",
    hf_model_types=("deepseek_v3", "kimi_k2"),
    hf_architecture="DeepseekV3ForCausalLM",
    names=DEEPSEEK_V3_NAMES,
    from_hf=_from_hf,
    to_hf=_to_hf,
    fixed={"moe_router": "sigmoid"},
    reads=(
        "mla_kv_rank",
        "mla_q_rank",
        "mla_rope_dim",
        "v_head_dim",
        "rope_interleave",
        "qkv_bias",
        "attention_out_bias",
        *DEEPSEEK_MOE_READS,
    ),
    check=_check,
)
