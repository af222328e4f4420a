"""Measuring the library's own training path: composed configs, synthetic batches, timing.

The benchmarks that time ``recipes_lib`` build it the way ``recipes_lib.train.run`` does
(``compose_config`` -> ``to_run_config`` -> ``build_trainer`` / ``build_stage``), so the
strategy, precision plugin, FP8 conversion, activation checkpointing and per-block
compilation measured are the library's own. Only the data differs: uniformly random
tokens made on the host up front, so data loading is not measured.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import lightning as L
import torch
from _common import StepTimer

from recipes_lib.config import RunConfig, compose_config, to_run_config
from recipes_lib.models import Transformer
from recipes_lib.train import build_stage, build_trainer, check_run_config

GRAD_CLIP = 1.0

Batch = dict[str, torch.Tensor]


def flag(value: bool) -> str:
    return "true" if value else "false"


def measured_run_overrides(
    *,
    steps: int,
    seq_len: int,
    batch_size: int,
    accelerator: str,
    devices: int,
    run_dir: str,
    seed: int,
    monitors: bool = False,
) -> list[str]:
    """Hydra overrides that turn any composed run into a timed one.

    ``steps`` optimizer steps of one micro-batch each, a constant LR (lr 3e-4, weight
    decay 0.1), gradient clipping at 1.0, no validation, no logger, no checkpoint files
    (the checkpoint callback stays but saves nothing), no progress bar. With
    ``monitors`` the throughput and gradient-norm callbacks of ``callbacks=default`` run
    as in a real run.
    """
    return [
        f"trainer.accelerator={accelerator}",
        f"trainer.devices={devices}",
        "trainer.num_nodes=1",
        f"trainer.max_steps={steps}",
        "trainer.accumulate_grad_batches=1",
        f"trainer.gradient_clip_val={GRAD_CLIP}",
        "trainer.val_check_interval=null",
        "trainer.num_sanity_val_steps=0",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        f"data.seq_len={seq_len}",
        f"data.batch_size={batch_size}",
        "optim.lr=3e-4",
        "optim.weight_decay=0.1",
        "scheduler=constant",
        "scheduler.warmup=0",
        "scheduler.min_lr_ratio=1.0",
        "callbacks=default" if monitors else "callbacks=minimal",
        "run.save_top_k=0",  # with save_last off, the checkpoint callback writes nothing
        "callbacks.checkpoint.save_last=false",
        "logger=none",
        f"run.dir={run_dir}",
        f"run.seed={seed}",
        "run.ckpt_path=null",
        "stage.init_from=null",
    ]


def rank_and_device(*, cpu: bool) -> tuple[int, int, torch.device]:
    """This process's global rank, the world size (from torchrun's variables; 0 and 1
    without them) and its device: the CPU, or the GPU of its local rank (made current,
    with TF32 matmuls for fp32 work)."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if cpu:
        return rank, world_size, torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    torch.set_float32_matmul_precision("high")
    return rank, world_size, device


def compose_run(overrides: Sequence[str], *, check: bool = True) -> RunConfig:
    """The typed config ``recipes-train <overrides>`` would run; with ``check``, checked
    as ``run`` checks it (a precision or strategy this machine cannot run fails here,
    with its reason)."""
    cfg = to_run_config(compose_config(list(overrides)))
    if check:
        check_run_config(cfg)
    return cfg


def meta_transformer(cfg) -> Transformer:
    """The model without memory behind its weights, for parameter and FLOP counts."""
    with torch.device("meta"):
        return Transformer(cfg)


def synthetic_batches(vocab_size: int, batch_size: int, seq_len: int, n: int, seed: int):
    """``n`` batches of uniformly random tokens on the CPU (the same for a given seed)."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (n, batch_size, seq_len + 1), generator=generator)
    doc_ids = torch.zeros(batch_size, seq_len, dtype=torch.int32)  # one document per row
    return [
        {"input_ids": row[:, :-1].clone(), "labels": row[:, 1:].clone(), "doc_ids": doc_ids}
        for row in tokens
    ]  # each (B, T)


class MeasuredSteps(L.Callback):
    """Starts the timer at the first measured batch and stops it after the last one.

    Every rank times (each synchronizes its own device); under data parallelism the
    ranks wait for each other at every step, so rank 0's clock is the run's clock.
    """

    def __init__(self, timer: StepTimer, warmup_steps: int, total_steps: int):
        self.timer, self.warmup_steps, self.total_steps = timer, warmup_steps, total_steps
        self.last_loss: torch.Tensor | None = None
        self.steps_done = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.warmup_steps:
            self.timer.start()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            self.last_loss = loss.detach()
        self.steps_done = batch_idx + 1
        if batch_idx >= self.warmup_steps:
            self.timer.step_end()
        if batch_idx == self.total_steps - 1:
            self.timer.stop()


@dataclass
class MeasuredFit:
    timer: StepTimer
    final_loss: float
    trainer: L.Trainer
    module: L.LightningModule


def fit_measured(
    cfg: RunConfig,
    batches: list[Batch],
    *,
    warmup_steps: int,
    device: torch.device,
    world_size: int = 1,
    callbacks: Sequence[L.Callback] = (),
) -> MeasuredFit:
    """Train ``cfg`` on ``batches`` (one per step, this rank's) and time the steps after
    ``warmup_steps``. The trainer and module are built by the library's own builders;
    ``callbacks`` run after the timing callback.
    The CUDA peak-memory counter is left alone: it covers building the model too.

    Raises:
        RuntimeError: the trainer stopped before the last batch.
    """
    total = len(batches)
    if cfg.trainer.max_steps != total:
        raise ValueError(f"trainer.max_steps={cfg.trainer.max_steps} but {total} batches")
    B, T = batches[0]["input_ids"].shape
    timer = StepTimer(device)
    measured = MeasuredSteps(timer, warmup_steps, total)
    L.seed_everything(cfg.run.seed, verbose=False)  # the module inits from PL_GLOBAL_SEED
    trainer = build_trainer(cfg, [measured, *callbacks])
    module = build_stage(cfg, total_steps=total, tokens_per_step=B * T * world_size)
    loader = torch.utils.data.DataLoader(batches, batch_size=None, shuffle=False)
    trainer.fit(module, train_dataloaders=loader)
    if not timer.started or measured.last_loss is None or measured.steps_done < total:
        raise RuntimeError(
            f"the trainer stopped after {measured.steps_done} of {total} steps "
            f"(global step {trainer.global_step})"
        )
    return MeasuredFit(timer, measured.last_loss.float().item(), trainer, module)


def temporary_run_dir() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="recipes-bench-")
