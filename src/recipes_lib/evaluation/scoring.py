"""Log-likelihoods of continuations: the one engine behind every evaluation.

A request is a context and a continuation, both token ids. Its score is the sum of the
continuation's log-probabilities given everything before it, and whether each of its
tokens is the greedy (argmax) choice: what lm-evaluation-harness asks of a model for
multiple-choice and perplexity tasks, and what the built-in tasks and the in-loop
evaluation read.

Requests run longest first, in batches of right-padded rows (causal attention, so the
padding after a row never reaches it) limited by rows and by padded tokens, so that a
forward pass is large enough to keep the GPU busy however short the requests are.
Only the continuation's rows of logits are ever formed, at most
:data:`HEAD_CHUNK_ROWS` of them at once: for a 128k vocabulary that is the difference
between a ``(B, T, V)`` tensor and a few thousand rows. A request longer than the
model's context keeps its last ``max_seq_len + 1`` tokens, as lm-eval's Hugging Face
backend does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from recipes_lib.errors import ConfigError
from recipes_lib.losses.cross_entropy import IGNORE_INDEX

if TYPE_CHECKING:
    from recipes_lib.models.transformer import Transformer

Score = tuple[float, bool]  # (sum of log-probabilities, every token greedy)
HEAD_CHUNK_ROWS = 4096  # rows of fp32 logits formed at once
DEFAULT_BATCH_TOKENS = 32768  # padded tokens a forward pass takes, by default


@dataclass(frozen=True)
class Request:
    """A continuation to score after a context (token ids; the context is not empty)."""

    context: tuple[int, ...]
    continuation: tuple[int, ...]


Window = tuple[list[int], list[int]]  # (input ids, the continuation they predict last)


def _window(request: Request, max_len: int) -> Window:
    """A request's inputs, cut to ``max_len`` from the left, and its continuation: the
    tokens the last ``len(continuation)`` inputs predict."""
    if not request.context:
        raise ConfigError("a scored continuation needs at least one context token")
    if len(request.continuation) > max_len:
        raise ConfigError(
            f"a continuation of {len(request.continuation)} tokens is longer than the "
            f"model's context ({max_len})"
        )
    tokens = [*request.context, *request.continuation][-(max_len + 1) :]
    return tokens[:-1], list(request.continuation)


def batches_of(lengths: Sequence[int], batch_size: int, max_tokens: int | None) -> list[list[int]]:
    """Request indices in batches, longest first: at most ``batch_size`` rows and (when
    set) at most ``max_tokens`` padded tokens a batch."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for index in order:
        current = batches[-1] if batches else None
        # the first row of a batch is its longest: the padded size is rows x that length
        if (
            current is None
            or len(current) >= batch_size
            or (max_tokens is not None and (len(current) + 1) * lengths[current[0]] > max_tokens)
        ):
            batches.append([index])
        else:
            current.append(index)
    return batches


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def score_requests(
    model: Transformer,
    requests: Sequence[Request],
    *,
    batch_size: int = 256,
    max_tokens: int | None = DEFAULT_BATCH_TOKENS,
    greedy: bool = True,
    progress: Callable[[int], None] | None = None,
) -> list[Score]:
    """Score every request with ``model`` (a :class:`~recipes_lib.models.Transformer`).

    Args:
        model: the decoder; its training mode is restored afterwards.
        requests: what to score.
        batch_size: the most rows a forward pass takes.
        max_tokens: the most padded tokens a forward pass takes (None: no limit; a
            request longer than it still runs, alone).
        greedy: also decide whether each continuation is the greedy one. This reads the
            model's hidden states and head directly, which a sharded (FSDP) model does
            not allow; without it the log-probabilities come through the model's own
            forward and its fused head (which forms logits for every row, in chunks),
            and every request reports ``False``.
        progress: called with the number of requests done after each batch.

    Returns:
        One ``(log-likelihood, is greedy)`` per request, in the order given.
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size={batch_size} must be at least 1")
    max_len = model.config.max_seq_len
    # an empty continuation (its text merged into the context's last token) scores 0
    results: list[Score] = [(0.0, True)] * len(requests)
    scored = [i for i, r in enumerate(requests) if r.continuation]
    windows = [_window(requests[i], max_len) for i in scored]
    was_training = model.training
    model.eval()
    try:
        with _varying_shapes_attention(model_device(model)):
            found: list[Score] = [(0.0, False)] * len(scored)
            _score_batches(model, windows, found, batch_size, max_tokens, greedy, progress)
        for i, score in zip(scored, found, strict=True):
            results[i] = score
    finally:
        model.train(was_training)
    return results


def _score_batches(
    model: Transformer,
    windows: list[Window],
    results: list[Score],
    batch_size: int,
    max_tokens: int | None,
    greedy: bool,
    progress: Callable[[int], None] | None,
) -> None:
    """Fill ``results`` batch by batch, longest first."""
    device = model_device(model)
    for batch in batches_of([len(w[0]) for w in windows], batch_size, max_tokens):
        rows = [windows[i] for i in batch]
        width = len(rows[0][0])
        padded = [tokens + [0] * (width - len(tokens)) for tokens, _ in rows]
        ids = torch.tensor(padded, dtype=torch.long).to(device, non_blocking=True)
        scores = (_greedy_scores if greedy else _forward_scores)(model, ids, rows)
        for i, score in zip(batch, scores, strict=True):
            results[i] = score
        if progress is not None:
            progress(len(batch))


def _varying_shapes_attention(device: torch.device):
    """SDPA without its cuDNN backend on CUDA: every batch here has a new length, and
    cuDNN plans each new shape afresh (about a millisecond of host time per layer and
    call, measured on an H100: the host, not the GPU, then bounds the evaluation);
    FlashAttention and the memory-efficient kernel take any length as it comes."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(
        [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    )


def _gather_index(rows: list[Window], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(row, position, target) of every continuation token, request by request."""
    row_index: list[int] = []
    positions: list[int] = []
    targets: list[int] = []
    for r, (inputs, continuation) in enumerate(rows):
        n = len(continuation)
        row_index += [r] * n
        positions += range(len(inputs) - n, len(inputs))
        targets += continuation
    as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
    return as_tensor(row_index), as_tensor(positions), as_tensor(targets)


def _greedy_scores(model: Transformer, ids: Tensor, rows: list[Window]) -> list[Score]:
    row_index, positions, target = _gather_index(rows, ids.device)
    picked = model.forward_hidden(ids)[row_index, positions]  # (N, C)
    chosen, is_greedy = [], []
    for hidden, wanted in zip(
        picked.split(HEAD_CHUNK_ROWS), target.split(HEAD_CHUNK_ROWS), strict=True
    ):
        logprobs = torch.log_softmax(model.output(hidden).float(), dim=-1)  # (n, V)
        chosen.append(logprobs.gather(1, wanted[:, None])[:, 0])
        is_greedy.append(logprobs.argmax(dim=-1) == wanted)
    return _per_request(rows, torch.cat(chosen), torch.cat(is_greedy))


def _forward_scores(model: Transformer, ids: Tensor, rows: list[Window]) -> list[Score]:
    row_index, positions, target = _gather_index(rows, ids.device)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[row_index, positions] = target
    per_token = model(ids, labels=labels, per_token=True, loss_chunk_size=HEAD_CHUNK_ROWS)
    chosen = per_token[row_index, positions]
    return _per_request(rows, chosen, torch.zeros_like(chosen, dtype=torch.bool))


def _per_request(rows: list[Window], chosen: Tensor, is_greedy: Tensor) -> list[Score]:
    """Sums and all-greedy flags per request, read from the device once."""
    owner = torch.tensor(
        [r for r, (_, c) in enumerate(rows) for _ in c], dtype=torch.long, device=chosen.device
    )
    sums = torch.zeros(len(rows), dtype=torch.float64, device=chosen.device)
    sums.index_add_(0, owner, chosen.double())
    misses = torch.zeros(len(rows), dtype=torch.long, device=chosen.device)
    misses.index_add_(0, owner, (~is_greedy).long())
    return [(float(s), m == 0) for s, m in zip(sums.tolist(), misses.tolist(), strict=True)]
