"""The Llama family: Llama 2/3 (and Mistral, SmolLM and other checkpoints of its layout).

RMSNorm before attention and before the SwiGLU MLP, rotate-half RoPE (theta and
``linear`` / ``llama3`` scaling), grouped-query attention, no biases, optionally tied
embeddings. Parameter names follow Meta's Llama code, so the Hugging Face adapter is a
rename table with no permutation (transformers uses the same rotate-half RoPE):

    model.embed_tokens              <-> tok_embeddings
    model.layers.N.self_attn.q_proj <-> layers.N.attention.wq   (k_proj, v_proj, o_proj alike)
    model.layers.N.mlp.gate_proj    <-> layers.N.feed_forward.w1
    model.layers.N.mlp.up_proj      <-> layers.N.feed_forward.w3
    model.layers.N.mlp.down_proj    <-> layers.N.feed_forward.w2
    model.layers.N.input_layernorm  <-> layers.N.attention_norm
    model.layers.N.post_attention_layernorm <-> layers.N.ffn_norm
    model.norm                      <-> norm
    lm_head                         <-> output   (absent when the embeddings are tied)
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
)

LLAMA_NAMES = TensorNames(
    layer={
        "self_attn.q_proj": "attention.wq",
        "self_attn.k_proj": "attention.wk",
        "self_attn.v_proj": "attention.wv",
        "self_attn.o_proj": "attention.wo",
        "mlp.gate_proj": "feed_forward.w1",
        "mlp.up_proj": "feed_forward.w3",
        "mlp.down_proj": "feed_forward.w2",
        "input_layernorm": "attention_norm",
        "post_attention_layernorm": "ffn_norm",
    },
    top={
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "output.weight",
    },
)


def _from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    if config.get("model_type") == "llama" and config.get("attention_bias"):
        raise CheckpointError(
            "llama: attention_bias=true also adds a bias to o_proj, which is not supported "
            "(q/k/v biases alone are: model_type qwen2)"
        )
    return common_from_hf(config)


def _to_hf(config: ModelConfig) -> dict[str, Any]:
    return {"attention_bias": False, "mlp_bias": False}


def _sliding_window(config: Mapping[str, Any]) -> int | None:
    if config.get("model_type") == "llama" or config.get("sliding_window") is None:
        return None
    return int(config["sliding_window"])  # Mistral v0.1


LLAMA = Family(
    name="llama",
    hf_model_types=("llama", "mistral"),
    hf_architecture="LlamaForCausalLM",
    names=LLAMA_NAMES,
    from_hf=_from_hf,
    to_hf=_to_hf,
    sliding_window=_sliding_window,
)
