"""Multi-head latent attention (MLA: DeepSeek-V2 and V3), the attention of a layer when
``model.mla_kv_rank`` is set.

Each token's keys and values come from one small latent: ``wkv_a`` projects the token
to ``mla_kv_rank`` latent dims (normed by ``kv_norm``) and ``mla_rope_dim`` more, one
key part that RoPE rotates and every head shares; ``wkv_b`` expands the latent into
each head's unrotated key part and its value. The queries come from a latent of
``mla_q_rank`` (``wq_a``, ``q_norm``, ``wq_b``) or, without it, from one projection
(``wq``). A head's query and key are ``head_dim`` wide: ``head_dim - mla_rope_dim``
unrotated dims, then the rotated ones; its value is ``v_head_dim`` wide.

Decoding caches what MLA is for: per token, the normed latent and the rotated shared
key (``mla_kv_rank + mla_rope_dim`` numbers per layer instead of keys and values for
every head), expanded through ``wkv_b`` when attended.

The softmax scale is ``1 / sqrt(head_dim)`` times, with YaRN and its
``mscale_all_dim``, the square of YaRN's ``0.1 * mscale_all_dim * ln(factor) + 1``
(how transformers' DeepSeek-V3 scales it). ``model.rope_interleave`` takes the rotated
dims as adjacent pairs: they are put in halves first, after which RoPE is the usual
rotate-half one. An attention kernel that needs values as wide as the keys gets both
padded with zeros to the wider width, and the padding's part of the output is sliced
off.

Shapes: B batch, T new tokens, S positions attended, C model dim, nh heads, hs query and
key width, vd value width, r latent width, rd rotated dims.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from recipes_lib.errors import ConfigError
from recipes_lib.kernels import AttentionBackend
from recipes_lib.models.kv_cache import LayerCache, cached_attention
from recipes_lib.models.norms import RMSNorm
from recipes_lib.models.rope import apply_rope

if TYPE_CHECKING:
    from recipes_lib.config.schema import ModelConfig

# the latents' norms use this epsilon whatever model.norm_eps (as transformers builds them)
LATENT_NORM_EPS = 1e-6


def latent_softmax_scale(config: ModelConfig, head_dim: int) -> float:
    """``1 / sqrt(head_dim)``, times YaRN's ``mscale_all_dim`` factor squared."""
    scale = 1.0 / math.sqrt(head_dim)
    scaling = config.rope_scaling
    if scaling.type == "yarn" and scaling.mscale_all_dim and scaling.factor > 1:
        mscale = 0.1 * scaling.mscale_all_dim * math.log(scaling.factor) + 1.0
        scale *= mscale * mscale
    return scale


def to_halves(x: Tensor) -> Tensor:
    """Adjacent pairs ``(x0, x1), (x2, x3), ...`` -> the even dims, then the odd ones:
    rotate-half RoPE of the result is the pairwise rotation of ``x``."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class LatentAttention(nn.Module):
    """Multi-head latent attention of one layer; the kernel is a pluggable backend."""

    def __init__(self, config: ModelConfig, head_dim: int, backend: AttentionBackend, layer: int):
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, head_dim
        self.kv_rank = cast(int, config.mla_kv_rank)
        self.rope_dim = config.mla_rope_dim
        self.nope_dim = head_dim - self.rope_dim
        self.v_dim = config.v_head_dim or head_dim
        self.interleave = config.rope_interleave
        bias, width = config.qkv_bias, self.n_heads * head_dim
        self.wq: nn.Linear | None = None
        self.wq_a: nn.Linear | None = None
        self.wq_b: nn.Linear | None = None
        if config.mla_q_rank is None:
            self.wq = nn.Linear(config.dim, width, bias=False)
        else:
            self.wq_a = nn.Linear(config.dim, config.mla_q_rank, bias=bias)
            self.q_norm = RMSNorm(config.mla_q_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(config.mla_q_rank, width, bias=False)
        self.wkv_a = nn.Linear(config.dim, self.kv_rank + self.rope_dim, bias=bias)
        self.kv_norm = RMSNorm(self.kv_rank, eps=LATENT_NORM_EPS)
        expanded = self.n_heads * (self.nope_dim + self.v_dim)
        self.wkv_b = nn.Linear(self.kv_rank, expanded, bias=False)
        self.wo = nn.Linear(self.n_heads * self.v_dim, config.dim, bias=config.attention_out_bias)
        self.scale = latent_softmax_scale(config, head_dim)
        # what Transformer and TransformerBlock read of every attention
        self.sinks = None
        self.window = None
        self.local_rope = False
        self.backend = backend  # a plain object, not a submodule: it holds no weights

    def input_projections(self) -> list[nn.Linear]:
        """The projections reading the block's input or a latent (initialised alike)."""
        found = [self.wq] if self.wq is not None else [self.wq_a, self.wq_b]
        return [*cast(list[nn.Linear], found), self.wkv_a, self.wkv_b]

    def norms(self) -> list[nn.RMSNorm]:
        """The latents' norms."""
        return [self.q_norm, self.kv_norm] if self.wq is None else [self.kv_norm]

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: object | None,
        cache: LayerCache | None = None,
    ) -> Tensor:
        """Attention of ``x`` (``(B, T, C)``); with ``cache``, the tokens continue the
        cached ones, whose latents and rotated keys it holds."""
        B, T, _ = x.shape
        if self.wq is not None:
            q = self.wq(x)
        else:
            q = cast(nn.Linear, self.wq_b)(self.q_norm(cast(nn.Linear, self.wq_a)(x)))
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        latent = self.kv_norm(latent)  # (B, T, r)
        k_rope = k_rope.unsqueeze(1)  # (B, 1, T, rd): one key part for every head
        if self.interleave:
            q_rope, k_rope = to_halves(q_rope), to_halves(k_rope)
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)  # (B, nh, T, hs)
        k_rope = apply_rope(k_rope, cos, sin)
        if cache is None:
            k, v = self._expand(latent, k_rope)  # (B, nh, T, hs), (B, nh, T, vd)
            y = self._attend(q, k, v, mask)
        else:  # the latents and rotated keys of every cached position
            # a cache's mask is a boolean tensor or None (Transformer._mask)
            latents, k_ropes = cache.write(latent.unsqueeze(1), k_rope)
            k, v = self._expand(latents.squeeze(1), k_ropes)  # (B, nh, S, hs), (B, nh, S, vd)
            y = cached_attention(q, k, v, cast("Tensor | None", mask), self.scale)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.v_dim)  # (B, T, nh * vd)
        return self.wo(y)  # (B, T, C)

    def _expand(self, latent: Tensor, k_rope: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of every head from the latents ``(B, S, r)`` and the shared
        rotated keys ``(B, 1, S, rd)``."""
        B, S, _ = latent.shape
        kv = self.wkv_b(latent).view(B, S, self.n_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope_dim, self.v_dim], dim=-1)
        k_rope = k_rope.to(k_nope.dtype).expand(-1, self.n_heads, -1, -1)
        return torch.cat([k_nope, k_rope], dim=-1), v

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: object | None) -> Tensor:
        """The training kernel's attention. A kernel that needs values as wide as the
        keys (``capabilities.value_width`` false) gets both padded with zeros to the
        wider of the two, which changes no product (the scale is explicit), and the
        output's padding is sliced off."""
        if self.v_dim == self.head_dim or self.backend.capabilities.value_width:
            return self.backend(q, k, v, mask, scale=self.scale)  # (B, nh, T, vd)
        width = max(self.head_dim, self.v_dim)
        q, k, v = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
        return self.backend(q, k, v, mask, scale=self.scale)[..., : self.v_dim]


def check_latent(config: ModelConfig, head_dim: int) -> None:
    """Refuse latent-attention widths that do not fit together, in one line naming the
    keys (nothing to check without ``model.mla_kv_rank``)."""
    if config.mla_kv_rank is None:
        return
    rope, ranks = config.mla_rope_dim, (config.mla_kv_rank, config.mla_q_rank or 1)
    if not all(isinstance(r, int) and r >= 1 for r in ranks):
        raise ConfigError(
            f"model.mla_kv_rank={config.mla_kv_rank!r} and model.mla_q_rank="
            f"{config.mla_q_rank!r} must be positive widths (mla_q_rank may be null)"
        )
    if not (isinstance(rope, int) and rope >= 2 and rope % 2 == 0 and rope < head_dim):
        raise ConfigError(
            f"model.mla_rope_dim={rope!r} must be an even number of rotated dims below the "
            f"query/key width model.head_dim={head_dim}"
        )
    if config.v_head_dim is not None and config.v_head_dim < 1:
        raise ConfigError(f"model.v_head_dim={config.v_head_dim} must be positive or null")
    if (config.n_kv_heads or config.n_heads) != config.n_heads:
        raise ConfigError(
            f"model.n_kv_heads={config.n_kv_heads} with model.mla_kv_rank: latent attention "
            f"expands keys and values for every query head (n_kv_heads = n_heads = "
            f"{config.n_heads})"
        )
