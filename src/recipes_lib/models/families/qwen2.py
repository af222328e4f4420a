"""The Qwen2 family (Qwen2, Qwen2.5): the Llama layout with biases on q, k and v.

The same tensor names as Llama (:data:`~recipes_lib.models.families.llama.LLAMA_NAMES`,
plus the three biases). Qwen2's optional sliding window applies to layers at and above
``max_window_layers`` when ``use_sliding_window`` is set (or to the
``sliding_attention`` entries of ``layer_types`` in transformers 5).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from recipes_lib.config.schema import ModelConfig
from recipes_lib.models.families.base import (
    Family,
    common_from_hf,
)
from recipes_lib.models.families.llama import LLAMA_NAMES


def _from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    return common_from_hf(config)


def _to_hf(config: ModelConfig) -> dict[str, Any]:
    return {
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": config.n_layers,
    }


def qwen_sliding_window(config: Mapping[str, Any]) -> int | None:
    """The window of a Qwen2 or Qwen3 ``config.json`` (see the module docstring)."""
    window = config.get("sliding_window")
    if window is None:
        return None
    layer_types = config.get("layer_types")
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    uses = config.get("use_sliding_window", False)
    if not uses or config.get("max_window_layers", 0) >= config["num_hidden_layers"]:
        return None
    return int(window)


QWEN2 = Family(
    name="qwen2",
    hf_model_types=("qwen2",),
    hf_architecture="Qwen2ForCausalLM",
    names=LLAMA_NAMES,
    from_hf=_from_hf,
    to_hf=_to_hf,
    fixed={"qkv_bias": True},
    sliding_window=qwen_sliding_window,
)
