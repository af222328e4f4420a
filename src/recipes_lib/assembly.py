"""The parts a run is assembled from, built from its config: the batch arithmetic
(tokens per optimizer step, the batch ramp's schedule, the run's steps), the Lightning
Trainer with the configured callbacks, loggers, strategy and checkpoint I/O, the
objective's LightningModule, and the checks that precede them.

:func:`recipes_lib.train.run` assembles a run from these; the launch check
(:mod:`recipes_lib.launch_check`) assembles the same parts to estimate and probe a
launch without training, so both sit above this module and neither imports the other's
entry point.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelSummary, ProgressBar

from recipes_lib.callbacks.summary import ModelSizeSummary
from recipes_lib.checkpoint.io import VerifiedCheckpointIO
from recipes_lib.checkpoint.layout import RunDir
from recipes_lib.checkpoint.retention import retention_of
from recipes_lib.config import RunConfig, instantiate_dict
from recipes_lib.config.instantiate import CALLBACKS, LOGGERS
from recipes_lib.errors import ConfigError
from recipes_lib.objectives import build_module, objective_names
from recipes_lib.optim.batch_ramp import BatchSchedule
from recipes_lib.parallel import build_strategy, get_strategy, trainer_devices
from recipes_lib.parallel.context import data_parallel_size
from recipes_lib.parallel.fp8 import fp8_callbacks
from recipes_lib.parallel.precision import lightning_precision
from recipes_lib.preflight import check_run
from recipes_lib.training.module import CausalLMModule


def tokens_per_step(cfg: RunConfig, world_size: int) -> int:
    """Tokens consumed by one full optimizer step across all ranks (after any ramp); the
    ranks of a context-parallel group share their rows."""
    replicas = data_parallel_size(world_size, cfg.strategy.context_parallel)
    return cfg.data.seq_len * cfg.data.batch_size * cfg.trainer.accumulate_grad_batches * replicas


def batch_schedule(cfg: RunConfig, world_size: int) -> BatchSchedule:
    """Micro-batches per optimizer step: ``trainer.accumulate_grad_batches``, ramped up to
    over ``stage.batch_ramp.tokens`` when set (:mod:`recipes_lib.optim.batch_ramp`)."""
    replicas = data_parallel_size(world_size, cfg.strategy.context_parallel)
    micro = cfg.data.seq_len * cfg.data.batch_size * replicas
    return BatchSchedule.of(cfg.stage.batch_ramp, cfg.trainer.accumulate_grad_batches, micro)


def total_steps(cfg: RunConfig, schedule: BatchSchedule) -> int:
    """Optimizer steps of the run: ``stage.max_tokens`` when set, else ``trainer.max_steps``."""
    if cfg.stage.max_tokens is not None:
        return schedule.steps_for_tokens(cfg.stage.max_tokens)
    return cfg.trainer.max_steps


def build_trainer(cfg: RunConfig, extra_callbacks: Sequence[Callback] = ()) -> L.Trainer:
    """A Lightning Trainer from ``cfg.trainer`` plus the configured callbacks and loggers."""
    kwargs: dict[str, Any] = dict(vars(cfg.trainer))
    accumulate = cfg.trainer.accumulate_grad_batches
    if not get_strategy(cfg.strategy.name).steps_in_engine:
        # the module runs each step's micro-batches and clips itself: a Lightning batch is a step
        accumulate = kwargs["accumulate_grad_batches"] = 1
        kwargs["gradient_clip_val"] = None
    # Our validation interval counts optimizer steps; Lightning's counts micro-batches.
    val_every = kwargs.pop("val_check_interval")
    if val_every is not None:
        kwargs["val_check_interval"] = max(1, min(val_every, cfg.trainer.max_steps)) * accumulate
    else:
        kwargs["limit_val_batches"] = 0
    allowed = cfg.run.allowed_targets
    callbacks = instantiate_dict(cfg.callbacks, "callbacks", CALLBACKS, allowed)
    callbacks += list(extra_callbacks)
    # float8 all-gather under FSDP: every weight's scale refreshed after each step
    callbacks += fp8_callbacks(
        cfg.precision, fsdp=get_strategy(cfg.strategy.name).float8_all_gather
    )
    if not cfg.trainer.enable_progress_bar:  # a progress bar callback would contradict it
        callbacks = [cb for cb in callbacks if not isinstance(cb, ProgressBar)]
    # Our summary line replaces Lightning's table (whose FLOPs need an example input:
    # "Total FLOPs: 0"); Lightning is told not to add its own, which would also log that
    # it skipped it when a summary callback is configured.
    summary = kwargs.pop("enable_model_summary")
    if summary and not any(isinstance(cb, ModelSummary) for cb in callbacks):
        callbacks.append(ModelSizeSummary(seq_len=cfg.data.seq_len))
    kwargs["enable_model_summary"] = False
    loggers = instantiate_dict(cfg.logger, "logger", LOGGERS, allowed)
    kwargs["devices"] = trainer_devices(cfg)
    retention = retention_of(cfg.run, cfg.stage.average_last_k)
    checkpoint_io = VerifiedCheckpointIO(
        RunDir(cfg.run.dir).checkpoints, retention, cfg.strategy.async_checkpoint
    )
    trainer = L.Trainer(
        **kwargs,
        strategy=build_strategy(cfg.strategy, micro_batch_size=cfg.data.batch_size),
        precision=lightning_precision(cfg.precision),
        callbacks=callbacks,
        logger=loggers if loggers else False,
        default_root_dir=cfg.run.dir,
        use_distributed_sampler=False,  # our sampler shards by rank and resumes mid-epoch
        # every checkpoint file written atomically with its checksum, verified on load,
        # and the run's retention applied in checkpoints/ as each one lands
        plugins=[checkpoint_io],
    )
    checkpoint_io.final_step = lambda: trainer.max_steps  # the last save is written in place
    return trainer


def build_stage(
    cfg: RunConfig, *, total_steps: int, tokens_per_step: int, **extra: Any
) -> CausalLMModule:
    """The LightningModule of ``cfg.stage.objective``, as its spec builds it
    (``extra``: module arguments such as a rollback's ``lr_window``)."""
    return build_module(cfg, total_steps=total_steps, tokens_per_step=tokens_per_step, **extra)


def check_run_config(cfg: RunConfig) -> None:
    """Every check :func:`run` makes before touching data or weights (the pre-flight,
    :func:`recipes_lib.preflight.check_run`).

    Raises:
        ConfigError: the first problem found, naming its keys; ``run.launch_check=true``,
            which asks for the pre-launch check instead of a run.
    """
    check_run(cfg, objectives=objective_names())
    if cfg.run.launch_check:
        raise ConfigError(
            "run.launch_check=true asks for the pre-launch check, not a run: use recipes-check "
            "or recipes-train (or recipes_lib.launch_check.check_launch); set "
            "run.launch_check=false to train"
        )
