"""Quantized Hugging Face folders read as full-precision tensors, one tensor at a time.

A folder whose ``config.json`` has a ``quantization_config`` stores some weights packed
with their scales beside them. Two methods are read, each into the model's dtype as the
tensor is copied into place (never the whole folder at once):

- ``fp8`` with ``weight_block_size: [a, b]`` (DeepSeek-V3, Kimi K2 and other block-scaled
  folders): a weight ``X.weight`` stored as float8 has ``X.weight_scale_inv`` beside it,
  one fp32 factor per ``a x b`` block of its last two dims (the last block of a dim may be
  short: ``ceil(rows / a) x ceil(cols / b)`` factors). The weight is each value times its
  block's factor. Weights stored in another dtype (the modules in
  ``modules_to_not_convert``: embeddings, norms, the router) are read as they are.
- ``mxfp4`` (gpt-oss's experts): ``X_blocks`` (uint8, ``(..., rows, groups, 16)``) holds
  two FP4 E2M1 values per byte, the low nibble first, 32 values per group; ``X_scales``
  (uint8, ``(..., rows, groups)``) a power of two per group, ``2 ** (s - 127)``. The
  unpacked ``(..., rows, 32 * groups)`` is the transpose of the tensor ``X`` the model
  reads (transformers keeps the experts as ``x @ W``), so ``X`` is ``(..., 32 * groups,
  rows)``.

The scale tensors are consumed (never unexpected names), and a folder whose pairs do not
fit (a scale missing, or of the wrong shape) is refused naming the file and tensor. An
export writes the model as it is, unquantized.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from recipes_lib.errors import CheckpointError

FP8_DTYPES = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
FP8_SCALE = "_scale_inv"  # X.weight -> X.weight_scale_inv
MX_BLOCKS, MX_SCALES = "_blocks", "_scales"  # X -> X_blocks, X_scales
MX_GROUP = 32  # FP4 values per shared scale
MX_BIAS = 127  # the scales' exponent bias
# the 16 FP4 E2M1 codes: sign bit, two exponent bits, one mantissa bit
_FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES: tuple[float, ...] = (*_FP4_MAGNITUDES, *(-v for v in _FP4_MAGNITUDES))
_EXACT_DTYPES = (torch.float32, torch.bfloat16)  # hold any FP4 value times 2**k exactly


@dataclass(frozen=True)
class Stored:
    """One tensor as a safetensors file stores it (``dtype`` in safetensors' spelling)."""

    file: Path
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Packed:
    """A tensor the folder stores quantized: its values and scales, and the shape it
    unpacks to."""

    values: Stored
    scales: Stored
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Quantization:
    """How a folder's ``quantization_config`` packs its weights.

    Attributes:
        method: ``fp8`` | ``mxfp4``.
        block: fp8's ``weight_block_size`` (rows, columns); None for mxfp4.
    """

    method: str
    block: tuple[int, int] | None = None

    def describe(self) -> str:
        """How the user is told what was read: ``fp8 (128x128 blocks)``."""
        if self.block is None:
            return f"{self.method} (groups of {MX_GROUP})"
        return f"{self.method} ({self.block[0]}x{self.block[1]} blocks)"

    def unpacked(self, stored: Mapping[str, Stored]) -> tuple[dict[str, Stored], dict[str, Packed]]:
        """The folder's tensors by the name the model reads: those stored as they are,
        and those stored packed (their scales consumed).

        Raises:
            CheckpointError: naming the file and tensor: a value without its scales,
                scales without their values, or scales of the wrong shape or dtype.
        """
        plain = dict(stored)
        packed: dict[str, Packed] = {}
        pair = _fp8_pair if self.method == "fp8" else _mxfp4_pair
        for name, tensor in stored.items():
            found = pair(name, tensor, stored)
            if found is None:
                continue
            logical, values, scales = found
            packed[logical] = Packed(values, scales, self._shape(values, scales))
            plain.pop(values.name, None)
            plain.pop(scales.name, None)
        for tensor in plain.values():
            _refuse_stray(self, tensor)
        return plain, packed

    def _shape(self, values: Stored, scales: Stored) -> tuple[int, ...]:
        if self.block is not None:
            if len(values.shape) < 2:
                raise _unfit(values, f"has shape {values.shape}: fp8 blocks need two dims")
            rows, cols = values.shape[-2:]
            wanted = (*values.shape[:-2], -(-rows // self.block[0]), -(-cols // self.block[1]))
            if scales.shape != wanted:
                raise _unfit(
                    scales,
                    f"has shape {scales.shape}; {values.name} {values.shape} in "
                    f"{self.block[0]}x{self.block[1]} blocks needs {wanted}",
                )
            return values.shape
        if len(values.shape) < 3 or values.shape[-1] != MX_GROUP // 2 or values.dtype != "U8":
            raise _unfit(
                values,
                f"is {values.dtype} {values.shape}: MXFP4 blocks are uint8 "
                f"(..., rows, groups, {MX_GROUP // 2})",
            )
        if scales.shape != values.shape[:-1] or scales.dtype != "U8":
            raise _unfit(
                scales,
                f"is {scales.dtype} {scales.shape}; {values.name} {values.shape} needs uint8 "
                f"{values.shape[:-1]}",
            )
        *lead, rows, groups, _ = values.shape
        return (*lead, groups * MX_GROUP, rows)

    def unpack(
        self, packed: Packed, read: Callable[[Stored], Tensor], dtype: torch.dtype
    ) -> Tensor:
        """The full-precision tensor ``packed`` holds, in ``dtype``; ``read`` gives a
        stored tensor."""
        values, scales = read(packed.values), read(packed.scales)
        if self.block is not None:
            return _unpack_fp8(values, scales, self.block, dtype)
        return _unpack_mxfp4(values, scales, dtype)


def quantization_of(config: Mapping[str, Any]) -> Quantization | None:
    """The quantization a folder's ``config.json`` declares, or None for full-precision
    weights.

    Raises:
        CheckpointError: a method or a setting this library cannot read, in one line.
    """
    settings = config.get("quantization_config")
    if not settings:
        return None
    method = settings.get("quant_method") if isinstance(settings, Mapping) else None
    if method == "mxfp4":
        return Quantization("mxfp4")
    if method != "fp8":
        raise CheckpointError(
            f"quantization_config.quant_method={method!r} is not supported (fp8 with "
            "weight_block_size and mxfp4 are read, dequantized at load); dequantize the folder "
            "first (transformers' from_pretrained with its dequantize option, then save_pretrained)"
        )
    block = settings.get("weight_block_size")
    sizes = block if isinstance(block, list | tuple) else ()
    if not (len(sizes) == 2 and all(_positive(b) for b in sizes)):
        raise CheckpointError(
            f"quantization_config.weight_block_size={block!r}: an fp8 folder is read with its "
            "block scales, two positive sizes ([128, 128]); per-tensor fp8 is not supported"
        )
    scheme = settings.get("activation_scheme", "dynamic")
    fmt = settings.get("scale_fmt", "float")
    if scheme != "dynamic" or fmt != "float":
        key, value = ("activation_scheme", scheme) if scheme != "dynamic" else ("scale_fmt", fmt)
        raise CheckpointError(
            f"quantization_config.{key}={value!r}: fp8 folders are read with dynamic activation "
            "scaling and fp32 weight scales (scale_fmt='float')"
        )
    return Quantization("fp8", (int(sizes[0]), int(sizes[1])))


def dequantized_from(config: Mapping[str, Any]) -> str | None:
    """How a folder of this ``config.json`` is read dequantized (``fp8 (128x128
    blocks)``), or None for a full-precision one."""
    quantization = quantization_of(config)
    return None if quantization is None else quantization.describe()


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _unfit(tensor: Stored, problem: str) -> CheckpointError:
    return CheckpointError(f"'{tensor.file}': {tensor.name} {problem}")


def _fp8_pair(
    name: str, tensor: Stored, stored: Mapping[str, Stored]
) -> tuple[str, Stored, Stored] | None:
    """``(name, values, scales)`` of an fp8 weight, None for any other tensor."""
    if tensor.dtype not in FP8_DTYPES:
        return None
    scales = stored.get(name + FP8_SCALE)
    if scales is None:
        raise _unfit(tensor, f"is {tensor.dtype} (fp8) without its {name}{FP8_SCALE}")
    if not scales.dtype.startswith(("F32", "BF16", "F16")):
        raise _unfit(scales, f"is {scales.dtype}; fp8 block scales are floats (F32)")
    return name, tensor, scales


def _mxfp4_pair(
    name: str, tensor: Stored, stored: Mapping[str, Stored]
) -> tuple[str, Stored, Stored] | None:
    """``(name, blocks, scales)`` of an MXFP4 tensor's blocks, None for any other."""
    if not name.endswith(MX_BLOCKS):
        return None
    logical = name.removesuffix(MX_BLOCKS)
    scales = stored.get(logical + MX_SCALES)
    if scales is None:
        raise _unfit(tensor, f"has no {logical}{MX_SCALES} beside it (MXFP4 scales)")
    return logical, tensor, scales


def _refuse_stray(q: Quantization, tensor: Stored) -> None:
    """Refuse scales left over once every packed tensor took its own."""
    if q.method == "fp8" and tensor.name.endswith(FP8_SCALE):
        weight = tensor.name.removesuffix(FP8_SCALE)
        raise _unfit(tensor, f"scales no fp8 tensor ({weight} is missing or not stored in fp8)")
    if q.method == "mxfp4" and tensor.name.endswith(MX_SCALES):
        blocks = tensor.name.removesuffix(MX_SCALES) + MX_BLOCKS
        raise _unfit(tensor, f"has no {blocks} beside it (MXFP4 blocks)")


def _unpack_fp8(
    values: Tensor, scales: Tensor, block: tuple[int, int], dtype: torch.dtype
) -> Tensor:
    """Each fp8 value times its block's scale, computed in fp32 one row of blocks at a
    time (the fp32 copy of the whole weight is never held)."""
    rows, cols = values.shape[-2:]
    out = torch.empty(values.shape, dtype=dtype)
    for index, start in enumerate(range(0, rows, block[0])):
        stop = min(start + block[0], rows)
        factor = scales[..., index : index + 1, :].float().repeat_interleave(block[1], dim=-1)
        out[..., start:stop, :] = values[..., start:stop, :].float() * factor[..., :cols]
    return out


def _unpack_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """The FP4 values times their group's power of two, transposed to the stored layout
    of the full-precision tensor; each leading slice (an expert) is unpacked on its own."""
    work = dtype if dtype in _EXACT_DTYPES else torch.float32
    table = torch.tensor(FP4_VALUES, dtype=work)
    *lead, rows, groups, width = blocks.shape
    flat_blocks = blocks.reshape(-1, rows, groups, width)
    flat_scales = scales.reshape(-1, rows, groups, 1).to(torch.int32) - MX_BIAS
    out = torch.empty((len(flat_blocks), rows, groups, 2 * width), dtype=dtype)
    for index, (packed, exponent) in enumerate(zip(flat_blocks, flat_scales, strict=True)):
        pairs = torch.stack((table[(packed & 0x0F).long()], table[(packed >> 4).long()]), dim=-1)
        out[index] = torch.ldexp(pairs.flatten(-2), exponent).to(dtype)  # low nibble first
    return out.reshape(*lead, rows, groups * 2 * width).transpose(-2, -1)


class FolderReader:
    """Reads a folder's tensors by the name the model reads, unpacking quantized ones.

    Stored tensors are read from the file already open; a packed one's scales may lie in
    another shard, opened for them alone.
    """

    def __init__(self, quantization: Quantization | None, packed: Mapping[str, Packed]):
        self.quantization = quantization
        self.packed = packed

    def read(self, handle: Any, file: Path, name: str, dtype: torch.dtype) -> Tensor:
        """The tensor ``name`` (opened ``file`` as ``handle``), a packed one in ``dtype``."""
        packed = self.packed.get(name)
        if packed is None or self.quantization is None:
            return handle.get_tensor(name)

        def stored(tensor: Stored) -> Tensor:
            if tensor.file == file:
                return handle.get_tensor(tensor.name)
            with safe_open(str(tensor.file), framework="pt", device="cpu") as other:
                return other.get_tensor(tensor.name)

        return self.quantization.unpack(packed, stored, dtype)

    def is_packed(self, name: str) -> bool:
        return name in self.packed
