"""What one decoder block keeps for its backward pass, per token, tensor by tensor.

The terms follow ``TransformerBlock._forward`` in :mod:`recipes_lib.models.blocks`
(pre-norm attention with RoPE, then a SwiGLU MLP) and what each op's backward needs
(PyTorch saves an op's inputs only for the gradients it must compute: a frozen
linear keeps no input). They were checked against ``torch.cuda.memory_allocated`` after
the forward pass on an H100 (``benchmarks/memory_estimate.py``): eager blocks within 1%.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from recipes_lib.config.model import head_width
from recipes_lib.config.schema import RunConfig
from recipes_lib.models.norms import qk_norm_sizes

RSTD_BYTES = 4  # RMSNorm's fp32 reciprocal RMS per token
LSE_BYTES = 4  # the attention kernel's fp32 log-sum-exp per token and head
MASK_BYTES = 1  # dropout's bool mask per element


@dataclass(frozen=True)
class DecoderShape:
    """The sizes the decoder's tensors are made of (``model.*``)."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    max_seq_len: int
    tie_embeddings: bool
    qkv_bias: bool
    qk_norm: str = "none"
    norm_placement: str = "pre"
    # a mixture of experts, averaged over the layers: the MLP width a token's activations
    # take (k experts and the shared ones; None: ffn_dim, which then counts every
    # expert's weights), the router's outputs, and the routed rows a token adds (its k
    # gathered inputs and outputs, C wide each)
    ffn_active: int | None = None
    router_width: int = 0
    routed: int = 0
    # the routed experts themselves: how many layers have them, how many, how wide
    moe_layers: int = 0
    experts: int = 0
    expert_width: int = 0
    # Qwen3.5: wq also makes an output gate per head (twice as wide); the layers whose
    # mixer is linear attention and one such mixer's parameters (in place of the
    # attention's); the layers whose shared experts have a C -> 1 gate
    attention_gate: bool = False
    linear_layers: int = 0
    linear_mixer: int = 0
    shared_gate_layers: int = 0
    # the linear-attention mixer's projections: (name, in_features, out_features)
    linear_projections: tuple[tuple[str, int, int], ...] = ()
    # multi-head latent attention's parameters in one block (DeepSeek-V3), in place of
    # the attention's; 0: plain attention (its activations are still estimated as plain
    # attention's of head_dim-wide heads)
    latent_attention: int = 0
    # its projections, (name, in_features, out_features), in place of wq, wk, wv and wo
    latent_projections: tuple[tuple[str, int, int], ...] = ()

    @classmethod
    def of(cls, cfg: RunConfig) -> DecoderShape:
        return cls.of_model(cfg.model)

    @classmethod
    def of_model(cls, m) -> DecoderShape:
        """The shape of a model config (another model's: a teacher's)."""
        fields: dict[str, Any] = {**_moe_widths(m), **cls._attention(m), **_hybrid(m)}
        fields["latent_attention"] = _latent_attention(m)
        fields["latent_projections"] = _latent_projections(m)
        return cls(**fields)

    @staticmethod
    def _attention(m) -> dict:
        return dict(
            dim=m.dim,
            n_layers=m.n_layers,
            n_heads=m.n_heads,
            n_kv_heads=m.n_kv_heads or m.n_heads,
            head_dim=head_width(m),
            vocab_size=m.vocab_size,
            max_seq_len=m.max_seq_len,
            tie_embeddings=m.tie_embeddings,
            qkv_bias=m.qkv_bias,
            qk_norm=m.qk_norm,
            norm_placement=m.norm_placement,
        )

    @property
    def q_width(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim

    def linears(self) -> dict[str, tuple[int, int]]:
        """Each block linear's ``(in_features, out_features)``, by native name."""
        c, f, q, kv = self.dim, self.ffn_dim, self.q_width, self.kv_width
        return {
            "wq": (c, 2 * q if self.attention_gate else q),
            "wk": (c, kv),
            "wv": (c, kv),
            "wo": (q, c),
            "w1": (c, f),
            "w3": (c, f),
            "w2": (f, c),
            **({"router": (c, self.router_width)} if self.router_width else {}),
        }

    @property
    def block_norms(self) -> int:
        """Norms around the sublayers: two, four with ``norm_placement=both`` (Gemma 3)."""
        return 4 if self.norm_placement == "both" else 2

    @property
    def qkv_bias_params(self) -> int:
        """The q, k and v biases of one block (``model.qkv_bias``), else 0."""
        return self.q_width + 2 * self.kv_width if self.qkv_bias else 0

    def block_params(self) -> int:
        """Parameters of one block: its linears, q/k/v biases, the norm gains around the
        sublayers and the query and key norms' gains."""
        linears = self.linears()
        weights = sum(i * o for i, o in linears.values())
        plain = sum(i * o for i, o in (linears[n] for n in ("wq", "wk", "wv", "wo")))
        return weights - plain + self.attention_params() + self.block_norms * self.dim

    @property
    def head_params(self) -> int:
        """The output head's (and the embedding's) ``vocab_size x dim``."""
        return self.vocab_size * self.dim

    def outer_params(self) -> int:
        """Parameters outside the blocks: embedding, final norm, untied head."""
        head = 0 if self.tie_embeddings else self.head_params
        return self.head_params + self.dim + head

    def attention_params(self) -> int:
        """The attention's parameters in one block: its projections, q/k/v biases and
        query and key norms (what a linear-attention layer has in their place); a latent
        attention's own."""
        if self.latent_attention:
            return self.latent_attention
        linears = self.linears()
        weights = sum(i * o for i, o in (linears[n] for n in ("wq", "wk", "wv", "wo")))
        qk = 0
        if self.qk_norm != "none":
            qk = sum(qk_norm_sizes(self.qk_norm, self.n_heads, self.n_kv_heads, self.head_dim))
        return weights + self.qkv_bias_params + qk

    def adapted(self, lora: dict[str, int]) -> list[tuple[int, int, int]]:
        """``(in_features, out_features, rank)`` of every linear LoRA adapts, one entry
        per layer that has it (the attention's in the attention layers, the linear
        attention's in the linear ones, the MLP's in every layer; not the experts)."""
        linears = self.linears()
        mixer = {name: (i, o) for name, i, o in self.linear_projections}
        plain = {name: linears[name] for name in ("wq", "wk", "wv", "wo")}
        # a latent attention's own projections (wq and wo among them, of its widths)
        attention = {name: (i, o) for name, i, o in self.latent_projections} or plain
        attention_layers = self.n_layers - self.linear_layers
        found: list[tuple[int, int, int]] = []
        for name, r in lora.items():
            if name in attention:
                found += [(*attention[name], r)] * attention_layers
            elif name in plain:  # a projection a latent attention does not have
                continue
            elif name in linears:
                found += [(*linears[name], r)] * self.n_layers
            elif name in mixer:
                found += [(*mixer[name], r)] * self.linear_layers
        return found

    def num_params(self) -> int:
        """Every parameter (a tied head counted once), as ``Transformer.num_params``."""
        mixers = self.linear_layers * (self.linear_mixer - self.attention_params())
        gates = self.shared_gate_layers * self.dim
        return self.n_layers * self.block_params() + mixers + gates + self.outer_params()


def _latent_attention(m) -> int:
    """Multi-head latent attention's parameters in one block (0 without it): the query
    projection or latent (with its norm), the key/value latent with the shared rotated
    key, its norm and expansion, the output, and the biases ``qkv_bias`` and
    ``attention_out_bias`` put on ``wq_a``, ``wkv_a`` and ``wo``."""
    if m.mla_kv_rank is None:
        return 0
    c, heads, rank = m.dim, m.n_heads, m.mla_kv_rank
    hs = head_width(m)
    vd, rope, q_rank = m.v_head_dim or hs, m.mla_rope_dim, m.mla_q_rank
    query = c * heads * hs if q_rank is None else q_rank * (c + 1 + heads * hs)
    kv = c * (rank + rope) + rank + rank * heads * (hs - rope + vd)
    bias = ((q_rank or 0) + rank + rope) if m.qkv_bias else 0
    return query + kv + heads * vd * c + bias + (c if m.attention_out_bias else 0)


def _latent_projections(m) -> tuple[tuple[str, int, int], ...]:
    """Multi-head latent attention's projections ``(name, in_features, out_features)``
    in one block (none without it)."""
    if m.mla_kv_rank is None:
        return ()
    c, heads, rank = m.dim, m.n_heads, m.mla_kv_rank
    hs = head_width(m)
    vd, rope, q_rank = m.v_head_dim or hs, m.mla_rope_dim, m.mla_q_rank
    query = [("wq", c, heads * hs)] if q_rank is None else []
    if q_rank is not None:
        query = [("wq_a", c, q_rank), ("wq_b", q_rank, heads * hs)]
    return (
        *query,
        ("wkv_a", c, rank + rope),
        ("wkv_b", rank, heads * (hs - rope + vd)),
        ("wo", heads * vd, c),
    )


def _hybrid(m) -> dict[str, Any]:
    """Qwen3.5's fields of :class:`DecoderShape`: the attention's output gate, the
    linear-attention layers and one mixer's parameters (its four input projections,
    convolution, decay and step parameters, output norm and projection), the layers with
    a gated shared expert."""
    linear = len(m.linear_layers)
    mixer = 0
    if linear:
        keys, values = m.linear_key_heads * m.linear_key_dim, m.linear_heads * m.linear_value_dim
        channels = 2 * keys + values  # the convolution's
        mixer = m.dim * (channels + values + 2 * m.linear_heads)  # in_qkv, in_z, in_b, in_a
        mixer += channels * m.linear_conv_kernel + 2 * m.linear_heads + m.linear_value_dim
        mixer += values * m.dim  # out_proj
    gated = m.n_layers - len(m.moe_dense_layers) if m.moe_experts and m.moe_shared_gate else 0
    projections: tuple[tuple[str, int, int], ...] = ()
    if linear:
        c, values, heads = m.dim, m.linear_heads * m.linear_value_dim, m.linear_heads
        channels = 2 * m.linear_key_heads * m.linear_key_dim + values
        projections = (
            ("in_qkv", c, channels),
            ("in_z", c, values),
            ("in_b", c, heads),
            ("in_a", c, heads),
            ("out_proj", values, c),
        )
    return {
        "attention_gate": m.attention_output_gate,
        "linear_layers": linear,
        "linear_mixer": mixer,
        "shared_gate_layers": gated,
        "linear_projections": projections,
    }


def _moe_widths(m) -> dict[str, int]:
    """``ffn_dim`` (as wide as the layers' MLP weights, every expert's counted) and the
    mixture fields of :class:`DecoderShape`, averaged over the layers (exact when every
    layer has experts)."""
    if not m.moe_experts:
        return {"ffn_dim": m.ffn_dim}
    width = m.moe_ffn_dim or m.ffn_dim
    layers, dense = m.n_layers, len(m.moe_dense_layers)
    sparse, shared = layers - dense, m.moe_shared_experts * width

    def mean(dense_value: int, sparse_value: int) -> int:
        return round((dense * dense_value + sparse * sparse_value) / layers)

    return {
        "ffn_dim": mean(m.ffn_dim, m.moe_experts * width + shared),
        "ffn_active": mean(m.ffn_dim, m.moe_top_k * width + shared),
        "router_width": mean(0, m.moe_experts),
        "routed": mean(0, 2 * m.moe_top_k * m.dim),
        "moe_layers": sparse,
        "experts": m.moe_experts,
        "expert_width": width,
    }


@dataclass(frozen=True)
class ActivationDtypes:
    """Bytes per element of what a block keeps, under one precision.

    Attributes:
        residual: the residual stream (the blocks' and norms' inputs).
        compute: matmul outputs (q, k, v, attention, SwiGLU).
        casts: autocast makes a bf16 copy of each linear's fp32 input, one per linear
            that reads it (bf16-mixed and fp8 without FSDP).
    """

    residual: int
    compute: int
    casts: bool

    @classmethod
    def of(cls, precision: str, fsdp: bool) -> ActivationDtypes:
        if precision == "32-true":
            return cls(residual=4, compute=4, casts=False)
        if precision == "bf16-true" or fsdp:  # FSDP2 gathers bf16 weights: a bf16 stream
            return cls(residual=2, compute=2, casts=False)
        return cls(residual=4, compute=2, casts=True)  # bf16-mixed, fp8: autocast


def block_bytes_per_token(
    shape: DecoderShape,
    dt: ActivationDtypes,
    *,
    lora: dict[str, int] | None = None,
    dropout: bool = False,
    quantized: bool = False,
    compiled: bool = False,
) -> float:
    """Bytes one block keeps for its backward, per token.

    Eager (C dim, q and kv the query and key/value widths, F ffn_dim):

    - each RMSNorm keeps its input (``residual x C``) and an fp32 rstd;
    - wq, wk, wv keep their input, the attention norm's output, once; under autocast
      each keeps its own bf16 cast of it (3 x 2C); w1 and w3 likewise (2 x 2C). A frozen
      linear (LoRA's base) keeps none;
    - attention keeps q and k after RoPE, v, its output (also wo's input: the same
      storage) and an fp32 log-sum-exp per head;
    - SwiGLU keeps w1's output (for SiLU), SiLU's and w3's outputs (for the product)
      and the product (w2's input, when w2 trains). Under QLoRA with autocast these
      three are fp32: bitsandbytes returns its output in its input's dtype;
    - each LoRA adapter keeps the bf16 cast of its input (the compute dtype without
      autocast), a one-byte dropout mask per input element, and ``r`` values.

    Beyond the Llama block (estimated from the same rules, not yet checked against a
    measurement): ``norm_placement=both`` adds two norms on the sublayers' outputs
    (``compute x C`` and an rstd each); a q/k norm keeps the projections' outputs
    (``(q + kv) x compute``) and an rstd per head (per token with ``full``).

    Compiled (inductor, ``kernels.compile``): the norms' inputs, one copy of the
    attention's input, the attention tensors and SwiGLU's three F-wide tensors are kept,
    the rest is recomputed in the backward (measured, full training, H100, torch 2.11).

    Args:
        lora: adapted linear name -> rank (None: no adapter; every linear trains).
        dropout: the adapters drop their input.
        quantized: QLoRA's 4-bit base linears.
        compiled: the block is compiled.
    """
    c, f, a, r = shape.dim, shape.ffn_active or shape.ffn_dim, dt.compute, dt.residual
    q, kv = shape.q_width, shape.kv_width
    total = 2 * (r * c + RSTD_BYTES)  # the norms' inputs
    if shape.block_norms == 4:  # the output norms, on the sublayers' (compute) outputs
        total += 2 * (a * c + RSTD_BYTES)
    if shape.qk_norm != "none":  # the q and k norms' inputs and rstds
        per = shape.n_heads + shape.n_kv_heads if shape.qk_norm == "head" else 2
        total += (q + kv) * a + RSTD_BYTES * per
    total += (2 * q + 2 * kv) * a + LSE_BYTES * shape.n_heads  # q, k, v, output, lse
    total += shape.routed * a  # a mixture's gathered rows and their outputs
    mlp = 4 if (quantized and dt.casts) else a
    total += 3 * f * mlp  # w1's output, SiLU's output, w3's output
    if compiled:
        return float(total + a * c + _adapter_bytes(shape, dt, lora, dropout))
    if lora is None:
        total += f * a  # the product, w2's input
        total += (5 * 2 * c) if dt.casts else 2 * r * c  # the linears' inputs
    return float(total + _adapter_bytes(shape, dt, lora, dropout))


def _adapter_bytes(
    shape: DecoderShape, dt: ActivationDtypes, lora: dict[str, int] | None, dropout: bool
) -> float:
    if not lora:
        return 0.0
    linears = shape.linears()
    kept = 0
    for name, rank in lora.items():
        if name not in linears:  # the experts': an update of their weights, kept by none
            continue
        width = linears[name][0]
        kept += (2 if dt.casts else dt.compute) * width + rank * dt.compute
        if dropout:
            kept += MASK_BYTES * width
    return float(kept)
