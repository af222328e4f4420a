"""Collectives the objectives make themselves, outside a strategy's own."""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor


def summed_over_ranks(value: Tensor) -> Tensor:
    """``value`` summed in place over every rank by one all-reduce (Lightning's
    ``reduce`` puts a barrier before it, a second collective for nothing); this rank's
    own where it runs alone."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value
