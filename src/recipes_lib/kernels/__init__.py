"""Kernel backends with declared capabilities (see :mod:`recipes_lib.kernels.attention`)."""

from recipes_lib.kernels.attention import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    AttentionCapabilities,
    FlashAttention,
    FlexAttention,
    SDPAAttention,
    VarlenMask,
    get_attention_backend,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionCapabilities",
    "FlashAttention",
    "FlexAttention",
    "SDPAAttention",
    "VarlenMask",
    "get_attention_backend",
]
