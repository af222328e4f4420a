"""Decoding state: the keys and values of past positions, apart from the training forward.

The decoder's forward pass is the same with or without a cache; given one, each layer
hands its new keys and values to :meth:`LayerCache.attend`, which writes them at their
positions and attends over every cached position with SDPA (whatever the training
kernel: decoding needs no document mask). New tokens take RoPE positions after the
cached ones, so each generated token costs one position's forward pass.

A layer of multi-head latent attention (``model.mla_kv_rank``) holds, in the same two
buffers, its tokens' latents (``(B, 1, S, r)``) and rotated shared keys (``(B, 1, S, rd)``)
instead of every head's keys and values (:mod:`recipes_lib.models.latent_attention`).

A linear-attention layer (``model.linear_layers``, :mod:`recipes_lib.models.
linear_attention`) keeps no keys: its decoding state is the last ``K - 1`` inputs of its
convolution and its recurrent ``(H, dk, dv)`` state (:class:`RecurrentCache`), which only
move forward: a forward pass continues them from the cache's length, or starts them
afresh from position 0.

Shapes: B batch, nh query heads, nkv key/value heads, T new tokens, S positions held,
hs head dim; D convolution channels, K its width, H value heads, dk/dv their key/value dims.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from recipes_lib.errors import ConfigError
from recipes_lib.kernels.attention import sdpa_with_sinks


def padded_offset_mask(mask: Tensor | None, key_mask: Tensor, n_new: int, start_pos: int) -> Tensor:
    """``mask`` (``(T, S')`` or None: all keys) limited, row by row, to the keys
    ``key_mask`` (``(B, S')`` bool) marks real: ``(B, 1, T, S')``. A padding query still
    sees itself, so no row of the softmax is empty (its output is never used)."""
    end = start_pos + n_new
    keys = key_mask[:, None, None, :end]  # (B, 1, 1, S')
    own = (
        torch.arange(end, device=keys.device)
        == torch.arange(start_pos, end, device=keys.device)[:, None]
    )
    seen = keys if mask is None else keys & mask
    return seen | own  # (B, 1, T, S')


def causal_offset_mask(
    n_new: int, start_pos: int, device=None, window: int | None = None
) -> Tensor:
    """Which keys each new token sees, ``(T, start_pos + T)`` bool.

    New token ``i`` sits at position ``start_pos + i`` and sees every key ``j`` with
    ``j <= start_pos + i`` (and, with ``window``, ``start_pos + i - j < window``).
    """
    key_pos = torch.arange(start_pos + n_new, device=device)  # (start_pos + T,)
    query_pos = torch.arange(start_pos, start_pos + n_new, device=device)  # (T,)
    seen = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        seen &= query_pos[:, None] - key_pos[None, :] < window
    return seen


@dataclass
class LayerCache:
    """One layer's cached keys and values, and where the new tokens go."""

    keys: Tensor  # (B, nkv, S, hs)
    values: Tensor  # (B, nkv, S, hs)
    start_pos: int

    def write(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write ``k``/``v`` (``(B, nkv, T, hs)``) at ``start_pos``; return the keys and
        values of positions ``0 .. start_pos + T`` (``(B, nkv, start_pos + T, hs)``)."""
        B, T = k.shape[0], k.shape[2]
        end = self.start_pos + T
        self.keys[:B, :, self.start_pos : end] = k
        self.values[:B, :, self.start_pos : end] = v
        return self.keys[:B, :, :end], self.values[:B, :, :end]

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        scale: float | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """Write ``k``/``v`` (``(B, nkv, T, hs)``) at ``start_pos`` and attend ``q``
        (``(B, nh, T, hs)``) over positions ``0 .. start_pos + T`` under ``mask`` (None for
        a single token, which sees every cached position), with softmax scale ``scale``
        (None: ``1 / sqrt(hs)``) and ``sinks`` (``(nh,)``, a logit per head with no
        value; None: none). Returns ``(B, nh, T, hs)``."""
        keys, values = self.write(k, v)  # (B, nkv, end, hs)
        return cached_attention(q, keys, values, mask, scale, sinks)


def cached_attention(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    mask: Tensor | None,
    scale: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """SDPA of new queries ``(B, nh, T, hs)`` over every cached position's keys and
    values (``(B, nkv, S, hs)``; values may be narrower), as :meth:`LayerCache.attend`."""
    if sinks is not None:
        return sdpa_with_sinks(q, keys, values, mask, sinks, scale)
    gqa = keys.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, enable_gqa=gqa, scale=scale
    )


@dataclass
class RecurrentCache:
    """One linear-attention layer's decoding state, and where the new tokens go."""

    conv: Tensor  # (B, D, K - 1): the convolution's last inputs
    state: Tensor  # (B, H, dk, dv) float32: the gated delta rule's state
    start_pos: int
    key_mask: Tensor | None  # (B, S): the cache's real positions, or None: all

    def masked(self, x: Tensor) -> Tensor:
        """``x`` ``(B, T, C)`` with the padding positions zeroed: a left-padded row's
        state stays empty until its first token, as if it had no padding."""
        if self.key_mask is None:
            return x
        B, T = x.shape[:2]
        keep = self.key_mask[:B, self.start_pos : self.start_pos + T]  # (B, T)
        return x * keep[..., None].to(x.dtype)


class KVCache:
    """Keys and values of past positions for every layer, preallocated for decoding.

    ``keys[i]`` and ``values[i]`` are ``(B, nkv, S, hs)`` buffers of layer ``i``;
    ``length`` counts the positions filled so far, where the next forward pass with
    this cache writes by default. Build one with :meth:`for_model`.

    ``key_mask`` (``(B, S)`` bool, or None: every position) says which cached positions
    hold a row's real tokens: rows of different lengths decode together left-padded,
    each attending over its own tokens only (RoPE sees relative positions, so a row's
    shift by its padding changes nothing). Set it before a forward pass writes the
    positions it describes (:func:`recipes_lib.models.sampling.sample_completions`).
    """

    def __init__(
        self,
        n_layers: int,
        batch_size: int,
        n_kv_heads: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        value_dim: int | None = None,
        keyless: Collection[int] = (),
    ):
        # the layers in keyless (linear attention's) hold empty (B, nkv, S, 0) buffers
        # from the start: allocating theirs first would hold a whole model's cache at once
        def buffers(width: int) -> list[Tensor]:
            return [
                torch.zeros(
                    (batch_size, n_kv_heads, max_len, 0 if i in keyless else width),
                    dtype=dtype,
                    device=device,
                )
                for i in range(n_layers)
            ]

        self.keys = buffers(head_dim)  # (B, nkv, S, hs)
        self.values = buffers(head_dim if value_dim is None else value_dim)
        self.length = 0
        self.key_mask: Tensor | None = None  # (B, S): positions holding real tokens
        self.conv: dict[int, Tensor] = {}  # (B, D, K - 1) per linear-attention layer
        self.states: dict[int, Tensor] = {}  # (B, H, dk, dv) float32 per such layer

    @classmethod
    def for_model(cls, model, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        """A cache for a :class:`~recipes_lib.models.Transformer`, in its dtype and on
        its device.

        Args:
            model: the decoder it caches for.
            batch_size: rows decoded together.
            max_len: positions to hold (prompt plus new tokens); default
                ``model.max_seq_len``.

        Raises:
            ConfigError: ``max_len`` exceeds ``model.max_seq_len``.
        """
        c = model.config
        max_len = c.max_seq_len if max_len is None else max_len
        if not 0 < max_len <= c.max_seq_len:
            raise ConfigError(
                f"a KV cache of {max_len} positions does not fit model.max_seq_len={c.max_seq_len}"
            )
        weight = model.tok_embeddings.weight
        heads, key_dim, value_dim = c.n_kv_heads or c.n_heads, model.head_dim, model.head_dim
        if c.mla_kv_rank is not None:  # a latent and a rotated key per token, for all heads
            heads, key_dim, value_dim = 1, c.mla_kv_rank, c.mla_rope_dim
        cache = cls(
            c.n_layers,
            batch_size,
            heads,
            max_len,
            key_dim,
            dtype=weight.dtype,
            device=weight.device,
            value_dim=value_dim,
            keyless=c.linear_layers,
        )
        if c.linear_layers:  # their state in place of keys and values
            channels = 2 * c.linear_key_heads * c.linear_key_dim
            channels += c.linear_heads * c.linear_value_dim
            conv = (channels, c.linear_conv_kernel - 1)
            state = (c.linear_heads, c.linear_key_dim, c.linear_value_dim)
            cache.add_recurrent(list(c.linear_layers), conv, state)
        return cache

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2]

    def add_recurrent(
        self, layers: list[int], conv: tuple[int, int], state: tuple[int, int, int]
    ) -> None:
        """Hold the decoding state of linear-attention ``layers`` (``conv``: ``(D, K - 1)``,
        ``state``: ``(H, dk, dv)``) in place of their keys and values, which become
        empty ``(B, nkv, S, 0)`` tensors: no memory, the same batch and length."""
        for layer in layers:
            keys = self.keys[layer]
            B, heads, S = keys.shape[:3]
            self.keys[layer] = keys.new_zeros(B, heads, S, 0)
            self.values[layer] = keys.new_zeros(B, heads, S, 0)
            self.conv[layer] = keys.new_zeros(B, *conv)
            self.states[layer] = keys.new_zeros(B, *state, dtype=torch.float32)

    def layer(self, index: int, start_pos: int) -> LayerCache | RecurrentCache:
        """Layer ``index``'s cache, writing new tokens from ``start_pos``.

        Raises:
            ValueError: a linear-attention layer asked to rewind (``0 < start_pos <
                length``): its state cannot forget the later positions.
        """
        if index not in self.states:
            return LayerCache(self.keys[index], self.values[index], start_pos)
        if start_pos == 0:  # afresh
            self.conv[index].zero_()
            self.states[index].zero_()
        elif start_pos != self.length:
            raise ValueError(
                f"start_pos={start_pos}: a linear-attention layer's state continues from "
                f"the cache's length ({self.length}) or starts afresh at 0, never rewinds"
            )
        return RecurrentCache(self.conv[index], self.states[index], start_pos, self.key_mask)

    def reset(self) -> None:
        """Forget every cached position (the buffers are reused)."""
        self.length = 0
        for tensor in (*self.conv.values(), *self.states.values()):
            tensor.zero_()
