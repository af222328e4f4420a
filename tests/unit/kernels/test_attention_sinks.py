"""Attention sinks (a learned logit per query head in each softmax's denominator, with no
value) in every path that takes them: SDPA's extra key, flex's log-sum-exp (run here
with the eager flex_attention, forward and backward, as CUDA runs it compiled), the KV
cache; each against the softmax written out, values and gradients."""

import math

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from recipes_lib.kernels import get_attention_backend
from recipes_lib.kernels.attention import flex_with_sinks, sdpa_with_sinks
from recipes_lib.models.kv_cache import LayerCache, causal_offset_mask

B, H, HKV, T, D = 2, 4, 2, 12, 16


def reference(q, k, v, sinks, mask, scale):
    """The softmax over the keys and the sink column, written out."""
    k, v = (x.repeat_interleave(H // x.shape[1], dim=1) for x in (k, v))
    scores = q @ k.transpose(-2, -1) * scale  # (B, H, T, S)
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.view(1, H, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return probs @ v


def inputs(seed=0, S=T):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=gen, requires_grad=True)
    k = torch.randn(B, HKV, S, D, generator=gen, requires_grad=True)
    v = torch.randn(B, HKV, S, D, generator=gen, requires_grad=True)
    sinks = (torch.randn(H, generator=gen) * 2).requires_grad_()
    return q, k, v, sinks


def window_mask(window):
    positions = torch.arange(T)
    offset = positions[:, None] - positions[None, :]
    return (offset >= 0) & (offset < window)


def assert_same_with_gradients(ours, theirs, tensors):
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    upstream = torch.randn_like(ours)
    got = torch.autograd.grad(ours, tensors, upstream)
    want = torch.autograd.grad(theirs, tensors, upstream)
    for name, a, b in zip("qkv" + "s", got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    assert got[-1].abs().sum() > 0  # the sinks learn


@pytest.mark.parametrize("window", [None, 5])
def test_sdpa_backend_with_sinks_is_the_written_out_softmax(window):
    q, k, v, sinks = inputs()
    backend = get_attention_backend("sdpa")
    mask = backend.build_mask(None, T, window=window)
    ours = backend(q, k, v, mask, scale=0.3, sinks=sinks)
    dense = window_mask(window or T)
    assert_same_with_gradients(ours, reference(q, k, v, sinks, dense, 0.3), (q, k, v, sinks))


def test_flex_backend_with_sinks_and_documents_is_the_written_out_softmax():
    q, k, v, sinks = inputs(1)
    doc_ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    backend = get_attention_backend("flex")
    ours = backend(q, k, v, backend.build_mask(doc_ids, T, window=4), sinks=sinks)
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    dense = (window_mask(4)[None] & same)[:, None]
    theirs = reference(q, k, v, sinks, dense, 1 / math.sqrt(D))
    assert_same_with_gradients(ours, theirs, (q, k, v, sinks))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_log_sum_exp_identity_is_the_written_out_softmax():
    """CUDA's path: flex_attention's output times sigmoid(lse - sink), here with the eager
    kernel (forward only: torch's flex has no CPU backward; tests/gpu runs it)."""
    q, k, v, sinks = (t.detach() for t in inputs(2))

    def windowed(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < 6)

    block_mask = create_block_mask(windowed, None, None, T, T, device="cpu")
    ours = flex_with_sinks(flex_attention, q, k, v, sinks, block_mask=block_mask, enable_gqa=True)
    theirs = reference(q, k, v, sinks, window_mask(6), 1 / math.sqrt(D))
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_the_log_sum_exp_identity_has_the_softmax_gradients():
    """Through a kernel that differentiates its log-sum-exp (flex's backward does), the
    identity's gradients are the written-out softmax's: here that kernel written out."""
    q, k, v, sinks = inputs(5)
    mask = window_mask(7)

    def kernel(q, k, v, return_aux, enable_gqa):
        keys, values = (x.repeat_interleave(H // HKV, dim=1) for x in (k, v))
        scores = (q @ keys.transpose(-2, -1) / math.sqrt(D)).masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        return torch.softmax(scores, dim=-1) @ values, type("Aux", (), {"lse": lse})

    ours = flex_with_sinks(kernel, q, k, v, sinks, enable_gqa=True)
    theirs = reference(q, k, v, sinks, mask, 1 / math.sqrt(D))
    assert_same_with_gradients(ours, theirs, (q, k, v, sinks))


def test_sdpa_with_sinks_takes_queries_at_the_end_of_the_keys():
    """Decoding: the new queries are the last of the cached keys, causal among them."""
    q, k, v, sinks = inputs(3, S=T + 5)
    ours = sdpa_with_sinks(q, k, v, None, sinks, None)
    dense = causal_offset_mask(T, 5)
    theirs = reference(q, k, v, sinks, dense, 1 / math.sqrt(D))
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_the_kv_cache_attends_with_the_sinks():
    q, k, v, sinks = inputs(4)
    cache = LayerCache(torch.zeros(B, HKV, 32, D), torch.zeros(B, HKV, 32, D), start_pos=0)
    with torch.no_grad():
        first = cache.attend(q, k, v, causal_offset_mask(T, 0), sinks=sinks)
        step = LayerCache(cache.keys, cache.values, start_pos=T)
        one = step.attend(q[:, :, -1:], k[:, :, -1:], v[:, :, -1:], None, sinks=sinks)
    dense = window_mask(T)
    torch.testing.assert_close(first, reference(q, k, v, sinks, dense, 1 / math.sqrt(D)))
    keys = torch.cat([k, k[:, :, -1:]], dim=2)
    values = torch.cat([v, v[:, :, -1:]], dim=2)
    everything = torch.ones(1, T + 1, dtype=torch.bool)
    scale = 1 / math.sqrt(D)
    want = reference(q[:, :, -1:], keys, values, sinks, everything, scale)
    torch.testing.assert_close(one, want.detach())


def test_backends_without_sinks_say_so():
    assert get_attention_backend("sdpa").capabilities.sinks
    assert get_attention_backend("flex").capabilities.sinks
    assert not get_attention_backend("flash_attn").capabilities.sinks
