"""The Qwen3-MoE family: Qwen3's attention (an RMSNorm on each head's queries and keys,
``head_dim`` its own setting) with routed experts in place of the MLP
(:mod:`recipes_lib.models.moe`): a softmax router over ``num_experts``, the top
``num_experts_per_tok`` taken and, with ``norm_topk_prob``, renormalised; the layers in
``mlp_only_layers`` (or off the ``decoder_sparse_step``) keep a dense MLP of
``intermediate_size``; each expert's width is ``moe_intermediate_size``.

Qwen3's tensor names plus, in a layer with experts:

    model.layers.N.mlp.gate                    <-> layers.N.feed_forward.router
    model.layers.N.mlp.experts.E.gate_proj     <-> layers.N.feed_forward.experts.w1[E]
    model.layers.N.mlp.experts.E.up_proj       <-> layers.N.feed_forward.experts.w3[E]
    model.layers.N.mlp.experts.E.down_proj     <-> layers.N.feed_forward.experts.w2[E]

It is also the family of a mixture of experts trained from scratch here, so it may have
what its transformers class has not (a sigmoid router with balancing bias, shared
experts): such a model trains, and its Hugging Face export is refused naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from recipes_lib.config.schema import ModelConfig
from recipes_lib.models.families.base import (
    Family,
    common_from_hf,
    required,
    without_attention_bias,
)
from recipes_lib.models.families.experts import (
    MOE_READS,
    moe_from_hf,
    moe_hf_fields,
    with_experts,
)
from recipes_lib.models.families.qwen2 import qwen_sliding_window
from recipes_lib.models.families.qwen3 import QWEN3_NAMES

QWEN3_MOE_NAMES = with_experts(
    QWEN3_NAMES, "mlp", "gate_proj", "up_proj", "down_proj", dense_layers=True
)


def _from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    without_attention_bias("qwen3_moe", config)
    n_layers = int(required(config, "num_hidden_layers"))
    step = int(config.get("decoder_sparse_step") or 1)
    only = set(config.get("mlp_only_layers") or [])
    dense = [i for i in range(n_layers) if i in only or (i + 1) % step != 0]
    return {
        **common_from_hf(config),
        **moe_from_hf(config, "num_experts", config.get("norm_topk_prob", False)),
        "moe_dense_layers": dense,
    }


def _to_hf(config: ModelConfig) -> dict[str, Any]:
    return {
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": config.n_layers,
        **moe_hf_fields(config, "qwen3_moe", "num_experts"),
        "moe_intermediate_size": config.moe_ffn_dim or config.ffn_dim,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(config.moe_dense_layers),
    }


QWEN3_MOE = Family(
    name="qwen3_moe",
    hf_model_types=("qwen3_moe",),
    hf_architecture="Qwen3MoeForCausalLM",
    names=QWEN3_MOE_NAMES,
    from_hf=_from_hf,
    to_hf=_to_hf,
    fixed={"qk_norm": "head"},
    reads=(*MOE_READS, "moe_dense_layers", "moe_shared_experts", "moe_router"),
    sliding_window=qwen_sliding_window,
)
