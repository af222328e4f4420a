"""One decoding step with static shapes, replayed as a CUDA graph.

Decoding a batch token by token costs little GPU time per step (one token per row) but
hundreds of kernel launches, so a small model's sampling is bound by the launches.
:class:`GraphedDecoder` runs the decoder's own blocks for one new token per row over
the whole preallocated :class:`~recipes_lib.models.kv_cache.KVCache` (its ``key_mask``
hides the positions not yet written), with the position as a tensor: every step has
the same shapes and addresses, so it is captured once as a CUDA graph and replayed.
The step's arithmetic is the eager one's (same blocks, same order); attending over
masked positions adds only zeros.

It applies where a graph can hold the whole step: a model on one CUDA device, not
sharded, without mixture-of-experts layers (their routing sizes vary) and without
longrope; :func:`graphable` says so, and sampling falls back to the eager step
otherwise. On a CPU the same static step runs eagerly (what the tests compare).

Shapes: B rows, S cached positions, C model dim, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from recipes_lib.models.kv_cache import KVCache
from recipes_lib.models.moe import MoEFeedForward
from recipes_lib.models.rope import LOCAL_TABLES
from recipes_lib.models.transformer import Transformer


class _StaticLayerCache:
    """A layer's cache written at a position given as a tensor, attended in full."""

    def __init__(self, keys: Tensor, values: Tensor, position: Tensor):
        self.keys, self.values, self.position = keys, values, position

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None = None
    ) -> Tensor:
        # (B, nkv, S, hs) at the new position, in the cache's dtype (as the eager
        # cache's assignment casts: autocast computes them in a lower one)
        self.keys.index_copy_(2, self.position, k.to(self.keys.dtype))
        self.values.index_copy_(2, self.position, v.to(self.values.dtype))
        gqa = self.keys.shape[1] != q.shape[1]
        return torch.nn.functional.scaled_dot_product_attention(
            q, self.keys, self.values, attn_mask=mask, enable_gqa=gqa, scale=scale
        )


def graphable(model: Transformer) -> bool:
    """Whether one decoding step of ``model`` can be captured as a CUDA graph."""
    weight = model.tok_embeddings.weight
    plain = type(weight) is torch.nn.Parameter and type(weight.data) is torch.Tensor
    return (
        weight.device.type == "cuda"
        and plain
        and not any(isinstance(m, MoEFeedForward) for m in model.modules())
        and model.config.rope_scaling.type != "longrope"
        and not model.config.attention_sinks  # its static cache attends without them
        and model.config.mla_kv_rank is None  # its static cache holds keys, not latents
        and not model.config.linear_layers  # their recurrent state decodes step by step
    )


class GraphedDecoder:
    """One token per row through ``model`` with ``cache`` (which already holds the
    prompts, and whose ``key_mask`` is set), as a CUDA graph on CUDA.

    Call :meth:`step` with the new tokens ``(B,)`` and their position (an int): it
    returns the next-token logits ``(B, V)`` (a buffer overwritten by the next step).
    """

    def __init__(self, model: Transformer, cache: KVCache):
        if cache.key_mask is None:
            raise ValueError("a graphed decoder needs the cache's key_mask")
        self.model, self.cache = model, cache
        self.key_mask: Tensor = cache.key_mask  # updated in place by the sampler
        device = model.tok_embeddings.weight.device
        B, S = cache.key_mask.shape
        self.tokens = torch.zeros(B, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.key_positions = torch.arange(S, device=device)
        self.logits: Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.use_graph = device.type == "cuda"

    def _forward(self) -> Tensor:
        model, cache = self.model, self.cache
        position = self.position
        seen = self.key_mask[:, None, None, :]  # (B, 1, 1, S)
        own = (self.key_positions == position)[None, None, None, :]
        masks = {}
        for window in model._windows:
            mask = seen
            if window is not None:
                mask = mask & (position - self.key_positions < window)[None, None, None, :]
            masks[window] = mask | own  # a row that finished still sees its own key
        tables = {}
        for local in model._ropes:
            names = LOCAL_TABLES if local else ("rope_cos", "rope_sin")
            tables[local] = tuple(getattr(model, n).index_select(0, position) for n in names)
        h = model.tok_embeddings(self.tokens)  # (B, 1, C)
        if model.config.scale_embeddings:
            h = h * torch.tensor(model.config.dim**0.5, dtype=h.dtype)
        for index, layer in enumerate(model.blocks):
            layer_cache = _StaticLayerCache(cache.keys[index], cache.values[index], position)
            cos, sin = tables[layer.attention.local_rope]
            h = layer(h, cos, sin, masks[layer.attention.window], layer_cache)
        return model.output(model.norm(h)[:, -1])  # (B, V)

    @torch.no_grad()
    def step(self, tokens: Tensor, position: int) -> Tensor:
        self.tokens.copy_(tokens.view(-1, 1))
        self.position.fill_(position)
        if not self.use_graph:
            return self._forward()
        if self.graph is None or self.logits is None:
            self.graph, self.logits = self._capture()
        self.graph.replay()
        return self.logits

    def _capture(self) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        """Warm up on a side stream, then capture the step. Autocast (a trainer's mixed
        precision) is kept without its cache of cast weights, whose memory would be
        freed under the graph when autocast ends."""
        autocast = torch.is_autocast_enabled("cuda")
        dtype = torch.get_autocast_dtype("cuda")

        def context():
            return torch.autocast("cuda", dtype=dtype, enabled=autocast, cache_enabled=False)

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), context():
            self._forward()  # writes this step's keys and values, as the replay will
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread-local: a data loader's pinning thread may use CUDA meanwhile
        with torch.cuda.graph(graph, capture_error_mode="thread_local"), context():
            logits = self._forward()
        return graph, logits
