"""GRPO's advantages and clipped objective against hand-worked values."""

from __future__ import annotations

import math

import pytest
import torch

from recipes_lib.losses.rl import group_advantages, grpo_loss


def test_group_advantages_centre_and_scale_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    scaled = group_advantages(rewards, 4)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()
    expected = (torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-4)).tolist() + [0.0] * 4
    assert scaled.tolist() == pytest.approx(expected)
    assert group_advantages(rewards, 4, scale=False).tolist() == [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(rewards, 3)


def test_at_the_sampling_policy_the_gradient_is_the_advantage_weighted_log_likelihood():
    logps = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.5, -0.5]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    advantages = torch.tensor([1.0, -2.0])
    loss, metrics = grpo_loss(logps, logps.detach(), advantages, mask)
    # ratio 1: loss = -mean_seq(mean_tok(A)) = -(1 + -2) / 2
    assert loss.item() == pytest.approx(0.5)
    loss.backward()
    expected = torch.tensor([[-0.25, -0.25, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    torch.testing.assert_close(logps.grad, expected)
    assert metrics["clip_fraction"] == 0 and metrics["kl"] == 0


def test_clipping_the_normalisations_and_the_kl_term():
    old = torch.zeros(1, 4)
    logps = torch.log(torch.tensor([[1.5, 0.5, 1.1, 1.0]]))  # ratios
    mask = torch.tensor([[True, True, True, False]])
    up, down = torch.tensor([1.0]), torch.tensor([-1.0])
    loss, metrics = grpo_loss(logps, old, up, mask)
    assert loss.item() == pytest.approx(-(1.2 + 0.5 + 1.1) / 3)  # 1.5 clipped to 1.2
    assert metrics["clip_fraction"].item() == pytest.approx(1 / 3)
    loss, metrics = grpo_loss(logps, old, down, mask, clip_high=0.6)
    assert loss.item() == pytest.approx((1.5 + 0.8 + 1.1) / 3)  # 0.5 clipped to 0.8
    token, _ = grpo_loss(logps, old, up, mask, loss_norm="token")
    dr, _ = grpo_loss(logps, old, up, mask, loss_norm="dr_grpo", max_new_tokens=8)
    assert dr.item() == pytest.approx(token.item() * 3 / 8)
    ref = torch.zeros(1, 4)
    with_kl, metrics = grpo_loss(logps, old, up, mask, ref_logps=ref, kl_coef=0.1)
    ratios = [1.5, 0.5, 1.1]
    k3 = [1 / r + math.log(r) - 1 for r in ratios]
    assert metrics["kl"].item() == pytest.approx(sum(k3) / 3)
    assert with_kl.item() == pytest.approx(loss_plain := -(1.2 + 0.5 + 1.1) / 3 + 0.1 * sum(k3) / 3)
    assert loss_plain < 0
    with pytest.raises(ValueError, match="reference"):
        grpo_loss(logps, old, up, mask, kl_coef=0.1)


@pytest.mark.parametrize("loss_norm", ["sequence", "token", "dr_grpo"])
def test_completions_split_over_two_ranks_give_the_whole_loss_and_gradient(loss_norm):
    """Each completion's tokens split over two ranks (context parallelism), ``across``
    adding the other rank's per-completion sums: each rank's loss is the whole
    completions' loss, and the two ranks' gradients are the whole one's."""
    torch.manual_seed(0)
    n, t = 4, 10
    logps = -torch.rand(n, t, dtype=torch.float64) * 3
    old = logps + 0.3 * torch.randn(n, t, dtype=torch.float64)
    ref = logps + 0.2 * torch.randn(n, t, dtype=torch.float64)
    advantages = torch.randn(n, dtype=torch.float64)
    mask = torch.rand(n, t) < 0.7
    halves = (torch.arange(t) % 2 == 0, torch.arange(t) % 2 == 1)  # any split of the tokens

    def run(part, across=None):
        leaf = logps[:, part].clone().requires_grad_(True)
        loss, metrics = grpo_loss(
            leaf,
            old[:, part],
            advantages,
            mask[:, part],
            ref_logps=ref[:, part],
            kl_coef=0.1,
            loss_norm=loss_norm,
            max_new_tokens=t,
            across=across,
        )
        return leaf, loss, metrics

    whole_leaf, whole, whole_metrics = run(slice(None))
    (whole_grad,) = torch.autograd.grad(whole, whole_leaf)
    sent: list[list[torch.Tensor]] = []  # what each rank's sums would be, in call order
    for part in halves:
        recorded: list[torch.Tensor] = []
        run(part, lambda x, recorded=recorded: (recorded.append(x.detach()), x)[1])
        sent.append(recorded)
    grads = torch.zeros(n, t, dtype=torch.float64)
    for rank, part in enumerate(halves):
        other = iter(sent[1 - rank])
        leaf, loss, metrics = run(part, lambda x, other=other: x + next(other))
        assert loss.item() == pytest.approx(whole.item(), rel=1e-9)
        for name in ("kl", "clip_fraction"):
            assert metrics[name].item() == pytest.approx(whole_metrics[name].item(), rel=1e-9)
        (grad,) = torch.autograd.grad(loss, leaf)
        grads[:, part] = grad
    assert torch.allclose(grads, whole_grad, rtol=1e-9, atol=1e-12)
