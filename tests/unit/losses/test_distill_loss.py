"""The chunked distillation losses against the same divergences on full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from recipes_lib.losses.distill import chunked_distill_loss

N, D, DT, V = 19, 8, 12, 31


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(V, D, generator=g, dtype=torch.float64).requires_grad_()
    teacher_hidden = torch.randn(N, DT, generator=g, dtype=torch.float64)
    teacher_weight = torch.randn(V, DT, generator=g, dtype=torch.float64)
    mask = torch.rand(N, generator=g) > 0.3
    return hidden, weight, teacher_hidden, teacher_weight, mask


def naive(hidden, weight, teacher_hidden, teacher_weight, mask, loss, beta, temperature):
    log_q = F.log_softmax(hidden @ weight.t() / temperature, -1)[mask]
    log_p = F.log_softmax(teacher_hidden @ teacher_weight.t() / temperature, -1)[mask]
    p, q = log_p.exp(), log_q.exp()
    if loss == "forward_kl":
        rows = (p * (log_p - log_q)).sum(-1)
    else:
        m = beta * p + (1 - beta) * q
        rows = beta * (p * (log_p - m.log())).sum(-1) + (1 - beta) * (q * (log_q - m.log())).sum(-1)
    return rows.mean() * temperature**2


@pytest.mark.parametrize(
    ("loss", "beta", "temperature", "chunk"),
    [
        ("forward_kl", 0.5, 1.0, 4),
        ("forward_kl", 0.5, 2.0, 64),
        ("jsd", 0.5, 1.0, 5),
        ("jsd", 0.1, 1.5, 1),
    ],
)
def test_value_and_gradients_match_the_full_logits(loss, beta, temperature, chunk):
    hidden, weight, teacher_hidden, teacher_weight, mask = inputs()
    ours = chunked_distill_loss(
        hidden,
        weight,
        teacher_hidden,
        teacher_weight,
        mask,
        loss=loss,
        beta=beta,
        temperature=temperature,
        chunk_size=chunk,
    )
    ours_grads = torch.autograd.grad(3.0 * ours, (hidden, weight))
    theirs = naive(hidden, weight, teacher_hidden, teacher_weight, mask, loss, beta, temperature)
    theirs_grads = torch.autograd.grad(3.0 * theirs, (hidden, weight))
    torch.testing.assert_close(ours.double(), theirs, atol=1e-6, rtol=1e-6)
    for a, b in zip(ours_grads, theirs_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert torch.all(ours_grads[0][~mask] == 0)


def test_a_student_equal_to_its_teacher_has_no_loss_and_evaluation_keeps_no_graph():
    hidden, weight, _, _, mask = inputs()
    for loss in ("forward_kl", "jsd"):
        same = chunked_distill_loss(
            hidden, weight, hidden.detach(), weight.detach(), mask, loss=loss
        )
        assert same.item() == pytest.approx(0.0, abs=1e-6)
    with torch.no_grad():
        value = chunked_distill_loss(*inputs()[:4], mask)
    assert value.grad_fn is None and value.item() > 0


def test_a_different_vocabulary_and_bad_settings_are_refused():
    hidden, weight, teacher_hidden, teacher_weight, mask = inputs()
    with pytest.raises(ValueError, match="vocabulary"):
        chunked_distill_loss(hidden, weight, teacher_hidden, teacher_weight[:-1], mask)
    with pytest.raises(ValueError, match="unknown distillation loss"):
        chunked_distill_loss(hidden, weight, teacher_hidden, teacher_weight, mask, loss="kl")
    with pytest.raises(ValueError, match="beta=2"):
        chunked_distill_loss(hidden, weight, teacher_hidden, teacher_weight, mask, beta=2)
