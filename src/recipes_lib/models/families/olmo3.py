"""The OLMo 3 family: OLMo 2's blocks with local and global layers.

The block is OLMo 2's (:mod:`~recipes_lib.models.families.olmo2`): norms after attention
and after the MLP (``model.norm_placement=post``), an RMSNorm over the whole query and
key projections (``qk_norm=full``), SwiGLU, no biases, untied embeddings; the tensor
names are OLMo 2's. What OLMo 3 adds, each a model option it reads:

- local and global layers: the ``sliding_attention`` entries of ``layer_types`` (or,
  without the list, three of every four layers) attend to the last ``sliding_window``
  keys (``model.window_layers``, ``model.sliding_window``); the others to every key;
- RoPE per kind of layer (``rope_parameters.full_attention`` and
  ``.sliding_attention``): the global layers' base and scaling are ``model.rope_theta``
  and ``model.rope_scaling`` (the published models extend their context with YaRN
  there), the local layers rotate unscaled with their own base
  (``model.local_rope_theta``). A ``config.json`` in transformers 4's form
  (``rope_theta`` and ``rope_scaling``) scales the global layers only, and both kinds
  use its ``rope_theta``. Local layers scaled as the global ones are read with
  ``model.local_rope_theta`` unset, so they share the global tables.

A YaRN ``truncate`` of false inside ``rope_parameters.full_attention`` is refused:
transformers 5 reads ``truncate`` only from the top of ``rope_parameters``, so it would
compute a different model from the one the file asks for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from recipes_lib.config.schema import ModelConfig, RopeScalingConfig
from recipes_lib.errors import CheckpointError
from recipes_lib.models.families.base import (
    Family,
    common_from_hf,
    refuse,
    rope_to_hf,
    scaling_from_hf,
    sliding_layers,
    without_attention_bias,
)
from recipes_lib.models.families.olmo2 import OLMO2

PATTERN = 4  # Olmo3Config's default layer_types: every fourth layer global
THETA = 500_000.0  # Olmo3Config's default RoPE base
_ROPE_KEYS = ("rope_parameters", "rope_scaling", "rope_theta")
_DEFAULT = {"rope_type": "default"}


def _rope_entries(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The global and local layers' ``rope_parameters`` entries, each with its base."""
    params = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", THETA)
    if "full_attention" in params or "sliding_attention" in params:  # transformers 5
        full = dict(params.get("full_attention") or _DEFAULT)
        local = dict(params.get("sliding_attention") or _DEFAULT)
        if full.get("rope_type") == "yarn" and not full.get("truncate", True):
            raise CheckpointError(
                "olmo3: rope_parameters.full_attention.truncate=false is not supported: "
                "transformers 5 reads truncate only from the top of rope_parameters"
            )
    else:  # transformers 4: one rope_theta, the scaling the global layers'
        full, local = dict(config.get("rope_scaling") or params or _DEFAULT), dict(_DEFAULT)
    full.setdefault("rope_theta", theta)
    local.setdefault("rope_theta", theta)
    for entry in (full, local):
        if float(entry.get("partial_rotary_factor", 1.0)) != 1:
            raise CheckpointError("olmo3: partial_rotary_factor != 1 is not supported")
    return full, local


def _ropes(config: Mapping[str, Any]) -> tuple[float, RopeScalingConfig, float | None]:
    """The global layers' base and scaling, and the local layers' own base (None: they
    share the global tables)."""
    full, local = _rope_entries(config)
    max_positions = config.get("max_position_embeddings")
    scaling = scaling_from_hf(full, max_positions)
    full_theta, local_theta = float(full["rope_theta"]), float(local["rope_theta"])
    local_scaling = scaling_from_hf(local, max_positions)
    if local_scaling.type == "none":
        return full_theta, scaling, local_theta
    if (local_scaling, local_theta) == (scaling, full_theta):
        return full_theta, scaling, None
    raise CheckpointError(
        f"olmo3: the sliding layers' rope type {local.get('rope_type')!r} differs from the "
        "full layers'; they must rotate unscaled or as the full layers do"
    )


def _from_hf(config: Mapping[str, Any]) -> dict[str, Any]:
    without_attention_bias("olmo3", config)
    theta, scaling, local_theta = _ropes(config)
    fields = common_from_hf({k: v for k, v in config.items() if k not in _ROPE_KEYS})
    window = config.get("sliding_window")
    local = [] if window is None else sliding_layers("olmo3", config, PATTERN)
    return {
        **fields,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "sliding_window": None if window is None or not local else int(window),
        "window_layers": local,
        "local_rope_theta": local_theta if local else None,
    }


def _to_hf(config: ModelConfig) -> dict[str, Any]:
    local = set(config.window_layers)
    scaling = rope_to_hf(config.rope_scaling) or _DEFAULT
    full = {k: v for k, v in scaling.items() if k != "type"}  # transformers 4's spelling
    full["rope_theta"] = config.rope_theta
    own = config.local_rope_theta
    sliding = dict(full) if own is None else {"rope_type": "default", "rope_theta": own}
    return {
        "attention_bias": False,
        # transformers builds the window mask whether a layer uses it or not
        "sliding_window": config.sliding_window or config.max_seq_len,
        "layer_types": [
            "sliding_attention" if layer in local else "full_attention"
            for layer in range(config.n_layers)
        ],
        "rope_parameters": {"full_attention": full, "sliding_attention": sliding},
        # Olmo3Config defaults to pad_token_id=1, which would make row 1 of its
        # embedding a padding row (no gradient); this model has none
        "pad_token_id": None,
    }


def _check(config: ModelConfig) -> None:
    scaling = config.rope_scaling
    if scaling.type == "yarn" and not scaling.truncate:
        why = (
            "OLMo 3's folders keep YaRN per kind of layer, where transformers 5 reads no "
            "truncate (it reads it only from the top of rope_parameters): the export could "
            "not be read back as the same model"
        )
        raise refuse("olmo3", "rope_scaling.truncate", False, why)


OLMO3 = Family(
    name="olmo3",
    hf_model_types=("olmo3",),
    hf_architecture="Olmo3ForCausalLM",
    names=OLMO2.names,
    from_hf=_from_hf,
    to_hf=_to_hf,
    fixed=OLMO2.fixed,
    reads=("sliding_window", "window_layers", "local_rope_theta"),
    check=_check,
)
