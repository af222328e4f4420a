"""The Gemma 3 family (text: ``model_type`` ``gemma3_text``, ``Gemma3ForCausalLM``).

What sets it apart from the Llama layout, each a model option it fixes or reads:

- local and global layers: the ``sliding_attention`` entries of ``layer_types`` (or,
  in older ``config.json`` files, five of every ``sliding_window_pattern`` = 6 layers)
  attend to the last ``sliding_window`` keys (``model.window_layers``,
  ``model.sliding_window``) and rotate with their own unscaled RoPE base
  (``rope_local_base_freq``, or ``rope_parameters.sliding_attention``:
  ``model.local_rope_theta``); the global layers use ``rope_theta`` with its scaling;
- the softmax scale ``query_pre_attn_scalar ** -0.5`` (``model.query_pre_attn_scalar``);
- four norms per block, on both sides of attention and the MLP
  (``model.norm_placement=both``), and an RMSNorm on each head's queries and keys
  (``qk_norm=head``), all computing ``x * (1 + w)`` in float32 from a stored ``w``
  (``model.norm_gain_offset=1``: the gains are the checkpoint's own tensors);
- embeddings multiplied by ``sqrt(hidden_size)`` (``model.scale_embeddings``), GeGLU
  with the tanh GELU (``hidden_activation=gelu_pytorch_tanh``: ``model.activation``),
  tied embeddings by default.

Tensor names (besides Llama's projections and embeddings):

    model.layers.N.input_layernorm            <-> layers.N.attention_norm
    model.layers.N.post_attention_layernorm   <-> layers.N.post_attention_norm
    model.layers.N.pre_feedforward_layernorm  <-> layers.N.ffn_norm
    model.layers.N.post_feedforward_layernorm <-> layers.N.post_ffn_norm
    model.layers.N.self_attn.q_norm / k_norm  <-> layers.N.attention.q_norm / k_norm

Logit soft-capping (Gemma 2's), bidirectional attention and attention biases are
refused: Gemma 3's published models have none of them.

The gains stay ``w`` (not ``1 + w``, which bfloat16 would round to steps of 2**-7), so
a model loaded in bfloat16 computes its norms as transformers does.

The official 4B, 12B and 27B folders are image-text (``model_type`` ``gemma3``,
``Gemma3ForConditionalGeneration``): their ``text_config`` is a ``gemma3_text`` model
whose tensors are ``language_model.model.*`` (``model.language_model.*`` as
transformers 5 names them in memory), beside ``vision_tower.*`` and
``multi_modal_projector.*`` (:data:`GEMMA3_IMAGE_TEXT`). The text model trains as this
family's; the vision tower and projector are copied through on export.
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
    rope_from_hf,
    sliding_layers,
    without_attention_bias,
)
from recipes_lib.models.families.image_text import ImageText
from recipes_lib.models.families.llama import LLAMA_NAMES

_NORMS = ("input_layernorm", "post_attention_layernorm")
GEMMA3_NAMES = TensorNames(
    layer={
        **{hf: native for hf, native in LLAMA_NAMES.layer.items() if hf not in _NORMS},
        "self_attn.q_norm": "attention.q_norm",
        "self_attn.k_norm": "attention.k_norm",
        "input_layernorm": "attention_norm",
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffn_norm",
    },
    top=LLAMA_NAMES.top,
)
PATTERN = 6  # transformers' default sliding_window_pattern: every sixth layer is global
LOCAL_THETA, GLOBAL_THETA = 10_000.0, 1_000_000.0  # Gemma3TextConfig's default bases
GELU_TANH = "gelu_pytorch_tanh"


def window_layers(config: Mapping[str, Any]) -> list[int]:
    """The local layers of a Gemma 3 ``config.json`` (see the module docstring): its
    ``layer_types``, else all but every ``sliding_window_pattern``-th layer.

    Raises:
        CheckpointError: ``layer_types`` that is not one entry per layer of the two kinds.
    """
    pattern = int(config.get("sliding_window_pattern") or PATTERN)
    return sliding_layers("gemma3", config, pattern)


def _ropes(config: Mapping[str, Any]) -> tuple[dict[str, Any], float]:
    """The global layers' RoPE (``rope_parameters`` form) and the local layers' base."""
    params = config.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full = dict(config.get("rope_scaling") or params)
        local = {"rope_theta": config.get("rope_local_base_freq", LOCAL_THETA)}
    full.setdefault("rope_theta", config.get("rope_theta", GLOBAL_THETA))
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise CheckpointError(
            f"gemma3: the local layers' rope type {local.get('rope_type')!r} is not supported "
            "(Gemma 3's local layers rotate unscaled)"
        )
    return full, float(local.get("rope_theta", LOCAL_THETA))


def _from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    without_attention_bias("gemma3", config)
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(key) is not None:
            raise CheckpointError(f"gemma3: {key}={config[key]} (soft-capping) is not supported")
    if config.get("use_bidirectional_attention"):
        raise CheckpointError("gemma3: use_bidirectional_attention=true is not supported")
    activation = config.get("hidden_activation") or config.get("hidden_act") or GELU_TANH
    if activation != GELU_TANH:
        raise CheckpointError(
            f"gemma3: hidden_activation={activation!r}; only {GELU_TANH} is supported"
        )
    full, local_theta = _ropes(config)
    # YaRN's original length defaults to the model's, as transformers reads it
    theta, scaling = rope_from_hf(
        {
            "rope_parameters": {"rope_type": "default", **full},
            "max_position_embeddings": config.get("max_position_embeddings"),
        }
    )
    skip = ("hidden_act", "rope_parameters", "rope_scaling", "rope_theta")
    fields = common_from_hf({k: v for k, v in config.items() if k not in skip})
    local = window_layers(config)
    return {
        **fields,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(config.get("tie_word_embeddings", True)),
        "query_pre_attn_scalar": float(config.get("query_pre_attn_scalar", 256)),
        "sliding_window": int(config.get("sliding_window") or 4096) if local else None,
        "window_layers": local,
        "local_rope_theta": local_theta if local else None,
    }


def _to_hf(config: ModelConfig) -> dict[str, Any]:
    local = set(config.window_layers)
    head_dim = head_width(config)
    return {
        "hidden_activation": GELU_TANH,
        "hidden_act": GELU_TANH,
        "attention_bias": False,
        "query_pre_attn_scalar": _number(config.query_pre_attn_scalar or head_dim),
        "sliding_window": config.sliding_window or config.max_seq_len,
        "layer_types": [
            "sliding_attention" if layer in local else "full_attention"
            for layer in range(config.n_layers)
        ],
        "rope_local_base_freq": config.local_rope_theta or config.rope_theta,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
        # Gemma3TextConfig defaults to pad_token_id=0, an embedding row without gradient;
        # this model has no padding row
        "pad_token_id": None,
    }


def _number(value: float) -> int | float:
    """``value`` as an int when it is one (transformers' config takes an int scalar)."""
    return int(value) if float(value).is_integer() else value


def _check(config: ModelConfig) -> None:
    if (
        config.window_layers
        and config.local_rope_theta is None
        and config.rope_scaling.type != "none"
    ):
        why = (
            "Gemma 3's local layers rotate unscaled: set model.local_rope_theta (its "
            "rope_local_base_freq, 10000 in the published models)"
        )
        raise refuse("gemma3", "local_rope_theta", None, why)


# Gemma3TextConfig's defaults of what the family reads without a default of its own: the
# published folders' text_config writes only what differs from them
TEXT_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131_072,
}
GEMMA3_IMAGE_TEXT = ImageText(
    model_type="gemma3",
    architecture="Gemma3ForConditionalGeneration",
    text_model_type="gemma3_text",
    text_defaults=TEXT_DEFAULTS,
    text_prefixes=(
        ("language_model.model.", "model."),  # the published files, transformers 4
        ("language_model.lm_head.", "lm_head."),
        ("model.language_model.", "model."),  # transformers 5's own names
        ("lm_head.", "lm_head."),
    ),
)

GEMMA3 = Family(
    name="gemma3",
    hf_model_types=("gemma3_text",),
    hf_architecture="Gemma3ForCausalLM",
    hf_score_class="Gemma3TextForSequenceClassification",
    names=GEMMA3_NAMES,
    from_hf=_from_hf,
    to_hf=_to_hf,
    fixed={
        "qk_norm": "head",
        "norm_placement": "both",
        "activation": "gelu_tanh",
        "scale_embeddings": True,
        "norm_gain_offset": 1.0,
    },
    reads=("query_pre_attn_scalar", "sliding_window", "window_layers", "local_rope_theta"),
    check=_check,
    image_text=GEMMA3_IMAGE_TEXT,
)
