"""Run by ``torchrun`` from ``test_context_parallel.py`` and ``test_long_recipes.py``:
``recipes_lib.train.run`` on the overrides given, with a spy on the sharded attention
that writes, per rank, how many times it ran and the query lengths it saw, and how many
block inputs activation offload sent to the host (``<run.dir>/sharded_rank<r>.json``),
so the test knows the rows were split and not trained whole on every rank.

Several runs, their overrides separated by ``+``, run one after another in the same
processes (a later one may resume from an earlier one's checkpoint), each counted apart."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from recipes_lib.config import compose_config
from recipes_lib.kernels.offload import ActivationOffload
from recipes_lib.kernels.sharded import ShardedAttention
from recipes_lib.train import run


def main() -> None:
    seen: list[int] = []
    attend = ShardedAttention.__call__

    def spy(self, q, k, v, mask, scale=None):
        seen.append(q.shape[2])
        return attend(self, q, k, v, mask, scale)

    ShardedAttention.__call__ = spy  # type: ignore[method-assign]
    offloads: list[ActivationOffload] = []
    start = ActivationOffload.__init__

    def remember(self):
        start(self)
        offloads.append(self)

    ActivationOffload.__init__ = remember  # type: ignore[method-assign]
    runs, overrides = [], []
    for arg in [*sys.argv[1:], "+"]:
        if arg == "+":
            runs.append(overrides)
            overrides = []
        else:
            overrides.append(arg)
    for overrides in runs:
        seen.clear()
        offloads.clear()
        cfg = compose_config(overrides)
        run(cfg)
        out = Path(cfg.run.dir) / f"sharded_rank{os.environ['RANK']}.json"
        offloaded = sum(o.copies for o in offloads)
        out.write_text(
            json.dumps({"calls": len(seen), "lengths": sorted(set(seen)), "offloaded": offloaded})
        )


if __name__ == "__main__":
    main()
