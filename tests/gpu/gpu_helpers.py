"""Helpers shared by the GPU tests: CSV metrics of a run, ``torchrun`` jobs, peak
training memory and the small QLoRA runs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback
from run_metrics import metric_series, read_metrics

__all__ = [
    "WORKER",
    "PeakTrainingMemory",
    "metric_series",
    "qlora_overrides",
    "read_metrics",
    "torchrun",
]

WORKER = Path(__file__).with_name("multigpu_worker.py")


def torchrun(processes: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=<processes> <args>``; fails the test with
    the end of its output when the job fails."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "4"}
    # its own session, so a job that hangs is stopped with every worker it started
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        status = f"exited with {proc.returncode}"
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        status = f"timed out after {timeout} s"
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)}\n{status}\n"
            f"--- stdout ---\n{stdout[-3000:]}\n--- stderr ---\n{stderr[-8000:]}"
        )
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


class PeakTrainingMemory(Callback):
    """The peak CUDA memory allocated from the start of fit to the end of training."""

    def __init__(self) -> None:
        self.peak = 0

    def on_fit_start(self, trainer, pl_module) -> None:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

    def on_train_end(self, trainer, pl_module) -> None:
        torch.cuda.synchronize()
        self.peak = torch.cuda.max_memory_allocated()


def qlora_overrides(recipe: str, source: str, run_dir: Path, cache_dir: Path, *extra: str):
    """A 1B QLoRA recipe (``sft/qlora_1b``, ``dpo/qlora_1b``) shrunk to 4 steps on a
    randomly initialised Qwen2-0.5B shape: the memory and the code path are what count."""
    return [
        f"recipe={recipe}",
        "model=qwen2_0_5b",
        f"run.dir={run_dir}",
        f"data.cache_dir={cache_dir}",
        f"data.sources.{source}.max_documents=200",
        "data.tokenizer.vocab_size=8192",
        "data.seq_len=512",
        "data.batch_size=4",
        "trainer.max_steps=4",
        "trainer.accumulate_grad_batches=1",
        "trainer.val_check_interval=4",
        "trainer.limit_val_batches=2",
        "trainer.log_every_n_steps=1",
        "trainer.enable_progress_bar=false",
        "scheduler.warmup=1",
        "run.checkpoint_every_n_steps=4",
        "run.save_top_k=0",  # last.ckpt only: a 0.5B model's checkpoint is several GB
        "callbacks=minimal",
        *extra,
    ]
