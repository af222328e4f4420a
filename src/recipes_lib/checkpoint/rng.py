"""The random number generators' states, saved in a checkpoint and restored on resume,
so a resumed run draws the same numbers (dropout, sampling) as one that never stopped."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor


def collect_rng_states(device: torch.device) -> dict[str, Any]:
    """Python, NumPy, torch CPU and (on a CUDA device) CUDA generator states.

    Stored as tensors and plain Python values so a checkpoint loads with
    ``torch.load(weights_only=True)``.
    """
    # the global generator is always MT19937, whose legacy state is this tuple (the
    # stub's union also allows the dict of other bit generators)
    state = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())
    algorithm, keys, pos, has_gauss, cached_gaussian = state
    states: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "algorithm": str(algorithm),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def restore_rng_states(states: Mapping[str, Any], device: torch.device) -> None:
    """Inverse of :func:`collect_rng_states`; a missing entry is left alone."""
    if "python" in states:
        version, internal, gauss_next = states["python"]
        random.setstate((version, tuple(internal), gauss_next))
    if "numpy" in states:
        n = states["numpy"]
        keys = np.asarray(n["keys"].numpy() if isinstance(n["keys"], Tensor) else n["keys"])
        np.random.set_state(
            (n["algorithm"], keys.astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
        )
    if "torch" in states:
        torch.set_rng_state(states["torch"].cpu())
    if "cuda" in states and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"].cpu(), device)
