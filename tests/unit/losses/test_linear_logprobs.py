"""The fused output head's log-probabilities against the head followed by log-softmax."""

from __future__ import annotations

import pytest
import torch

from recipes_lib.losses.logprobs import linear_token_logprobs, token_logprobs

N, D, V = 23, 16, 41


def inputs(dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=generator, dtype=dtype).requires_grad_()
    weight = (0.5 * torch.randn(V, D, generator=generator, dtype=dtype)).requires_grad_()
    labels = torch.randint(0, V, (N,), generator=generator)
    labels[:5] = -100  # a prompt
    labels[-3:] = -100  # padding
    upstream = torch.randn(N, generator=generator, dtype=torch.float32)
    return hidden, weight, labels, upstream


def grads(out, upstream, *tensors):
    return torch.autograd.grad((out * upstream).sum(), tensors)


@pytest.mark.parametrize("chunk_size", [1, 7, 1024])
def test_values_and_both_gradients_equal_the_materialised_head(chunk_size):
    hidden, weight, labels, upstream = inputs()
    fused = linear_token_logprobs(hidden, weight, labels, chunk_size=chunk_size)
    assert fused.dtype == torch.float32 and fused.shape == (N,)
    fused_grads = grads(fused, upstream, hidden, weight)

    reference = token_logprobs((hidden @ weight.t()).unsqueeze(0), labels.unsqueeze(0))[0]
    reference_grads = grads(reference, upstream, hidden, weight)
    torch.testing.assert_close(fused, reference, atol=1e-6, rtol=1e-6)
    for ours, theirs in zip(fused_grads, reference_grads, strict=True):
        assert ours.dtype == torch.float64
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    assert torch.all(fused[:5] == 0) and torch.all(fused_grads[0][:5] == 0)


def test_bf16_autocast_runs_the_matmuls_in_bf16_and_keeps_fp32_sums():
    hidden, weight, labels, upstream = inputs(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = linear_token_logprobs(hidden, weight, labels, chunk_size=8)
        logits = hidden @ weight.t()  # autocast's bf16 product, as nn.Linear's
    assert logits.dtype == torch.bfloat16
    fused_grads = grads(fused, upstream, hidden, weight)
    reference = token_logprobs(logits.unsqueeze(0), labels.unsqueeze(0))[0]
    reference_grads = grads(reference, upstream, hidden, weight)
    torch.testing.assert_close(fused, reference, atol=1e-5, rtol=1e-5)
    for ours, theirs in zip(fused_grads, reference_grads, strict=True):
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, theirs, atol=3e-2, rtol=3e-2)


def test_only_a_block_of_logits_is_ever_kept_and_a_frozen_weight_gets_no_gradient():
    hidden, weight, labels, _ = inputs(torch.float32)
    weight = weight.detach()  # a frozen head (LoRA)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = linear_token_logprobs(hidden, weight, labels, chunk_size=4)
    assert saved and all(t.numel() < N * V for t in saved)
    out.sum().backward()
    assert hidden.grad is not None and weight.grad is None


def test_shapes_and_chunk_size_are_checked():
    hidden, weight, labels, _ = inputs()
    with pytest.raises(ValueError, match="expects hidden"):
        linear_token_logprobs(hidden.unsqueeze(0), weight, labels)
    with pytest.raises(ValueError, match="expects hidden"):
        linear_token_logprobs(hidden, weight, labels[:-1])
    with pytest.raises(ValueError, match="chunk_size"):
        linear_token_logprobs(hidden, weight, labels, chunk_size=0)
