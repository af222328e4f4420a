"""Linear attention on CUDA (``pytest -m gpu``, flash-linear-attention installed: the
``linear`` extra): fla's gated delta rule and convolution against the torch path, values
and gradients, over packed documents (``cu_seqlens``) with grouped value heads; a
Qwen3.5-shaped model through fla against itself through torch (training forward and
backward, and decoding through the recurrent cache); the model in bf16 against its fp32
self."""

from __future__ import annotations

import pytest
import torch
from tiny import tiny_model_config

from recipes_lib.kernels.linear_attention import (
    Segments,
    causal_conv,
    fla_available,
    fla_training_error,
    gated_delta_rule,
)
from recipes_lib.models import Transformer
from recipes_lib.models.families import FAMILIES
from recipes_lib.models.kv_cache import KVCache
from recipes_lib.models.linear_attention import GatedDeltaNet

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        not fla_available(), reason="needs flash-linear-attention (pip install '.[linear]')"
    ),
]

B, T, HK, H, DK, DV = 2, 200, 2, 4, 32, 48  # T not a whole number of fla's 64-token chunks
# row 0: four documents, one shorter than the convolution; row 1: one document
LENGTHS = [[70, 2, 100, 28], [200]]


def _doc_ids() -> torch.Tensor:
    rows = [torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)) for n in LENGTHS]
    return torch.stack(rows).cuda()


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _inputs(dtype: torch.dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)

    def draw(*shape, scale=1.0):
        x = torch.randn(*shape, device="cuda", generator=gen) * scale
        return x.to(dtype).requires_grad_()

    q, k = draw(B, T, HK, DK), draw(B, T, HK, DK)
    v = draw(B, T, H, DV)
    g = (-torch.rand(B, T, H, device="cuda", generator=gen) * 0.5).requires_grad_()
    beta = torch.rand(B, T, H, device="cuda", generator=gen).to(dtype).requires_grad_()
    return q, k, v, g, beta


def _skip_unless_fla_trains() -> None:
    """fla's backward refuses on some GPU and Triton pairs; the layers then take the
    torch path, and a comparison of the two would compare the torch path with itself."""
    reason = fla_training_error(torch.cuda.current_device())
    if reason is not None:
        pytest.skip(f"flash-linear-attention cannot train here: {reason}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_gated_delta_rule_matches_the_torch_path_over_packed_documents(dtype):
    _skip_unless_fla_trains()
    segments = Segments.of(_doc_ids())
    inputs = _inputs(dtype)
    ours, _ = gated_delta_rule(*inputs, segments=segments, path="fla")
    reference, _ = gated_delta_rule(*inputs, segments=segments, path="torch")
    bound = 5e-3 if dtype == torch.float32 else 2e-2  # fla's fp32 products may be tf32
    assert _relative(ours, reference) < bound
    upstream = torch.randn_like(reference)
    got = torch.autograd.grad(ours, inputs, upstream)
    want = torch.autograd.grad(reference, inputs, upstream)
    for name, a, b in zip("q k v g beta".split(), got, want, strict=True):
        assert _relative(a, b) < 5 * bound, name


def test_fla_decoding_state_is_the_torch_paths():
    """From a state, one token at a time (fla's fused recurrent kernel) and a prompt at
    once (its chunked kernel), the outputs and the state after are the torch path's."""
    q, k, v, g, beta = (t.detach() for t in _inputs(torch.float32))
    state = torch.randn(B, H, DK, DV, device="cuda") * 0.1
    for n in (1, 37):
        pieces = [t[:, :n] for t in (q, k, v, g, beta)]
        ours, ours_after = gated_delta_rule(*pieces, state=state.clone(), path="fla")
        reference, after = gated_delta_rule(*pieces, state=state.clone(), path="torch")
        assert _relative(ours, reference) < 5e-3 and _relative(ours_after, after) < 5e-3


def test_fla_convolution_matches_the_torch_path_over_packed_documents():
    segments = Segments.of(_doc_ids())
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(B, T, 96, device="cuda", generator=gen).requires_grad_()
    weight = torch.randn(96, 4, device="cuda", generator=gen).requires_grad_()
    ours, ours_last = causal_conv(x, weight, segments, path="fla")
    reference, last = causal_conv(x, weight, segments, path="torch")
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours_last, last)
    upstream = torch.randn_like(reference)
    got = torch.autograd.grad(ours, (x, weight), upstream)
    want = torch.autograd.grad(reference, (x, weight), upstream)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


def _qwen3_5(**changes):
    config = tiny_model_config(
        **FAMILIES["qwen3_5"].fixed,
        family="qwen3_5",
        vocab_size=256,
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,  # flex's CUDA kernels take no narrower head
        partial_rotary_factor=0.25,
        linear_layers=[0, 1, 2],
        linear_heads=4,
        linear_key_heads=2,
        linear_key_dim=16,
        linear_value_dim=32,
        max_seq_len=256,
        **changes,
    )
    torch.manual_seed(0)
    return Transformer(config, "flex").cuda()


def _set_path(model: Transformer, path: str) -> None:
    for module in model.modules():
        if isinstance(module, GatedDeltaNet):
            module.path = path


def test_the_model_through_fla_is_the_model_through_torch():
    _skip_unless_fla_trains()
    model = _qwen3_5()
    x = torch.randint(0, 256, (B, T), device="cuda")
    doc_ids, labels = _doc_ids(), torch.roll(x, -1, dims=1)
    results = {}
    for path in ("fla", "torch"):
        _set_path(model, path)
        model.zero_grad()
        loss = model(x, doc_ids, labels=labels)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            results[path] = (model(x, doc_ids), loss.detach(), grads)
    (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = results["fla"], results["torch"]
    assert _relative(logits, ref_logits) < 5e-3
    torch.testing.assert_close(loss, ref_loss, atol=2e-3, rtol=2e-3)
    for name, grad in grads.items():
        assert _relative(grad, ref_grads[name]) < 3e-2, name
    # decoding through the recurrent cache: a prompt, then one token at a time
    decoded = {}
    for path in ("fla", "torch"):
        _set_path(model, path)
        cache = KVCache.for_model(model, batch_size=B, max_len=64)
        with torch.no_grad():
            steps = [model(x[:, :11], cache=cache, last_only=True)]
            steps += [model(x[:, i : i + 1], cache=cache) for i in range(11, 19)]
        decoded[path] = torch.cat(steps, dim=1)
    assert _relative(decoded["fla"], decoded["torch"]) < 5e-3


def test_a_bf16_qwen3_5_model_follows_its_fp32_self():
    model = _qwen3_5()
    x = torch.randint(0, 256, (B, T), device="cuda")
    with torch.no_grad():
        full = model(x, _doc_ids()).float()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            half = model(x, _doc_ids()).float()
    error = (half - full).abs()
    assert error.mean() < 0.02 and torch.quantile(error.flatten(), 0.999) < 0.1
    assert (half.argmax(-1) == full.argmax(-1)).float().mean() > 0.95
