"""What every family of routed experts shares (Qwen3-MoE, OLMoE, Mixtral): the tensor
names of a layer whose MLP is routed, the mixture's ``config.json`` fields both ways,
and the check that every layer has experts."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from recipes_lib.config.schema import ModelConfig
from recipes_lib.errors import CheckpointError
from recipes_lib.models.families.base import TensorNames, refuse, required

# The mixture-of-experts options a family of routed experts reads from its config.json
MOE_READS = ("moe_experts", "moe_top_k", "moe_ffn_dim", "moe_renormalize")


def with_experts(
    base: TensorNames,
    mlp: str,
    gate: str,
    up: str,
    down: str,
    *,
    dense_layers: bool = False,
    experts_module: str = "mlp.experts",
) -> TensorNames:
    """``base``'s tensor names for a model whose layers route their MLP: the router
    ``<mlp>.gate`` <-> ``feed_forward.router``, and one Hugging Face tensor per expert
    (``<mlp>.experts.{}.<gate>`` <-> ``feed_forward.experts.w1``, ``up`` w3, ``down`` w2).
    ``base``'s dense MLP names stay only with ``dense_layers`` (layers that keep one).
    ``experts_module``: see :class:`TensorNames` (Mixtral's is ``mlp`` in memory)."""
    experts = {
        f"{mlp}.experts.{{}}.{hf}": f"feed_forward.experts.{native}"
        for hf, native in ((gate, "w1"), (up, "w3"), (down, "w2"))
    }
    layer = {
        hf: native
        for hf, native in base.layer.items()
        if dense_layers or not native.startswith("feed_forward.")
    }
    return TensorNames(
        layer={**layer, f"{mlp}.gate": "feed_forward.router"},
        top=base.top,
        experts=experts,
        experts_module=experts_module,
    )


def moe_from_hf(config: Mapping[str, Any], experts_key: str, renormalize: bool) -> dict[str, Any]:
    """The routed experts of a ``config.json``: their number (``experts_key``), top-k,
    the expert MLP's width (``moe_intermediate_size``, else ``intermediate_size``), the
    renormalisation and the balance loss's weight."""
    width = config.get("moe_intermediate_size") or required(config, "intermediate_size")
    # transformers 5 writes every family's count as num_local_experts
    experts = config.get(experts_key, config.get("num_local_experts"))
    return dict(
        moe_experts=int(required({experts_key: experts}, experts_key)),
        moe_top_k=int(required(config, "num_experts_per_tok")),
        moe_ffn_dim=int(width),
        moe_renormalize=bool(renormalize),
        moe_aux_loss_coef=float(config.get("router_aux_loss_coef") or 0.0),
    )


def moe_hf_fields(config: ModelConfig, family: str, experts_key: str) -> dict[str, Any]:
    """The routed experts' ``config.json`` fields; refuses what its transformers class
    cannot compute (a sigmoid router, shared experts), naming the key.

    Raises:
        CheckpointError: the model has one of them.
    """
    if config.moe_router != "softmax" or config.moe_shared_experts:
        key = "moe_router" if config.moe_router != "softmax" else "moe_shared_experts"
        raise CheckpointError(
            f"{family}: model.{key}={getattr(config, key)!r} has no Hugging Face {family} "
            "equivalent; the export needs model.moe_router=softmax and no shared experts"
        )
    return {
        experts_key: config.moe_experts,
        "num_experts_per_tok": config.moe_top_k,
        "norm_topk_prob": config.moe_renormalize,
        "router_aux_loss_coef": config.moe_aux_loss_coef,
        "output_router_logits": False,
    }


def needs_experts(family: str) -> Callable[[ModelConfig], None]:
    """A family check refusing a model without experts (every layer of ``family`` has)."""

    def check(config: ModelConfig) -> None:
        if config.moe_experts < 1:
            raise refuse(
                family, "moe_experts", config.moe_experts, f"every {family} layer has experts"
            )

    return check
