"""The decoder's configuration (``model.*``) and the role of each of its fields.

Every :class:`ModelConfig` field declares its role in ``metadata``, read by the checks
that compare two models (the stage-compatibility check, a checkpoint against the run's
config): ``shape`` fields decide the weights' shapes (equal wherever weights are handed
on), ``compute`` fields change what the same weights compute, ``context`` fields may
change between stages (context extension), ``label`` fields change nothing computed.
A new field with its role is followed by every check at once (:func:`model_fields`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any


@dataclass
class RopeScalingConfig:
    """RoPE frequency scaling for context extension.

    ``type``: ``none`` | ``linear`` (positions divided by ``factor``) |
    ``llama3`` (Llama 3.1 frequency-band scaling using ``factor``, the two band factors
    and ``original_max_seq_len``) | ``longrope`` (Phi-3: one factor per frequency,
    ``short_factor`` for forwards within ``original_max_seq_len``, ``long_factor`` past
    it, cos and sin scaled by ``attention_factor``, when it is None by
    ``sqrt(1 + ln(factor) / ln(original_max_seq_len))``; ``factor`` is the context ratio
    it was read with) | ``yarn`` (YaRN: frequencies blended between kept and divided by
    ``factor`` over the band that ``beta_fast``/``beta_slow`` rotations within
    ``original_max_seq_len`` mark, the band's edges rounded outwards with ``truncate``;
    cos and sin scaled by ``attention_factor``, or when it is None by
    ``0.1 * ln(factor) + 1``, or by the ratio of that formula with ``mscale`` and with
    ``mscale_all_dim`` when both are set).
    """

    type: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192
    short_factor: list[float] = field(default_factory=list)
    long_factor: list[float] = field(default_factory=list)
    # None: derived from factor as transformers derives it (models.rope.attention_scale)
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


# The role of each ModelConfig field, read by the checks that compare two models:
# ``shape`` fields decide the weights' shapes (equal wherever weights are handed on);
# ``compute`` fields change what the same weights compute; ``context`` fields may change
# between stages (context extension); ``label`` fields change nothing computed.
SHAPE = {"role": "shape"}
COMPUTE = {"role": "compute"}
CONTEXT = {"role": "context"}
LABEL = {"role": "label"}


@dataclass
class ModelConfig:
    """Shape of a decoder (see ``recipes_lib.models.transformer``) and its family.

    Every field declares its role (``metadata``: shape, compute, context or label), so
    the checks between stages and against a checkpoint's own config follow a new
    field automatically (:func:`model_fields`).
    """

    name: str = field(default="tiny", metadata=LABEL)
    # the architecture (recipes_lib.models.families): its options and Hugging Face adapter
    family: str = field(default="llama", metadata=SHAPE)
    vocab_size: int = field(default=8192, metadata=SHAPE)
    dim: int = field(default=128, metadata=SHAPE)
    n_layers: int = field(default=2, metadata=SHAPE)
    n_heads: int = field(default=4, metadata=SHAPE)
    # None: as many KV heads as query heads (MHA)
    n_kv_heads: int | None = field(default=None, metadata=SHAPE)
    head_dim: int | None = field(default=None, metadata=SHAPE)  # None: dim // n_heads
    ffn_dim: int = field(default=384, metadata=SHAPE)  # hidden size of the SwiGLU MLP
    max_seq_len: int = field(default=1024, metadata=CONTEXT)
    rope_theta: float = field(default=10000.0, metadata=CONTEXT)
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig, metadata=CONTEXT)
    norm_eps: float = field(default=1e-5, metadata=COMPUTE)
    qkv_bias: bool = field(default=False, metadata=SHAPE)
    # a bias on the attention's output projection too (gpt-oss: biases on q, k, v and o)
    attention_out_bias: bool = field(default=False, metadata=SHAPE)
    # a learned logit per query head in each softmax's denominator, with no value: a
    # query may put weight on nothing (gpt-oss's sinks; kernels.attention sdpa or flex)
    attention_sinks: bool = field(default=False, metadata=SHAPE)
    # RMSNorm on queries and keys before RoPE: none | head (each head's hs values, Qwen3)
    # | full (the whole projection, OLMo 2)
    qk_norm: str = field(default="none", metadata=SHAPE)
    # each block's norms: pre (on the sublayer's input) | post (on its output, before
    # the residual add: OLMo 2) | both (on its input and on its output: Gemma 3)
    norm_placement: str = field(default="pre", metadata=SHAPE)
    # every RMSNorm computes x * (offset + w) in float32 from its stored gain w (Gemma's
    # (1 + w): 1; its gains start at zero); 0: x * w in the input's dtype
    norm_gain_offset: float = field(default=0.0, metadata=COMPUTE)
    # the MLP's gate: silu (SwiGLU) | gelu_tanh (GeGLU with the tanh-approximated GELU)
    # | clamped_swiglu (gpt-oss: the gate clamped above at swiglu_limit, the up projection
    # to +-swiglu_limit, then (up + 1) * gate * sigmoid(swiglu_alpha * gate))
    activation: str = field(default="silu", metadata=COMPUTE)
    swiglu_alpha: float = field(default=1.702, metadata=COMPUTE)  # clamped_swiglu only
    swiglu_limit: float = field(default=7.0, metadata=COMPUTE)  # clamped_swiglu only
    # multiply the token embeddings by sqrt(dim) on the way in (Gemma), not the head's input
    scale_embeddings: bool = field(default=False, metadata=COMPUTE)
    # the softmax scale is 1 / sqrt(this) (Gemma's query_pre_attn_scalar); None: head_dim
    query_pre_attn_scalar: float | None = field(default=None, metadata=COMPUTE)
    # multi-head latent attention (DeepSeek-V2/V3, recipes_lib.models.latent_attention)
    # when set: each token's keys and values come from one latent of this width (normed),
    # plus one rotated key of mla_rope_dim that every head shares; queries from a latent
    # of mla_q_rank (None: one projection). head_dim is the query/key width, its last
    # mla_rope_dim dims rotated; v_head_dim the value width (None: head_dim)
    mla_kv_rank: int | None = field(default=None, metadata=SHAPE)
    mla_q_rank: int | None = field(default=None, metadata=SHAPE)
    mla_rope_dim: int = field(default=64, metadata=SHAPE)
    v_head_dim: int | None = field(default=None, metadata=SHAPE)
    # RoPE on adjacent pairs of dims (x0, x1), (x2, x3), ... instead of the two halves
    # (DeepSeek-V3's rope_interleave)
    rope_interleave: bool = field(default=False, metadata=COMPUTE)
    # local attention: the layers in window_layers attend to at most sliding_window keys
    # (their own and the sliding_window - 1 before it); Gemma 3's five of every six layers
    sliding_window: int | None = field(default=None, metadata=CONTEXT)
    window_layers: list[int] = field(default_factory=list, metadata=COMPUTE)
    # the RoPE base of the window layers, unscaled (Gemma 3's rope_local_base_freq); None:
    # they rotate as every other layer does
    local_rope_theta: float | None = field(default=None, metadata=CONTEXT)
    # the layers without RoPE (NoPE: their queries and keys are not rotated; SmolLM3's
    # every fourth), in increasing order; empty: every layer uses RoPE
    nope_layers: list[int] = field(default_factory=list, metadata=COMPUTE)
    # the fraction of each head's dims that RoPE rotates (the first int(hs * it); Phi-3's
    # partial rotation); 1: the whole head
    partial_rotary_factor: float = field(default=1.0, metadata=COMPUTE)
    # the attention's query projection also makes a gate per head: its output is
    # multiplied by sigmoid(gate) before wo (Qwen3.5's gated attention; wq is twice as wide)
    attention_output_gate: bool = field(default=False, metadata=SHAPE)
    # linear attention (recipes_lib.models.linear_attention): the layers in linear_layers
    # mix tokens with a Gated DeltaNet (a short causal convolution over q, k and v, then the
    # gated delta rule's recurrent state) instead of softmax attention (Qwen3.5); it has
    # linear_heads value heads of linear_value_dim and linear_key_heads query/key heads of
    # linear_key_dim, and a depthwise convolution over linear_conv_kernel positions
    linear_layers: list[int] = field(default_factory=list, metadata=SHAPE)
    linear_heads: int = field(default=0, metadata=SHAPE)
    linear_key_heads: int = field(default=0, metadata=SHAPE)
    linear_key_dim: int = field(default=128, metadata=SHAPE)
    linear_value_dim: int = field(default=128, metadata=SHAPE)
    linear_conv_kernel: int = field(default=4, metadata=SHAPE)
    tie_embeddings: bool = field(default=False, metadata=SHAPE)  # an LM head only
    # the output head: lm (next-token logits over the vocabulary) | score (one scalar per
    # position, read at a sequence's last token: a reward model, Hugging Face's
    # ...ForSequenceClassification with one label). A score head may start from a
    # language model's weights: its body is loaded, the head starts fresh.
    head: str = field(default="lm", metadata=SHAPE)
    init_std: float = field(default=0.02, metadata=LABEL)
    # Mixture of experts (recipes_lib.models.moe): 0 is a dense model; otherwise every
    # layer but moe_dense_layers replaces its MLP with moe_experts experts of
    # moe_ffn_dim (None: ffn_dim) hidden units, each token going through moe_top_k of them
    moe_experts: int = field(default=0, metadata=SHAPE)
    moe_top_k: int = field(default=2, metadata=COMPUTE)
    moe_ffn_dim: int | None = field(default=None, metadata=SHAPE)
    # the layers that keep the dense MLP of ffn_dim (Qwen3-MoE's mlp_only_layers)
    moe_dense_layers: list[int] = field(default_factory=list, metadata=SHAPE)
    # experts every token goes through (one MLP of moe_shared_experts * moe_ffn_dim units)
    moe_shared_experts: int = field(default=0, metadata=SHAPE)
    # the shared experts' output multiplied by sigmoid(a learned C -> 1 projection of the
    # token) (Qwen3.5-MoE's shared_expert_gate)
    moe_shared_gate: bool = field(default=False, metadata=SHAPE)
    # the router's scores: softmax (over every expert) | sigmoid (each expert on its own,
    # chosen with a per-expert bias that moe_bias_update_rate moves: DeepSeek-V3)
    moe_router: str = field(default="softmax", metadata=SHAPE)  # sigmoid has a bias buffer
    # divide the chosen experts' weights by their sum (Mixtral; Qwen3-MoE's norm_topk_prob)
    moe_renormalize: bool = field(default=True, metadata=COMPUTE)
    # group-limited routing (DeepSeek-V3's n_group, topk_group; the sigmoid router): the
    # experts split into moe_groups groups, each scored by its two best experts, and a
    # token's experts are chosen within its moe_top_groups best groups
    moe_groups: int = field(default=1, metadata=COMPUTE)
    moe_top_groups: int = field(default=1, metadata=COMPUTE)
    # the routed experts' weights times this (DeepSeek-V3's routed_scaling_factor)
    moe_routed_scale: float = field(default=1.0, metadata=COMPUTE)
    # biases on the router and on each expert's three projections (gpt-oss)
    moe_bias: bool = field(default=False, metadata=SHAPE)
    # training only, free to change between stages: the load-balancing loss's and the
    # router z-loss's weights in the loss, and the bias step of sigmoid routing
    moe_aux_loss_coef: float = field(default=0.0, metadata=LABEL)
    moe_z_loss_coef: float = field(default=0.0, metadata=LABEL)
    moe_bias_update_rate: float = field(default=0.0, metadata=LABEL)
    # the transformers fallback (family=hf, recipes_lib.models.hf_fallback): the folder's
    # config.json, which transformers builds the model from, and whether the folder's
    # own code may run (refused unless set; recorded with the run)
    hf_config: Any = field(default=None, metadata=SHAPE)  # a dict, or None
    trust_remote_code: bool = field(default=False, metadata=LABEL)


# The block options: what a model family fixes or reads from its config.json. A family
# holds the default of every one it does not name (recipes_lib.models.families).
BLOCK_OPTIONS = (
    "qkv_bias",
    "attention_out_bias",
    "attention_sinks",
    "qk_norm",
    "norm_placement",
    "norm_gain_offset",
    "nope_layers",
    "partial_rotary_factor",
    "activation",
    "swiglu_alpha",
    "swiglu_limit",
    "scale_embeddings",
    "query_pre_attn_scalar",
    "mla_kv_rank",
    "mla_q_rank",
    "mla_rope_dim",
    "v_head_dim",
    "rope_interleave",
    "sliding_window",
    "window_layers",
    "local_rope_theta",
    "attention_output_gate",
    "linear_layers",
    "linear_heads",
    "linear_key_heads",
    "linear_key_dim",
    "linear_value_dim",
    "linear_conv_kernel",
    "moe_experts",
    "moe_top_k",
    "moe_ffn_dim",
    "moe_dense_layers",
    "moe_shared_experts",
    "moe_shared_gate",
    "moe_router",
    "moe_renormalize",
    "moe_bias",
    "moe_groups",
    "moe_top_groups",
    "moe_routed_scale",
)


def block_option_defaults() -> dict[str, Any]:
    """Each block option's default (a fresh list for the list ones)."""
    return {
        f.name: f.default if f.default_factory is MISSING else f.default_factory()
        for f in fields(ModelConfig)
        if f.name in BLOCK_OPTIONS
    }


def is_layer_list(layers: Any, n_layers: int) -> bool:
    """Whether ``layers`` lists layer indices of a ``n_layers`` model in increasing order
    (``model.nope_layers``, ``model.window_layers``)."""
    try:
        return all(0 <= i < n_layers and int(i) == i for i in layers) and all(
            a < b for a, b in zip(layers, layers[1:], strict=False)
        )
    except TypeError:
        return False


def model_fields(*roles: str) -> tuple[str, ...]:
    """The names of the :class:`ModelConfig` fields of the given roles, in order."""
    return tuple(f.name for f in fields(ModelConfig) if f.metadata.get("role") in roles)


_DEFAULTS = {f.name: f.default for f in fields(ModelConfig) if f.default is not MISSING}


HEADS = ("lm", "score")


def head_width(config: ModelConfig) -> int:
    """The width of one query/key attention head: ``model.head_dim``, or ``dim // n_heads``
    where it is null (``dim`` itself for a model without attention heads, such as a
    state-space type of the transformers fallback)."""
    return config.head_dim or config.dim // max(config.n_heads, 1)


def head_tied(config: ModelConfig) -> bool:
    """Whether the output head is the token embeddings (``tie_embeddings`` ties an LM
    head; a score head is its own weight)."""
    return config.tie_embeddings and config.head == "lm"


def starts_fresh_head(model: Mapping[str, Any], source: Mapping[str, Any]) -> bool:
    """Whether a model (its fields) with a score head starts from a language model's
    weights (``source``): the body is handed on and the head starts fresh."""
    return model.get("head") == "score" and source.get("head", "lm") == "lm"


# the fields a score head starting from a language model is free to differ in
FRESH_HEAD_FIELDS = ("head", "tie_embeddings")


def field_differences(
    model: ModelConfig | Mapping[str, Any], source: ModelConfig | Mapping[str, Any], *roles: str
) -> list[tuple[str, Any, Any]]:
    """``(field, ours, theirs)`` for each field of ``roles`` in which ``model`` differs
    from the ``source`` whose weights it starts from (resolved as
    :func:`resolved_model_fields`); a score head starting from a language model may
    differ in :data:`FRESH_HEAD_FIELDS`."""
    ours, theirs = resolved_model_fields(model, *roles), resolved_model_fields(source, *roles)
    both = (resolved_model_fields(model, "shape"), resolved_model_fields(source, "shape"))
    free = FRESH_HEAD_FIELDS if starts_fresh_head(*both) else ()
    return [(k, ours[k], theirs[k]) for k in ours if k not in free and ours[k] != theirs[k]]


def resolved_model_fields(model: ModelConfig | Mapping[str, Any], *roles: str) -> dict[str, Any]:
    """``model``'s fields of ``roles`` (a ModelConfig or its dict, e.g. from a manifest),
    with the defaults spelled out (``n_kv_heads``, ``head_dim``, ``v_head_dim``,
    ``nope_layers``), so two ways of writing one model compare equal."""
    values = asdict(model) if isinstance(model, ModelConfig) else dict(model)
    # a field the mapping leaves out holds its default
    out = {name: values.get(name, _DEFAULTS.get(name)) for name in model_fields(*roles)}
    heads = values.get("n_heads")
    if "n_kv_heads" in out and out["n_kv_heads"] is None:
        out["n_kv_heads"] = heads
    if "head_dim" in out and out["head_dim"] is None and values.get("dim") and heads:
        out["head_dim"] = values["dim"] // heads
    if "v_head_dim" in out and out["v_head_dim"] is None:  # as wide as the query heads
        width = values.get("head_dim")
        if width is None and values.get("dim") and heads:
            width = values["dim"] // heads
        out["v_head_dim"] = width
    if "moe_ffn_dim" in out:  # the experts' width, or none in a dense model
        dense = not values.get("moe_experts")
        out["moe_ffn_dim"] = None if dense else out["moe_ffn_dim"] or values.get("ffn_dim")
    # null and [] alike
    for name in ("nope_layers", "window_layers", "moe_dense_layers", "linear_layers"):
        if name in out:
            out[name] = list(out[name] or [])
    scaling = out.get("rope_scaling")
    if isinstance(scaling, Mapping):  # fields left out hold their defaults
        out["rope_scaling"] = {**asdict(RopeScalingConfig()), **scaling}
    return out
