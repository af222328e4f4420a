"""The decoder's block: grouped-query attention with RoPE and a gated MLP, each wrapped
in its norms, and the options the model families turn on inside it.

- Attention: q/k/v biases (Qwen2) and one on the output (gpt-oss), a learned sink
  logit per head in each softmax (``model.attention_sinks``: gpt-oss), a norm on the
  queries and keys (``model.qk_norm``: Qwen3, OLMo 2, Gemma 3), layers without RoPE
  (``model.nope_layers``: SmolLM3), a local window (``model.window_layers`` attend to
  the last ``model.sliding_window`` keys: Gemma 3) and the softmax scale
  ``1 / sqrt(model.query_pre_attn_scalar)`` (Gemma).
- MLP: ``w2(act(w1 x) * w3 x)`` with ``act`` SiLU (SwiGLU) or the tanh-approximated GELU
  (GeGLU: ``model.activation=gelu_tanh``, Gemma); or, in a mixture of experts, routed
  experts of that form (:mod:`recipes_lib.models.moe`); gpt-oss's clamped SwiGLU.
- Linear attention in place of attention in the layers of ``model.linear_layers``
  (Qwen3.5's Gated DeltaNet: :mod:`recipes_lib.models.linear_attention`), and an output
  gate on attention (``model.attention_output_gate``: ``wq`` also makes, per head, a gate
  whose sigmoid scales the head's output before ``wo``; Qwen3.5).
- Multi-head latent attention in place of attention with ``model.mla_kv_rank``
  (DeepSeek-V3: keys and values from a per-token latent,
  :mod:`recipes_lib.models.latent_attention`).
- Norms (``model.norm_placement``): ``pre`` on each sublayer's input (Llama), ``post``
  on its output before the residual add (OLMo 2), ``both`` (Gemma 3).

Parameter names follow Meta's Llama code (``attention.wq``, ``feed_forward.w1``, ...).

Shapes: B batch, T sequence length, C model dim, nh query heads, nkv key/value heads,
hs head dim.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, cast

import torch
import torch.nn as nn
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from recipes_lib.kernels import AttentionBackend
from recipes_lib.models.kv_cache import LayerCache, RecurrentCache
from recipes_lib.models.latent_attention import LatentAttention
from recipes_lib.models.linear_attention import GatedDeltaNet, is_linear_layer
from recipes_lib.models.moe import GatedActivation, MoEFeedForward, gated_mlp, is_moe_layer
from recipes_lib.models.norms import make_norm, qk_norm_sizes
from recipes_lib.models.rope import apply_rope
from recipes_lib.models.windows import layer_window

if TYPE_CHECKING:
    from recipes_lib.config.schema import ModelConfig


class Attention(nn.Module):
    """Grouped-query self-attention of layer ``layer`` with RoPE (unless it is one of
    ``model.nope_layers``), optionally with RMSNorm on the queries and keys before it
    (``model.qk_norm``) and a local window; the kernel is a pluggable backend."""

    def __init__(self, config: ModelConfig, head_dim: int, backend: AttentionBackend, layer: int):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads or config.n_heads
        self.head_dim = head_dim
        bias = config.qkv_bias
        # with an output gate, each head's query is followed by its gate in wq's output
        self.output_gate = config.attention_output_gate
        q_width = self.n_heads * head_dim * (2 if self.output_gate else 1)
        self.wq = nn.Linear(config.dim, q_width, bias=bias)
        self.wk = nn.Linear(config.dim, self.n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(config.dim, self.n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(self.n_heads * head_dim, config.dim, bias=config.attention_out_bias)
        # a logit per query head in the softmax's denominator, with no value (gpt-oss)
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if config.attention_sinks else None
        self.qk_norm = config.qk_norm
        if self.qk_norm != "none":
            sizes = qk_norm_sizes(self.qk_norm, self.n_heads, self.n_kv_heads, head_dim)
            self.q_norm = make_norm(config, sizes[0], follows_input=True)
            self.k_norm = make_norm(config, sizes[1], follows_input=True)
        self.use_rope = layer not in config.nope_layers
        # the keys a query sees: its own and window - 1 before it; None: every earlier one
        self.window = layer_window(config, layer)
        # a window layer rotates with its own unscaled base (model.local_rope_theta)
        self.local_rope = self.window is not None and config.local_rope_theta is not None
        scalar = config.query_pre_attn_scalar
        self.scale = None if scalar is None else 1.0 / math.sqrt(scalar)  # None: 1/sqrt(hs)
        self.backend = backend  # a plain object, not a submodule: it holds no weights

    def input_projections(self) -> list[nn.Linear]:
        """The projections reading the block's input (initialised alike)."""
        return [self.wq, self.wk, self.wv]

    def norms(self) -> list[nn.RMSNorm]:
        """The query and key norms, if any."""
        return [self.q_norm, self.k_norm] if self.qk_norm != "none" else []

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: object | None,
        cache: LayerCache | None = None,
    ) -> Tensor:
        """Attention of ``x`` (``(B, T, C)``); with ``cache``, the tokens continue the
        cached ones and attend over them (see :mod:`recipes_lib.models.kv_cache`)."""
        B, T, _ = x.shape
        q, k = self.wq(x), self.wk(x)  # (B, T, nh * hs), (B, T, nkv * hs)
        gate = None
        if self.output_gate:  # (B, T, nh, 2 * hs): each head's query, then its gate
            q, gate = q.view(B, T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(B, T, -1), gate.reshape(B, T, -1)  # (B, T, nh * hs) each
        if self.qk_norm == "full":  # over every head at once
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.n_heads, self.head_dim)  # (B, T, nh, hs)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, nkv, hs)
        if self.qk_norm == "head":  # each head on its own
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, nh, T, hs), (B, nkv, T, hs)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        if self.use_rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # a backend without sinks is refused when the model is built (Transformer)
        sinks = {} if self.sinks is None else {"sinks": self.sinks}
        if cache is None:
            y = self.backend(q, k, v, mask, scale=self.scale, **sinks)  # (B, nh, T, hs)
        else:  # over every cached position
            # a cache's mask is a boolean tensor or None (Transformer._mask)
            y = cache.attend(q, k, v, cast("Tensor | None", mask), scale=self.scale, **sinks)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, nh * hs)
        if gate is not None:
            y = y * torch.sigmoid(gate)
        return self.wo(y)  # (B, T, C)


class FeedForward(nn.Module):
    """Gated MLP: ``w2(act(w1 x) * w3 x)``, ``act`` SiLU (SwiGLU) or the tanh GELU (GeGLU)
    (or gpt-oss's clamped SwiGLU: :class:`~recipes_lib.models.moe.GatedActivation`)."""

    def __init__(self, dim: int, hidden_dim: int, activation: str | GatedActivation = "silu"):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)  # down
        self.activation = activation

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(gated_mlp(self.w1(x), self.w3(x), self.activation))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; with
    ``model.norm_placement=post``: ``x + norm(attn(x))``, then ``x + norm(mlp(x))``; with
    ``both``: ``x + post_norm(attn(norm(x)))``, then the same around the MLP."""

    def __init__(self, config: ModelConfig, head_dim: int, backend: AttentionBackend, layer: int):
        super().__init__()
        self.placement = config.norm_placement
        # a sublayer's output is bfloat16 under autocast: a norm there follows its dtype
        post = self.placement == "post"
        self.attention_norm = make_norm(config, config.dim, follows_input=post)
        # the token mixer: linear attention in model.linear_layers (Qwen3.5), multi-head
        # latent attention with model.mla_kv_rank (DeepSeek-V3), else attention
        self.linear = is_linear_layer(config, layer)
        latent = config.mla_kv_rank is not None
        self.attention: Attention | LatentAttention | GatedDeltaNet
        if self.linear:
            self.attention = GatedDeltaNet(config)
        else:
            mixer = LatentAttention if latent else Attention
            self.attention = mixer(config, head_dim, backend, layer)
        self.ffn_norm = make_norm(config, config.dim, follows_input=post)
        self.routed = is_moe_layer(config, layer)
        self.feed_forward: MoEFeedForward | FeedForward
        if self.routed:  # experts in place of the MLP
            self.feed_forward = MoEFeedForward(config, FeedForward)
        else:
            activation = GatedActivation.of(config)
            self.feed_forward = FeedForward(config.dim, config.ffn_dim, activation)
        if self.placement == "both":  # the output norms, beside the input ones
            self.post_attention_norm = make_norm(config, config.dim, follows_input=True)
            self.post_ffn_norm = make_norm(config, config.dim, follows_input=True)
        # recompute this block's activations in the backward pass instead of keeping them
        self.checkpoint_activations = False

    def norms(self) -> list[nn.RMSNorm]:
        """Every RMSNorm of the block."""
        found = [self.attention_norm, self.ffn_norm]
        if self.placement == "both":
            found += [self.post_attention_norm, self.post_ffn_norm]
        return found + self.attention.norms()

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: object | None,
        cache: LayerCache | None = None,
        token_mask: Tensor | None = None,
    ) -> Tensor:
        """``token_mask`` (``(B, T)``, True where a token counts; None: all) reaches a
        mixture's router bookkeeping: padding moves no balance loss or count."""
        if self.checkpoint_activations and torch.is_grad_enabled():
            # inside forward, so hooks on the block (FSDP's all-gather) run once per call
            return checkpoint(
                self._forward, x, cos, sin, mask, cache, token_mask, use_reentrant=False
            )
        return self._forward(x, cos, sin, mask, cache, token_mask)

    def _forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: object | None,
        cache: LayerCache | RecurrentCache | None,
        token_mask: Tensor | None,
    ) -> Tensor:
        if self.placement == "post":
            x = x + self.attention_norm(self.attention(x, cos, sin, mask, cache))  # (B, T, C)
            return x + self.ffn_norm(self._mlp(x, token_mask))  # (B, T, C)
        h = self.attention(self.attention_norm(x), cos, sin, mask, cache)  # (B, T, C)
        x = x + (self.post_attention_norm(h) if self.placement == "both" else h)
        h = self._mlp(self.ffn_norm(x), token_mask)  # (B, T, C)
        return x + (self.post_ffn_norm(h) if self.placement == "both" else h)

    def _mlp(self, x: Tensor, token_mask: Tensor | None) -> Tensor:
        if self.routed:
            return self.feed_forward(x, token_mask)
        return self.feed_forward(x)
