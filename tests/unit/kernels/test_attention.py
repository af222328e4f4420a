import math
import sys
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from recipes_lib.errors import ConfigError, UnsupportedKernelError
from recipes_lib.kernels import (
    ATTENTION_BACKENDS,
    AttentionBackend,
    FlashAttention,
    get_attention_backend,
)
from recipes_lib.kernels import flash as flash_module

DOC_LENGTHS = (5, 17, 9)  # three documents packed into one row of 31 tokens


def naive_attention(q, k, v, allowed):
    """Masked softmax attention; ``allowed`` broadcasts to (B, H, T, T)."""
    repeat = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(repeat, dim=1)  # (B, H, T, D)
    v = v.repeat_interleave(repeat, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(dim=-1) @ v


def causal_mask(T):
    return torch.ones(T, T, dtype=torch.bool).tril()


def doc_ids_for(lengths, batch=1):
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return ids.unsqueeze(0).repeat(batch, 1)  # (B, T)


def random_qkv(B, H, Hkv, T, D, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    shapes = ((B, H, T, D), (B, Hkv, T, D), (B, Hkv, T, D))
    return tuple(torch.randn(s, generator=g).to(device=device, dtype=dtype) for s in shapes)


def run(backend: AttentionBackend, q, k, v, doc_ids=None):
    mask = backend.build_mask(doc_ids, q.shape[2], device=q.device)
    return backend(q, k, v, mask)


@pytest.mark.parametrize("name", ["sdpa", "flex"])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_causal_attention_matches_naive_reference(name, heads):
    H, Hkv = heads
    q, k, v = random_qkv(2, H, Hkv, 37, 16)
    out = run(get_attention_backend(name), q, k, v)
    assert out.shape == (2, H, 37, 16)
    torch.testing.assert_close(out, naive_attention(q, k, v, causal_mask(37)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
def test_flex_packed_documents_equal_documents_run_alone(heads):
    H, Hkv = heads
    T = sum(DOC_LENGTHS)
    q, k, v = random_qkv(1, H, Hkv, T, 16)
    packed = run(get_attention_backend("flex"), q, k, v, doc_ids_for(DOC_LENGTHS))
    start = 0
    for n in DOC_LENGTHS:
        doc = slice(start, start + n)
        alone = naive_attention(q[:, :, doc], k[:, :, doc], v[:, :, doc], causal_mask(n))
        torch.testing.assert_close(packed[:, :, doc], alone, atol=1e-5, rtol=1e-5)
        start += n
    # Without doc_ids the later documents see the earlier ones: the mask matters.
    unmasked = run(get_attention_backend("flex"), q, k, v)
    assert not torch.allclose(unmasked[:, :, DOC_LENGTHS[0] :], packed[:, :, DOC_LENGTHS[0] :])


def test_flex_document_mask_differs_per_row_and_backpropagates():
    doc_ids = torch.stack([doc_ids_for(DOC_LENGTHS)[0], doc_ids_for((20, 11))[0]])  # (2, 31)
    q, k, v = random_qkv(2, 4, 2, 31, 8)
    allowed = causal_mask(31) & (doc_ids[:, :, None] == doc_ids[:, None, :])  # (2, T, T)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = run(get_attention_backend("flex"), q, k, v, doc_ids)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    expected = naive_attention(q, k, v, allowed[:, None])
    expected_grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_flex_block_mask_drives_torch_flex_attention():
    # The BlockMask is what the CUDA path hands to flex_attention; check it there too.
    backend = get_attention_backend("flex")
    doc_ids = doc_ids_for(DOC_LENGTHS, batch=2)
    q, k, v = random_qkv(2, 4, 2, sum(DOC_LENGTHS), 16)
    mask = backend.build_mask(doc_ids, q.shape[2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    torch.testing.assert_close(backend(q, k, v, mask), reference, atol=1e-5, rtol=1e-5)


def test_a_compiled_region_calls_flex_itself_and_eager_code_the_compiled_one():
    # Inside a compiled region flex is the operator itself, which the region's graph
    # takes in: calling flex compiled on its own there broke a block's graph (torch 2.11
    # on a GPU, which tests/gpu/test_late_row_count_gpu.py checks). And when the first
    # call came from there, the old code stored the plain operator as the compiled one,
    # so every later eager call ran flex uncompiled: the last two lines fail on it.
    from recipes_lib.kernels.attention import compiled_flex

    inside = []

    @torch.compile(backend="eager", fullgraph=True)
    def block(x):
        inside.append(compiled_flex())
        return x * 2

    block(torch.ones(2))
    torch._dynamo.reset()
    assert inside == [flex_attention]
    assert compiled_flex() is not flex_attention  # eager code: flex compiled once
    assert compiled_flex() is compiled_flex()


def test_flex_reuses_the_causal_block_mask():
    backend = get_attention_backend("flex")
    assert backend.build_mask(None, 64) is backend.build_mask(None, 64)
    assert backend.build_mask(None, 64) is not backend.build_mask(None, 32)


def test_sdpa_refuses_document_mask():
    sdpa = get_attention_backend("sdpa")
    sdpa.check(device=torch.device("cpu"), dtype=torch.bfloat16, document_mask=False)
    with pytest.raises(UnsupportedKernelError, match="kernels.attention=flex") as err:
        sdpa.check(device=torch.device("cpu"), dtype=torch.float32, document_mask=True)
    assert "sdpa" in str(err.value)
    with pytest.raises(UnsupportedKernelError, match="kernels.attention=flex"):
        sdpa.build_mask(doc_ids_for(DOC_LENGTHS), sum(DOC_LENGTHS))


def test_flex_accepts_document_mask_on_cpu():
    get_attention_backend("flex").check(device="cpu", dtype=torch.float32, document_mask=True)


def test_unknown_backend_lists_the_choices():
    with pytest.raises(ConfigError) as err:
        get_attention_backend("xformers")
    message = str(err.value)
    assert "kernels.attention='xformers'" in message
    assert all(name in message for name in ATTENTION_BACKENDS)
    assert set(ATTENTION_BACKENDS) == {"sdpa", "flex", "varlen", "flash_attn"}


def test_flash_attn_refuses_cpu_and_fp32_with_a_clear_message():
    flash = get_attention_backend("flash_attn")
    with pytest.raises(UnsupportedKernelError) as err:
        flash.check(device=torch.device("cpu"), dtype=torch.float32, document_mask=False)
    message = str(err.value)
    assert "kernels.attention=flash_attn" in message
    assert "'cpu'" in message and "cuda" in message
    assert "float32" in message and "bfloat16" in message and "float16" in message
    if flash.unavailable_reason() is not None:
        assert "pip install recipes-lib[flash]" in message


def test_flash_attn_missing_package_is_reported(monkeypatch):
    monkeypatch.setattr(flash_module, "_flash_attn_module", None)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes the import fail
    flash = FlashAttention()
    reason = flash.unavailable_reason()
    assert reason is not None and "pip install recipes-lib[flash]" in reason
    with pytest.raises(UnsupportedKernelError, match=r"recipes-lib\[flash\]"):
        flash.check(device="cuda", dtype=torch.bfloat16, document_mask=False)


def _fake_flash_attn() -> types.ModuleType:
    """flash_attn's two entry points, per its documented layout, in plain torch."""

    def flash_attn_func(q, k, v, causal=False):  # (B, T, heads, D)
        assert causal
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        return naive_attention(q, k, v, causal_mask(q.shape[2])).transpose(1, 2)

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=False):
        assert causal and cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)
        out = torch.empty_like(q)  # (total, heads, D)
        bounds = cu_q.tolist()
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            assert end - start <= max_q
            seg = (x[start:end].transpose(0, 1)[None] for x in (q, k, v))  # (1, heads, n, D)
            out[start:end] = flash_attn_func(*(s.transpose(1, 2) for s in seg), causal=True)[0]
        return out

    module = types.ModuleType("flash_attn")
    module.flash_attn_func = flash_attn_func
    module.flash_attn_varlen_func = flash_attn_varlen_func
    return module


def test_flash_attn_layout_and_document_offsets(monkeypatch):
    monkeypatch.setattr(flash_module, "_flash_attn_module", None)
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_attn())
    flash = FlashAttention()
    assert flash.unavailable_reason() is None
    doc_ids = torch.stack([doc_ids_for(DOC_LENGTHS)[0], doc_ids_for((20, 11))[0]])  # (2, 31)
    mask = flash.build_mask(doc_ids, 31)
    assert mask.cu_seqlens.tolist() == [0, 5, 22, 31, 51, 62]
    q, k, v = random_qkv(2, 4, 2, 31, 8)
    expected = run(get_attention_backend("flex"), q, k, v, doc_ids)
    torch.testing.assert_close(flash(q, k, v, mask), expected, atol=1e-5, rtol=1e-5)
    causal = naive_attention(q, k, v, causal_mask(31))
    torch.testing.assert_close(run(flash, q, k, v), causal, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ATTENTION_BACKENDS)
@pytest.mark.parametrize("packed", [False, True], ids=["causal", "documents"])
@pytest.mark.parametrize("lengths", [(100, 300, 112), (37, 63)], ids=["T512", "T100"])
def test_backends_on_cuda_bf16_match_sdpa(name, packed, lengths):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    backend = get_attention_backend(name)
    if backend.unavailable_reason() is not None:
        pytest.skip(backend.unavailable_reason())
    if packed and not backend.capabilities.document_mask:
        pytest.skip(f"{name} has no document mask")
    backend.check(device=torch.device("cuda"), dtype=torch.bfloat16, document_mask=packed)
    T = sum(lengths)  # document boundaries off the 128-token blocks
    q, k, v = random_qkv(2, 8, 2, T, 64, dtype=torch.bfloat16, device="cuda")
    doc_ids = doc_ids_for(lengths, batch=2).cuda() if packed else None
    out = run(backend, q, k, v, doc_ids)
    if not packed:
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        expected = torch.empty_like(q)
        start = 0
        for n in lengths:
            doc = slice(start, start + n)
            expected[:, :, doc] = F.scaled_dot_product_attention(
                q[:, :, doc], k[:, :, doc], v[:, :, doc], is_causal=True, enable_gqa=True
            )
            start += n
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
