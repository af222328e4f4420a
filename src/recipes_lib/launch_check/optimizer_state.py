"""The optimizer state of a run, from its config alone: its trainable tensors as the
optimizer will see them, and the bytes the chosen optimizer's spec keeps for them
(:meth:`recipes_lib.optim.OptimizerSpec.state_bytes`).

Without an adapter every parameter of the decoder trains: its shapes come from the
decoder built on the meta device. With LoRA or QLoRA only the adapters train: each
adapted linear's ``A`` (``r x in``) and ``B`` (``out x r``), a mixture's experts adapted
as one ``A`` and one ``B`` per stacked projection (``r x experts`` wide).
"""

from __future__ import annotations

import torch

from recipes_lib.config.schema import RunConfig
from recipes_lib.launch_check.activations import DecoderShape
from recipes_lib.launch_check.parameters import adapted_linears, weight_bytes_of
from recipes_lib.models.hf_fallback import model_shapes
from recipes_lib.optim import ParameterInfo, describe_parameters, get_optimizer_spec


def trainable_parameters(cfg: RunConfig) -> list[ParameterInfo]:
    """Each trainable tensor of the run's policy, in its stored dtype."""
    dtype = torch.bfloat16 if weight_bytes_of(cfg.precision.name) == 2 else torch.float32
    lora = adapted_linears(cfg)
    if lora is None:
        model = model_shapes(cfg.model)  # shapes only, on the meta device
        return [
            ParameterInfo(p.shape, dtype, p.group, p.outer)
            for p in describe_parameters(model, cfg.optim)
        ]
    from recipes_lib.adapters.lora import EXPERTS_TARGET

    shape = DecoderShape.of(cfg)
    pairs = shape.adapted({name: r for name, r in lora.items() if name != EXPERTS_TARGET})
    if EXPERTS_TARGET in lora:
        r = lora[EXPERTS_TARGET] * shape.experts
        c, f = shape.dim, shape.expert_width
        pairs += [(c, f, r), (c, f, r), (f, c, r)] * shape.moe_layers
    return [
        ParameterInfo(matrix, dtype)
        for fan_in, fan_out, r in pairs
        for matrix in ((r, fan_in), (fan_out, r))
    ]


def optimizer_state_bytes(cfg: RunConfig) -> int:
    """Bytes of state ``optim`` keeps for the run's trainable tensors, before any
    strategy divides it."""
    spec = get_optimizer_spec(cfg.optim.name)
    return spec.state_bytes(trainable_parameters(cfg), dict(cfg.optim.args))
