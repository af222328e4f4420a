"""The Mixtral family: Mistral's blocks (the Llama layout) with routed experts in every
layer (:mod:`recipes_lib.models.moe`): a softmax router over ``num_local_experts``, the
top ``num_experts_per_tok`` taken and always renormalised; each expert's width is
``intermediate_size``.

Llama's attention and norm names plus (``mlp`` as transformers 5 names the block
internally; the published checkpoints say ``block_sparse_moe``, read and written here):

    model.layers.N.block_sparse_moe.gate          <-> layers.N.feed_forward.router
    model.layers.N.block_sparse_moe.experts.E.w1  <-> layers.N.feed_forward.experts.w1[E]
    model.layers.N.block_sparse_moe.experts.E.w3  <-> layers.N.feed_forward.experts.w3[E]
    model.layers.N.block_sparse_moe.experts.E.w2  <-> layers.N.feed_forward.experts.w2[E]

A ``sliding_window`` is read as Mistral's: full attention within the window.
``router_jitter_noise`` (noise on the router's input in training) is not applied.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from recipes_lib.config.schema import ModelConfig
from recipes_lib.models.families.base import (
    Family,
    common_from_hf,
    without_attention_bias,
)
from recipes_lib.models.families.experts import (
    moe_from_hf,
    moe_hf_fields,
    needs_experts,
    with_experts,
)
from recipes_lib.models.families.llama import LLAMA_NAMES

MIXTRAL_NAMES = with_experts(LLAMA_NAMES, "block_sparse_moe", "w1", "w3", "w2")


def _from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    without_attention_bias("mixtral", config)
    return {**common_from_hf(config), **moe_from_hf(config, "num_local_experts", True)}


def _to_hf(config: ModelConfig) -> dict[str, Any]:
    fields = moe_hf_fields(config, "mixtral", "num_local_experts")
    del fields["norm_topk_prob"]  # always renormalised
    return {
        **fields,
        "intermediate_size": config.moe_ffn_dim or config.ffn_dim,
        "sliding_window": None,
        "router_jitter_noise": 0.0,
    }


def _sliding_window(config: Mapping[str, Any]) -> int | None:
    window = config.get("sliding_window")
    return None if window is None else int(window)


MIXTRAL = Family(
    name="mixtral",
    hf_model_types=("mixtral",),
    hf_architecture="MixtralForCausalLM",
    names=MIXTRAL_NAMES,
    from_hf=_from_hf,
    to_hf=_to_hf,
    reads=("moe_experts", "moe_top_k", "moe_ffn_dim"),
    check=needs_experts("mixtral"),
    sliding_window=_sliding_window,
)
