"""Kernel backends with declared capabilities: the attention backends ``sdpa`` and
``flex`` (:mod:`recipes_lib.kernels.attention`, where the interface is) and
``flash_attn`` (:mod:`recipes_lib.kernels.flash`), by name."""

from recipes_lib.errors import ConfigError
from recipes_lib.kernels.attention import (
    AttentionBackend,
    AttentionCapabilities,
    FlexAttention,
    SDPAAttention,
)
from recipes_lib.kernels.flash import FlashAttention, VarlenMask

_BACKENDS: dict[str, type[AttentionBackend]] = {
    SDPAAttention.name: SDPAAttention,
    FlexAttention.name: FlexAttention,
    FlashAttention.name: FlashAttention,
}
ATTENTION_BACKENDS: tuple[str, ...] = tuple(_BACKENDS)


def get_attention_backend(name: str) -> AttentionBackend:
    """A new instance of the attention backend called ``name``.

    Raises:
        ConfigError: ``name`` is not one of :data:`ATTENTION_BACKENDS`.
    """
    if name not in _BACKENDS:
        choices = " | ".join(ATTENTION_BACKENDS)
        raise ConfigError(
            f"kernels.attention={name!r} is not an attention backend; choose one of: {choices} "
            f"(e.g. kernels.attention=sdpa)"
        )
    return _BACKENDS[name]()


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
