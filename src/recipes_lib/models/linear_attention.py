"""Linear attention: the Gated DeltaNet token mixer of the layers in ``model.linear_layers``
(Qwen3.5), in place of softmax attention.

A layer's input ``x`` goes through four projections: ``in_qkv`` (queries and keys of
``model.linear_key_heads`` heads of ``model.linear_key_dim``, values of
``model.linear_heads`` heads of ``model.linear_value_dim``), ``in_z`` (the output gate,
one per value dim), ``in_b`` and ``in_a`` (one scalar per value head each). Then:

- ``q, k, v``: a causal depthwise convolution over the last ``model.linear_conv_kernel``
  positions (``conv``, no bias), then SiLU;
- ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)`` (a decay per value
  head and token);
- the gated delta rule's state carries ``k -> v`` associations from token to token and
  is read with ``q`` (:mod:`recipes_lib.kernels.linear_attention`);
- each head's output is RMS-normalised, scaled by ``out_norm``'s gain (a plain gain,
  not the model's ``1 + w``) and by ``silu(z)``, then projected back (``out_proj``).

No RoPE and no attention mask: the documents of packed rows are kept apart by starting
each one's convolution window and state afresh (:class:`~recipes_lib.kernels.
linear_attention.Segments`). Decoding keeps, per layer, the last ``K - 1`` convolution
inputs and the ``(H, dk, dv)`` state (:class:`~recipes_lib.models.kv_cache.RecurrentCache`).

Shapes: B batch, T sequence length, C model dim, H value heads, Hk key heads, dk key dim,
dv value dim, D = 2 * Hk * dk + H * dv the convolution's channels, K its width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from recipes_lib.config.model import is_layer_list
from recipes_lib.errors import ConfigError
from recipes_lib.kernels.linear_attention import Segments, causal_conv, gated_delta_rule, pick_path

if TYPE_CHECKING:
    from recipes_lib.config.schema import ModelConfig
    from recipes_lib.models.kv_cache import RecurrentCache


def check_linear_attention(config: ModelConfig) -> None:
    """Refuse linear-attention options that do not fit together, naming the key."""
    layers = config.linear_layers
    if not is_layer_list(layers, config.n_layers):
        raise ConfigError(
            f"model.linear_layers={layers!r} must list layers in increasing order, each in "
            f"0..{config.n_layers - 1} (model.n_layers={config.n_layers})"
        )
    if not layers:
        return
    for key in ("linear_heads", "linear_key_heads", "linear_key_dim", "linear_value_dim"):
        value = getattr(config, key)
        if not (isinstance(value, int) and value >= 1):
            raise ConfigError(
                f"model.{key}={value!r} must be a positive size with model.linear_layers set"
            )
    if config.linear_heads % config.linear_key_heads:
        raise ConfigError(
            f"model.linear_heads={config.linear_heads} is not a multiple of "
            f"model.linear_key_heads={config.linear_key_heads}"
        )
    if not (isinstance(config.linear_conv_kernel, int) and config.linear_conv_kernel >= 2):
        raise ConfigError(
            f"model.linear_conv_kernel={config.linear_conv_kernel!r} must be at least 2"
        )
    if config.attention_sinks:
        raise ConfigError(
            "model.attention_sinks=true with model.linear_layers: the linear layers "
            "have no softmax to add sinks to"
        )


def is_linear_layer(config: ModelConfig, layer: int) -> bool:
    """Whether layer ``layer`` mixes tokens with linear attention."""
    return layer in config.linear_layers


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output times a gain, then times ``silu(gate)``; the norm in
    float32, the gain applied in the input's dtype, as transformers computes it."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * normed.to(x.dtype)
        return (y * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """The linear-attention mixer of one layer (see the module docstring).

    It stands where :class:`~recipes_lib.models.blocks.Attention` does and takes the same
    call; ``mask`` is the rows' :class:`Segments` (None: each row one document) and
    ``cos``/``sin`` are unused. The attributes the decoder reads from every mixer say it
    has no window, no local RoPE and no sinks.
    """

    window: int | None = None
    local_rope = False
    qk_norm = "none"
    sinks = None

    def __init__(self, config: ModelConfig):
        super().__init__()
        C = config.dim
        self.n_heads, self.n_key_heads = config.linear_heads, config.linear_key_heads
        self.key_dim, self.value_dim = config.linear_key_dim, config.linear_value_dim
        self.key_width = self.n_key_heads * self.key_dim  # Hk * dk
        self.value_width = self.n_heads * self.value_dim  # H * dv
        channels = 2 * self.key_width + self.value_width  # D
        self.in_qkv = nn.Linear(C, channels, bias=False)
        self.in_z = nn.Linear(C, self.value_width, bias=False)
        self.in_b = nn.Linear(C, self.n_heads, bias=False)
        self.in_a = nn.Linear(C, self.n_heads, bias=False)
        # depthwise: weight (D, 1, K), transformers' layout; called through causal_conv
        K = config.linear_conv_kernel
        self.conv = nn.Conv1d(channels, channels, K, groups=channels, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.n_heads))
        self.dt_bias = nn.Parameter(torch.ones(self.n_heads))
        self.out_norm = GatedRMSNorm(self.value_dim, config.norm_eps)
        self.out_proj = nn.Linear(self.value_width, C, bias=False)
        # auto: flash-linear-attention's kernels on CUDA where it imports, else torch
        self.path = "auto"
        self.backend: object | None = None  # the decoder sets every mixer's; unused here

    def norms(self) -> list[nn.RMSNorm]:
        """The block's norms inside the mixer: none (its output norm's gain is plain)."""
        return []

    @torch.no_grad()
    def init_weights(self, std: float, residual_std: float) -> None:
        """Projections from N(0, std) (the output one from N(0, residual_std)), decay
        rates ``A`` uniform in ``[0.01, 16]`` (``A_log`` their log), ``dt_bias`` and the
        output gain one, as transformers initialises them."""
        for linear in (self.in_qkv, self.in_z, self.in_b, self.in_a):
            nn.init.normal_(linear.weight, mean=0.0, std=std)
        nn.init.normal_(self.conv.weight, mean=0.0, std=std)
        nn.init.normal_(self.out_proj.weight, mean=0.0, std=residual_std)
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())
        nn.init.ones_(self.dt_bias)
        nn.init.ones_(self.out_norm.weight)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: object | None,
        cache: RecurrentCache | None = None,
    ) -> Tensor:
        """``(B, T, C)`` -> ``(B, T, C)``; with ``cache`` the tokens continue its state."""
        B, T, _ = x.shape
        segments = mask if isinstance(mask, Segments) else None
        if cache is not None:
            x = cache.masked(x)  # padding leaves the state as it was: empty
        path = pick_path(self.path, x)
        conv_state = None if cache is None else cache.conv[:B]
        mixed, conv_after = causal_conv(
            self.in_qkv(x), self.conv.weight[:, 0], segments, conv_state, path
        )  # (B, T, D)
        q, k, v = mixed.split([self.key_width, self.key_width, self.value_width], dim=-1)
        q = q.view(B, T, self.n_key_heads, self.key_dim)  # (B, T, Hk, dk)
        k = k.view(B, T, self.n_key_heads, self.key_dim)  # (B, T, Hk, dk)
        v = v.view(B, T, self.n_heads, self.value_dim)  # (B, T, H, dv)
        beta = torch.sigmoid(self.in_b(x))  # (B, T, H)
        # decay in float32: exp(A_log) of a bfloat16 A_log would be coarse
        g = -self.A_log.float().exp() * F.softplus(self.in_a(x).float() + self.dt_bias.float())
        state = None if cache is None else cache.state[:B]
        y, state_after = gated_delta_rule(q, k, v, g, beta, segments, state, path)
        if cache is not None and state_after is not None:
            cache.conv[:B] = conv_after
            cache.state[:B] = state_after
        z = self.in_z(x).view(B, T, self.n_heads, self.value_dim)  # (B, T, H, dv)
        y = self.out_norm(y, z).reshape(B, T, self.value_width)  # (B, T, H * dv)
        return self.out_proj(y)  # (B, T, C)

    def flops_per_token(self) -> float:
        """Training FLOPs of the state per token, beyond the projections' (counted with
        the parameters): three ``dk x dv`` products per head (recall, write, read),
        forward and backward."""
        return 18.0 * self.n_heads * self.key_dim * self.value_dim
