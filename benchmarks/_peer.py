"""What the peer benchmarks (``posttrain_peer.py``, ``grpo_peer.py``) share: the step
figures, the clocks that record each side's steps, and the process each side runs in."""

from __future__ import annotations

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
    try:
        done = subprocess.run(command, env=env, timeout=args.side_timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"the {side} process ran past --side-timeout={args.side_timeout} s"}
    if out.is_file():
        return json.loads(out.read_text())
    return {"error": f"the {side} process exited with status {done.returncode} and no figures"}
