"""The OLMo 2 family: post-norm blocks and a norm on the whole query and key projections.

Each block normalises its sublayers' outputs before the residual add
(``model.norm_placement=post``: ``x + norm(attn(x))``, then ``x + norm(mlp(x))``; no
norm on their inputs), and the queries and keys are normalised over every head at once
(``model.qk_norm=full``: gains of ``n_heads * head_dim`` and ``n_kv_heads * head_dim``)
after the projections and before RoPE. Otherwise the Llama layout: SwiGLU, rotate-half
RoPE, no biases, a final norm, untied embeddings at the published sizes.

    model.embed_tokens                       <-> tok_embeddings
    model.layers.N.self_attn.q_proj          <-> layers.N.attention.wq  (k, v, o alike)
    model.layers.N.self_attn.q_norm          <-> layers.N.attention.q_norm  (k_norm alike)
    model.layers.N.mlp.gate_proj / up_proj / down_proj <-> layers.N.feed_forward.w1 / w3 / w2
    model.layers.N.post_attention_layernorm  <-> layers.N.attention_norm  (after attention)
    model.layers.N.post_feedforward_layernorm <-> layers.N.ffn_norm       (after the MLP)
    model.norm                               <-> norm
    lm_head                                  <-> output
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

_PRE_NORMS = ("input_layernorm", "post_attention_layernorm")
OLMO2_NAMES = TensorNames(
    layer={
        **{hf: native for hf, native in LLAMA_NAMES.layer.items() if hf not in _PRE_NORMS},
        "self_attn.q_norm": "attention.q_norm",
        "self_attn.k_norm": "attention.k_norm",
        "post_attention_layernorm": "attention_norm",
        "post_feedforward_layernorm": "ffn_norm",
    },
    top=LLAMA_NAMES.top,
)


def _from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    without_attention_bias("olmo2", config)
    return common_from_hf(config)


def _to_hf(config: ModelConfig) -> dict[str, Any]:
    # transformers' Olmo2Config defaults to pad_token_id=1, which would make row 1 of its
    # embedding a padding row (no gradient); this model has none
    return {"attention_bias": False, "pad_token_id": None}


OLMO2 = Family(
    name="olmo2",
    hf_model_types=("olmo2",),
    hf_architecture="Olmo2ForCausalLM",
    names=OLMO2_NAMES,
    from_hf=_from_hf,
    to_hf=_to_hf,
    fixed={"qk_norm": "full", "norm_placement": "post"},
)
