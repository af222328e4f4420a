import pytest
import torch
import torch.nn.functional as F

from recipes_lib.losses import causal_lm_loss, chunked_cross_entropy


def make_inputs(n=37, d=16, v=50, seed=0, ignored=(3, 4, 20)):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen)
    weight = torch.randn(v, d, generator=gen) * 0.3
    labels = torch.randint(0, v, (n,), generator=gen)
    labels[list(ignored)] = -100
    return hidden, weight, labels


def test_causal_lm_loss_matches_mean_over_kept_tokens():
    logits = torch.randn(2, 5, 11)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, :2] = -100
    keep = labels != -100
    expected = F.cross_entropy(logits[keep], labels[keep])
    assert torch.allclose(causal_lm_loss(logits, labels), expected)


def test_causal_lm_loss_upcasts_half_precision_logits():
    logits = torch.randn(3, 7, 13).to(torch.bfloat16)
    labels = torch.randint(0, 13, (3, 7))
    loss = causal_lm_loss(logits, labels)
    assert loss.dtype == torch.float32
    assert torch.allclose(loss, F.cross_entropy(logits.float().view(-1, 13), labels.view(-1)))


def test_causal_lm_loss_of_fully_ignored_batch_is_zero_not_nan():
    logits = torch.randn(1, 4, 9, requires_grad=True)
    loss = causal_lm_loss(logits, torch.full((1, 4), -100))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(logits.grad) == 0


@pytest.mark.parametrize("chunk_size", [1, 8, 37, 100])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_matches_full_loss_and_gradients(chunk_size, reduction):
    hidden, weight, labels = make_inputs()
    hidden_ref = hidden.clone().requires_grad_(True)
    weight_ref = weight.clone().requires_grad_(True)
    expected = F.cross_entropy(hidden_ref @ weight_ref.t(), labels, reduction=reduction)
    (expected * 1.7).backward()

    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    loss = chunked_cross_entropy(hidden, weight, labels, chunk_size=chunk_size, reduction=reduction)
    (loss * 1.7).backward()

    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden.grad, hidden_ref.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad, weight_ref.grad, rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(hidden.grad[[3, 4, 20]]) == 0  # ignored rows get no gradient


def test_chunked_without_grad_matches_and_builds_no_graph():
    hidden, weight, labels = make_inputs(seed=1)
    with torch.no_grad():
        loss = chunked_cross_entropy(hidden, weight, labels, chunk_size=5)
    expected = causal_lm_loss(hidden @ weight.t(), labels)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    assert loss.grad_fn is None


def test_chunked_gradient_flows_through_upstream_layers():
    hidden, weight, labels = make_inputs(seed=2)
    proj = torch.nn.Linear(16, 16)
    ref_proj = torch.nn.Linear(16, 16)
    ref_proj.load_state_dict(proj.state_dict())
    chunked_cross_entropy(proj(hidden), weight, labels, chunk_size=6).backward()
    causal_lm_loss(ref_proj(hidden) @ weight.t(), labels).backward()
    torch.testing.assert_close(proj.weight.grad, ref_proj.weight.grad, rtol=1e-5, atol=1e-5)


def test_chunked_all_ignored_is_zero():
    hidden, weight, _ = make_inputs()
    hidden.requires_grad_(True)
    loss = chunked_cross_entropy(hidden, weight, torch.full((37,), -100))
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(hidden.grad) == 0


def test_chunked_rejects_unflattened_inputs():
    hidden, weight, labels = make_inputs()
    with pytest.raises(ValueError, match=r"hidden \(N, D\)"):
        chunked_cross_entropy(hidden.view(1, 37, 16), weight, labels)


def test_chunked_gradients_are_spent_by_one_backward_and_a_frozen_head_gets_none():
    torch.manual_seed(0)
    hidden = torch.randn(12, 8, requires_grad=True)
    weight = torch.randn(20, 8)  # frozen
    labels = torch.randint(0, 20, (12,))
    loss = chunked_cross_entropy(hidden, weight, labels, chunk_size=5)
    (2.0 * loss).backward(retain_graph=True)
    expected = torch.autograd.grad(2.0 * causal_lm_loss(hidden @ weight.t(), labels), hidden)[0]
    torch.testing.assert_close(hidden.grad, expected, atol=1e-6, rtol=1e-6)
    with pytest.raises(RuntimeError, match="backpropagated once"):
        loss.backward()
