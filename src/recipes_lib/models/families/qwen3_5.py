"""The Qwen3.5 families: dense ``qwen3_5`` (``model_type`` ``qwen3_5_text``,
``Qwen3_5ForCausalLM``) and ``qwen3_5_moe`` (``qwen3_5_moe_text``,
``Qwen3_5MoeForCausalLM``), a hybrid stack of two token mixers:

- most layers (``layer_types`` ``linear_attention``; by default all but every
  ``full_attention_interval`` = 4th) mix tokens with a Gated DeltaNet
  (``model.linear_layers``, :mod:`recipes_lib.models.linear_attention`): a causal
  depthwise convolution over ``linear_conv_kernel_dim`` positions, the gated delta rule
  with ``linear_num_value_heads`` heads of ``linear_value_head_dim`` and
  ``linear_num_key_heads`` query/key heads of ``linear_key_head_dim``, and a gated
  RMSNorm on its output;
- the others are gated attention: ``q_proj`` makes each head's query followed by its
  output gate (``model.attention_output_gate``), an RMSNorm on each head's queries and
  keys (``model.qk_norm=head``), RoPE on the first ``partial_rotary_factor`` (0.25 by
  default) of each head's dims.

Every RMSNorm but the linear layers' output norm computes ``x * (1 + w)`` in float32
(``model.norm_gain_offset=1``; the output norm's gain is plain). ``rope_parameters``'
``mrope_section`` splits the rotated dims between text, height and width positions; a
text-only sequence has the three equal, so it is plain RoPE here. The MoE family routes
every layer's MLP: a softmax router over ``num_experts``, the top
``num_experts_per_tok`` always renormalised, experts of ``moe_intermediate_size``, and
a shared expert of ``shared_expert_intermediate_size`` (``model.moe_shared_experts``
times the experts' width) whose output is scaled by ``sigmoid(shared_expert_gate x)``
(``model.moe_shared_gate``).

Tensor names, besides Qwen3's (:data:`~recipes_lib.models.families.qwen3.QWEN3_NAMES`):

    model.layers.N.linear_attn.in_proj_qkv <-> layers.N.attention.in_qkv
    model.layers.N.linear_attn.in_proj_z   <-> layers.N.attention.in_z
    model.layers.N.linear_attn.in_proj_b   <-> layers.N.attention.in_b
    model.layers.N.linear_attn.in_proj_a   <-> layers.N.attention.in_a
    model.layers.N.linear_attn.conv1d      <-> layers.N.attention.conv
    model.layers.N.linear_attn.A_log       <-> layers.N.attention.A_log
    model.layers.N.linear_attn.dt_bias     <-> layers.N.attention.dt_bias
    model.layers.N.linear_attn.norm        <-> layers.N.attention.out_norm
    model.layers.N.linear_attn.out_proj    <-> layers.N.attention.out_proj
    model.layers.N.mlp.shared_expert.*     <-> layers.N.feed_forward.shared.w1/w3/w2
    model.layers.N.mlp.shared_expert_gate  <-> layers.N.feed_forward.shared_gate
    model.layers.N.mlp.experts.E.gate_proj <-> layers.N.feed_forward.experts.w1[E]
        (up_proj w3, down_proj w2), or all experts in one tensor, as the published
        folders store them: mlp.experts.gate_up_proj (E, 2F, C: the gates' rows, then
        the ups') <-> w1, w3 and mlp.experts.down_proj (E, C, F) <-> w2

The published folders are image-text (``Qwen3_5ForConditionalGeneration``,
``model_type`` ``qwen3_5``; ``qwen3_5_moe`` for the MoE): a ``text_config`` of this
family beside a vision tower, the text tensors under ``model.language_model.``; the text
model trains here and the vision tower (and the multi-token-prediction weights,
``mtp.*``) are copied through when the folder is written back. Read from a folder, the
``mtp.*`` weights are left out, said in one line: the decoder predicts the next token.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from recipes_lib.config.schema import ModelConfig
from recipes_lib.errors import CheckpointError
from recipes_lib.models.families.base import (
    Family,
    Rearranged,
    TensorNames,
    common_from_hf,
    refuse,
    required,
    without_attention_bias,
)
from recipes_lib.models.families.experts import needs_experts, with_experts
from recipes_lib.models.families.image_text import ImageText
from recipes_lib.models.families.qwen3 import QWEN3_NAMES

log = logging.getLogger(__name__)

LINEAR_NAMES = {
    "linear_attn.in_proj_qkv": "attention.in_qkv",
    "linear_attn.in_proj_z": "attention.in_z",
    "linear_attn.in_proj_b": "attention.in_b",
    "linear_attn.in_proj_a": "attention.in_a",
    "linear_attn.conv1d": "attention.conv",
    "linear_attn.A_log": "attention.A_log",
    "linear_attn.dt_bias": "attention.dt_bias",
    "linear_attn.norm": "attention.out_norm",
    "linear_attn.out_proj": "attention.out_proj",
}
# the RoPE table of older exports and the multi-token-prediction module: nothing to read
_IGNORED = re.compile(r".*rotary_emb\.inv_freq|mtp\..*")
QWEN3_5_NAMES = TensorNames(
    layer={**QWEN3_NAMES.layer, **LINEAR_NAMES}, top=QWEN3_NAMES.top, ignored=_IGNORED
)
_ROUTED = with_experts(QWEN3_5_NAMES, "mlp", "gate_proj", "up_proj", "down_proj")


def _halves(gate_up: Tensor) -> list[Tensor]:
    """``(E, 2F, C)`` -> the gates' and the ups' ``(E, F, C)``."""
    return list(gate_up.chunk(2, dim=1))


# the published folders stack every expert in one tensor (transformers' own layout);
# transformers' save_pretrained writes one per expert: both are read
FUSED_EXPERTS = {
    "mlp.experts.gate_up_proj": Rearranged(
        parts=("feed_forward.experts.w1.weight", "feed_forward.experts.w3.weight"),
        split=_halves,
        join=lambda parts: torch.cat(parts, dim=1),
    ),
    "mlp.experts.down_proj": Rearranged(
        parts=("feed_forward.experts.w2.weight",),
        split=lambda down: [down],
        join=lambda parts: parts[0],
    ),
}
QWEN3_5_MOE_NAMES = TensorNames(
    layer={
        **_ROUTED.layer,
        "mlp.shared_expert.gate_proj": "feed_forward.shared.w1",
        "mlp.shared_expert.up_proj": "feed_forward.shared.w3",
        "mlp.shared_expert.down_proj": "feed_forward.shared.w2",
        "mlp.shared_expert_gate": "feed_forward.shared_gate",
    },
    top=_ROUTED.top,
    ignored=_IGNORED,
    experts=_ROUTED.experts,
    experts_module=_ROUTED.experts_module,
    rearranged=FUSED_EXPERTS,
)
LINEAR_READS = (
    "linear_layers",
    "linear_heads",
    "linear_key_heads",
    "linear_key_dim",
    "linear_value_dim",
    "linear_conv_kernel",
)
FIXED = {"qk_norm": "head", "norm_gain_offset": 1.0, "attention_output_gate": True}
_LAYER_KINDS = ("linear_attention", "full_attention")


def _rope(family: str, config: Mapping[str, Any]) -> tuple[float, float]:
    """RoPE theta and the rotated fraction of each head (0.25 unless said)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(
            f"{family}: rope_parameters.rope_type={rope_type!r} is not supported (default only)"
        )
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
    return theta, float(factor)


def _linear_layers(family: str, config: Mapping[str, Any]) -> list[int]:
    """The ``linear_attention`` layers of ``layer_types`` (or, without the list, all but
    every ``full_attention_interval``-th)."""
    n_layers = int(required(config, "num_hidden_layers"))
    types = config.get("layer_types")
    if types is None:
        interval = int(config.get("full_attention_interval") or 4)
        return [layer for layer in range(n_layers) if (layer + 1) % interval]
    if len(types) != n_layers or not set(types) <= set(_LAYER_KINDS):
        raise CheckpointError(
            f"{family}: layer_types must name linear_attention or full_attention for each "
            f"of the num_hidden_layers={n_layers} layers, got {list(types)!r}"
        )
    return [layer for layer, kind in enumerate(types) if kind == "linear_attention"]


def _from_hf(family: str, config: Mapping[str, Any]) -> dict[str, Any]:
    without_attention_bias(family, config)
    if config.get("attn_output_gate") is False:
        raise CheckpointError(
            f"{family}: attn_output_gate=false is not supported: transformers' {family} "
            "always gates its attention's output"
        )
    mtp = int(config.get("mtp_num_hidden_layers") or 0)
    if mtp:
        log.warning(
            "%s: mtp_num_hidden_layers=%d: the multi-token-prediction weights (mtp.*) are "
            "not read; the model predicts the next token only",
            family,
            mtp,
        )
    theta, partial = _rope(family, config)
    rope_keys = ("rope_parameters", "rope_scaling", "partial_rotary_factor")
    plain = {k: v for k, v in config.items() if k not in rope_keys}
    # ffn_dim is each family's own (a MoE folder has no intermediate_size): a stand-in
    fields = common_from_hf({**plain, "rope_theta": theta, "intermediate_size": 1})
    fields.pop("ffn_dim")
    return {
        **fields,
        "partial_rotary_factor": partial,
        "linear_layers": _linear_layers(family, config),
        "linear_heads": int(config.get("linear_num_value_heads", 32)),
        "linear_key_heads": int(config.get("linear_num_key_heads", 16)),
        "linear_key_dim": int(config.get("linear_key_head_dim", 128)),
        "linear_value_dim": int(config.get("linear_value_head_dim", 128)),
        "linear_conv_kernel": int(config.get("linear_conv_kernel_dim", 4)),
    }


def _to_hf(config: ModelConfig) -> dict[str, Any]:
    linear = set(config.linear_layers)
    return {
        "attention_bias": False,
        "attn_output_gate": True,
        "layer_types": [
            _LAYER_KINDS[0] if layer in linear else _LAYER_KINDS[1]
            for layer in range(config.n_layers)
        ],
        "linear_num_value_heads": config.linear_heads,
        "linear_num_key_heads": config.linear_key_heads,
        "linear_key_head_dim": config.linear_key_dim,
        "linear_value_head_dim": config.linear_value_dim,
        "linear_conv_kernel_dim": config.linear_conv_kernel,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": config.rope_theta,
            "partial_rotary_factor": config.partial_rotary_factor,
        },
    }


def _check(family: str, config: ModelConfig) -> None:
    if config.rope_scaling.type != "none":
        raise refuse(
            family,
            "rope_scaling.type",
            config.rope_scaling.type,
            f"{family} rotates with plain RoPE (none)",
        )


def _dense_from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    ffn = int(required(config, "intermediate_size"))
    return {**_from_hf("qwen3_5", config), "ffn_dim": ffn}


def _moe_from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    width = int(config.get("moe_intermediate_size") or 512)
    shared = int(config.get("shared_expert_intermediate_size") or width)
    if shared % width:
        raise CheckpointError(
            f"qwen3_5_moe: shared_expert_intermediate_size={shared} is not a multiple of "
            f"moe_intermediate_size={width}; the shared expert is a whole number of experts' "
            "widths here"
        )
    return {
        **_from_hf("qwen3_5_moe", config),
        "ffn_dim": width,
        "moe_experts": int(config.get("num_experts") or 256),
        "moe_top_k": int(config.get("num_experts_per_tok") or 8),
        "moe_ffn_dim": width,
        "moe_shared_experts": shared // width,
        # transformers' default when the file says none
        "moe_aux_loss_coef": float(config.get("router_aux_loss_coef", 0.001) or 0.0),
    }


def _moe_to_hf(config: ModelConfig) -> dict[str, Any]:
    width = config.moe_ffn_dim or config.ffn_dim
    return {
        **_to_hf(config),
        "num_experts": config.moe_experts,
        "num_experts_per_tok": config.moe_top_k,
        "moe_intermediate_size": width,
        "shared_expert_intermediate_size": config.moe_shared_experts * width,
        "router_aux_loss_coef": config.moe_aux_loss_coef,
        "output_router_logits": False,
    }


def _check_moe(config: ModelConfig) -> None:
    _check("qwen3_5_moe", config)
    needs_experts("qwen3_5_moe")(config)
    if config.moe_shared_experts < 1:
        raise refuse(
            "qwen3_5_moe",
            "moe_shared_experts",
            config.moe_shared_experts,
            "every qwen3_5_moe layer has a gated shared expert",
        )


def _image_text(model_type: str, architecture: str) -> ImageText:
    return ImageText(
        model_type=model_type,
        architecture=architecture,
        text_model_type=f"{model_type}_text",
        text_prefixes=(("model.language_model.", "model."), ("lm_head.", "lm_head.")),
    )


QWEN3_5 = Family(
    name="qwen3_5",
    hf_model_types=("qwen3_5_text",),
    hf_architecture="Qwen3_5ForCausalLM",
    names=QWEN3_5_NAMES,
    from_hf=_dense_from_hf,
    to_hf=_to_hf,
    fixed=FIXED,
    reads=("partial_rotary_factor", *LINEAR_READS),
    check=lambda config: _check("qwen3_5", config),
    extended_rope=True,
    hf_score_class="",
    image_text=_image_text("qwen3_5", "Qwen3_5ForConditionalGeneration"),
)
QWEN3_5_MOE = Family(
    name="qwen3_5_moe",
    hf_model_types=("qwen3_5_moe_text",),
    hf_architecture="Qwen3_5MoeForCausalLM",
    names=QWEN3_5_MOE_NAMES,
    from_hf=_moe_from_hf,
    to_hf=_moe_to_hf,
    fixed={**FIXED, "moe_shared_gate": True},
    # the top k are always renormalised: model.moe_renormalize holds its default, true
    reads=(
        "partial_rotary_factor",
        *LINEAR_READS,
        "moe_experts",
        "moe_top_k",
        "moe_ffn_dim",
        "moe_shared_experts",
    ),
    check=_check_moe,
    extended_rope=True,
    hf_score_class="",
    image_text=_image_text("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration"),
)
