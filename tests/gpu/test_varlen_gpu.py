"""PyTorch's FlashAttention-2 for variable-length rows (``kernels.attention=varlen``) on a
GPU (``pytest -m gpu``): outputs and gradients against fp32 attention over the same
documents and windows, with grouped-query heads; a Gemma-like model on it gives flex's
loss and gradients; compiled blocks take a bounded number of graphs on batches whose
documents and rows vary, in training and no-grad passes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_helpers import GEMMA_LIKE_SEQ, gemma_like_pair

from recipes_lib.kernels import get_attention_backend
from recipes_lib.kernels.compiled import watch_compiles
from recipes_lib.models import Transformer

pytestmark = pytest.mark.gpu


def _needs_varlen():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    reason = get_attention_backend("varlen").unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def _doc_ids(lengths_per_row: list[list[int]]) -> torch.Tensor:
    rows = []
    for lengths in lengths_per_row:
        rows.append(torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]))
    return torch.stack(rows).cuda()


def _reference(q, k, v, doc_ids, window):
    """fp32 attention through one dense boolean mask: causal, within each document and
    (with ``window``) the ``window`` keys ending at the query."""
    T = q.shape[2]
    pos = torch.arange(T, device=q.device)
    allowed = pos[None, :] <= pos[:, None]  # (T, T): key <= query
    if window is not None:
        allowed = allowed & (pos[:, None] - pos[None, :] < window)
    mask = allowed[None] & (doc_ids[:, :, None] == doc_ids[:, None, :])  # (B, T, T)
    q, k, v = (x.float() for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)


@pytest.mark.parametrize("window", [None, 48], ids=["global", "window48"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "documents"])
def test_varlen_matches_fp32_attention_forward_and_backward(window, packed):
    _needs_varlen()
    backend = get_attention_backend("varlen")
    backend.check(device="cuda", dtype=torch.bfloat16, document_mask=packed)
    torch.manual_seed(0)
    B, H, Hkv, T, D = 2, 8, 2, 320, 64
    q = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, Hkv, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, Hkv, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    # boundaries off any block size, one document longer than the window
    lengths = [[100, 7, 150, 63], [320]] if packed else [[T], [T]]
    doc_ids = _doc_ids(lengths)
    mask = backend.build_mask(doc_ids if packed else None, T, device="cuda", window=window)
    out = backend(q, k, v, mask)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref_inputs = [x.detach().float().requires_grad_() for x in (q, k, v)]
    ref = _reference(*ref_inputs, doc_ids, window)
    expected = torch.autograd.grad(ref, ref_inputs, grad.float())
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    for name, a, b in zip("qkv", got, expected, strict=True):
        torch.testing.assert_close(a.float(), b, atol=5e-2, rtol=5e-2, msg=f"grad of {name}")


SEQ = GEMMA_LIKE_SEQ


def _pair(compiled: bool, varying: bool = False) -> tuple[Transformer, Transformer]:
    """The Gemma-like model on varlen, and the same weights on flex."""
    return gemma_like_pair("varlen", compiled=compiled, varying=varying)


def _loss_and_grads(model, x, doc_ids):
    model.zero_grad(set_to_none=True)
    loss = model(x, doc_ids, labels=x)
    loss.backward()
    return loss.float().item(), {n: p.grad.float() for n, p in model.named_parameters()}


def test_varlen_gives_flexs_loss_and_gradients():
    _needs_varlen()
    varlen_model, flex = _pair(compiled=False)
    assert {layer.attention.backend.name for layer in varlen_model.blocks} == {"varlen"}
    x = torch.randint(0, varlen_model.config.vocab_size, (2, SEQ), device="cuda")
    doc_ids = _doc_ids([[300, 212], [17, 400, 95]])
    loss, grads = _loss_and_grads(varlen_model, x, doc_ids)
    flex_loss, flex_grads = _loss_and_grads(flex, x, doc_ids)
    assert abs(loss - flex_loss) < 2e-2 * max(1.0, abs(flex_loss)), (loss, flex_loss)
    for name, grad in grads.items():
        ref = flex_grads[name]
        error = (grad - ref).norm() / ref.norm().clamp_min(1e-6)
        assert error < 5e-2, (name, error.item())


def test_compiled_varlen_blocks_take_few_graphs_on_varying_batches():
    """Forty batches of 2-4 rows, each row holding 1-9 documents of random lengths, in
    training and no-grad passes: each kind of block (local, global) x kind of call
    (training, no grad) takes at most two graphs, all in the first steps, and none hits
    dynamo's limit."""
    _needs_varlen()
    torch._dynamo.reset()
    varlen_model, _ = _pair(compiled=True, varying=True)
    generator = torch.Generator().manual_seed(0)

    def steps(n: int) -> None:
        for _ in range(n):
            rows = int(torch.randint(2, 5, (), generator=generator))
            lengths = []
            for _ in range(rows):
                cuts = torch.randint(1, SEQ, (int(torch.randint(0, 9, (), generator=generator)),))
                edges = sorted({0, SEQ, *cuts.tolist()})
                lengths.append([b - a for a, b in zip(edges, edges[1:], strict=False)])
            doc_ids = _doc_ids(lengths)
            x = torch.randint(0, varlen_model.config.vocab_size, (rows, SEQ), device="cuda")
            varlen_model(x, doc_ids, labels=x).backward()
            with torch.no_grad():
                varlen_model(x, doc_ids, labels=x)

    with watch_compiles() as first:
        steps(5)
    with watch_compiles() as later:
        steps(35)
    # two block kinds (the local blocks share one, the global one) x two kinds of call,
    # the documents' offsets traced dynamic from the first call
    assert first.graphs <= 8 and first.recompile_limit_hits == 0, first.as_dict()
    assert later.graphs == 0 and later.recompile_limit_hits == 0, later.as_dict()
