"""Weighted mixtures of map-style datasets.

The mixture is laid out in blocks of a fixed schedule computed once by smooth weighted
round-robin (the nginx algorithm): within every block each source appears in proportion
to its weight, evenly spread, and a source's local index keeps counting up across
blocks, wrapping around its own length. So mixture index ``j`` maps to a source and a
local index in O(1), the proportions hold over any stretch longer than a block, and a
small source is repeated (upsampled) rather than a large one truncated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from torch.utils.data import Dataset

from recipes_lib.errors import ConfigError

_MIN_BLOCK = 1024  # mixture positions per schedule block, at least
_MAX_BLOCK = 1 << 16


def check_weights(weights: Mapping[str, float]) -> dict[str, float]:
    """Validate mixture weights.

    Raises:
        ConfigError: a weight is not a positive finite number (naming
            ``data.sources.<name>.weight``).
    """
    checked = {}
    for name, weight in weights.items():
        if not isinstance(weight, int | float) or not math.isfinite(weight) or weight <= 0:
            raise ConfigError(
                f"data.sources.{name}.weight must be a positive number, got {weight!r}"
            )
        checked[name] = float(weight)
    if not checked:
        raise ConfigError("a mixture needs at least one source (data.sources)")
    return checked


def smooth_weighted_round_robin(weights: list[float], length: int) -> np.ndarray:
    """The source index of each of ``length`` slots, spread evenly by weight, (length,)."""
    current = [0.0] * len(weights)
    total = sum(weights)
    order = np.empty(length, dtype=np.int64)
    for slot in range(length):
        for i, weight in enumerate(weights):
            current[i] += weight
        chosen = max(range(len(weights)), key=lambda i: current[i])
        current[chosen] -= total
        order[slot] = chosen
    return order


class MixtureDataset(Dataset):
    """A deterministic weighted interleaving of several map-style datasets.

    Args:
        datasets: name -> dataset; the names are the keys under ``data.sources``.
        weights: name -> positive relative weight; source ``i`` provides about
            ``weight_i / sum(weights)`` of the items.
        length: the mixture's length (``None``: the shortest length in which every
            source's items all appear at least once, ``max_i len_i / share_i``).

    Raises:
        ConfigError: a non-positive weight, or names that differ between the two maps.
    """

    def __init__(
        self,
        datasets: Mapping[str, Dataset],
        weights: Mapping[str, float],
        length: int | None = None,
    ) -> None:
        weights = check_weights(weights)
        if set(weights) != set(datasets):
            raise ConfigError(
                f"mixture weights name {sorted(weights)} but datasets name {sorted(datasets)}"
            )
        self.names = list(datasets)
        self.datasets = [datasets[name] for name in self.names]
        self.lengths = [len(d) for d in self.datasets]  # type: ignore[arg-type]
        for name, size in zip(self.names, self.lengths, strict=True):
            if size == 0:
                raise ConfigError(f"data.sources.{name} has no items to mix")
        raw = [weights[name] for name in self.names]
        self.shares = [w / sum(raw) for w in raw]
        # Long enough that the rarest source has at least two slots per block.
        self.block = max(_MIN_BLOCK, math.ceil(2 / min(self.shares)))
        if self.block > _MAX_BLOCK:
            rarest = self.names[int(np.argmin(self.shares))]
            raise ConfigError(
                f"data.sources.{rarest}.weight is too small: a share of "
                f"{min(self.shares):.2g} of the mixture (the least is {2 / _MAX_BLOCK:.2g})"
            )
        self.schedule = smooth_weighted_round_robin(raw, self.block)  # (block,) source per slot
        self.per_block = np.bincount(self.schedule, minlength=len(raw))  # (n_sources,)
        # rank_in_block[s] = how many earlier slots of the block belong to the same source
        self.rank_in_block = np.zeros(self.block, dtype=np.int64)
        seen = np.zeros(len(raw), dtype=np.int64)
        for slot, source in enumerate(self.schedule):
            self.rank_in_block[slot] = seen[source]
            seen[source] += 1
        if length is None:
            length = max(
                math.ceil(size * self.block / count)
                for size, count in zip(self.lengths, self.per_block, strict=True)
            )
        self._length = int(length)

    def __len__(self) -> int:
        return self._length

    def locate(self, index: int) -> tuple[int, int]:
        """The (source position in ``names``, local index) that mixture ``index`` reads."""
        if not 0 <= index < self._length:
            raise IndexError(f"index {index} out of range for a mixture of {self._length}")
        block, slot = divmod(index, self.block)
        source = int(self.schedule[slot])
        local = block * int(self.per_block[source]) + int(self.rank_in_block[slot])
        return source, local % self.lengths[source]

    def __getitem__(self, index: int):
        source, local = self.locate(index)
        return self.datasets[source][local]
