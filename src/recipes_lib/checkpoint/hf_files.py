"""The files of a Hugging Face model folder: ``config.json`` and the safetensors weights
(``model.safetensors``, or shards listed by ``model.safetensors.index.json``), read
tensor by tensor under a family's names, and written in shards.

An image-text folder whose text tower is a family's model (Gemma 3's
``Gemma3ForConditionalGeneration``, :class:`~recipes_lib.models.families.image_text.ImageText`)
reads as that text model: :func:`read_hf_config` gives its text config and
:func:`checked_tensors` its text tensors, the rest of the folder left where it is."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from recipes_lib.checkpoint.dequantize import (
    FolderReader,
    Packed,
    Stored,
    quantization_of,
)
from recipes_lib.checkpoint.weights import mismatch_lines
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.files import chmod_as_umask, untag_float
from recipes_lib.models.families import FAMILIES, TensorNames
from recipes_lib.models.families.base import Rearranged, expert_slice, split_expert_slice
from recipes_lib.models.families.image_text import ImageText

HF_CONFIG_NAME = "config.json"
HF_WEIGHTS_NAME = "model.safetensors"
HF_INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# native name -> (file, Hugging Face name, shape, dtype, rows) of each tensor found; rows:
# the (start, stop) of a native tensor inside a fused one along dim 0, the function that
# takes it out of a rearranged one, else None
Part = tuple[int, int] | Callable[[Tensor], Tensor] | None
Located = dict[str, tuple[Path, str, tuple[int, ...], str, Part]]


def is_hf_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a Hugging Face model folder (a folder holding config.json)."""
    folder = Path(path).expanduser()
    return folder.is_dir() and (folder / HF_CONFIG_NAME).is_file()


def read_folder_config(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``config.json`` of a Hugging Face model folder, as it is written.

    Raises:
        CheckpointError: the folder or its config.json is missing or not JSON.
    """
    folder = Path(path).expanduser()
    file = folder / HF_CONFIG_NAME
    if not folder.is_dir():
        raise CheckpointError(f"no Hugging Face model folder at '{folder}'")
    if not file.is_file():
        raise CheckpointError(f"'{folder}' has no {HF_CONFIG_NAME}; not a Hugging Face model")
    try:  # the floats JSON cannot spell come tagged: {"__float__": "Infinity"}
        config = json.loads(file.read_text(), object_hook=untag_float)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"'{file}' is not readable JSON: {err}") from err
    if not isinstance(config, dict):
        raise CheckpointError(f"'{file}' holds a JSON {type(config).__name__}, not an object")
    return config


def image_text_of(config: Mapping[str, Any]) -> ImageText | None:
    """The image-text folder a family declares for this ``config.json``'s
    ``model_type``, or None for any other folder."""
    layouts = [family.image_text for family in FAMILIES.values() if family.image_text]
    return next((x for x in layouts if x.model_type == config.get("model_type")), None)


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """The ``config.json`` of the causal LM a Hugging Face model folder holds: the file's
    own, or an image-text folder's text tower's (its text config, defaults filled in).

    Raises:
        CheckpointError: the folder or its config.json is missing or not JSON.
        ConfigError: an image-text folder without a text tower a family reads.
    """
    config = read_folder_config(path)
    layout = image_text_of(config)
    if layout is None:
        return config
    text = layout.text_config(config)
    where = f"'{Path(path).expanduser()}' ({layout.architecture})"
    if text is None:
        raise ConfigError(
            f"{where} has no {layout.text_key}: a vision-only folder has no text model to train"
        )
    if text["model_type"] != layout.text_model_type:
        raise ConfigError(
            f"{where}: its {layout.text_key}.model_type={text['model_type']!r} is not "
            f"{layout.text_model_type!r}, the text tower this folder's family trains"
        )
    return text


def hf_weight_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a Hugging Face model folder (shards in index order).

    Raises:
        CheckpointError: no safetensors weights, or an index naming a missing shard.
    """
    folder = Path(path).expanduser()
    index = folder / HF_INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"'{index}' is not a safetensors index: {err}") from err
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"'{index}' names missing shards: {', '.join(missing[:5])}")
        return files
    single = folder / HF_WEIGHTS_NAME
    if single.is_file():
        return [single]
    if any(folder.glob("*.bin")):
        raise CheckpointError(
            f"'{folder}' holds only PyTorch .bin weights; save it with safetensors "
            "(save_pretrained(..., safe_serialization=True))"
        )
    raise CheckpointError(f"'{folder}' has neither {HF_WEIGHTS_NAME} nor {HF_INDEX_NAME}")


def _stored_tensors(files: list[Path]) -> dict[str, Stored]:
    """Every tensor the files hold, by its stored name (headers only: nothing is read)."""
    stored: dict[str, Stored] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    shape = tuple(piece.get_shape())
                    stored[name] = Stored(file, name, shape, piece.get_dtype())
        except Exception as err:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"'{file}' is not a readable safetensors file: {err}") from err
    return stored


def _locate_tensors(
    tensors: Mapping[str, Stored], names: TensorNames, tied: bool, layout: ImageText | None
) -> tuple[Located, Located, list[str]]:
    """native name -> (file, name in the file, shape, dtype, None), the same of the fused
    tensors by their Hugging Face name, and unmapped names. In an image-text folder
    (``layout``) only the text tower's tensors are read, by their text model names. A
    quantized tensor is named as the model reads it (its scales consumed)."""
    located: Located = {}
    fused: Located = {}
    unexpected: list[str] = []
    for stored, tensor in tensors.items():
        hf_name = stored if layout is None else layout.text_name(stored)
        if hf_name is None:
            continue  # not the text tower's: the vision tower, the projector
        native = names.to_native(hf_name)
        combined = names.fused_parts(hf_name) or names.rearranged_parts(hf_name)
        if native is None and combined is None:
            if not names.ignored.fullmatch(hf_name):
                unexpected.append(stored)
            continue
        if tied and native == "output.weight":
            continue  # a tied head stored anyway: the embeddings are the head
        found = (tensor.file, stored, tensor.shape, tensor.dtype, None)
        if native is None:
            fused[hf_name] = found
        else:
            located[native] = found
    return located, fused, unexpected


def _split_fused(
    fused: Located, names: TensorNames, expected: Mapping[str, tuple[int, ...]]
) -> tuple[Located, list[str]]:
    """The native tensors inside each fused one (rows by the expected shapes, in order),
    and the fused tensors that do not stack into them (a line each)."""
    located: Located = {}
    problems: list[str] = []
    for hf_name, (file, stored, shape, dtype, _) in fused.items():
        rearranged = names.rearranged_parts(hf_name)
        if rearranged is not None:
            problems += _locate_rearranged(located, rearranged, fused[hf_name], expected)
            continue
        parts = names.fused_parts(hf_name) or []
        found = [expected.get(part) for part in parts]
        shapes = [s for s in found if s is not None]
        fits = len(shapes) == len(parts) and sum(s[0] for s in shapes) == shape[0]
        if not (fits and all(s[1:] == shape[1:] for s in shapes)):
            model = " + ".join(map(str, found))
            problems.append(f"{stored}: checkpoint {shape} vs model {model} stacked")
            continue
        start = 0
        for part, part_shape in zip(parts, shapes, strict=True):
            located[part] = (file, stored, part_shape, dtype, (start, start + part_shape[0]))
            start += part_shape[0]
    return located, problems


def _nth_part(split: Callable[[Tensor], list[Tensor]], index: int, tensor: Tensor) -> Tensor:
    return split(tensor)[index]


def _nth_expert(
    split: Callable[[Tensor], list[Tensor]], index: int, expert: int, tensor: Tensor
) -> Tensor:
    return split(tensor)[index][expert]


def _stacked_shape(expected: Mapping[str, tuple[int, ...]], part: str) -> tuple[int, ...] | None:
    """The whole shape of a stacked native tensor whose experts ``expected`` holds one by
    one (``(E, ...)``), or None when it holds none of them."""
    count = 0
    while expert_slice(part, count) in expected:
        count += 1
    return (count, *expected[expert_slice(part, 0)]) if count else None


def _locate_rearranged(
    located: Located,
    rearranged: tuple[Rearranged, list[str]],
    found: tuple[Path, str, tuple[int, ...], str, Part],
    expected: Mapping[str, tuple[int, ...]],
) -> list[str]:
    """Locate the native tensors a rearranged one holds (their shapes from its split of
    an empty tensor of its shape); a line if they do not fit the model's. A part the
    model expects expert by expert (a family that also reads one tensor per expert:
    Qwen3.5-MoE) is located as its experts' slices."""
    layout, parts = rearranged
    file, stored, shape, dtype, _ = found
    shapes = [tuple(t.shape) for t in layout.split(torch.empty(shape, device="meta"))]
    wanted = [expected.get(part) or _stacked_shape(expected, part) for part in parts]
    if shapes != wanted:
        return [f"{stored}: checkpoint {shape} holds {shapes} vs model {wanted}"]
    for index, (part, part_shape) in enumerate(zip(parts, shapes, strict=True)):
        if part in expected:
            take = partial(_nth_part, layout.split, index)
            located[part] = (file, stored, part_shape, dtype, take)
            continue
        for expert in range(part_shape[0]):
            take = partial(_nth_expert, layout.split, index, expert)
            located[expert_slice(part, expert)] = (file, stored, part_shape[1:], dtype, take)
    return []


def _mismatches(
    expected: Mapping[str, tuple[int, ...]],
    located: Located,
    unexpected: list[str],
    names: TensorNames,
) -> list[str]:
    shapes = [
        f"{located[name][1]}: checkpoint {located[name][2]} vs model {shape}"
        for name, shape in expected.items()
        if name in located and located[name][2] != shape
    ]
    missing = [names.to_hf(name) or name for name in expected if name not in located]
    unexpected = unexpected + [located[name][1] for name in located if name not in expected]
    return mismatch_lines(shapes, missing, unexpected)


def _past_layer(n_layers: int, name: str) -> bool:
    """Whether a Hugging Face tensor is inside a layer past the model's last one."""
    match = _HF_LAYER_INDEX.match(name)
    return match is not None and int(match[1]) >= n_layers


_HF_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


class CheckedTensors(NamedTuple):
    """A folder's tensors located by native name, and how to read them."""

    located: Located
    reader: FolderReader

    @property
    def dequantized(self) -> str | None:
        """``fp8 (128x128 blocks)`` when the model's tensors are read from quantized ones."""
        quantization = self.reader.quantization
        read = {found[1] for found in self.located.values()}
        if quantization is None or not any(map(self.reader.is_packed, read)):
            return None
        return quantization.describe()


def checked_tensors(
    folder: Path, model: nn.Module, names: TensorNames, tied: bool, what: str
) -> CheckedTensors:
    """The folder's tensors located by native name, after checking that every tensor of
    ``model`` (a tied output head aside) is there with its shape and nothing else is (in
    an image-text folder: nothing else of its text tower). A quantized folder's tensors
    (:mod:`recipes_lib.checkpoint.dequantize`) are checked as they unpack.

    Raises:
        CheckpointError: tensors missing, unexpected or of another shape; quantized
            tensors whose scales are missing or do not fit (naming the file and tensor).
        ConfigError: an image-text folder that holds no text tower's tensors.
    """
    config = read_folder_config(folder)
    layout = image_text_of(config)
    quantization = quantization_of(config)
    stored = _stored_tensors(hf_weight_files(folder))
    if layout is not None:  # the text tower's alone: the vision tower is never read
        stored = {name: t for name, t in stored.items() if layout.text_name(name) is not None}
    packed: dict[str, Packed] = {}
    if quantization is not None:
        plain, packed = quantization.unpacked(stored)
        unpacked = {name: replace(p.values, name=name, shape=p.shape) for name, p in packed.items()}
        stored = {**plain, **unpacked}
    located, fused, unexpected = _locate_tensors(stored, names, tied, layout)
    if names.prediction_layers:  # multi-token prediction past the last layer: skipped
        past = partial(_past_layer, len(getattr(model, "layers", ())))
        located = {name: found for name, found in located.items() if not past(found[1])}
        unexpected = [name for name in unexpected if not past(name)]
    if layout is not None and not (located or fused or unexpected):
        raise ConfigError(
            f"'{folder}' ({layout.architecture}) holds no text tower's tensors (none named "
            + " or ".join(prefix for prefix, _ in layout.text_prefixes)
            + "): a vision-only folder has no text model to train"
        )
    expected: dict[str, tuple[int, ...]] = {}
    for name, t in model.state_dict().items():
        if tied and name == "output.weight":
            continue
        if names.is_stacked(name):  # one Hugging Face tensor per expert
            expected.update({expert_slice(name, e): tuple(t.shape[1:]) for e in range(len(t))})
        else:
            expected[name] = tuple(t.shape)
    split, unfit = _split_fused(fused, names, expected)
    located.update(split)
    problems = unfit + _mismatches(expected, located, unexpected, names)
    if problems:
        raise CheckpointError(f"'{folder}' does not fit {what}: " + " | ".join(problems))
    return CheckedTensors(located, FolderReader(quantization, packed))


def copy_tensors(params: Mapping[str, Tensor], checked: CheckedTensors) -> None:
    """Copy each located tensor into ``params[name]`` (in place, cast to its dtype),
    opening every file once; a quantized one is unpacked into the parameter's dtype, one
    tensor at a time."""
    located, reader = checked
    by_file: dict[Path, list[str]] = {}
    for name, (file, *_) in located.items():
        by_file.setdefault(file, []).append(name)
    with torch.no_grad():
        for file, in_file in by_file.items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                whole: tuple[str, Tensor] | None = None  # the tensor last read whole
                for name in in_file:
                    _, hf_name, _, _, rows = located[name]
                    stacked, expert = split_expert_slice(name)
                    target = params[stacked] if expert is None else params[stacked][expert]
                    if rows is None:
                        tensor = reader.read(f, file, hf_name, target.dtype)
                    elif callable(rows) or reader.is_packed(hf_name):  # a part, read once
                        if whole is None or whole[0] != hf_name:
                            whole = (hf_name, reader.read(f, file, hf_name, target.dtype))
                        tensor = rows(whole[1]) if callable(rows) else whole[1][rows[0] : rows[1]]
                    else:  # its rows of a fused tensor
                        tensor = f.get_slice(hf_name)[rows[0] : rows[1]]
                    target.copy_(tensor)


def write_safetensors(tensors: dict[str, Tensor], folder: Path, max_shard_bytes: int) -> None:
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    for stale in [*folder.glob("model-*-of-*.safetensors"), folder / HF_INDEX_NAME]:
        stale.unlink(missing_ok=True)  # an earlier export's shards
    if len(shards) == 1:
        save_file(shards[0], str(folder / HF_WEIGHTS_NAME), metadata={"format": "pt"})
        chmod_as_umask(folder / HF_WEIGHTS_NAME)
        return
    (folder / HF_WEIGHTS_NAME).unlink(missing_ok=True)
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / file), metadata={"format": "pt"})
        chmod_as_umask(folder / file)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / HF_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
