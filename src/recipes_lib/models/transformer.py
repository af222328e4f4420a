"""The decoder: token embeddings, a stack of blocks (:mod:`recipes_lib.models.blocks`),
a final RMSNorm and the output head.

Its options are what the model families turn on (:mod:`recipes_lib.models.families`):
the Llama layout, Qwen2's q/k/v biases, tied embeddings, Qwen3's and OLMo 2's norms on
the queries and keys and OLMo 2's post-norm blocks (:mod:`recipes_lib.models.norms`),
SmolLM3's layers without RoPE (``model.nope_layers``), Phi-3's partial rotation and
LongRoPE (:mod:`recipes_lib.models.rope`), Gemma 3's local layers with their own RoPE
base, scaled embeddings, GeGLU and norms on both sides of each sublayer, gpt-oss's
attention sinks and biases and its experts' clamped SwiGLU, DeepSeek-V3's multi-head
latent attention (:mod:`recipes_lib.models.latent_attention`).
Parameter names follow Meta's Llama code (``tok_embeddings``,
``layers.{i}.attention.wq``, ``feed_forward.w1``, ...), so a family's Hugging Face
adapter is a rename table. RoPE uses the rotate-half convention of Hugging Face /
GPT-NeoX (:mod:`recipes_lib.models.rope`).

The forward pass is one path for training and decoding: given a
:class:`~recipes_lib.models.kv_cache.KVCache`, each layer attends over the cached
positions instead of through the training kernel. Each kind of attention layer (local,
global) runs the backend chosen for it (:mod:`recipes_lib.kernels.choice`), and each
kind's mask is built once per batch.

One concept: the decoder as one module, its inputs (masks, RoPE tables, a shard of the
rows, a cache) prepared once per batch for every layer, and what is counted of it
(parameters, FLOPs); the layers' own parts live in their modules.

Shapes: B batch, T sequence length, C model dim, nh query heads, nkv key/value heads,
hs head dim, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
import torch.nn as nn
from torch import Tensor

from recipes_lib.config.model import HEADS, head_tied, head_width
from recipes_lib.errors import ConfigError, UnsupportedKernelError
from recipes_lib.kernels import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    AttentionChoice,
    choose_attention,
    get_attention_backend,
)
from recipes_lib.kernels.compiled import call_block, mark_varying, varying
from recipes_lib.kernels.linear_attention import Segments
from recipes_lib.kernels.offload import ActivationOffload, offloaded
from recipes_lib.kernels.sharded import ContextShard, ShardedAttention
from recipes_lib.models.blocks import FeedForward, TransformerBlock
from recipes_lib.models.families import check_family
from recipes_lib.models.head import OutputHead, head_loss
from recipes_lib.models.kv_cache import KVCache, causal_offset_mask, padded_offset_mask
from recipes_lib.models.latent_attention import check_latent
from recipes_lib.models.linear_attention import GatedDeltaNet, check_linear_attention
from recipes_lib.models.moe import Experts, MoEFeedForward, check_moe
from recipes_lib.models.norms import check_norm_options, make_norm
from recipes_lib.models.rope import check_nope_layers, check_rope, rope_tables, rope_window
from recipes_lib.models.windows import attention_kinds, check_windows

if TYPE_CHECKING:
    from recipes_lib.config.schema import ModelConfig


def context_parallel_refusal(config: ModelConfig) -> str | None:
    """Why context parallelism cannot run ``config``'s attention on a share of each row,
    in one line (None: it can): attention sinks, latent or linear attention."""
    if config.attention_sinks:
        return (
            "context parallelism cannot add attention sinks (model.attention_sinks=true, "
            f"model.family={config.family}): its attention takes none"
        )
    if config.mla_kv_rank is not None:
        return (
            "context parallelism does not shard multi-head latent attention "
            f"(model.mla_kv_rank={config.mla_kv_rank}, model.family={config.family})"
        )
    if config.linear_layers:
        return (
            "context parallelism does not shard linear attention (model.linear_layers="
            f"{list(config.linear_layers)}, model.family={config.family}): "
            "its state runs through every position of a document"
        )
    return None


def _validate(config: ModelConfig) -> int:
    """Check the shape of ``config`` and its family's options; return the head dimension."""
    check_norm_options(config)
    check_nope_layers(config)
    check_windows(config)
    check_moe(config)
    check_linear_attention(config)
    family = check_family(config)
    if config.head not in HEADS:
        raise ConfigError(f"model.head={config.head!r}: choose one of {list(HEADS)}")
    if config.head_dim is None and config.dim % config.n_heads != 0:
        raise ConfigError(
            f"model.dim={config.dim} is not divisible by model.n_heads={config.n_heads}; "
            "change one of them or set model.head_dim"
        )
    head_dim = head_width(config)
    if head_dim % 2 != 0:
        raise ConfigError(f"the head dimension must be even for RoPE, got {head_dim}")
    n_kv_heads = config.n_kv_heads or config.n_heads
    if config.n_heads % n_kv_heads != 0:
        raise ConfigError(
            f"model.n_heads={config.n_heads} is not a multiple of model.n_kv_heads={n_kv_heads}"
        )
    if config.max_seq_len < 1:
        raise ConfigError(f"model.max_seq_len must be positive, got {config.max_seq_len}")
    check_rope(config, head_dim, family.name, family.extended_rope)
    check_latent(config, head_dim)
    return head_dim


def _check_backends(config: ModelConfig, choice: AttentionChoice) -> None:
    """Refuse a backend that cannot do what its layers need (grouped-query attention,
    sinks), in one line naming the key that chose it."""
    n_kv_heads = config.n_kv_heads or config.n_heads
    for kind in choice.kinds:
        backend, key = choice.backends[kind], choice.key(kind)
        if n_kv_heads != config.n_heads and not backend.capabilities.gqa:
            raise UnsupportedKernelError(
                f"{key}={backend.name} does not support grouped-query attention "
                f"(model.n_kv_heads={n_kv_heads} < model.n_heads={config.n_heads})"
            )
        if config.attention_sinks and not backend.capabilities.sinks:
            takes = [
                name
                for name in ATTENTION_BACKENDS
                if get_attention_backend(name).capabilities.sinks
            ]
            raise UnsupportedKernelError(
                f"{key}={backend.name} cannot add attention sinks "
                f"(model.attention_sinks=true, model.family={config.family}); use "
                f"{key}={' | '.join(takes)}"
            )


class Transformer(nn.Module):
    """A decoder-only language model; ``config.family`` names its architecture.

    Args:
        config: the model's shape.
        attention: the backend of every attention layer or its name (``sdpa`` | ``flex``
            | ``flash_attn``), ``auto``, or each kind of layer's
            (:class:`~recipes_lib.kernels.AttentionChoice`: local and global layers may
            run different kernels). A name is chosen for rows without a document mask.
    """

    # Whether the training loss its forward computes from ``labels`` holds terms beyond
    # the cross-entropy of its logits, so a caller may not compute the loss from the
    # logits alone. A native mixture's balance loss is added by the objective instead.
    loss_beyond_logits = False

    def __init__(
        self, config: ModelConfig, attention: str | AttentionBackend | AttentionChoice = "sdpa"
    ):
        super().__init__()
        self.config = config
        self.head_dim = _validate(config)
        if isinstance(attention, str):
            attention = choose_attention(attention)
        elif isinstance(attention, AttentionBackend):
            attention = AttentionChoice.single(attention)
        # the backend of each kind of layer the model has (global, local)
        choice = attention.for_kinds(attention_kinds(config))
        _check_backends(config, choice)
        self.attention_backend = choice
        self.sharded_attention: AttentionChoice | None = None  # set_context_shard
        self.context_shard: ContextShard | None = None  # set_context_shard
        # checkpointed blocks' inputs kept in host memory (kernels.activation_offload)
        self.activation_offload: ActivationOffload | None = None

        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(
            TransformerBlock(config, self.head_dim, choice.for_window(None), i)
            for i in range(config.n_layers)
        )
        self._route_attention(choice)  # each layer to its kind's backend
        # the windows and RoPE tables the layers use (None: full attention; True: local)
        self._windows = {layer.attention.window for layer in self.blocks}
        self._ropes = {layer.attention.local_rope for layer in self.blocks}
        self.norm = make_norm(config, config.dim)
        # a score head: one scalar per position (a reward model)
        outputs = config.vocab_size if config.head == "lm" else 1
        self.output = OutputHead(config.dim, outputs, bias=False)
        if head_tied(config):
            self.output.weight = self.tok_embeddings.weight

        # RoPE tables, derived from the config: not saved in checkpoints, rebuilt by
        # init_weights() (a meta-device build has no values to keep).
        device = self.tok_embeddings.weight.device
        for name, table in rope_tables(config, self.head_dim, device).items():
            self.register_buffer(name, table, persistent=False)  # (max_seq_len, rotated dims)
        self.init_weights()

    @property
    def blocks(self) -> list[TransformerBlock]:
        """``layers``, typed as the blocks they hold (a ModuleList yields plain Modules to
        the type checker)."""
        return cast("list[TransformerBlock]", list(self.layers))

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute each block's activations in the backward pass (less memory, about
        a third more compute) instead of keeping them from the forward pass."""
        for layer in self.blocks:
            layer.checkpoint_activations = enabled

    def set_context_shard(self, shard: ContextShard | None) -> None:
        """Train on one rank's share of each row (context parallelism): the inputs of
        :meth:`forward_hidden` are then ``shard``'s positions of every row, attention
        gathers the others' keys and values, and RoPE and the masks use the global
        positions (:mod:`recipes_lib.kernels.sharded`). None: whole rows again."""
        if shard is not None and (refused := context_parallel_refusal(self.config)):
            raise UnsupportedKernelError(refused)
        sharded = None
        if shard is not None:  # each backend over the shard, kinds that shared one sharing it
            sharded = self.attention_backend.wrapped(lambda inner: ShardedAttention(inner, shard))
        self.sharded_attention = sharded
        self.context_shard = shard
        self._route_attention(sharded or self.attention_backend)

    def _route_attention(self, choice: AttentionChoice) -> None:
        """Give each attention layer its kind's backend: a local layer the backend of
        the layers with a window, a global one the other."""
        for layer in self.blocks:
            if not layer.linear:
                layer.attention.backend = choice.for_window(layer.attention.window)

    def _apply(self, fn, recurse=True):
        # Moving a meta-device build (to_empty) gives each module a new Parameter,
        # which would untie the output head from the embeddings: tie them again.
        super()._apply(fn, recurse)
        if head_tied(self.config):
            self.output.weight = self.tok_embeddings.weight
        return self

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialize every weight; deterministic given the torch seed.

        Linear layers and embeddings draw from N(0, init_std); the projections that
        write into the residual stream (``wo``, ``w2``) use init_std / sqrt(2 * n_layers).
        Biases are zero, norm gains one. Works after ``to_empty()`` of a meta-device build.
        """
        for name, table in rope_tables(self.config, self.head_dim, self.rope_cos.device).items():
            getattr(self, name).copy_(table)
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=std)
        for layer in self.blocks:
            attention, feed_forward = layer.attention, layer.feed_forward
            mlps: list[FeedForward | Experts]
            if isinstance(feed_forward, MoEFeedForward):  # each expert as an MLP
                held = feed_forward.shared  # built from blocks' FeedForward
                shared = [cast(FeedForward, held)] if held is not None else []
                mlps = [feed_forward.experts, *shared]
            else:
                mlps = [feed_forward]
            # the order of the draws is the dense models' since their first release
            if isinstance(attention, GatedDeltaNet):  # its own draws, then the MLP's
                attention.init_weights(std, residual_std)
                inputs, outputs = [], []
            else:
                inputs, outputs = attention.input_projections(), [attention.wo]
            for linear in inputs + [m.w1 for m in mlps] + [m.w3 for m in mlps]:
                nn.init.normal_(linear.weight, mean=0.0, std=std)
                bias = getattr(linear, "bias", None)  # experts have one with model.moe_bias
                if bias is not None:
                    nn.init.zeros_(bias)
            for linear in outputs + [m.w2 for m in mlps]:
                nn.init.normal_(linear.weight, mean=0.0, std=residual_std)
                bias = getattr(linear, "bias", None)
                if bias is not None:
                    nn.init.zeros_(bias)
            if attention.sinks is not None:  # a sink logit of zero in every head
                nn.init.zeros_(attention.sinks)
            if isinstance(layer.feed_forward, MoEFeedForward):
                nn.init.normal_(layer.feed_forward.router.weight, mean=0.0, std=std)
                if layer.feed_forward.shared_gate is not None:
                    nn.init.normal_(layer.feed_forward.shared_gate.weight, mean=0.0, std=std)
                if layer.feed_forward.router.bias is not None:
                    nn.init.zeros_(layer.feed_forward.router.bias)
                if layer.feed_forward.router_kind == "sigmoid":
                    nn.init.zeros_(layer.feed_forward.expert_bias)
            for norm in layer.norms():  # a gain of one: 1 - offset stored
                nn.init.constant_(norm.weight, 1.0 - self.config.norm_gain_offset)
        nn.init.constant_(self.norm.weight, 1.0 - self.config.norm_gain_offset)
        if not head_tied(self.config):
            nn.init.normal_(self.output.weight, mean=0.0, std=std)

    def forward_hidden(
        self,
        input_ids: Tensor,
        doc_ids: Tensor | None = None,
        *,
        cache: KVCache | None = None,
        start_pos: int | None = None,
        token_mask: Tensor | None = None,
    ) -> Tensor:
        """Hidden states after the final norm, ``(B, T, C)``.

        Args:
            input_ids: ``(B, T)`` token ids, ``T <= model.max_seq_len``.
            doc_ids: ``(B, T)`` document ids of packed rows, or None for causal
                attention across each whole row (training only).
            cache: for incremental decoding: the tokens continue the ones the cache
                holds, at RoPE positions ``start_pos ..``; their keys and values are
                written there and they attend over every position before them;
                afterwards ``cache.length`` is ``start_pos + T``. None: training.
            start_pos: with ``cache``, where the tokens start; default ``cache.length``
                (append); smaller values rewind the cache.
            token_mask: ``(B, T)``, True for the tokens a mixture of experts' balance
                loss and load are taken over (not padding); None: every token.

        Raises:
            ConfigError: the input, or the cached positions, run past
                ``model.max_seq_len`` or the cache.
        """
        B, T = input_ids.shape
        if cache is None:
            if start_pos:
                raise ValueError(
                    f"start_pos={start_pos} needs a KV cache holding the earlier tokens"
                )
            if T > self.config.max_seq_len:
                limit = self.config.max_seq_len
                raise ConfigError(f"input of length {T} is longer than model.max_seq_len={limit}")
            if doc_ids is not None and doc_ids.shape != input_ids.shape:
                raise ValueError(
                    f"doc_ids {tuple(doc_ids.shape)} must have the shape of input_ids {(B, T)}"
                )
            start = 0
        else:
            if doc_ids is not None:
                raise ValueError("doc_ids cannot be combined with a KV cache")
            start = cache.length if start_pos is None else start_pos
            self._check_cached(B, T, start, cache)
        end = start + T
        sharded = self.sharded_attention if cache is None else None
        if sharded is not None:  # this rank's positions of rows of sharded.shard.seq_len
            masks, tables = self._sharded_inputs(sharded, doc_ids, T, input_ids.device)
        else:
            # one mask per batch and window, built by that window's kind's backend and
            # shared by the layers with that window
            masks = {w: self._mask(input_ids, doc_ids, start, cache, w) for w in self._windows}
            tables = {local: rope_window(self, start, end, local) for local in self._ropes}
        # where packed rows' documents start: the linear-attention layers start afresh there
        segments = None
        if doc_ids is not None and self.config.linear_layers:
            segments = Segments.of(doc_ids)
        h = self.tok_embeddings(input_ids)  # (B, T, C)
        if self.config.scale_embeddings:  # by sqrt(C) rounded to their dtype, as Gemma's
            h = h * torch.tensor(self.config.dim**0.5, dtype=h.dtype)
        rows_vary = cache is None and varying(self.blocks[0])
        if rows_vary:  # compiled blocks trace the rows dynamic from the first call
            choice = self.attention_backend
            rows = (t for w, m in masks.items() for t in choice.row_tensors(m, w))
            mark_varying(token_mask, *rows)
            if segments is not None:  # the linear layers' documents
                mark_varying(segments.starts, segments.doc)
        for index, layer in enumerate(self.blocks):
            layer_cache = None if cache is None else cache.layer(index, start)
            cos, sin = tables[layer.attention.local_rope]  # (T, rotated dims)
            mask = segments if layer.linear else masks[layer.attention.window]
            if rows_vary:
                mark_varying(h)  # each layer's input is a new tensor
            with offloaded(self.activation_offload, h, layer.checkpoint_activations):
                h = call_block(layer, h, cos, sin, mask, layer_cache, token_mask)  # (B, T, C)
        if cache is not None:
            cache.length = end
        return self.norm(h)  # (B, T, C)

    def _sharded_inputs(
        self, sharded: AttentionChoice, doc_ids: Tensor | None, T: int, device: torch.device
    ) -> tuple[dict[int | None, object], dict[bool, tuple[Tensor, Tensor]]]:
        """The masks and RoPE tables of one rank's share of the rows."""
        # the model's own: a kind of layer the model lacks has no wrapped backend
        shard = self.context_shard
        assert shard is not None  # set with sharded_attention
        if shard.seq_len > self.config.max_seq_len:
            limit = self.config.max_seq_len
            raise ConfigError(f"rows of {shard.seq_len} tokens exceed model.max_seq_len={limit}")
        masks: dict[int | None, object] = {
            w: sharded.build_mask(doc_ids, T, device=device, window=w) for w in self._windows
        }
        positions = shard.positions.to(device)
        tables: dict[bool, tuple[Tensor, Tensor]] = {}
        for local in self._ropes:
            cos, sin = rope_window(self, 0, shard.seq_len, local)
            tables[local] = (cos[positions], sin[positions])
        return masks, tables

    def _mask(
        self,
        input_ids: Tensor,
        doc_ids: Tensor | None,
        start: int,
        cache: KVCache | None,
        window: int | None,
    ) -> object | None:
        """The attention mask of layers attending to ``window`` keys (None: all before),
        built by their kind's backend."""
        B, T, device = *input_ids.shape, input_ids.device
        if cache is None:
            return self.attention_backend.build_mask(doc_ids, T, device=device, window=window)
        mask = None  # a single new token sees every cached position
        if T > 1 or (window is not None and start >= window):
            mask = causal_offset_mask(T, start, device=device, window=window)
        if cache.key_mask is not None:  # left-padded rows: each sees its own tokens
            mask = padded_offset_mask(mask, cache.key_mask[:B], T, start)
        return mask

    def _check_cached(self, B: int, T: int, start: int, cache: KVCache) -> None:
        if T < 1 or not 0 <= start <= cache.length:
            raise ValueError(
                f"start_pos={start} with {T} tokens: the cache holds {cache.length} positions"
            )
        if start + T > min(cache.max_len, self.config.max_seq_len):
            raise ConfigError(
                f"positions up to {start + T} do not fit the KV cache of {cache.max_len} "
                f"positions and model.max_seq_len={self.config.max_seq_len}"
            )
        if B > cache.batch_size:
            raise ValueError(f"a batch of {B} rows does not fit a cache of {cache.batch_size}")

    def forward(
        self,
        input_ids: Tensor,
        doc_ids: Tensor | None = None,
        *,
        cache: KVCache | None = None,
        start_pos: int | None = None,
        labels: Tensor | None = None,
        per_token: bool = False,
        loss_chunk_size: int | None = None,
        last_only: bool = False,
        temperature: float = 1.0,
        token_mask: Tensor | None = None,
        fused: Callable[[Tensor, Tensor], Tensor] | None = None,
    ) -> Tensor:
        """Next-token logits, ``(B, T, V)``; ``cache``/``start_pos`` as in
        :meth:`forward_hidden`; with ``last_only``, the last position's alone
        (``(B, 1, V)``: what decoding needs, through the model's own forward so that a
        sharded model gathers its weights).

        With ``labels`` (``(B, T)``, aligned with the logits, ``-100`` where nothing
        counts) the head's loss instead: the mean cross-entropy (0-d), or with
        ``per_token`` each label's log-probability (``(B, T)``, fp32, 0 where ignored).
        With ``loss_chunk_size`` the output projection is fused with it
        (:class:`~recipes_lib.models.head.OutputHead`): at most that many rows of logits
        exist at once; with ``temperature``, of the logits divided by it (the log-probs of
        sampling at that temperature). ``token_mask`` as in :meth:`forward_hidden`.
        The loss is computed inside the forward passes of
        the model and of its head, so that a sharded model gathers the head's weight as
        for the logits; so is ``fused(hidden, head weight)``, any other loss of the head.
        """
        hidden = self.forward_hidden(
            input_ids, doc_ids, cache=cache, start_pos=start_pos, token_mask=token_mask
        )
        if fused is not None:
            return self.output(hidden, fused=fused)
        if labels is None:
            return self.output(hidden[:, -1:] if last_only else hidden)
        if labels.shape != input_ids.shape:
            raise ValueError(
                f"labels {tuple(labels.shape)} must have the shape of input_ids "
                f"{tuple(input_ids.shape)}"
            )
        if temperature != 1.0:  # the logits of sampling at that temperature
            hidden = hidden / temperature
        if loss_chunk_size is None:  # any head (a float8 one too), then its loss
            return head_loss(self.output(hidden), labels, per_token)
        return self.output(hidden, labels, per_token=per_token, loss_chunk_size=loss_chunk_size)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters (a tied output head counted once).

        With ``exclude_embeddings`` the token embedding table is left out; when the
        head is tied to it, the head goes with it.
        """
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.tok_embeddings.weight.numel()
        return n

    def inactive_params(self) -> int:
        """Expert parameters a token does not go through: ``E - k`` of each mixture
        layer's experts (0 for a dense model)."""
        return sum(
            sum(p.numel() for p in layer.feed_forward.experts.parameters())
            * (layer.feed_forward.n_experts - layer.feed_forward.top_k)
            // layer.feed_forward.n_experts
            for layer in self.blocks
            if isinstance(layer.feed_forward, MoEFeedForward)
        )

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), PaLM / nanoGPT convention.

        ``6 * N + 12 * n_layers * n_heads * head_dim * seq_len``, where N counts the
        non-embedding parameters a token goes through including the output head (all
        matmul weights; of a mixture of experts only the ``k`` routed experts, the
        active parameters), and the attention term counts the full ``T x T`` score
        and value products, as the convention does, though causal attention needs only
        about half of them.
        """
        c = self.config
        n = self.num_params(exclude_embeddings=True) - self.inactive_params()
        if head_tied(c):
            n += self.output.weight.numel()  # the head is a matmul all the same
        # scores over the query/key width, the weighted sum over the value width
        width = (self.head_dim + (c.v_head_dim or self.head_dim)) / 2
        attention = 12.0 * (c.n_layers - len(c.linear_layers)) * c.n_heads * width * seq_len
        return 6.0 * n + attention + self._linear_flops()

    def _linear_flops(self) -> float:
        """The linear-attention layers' state FLOPs per token (their projections are
        counted with the parameters)."""
        mixers = [layer.attention for layer in self.blocks]
        return sum(m.flops_per_token() for m in mixers if isinstance(m, GatedDeltaNet))
