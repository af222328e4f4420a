"""Loss functions: pure functions of tensors, no model or trainer state."""

from recipes_lib.losses.cross_entropy import (
    DEFAULT_CHUNK_SIZE,
    IGNORE_INDEX,
    causal_lm_loss,
    chunked_cross_entropy,
)

__all__ = ["DEFAULT_CHUNK_SIZE", "IGNORE_INDEX", "causal_lm_loss", "chunked_cross_entropy"]
