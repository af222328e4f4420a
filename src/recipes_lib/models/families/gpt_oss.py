"""The gpt-oss family (``model_type`` ``gpt_oss``, ``GptOssForCausalLM``).

The Llama layout (RMSNorm before each sublayer, rotate-half RoPE, grouped-query
attention, untied embeddings) with, each a model option it fixes or reads:

- biases on the query, key, value and output projections (``attention_bias``:
  ``model.qkv_bias`` and ``model.attention_out_bias``);
- a learned sink logit per query head in every softmax's denominator
  (``model.attention_sinks``; ``kernels.attention`` sdpa or flex);
- local and global layers: the ``sliding_attention`` entries of ``layer_types`` (or,
  without the list, every other layer from the first) attend to the last
  ``sliding_window`` keys (``model.window_layers``, ``model.sliding_window``);
- YaRN RoPE (``model.rope_scaling``), the same in every layer;
- routed experts in every layer: a router with a bias, the top ``num_experts_per_tok``
  of its logits taken and softmaxed among themselves (the library's softmax router
  with ``model.moe_renormalize``: the same weights), each expert with biases
  (``model.moe_bias``) and the clamped SwiGLU (``model.activation=clamped_swiglu``,
  ``swiglu_alpha`` and ``swiglu_limit``).

Tensor names beside Llama's attention and norms, in layer ``N``:

    model.layers.N.self_attn.sinks               <-> layers.N.attention.sinks
    model.layers.N.mlp.router                    <-> layers.N.feed_forward.router
    model.layers.N.mlp.experts.gate_up_proj      <-> feed_forward.experts.w1/w3.weight
    model.layers.N.mlp.experts.gate_up_proj_bias <-> feed_forward.experts.w1/w3.bias
    model.layers.N.mlp.experts.down_proj         <-> feed_forward.experts.w2.weight
    model.layers.N.mlp.experts.down_proj_bias    <-> feed_forward.experts.w2.bias

Hugging Face stores the experts as ``x @ W``: ``gate_up_proj`` is ``(E, C, 2F)`` with
the gate in the even columns and the up projection in the odd ones, ``down_proj``
``(E, F, C)``; the native experts are ``(E, F, C)`` and ``(E, C, F)`` (``W x``), so they
are transposed and de-interleaved on import and put back on export, exactly.

The published folders keep their experts in MXFP4 (``quantization_config``): they are
unpacked at load into the model's dtype (:mod:`recipes_lib.checkpoint.dequantize`), the
blocks and scales of ``gate_up_proj`` and ``down_proj`` read as those tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from recipes_lib.config.schema import ModelConfig
from recipes_lib.models.families.base import (
    Family,
    Rearranged,
    TensorNames,
    common_from_hf,
    refuse,
    required,
    rope_to_hf,
    sliding_layers,
)
from recipes_lib.models.families.experts import moe_from_hf, moe_hf_fields, needs_experts
from recipes_lib.models.families.llama import LLAMA_NAMES

PATTERN = 2  # GptOssConfig's default layer_types: sliding, full, sliding, ...


def _interleaved(parts: list[Tensor]) -> Tensor:
    """Gate and up ``(..., F)`` each -> ``(..., 2F)``, gate in the even places."""
    return torch.stack(parts, dim=-1).flatten(-2)


def _transposed(t: Tensor) -> Tensor:
    return t.transpose(-2, -1)


GPT_OSS_NAMES = TensorNames(
    layer={
        **{hf: native for hf, native in LLAMA_NAMES.layer.items() if not hf.startswith("mlp.")},
        "self_attn.sinks": "attention.sinks",
        "mlp.router": "feed_forward.router",
    },
    top=LLAMA_NAMES.top,
    rearranged={
        "mlp.experts.gate_up_proj": Rearranged(
            parts=("feed_forward.experts.w1.weight", "feed_forward.experts.w3.weight"),
            split=lambda t: [_transposed(t[..., 0::2]), _transposed(t[..., 1::2])],
            join=lambda parts: _interleaved([_transposed(p) for p in parts]),
        ),
        "mlp.experts.gate_up_proj_bias": Rearranged(
            parts=("feed_forward.experts.w1.bias", "feed_forward.experts.w3.bias"),
            split=lambda t: [t[..., 0::2], t[..., 1::2]],
            join=_interleaved,
        ),
        "mlp.experts.down_proj": Rearranged(
            parts=("feed_forward.experts.w2.weight",),
            split=lambda t: [_transposed(t)],
            join=lambda parts: _transposed(parts[0]),
        ),
        "mlp.experts.down_proj_bias": Rearranged(
            parts=("feed_forward.experts.w2.bias",),
            split=lambda t: [t],
            join=lambda parts: parts[0],
        ),
    },
)


def _from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    window = config.get("sliding_window")
    local = [] if window is None else sliding_layers("gpt_oss", config, PATTERN)
    bias = bool(config.get("attention_bias", True))  # GptOssConfig's default
    fields = common_from_hf(config)
    return {
        **fields,
        **moe_from_hf(config, "num_local_experts", True),
        "qkv_bias": bias,
        "attention_out_bias": bias,
        "swiglu_alpha": float(config.get("swiglu_alpha", 1.702)),
        "swiglu_limit": float(required(config, "swiglu_limit")),
        "sliding_window": None if window is None or not local else int(window),
        "window_layers": local,
    }


def _to_hf(config: ModelConfig) -> dict[str, Any]:
    local = set(config.window_layers)
    scaling = rope_to_hf(config.rope_scaling) or {"rope_type": "default"}
    rope = {k: v for k, v in scaling.items() if k != "type"}  # transformers 4's spelling
    moe = moe_hf_fields(config, "gpt_oss", "num_local_experts")
    del moe["norm_topk_prob"]  # GptOssConfig has none: it always softmaxes the top k
    return {
        "attention_bias": config.qkv_bias,
        **moe,
        "swiglu_alpha": config.swiglu_alpha,
        "swiglu_limit": config.swiglu_limit,
        # transformers builds the window mask whether a layer uses it or not
        "sliding_window": config.sliding_window or config.max_seq_len,
        "layer_types": [
            "sliding_attention" if layer in local else "full_attention"
            for layer in range(config.n_layers)
        ],
        # spelled out: without it GptOssConfig would take its published YaRN
        "rope_parameters": {**rope, "rope_theta": config.rope_theta},
    }


def _check(config: ModelConfig) -> None:
    needs_experts("gpt_oss")(config)
    if config.attention_out_bias != config.qkv_bias:
        why = "gpt-oss has biases on q, k, v and o together or on none (attention_bias)"
        raise refuse("gpt_oss", "attention_out_bias", config.attention_out_bias, why)


GPT_OSS = Family(
    name="gpt_oss",
    hf_model_types=("gpt_oss",),
    hf_architecture="GptOssForCausalLM",
    names=GPT_OSS_NAMES,
    from_hf=_from_hf,
    to_hf=_to_hf,
    fixed={"attention_sinks": True, "activation": "clamped_swiglu", "moe_bias": True},
    reads=(
        "qkv_bias",
        "attention_out_bias",
        "swiglu_alpha",
        "swiglu_limit",
        "sliding_window",
        "window_layers",
        "moe_experts",
        "moe_top_k",
        "moe_ffn_dim",
    ),
    check=_check,
)
