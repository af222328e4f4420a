"""An image-text folder written back in its own format, its text tower replaced.

A model trained from an image-text folder (Gemma 3's ``Gemma3ForConditionalGeneration``:
:class:`~recipes_lib.models.families.image_text.ImageText`) is its text tower only. Its
export is the folder it came from (the *base*) with the trained text weights in place:

- ``config.json`` is the base's, byte for byte (image-text, with its vision config);
- each text tensor is written under the name the base stores it by, in the base's
  dtype, with the trained values;
- every other tensor (the vision tower, the projector) is copied from the base's files
  unchanged, bit for bit;
- the tokenizer and processor files (every other file of the base) are copied.

transformers then loads the folder as the image-text model it was, and its text-only
logits are the trained model's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import cast

import torch
from safetensors import safe_open
from torch import Tensor

from recipes_lib.checkpoint.hf import hf_config_mismatches, model_config_from_hf
from recipes_lib.checkpoint.hf_files import (
    DTYPES,
    HF_CONFIG_NAME,
    HF_INDEX_NAME,
    hf_weight_files,
    image_text_of,
    read_folder_config,
    read_hf_config,
    write_safetensors,
)
from recipes_lib.config.schema import ModelConfig
from recipes_lib.errors import CheckpointError
from recipes_lib.files import copy_atomic
from recipes_lib.models.families import get_family
from recipes_lib.models.families.base import expert_slice
from recipes_lib.models.families.image_text import ImageText

_EMBEDDINGS, _HEAD = "model.embed_tokens.weight", "lm_head.weight"  # text model names
_MAX_LISTED = 5  # tensors named in an error message


def image_text_base(path: str | os.PathLike | None) -> ImageText | None:
    """The image-text layout of the Hugging Face folder at ``path``, or None when
    ``path`` is None, not a Hugging Face folder, a folder of a causal LM, or a quantized
    folder (``quantization_config``: its text tower was read dequantized, so the export
    is the text model alone, unquantized, rather than the base with its quantized
    vision tower)."""
    if path is None:
        return None
    folder = Path(path).expanduser()
    if not (folder / HF_CONFIG_NAME).is_file():
        return None
    try:
        config = read_folder_config(folder)
    except CheckpointError:  # not readable: not an image-text folder to write back
        return None
    return None if config.get("quantization_config") else image_text_of(config)


def image_text_dtype(base: str | os.PathLike) -> torch.dtype | None:
    """The dtype an image-text folder stores its text tower in (its first text tensor's),
    or None when it holds none."""
    folder = Path(base).expanduser()
    layout = image_text_base(folder)
    if layout is None:
        return None
    for file in hf_weight_files(folder):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for stored in f.keys():
                if layout.text_name(stored) is not None:
                    return DTYPES.get(f.get_slice(stored).get_dtype())
    return None


def _is_weights(file: Path) -> bool:
    """Whether ``file`` holds weights (or their index), which the export writes anew."""
    return file.suffix in (".safetensors", ".bin") or file.name in (
        HF_INDEX_NAME,
        "pytorch_model.bin.index.json",
    )


def _stacked_experts(
    config: ModelConfig, name: str, text: Mapping[str, Tensor]
) -> tuple[Tensor, list[str]] | None:
    """A base tensor holding every expert at once (Qwen3.5-MoE's published
    ``mlp.experts.gate_up_proj``), made from ``text``'s one tensor per expert, and the
    names it used; None when ``name`` is no such tensor of the family."""
    names = get_family(config.family).names
    found = names.rearranged_parts(name)
    if found is None:
        return None
    layout, parts = found
    stacked, used = [], []
    for part in parts:
        experts = [names.to_hf(expert_slice(part, e)) for e in range(config.moe_experts)]
        if not experts or not all(hf is not None and hf in text for hf in experts):
            return None
        stacked.append(torch.stack([text[cast(str, hf)].detach() for hf in experts]))
        used += [cast(str, hf) for hf in experts]
    return layout.join(stacked), used


def _merged(
    text: Mapping[str, Tensor], base: Path, layout: ImageText, config: ModelConfig
) -> dict[str, Tensor]:
    """The base's tensors in its order and under its names, its text tensors replaced
    by ``text`` (by text model name) in the dtype the base stores each in.

    Raises:
        CheckpointError: a trained text tensor the base has no place for, or a base
            text tensor the trained model does not give.
    """
    ignored = get_family(config.family).names.ignored
    out: dict[str, Tensor] = {}
    placed: set[str] = set()
    left: list[str] = []
    for file in hf_weight_files(base):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for stored in f.keys():
                name = layout.text_name(stored)
                if name is None or ignored.fullmatch(name):
                    out[stored] = f.get_tensor(stored)  # the vision tower, the projector
                    continue
                tied = name == _HEAD and name not in text and config.tie_embeddings
                name = _EMBEDDINGS if tied else name  # a tied head the base stores anyway
                if name not in text:
                    stacked = _stacked_experts(config, name, text)
                    if stacked is None:
                        left.append(stored)
                        continue
                    tensor, used = stacked
                    dtype = DTYPES.get(f.get_slice(stored).get_dtype(), tensor.dtype)
                    out[stored] = tensor.to("cpu", dtype).contiguous()
                    placed.update(used)
                    continue
                dtype = DTYPES.get(f.get_slice(stored).get_dtype(), text[name].dtype)
                tensor = text[name].detach().to("cpu", dtype).contiguous()
                out[stored] = tensor.clone() if tied else tensor  # safetensors: no shared memory
                placed.add(name)
    extra = [name for name in text if name not in placed]
    if left or extra:
        problems = [f"{len(left)} not trained: {', '.join(left[:_MAX_LISTED])}"] if left else []
        if extra:
            problems.append(f"{len(extra)} not in the base: {', '.join(extra[:_MAX_LISTED])}")
        raise CheckpointError(
            f"the model's text tensors do not fit '{base}' ({layout.architecture}): "
            + " | ".join(problems)
        )
    return out


def write_image_text_folder(
    text: Mapping[str, Tensor],
    config: ModelConfig,
    base: str | os.PathLike,
    out_dir: str | os.PathLike,
    max_shard_bytes: int,
) -> Path:
    """Write ``base`` into ``out_dir`` with its text tower's tensors replaced by ``text``
    (the model's tensors under the text model's Hugging Face names, as the family names
    them); see the module docstring.

    Raises:
        CheckpointError: ``base`` is not an image-text folder, its text tower is not
            the model ``config`` describes, or the tensors do not fit it; nothing is
            written then.
    """
    source = Path(base).expanduser()
    folder = Path(out_dir).expanduser()
    layout = image_text_base(source)
    if layout is None:
        raise CheckpointError(f"'{source}' is not an image-text Hugging Face folder")
    theirs = model_config_from_hf(read_hf_config(source), max_seq_len=config.max_seq_len)
    differences = hf_config_mismatches(theirs, config)
    if differences:
        raise CheckpointError(
            f"the model is not the text tower of '{source}' ({layout.architecture}): "
            + "; ".join(differences[:_MAX_LISTED])
        )
    if folder.resolve() == source.resolve():
        raise CheckpointError(f"cannot write '{source}' over itself: choose another folder")
    tensors = _merged(text, source, layout, config)
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, folder, max_shard_bytes)
    for file in sorted(source.iterdir()):
        if file.is_file() and not _is_weights(file):  # config.json, tokenizer, processor
            copy_atomic(file, folder / file.name)
    return folder
