"""The Phi-3 family (Phi-3, Phi-3.5 and Phi-4-mini text models, ``Phi3ForCausalLM``): the
Llama block with fused projections, partial rotation and LongRoPE.

Its checkpoints store q, k and v as one ``self_attn.qkv_proj`` (q's rows, then k's,
then v's) and the MLP's gate and up projections as one ``mlp.gate_up_proj`` (gate's
rows, then up's); they are split into the native tensors on import and stacked again on
export (:attr:`TensorNames.fused`). ``partial_rotary_factor`` (Phi-4-mini: 0.75) is
``model.partial_rotary_factor``; ``rope_scaling`` of type ``longrope`` (``su`` in old
configs) is ``model.rope_scaling.type=longrope`` with its per-frequency
``short_factor``/``long_factor``, ``original_max_position_embeddings`` (the top-level
key first, as transformers reads it; its default 4096) and the attention factor (given,
or ``sqrt(1 + ln(factor) / ln(original))`` with ``factor`` given or
``max_position_embeddings / original``). No biases (``attention_bias``, ``mlp_bias``
refused), ``head_dim`` is ``hidden_size / num_attention_heads``. A ``sliding_window``
applies to every layer; the model is then built with full attention over at most the
window (see ``model_config_from_hf``).

    model.layers.N.self_attn.qkv_proj <-> layers.N.attention.wq, wk, wv (stacked)
    model.layers.N.mlp.gate_up_proj   <-> layers.N.feed_forward.w1, w3 (stacked)
    (the rest as Llama's: o_proj, down_proj, the norms, embed_tokens, lm_head)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from recipes_lib.config.schema import ModelConfig, RopeScalingConfig
from recipes_lib.errors import CheckpointError
from recipes_lib.models.families.base import (
    Family,
    TensorNames,
    common_from_hf,
    refuse,
    required,
    without_attention_bias,
)
from recipes_lib.models.families.llama import LLAMA_NAMES

_FUSED = {
    "self_attn.qkv_proj": ("attention.wq", "attention.wk", "attention.wv"),
    "mlp.gate_up_proj": ("feed_forward.w1", "feed_forward.w3"),
}
_STACKED = {native for natives in _FUSED.values() for native in natives}
PHI3_NAMES = TensorNames(
    layer={hf: native for hf, native in LLAMA_NAMES.layer.items() if native not in _STACKED},
    top=LLAMA_NAMES.top,
    fused=_FUSED,
)
ORIGINAL_MAX_POSITIONS = 4096  # Phi3Config's default original_max_position_embeddings
_ROPE_KEYS = ("rope_parameters", "rope_scaling", "partial_rotary_factor")


def _rope(config: Mapping[str, Any]) -> tuple[float, RopeScalingConfig]:
    """``partial_rotary_factor`` and RoPE scaling of a Phi-3 ``config.json``."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    factor = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return factor, RopeScalingConfig()
    if rope_type not in ("longrope", "su"):
        raise CheckpointError(
            f"phi3: rope_scaling type {rope_type!r} is not supported; supported: default, longrope"
        )
    original = config.get("original_max_position_embeddings", ORIGINAL_MAX_POSITIONS)
    if original is None:
        raise CheckpointError("the Hugging Face config has no 'original_max_position_embeddings'")
    original = int(original)
    ratio = params.get("factor")
    if ratio is None:
        ratio = int(required(config, "max_position_embeddings")) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if ratio <= 1 else math.sqrt(1 + math.log(ratio) / math.log(original))
    return factor, RopeScalingConfig(
        type="longrope",
        factor=float(ratio),
        original_max_seq_len=original,
        short_factor=[float(v) for v in required(params, "short_factor")],
        long_factor=[float(v) for v in required(params, "long_factor")],
        attention_factor=float(attention),
    )


def _from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    without_attention_bias("phi3", config)
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    plain = {k: v for k, v in config.items() if k not in _ROPE_KEYS}  # RoPE read here
    partial, scaling = _rope(config)
    fields = {**common_from_hf({**plain, "rope_theta": theta}), "rope_scaling": scaling}
    if fields["head_dim"] is not None:
        raise CheckpointError(
            f"phi3: head_dim={config.get('head_dim')} is not hidden_size / "
            "num_attention_heads, which transformers' Phi-3 assumes"
        )
    return {**fields, "partial_rotary_factor": partial}


def _to_hf(config: ModelConfig) -> dict[str, Any]:
    scaling = config.rope_scaling
    rope: dict[str, Any] = {
        "rope_type": "default",
        "rope_theta": config.rope_theta,
        "partial_rotary_factor": config.partial_rotary_factor,
    }
    original = {}
    if scaling.type == "longrope":
        original = {"original_max_position_embeddings": scaling.original_max_seq_len}
        rope.update(
            rope_type="longrope",
            type="longrope",
            short_factor=list(scaling.short_factor),
            long_factor=list(scaling.long_factor),
            factor=scaling.factor,
            attention_factor=scaling.attention_factor,
            **original,
        )
    return {
        "rope_scaling": rope,
        "partial_rotary_factor": config.partial_rotary_factor,
        **original,
        "sliding_window": None,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        # Phi3Config defaults to pad_token_id=32000, an embedding row without gradient
        # (and past a small vocabulary); this model has no padding row
        "pad_token_id": None,
    }


def _check(config: ModelConfig) -> None:
    if config.head_dim is not None and config.head_dim * config.n_heads != config.dim:
        why = "transformers' Phi-3 takes the head dimension as model.dim / model.n_heads"
        raise refuse("phi3", "head_dim", config.head_dim, why)
    if config.rope_scaling.type not in ("none", "longrope"):
        why = "Phi-3's RoPE is plain or longrope"
        raise refuse("phi3", "rope_scaling.type", config.rope_scaling.type, why)


def _sliding_window(config: Mapping[str, Any]) -> int | None:
    window = config.get("sliding_window")
    return None if window is None else int(window)


PHI3 = Family(
    name="phi3",
    hf_model_types=("phi3",),
    hf_architecture="Phi3ForCausalLM",
    names=PHI3_NAMES,
    from_hf=_from_hf,
    to_hf=_to_hf,
    reads=("partial_rotary_factor",),
    check=_check,
    sliding_window=_sliding_window,
    extended_rope=True,
)
