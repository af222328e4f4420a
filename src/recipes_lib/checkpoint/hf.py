"""Hugging Face checkpoints in and out, for every supported model family.

A Hugging Face model folder holds ``config.json`` and its weights as ``model.safetensors``
or as shards listed by ``model.safetensors.index.json``. Its ``model_type`` picks the
family (:mod:`recipes_lib.models.families`), whose adapter maps the config and renames
the tensors; the files themselves are :mod:`recipes_lib.checkpoint.hf_files`'s and the
tokenizer :mod:`recipes_lib.checkpoint.hf_tokenizer`'s.

:func:`load_hf_checkpoint` reads a downloaded folder into a model; :func:`load_hf_weights_into`
fills a model built from a run's config (``stage.init_from=<folder>``) after checking that
the folder's ``config.json`` describes it; :func:`export_hf_checkpoint` writes one that
``transformers.AutoModelForCausalLM.from_pretrained`` loads, with the tokenizer and chat
template a run saved beside it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from recipes_lib.checkpoint.hf_files import (
    DEFAULT_MAX_SHARD_BYTES,
    DTYPES,
    HF_CONFIG_NAME,
    checked_tensors,
    copy_tensors,
    is_hf_folder,
    read_hf_config,
    write_safetensors,
)
from recipes_lib.checkpoint.hf_tokenizer import (
    HF_TOKENIZER_CONFIG_NAME,
    first_special_token,
    hf_chat_template,
    read_json,
    token_text,
)
from recipes_lib.config.schema import ModelConfig, resolved_model_fields
from recipes_lib.data.tokenizer import (
    load_tokenizer,
    resolve_tokenizer_file,
    save_tokenizer_folder,
    tokenizer_vocab_size,
)
from recipes_lib.errors import CheckpointError
from recipes_lib.files import write_json_atomic
from recipes_lib.models import Transformer
from recipes_lib.models.families import check_family, family_of_hf, get_family
from recipes_lib.models.families.base import common_hf_fields, expert_slice
from recipes_lib.models.rope import check_rope, rope_tables

log = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_MAX_LISTED = 5  # tensors named in an error message
__all__ = [
    "export_hf_checkpoint",
    "hf_config_from_model",
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
    fields = {"family": family.name, **family.fixed, **family.from_hf(config)}
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
    name = name or config.get("_name_or_path") or model_type
    return ModelConfig(name=name, max_seq_len=int(max_seq_len), **fields)


def hf_config_from_model(
    config: ModelConfig, dtype: torch.dtype = torch.float32, eos_token_id: int | None = None
) -> dict[str, Any]:
    """A ``config.json`` for ``transformers``, of the model's family. RoPE is written in
    the ``rope_theta``/``rope_scaling`` form that transformers 4 reads and transformers 5
    converts."""
    family = check_family(config)
    head_dim = config.head_dim or config.dim // config.n_heads
    check_rope(config, head_dim, family.name, family.extended_rope)
    return {
        "architectures": [family.hf_architecture],
        "model_type": family.hf_model_types[0],
        **common_hf_fields(config),
        **family.to_hf(config),
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "torch_dtype": _DTYPE_NAMES[dtype],  # transformers 4
        "dtype": _DTYPE_NAMES[dtype],  # transformers 5
    }


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
}
# Everything that decides what the weights compute must match a checkpoint's config;
# the context length may differ (RoPE tables are built for whatever is configured).
_FREE_FIELDS = ("max_seq_len",)


def hf_config_mismatches(hf: ModelConfig, configured: ModelConfig) -> list[str]:
    """``model.<key>=<ours> vs <config.json key>=<theirs>`` for every field in which a
    Hugging Face model's config differs from the configured model's (label fields and
    ``max_seq_len`` are free to differ)."""
    roles = ("shape", "compute", "context")
    ours, theirs = resolved_model_fields(configured, *roles), resolved_model_fields(hf, *roles)
    return [
        f"model.{name}={ours[name]!r} vs {_HF_KEY_NAMES.get(name, name)}={theirs[name]!r}"
        for name in ours
        if name not in _FREE_FIELDS and ours[name] != theirs[name]
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
        names = get_family(configured.family).names
        located = checked_tensors(
            folder, model, names, configured.tie_embeddings, "the configured model"
        )
    except CheckpointError as err:
        raise CheckpointError(f"{label}: {err}") from err
    copy_tensors(model.state_dict(), located)


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
    names = get_family(config.family).names
    located = checked_tensors(folder, shapes, names, config.tie_embeddings, f"its {HF_CONFIG_NAME}")
    if dtype is None:
        dtype = DTYPES.get(located["tok_embeddings.weight"][3], torch.float32)
    model = empty_model(config, attention, dtype=dtype, device=device)
    copy_tensors(model.state_dict(), located)
    return model.eval(), config


# ----------------------------------------------------------------------- export
def _hf_state(model: nn.Module | Mapping[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    state = model.state_dict() if isinstance(model, nn.Module) else dict(model)
    names = get_family(config.family).names
    out: dict[str, Tensor] = {}
    fused: dict[str, list[Tensor | None]] = {}
    unknown = []
    for name, tensor in state.items():
        if config.tie_embeddings and name == "output.weight":
            continue  # transformers ties lm_head to the embeddings itself
        if names.is_stacked(name):  # every expert's tensor on its own
            out.update({names.to_hf(expert_slice(name, e)): t for e, t in enumerate(tensor)})
            continue
        hf_name, into = names.to_hf(name), names.fused_of(name)
        if into is not None:  # one of the tensors a fused one stacks
            fused.setdefault(into[0], [None] * into[2])[into[1]] = tensor
        elif hf_name is None:
            unknown.append(name)
        else:
            out[hf_name] = tensor
    for hf_name, parts in fused.items():
        if any(part is None for part in parts):
            raise CheckpointError(f"cannot export {hf_name}: the model lacks some of its parts")
        out[hf_name] = torch.cat(parts, dim=0)
    if unknown:
        raise CheckpointError(
            f"cannot export {len(unknown)} tensor(s) with no Hugging Face name: "
            + ", ".join(unknown[:_MAX_LISTED])
        )
    return out


def export_hf_checkpoint(
    model: nn.Module | Mapping[str, Tensor],
    config: ModelConfig,
    out_dir: str | os.PathLike,
    tokenizer_path: str | os.PathLike | None = None,
    *,
    eos_token: str | None = None,
    pad_token: str | None = None,
    chat_template: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a Hugging Face model folder that ``transformers`` loads.

    Writes ``config.json``, the weights (``model.safetensors``, or shards of at most
    ``max_shard_bytes`` each with ``model.safetensors.index.json``; an earlier export's
    weight files in ``out_dir`` are replaced) and, with a tokenizer, ``tokenizer.json``
    and a ``tokenizer_config.json`` naming the EOS and padding tokens and the chat template.

    Args:
        model: a :class:`~recipes_lib.models.Transformer` or its state dict.
        config: the model's shape.
        out_dir: the folder to write (created if needed).
        tokenizer_path: a tokenizer.json, or a folder holding one, to copy (an SFT or
            DPO run's output folder carries the tokenizer and chat template it used).
        eos_token: the end-of-sequence token; default the one the tokenizer_config.json
            beside the tokenizer names, else the tokenizer's first special token.
        pad_token: the padding token; default the one the tokenizer_config.json beside
            the tokenizer names, else the EOS token (what the chat and preference data
            pad with).
        chat_template: a Jinja chat template for ``tokenizer.apply_chat_template``;
            default the one saved beside the tokenizer (see :func:`hf_chat_template`).
        max_shard_bytes: the largest shard.
        dtype: the dtype to store; default the model's.

    Returns:
        ``out_dir`` as a path.

    Raises:
        CheckpointError: a tensor without a Hugging Face name, a tokenizer larger than
            the model's vocabulary, or an EOS token that the tokenizer lacks.
        DataError: ``tokenizer_path`` holds no tokenizer, or a padding token it lacks.
    """
    folder = Path(out_dir).expanduser()
    hf_config_from_model(config)  # what the family cannot export, before anything is written
    tensors = {
        name: t.detach().to("cpu", dtype or t.dtype).contiguous()
        for name, t in _hf_state(model, config).items()
    }
    stored_dtype = dtype or tensors["model.embed_tokens.weight"].dtype
    eos_id = None
    if tokenizer_path is not None:
        tokenizer = load_tokenizer(tokenizer_path, key="tokenizer_path")
        if tokenizer_vocab_size(tokenizer) > config.vocab_size:
            raise CheckpointError(
                f"the tokenizer '{tokenizer_path}' has {tokenizer_vocab_size(tokenizer)} "
                f"tokens, more than model.vocab_size={config.vocab_size}"
            )
        # a run's output folder carries the template and EOS token it trained with
        beside = resolve_tokenizer_file(tokenizer_path, key="tokenizer_path").parent
        if chat_template is None:
            chat_template = hf_chat_template(beside)
        eos_token = eos_token or token_text(
            read_json(beside / HF_TOKENIZER_CONFIG_NAME).get("eos_token")
        )
        eos_token = eos_token or first_special_token(tokenizer)
        eos_id = tokenizer.token_to_id(eos_token) if eos_token is not None else None
        if eos_token is not None and eos_id is None:
            raise CheckpointError(f"eos_token={eos_token!r} is not a token of '{tokenizer_path}'")
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, folder, max_shard_bytes)
    hf_config = hf_config_from_model(config, stored_dtype, eos_id)
    write_json_atomic(folder / HF_CONFIG_NAME, hf_config)
    if tokenizer_path is not None:
        save_tokenizer_folder(
            folder,
            tokenizer_path,
            eos_token=eos_token,
            pad_token=pad_token,
            chat_template=chat_template,
            model_max_length=config.max_seq_len,
        )
    return folder
