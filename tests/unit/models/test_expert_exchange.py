"""The expert-parallel exchange on two processes over gloo: when every token goes to one
rank's experts, the other rank receives no rows, and its backward must still run the
exchange's all-to-alls, or the first rank waits for them for ever."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recipes_lib.models.moe import ExpertParallel, Experts

EXPERTS, DIM, HIDDEN, ROWS = 4, 8, 16, 6


def _weights() -> list[torch.Tensor]:
    torch.manual_seed(0)
    return [torch.randn(EXPERTS, HIDDEN, DIM), torch.randn(EXPERTS, HIDDEN, DIM)] + [
        torch.randn(EXPERTS, DIM, HIDDEN)
    ]


def _experts(first: int, n: int) -> Experts:
    """Experts ``first`` .. ``first + n - 1`` of :func:`_weights`."""
    experts = Experts(n, DIM, HIDDEN, "silu")
    for linear, w in zip((experts.w1, experts.w3, experts.w2), _weights(), strict=True):
        linear.weight = torch.nn.Parameter(w[first : first + n].clone())
    experts.path = "loop"
    return experts


def _rows(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's rows, sorted by expert, all for experts 0 and 1 (rank 0's)."""
    torch.manual_seed(10 + rank)
    return torch.randn(ROWS, DIM, requires_grad=True), torch.tensor([2, 4, 0, 0])


def _rank(rank: int, store_path: str, out: dict) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=30),
    )
    try:
        experts = _experts(2 * rank, 2)
        experts.parallel = ExpertParallel(dist.group.WORLD, 2)
        x, counts = _rows(rank)
        y = experts.parallel.exchange(experts, x, counts)
        y.square().sum().backward()
        grads = [linear.weight.grad.clone() for linear in (experts.w1, experts.w3, experts.w2)]
        dist.all_reduce(torch.ones(1))  # both ranks are past the backward's collectives
        out[rank] = (y.detach(), x.grad.clone(), grads)
    finally:
        dist.destroy_process_group()


def test_a_rank_that_receives_no_rows_still_runs_the_backward_exchange(tmp_path):
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(str(tmp_path / "store"), out), nprocs=2, join=True)
        out = dict(out)
    whole = _experts(0, EXPERTS)
    for rank in (0, 1):
        x, counts = _rows(rank)
        y = whole(x, counts)
        y.square().sum().backward()
        got_y, got_grad, _ = out[rank]
        torch.testing.assert_close(got_y, y.detach())
        torch.testing.assert_close(got_grad, x.grad, rtol=1e-5, atol=1e-4)  # sums reordered
    # rank 1's experts took no rows: zero gradients, present (the same step on every rank)
    assert all(g.abs().sum() == 0 for g in out[1][2])
    # rank 0's: both ranks' rows, each gradient scaled by 1/2 (the mean over ranks)
    for got, linear in zip(out[0][2], (whole.w1, whole.w3, whole.w2), strict=True):
        torch.testing.assert_close(got, linear.weight.grad[:2] / 2, rtol=1e-5, atol=1e-4)
