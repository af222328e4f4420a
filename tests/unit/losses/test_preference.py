"""Preference losses and per-sequence log-probs against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from recipes_lib.losses.logprobs import sequence_logprobs, token_logprobs
from recipes_lib.losses.preference import (
    PairLogps,
    dpo_sigmoid_loss,
    get_preference_loss,
    hinge_loss,
    ipo_loss,
    kto_loss,
)

BETA = 0.5
# pair 0: chosen log-ratio -10 - (-11) = 1, rejected -12 - (-11) = -1, margin 2
# pair 1: chosen log-ratio -8 - (-8) = 0, rejected -7 - (-6.5) = -0.5, margin 0.5
POLICY_CHOSEN = [-10.0, -8.0]
POLICY_REJECTED = [-12.0, -7.0]
REF_CHOSEN = [-11.0, -8.0]
REF_REJECTED = [-11.0, -6.5]
CHOSEN_REWARDS = [0.5, 0.0]  # beta * chosen log-ratio
REJECTED_REWARDS = [-0.5, -0.25]


def fixed_batch(requires_grad: bool = False) -> list[torch.Tensor]:
    return [
        torch.tensor(v, dtype=torch.float32, requires_grad=requires_grad)
        for v in (POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED)
    ]


@pytest.mark.parametrize(
    ("loss_fn", "expected"),
    [
        # -log sigmoid(beta * margin) = log(1 + exp(-beta * margin)); beta * margin = 1, 0.25
        (dpo_sigmoid_loss, (math.log1p(math.exp(-1.0)) + math.log1p(math.exp(-0.25))) / 2),
        # (margin - 1 / (2 beta))^2 = (2 - 1)^2, (0.5 - 1)^2
        (ipo_loss, (1.0 + 0.25) / 2),
        # relu(1 - beta * margin) = relu(0), relu(0.75)
        (hinge_loss, (0.0 + 0.75) / 2),
    ],
)
def test_loss_and_rewards_match_hand_computed_values(loss_fn, expected):
    loss, chosen_rewards, rejected_rewards = loss_fn(*fixed_batch(), beta=BETA)
    assert loss.shape == ()
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    torch.testing.assert_close(chosen_rewards, torch.tensor(CHOSEN_REWARDS))
    torch.testing.assert_close(rejected_rewards, torch.tensor(REJECTED_REWARDS))


def test_sigmoid_gradient_matches_its_closed_form():
    policy_chosen, policy_rejected, ref_chosen, ref_rejected = fixed_batch(requires_grad=True)
    loss, chosen_rewards, _ = dpo_sigmoid_loss(
        policy_chosen, policy_rejected, ref_chosen.detach(), ref_rejected.detach(), beta=BETA
    )
    loss.backward()
    # d/d pc of mean(-log sigmoid(beta h)) = -beta * sigmoid(-beta h) / P
    expected = [-BETA / (1 + math.exp(m)) / 2 for m in (1.0, 0.25)]
    torch.testing.assert_close(policy_chosen.grad, torch.tensor(expected))
    torch.testing.assert_close(policy_rejected.grad, -torch.tensor(expected))
    assert not chosen_rewards.requires_grad  # rewards are for logging only


def test_hinge_ignores_pairs_past_the_margin():
    policy_chosen, policy_rejected, ref_chosen, ref_rejected = fixed_batch(requires_grad=True)
    hinge_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=BETA)[0].backward()
    assert policy_chosen.grad[0] == 0  # margin 2: beta * 2 = 1, already satisfied
    assert policy_chosen.grad[1] == pytest.approx(-BETA / 2)


def test_unknown_loss_and_bad_beta_are_refused():
    with pytest.raises(ValueError, match="'kto'.*hinge"):
        get_preference_loss("kto")
    pc, pr, rc, rr = fixed_batch()
    pairs = PairLogps(torch.stack([pc, pr], 1), torch.ones(len(pc), 2), torch.stack([rc, rr], 1))
    for got, want in zip(
        get_preference_loss("ipo")(pairs, BETA), ipo_loss(pc, pr, rc, rr, BETA), strict=True
    ):
        torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="compares with a reference"):
        get_preference_loss("sigmoid")(PairLogps(pairs.policy, pairs.tokens), BETA)
    with pytest.raises(ValueError, match="beta"):
        dpo_sigmoid_loss(*fixed_batch(), beta=0.0)


def naive_sequence_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = logprobs.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * (labels != -100)).sum(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_rows", [1, 5, 1024])
def test_sequence_logprobs_match_a_naive_log_softmax_gather(dtype, chunk_rows):
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 9, 37, generator=generator)).to(dtype).requires_grad_()
    labels = torch.randint(0, 37, (3, 9), generator=generator)
    labels[0, :4] = -100  # a prompt
    labels[2, 6:] = -100  # padding
    weights = torch.tensor([1.0, -2.0, 0.5])

    ours = sequence_logprobs(logits, labels, chunk_rows=chunk_rows)
    assert ours.dtype == torch.float32 and ours.shape == (3,)
    (ours * weights).sum().backward()
    ours_grad, logits.grad = logits.grad.clone(), None

    naive = naive_sequence_logprobs(logits, labels)
    (naive * weights).sum().backward()
    torch.testing.assert_close(ours, naive, atol=1e-5, rtol=1e-5)
    atol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ours_grad.float(), logits.grad.float(), atol=atol, rtol=0)
    assert ours_grad.dtype == dtype
    assert torch.all(ours_grad[0, :4] == 0) and torch.all(ours_grad[2, 6:] == 0)


def test_no_full_fp32_copy_of_low_precision_logits_is_kept_for_backward():
    logits = torch.randn(4, 64, 500, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 500, (4, 64))
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        sequence_logprobs(logits, labels, chunk_rows=32)
    full_size = logits.numel()
    assert saved, "nothing saved for backward"
    assert all(not (t.dtype == torch.float32 and t.numel() >= full_size) for t in saved)


def test_token_logprobs_are_zero_where_ignored_and_checks_shapes():
    logits = torch.randn(2, 3, 5)
    labels = torch.tensor([[1, -100, 2], [-100, -100, -100]])
    out = token_logprobs(logits, labels)
    assert out[0, 1] == 0 and torch.all(out[1] == 0)
    assert out[0, 0] == pytest.approx(torch.log_softmax(logits[0, 0], -1)[1].item(), abs=1e-6)
    with pytest.raises(ValueError, match="do not match"):
        token_logprobs(logits, labels[:, :2])


def test_simpo_is_a_length_normalised_margin_against_gamma():
    # (P, 2) summed log-probs over (P, 2) response tokens: means -1/-2 and -0.5/-0.25
    policy = torch.tensor([[-4.0, -10.0], [-1.0, -1.0]], requires_grad=True)
    tokens = torch.tensor([[4, 5], [2, 4]])
    beta, gamma = 2.0, 0.5
    loss, chosen, rejected = get_preference_loss("simpo")(PairLogps(policy, tokens), beta, gamma)
    margins = torch.tensor([-1.0 - -2.0, -0.5 - -0.25])
    expected = -torch.nn.functional.logsigmoid(beta * margins - gamma).mean()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(chosen, beta * torch.tensor([-1.0, -0.5]))
    torch.testing.assert_close(rejected, beta * torch.tensor([-2.0, -0.25]))
    loss.backward()  # raising the chosen response's log-prob lowers the loss
    assert (policy.grad[:, 0] < 0).all() and (policy.grad[:, 1] > 0).all()


def test_orpo_adds_the_chosen_nll_to_the_odds_ratio_term():
    policy = torch.tensor([[-2.0, -6.0], [-3.0, -1.0]], requires_grad=True)
    tokens = torch.tensor([[2, 3], [3, 2]])
    beta = 0.1
    loss, chosen, _ = get_preference_loss("orpo")(PairLogps(policy, tokens), beta)
    mean_c, mean_r = torch.tensor([-1.0, -1.0]), torch.tensor([-2.0, -0.5])

    def log_odds(a):
        p = torch.exp(a)
        return torch.log(p / (1 - p))

    ratio = -torch.nn.functional.logsigmoid(log_odds(mean_c) - log_odds(mean_r)).mean()
    nll = (2.0 + 3.0) / (2 + 3)  # the chosen tokens' mean negative log-likelihood
    torch.testing.assert_close(loss, torch.tensor(nll) + beta * ratio)
    torch.testing.assert_close(chosen, beta * mean_c)
    loss.backward()
    assert torch.isfinite(policy.grad).all()


def test_orpo_log_odds_stay_finite_near_certainty():
    policy = torch.tensor([[-1e-9, -5.0]], requires_grad=True)  # chosen p -> 1
    loss, _, _ = get_preference_loss("orpo")(PairLogps(policy, torch.tensor([[3, 3]])), 0.1)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(policy.grad).all()


def test_kto_scores_each_completion_against_the_clamped_kl_estimate():
    policy = torch.tensor([-10.0, -12.0], requires_grad=True)
    reference = torch.tensor([-11.0, -11.0])
    policy_kl = torch.tensor([-5.0, -6.0], requires_grad=True)
    reference_kl = torch.tensor([-6.0, -6.0])
    desirable = torch.tensor([True, False])
    loss, rewards, kl = kto_loss(
        policy, reference, policy_kl, reference_kl, desirable, beta=0.5, undesirable_weight=2.0
    )
    # log-ratios 1 and -1; KL estimate (1 + 0) / 2
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    expected = ((1 - sigmoid(0.5 * (1 - 0.5))) + 2 * (1 - sigmoid(0.5 * (0.5 + 1)))) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert rewards.tolist() == pytest.approx([0.5, -0.5]) and kl.item() == pytest.approx(0.5)
    loss.backward()
    assert policy.grad[0] < 0 < policy.grad[1]  # raise the desirable, lower the undesirable
    assert policy_kl.grad is None  # the reference point takes no gradient
    # a negative KL estimate is clamped at 0
    _, _, kl = kto_loss(policy, reference, reference_kl - 1, reference_kl, desirable, beta=0.5)
    assert kl.item() == 0
    # an estimate given (every rank's twins) replaces the batch's, clamped all the same
    for given, used in ((2.0, 2.0), (-1.0, 0.0)):
        args = (policy, reference, policy_kl, reference_kl, desirable)
        _, _, kl = kto_loss(*args, beta=0.5, kl=torch.tensor(given))
        assert kl.item() == used
