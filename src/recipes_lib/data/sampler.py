"""A shuffling sampler that resumes exactly where a run stopped, on any number of ranks.

The sampler defines one endless global stream: position ``p`` reads index
``perm_e[p % num_samples]`` where ``e = p // num_samples`` is the epoch and ``perm_e``
a ``torch.randperm`` seeded by ``(seed, e)``. Rank ``r`` of ``world_size`` reads
positions ``r, r + world_size, r + 2 * world_size, ...``, so ranks never overlap, and
skipping the first ``start`` draws of each rank costs nothing: resuming from
``start = k`` yields exactly the tail of the uninterrupted stream.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler

_SEED_STRIDE = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, epoch) pairs apart


def epoch_seed(seed: int, epoch: int) -> int:
    """The ``torch.Generator`` seed of one epoch's permutation."""
    return (seed * _SEED_STRIDE + epoch) % (1 << 63)


class ResumableSampler(Sampler[int]):
    """Endless seeded shuffling over ``range(num_samples)``, sharded across ranks.

    Args:
        num_samples: the dataset's length.
        seed: seeds every epoch's permutation.
        start: draws this rank already consumed; iteration begins after them.
        rank: this process's global rank.
        world_size: the number of ranks sharing the stream.
        length: what ``len()`` reports: the number of draws the trainer will make on
            this rank (Lightning sizes an epoch by it). ``None``: one epoch's share.

    Iterating never ends by itself; the trainer stops after ``length`` draws (or its
    step limit). Iterating again continues where the previous iterator stopped rather
    than replaying, so a second Lightning epoch sees new samples.
    """

    def __init__(
        self,
        num_samples: int,
        seed: int,
        start: int = 0,
        rank: int = 0,
        world_size: int = 1,
        length: int | None = None,
    ) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got {rank=}, {world_size=}")
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        self.num_samples = num_samples
        self.seed = seed
        self.start = start
        self.rank = rank
        self.world_size = world_size
        self.length = length if length is not None else -(-(num_samples - rank) // world_size)
        self.position = start  # draws of this rank handed out so far
        self._epoch = -1
        self._perm: np.ndarray | None = None

    def __len__(self) -> int:
        return self.length

    def global_position(self, draw: int) -> int:
        """The stream position of this rank's ``draw``-th sample."""
        return draw * self.world_size + self.rank

    def index_at(self, global_position: int) -> int:
        """The dataset index at a position of the global stream."""
        epoch, offset = divmod(global_position, self.num_samples)
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            self._perm = torch.randperm(self.num_samples, generator=generator).numpy()
            self._epoch = epoch
        return int(self._perm[offset])  # type: ignore[index]

    def __iter__(self) -> Iterator[int]:
        while True:
            index = self.index_at(self.global_position(self.position))
            self.position += 1
            yield index

    def state_dict(self) -> dict[str, int]:
        """Where the stream stands: ``position`` is the draws of this rank handed out."""
        return {
            "position": self.position,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "rank": self.rank,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a :meth:`state_dict` position."""
        self.position = int(state["position"])
