"""Sparse upcycling: a mixture of experts that starts from a dense model's weights.

Every expert of a layer starts as a copy of that layer's dense MLP (``w1``, ``w3``,
``w2``); the routers (and the sigmoid router's bias, and any shared experts) keep their
fresh initialisation; everything else is the dense model's. With the top-k weights
renormalised (``model.moe_renormalize``) the upcycled model computes exactly what the
dense one did, whichever experts the router picks (shared experts start adding nothing:
their ``w2`` is zero); without, each token's MLP output is scaled by its k experts'
probabilities. Training then lets the copies drift apart (Komatsuzaki et al., "Sparse
Upcycling", 2022).

The two models must agree on everything but the experts: the family may change to its
mixture (``llama`` -> ``mixtral``, ``qwen3`` -> ``qwen3_moe``) as long as every other
shape field (attention, norms, widths) is the same, and each expert is as wide as the
dense MLP (``model.moe_ffn_dim`` = the source's ``ffn_dim``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from recipes_lib.checkpoint.hf import load_hf_checkpoint
from recipes_lib.checkpoint.hf_files import is_hf_folder
from recipes_lib.checkpoint.weights import load_state_into, load_weights
from recipes_lib.config.model import ModelConfig, resolved_model_fields
from recipes_lib.errors import CheckpointError

# what may differ between the dense source and its mixture
_EXPERT_FIELDS = (
    "family",
    "moe_experts",
    "moe_ffn_dim",
    "moe_dense_layers",
    "moe_shared_experts",
    "moe_router",
    "moe_top_k",
    "moe_renormalize",
)
_EXPERT = re.compile(r"(layers\.\d+\.feed_forward)\.experts\.(w[123])\.weight")


def upcycle_mismatches(model: ModelConfig, source_model: Mapping[str, Any] | None) -> list[str]:
    """Every way the mixture ``model`` cannot start from the dense ``source_model``
    (empty when it can, or when the source records no model), a line each."""
    if source_model is None:
        return []
    # all that decides what the weights compute: a checkpoint's RoPE and norms included
    ours = resolved_model_fields(model, "shape", "compute")
    theirs = resolved_model_fields(source_model, "shape", "compute")
    problems = [
        f"model.{key}={ours[key]!r} vs {theirs[key]!r}"
        for key in ours
        if key not in _EXPERT_FIELDS and ours[key] != theirs[key]
    ]
    if theirs["moe_experts"]:
        problems.append(f"the source has experts already (moe_experts={theirs['moe_experts']})")
    if not ours["moe_experts"]:
        problems.append("model.moe_experts=0: upcycling makes a mixture of experts; set it")
    elif ours["moe_ffn_dim"] != theirs["ffn_dim"]:
        problems.append(
            f"model.moe_ffn_dim={ours['moe_ffn_dim']} vs the dense MLP's ffn_dim="
            f"{theirs['ffn_dim']} (each expert starts as a copy of it)"
        )
    return problems


def upcycled_state(model: nn.Module, dense: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """``model``'s state with every expert a copy of its layer's MLP in ``dense`` and the
    rest of ``dense``'s tensors; what ``dense`` cannot give (routers, biases, shared
    experts) stays ``model``'s own."""
    state = dict(dense)
    for name, tensor in model.state_dict().items():
        if name in state:
            continue
        match = _EXPERT.fullmatch(name)
        mlp = match and f"{match[1]}.{match[2]}.weight"
        if mlp and mlp in dense:
            source = state.pop(mlp, dense[mlp])
            fits = tuple(source.shape) == tuple(tensor.shape[1:])
            # one that does not fit is left as it is, for the load to name both shapes
            state[name] = source.to(tensor.dtype).expand_as(tensor).clone() if fits else source
        elif not match:  # fresh: the router, its bias, shared experts (adding nothing yet)
            state[name] = torch.zeros_like(tensor) if ".shared.w2." in name else tensor
    # a dense layer's MLP left over (its layer kept experts) is no tensor of the model
    return state


def load_upcycled_weights(model: nn.Module, path: str | os.PathLike, label: str) -> None:
    """Load a dense model's weights (any source ``stage.init_from`` takes) into the
    mixture ``model``, each expert a copy of its layer's MLP.

    Raises:
        CheckpointError: naming ``label``: the source cannot be read, or its tensors do
            not fit (the first mismatches are listed).
    """
    try:
        if is_hf_folder(path):
            dense = load_hf_checkpoint(path)[0].state_dict()
        else:
            dense = load_weights(path)
    except CheckpointError as err:
        raise CheckpointError(f"{label}: {err}") from err
    with torch.no_grad():
        load_state_into(model, upcycled_state(model, dense), f"{label} (upcycled)")
