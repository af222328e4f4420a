"""The storage dtype of an adapted model's frozen base linears (``adapter.base_dtype``).

Under ``precision=bf16-mixed`` autocast runs every linear in bf16: a frozen fp32 weight
is cast to bf16 at each use (and again in each recomputed block), and that cast is what
the matmul saves for the backward. Storing the frozen weights of the blocks' linears in
bf16 once gives the same matmuls, half their memory, and no cast per use; the LoRA
factors, the norms, the embeddings and the head keep the model's dtype.

``auto`` (the default) narrows under ``bf16-mixed`` only; ``bfloat16`` narrows under any
precision but ``fp8`` (whose float8 layers quantise from the weights themselves); the
matmuls of a narrowed linear then run in bf16 also outside autocast, and return the
input's dtype. A merged export restores each weight to the model's dtype (from the bf16
copy: a base saved in fp32 comes back rounded to bf16; a Hugging Face folder saved in
bf16, as most are, comes back as it was).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recipes_lib.errors import ConfigError

# adapter.base_dtype -> the dtype stored (None: as built; auto: see base_storage_dtype)
BASE_DTYPES = {"auto": None, "float32": None, "bfloat16": torch.bfloat16}
NARROWED_UNDER = ("bf16-mixed",)  # precisions where ``auto`` narrows
REFUSED_UNDER = ("fp8",)
# the blocks' linears (wq_a .. wkv_b: multi-head latent attention's; in_qkv .. out_proj:
# linear attention's)
PROJECTIONS = (
    *("wq", "wk", "wv", "wo", "w1", "w2", "w3"),
    *("wq_a", "wq_b", "wkv_a", "wkv_b"),
    *("in_qkv", "in_z", "in_b", "in_a", "out_proj"),
)


class NarrowedLinear(nn.Linear):
    """A frozen linear whose weight is stored in a narrower dtype than the model's.

    Under autocast it is a plain linear (autocast computes in that dtype anyway);
    outside, the input is cast to the weight's dtype and the output back to the input's.
    ``source_dtype`` is the dtype the weight had, which an export restores.
    """

    source_dtype: torch.dtype

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == self.weight.dtype or torch.is_autocast_enabled(x.device.type):
            return super().forward(x)
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)

    @classmethod
    def of(cls, linear: nn.Linear, dtype: torch.dtype) -> NarrowedLinear:
        """A frozen copy of ``linear`` stored in ``dtype`` (on ``linear``'s device)."""
        weight = linear.weight
        narrowed = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            device="meta",
        )
        narrowed.weight = nn.Parameter(weight.detach().to(dtype), requires_grad=False)
        if linear.bias is not None:
            narrowed.bias = nn.Parameter(linear.bias.detach().to(dtype), requires_grad=False)
        narrowed.source_dtype = weight.dtype
        return narrowed


def check_base_dtype(base_dtype: str, precision: str | None) -> None:
    """Refuse an unknown ``adapter.base_dtype``, or ``bfloat16`` under ``fp8``."""
    if base_dtype not in BASE_DTYPES:
        raise ConfigError(f"adapter.base_dtype={base_dtype!r} is not one of {list(BASE_DTYPES)}")
    if base_dtype == "bfloat16" and precision in REFUSED_UNDER:
        raise ConfigError(
            f"adapter.base_dtype=bfloat16 with precision={precision}: float8 layers "
            "quantise from the stored weights; leave adapter.base_dtype=auto under fp8"
        )


def base_storage_dtype(base_dtype: str, precision: str | None) -> torch.dtype | None:
    """The dtype the frozen base linears are stored in, or None to leave them as built."""
    check_base_dtype(base_dtype, precision)
    if base_dtype == "auto":
        return torch.bfloat16 if precision in NARROWED_UNDER else None
    return BASE_DTYPES[base_dtype]


def narrow_frozen_linears(blocks: nn.Module, dtype: torch.dtype) -> int:
    """Store the frozen projections of ``blocks`` (``wq`` .. ``w3``, also as a LoRA
    layer's ``base_layer`` or a shared expert's) in ``dtype`` where they are wider, in
    place; routers and stacked experts stay.

    Returns:
        How many linears were narrowed.
    """
    targets = []  # (parent, name): holding no child, so each replaced one is freed at once
    for parent_name, parent in blocks.named_modules():
        for name, child in parent.named_children():
            owner = parent_name.rsplit(".", 1)[-1] if name == "base_layer" else name
            if owner not in PROJECTIONS or type(child) is not nn.Linear:
                continue  # not a projection, quantized, or narrowed already
            weight = child.weight
            if not weight.requires_grad and weight.dtype.itemsize > dtype.itemsize:
                targets.append((parent, name))  # frozen and wider than ``dtype``
    for parent, name in targets:
        setattr(parent, name, NarrowedLinear.of(getattr(parent, name), dtype))
    return len(targets)


def export_dtype(base: nn.Module, weight: Tensor) -> torch.dtype:
    """The dtype a merged export writes ``base``'s weight in: its source dtype if it
    was narrowed, else its own."""
    return getattr(base, "source_dtype", weight.dtype)
