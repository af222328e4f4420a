"""Run by ``torchrun`` from ``test_distributed_cpu.py``: several runs, one after another,
in one process group.

The argument is a JSON file holding a list of runs, each the overrides ``recipes-train``
would take. Each is ``recipes_lib.train.run`` on its composed config, as the console
script runs it; the processes start, import Lightning and join the group once for the
whole list instead of once per run, which is most of what a tiny run on two processes
costs on a CPU. A later run may resume from an earlier one's checkpoint.

Rank 0 writes what the library logs during each run (its INFO lines: the strategy's
layout, the expert placement) beside the run's folder, ``<run.dir>.log``, as the console
script's ``cli.log`` holds them.

Usage: ``torchrun --nproc_per_node=N distributed_batch.py <runs.json>``.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch.distributed as dist

from recipes_lib.config import compose_config
from recipes_lib.files import global_rank
from recipes_lib.train import run


def run_log(run_dir: Path) -> Path:
    """Where a run's library log lines go: beside its folder, which the run makes."""
    return run_dir.with_name(f"{run_dir.name}.log")


def _run_logged(overrides: list[str]) -> None:
    """One run; on rank 0 its library log lines go to :func:`run_log`."""
    cfg = compose_config(overrides)
    if global_rank() != 0:
        run(cfg)
        return
    path = run_log(Path(cfg.run.dir))
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    library = logging.getLogger("recipes_lib")
    level = library.level
    library.addHandler(handler)
    library.setLevel(logging.INFO)
    try:
        run(cfg)
    finally:
        library.removeHandler(handler)
        library.setLevel(level)
        handler.close()


def main() -> None:
    for overrides in json.loads(Path(sys.argv[1]).read_text()):
        _run_logged(overrides)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
