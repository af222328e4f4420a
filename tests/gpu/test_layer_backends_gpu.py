"""A backend per kind of attention layer on a GPU (``pytest -m gpu``): a Gemma-3-like
model with ``kernels.attention=auto`` (flex's compiled kernel in the local layers, SDPA's
flash kernel in the global ones) gives flex-only's loss and gradients within bf16's
rounding, eagerly and with every block compiled, and with packed documents (every kind
on flex then)."""

from __future__ import annotations

import pytest
import torch
from gpu_helpers import GEMMA_LIKE_SEQ, gemma_like_pair

from recipes_lib.kernels import choose_attention
from recipes_lib.models import Transformer

pytestmark = pytest.mark.gpu

SEQ = GEMMA_LIKE_SEQ


def _models(attention, compiled: bool) -> tuple[Transformer, Transformer]:
    """The Gemma-like model on ``attention`` and the same weights on flex alone."""
    return gemma_like_pair(attention, compiled=compiled)


def _loss_and_grad_norm(model: Transformer, x: torch.Tensor, doc_ids=None):
    model.zero_grad(set_to_none=True)
    loss = model(x, doc_ids, labels=x)
    loss.backward()
    norm = torch.linalg.vector_norm(
        torch.stack([p.grad.float().norm() for p in model.parameters() if p.grad is not None])
    )
    return loss.float().item(), norm.item()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_auto_matches_flex_only_within_bf16(compiled):
    mixed, flex = _models("auto", compiled)
    names = [layer.attention.backend.name for layer in mixed.blocks]
    assert names == ["flex"] * 5 + ["sdpa"]
    x = torch.randint(0, mixed.config.vocab_size, (4, SEQ), device="cuda")
    for _ in range(2):  # a compiled block's first call compiles, the second reuses it
        loss, norm = _loss_and_grad_norm(mixed, x)
        flex_loss, flex_norm = _loss_and_grad_norm(flex, x)
        assert abs(loss - flex_loss) < 2e-2 * max(1.0, abs(flex_loss)), (loss, flex_loss)
        assert abs(norm - flex_norm) < 5e-2 * flex_norm, (norm, flex_norm)


def test_auto_with_packed_documents_matches_flex_only():
    mixed, flex = _models(choose_attention("auto", document_mask=True), compiled=False)
    assert {layer.attention.backend.name for layer in mixed.blocks} == {"flex"}
    x = torch.randint(0, mixed.config.vocab_size, (2, SEQ), device="cuda")
    doc_ids = torch.zeros_like(x)
    doc_ids[:, 300:] = 1  # two documents a row, the first longer than the window
    loss, _ = _loss_and_grad_norm(mixed, x, doc_ids)
    flex_loss, _ = _loss_and_grad_norm(flex, x, doc_ids)
    assert abs(loss - flex_loss) < 1e-3, (loss, flex_loss)
