"""What the peer benchmarks (``posttrain_peer.py``, ``grpo_peer.py``) share: the step
figures, the clocks that record each side's steps, and the process each side runs in."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def figures(ends: list[float], tokens: list[int], warmup: int, start: float) -> dict:
    """Tokens/s and step time over the steps after ``warmup``; time to the first step."""
    import torch

    timed = len(ends) - warmup - 1
    if timed < 1:
        raise RuntimeError(f"only {len(ends)} steps ran; {warmup + 2} needed")
    seconds = ends[-1] - ends[warmup]
    counted = sum(tokens[warmup + 1 :])
    cuda = torch.cuda.is_available()
    return {
        "tokens_per_sec": round(counted / seconds, 1),
        "step_time_ms": round(seconds / timed * 1000, 2),
        "timed_steps": timed,
        "tokens_per_step": round(counted / timed, 1),
        "time_to_first_step_s": round(ends[0] - start, 1),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None,
    }


def sync() -> float:
    """The time, once the GPU has finished its queued work."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.time()


def lightning_clock():
    """A Lightning callback that records each step's end and the tokens it trained on."""
    from lightning.pytorch.callbacks import Callback

    class Clock(Callback):
        def __init__(self):
            self.ends: list[float] = []
            self.tokens: list[int] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.ends.append(sync())
            self.tokens.append(pl_module.count_tokens(batch))

    return Clock()


def trainer_clock():
    """A transformers callback that records each step's end (the caller counts tokens)."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []
            self.tokens: list[int] = []

        def on_step_end(self, targs, state, control, **kwargs):
            self.ends.append(sync())

    return Clock()


def spawn(args, case: str, side: str, root: Path, script: str) -> dict:
    """Run one side of one case in a process of the benchmark ``script`` (its
    ``--worker`` mode) and read back its figures."""
    out = root / f"{case}.{side}.json"
    command = [sys.executable, script, *args.argv, "--worker"]
    command += ["--case", case, "--side", side, "--root", str(root), "--worker-out", str(out)]
    env = {**os.environ, "PEER_START": repr(time.time())}
    # compile caches of its own: no side starts from kernels another side compiled
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env[name] = str(root / "caches" / f"{case}.{side}" / name.lower())
    try:
        done = subprocess.run(command, env=env, timeout=args.side_timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"the {side} process ran past --side-timeout={args.side_timeout} s"}
    if out.is_file():
        return json.loads(out.read_text())
    return {"error": f"the {side} process exited with status {done.returncode} and no figures"}


# what a side's worker process is told, left out of the reported settings
WORKER_ONLY = ("out", "worker", "case", "side", "root", "worker_out", "argv")


def add_peer_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments every peer benchmark takes: the seed, gradient checkpointing, each
    side's time limit, further overrides of the library's side, the smoke mode and the
    output, and the hidden ones of a side's worker process."""
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--checkpointing", type=lambda s: s.lower() in ("1", "true", "on"), default=True)
    p.add_argument("--side-timeout", type=int, default=900)
    p.add_argument("--override", action="append", default=[], help="a further recipes_lib override")
    p.add_argument("--smoke", action="store_true", help="a tiny shape on CPU, fp32")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--side", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)


def check_choices(p: argparse.ArgumentParser, args: argparse.Namespace, **allowed) -> None:
    """Refuse (``p.error``) a comma-separated option naming what it does not allow:
    ``check_choices(p, args, sides=SIDES)`` checks ``--sides``."""
    for name, known in allowed.items():
        unknown = set(getattr(args, name).split(",")) - set(known)
        if unknown:
            p.error(f"--{name}: unknown {sorted(unknown)}; choose from {list(known)}")


def report_header(args: argparse.Namespace, *packages: str) -> dict:
    """The start of a peer benchmark's report: its settings, the card and the versions of
    torch and ``packages``; its ``cases`` to fill."""
    import torch
    from _common import package_versions

    cuda = torch.cuda.is_available() and not args.smoke
    return {
        "settings": {k: v for k, v in vars(args).items() if k not in WORKER_ONLY},
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "versions": package_versions("torch", "transformers", *packages),
        "cases": {},
    }
