"""Run by ``torchrun`` from ``test_distributed_cpu.py``: several runs, one after another,
in one process group.

The argument is a JSON file holding a list of runs, each the overrides ``recipes-train``
would take. Each is ``recipes_lib.train.run`` on its composed config, as the console
script runs it; the processes start, import Lightning and join the group once for the
whole list instead of once per run, which is most of what a tiny run on two processes
costs on a CPU. A later run may resume from an earlier one's checkpoint.

Usage: ``torchrun --nproc_per_node=N distributed_batch.py <runs.json>``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

from recipes_lib.config import compose_config
from recipes_lib.train import run


def main() -> None:
    for overrides in json.loads(Path(sys.argv[1]).read_text()):
        run(compose_config(overrides))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
