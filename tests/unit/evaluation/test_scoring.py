"""The log-likelihood engine against log-softmax over full logits, one request at a time."""

import pytest
import torch
from tiny import tiny_model_config

from recipes_lib.errors import ConfigError
from recipes_lib.evaluation.scoring import Request, batches_of, score_requests
from recipes_lib.models import Transformer


def model(max_seq_len=32) -> Transformer:
    torch.manual_seed(0)
    m = Transformer(tiny_model_config(max_seq_len=max_seq_len), "sdpa").eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return m


def reference(m: Transformer, request: Request) -> tuple[float, bool]:
    """Full logits of the whole (cut) sequence, read one continuation token at a time."""
    tokens = [*request.context, *request.continuation][-(m.config.max_seq_len + 1) :]
    inputs = torch.tensor([tokens[:-1]])
    logprobs = torch.log_softmax(m(inputs)[0].float(), dim=-1)
    n = len(request.continuation)
    rows = range(len(tokens) - 1 - n, len(tokens) - 1)
    pairs = list(zip(rows, request.continuation, strict=True))
    total = sum(logprobs[r, t].item() for r, t in pairs)
    greedy = all(logprobs[r].argmax().item() == t for r, t in pairs)
    return total, greedy


REQUESTS = [
    Request((1, 2, 3), (4, 5)),
    Request((1, 2, 3), (6,)),  # the same context as the first
    Request((1, 2, 3), (7, 8, 9, 10)),
    Request((7,), (8,)),
    Request((7,), (8, 9, 10, 11)),
    Request(tuple(range(1, 40)), (3, 4)),  # longer than the context: cut from the left
    Request((5, 6), (7,)),
    Request((9, 9, 9, 9, 9), (2, 2, 2)),
]


@pytest.mark.parametrize("batch_size, max_tokens", [(1, None), (2, None), (8, None), (8, 40)])
def test_scores_equal_full_logits_in_any_batching(batch_size, max_tokens):
    m = model()
    got = score_requests(m, REQUESTS, batch_size=batch_size, max_tokens=max_tokens)
    for request, (logprob, greedy) in zip(REQUESTS, got, strict=True):
        want, want_greedy = reference(m, request)
        assert logprob == pytest.approx(want, abs=1e-4)
        assert greedy == want_greedy


def test_greedy_flag_is_true_for_the_models_own_argmax():
    m = model()
    context = [3, 1, 4]
    with torch.no_grad():
        best = int(m(torch.tensor([context]))[0, -1].argmax())
    [(_, greedy)] = score_requests(m, [Request(tuple(context), (best,))])
    [(_, other)] = score_requests(m, [Request(tuple(context), ((best + 1) % 64,))])
    assert greedy and not other


def test_forward_path_gives_the_same_log_likelihoods():
    m = model()
    fused = score_requests(m, REQUESTS, batch_size=3, greedy=False)
    direct = score_requests(m, REQUESTS, batch_size=3)
    for (a, _), (b, _) in zip(fused, direct, strict=True):
        assert a == pytest.approx(b, abs=1e-4)


def test_an_empty_continuation_scores_zero_as_lm_evals_backend_does():
    assert score_requests(model(), [Request((1,), ())]) == [(0.0, True)]


def test_training_mode_is_restored():
    m = model().train()
    score_requests(m, REQUESTS[:1])
    assert m.training


def test_batches_run_longest_first_within_limits():
    lengths = [3, 10, 5, 10, 1]
    batches = batches_of(lengths, batch_size=2, max_tokens=25)
    assert batches == [[1, 3], [2, 0], [4]]
    assert batches_of(lengths, batch_size=8, max_tokens=None) == [[1, 3, 2, 0, 4]]


@pytest.mark.parametrize(
    "request_, match",
    [
        (Request((), (1,)), "context"),
        (Request((1,), tuple(range(40))), "longer than the model's context"),
    ],
)
def test_bad_requests_are_refused(request_, match):
    with pytest.raises(ConfigError, match=match):
        score_requests(model(), [request_])
