"""Loss functions: pure functions of tensors, no model or trainer state."""

from recipes_lib.losses.cross_entropy import (
    DEFAULT_CHUNK_SIZE,
    IGNORE_INDEX,
    causal_lm_loss,
    chunked_cross_entropy,
)
from recipes_lib.losses.logprobs import (
    linear_token_logprobs,
    sequence_logprobs,
    token_logprobs,
)
from recipes_lib.losses.preference import (
    PREFERENCE_LOSSES,
    PairLogps,
    PreferenceLoss,
    dpo_sigmoid_loss,
    hinge_loss,
    ipo_loss,
    orpo_loss,
    simpo_loss,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "IGNORE_INDEX",
    "PREFERENCE_LOSSES",
    "PairLogps",
    "PreferenceLoss",
    "causal_lm_loss",
    "chunked_cross_entropy",
    "dpo_sigmoid_loss",
    "hinge_loss",
    "ipo_loss",
    "linear_token_logprobs",
    "orpo_loss",
    "simpo_loss",
    "sequence_logprobs",
    "token_logprobs",
]
