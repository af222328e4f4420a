"""The bytes of optimizer state each choice keeps for one parameter.

Each function here answers for one optimizer choice, from the parameter's shape, dtype and
group alone (a meta-device model is enough), what ``optimizer.state`` will hold for it
after the first step. The figures follow the state each class makes:

- ``torch.optim.AdamW``: ``exp_avg`` and ``exp_avg_sq`` in the parameter's dtype
  (``max_exp_avg_sq`` too with ``amsgrad``) and a 0-d fp32 ``step``;
- ``torch.optim.Adafactor``: a 0-d fp32 ``step``; for a matrix (or a stack of them) a row
  factor and a column factor of its second moment, in the parameter's dtype; for a vector
  its whole second moment;
- ``torch.optim.Muon``: one ``momentum_buffer`` the size of its matrix; the rest is AdamW's;
- bitsandbytes' ``AdamW8bit``: from ``min_8bit_size`` elements, two uint8 moments and one
  fp32 absmax per block of each (blocks of 256, 2048 before bitsandbytes 0.46), plus two
  256-entry fp32 quantization maps shared by every parameter on a device; below it, two
  fp32 moments. Its ``step`` is a Python int.

None of them keeps an fp32 master copy of the weights. ``tests/unit/optim`` checks every
function against the state a real step makes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

STEP_BYTES = 4  # the 0-d fp32 step count torch's optimizers keep per parameter
# bitsandbytes' 8-bit optimizers (bitsandbytes.optim.optimizer.Optimizer2State)
MIN_8BIT_SIZE = 4096  # its min_8bit_size default: smaller tensors get fp32 moments
QMAP_BYTES = 256 * 4  # one quantization map: 256 fp32 code values
BLOCKWISE_BLOCK = 256  # elements per absmax block since bitsandbytes 0.46
OLD_BLOCKWISE_BLOCK = 2048  # before 0.46
PERCENTILE_HISTORY_BYTES = 100 * 4  # percentile_clipping's last 100 gradient norms


@dataclass(frozen=True)
class ParameterInfo:
    """What an optimizer's state depends on, for one trainable parameter.

    Attributes:
        shape: the parameter's shape (under sharding, the local shard's).
        dtype: the parameter's dtype.
        group: its weight-decay group, ``decay`` or ``no_decay``.
        outer: it is an embedding table or the output head.
    """

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    group: str = "decay"
    outer: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def takes_muon(ndim: int, group: str, outer: bool) -> bool:
    """Whether ``optim.name=muon`` gives a parameter to Muon: the blocks' decayed 2-D
    matrices. Embeddings, the output head, norms, biases and stacked 3-D experts go to
    AdamW."""
    return group == "decay" and ndim == 2 and not outer


def adamw_state(param: ParameterInfo, args: Mapping[str, Any]) -> int:
    moments = 3 if args.get("amsgrad") else 2
    return moments * param.numel * param.itemsize + STEP_BYTES


def adafactor_state(param: ParameterInfo, args: Mapping[str, Any]) -> int:
    shape = param.shape
    if len(shape) < 2:
        return param.numel * param.itemsize + STEP_BYTES
    rows = math.prod(shape[:-1])  # reduced over the last dimension
    cols = math.prod(shape[:-2]) * shape[-1]  # reduced over the one before
    return (rows + cols) * param.itemsize + STEP_BYTES


def muon_state(param: ParameterInfo, args: Mapping[str, Any]) -> int:
    if takes_muon(len(param.shape), param.group, param.outer):
        return param.numel * param.itemsize
    return adamw_state(param, {})  # the AdamW part takes no optim.args


def adamw_8bit_state(param: ParameterInfo, args: Mapping[str, Any]) -> int:
    n = param.numel
    extra = 0
    if args.get("percentile_clipping", 100) < 100:
        extra += PERCENTILE_HISTORY_BYTES
    if args.get("max_unorm", 0.0) > 0.0:
        extra += 4
    if n < args.get("min_8bit_size", MIN_8BIT_SIZE):
        return 2 * n * 4 + extra
    blocks = -(-n // bitsandbytes_block())
    return 2 * n + 2 * blocks * 4 + extra


def adamw_8bit_shared(params: list[ParameterInfo], args: Mapping[str, Any]) -> int:
    """The two quantization maps, once, where any parameter is stored in 8 bits."""
    least = args.get("min_8bit_size", MIN_8BIT_SIZE)
    return 2 * QMAP_BYTES if any(p.numel >= least for p in params) else 0


def bitsandbytes_block() -> int:
    """Elements per absmax block of the installed bitsandbytes (the current size when it
    is not installed, as on a machine that only plans a run)."""
    from importlib import metadata

    try:
        version = metadata.version("bitsandbytes")
    except metadata.PackageNotFoundError:
        return BLOCKWISE_BLOCK
    major, minor = (int(part) for part in version.split(".")[:2])
    return BLOCKWISE_BLOCK if (major, minor) >= (0, 46) else OLD_BLOCKWISE_BLOCK


def measured_state(cls: type[torch.optim.Optimizer], args: Mapping[str, Any]):
    """The state function of any other ``torch.optim`` class, measured once: one step
    over two probe parameters of different sizes gives its bytes per element and its
    fixed bytes per parameter (exact for element-wise optimizers: SGD, RAdam, NAdam,
    Adagrad, RMSprop, ...)."""
    probes = [torch.nn.Parameter(torch.zeros(n)) for n in (64, 192)]
    optimizer = cls([{"params": [p]} for p in probes], **dict(args))
    for p in probes:
        p.grad = torch.ones_like(p)
    # torch types a closure's loss as a float; a closure returns its loss tensor
    optimizer.step(lambda: torch.zeros(()))  # type: ignore[arg-type, return-value]
    small, large = (tensor_bytes(optimizer.state.get(p, {}).values()) for p in probes)
    per_element = (large - small) / (192 - 64)  # bytes per fp32 element
    fixed = small - 64 * per_element

    def state(param: ParameterInfo, _: Mapping[str, Any]) -> int:
        return int(per_element * param.numel * param.itemsize / 4 + fixed)

    return state


def tensor_bytes(values: Any) -> int:
    """Bytes of the tensors among ``values``."""
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def optimizer_state_storage(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state``, each storage counted once (8-bit
    AdamW's quantization maps are one tensor shared by every parameter): what a real
    step made, to hold the estimates above against."""
    seen, total = set(), 0
    for entry in optimizer.state.values():
        for value in entry.values():
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
    return total
