"""What every family of routed experts shares (Qwen3-MoE, OLMoE, Mixtral): the tensor
names of a layer whose MLP is routed, the mixture's ``config.json`` fields both ways,
and the check that every layer has experts; and DeepSeek-V3's mixture, which GLM-4.5
shares: the sigmoid router with its choice bias and group limit, the routed scale,
shared experts and the first layers dense."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
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


# DeepSeek-V3's mixture (GLM-4.5's too): the options its config.json sets, beside the
# router, which is the sigmoid one (Family.fixed)
DEEPSEEK_MOE_READS = (
    *MOE_READS,
    "moe_dense_layers",
    "moe_shared_experts",
    "moe_groups",
    "moe_top_groups",
    "moe_routed_scale",
)
# in a layer with experts, beside with_experts' names
_DEEPSEEK_MOE_NAMES = {
    "mlp.gate.e_score_correction_bias": "feed_forward.expert_bias",
    "mlp.shared_experts.gate_proj": "feed_forward.shared.w1",
    "mlp.shared_experts.up_proj": "feed_forward.shared.w3",
    "mlp.shared_experts.down_proj": "feed_forward.shared.w2",
}


def with_deepseek_experts(base: TensorNames) -> TensorNames:
    """``base``'s names (its dense MLP kept for the first layers) with DeepSeek-V3's
    experts: one tensor per routed expert, the shared experts, the router and its choice
    bias (``e_score_correction_bias``, the sigmoid router's ``expert_bias``); a folder's
    multi-token-prediction layers are skipped."""
    names = with_experts(base, "mlp", "gate_proj", "up_proj", "down_proj", dense_layers=True)
    return replace(names, layer={**names.layer, **_DEEPSEEK_MOE_NAMES}, prediction_layers=True)


def deepseek_moe_from_hf(config: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's mixture of a ``config.json``: ``n_routed_experts`` of
    ``moe_intermediate_size``, ``n_shared_experts``, the first
    ``first_k_dense_replace`` layers dense, the group limit (``n_group``,
    ``topk_group``), ``norm_topk_prob`` and ``routed_scaling_factor``. A key the file
    leaves out takes its value in ``defaults``: the family's transformers config's own
    default, which is what transformers builds from that file.

    Raises:
        CheckpointError: the remote code's ``scoring_func`` or ``topk_method`` name
            another router (DeepSeek-V2's softmax or greedy choice).
    """
    scoring, method = config.get("scoring_func", "sigmoid"), config.get("topk_method", "noaux_tc")
    if (scoring, method) != ("sigmoid", "noaux_tc"):
        raise CheckpointError(
            f"{config.get('model_type')}: scoring_func={scoring!r} with topk_method={method!r} "
            "is not supported; DeepSeek-V3's router is read (sigmoid, noaux_tc)"
        )

    def value(key: str) -> Any:
        found = config.get(key)
        return defaults[key] if found is None else found

    n_layers = int(required(config, "num_hidden_layers"))
    dense = int(value("first_k_dense_replace") or 0)
    return {
        **moe_from_hf(config, "n_routed_experts", value("norm_topk_prob")),
        "moe_shared_experts": int(value("n_shared_experts") or 0),
        "moe_dense_layers": list(range(min(dense, n_layers))),
        "moe_groups": int(value("n_group") or 1),
        "moe_top_groups": int(value("topk_group") or 1),
        "moe_routed_scale": float(value("routed_scaling_factor")),
    }


def deepseek_moe_hf_fields(config: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` fields of DeepSeek-V3's mixture (no multi-token prediction)."""
    return {
        "n_routed_experts": config.moe_experts,
        "num_experts_per_tok": config.moe_top_k,
        "norm_topk_prob": config.moe_renormalize,
        "moe_intermediate_size": config.moe_ffn_dim or config.ffn_dim,
        "n_shared_experts": config.moe_shared_experts,
        "first_k_dense_replace": len(config.moe_dense_layers),
        "n_group": config.moe_groups,
        "topk_group": config.moe_top_groups,
        "routed_scaling_factor": config.moe_routed_scale,
        "num_nextn_predict_layers": 0,
        "output_router_logits": False,
    }


def check_deepseek_moe(family: str, config: ModelConfig) -> None:
    """Refuse a mixture DeepSeek-V3's layout cannot hold, naming the key: it has experts,
    its dense layers are the first ones, and its shared experts are at least one (the
    Hugging Face class always builds them)."""
    needs_experts(family)(config)
    dense = list(config.moe_dense_layers)
    if dense != list(range(len(dense))):
        why = f"{family}'s dense layers are its first ones (first_k_dense_replace)"
        raise refuse(family, "moe_dense_layers", dense, why)
    if config.moe_shared_experts < 1:
        why = f"every {family} mixture layer has shared experts (n_shared_experts >= 1)"
        raise refuse(family, "moe_shared_experts", config.moe_shared_experts, why)
