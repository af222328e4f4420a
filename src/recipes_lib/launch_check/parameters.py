"""The run's parameters as the pre-launch check counts them, from its config alone:
every parameter of the decoder, what trains, what an adapter adds, what QLoRA stores in
4 bits and what LoRA stores in bf16 (``adapter.base_dtype``); a frozen model's bytes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from recipes_lib.config.schema import ModelConfig, RunConfig
from recipes_lib.launch_check.activations import DecoderShape


def weight_bytes_of(precision: str) -> int:
    """Bytes of a stored weight: bf16 under ``bf16-true``, fp32 under every other."""
    return 2 if precision == "bf16-true" else 4


def adapted_linears(cfg: RunConfig) -> dict[str, int] | None:
    """Adapted linear name -> LoRA rank, or None without an adapter."""
    if cfg.adapter.kind == "none":
        return None
    from recipes_lib.adapters.lora import native_targets

    return {name: cfg.adapter.r for name in native_targets(cfg.adapter)}


@dataclass(frozen=True)
class ParameterCounts:
    """How many parameters of the run's decoder train, are quantized, are adapters, are
    frozen projections stored in bf16 (``adapter.base_dtype``)."""

    total: int  # every parameter of the decoder
    trainable: int
    quantized: int  # 4-bit NF4 weights (QLoRA's base linears)
    adapters: int  # LoRA's A and B
    narrowed: int = 0

    @classmethod
    def of(cls, shape: DecoderShape, cfg: RunConfig) -> ParameterCounts:
        total, lora = shape.num_params(), adapted_linears(cfg)
        if lora is None:
            return cls(total=total, trainable=total, quantized=0, adapters=0)
        from recipes_lib.adapters.frozen_base import base_storage_dtype
        from recipes_lib.adapters.lora import EXPERTS_TARGET

        # every expert's w1, w3 and w2 (C -> F, C -> F, F -> C) at the experts' rank
        r = lora.pop(EXPERTS_TARGET, 0)
        per_layer = r * shape.experts * 3 * (shape.dim + shape.expert_width)
        adapters = shape.moe_layers * per_layer
        adapted = shape.adapted(lora)
        adapters += sum(r * (i + o) for i, o, r in adapted)
        if cfg.adapter.kind == "qlora":
            quantized = sum(i * o for i, o, _ in adapted)
            return cls(total=total, trainable=adapters, quantized=quantized, adapters=adapters)
        narrowed = 0
        if base_storage_dtype(cfg.adapter.base_dtype, cfg.precision.name) == torch.bfloat16:
            narrowed = projection_params(cfg.model)
        return cls(total, trainable=adapters, quantized=0, adapters=adapters, narrowed=narrowed)


def projection_params(model: ModelConfig) -> int:
    """The blocks' projections with their biases: the attention's (``wq`` .. ``wo``, or
    a latent attention's) in the attention layers, a linear-attention mixer's in the
    linear ones, ``w1`` .. ``w3`` of the dense layers' MLPs and of a mixture's shared
    experts (its routers, stacked experts, norms and the mixers' convolution and decay
    parameters are not among them)."""
    m, shape = model, DecoderShape.of_model(model)
    linears = shape.linears()
    if shape.latent_projections:  # biases on wq_a and wkv_a with qkv_bias
        attention = sum(i * o for _, i, o in shape.latent_projections)
        biased = [o for name, _, o in shape.latent_projections if name in ("wq_a", "wkv_a")]
        attention += sum(biased) if m.qkv_bias else 0
    else:
        attention = sum(i * o for i, o in (linears[n] for n in ("wq", "wk", "wv", "wo")))
        attention += shape.qkv_bias_params
    attention += m.dim if m.attention_out_bias else 0
    mixer = sum(i * o for _, i, o in shape.linear_projections)  # no biases
    dense = len(m.moe_dense_layers) if m.moe_experts else m.n_layers
    shared = m.moe_shared_experts * (m.moe_ffn_dim or m.ffn_dim) if m.moe_experts else 0
    mlp = 3 * m.dim * (dense * m.ffn_dim + (m.n_layers - dense) * shared)
    mixers = shape.linear_layers * mixer
    return (m.n_layers - shape.linear_layers) * attention + mixers + mlp


def frozen_model_bytes(model: ModelConfig, precision: str) -> tuple[int, float]:
    """A frozen model's parameters (a DPO reference, a teacher) and their bytes: in the
    run's storage dtype, its projections in bf16 under bf16-mixed
    (:func:`recipes_lib.adapters.frozen_base.narrow_frozen_linears`)."""
    from recipes_lib.adapters.frozen_base import base_storage_dtype

    total = DecoderShape.of_model(model).num_params()
    narrowed = projection_params(model) if base_storage_dtype("auto", precision) else 0
    return total, (total - narrowed) * weight_bytes_of(precision) + 2 * narrowed
