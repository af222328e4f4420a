"""The SmolLM3 family: the Llama layout with some layers left without RoPE (NoPE).

``config.json``'s ``no_rope_layers`` holds one flag per layer, named the other way round
from what it holds: 1 means the layer applies RoPE, 0 that it does not. Without the list,
transformers makes every ``no_rope_layer_interval``-th layer (default 4: layers 3, 7,
11, ...) a NoPE layer; only the first ``num_hidden_layers`` flags are read. Here the
layers with a 0 are ``model.nope_layers`` (their indices), and an export writes the
flags back. Otherwise Llama's block: GQA, SwiGLU, rotate-half RoPE, no biases
(``attention_bias`` would put one on o_proj too, and ``mlp_bias`` on the MLP: both
refused), tied embeddings at the published 3B size.

The tensor names are Llama's (:data:`~recipes_lib.models.families.llama.LLAMA_NAMES`).
The optional sliding window is read as transformers reads it: the
``sliding_attention`` entries of ``layer_types``, or, without ``layer_types``, the NoPE
layers when ``use_sliding_window`` is set; the model is then built with full attention
over at most the window (see ``model_config_from_hf``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from recipes_lib.config.schema import ModelConfig
from recipes_lib.errors import CheckpointError
from recipes_lib.models.families.base import (
    Family,
    common_from_hf,
    required,
    without_attention_bias,
)
from recipes_lib.models.families.llama import LLAMA_NAMES

NOPE_INTERVAL = 4  # transformers' default no_rope_layer_interval


def nope_layers(config: Mapping[str, Any]) -> list[int]:
    """The layers without RoPE of a SmolLM3 ``config.json`` (its 0 flags).

    Raises:
        CheckpointError: ``no_rope_layers`` shorter than the layers, or not flags.
    """
    n_layers = int(required(config, "num_hidden_layers"))
    flags = config.get("no_rope_layers")
    if flags is None:
        interval = int(config.get("no_rope_layer_interval") or NOPE_INTERVAL)
        return [layer for layer in range(n_layers) if (layer + 1) % interval == 0]
    if len(flags) < n_layers or any(f not in (0, 1) for f in flags[:n_layers]):
        raise CheckpointError(
            f"smollm3: no_rope_layers={list(flags)!r} must hold a 0 or 1 for each of the "
            f"num_hidden_layers={n_layers} layers"
        )
    return [layer for layer, flag in enumerate(flags[:n_layers]) if not flag]


def _from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    without_attention_bias("smollm3", config)
    return {**common_from_hf(config), "nope_layers": nope_layers(config)}


def _to_hf(config: ModelConfig) -> dict[str, Any]:
    nope = set(config.nope_layers)
    return {
        "attention_bias": False,
        "mlp_bias": False,
        "no_rope_layers": [int(layer not in nope) for layer in range(config.n_layers)],
        "use_sliding_window": False,
        "sliding_window": None,
        "layer_types": ["full_attention"] * config.n_layers,
        # SmolLM3Config defaults to pad_token_id=128004, an embedding row without
        # gradient (and past a small vocabulary); this model has no padding row
        "pad_token_id": None,
    }


def smollm3_sliding_window(config: Mapping[str, Any]) -> int | None:
    """The window of a SmolLM3 ``config.json`` (see the module docstring)."""
    window = config.get("sliding_window")
    if window is None:
        return None
    layer_types = config.get("layer_types")
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    if config.get("use_sliding_window") and nope_layers(config):
        return int(window)
    return None


SMOLLM3 = Family(
    name="smollm3",
    hf_model_types=("smollm3",),
    hf_architecture="SmolLM3ForCausalLM",
    names=LLAMA_NAMES,
    from_hf=_from_hf,
    to_hf=_to_hf,
    reads=("nope_layers",),
    sliding_window=smollm3_sliding_window,
)
