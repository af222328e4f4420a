"""The decoder's norm options beyond Llama's pre-norm blocks: where a block's two norms
sit (``model.norm_placement``) and a norm on the queries and keys (``model.qk_norm``).

- ``norm_placement``: ``pre`` normalises each sublayer's input (Llama, Qwen); ``post``
  normalises its output before the residual add (OLMo 2); ``both`` does both, with two
  more norms (``post_attention_norm``, ``post_ffn_norm``: Gemma 3). The two norms keep their
  names (``attention_norm``, ``ffn_norm``) either way.
- ``qk_norm``: ``none``; ``head`` normalises each head's ``hs`` query and key values
  with one gain of ``hs`` shared by the heads (Qwen3); ``full`` normalises the whole
  projection, all heads together, with a gain of ``nh * hs`` (``nkv * hs`` for the
  keys) (OLMo 2). ``Attention`` applies them (``attention.q_norm``, ``attention.k_norm``)
  before RoPE, so the attention kernels and the KV cache see ordinary queries and keys.

Shapes: B batch, T sequence length, nh query heads, nkv key/value heads, hs head dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from recipes_lib.errors import ConfigError

if TYPE_CHECKING:
    from recipes_lib.config.schema import ModelConfig

QK_NORMS = ("none", "head", "full")
NORM_PLACEMENTS = ("pre", "post", "both")
ACTIVATIONS = ("silu", "gelu_tanh", "clamped_swiglu")  # SwiGLU, GeGLU, gpt-oss's


def check_norm_options(config: ModelConfig) -> None:
    """Refuse a ``model.qk_norm``, ``model.norm_placement`` or ``model.activation`` that
    is not one of its values, in one line naming the key."""
    options = (("qk_norm", QK_NORMS), ("norm_placement", NORM_PLACEMENTS))
    for key, choices in (*options, ("activation", ACTIVATIONS)):
        value = getattr(config, key)
        if value not in choices:
            raise ConfigError(f"model.{key}={value!r} is not one of {' | '.join(choices)}")


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` whose gain follows its input's dtype.

    The norms this module adds read a projection's output, which is bfloat16 under
    autocast while the gain stays float32; with the gain cast, the fused kernel still
    applies. With matching dtypes it is ``nn.RMSNorm`` itself.
    """

    def forward(self, x: Tensor) -> Tensor:
        weight: Tensor | None = self.weight
        if weight is not None and weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


class OffsetRMSNorm(nn.RMSNorm):
    """RMSNorm computing ``x * (offset + w)`` in float32 from a stored gain ``w``, cast
    back to the input's dtype (Gemma's ``(1 + w)`` norms, ``model.norm_gain_offset``).

    The gain is the checkpoint's own tensor: ``1 + w`` held in bfloat16 would be
    rounded to steps of 2**-7, where the sum in float32 is not.
    """

    def __init__(self, dim: int, eps: float, offset: float):
        super().__init__(dim, eps=eps)
        self.offset = offset

    def forward(self, x: Tensor) -> Tensor:
        gain = self.weight.float() + self.offset
        return F.rms_norm(x.float(), self.normalized_shape, gain, self.eps).to(x.dtype)


def make_norm(config: ModelConfig, dim: int, *, follows_input: bool = False) -> nn.RMSNorm:
    """A norm of ``dim`` for ``config``: :class:`OffsetRMSNorm` with a gain offset, else
    :class:`RMSNorm` where it reads a sublayer's (bfloat16) output (``follows_input``),
    else ``nn.RMSNorm``."""
    if config.norm_gain_offset:
        return OffsetRMSNorm(dim, config.norm_eps, config.norm_gain_offset)
    return (RMSNorm if follows_input else nn.RMSNorm)(dim, eps=config.norm_eps)


def qk_norm_sizes(mode: str, n_heads: int, n_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """The gains' sizes of the query and key norms of ``model.qk_norm`` ``mode`` (not none)."""
    if mode == "full":
        return n_heads * head_dim, n_kv_heads * head_dim
    return head_dim, head_dim
