"""Hugging Face model folders out: ``config.json``, the weights renamed by the model's
family (:mod:`recipes_lib.models.families`) and the tokenizer a run saved beside them.

A language model (``model.head=lm``) is written as the family's ``...ForCausalLM``, which
``transformers.AutoModelForCausalLM`` loads; a reward model (``model.head=score``) as its
``...ForSequenceClassification`` with one label, which
``AutoModelForSequenceClassification`` loads with the same scores: transformers reads a
row's score at its last token that is not ``pad_token_id``, which the export sets to the
EOS token the reward stage's batches pad with, so it reads each sequence's score where
the library does (:func:`recipes_lib.data.preference.collate.score_position`).

A model trained from an image-text folder (``base``: Gemma 3's
``Gemma3ForConditionalGeneration``) is written back in that folder's format, its
vision tower untouched (:mod:`recipes_lib.checkpoint.hf_image_text`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from recipes_lib.checkpoint.hf_files import (
    DEFAULT_MAX_SHARD_BYTES,
    HF_CONFIG_NAME,
    write_safetensors,
)
from recipes_lib.checkpoint.hf_image_text import image_text_base, write_image_text_folder
from recipes_lib.checkpoint.hf_tokenizer import (
    HF_TOKENIZER_CONFIG_NAME,
    first_special_token,
    hf_chat_template,
    read_json,
    token_text,
)
from recipes_lib.config.model import head_tied, head_width
from recipes_lib.config.schema import ModelConfig
from recipes_lib.data.tokenizer import (
    load_tokenizer,
    resolve_tokenizer_file,
    save_tokenizer_folder,
    tokenizer_vocab_size,
)
from recipes_lib.errors import CheckpointError
from recipes_lib.files import write_json_atomic
from recipes_lib.models.families import check_family, get_family
from recipes_lib.models.families.base import common_hf_fields, expert_slice
from recipes_lib.models.rope import check_rope

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_MAX_LISTED = 5  # tensors named in an error message


def hf_config_from_model(
    config: ModelConfig,
    dtype: torch.dtype = torch.float32,
    eos_token_id: int | None = None,
) -> dict[str, Any]:
    """A ``config.json`` for ``transformers``, of the model's family (a score head's as
    its ``...ForSequenceClassification`` with one label). RoPE is written in the
    ``rope_theta``/``rope_scaling`` form that transformers 4 reads and transformers 5
    converts.

    Raises:
        CheckpointError: a score head of a family transformers has no
            ``...ForSequenceClassification`` of.
    """
    family = check_family(config)
    head_dim = head_width(config)
    check_rope(config, head_dim, family.name, family.extended_rope)
    architecture = family.architecture(config.head)
    if architecture is None:
        raise CheckpointError(
            f"model.head={config.head} of model.family={family.name}: transformers has no "
            f"{family.hf_architecture.replace('ForCausalLM', 'ForSequenceClassification')} "
            "to export it as"
        )
    out = {
        "architectures": [architecture],
        "model_type": family.hf_model_types[0],
        **common_hf_fields(config),
        **family.to_hf(config),
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "torch_dtype": _DTYPE_NAMES[dtype],  # transformers 4
        "dtype": _DTYPE_NAMES[dtype],  # transformers 5
    }
    if config.head == "score":  # one label, read before the padding the data used: EOS
        out.update(num_labels=1, pad_token_id=eos_token_id, tie_word_embeddings=False)
    return out


def _hf_state(model: nn.Module | Mapping[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    state = model.state_dict() if isinstance(model, nn.Module) else dict(model)
    names = get_family(config.family).names.for_head(config.head)
    out: dict[str, Tensor] = {}
    fused: dict[str, list[Tensor | None]] = {}
    joins: dict[str, Callable[[list[Tensor]], Tensor]] = {}  # of the rearranged tensors
    unknown = []
    for name, tensor in state.items():
        if head_tied(config) and name == "output.weight":
            continue  # transformers ties lm_head to the embeddings itself
        if names.is_stacked(name):  # every expert's tensor on its own, each with a name
            hf_names = [cast(str, names.to_hf(expert_slice(name, e))) for e in range(len(tensor))]
            out.update(zip(hf_names, tensor, strict=True))
            continue
        hf_name, into = names.to_hf(name), names.fused_of(name)
        layout = names.rearranged_of(name)
        if layout is not None:  # one of the tensors a rearranged one holds
            count = len(layout[2].parts)
            fused.setdefault(layout[0], [None] * count)[layout[1]] = tensor
            joins[layout[0]] = layout[2].join
        elif into is not None:  # one of the tensors a fused one stacks
            fused.setdefault(into[0], [None] * into[2])[into[1]] = tensor
        elif hf_name is None:
            unknown.append(name)
        else:
            out[hf_name] = tensor
    for hf_name, parts in fused.items():
        present = [part for part in parts if part is not None]
        if len(present) < len(parts):
            raise CheckpointError(f"cannot export {hf_name}: the model lacks some of its parts")
        join = joins.get(hf_name)
        out[hf_name] = torch.cat(present, dim=0) if join is None else join(present).contiguous()
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
    base: str | os.PathLike | None = None,
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
        base: the Hugging Face folder the model started from. When it is an
            image-text folder whose text tower the model is, the folder written is
            ``base`` with the trained text weights (in its own dtypes), its
            ``config.json``, vision tower, tokenizer and processor files copied
            through; ``tokenizer_path``, the token and template arguments and
            ``dtype`` are then not used. Any other folder is not read.

    Returns:
        ``out_dir`` as a path.

    Raises:
        CheckpointError: a tensor without a Hugging Face name, a tokenizer larger than
            the model's vocabulary, an EOS token that the tokenizer lacks, or an
            image-text ``base`` whose text tower is not the model.
        DataError: ``tokenizer_path`` holds no tokenizer, or a padding token it lacks.
    """
    folder = Path(out_dir).expanduser()
    hf_config_from_model(config)  # what the family cannot export, before anything is written
    if base is not None and image_text_base(base) is not None:
        text = _hf_state(model, config)
        return write_image_text_folder(text, config, base, folder, max_shard_bytes)
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
