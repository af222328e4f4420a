"""Rotary position embeddings (RoPE) in the rotate-half layout of Hugging Face /
GPT-NeoX, on real tensors, with optional frequency scaling for context extension.

``model.nope_layers`` lists the layers that do without it (NoPE: their queries and
keys stay as projected; SmolLM3's every fourth); empty, the default, every layer
applies it. ``Attention`` skips the rotation itself, so the attention kernels and the
KV cache see ordinary queries and keys.

``model.partial_rotary_factor`` (Phi-3's; 1, the default, rotates the whole head)
rotates only the first ``rd = int(hs * factor)`` dims of each head (rotate-half within
them, frequencies over ``rd``) and passes the rest through; the tables are ``rd`` wide.
``rope_scaling.type=longrope`` (Phi-3's LongRoPE) divides each frequency by its own
factor: ``short_factor`` for a forward whose last position is within
``original_max_seq_len``, ``long_factor`` for one that goes past it (the choice is per
call, as transformers makes it: cached keys keep the rotation they were written with),
and scales cos and sin by its attention factor. Such a model keeps both tables.
A generation that crosses ``original_max_seq_len`` runs its whole sequence again
with the long factors, as transformers does (:func:`longrope_restarts`).
``rope_scaling.type=yarn`` (YaRN) keeps the fast frequencies, divides the slow ones by
``factor`` and blends the two over a band of dims between (:func:`rope_inv_freq`), and
scales cos and sin by its attention factor, so every query-key product is multiplied by
its square, as transformers applies it (:func:`attention_scale`).

Shapes: T positions, hs head dim, rd rotated dims.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from recipes_lib.config.model import RopeScalingConfig as _RopeScaling
from recipes_lib.config.model import is_layer_list
from recipes_lib.errors import ConfigError

if TYPE_CHECKING:
    from recipes_lib.config.schema import ModelConfig, RopeScalingConfig


class HoldsRopeTables(Protocol):
    """A model with its rope tables as buffers (``rope_cos``, ``rope_sin`` and, where its
    config asks, the long and local ones) and the config they were built from."""

    @property
    def config(self) -> ModelConfig: ...


ROPE_SCALING_TYPES = ("none", "linear", "llama3", "longrope", "yarn")
# the tables of a longrope model for forwards past original_max_seq_len
_LONG = ("rope_cos_long", "rope_sin_long")
# the tables of the window layers of a model with model.local_rope_theta
LOCAL_TABLES = _LOCAL = ("rope_cos_local", "rope_sin_local")  # the window layers' own


_UNSCALED = _RopeScaling()


def rope_inv_freq(
    head_dim: int, theta: float, scaling: RopeScalingConfig, long: bool = False
) -> Tensor:
    """Inverse frequencies of RoPE, ``(hs // 2,)`` float32, with optional scaling.

    ``linear`` divides every frequency by ``factor`` (positions interpolated).
    ``llama3`` (Llama 3.1) leaves wavelengths shorter than
    ``original_max_seq_len / high_freq_factor`` alone, divides frequencies whose
    wavelength exceeds ``original_max_seq_len / low_freq_factor`` by ``factor``, and
    interpolates smoothly between the two bands. ``longrope`` divides each by its entry of
    ``long_factor`` (``long``) or ``short_factor``. ``yarn``: see :func:`_yarn_inv_freq`.
    """
    if scaling.type == "longrope":
        factors = torch.tensor(
            scaling.long_factor if long else scaling.short_factor, dtype=torch.float32
        )
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        return 1.0 / (factors * theta**exponents)
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling.type == "none":
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    if scaling.type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
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


def _yarn_inv_freq(head_dim: int, theta: float, scaling: RopeScalingConfig) -> Tensor:
    """YaRN's inverse frequencies, ``(hs // 2,)`` float32.

    Frequency ``i`` turns ``original_max_seq_len * inv_freq[i] / (2 pi)`` times over the
    pretraining context. Those that turn more than ``beta_fast`` times are kept as they
    are (extrapolated), those that turn fewer than ``beta_slow`` times are divided by
    ``factor`` (interpolated), and the ones between blend the two linearly in ``i``. The
    band's edges are the fractional ``i`` solving ``turns = beta``, rounded outwards
    with ``truncate`` and clipped to ``0 .. hs - 1``.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    wavelengths = theta**exponents  # 1 / inv_freq, over 2 pi
    kept, divided = 1.0 / wavelengths, 1.0 / (scaling.factor * wavelengths)

    def dim_turning(turns: float) -> float:  # the fractional i with `turns` rotations
        ratio = scaling.original_max_seq_len / (turns * 2 * math.pi)
        return head_dim * math.log(ratio) / (2 * math.log(theta))

    fast, slow = dim_turning(scaling.beta_fast), dim_turning(scaling.beta_slow)
    if scaling.truncate:
        fast, slow = math.floor(fast), math.ceil(slow)
    fast, slow = max(fast, 0), min(slow, head_dim - 1)
    if fast == slow:
        slow += 0.001  # a band of no width: a step between the two
    index = torch.arange(head_dim // 2, dtype=torch.float32)
    blend = ((index - fast) / (slow - fast)).clamp(0, 1)  # 0: kept, 1: divided
    return divided * blend + kept * (1 - blend)


def attention_scale(scaling: RopeScalingConfig) -> float:
    """What ``longrope`` and ``yarn`` multiply cos and sin by (1 for the other types):
    ``attention_factor``, or when it is None the type's own, as transformers derives it.

    longrope: ``sqrt(1 + ln(factor) / ln(original_max_seq_len))``. yarn:
    ``0.1 * ln(factor) + 1``, or with ``mscale`` and ``mscale_all_dim`` both set (and
    not zero) the ratio of ``0.1 * m * ln(factor) + 1`` for the two; 1 for
    ``factor <= 1``.
    """
    if scaling.type not in ("longrope", "yarn"):
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    factor = scaling.factor
    if factor <= 1:
        return 1.0
    if scaling.type == "longrope":
        return math.sqrt(1 + math.log(factor) / math.log(scaling.original_max_seq_len))

    def mscale(m: float) -> float:
        return 0.1 * m * math.log(factor) + 1.0

    if scaling.mscale and scaling.mscale_all_dim:
        return mscale(scaling.mscale) / mscale(scaling.mscale_all_dim)
    return mscale(1.0)


def rope_cos_sin(
    seq_len: int,
    head_dim: int,
    theta: float,
    scaling: RopeScalingConfig,
    device=None,
    long: bool = False,
) -> tuple[Tensor, Tensor]:
    """cos and sin tables, each ``(T, hs)`` float32, in the rotate-half layout (``hs``:
    the rotated dims), times :func:`attention_scale`; ``long`` picks longrope's long
    factors."""
    inv_freq = rope_inv_freq(head_dim, theta, scaling, long).to(device)
    positions = torch.arange(seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)  # (T, hs/2)
    angles = torch.cat([angles, angles], dim=-1)  # (T, hs): both halves share a frequency
    scale = attention_scale(scaling)
    if scale != 1:
        return angles.cos() * scale, angles.sin() * scale
    return angles.cos(), angles.sin()


def rotary_dim(config: ModelConfig, head_dim: int) -> int:
    """How many of each head's dims RoPE rotates (``model.partial_rotary_factor``; a
    latent attention's ``model.mla_rope_dim``)."""
    if config.mla_kv_rank is not None:
        return config.mla_rope_dim
    if config.partial_rotary_factor == 1:
        return head_dim
    return int(head_dim * config.partial_rotary_factor)


def rope_tables(config: ModelConfig, head_dim: int, device=None) -> dict[str, Tensor]:
    """The model's RoPE buffers by name: ``rope_cos``/``rope_sin`` ``(max_seq_len, rd)``,
    and a longrope model's ``rope_cos_long``/``rope_sin_long``."""
    rd, c = rotary_dim(config, head_dim), config
    cos, sin = rope_cos_sin(c.max_seq_len, rd, c.rope_theta, c.rope_scaling, device)
    tables = {"rope_cos": cos, "rope_sin": sin}
    if c.rope_scaling.type == "longrope":
        long = rope_cos_sin(c.max_seq_len, rd, c.rope_theta, c.rope_scaling, device, long=True)
        tables.update(zip(_LONG, long, strict=True))
    if c.local_rope_theta is not None:  # the window layers' own base, unscaled
        local = rope_cos_sin(c.max_seq_len, rd, c.local_rope_theta, _UNSCALED, device)
        tables.update(zip(_LOCAL, local, strict=True))
    return tables


def rope_window(
    model: HoldsRopeTables, start: int, end: int, local: bool = False
) -> tuple[Tensor, Tensor]:
    """cos and sin of positions ``start .. end - 1`` for one forward of ``model``: a
    longrope model's long tables when ``end`` is past ``original_max_seq_len``; with
    ``local``, the window layers' own (``model.local_rope_theta``)."""
    scaling = model.config.rope_scaling
    names = ("rope_cos", "rope_sin")
    if local:
        names = _LOCAL
    elif scaling.type == "longrope" and end > scaling.original_max_seq_len:
        names = _LONG
    return tuple(getattr(model, name)[start:end] for name in names)  # (T, rd) each


def longrope_restarts(config: ModelConfig, cached: int, total: int) -> bool:
    """Whether a generation holding ``cached`` positions runs its whole sequence of
    ``total`` again, as transformers' Phi-3 generation does: a longrope model whose
    cache was written within ``original_max_seq_len`` (short factors) when the sequence
    first goes past it (long factors throughout from then on)."""
    scaling = config.rope_scaling
    return scaling.type == "longrope" and cached <= scaling.original_max_seq_len < total


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (B, heads, T, hs) by position; computed in the tables' dtype. Tables
    narrower than the head (``rd < hs``) rotate its first ``rd`` dims only."""
    rd = cos.shape[-1]
    if rd < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)  # rotate_half
    return (x * cos + rotated * sin).to(x.dtype)


def check_rope(config: ModelConfig, head_dim: int, family: str, extended: bool) -> None:
    """Refuse RoPE options out of range, or ones ``family`` cannot have (``extended``:
    partial rotation and longrope), in one line naming the key."""
    scaling, factor = config.rope_scaling, config.partial_rotary_factor
    if scaling.type not in ROPE_SCALING_TYPES:
        choices = " | ".join(ROPE_SCALING_TYPES)
        raise ConfigError(f"model.rope_scaling.type={scaling.type!r} is not one of {choices}")
    if scaling.type != "none" and scaling.factor <= 0:
        raise ConfigError(f"model.rope_scaling.factor must be positive, got {scaling.factor}")
    if scaling.type == "llama3" and not scaling.high_freq_factor > scaling.low_freq_factor > 0:
        raise ConfigError(
            "model.rope_scaling needs high_freq_factor > low_freq_factor > 0, got "
            f"high_freq_factor={scaling.high_freq_factor}, "
            f"low_freq_factor={scaling.low_freq_factor}"
        )
    if not (isinstance(factor, int | float) and 0 < factor <= 1):
        raise ConfigError(f"model.partial_rotary_factor={factor!r} must be in (0, 1]")
    rd = rotary_dim(config, head_dim)
    if rd < 2 or rd % 2:
        raise ConfigError(
            f"model.partial_rotary_factor={factor!r} rotates int({head_dim} * {factor}) = {rd} "
            "dims of each head; it must be an even number of at least 2"
        )
    if not extended and (factor != 1 or scaling.type == "longrope"):
        key = "partial_rotary_factor" if factor != 1 else "rope_scaling.type"
        value = factor if factor != 1 else scaling.type
        raise ConfigError(
            f"model.family={family} with model.{key}={value!r}: {family}'s Hugging Face "
            "layout rotates whole heads without longrope (those are model.family=phi3's)"
        )
    if scaling.type == "longrope":
        _check_longrope(scaling, rd)
    if scaling.type == "yarn":
        _check_yarn(scaling)


def _check_longrope(scaling: RopeScalingConfig, rd: int) -> None:
    for key in ("short_factor", "long_factor"):
        values = getattr(scaling, key)
        if len(values) != rd // 2 or not all(v > 0 for v in values):
            raise ConfigError(
                f"model.rope_scaling.{key} must hold {rd // 2} positive factors (one per "
                f"frequency of the {rd} rotated dims), got {len(values)}"
            )
    _check_context(scaling)


def _check_context(scaling: RopeScalingConfig) -> None:
    factor = scaling.attention_factor
    if (factor is not None and factor <= 0) or scaling.original_max_seq_len < 1:
        raise ConfigError(
            "model.rope_scaling.attention_factor (or null) and original_max_seq_len must be "
            f"positive, got {factor} and {scaling.original_max_seq_len}"
        )


def _check_yarn(scaling: RopeScalingConfig) -> None:
    _check_context(scaling)
    if not scaling.beta_fast >= scaling.beta_slow > 0:
        raise ConfigError(
            "model.rope_scaling needs beta_fast >= beta_slow > 0 (the rotations that bound "
            f"YaRN's blended band), got beta_fast={scaling.beta_fast}, "
            f"beta_slow={scaling.beta_slow}"
        )
    for key in ("mscale", "mscale_all_dim"):
        value = getattr(scaling, key)
        if value is not None and not value > 0:
            raise ConfigError(f"model.rope_scaling.{key}={value!r} must be positive or null")


def check_nope_layers(config: ModelConfig) -> None:
    """Refuse a ``model.nope_layers`` that is not layer indices in increasing order, in
    one line naming the key."""
    layers = config.nope_layers
    if not is_layer_list(layers, config.n_layers):
        raise ConfigError(
            f"model.nope_layers={layers!r} must list layers without RoPE, in increasing "
            f"order, each in 0..{config.n_layers - 1} (model.n_layers={config.n_layers})"
        )
