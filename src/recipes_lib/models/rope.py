"""Rotary position embeddings (RoPE) in the rotate-half layout of Hugging Face /
GPT-NeoX, on real tensors, with optional frequency scaling for context extension.

``model.nope_layers`` lists the layers that do without it (NoPE: their queries and
keys stay as projected; SmolLM3's every fourth); empty, the default, every layer
applies it. ``Attention`` skips the rotation itself, so the attention kernels and the
KV cache see ordinary queries and keys.

Shapes: T positions, hs head dim.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from recipes_lib.errors import ConfigError

if TYPE_CHECKING:
    from recipes_lib.config.schema import ModelConfig, RopeScalingConfig

ROPE_SCALING_TYPES = ("none", "linear", "llama3")


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScalingConfig) -> Tensor:
    """Inverse frequencies of RoPE, ``(hs // 2,)`` float32, with optional scaling.

    ``linear`` divides every frequency by ``factor`` (positions interpolated).
    ``llama3`` (Llama 3.1) leaves wavelengths shorter than
    ``original_max_seq_len / high_freq_factor`` alone, divides frequencies whose
    wavelength exceeds ``original_max_seq_len / low_freq_factor`` by ``factor``, and
    interpolates smoothly between the two bands.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling.type == "none":
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    # llama3
    old_len, factor = scaling.original_max_seq_len, scaling.factor
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    seq_len: int, head_dim: int, theta: float, scaling: RopeScalingConfig, device=None
) -> tuple[Tensor, Tensor]:
    """cos and sin tables, each ``(T, hs)`` float32, in the rotate-half layout."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling).to(device)
    positions = torch.arange(seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)  # (T, hs/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, hs): both halves share a frequency
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (B, heads, T, hs) by position; computed in the tables' dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)  # rotate_half
    return (x * cos + rotated * sin).to(x.dtype)


def check_nope_layers(config: ModelConfig) -> None:
    """Refuse a ``model.nope_layers`` that is not layer indices in increasing order, in
    one line naming the key."""
    layers = config.nope_layers
    try:
        ok = all(0 <= i < config.n_layers and int(i) == i for i in layers) and all(
            a < b for a, b in zip(layers, layers[1:], strict=False)
        )
    except TypeError:
        ok = False
    if not ok:
        raise ConfigError(
            f"model.nope_layers={layers!r} must list layers without RoPE, in increasing "
            f"order, each in 0..{config.n_layers - 1} (model.n_layers={config.n_layers})"
        )


def uses_rope(config: ModelConfig, layer: int) -> bool:
    """Whether layer ``layer`` applies RoPE (it is not in ``model.nope_layers``)."""
    return layer not in config.nope_layers
