"""Context parallelism (``strategy.context_parallel=N``): each row split over ``N`` ranks.

The world's ranks form groups of ``N`` consecutive ranks; the ranks of one group read
the same rows (the data is sharded over ``world / N`` data-parallel ranks) and each
holds its load-balanced share of every row's positions
(:mod:`recipes_lib.kernels.sharded`: the attention gathers the group's keys and values
and masks with global positions, so packed documents are respected across shards).

The loss of a rank is its tokens' summed loss over the group's token count, so the
group's shares add up to the mean over the whole rows; its value is replaced by that
mean (the same on every rank of the group, for the log and the guard) while the
gradient stays the rank's share. Gradients are averaged over the whole world, the
group's ranks included: by DDP's all-reduce, or by FSDP2's reduce-scatter (and HSDP's
all-reduce across copies), whose mesh spans every rank so that the ranks of a group
also share the sharding of the parameters (torchtitan's ``dp_shard_cp``). The share is
therefore scaled by ``N``: the world's average is then the sum over each group's ranks
(the whole rows' gradient) averaged over the ``world / N`` data-parallel replicas, and
parameters stay equal on every rank.

A loss that takes whole sequences' sums (a preference pair's log-probs) has each rank
sum over its share of every sequence and the group add the shares first
(:func:`group_sum`); every rank of the group then computes the same loss, scaled by
``N`` in the same way (:func:`group_loss`).

:class:`ContextParallelDDP` is DDP with those groups; FSDP2's strategy
(:class:`recipes_lib.parallel.engines.FSDP2Strategy`) makes the same groups with
:func:`new_context_group`. The checks of :func:`check_context_parallel` run in the
pre-flight, before anything trains.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor

from recipes_lib.errors import ConfigError
from recipes_lib.kernels.sharded import ContextShard

if TYPE_CHECKING:
    from recipes_lib.kernels.attention import AttentionBackend


class ContextParallelDDP(DDPStrategy):
    """DDP whose ranks also form groups of ``degree`` that share each row.

    ``context_parallel`` (the degree) is what the data module divides its ranks by;
    ``context_group`` is this rank's group once the processes are connected."""

    def __init__(self, degree: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.context_parallel = degree
        self.context_group: dist.ProcessGroup | None = None

    def setup_distributed(self) -> None:
        super().setup_distributed()
        self.context_group = new_context_group(self.context_parallel)


def new_context_group(degree: int) -> dist.ProcessGroup:
    """This rank's group of ``degree`` consecutive ranks that share each row; a
    collective call: every rank creates every group, in one order."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for first in range(0, world, degree):
        group = dist.new_group(list(range(first, first + degree)))
        if first <= rank < first + degree:
            mine = group
    assert mine is not None  # the degree divides the world (check_context_parallel)
    return mine


def data_parallel_size(world_size: int, degree: int) -> int:
    """The data-parallel replicas of ``world_size`` processes whose groups of ``degree``
    share each row: each group reads one replica's rows, so a step's tokens and rows
    count ``world_size / degree`` replicas, not ``world_size``."""
    return max(1, world_size // max(1, degree))


@contextmanager
def holding_shard(model: Any, shard: ContextShard) -> Iterator[None]:
    """``model`` runs on ``shard``'s share of every row inside the block. After a block
    that ran with a gradient it keeps the shard: checkpointed blocks recompute their
    attention in the backward pass, sharded too, and the training step clears it once
    the backward has run. After a block without a gradient, or one that raised, the
    shard is cleared."""
    model.set_context_shard(shard)
    try:
        yield
    except BaseException:
        model.set_context_shard(None)
        raise
    if not torch.is_grad_enabled():
        model.set_context_shard(None)


def data_parallel_rank(strategy: object, rank: int) -> int:
    """The data-parallel replica of global ``rank`` under ``strategy``: the index of its
    context-parallel group of consecutive ranks (``rank`` itself without one)."""
    return rank // max(1, getattr(strategy, "context_parallel", 1))


def from_group_leader(strategy: object, value: Any) -> Any:
    """``value`` as the first rank of this rank's context-parallel group holds it (a
    collective call within the group; ``value`` itself without context parallelism):
    what every rank sharing a row must hold alike, such as sampled completions, which
    a GPU's kernels do not promise to draw bit for bit alike in every process."""
    if getattr(strategy, "context_parallel", 1) == 1 or not dist.is_initialized():
        return value
    group = getattr(strategy, "context_group", None)
    leader = dist.get_global_rank(group, 0) if group is not None else 0
    box = [value]
    dist.broadcast_object_list(box, src=leader, group=group)
    return box[0]


def context_shard(strategy: object, seq_len: int) -> ContextShard | None:
    """This rank's share of rows of ``seq_len`` under ``strategy`` (None: whole rows)."""
    degree = getattr(strategy, "context_parallel", 1)
    if degree == 1:
        return None
    if seq_len % (2 * degree) != 0:
        raise ConfigError(
            f"a batch of rows of {seq_len} tokens does not split into 2 x "
            f"strategy.context_parallel={degree} chunks"
        )
    group = getattr(strategy, "context_group", None)
    return ContextShard(seq_len=seq_len, degree=degree, rank=dist.get_rank(group), group=group)


def split_rows(
    strategy: object,
    input_ids: Tensor,
    labels: Tensor,
    doc_ids: Tensor | None = None,
    token_mask: Tensor | None = None,
) -> tuple[ContextShard, tuple[Tensor, Tensor, Tensor | None, Tensor | None]] | None:
    """This rank's share of a batch's rows under ``strategy`` (None: whole rows), and
    its shard.

    Rows of any length are split: padded rows (SFT without packing) are first widened on
    the right to a multiple of ``2 x strategy.context_parallel`` with padding that
    carries no loss (labels -100, a document id of its own, outside ``token_mask``);
    no real token attends to it, since it comes after every one.
    """
    degree = getattr(strategy, "context_parallel", 1)
    if degree == 1:
        return None
    extra = -labels.shape[1] % (2 * degree)
    if extra:
        input_ids = F.pad(input_ids, (0, extra), value=0)
        labels = F.pad(labels, (0, extra), value=-100)
        doc_ids = None if doc_ids is None else F.pad(doc_ids, (0, extra), value=-1)
        token_mask = None if token_mask is None else F.pad(token_mask, (0, extra), value=False)
    shard = context_shard(strategy, labels.shape[1])
    assert shard is not None  # degree > 1
    parts = (
        shard.shard(input_ids),
        shard.shard(labels),
        None if doc_ids is None else shard.shard(doc_ids),
        None if token_mask is None else shard.shard(token_mask),
    )
    return shard, parts


def sharded_loss(token_loss_sum: Tensor, tokens: Tensor, shard: ContextShard) -> Tensor:
    """The loss a rank backpropagates: its ``token_loss_sum`` over the group's token count
    times the degree (DDP and FSDP2 average over the whole world, where the group's
    shares must add up), valued as the group's mean."""
    total = tokens.detach().float().clone()
    summed = token_loss_sum.detach().clone()
    if shard.degree > 1:
        dist.all_reduce(total, group=shard.group)
        dist.all_reduce(summed, group=shard.group)
    total = total.clamp(min=1.0)
    share = token_loss_sum / total * shard.degree
    return share + (summed / total - share).detach()


class _GroupSum(torch.autograd.Function):
    """A sum over a process group whose backward keeps each rank's own gradient (see
    :func:`group_sum`)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        total = x.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def group_sum(x: Tensor, shard: ContextShard) -> Tensor:
    """``x`` summed over the ranks of ``shard``'s group: whole sequences' sums from each
    rank's share of their tokens (a pair's log-probs). Every rank then computes the same
    loss from the sum, so in the backward each keeps the gradient of its own share; the
    group's shares add up in the data-parallel reduction once the loss is scaled by the
    degree, as :func:`sharded_loss` scales it (:func:`group_loss`)."""
    if shard.degree == 1:
        return x
    return _GroupSum.apply(x, shard.group)


def group_loss(loss: Tensor, shard: ContextShard) -> Tensor:
    """The loss a rank backpropagates when every rank of the group computed ``loss`` from
    :func:`group_sum`'s sums: scaled by the degree (DDP and FSDP2 average over the whole
    world, where the group's shares must add up), valued as ``loss``."""
    return loss * shard.degree - (loss * (shard.degree - 1)).detach()


def shard_padded(shard: ContextShard, rows: Tensor, value: int) -> Tensor:
    """This rank's share of ``rows`` (``(B, T)``), first widened on the right with
    ``value`` to the shard's row length as :func:`split_rows` widens a batch."""
    extra = shard.seq_len - rows.shape[1]
    if extra:
        rows = F.pad(rows, (0, extra), value=value)
    return shard.shard(rows)


def check_context_parallel(
    degree: int,
    *,
    world_size: int,
    seq_len: int,
    strategy: str,
    strategy_supports: bool,
    backend: AttentionBackend,
    objective: str,
    objective_supports: bool,
    supporting: tuple[str, ...] = ("ddp",),
    shard_group_size: int | None = None,
    expert_parallel: bool = False,
) -> None:
    """Refuse, in one line naming the key, a context-parallel degree the run cannot use.

    ``supporting`` names the strategies that can split rows (for the message);
    ``shard_group_size`` is the ranks one HSDP copy shards over (None: not HSDP), which
    must hold whole groups so that a row's ranks share one copy's sharding.

    Raises:
        ConfigError: the degree is below 1, does not divide the world (or HSDP's shard
            group), does not split ``data.seq_len`` into ``2 x degree`` chunks, comes
            with expert parallelism, or the strategy, attention backend or objective
            cannot run with split rows.
    """
    if degree < 1:
        raise ConfigError(f"strategy.context_parallel={degree} must be 1 or more")
    if degree == 1:
        return
    if not strategy_supports:
        raise ConfigError(
            f"strategy.context_parallel={degree} needs strategy={' or '.join(supporting)}; "
            f"strategy={strategy} cannot split rows over ranks"
        )
    if world_size % degree != 0:
        raise ConfigError(
            f"strategy.context_parallel={degree} does not divide the {world_size} processes "
            "of the run (trainer.devices x trainer.num_nodes)"
        )
    if shard_group_size is not None and shard_group_size % degree != 0:
        raise ConfigError(
            f"strategy.context_parallel={degree} does not divide the {shard_group_size} ranks "
            "each strategy=hsdp copy shards over (world / strategy.replicas): a row's ranks "
            "must share one copy"
        )
    if expert_parallel:
        raise ConfigError(
            f"strategy.expert_parallel=true is not supported with strategy.context_parallel="
            f"{degree} yet: the experts' token exchange has not been checked on split rows"
        )
    if seq_len % (2 * degree) != 0:
        raise ConfigError(
            f"data.seq_len={seq_len} is not divisible by 2 x strategy.context_parallel="
            f"{degree} (each rank holds two equal chunks of every row)"
        )
    if not backend.capabilities.context_parallel:
        raise ConfigError(
            f"kernels.attention={backend.name} cannot run with rows split over ranks "
            f"(strategy.context_parallel={degree}); use kernels.attention=flex or sdpa"
        )
    if not objective_supports:
        raise ConfigError(
            f"stage.objective={objective} cannot split its rows over ranks; "
            f"strategy.context_parallel={degree} works with pretraining, continued "
            "pretraining, SFT (LoRA included), DPO, SimPO, ORPO, KTO, reward modelling, "
            "distillation and GRPO"
        )


__all__ = [
    "ContextParallelDDP",
    "check_context_parallel",
    "context_shard",
    "data_parallel_rank",
    "data_parallel_size",
    "from_group_leader",
    "group_loss",
    "group_sum",
    "holding_shard",
    "new_context_group",
    "shard_padded",
    "sharded_loss",
    "split_rows",
]
