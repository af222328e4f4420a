"""Kernel backends with declared capabilities: the attention backends ``sdpa`` and
``flex`` (:mod:`recipes_lib.kernels.attention`, where the interface is), ``varlen`` and
``flash_attn`` (:mod:`recipes_lib.kernels.flash`), by name, and the backend each kind of
layer runs (:mod:`recipes_lib.kernels.choice`)."""

from recipes_lib.kernels.attention import (
    AttentionBackend,
    AttentionCapabilities,
    FlexAttention,
    SDPAAttention,
)
from recipes_lib.kernels.choice import (
    ATTENTION_BACKENDS,
    ATTENTION_CHOICES,
    AUTO,
    LAYER_KINDS,
    AttentionChoice,
    choose_attention,
    get_attention_backend,
    layer_kind,
)
from recipes_lib.kernels.flash import FlashAttention, TorchVarlenAttention, VarlenMask

__all__ = [
    "ATTENTION_BACKENDS",
    "ATTENTION_CHOICES",
    "AUTO",
    "LAYER_KINDS",
    "AttentionBackend",
    "AttentionCapabilities",
    "AttentionChoice",
    "FlashAttention",
    "FlexAttention",
    "SDPAAttention",
    "TorchVarlenAttention",
    "VarlenMask",
    "choose_attention",
    "get_attention_backend",
    "layer_kind",
]
