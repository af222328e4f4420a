"""Local attention: the layers in ``model.window_layers`` attend to at most
``model.sliding_window`` keys, their own position's and the ``sliding_window - 1``
before it (Gemma 3's five of every six layers; the others attend to every earlier key).
A window layer may rotate with its own RoPE base, unscaled (``model.local_rope_theta``,
Gemma 3's ``rope_local_base_freq``; :func:`recipes_lib.models.rope.rope_tables`).

The attention kernels take the window in their mask
(:meth:`recipes_lib.kernels.AttentionBackend.build_mask`): ``flex`` skips the blocks
outside it, so a local layer costs less than a global one at long sequences; the KV
cache applies it in its offset mask (:func:`recipes_lib.models.kv_cache.causal_offset_mask`).
Local and global layers may run different kernels (``kernels.attention_local``,
``kernels.attention_global``, ``kernels.attention=auto``: :mod:`recipes_lib.kernels.choice`);
:func:`attention_choice` makes a model's choice from its config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from recipes_lib.config.model import is_layer_list
from recipes_lib.errors import ConfigError
from recipes_lib.kernels.choice import LAYER_KINDS, AttentionChoice, choose_attention, layer_kind

if TYPE_CHECKING:
    from recipes_lib.config.schema import KernelsConfig, ModelConfig


def layer_window(config: ModelConfig, layer: int) -> int | None:
    """The window of layer ``layer``, or None when it attends to every earlier key."""
    return config.sliding_window if layer in config.window_layers else None


def attention_kinds(config: ModelConfig) -> tuple[str, ...]:
    """The kinds of attention layer the model has (``global``, ``local``), in the order
    of :data:`~recipes_lib.kernels.choice.LAYER_KINDS`; a linear-attention layer takes no
    attention backend, a latent attention layer attends to every earlier key."""
    kinds = {
        layer_kind(None if config.mla_kv_rank is not None else layer_window(config, layer))
        for layer in range(config.n_layers)
        if layer not in config.linear_layers
    }
    return tuple(kind for kind in LAYER_KINDS if kind in kinds)


def attention_choice(
    kernels: KernelsConfig, config: ModelConfig, *, document_mask: bool
) -> AttentionChoice:
    """The backend of each kind of the model's attention layers, as ``kernels`` names them
    (``kernels.attention``, ``kernels.attention_local``, ``kernels.attention_global``).

    Raises:
        ConfigError: a name that is no backend, naming its key.
    """
    choice = choose_attention(
        kernels.attention,
        local=kernels.attention_local,
        global_=kernels.attention_global,
        document_mask=document_mask,
    )
    return choice.for_kinds(attention_kinds(config))


def check_windows(config: ModelConfig) -> None:
    """Refuse window options that do not fit together, in one line naming the key."""
    layers, window = config.window_layers, config.sliding_window
    if not is_layer_list(layers, config.n_layers):
        raise ConfigError(
            f"model.window_layers={layers!r} must list the local layers in increasing order, "
            f"each in 0..{config.n_layers - 1} (model.n_layers={config.n_layers})"
        )
    if window is not None and not (isinstance(window, int) and window >= 1):
        raise ConfigError(f"model.sliding_window={window!r} must be a positive number of keys")
    if layers and window is None:
        raise ConfigError(
            f"model.window_layers={layers!r} needs model.sliding_window (the keys each sees)"
        )
    theta = config.local_rope_theta
    if theta is not None and not (isinstance(theta, int | float) and theta > 0):
        raise ConfigError(f"model.local_rope_theta={theta!r} must be a positive RoPE base")
