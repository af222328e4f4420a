"""Hugging Face checkpoints in and out, for every supported model family.

A Hugging Face model folder holds ``config.json`` and its weights as ``model.safetensors``
or as shards listed by ``model.safetensors.index.json``. Its ``model_type`` picks the
family (:mod:`recipes_lib.models.families`), whose adapter maps the config and renames
the tensors; the files themselves are :mod:`recipes_lib.checkpoint.hf_files`'s and the
tokenizer :mod:`recipes_lib.checkpoint.hf_tokenizer`'s.

:func:`load_hf_checkpoint` reads a downloaded folder into a model; :func:`load_hf_weights_into`
fills a model built from a run's config (``stage.init_from=<folder>``) after checking that
the folder's ``config.json`` describes it (a reward model, ``model.head=score``, may start
from a language model's folder: its head starts fresh). A ``...ForSequenceClassification``
folder with one label is read as a model with a score head. An image-text folder whose
text tower a family reads (Gemma 3's ``Gemma3ForConditionalGeneration``) is read as that
text model (:func:`~recipes_lib.checkpoint.hf_files.read_hf_config`). Writing a folder is
:mod:`recipes_lib.checkpoint.hf_export`'s.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from recipes_lib.checkpoint.dequantize import quantization_of
from recipes_lib.checkpoint.hf_files import (
    DTYPES,
    HF_CONFIG_NAME,
    CheckedTensors,
    checked_tensors,
    copy_tensors,
    is_hf_folder,
    read_hf_config,
)
from recipes_lib.config.model import field_differences, head_tied, starts_fresh_head
from recipes_lib.config.schema import ModelConfig
from recipes_lib.errors import CheckpointError
from recipes_lib.models import Transformer
from recipes_lib.models.families import family_of_hf, get_family
from recipes_lib.models.rope import rope_tables

log = logging.getLogger(__name__)

__all__ = [
    "hf_config_mismatches",
    "is_hf_folder",
    "load_hf_checkpoint",
    "load_hf_weights_into",
    "model_config_from_hf",
    "read_hf_config",
]


def model_config_from_hf(
    config: Mapping[str, Any], *, name: str | None = None, max_seq_len: int | None = None
) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face ``config.json``, read by the family its
    ``model_type`` names.

    Sliding-window attention (Mistral v0.1, Qwen2 with ``use_sliding_window``) over a
    window of ``W`` tokens equals full causal attention on sequences of at most ``W``
    tokens, so such a model is built with full attention and a context of at most
    ``W``: ``max_seq_len`` defaults to ``min(max_position_embeddings, W)``, and a longer
    one is an error rather than a silently different model.

    Args:
        config: the parsed ``config.json``.
        name: the model's name (default: ``_name_or_path`` or the model type).
        max_seq_len: the context to build for (default: ``max_position_embeddings``);
            RoPE tables of that length are allocated, so a smaller value saves memory.

    Raises:
        CheckpointError: an unsupported model type (the supported ones are listed), an
            option the family does not support, a context longer than the sliding
            window, or a missing key.
    """
    model_type = config.get("model_type")
    family = family_of_hf(model_type)
    quantization_of(config)  # a quantization the loader cannot unpack is refused here
    fields = {"family": family.name, **family.fixed, **family.from_hf(config), **_head(config)}
    max_positions = int(config.get("max_position_embeddings") or 0)
    if not max_positions:
        raise CheckpointError("the Hugging Face config has no 'max_position_embeddings'")
    window = family.sliding_window(config)
    if max_seq_len is None:
        max_seq_len = max_positions
        if window is not None and window < max_seq_len:
            log.info(
                "%s: sliding_window=%d < max_position_embeddings=%d: using full attention "
                "over at most %d tokens",
                model_type,
                window,
                max_positions,
                window,
            )
            max_seq_len = window
    elif window is not None and max_seq_len > window:
        raise CheckpointError(
            f"{model_type}: max_seq_len={max_seq_len} exceeds sliding_window={window}; "
            "sliding-window attention is not supported, so the context must stay within "
            f"the window (max_seq_len <= {window})"
        )
    name = str(name or config.get("_name_or_path") or model_type)  # model_type is known here
    return ModelConfig(name=name, max_seq_len=int(max_seq_len), **fields)


# ModelConfig field -> how config.json says it, for messages
_HF_KEY_NAMES = {
    "family": "model_type's family",
    "vocab_size": "vocab_size",
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "ffn_dim": "intermediate_size",
    "rope_theta": "rope_theta",
    "rope_scaling": "rope_scaling",
    "norm_eps": "rms_norm_eps",
    "qkv_bias": "q/k/v biases (model_type qwen2)",
    "partial_rotary_factor": "partial_rotary_factor",
    "tie_embeddings": "tie_word_embeddings",
    "head": "architectures",
}
# Everything that decides what the weights compute must match a checkpoint's config;
# the context length may differ (RoPE tables are built for whatever is configured).
_FREE_FIELDS = ("max_seq_len",)


def _head(config: Mapping[str, Any]) -> dict[str, str]:
    """``{"head": "score"}`` for a ``...ForSequenceClassification`` config (one label),
    else nothing (an LM head)."""
    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        return {}
    labels = config.get("num_labels") or len(config.get("id2label") or {}) or 2
    if labels != 1:
        raise CheckpointError(
            f"{architectures[0]} with {labels} labels: a score head (model.head=score) has "
            "one (a reward model's)"
        )
    return {"head": "score"}


def hf_config_mismatches(hf: ModelConfig, configured: ModelConfig) -> list[str]:
    """``model.<key>=<ours> vs <config.json key>=<theirs>`` for every field in which a
    Hugging Face model's config differs from the configured model's (label fields and
    ``max_seq_len`` are free to differ, and a score head's own fields when it starts
    from a language model's folder)."""
    differences = field_differences(configured, hf, "shape", "compute", "context")
    return [
        f"model.{name}={ours!r} vs {_HF_KEY_NAMES.get(name, name)}={theirs!r}"
        for name, ours, theirs in differences
        if name not in _FREE_FIELDS
    ]


def load_hf_weights_into(model: Transformer, path: str | os.PathLike, label: str) -> None:
    """Copy a Hugging Face model folder's weights into an already built ``model``.

    The folder's ``config.json`` must describe the same model as ``model.config`` (the
    shapes, RoPE, norm epsilon, biases and tied embeddings; the context length may
    differ), and its tensors must be exactly the model's. Each tensor is read once and
    cast to the parameter's dtype and device.

    Args:
        model: the model to load into (built from the run's ``model`` config).
        path: the folder with ``config.json`` and ``model.safetensors`` or its shards.
        label: how the caller names the source in errors (``stage.init_from='...'``).

    Raises:
        CheckpointError: naming ``label``: the folder is missing or unsupported, its
            config differs from the configured model (the first differences are
            listed), or its tensors' names or shapes do not fit.
    """
    folder = Path(path).expanduser()
    configured: ModelConfig = model.config
    try:
        hf = model_config_from_hf(
            read_hf_config(folder), name=configured.name, max_seq_len=configured.max_seq_len
        )
        differences = hf_config_mismatches(hf, configured)
        if differences:
            raise CheckpointError(
                f"its {HF_CONFIG_NAME} does not match the configured model "
                f"({len(differences)} difference(s)): "
                + "; ".join(differences)
                + "; leave model= out to take the checkpoint's shape (model=from_init)"
            )
        # a score head starting from a language model's folder: every tensor but the head
        fresh = starts_fresh_head(asdict(configured), asdict(hf))
        names = get_family(configured.family).names.for_head(hf.head)
        no_head = fresh or head_tied(configured)
        checked = checked_tensors(folder, model, names, no_head, "the configured model")
    except CheckpointError as err:
        raise CheckpointError(f"{label}: {err}") from err
    copy_tensors(model.state_dict(), checked)
    _say_dequantized(label, checked, model)


def empty_model(
    config: ModelConfig,
    attention: str = "sdpa",
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Transformer:
    """A model with uninitialised weights on ``device``, to load a checkpoint into.

    Built on the meta device, so no random initialisation runs; the RoPE tables are
    computed (in float32, whatever ``dtype``).
    """
    with torch.device("meta"):
        model = Transformer(config, attention)
    model.to(dtype).to_empty(device=device)
    for name, table in rope_tables(config, model.head_dim, device).items():
        setattr(model, name, table)
    return model


def load_hf_checkpoint(
    path: str | os.PathLike,
    attention: str = "sdpa",
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    max_seq_len: int | None = None,
) -> tuple[Transformer, ModelConfig]:
    """Load a downloaded Hugging Face model folder of a supported family for inference.

    The model is built on the meta device and each tensor is copied into place as it is
    read, so no random initialisation runs and one copy of the weights is held.

    Args:
        path: the folder with ``config.json`` and ``model.safetensors`` or its shards.
        attention: the attention backend (``sdpa`` | ``flex`` | ``flash_attn``).
        dtype: the parameters' dtype; default the dtype the weights are stored in.
        device: where the model lives.
        max_seq_len: the context to build for (see :func:`model_config_from_hf`).

    Returns:
        The model in eval mode and its config.

    Raises:
        CheckpointError: a missing or unsupported folder, or tensors whose names or
            shapes do not fit the config (the first few of each kind are listed).
    """
    folder = Path(path).expanduser()
    config = model_config_from_hf(read_hf_config(folder), name=folder.name, max_seq_len=max_seq_len)
    with torch.device("meta"):  # only its names and shapes
        shapes = Transformer(config, attention)
    names = get_family(config.family).names.for_head(config.head)
    checked = checked_tensors(folder, shapes, names, head_tied(config), f"its {HF_CONFIG_NAME}")
    if dtype is None:
        dtype = DTYPES.get(checked.located["tok_embeddings.weight"][3], torch.float32)
    model = empty_model(config, attention, dtype=dtype, device=device)
    copy_tensors(model.state_dict(), checked)
    _say_dequantized(f"'{folder}'", checked, model)
    return model.eval(), config


def _say_dequantized(label: str, checked: CheckedTensors, model: torch.nn.Module) -> None:
    """The one line telling the user that a quantized folder was read dequantized."""
    method = checked.dequantized
    if method is None:
        return
    count = sum(map(checked.reader.is_packed, {found[1] for found in checked.located.values()}))
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    log.info(
        "%s: %d tensors dequantized from %s to %s at load; an export writes them unquantized",
        label,
        count,
        method,
        "/".join(dtypes),
    )
