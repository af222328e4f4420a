"""``run(cfg) -> RunResult``: the single entry used by the CLI, pipelines, tests and examples.

The order below matters and reads top to bottom:

1. convert the composed config to typed dataclasses and validate what can be checked
   without touching data or weights (bad keys already failed at compose time); resolve
   ``kernels.activation_checkpointing=auto`` for the card or ``run.memory_budget_gib``
   (:mod:`.launch_check.autofit`: checkpointing, loss chunk, micro-batch);
2. build the Trainer first: its world size fixes the tokens per optimizer step, which
   turns token durations into steps;
3. build the data module (tokenizer + shards are prepared once, on rank 0) and the
   objective's LightningModule (the model itself is built in ``configure_model``);
4. hold ``run.dir`` (one run at a time, :mod:`.checkpoint.run_lock`), remove what an
   interrupted write left there, and fit, resuming from ``run.ckpt_path`` when set, or
   when ``run.dir`` holds checkpoints of the same config (a rerun of the same command);
   SIGTERM or SIGUSR1 stops every rank after the same step with a checkpoint and exit
   status 75 (:mod:`.callbacks.preemption`);
5. export the stage's output weights to ``<run.dir>/model.safetensors`` (rank 0): the
   final weights, the mean of the last ``stage.average_last_k`` step checkpoints, or
   the ``stage.ema_decay`` moving average. With an adapter (LoRA/QLoRA) these are the
   base weights with the adapters merged in, and ``<run.dir>/adapter/`` holds the
   adapters alone in PEFT's format. The tokenizer is written beside them, and with
   ``stage.export_hf`` they are also ``<run.dir>/hf/``, a Hugging Face folder checked
   against transformers (:mod:`recipes_lib.export`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from omegaconf import DictConfig, OmegaConf

from recipes_lib.assembly import (
    batch_schedule,
    build_stage,
    build_trainer,
    check_run_config,
    tokens_per_step,
    total_steps,
)
from recipes_lib.callbacks.ema import WeightEMA
from recipes_lib.callbacks.preemption import Preemption
from recipes_lib.callbacks.start import StartClock
from recipes_lib.checkpoint.layout import RunDir
from recipes_lib.checkpoint.resume import auto_resume, remove_unfinished_writes, resolve_ckpt_path
from recipes_lib.checkpoint.run_lock import hold_run_dir
from recipes_lib.checkpoint.source import fill_model_from_init
from recipes_lib.config import RunConfig, to_run_config
from recipes_lib.config.widening import widening_line
from recipes_lib.data.module import ResumableDataModule
from recipes_lib.data.sources import resolve_cache_dir
from recipes_lib.export import export_run
from recipes_lib.files import global_rank, write_text_atomic
from recipes_lib.kernels.compiled import (
    keep_compile_caches,
    start_compile_workers,
    watch_compiles,
)
from recipes_lib.launch_check.autofit import fit_memory
from recipes_lib.models.hf_fallback import is_fallback
from recipes_lib.models.windows import attention_choice
from recipes_lib.objectives import build_data
from recipes_lib.optim.batch_ramp import BatchSchedule
from recipes_lib.parallel import (
    get_strategy,
)
from recipes_lib.parallel.precision import resolve_device_choices, trains_on_cuda
from recipes_lib.parallel.strategy import planned_world_size
from recipes_lib.trackers import attach_files, trackers_of
from recipes_lib.training.module import CausalLMModule
from recipes_lib.training.outputs import (
    OutputWeights,
    export_weights,
    prepare_averaging,
    save_tokenizer_beside,
)
from recipes_lib.training.rollback import plan_rollback

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    """What a finished run hands back: where it wrote, how far it got, final metrics."""

    output_dir: Path
    last_checkpoint: Path | None
    global_step: int
    tokens_seen: int
    metrics: dict[str, float] = field(default_factory=dict)
    last_lr: float | None = None  # learning rate of the last optimizer step
    tokenizer_path: Path | None = None
    data_fingerprint: str | None = None
    seconds: float = 0.0  # wall time of fit()
    # the stage's output weights; None when the run stopped before its last step
    weights_path: Path | None = None
    averaged_from: list[Path] = field(default_factory=list)  # step checkpoints averaged
    # records the data left out of training, by reason (data.chat.on_bad_record=skip, ...)
    skipped_records: dict[str, int] = field(default_factory=dict)
    # what the training guard did: updates skipped, rollbacks (each with the data skipped)
    guard: dict[str, Any] = field(default_factory=dict)
    # what torch.compile compiled: graphs, recompile-limit hits (recipes_lib.kernels.compiled)
    compiled: dict[str, int] = field(default_factory=dict)
    # seconds to the first step: import, data, load, compile, first_step, total
    start: dict[str, float] = field(default_factory=dict)
    # the experiment trackers among its loggers (W&B, MLflow: recipes_lib.trackers)
    trackers: list[Any] = field(default_factory=list, repr=False)
    hf_path: Path | None = None  # hf/: the output weights as a Hugging Face folder
    # what kernels.activation_checkpointing=auto chose (recipes_lib.launch_check.autofit)
    memory_fit: dict[str, Any] | None = None
    # the transformers fallback's first-batch losses (recipes_lib.models.hf_fallback)
    load_check: dict[str, float] | None = None
    # the attention backend of each kind of layer the model has: global, local
    # (recipes_lib.kernels.choice); empty for the transformers fallback
    attention: dict[str, str] = field(default_factory=dict)

    def summary_lines(self) -> list[str]:
        """What the run left and what to run next, for its closing summary."""
        if self.weights_path is None:
            return [f"  no output weights in {self.output_dir}: the run stopped before its end"]
        out = self.output_dir
        lines = [f"  weights: {self.weights_path}"]
        if self.hf_path is not None:
            lines.append(f"  Hugging Face folder: {self.hf_path} (transformers, vLLM, PEFT)")
        else:
            lines.append(f"  as a Hugging Face folder: recipes-export checkpoint={out} out=DIR")
        lines.append(f'  next: recipes-generate checkpoint={out} prompt="..."')
        lines.append(f"        recipes-eval checkpoint={out} tasks=TASKS")
        return lines


def _save_resolved_config(cfg: RunConfig, out: Path, *, resumed: bool) -> None:
    """Write ``cfg`` as the run folder's ``config.yaml``.

    A resumed run given no ``stage.init_from`` (the pipeline's resumed stage) keeps the
    one its first attempt recorded: the run still started from those weights, and what
    reads the record after it (an export that writes an image-text folder back, a rerun
    comparing its config) needs where it started, not that a later attempt was not told.
    """
    out.mkdir(parents=True, exist_ok=True)
    record = RunDir(out).config
    if resumed and cfg.stage.init_from is None and record.is_file():
        started = OmegaConf.select(OmegaConf.load(record), "stage.init_from")
        if started is not None:
            cfg = replace(cfg, stage=replace(cfg.stage, init_from=str(started)))
    yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    write_text_atomic(record, yaml)


def run(cfg: RunConfig | DictConfig, callbacks: Sequence[Callback] = ()) -> RunResult:
    """Train one stage as configured and return where it ended.

    Args:
        cfg: a composed config (``compose_config([...])``) or a typed :class:`RunConfig`.
        callbacks: callback objects added to the configured ones (for programmatic use).

    Returns:
        A :class:`RunResult` with the output folder, last checkpoint and final metrics.

    Raises:
        RecipesError: a bad config, data path, tokenizer or checkpoint, before training;
            a ``run.dir`` another live run holds (:class:`~recipes_lib.errors.RunDirInUse`);
            a disk that fills (:class:`~recipes_lib.errors.DiskFullError`).
        Preempted: SIGTERM or SIGUSR1 stopped training at a checkpoint (a ``SystemExit``
            with status 75, :mod:`recipes_lib.callbacks.preemption`).
    """
    clock = StartClock(time.perf_counter())  # the start's split (import, data, ...)
    if isinstance(cfg, DictConfig):
        cfg = fill_model_from_init(cfg)  # model=from_init: the shape of stage.init_from
    given = to_run_config(cfg)
    cfg = _as_recorded(given, resolve_device_choices(given))
    check_run_config(cfg)
    cfg, fit = _fit_memory(cfg)  # kernels.activation_checkpointing=auto, before the build
    if cfg.kernels.compile_cache is not None:  # before any compile (flex compiles anyway)
        cache = resolve_cache_dir(cfg.kernels.compile_cache, "kernels.compile_cache")
        keep_compile_caches(str(cache))
    if cfg.kernels.compile and trains_on_cuda(cfg):  # workers start while data and weights load
        start_compile_workers()
    if (widened := widening_line(cfg.run.allowed_targets)) is not None:
        log.info("%s", widened)  # code of the user's own, trusted on the command line
    attention = _attention_line(cfg)
    with hold_run_dir(cfg.run.dir), watch_compiles() as compiled:  # one run at a time
        result = _run(cfg, [*callbacks, clock])
    result.compiled = compiled.as_dict()
    result.start = clock.seconds
    result.memory_fit = fit.as_dict() if fit is not None else None
    result.attention = attention
    return result


def _as_recorded(given: RunConfig, resolved: RunConfig) -> RunConfig:
    """``resolved`` with the global layers' attention backend its ``run.dir``'s checkpoints
    were trained with, where ``given`` left it to the device (``kernels.attention_global``
    null) and the device chose another: a rerun of a run recorded before ``auto`` took
    varlen for short packed rows resumes on flex, as it trained, instead of being
    refused as another config. An unreadable record is left to the resume's own check."""
    choice = resolved.kernels.attention_global
    if given.kernels.attention_global is not None or choice is None:
        return resolved
    run_dir = RunDir(resolved.run.dir)
    if not (run_dir.config.is_file() and run_dir.has_checkpoints()):
        return resolved
    try:
        recorded = OmegaConf.select(OmegaConf.load(run_dir.config), "kernels.attention_global")
    except Exception:  # unreadable: auto_resume names it in one line
        return resolved
    if recorded == choice or not (recorded is None or isinstance(recorded, str)):
        return resolved
    kernels = dataclasses.replace(resolved.kernels, attention_global=recorded)
    return dataclasses.replace(resolved, kernels=kernels)


def _attention_line(cfg: RunConfig) -> dict[str, str]:
    """The attention backend of each kind of layer, its line printed (rank 0)."""
    if is_fallback(cfg.model):  # transformers' own attention (kernels.attention)
        return {}
    choice = attention_choice(cfg.kernels, cfg.model, document_mask=cfg.data.document_mask)
    if global_rank() == 0:
        log.info("%s", choice.line())
    return choice.names()


def _fit_memory(cfg: RunConfig) -> tuple[RunConfig, Any]:
    """``cfg`` with ``kernels.activation_checkpointing=auto`` resolved for its card or
    ``run.memory_budget_gib`` (the choice's line printed), and the choice."""
    cfg, choice = fit_memory(cfg, planned_world_size(cfg))
    if choice is not None and global_rank() == 0:
        log.info("%s", choice.line())
    return cfg, choice


def _run(cfg: RunConfig, callbacks: Sequence[Callback]) -> RunResult:
    """:func:`run` once its folder is held."""
    run_dir = RunDir(cfg.run.dir)
    if global_rank() == 0:  # an interrupted write's leftovers, never anyone else's
        for folder in (run_dir.root, run_dir.checkpoints):
            remove_unfinished_writes(folder)
    ckpt_path = resolve_ckpt_path(auto_resume(cfg))
    # SIGTERM/SIGUSR1: a step checkpoint, then exit 75
    callbacks = [*callbacks, Preemption(run_dir.step_checkpoint, run_dir.last_checkpoint)]
    L.seed_everything(cfg.run.seed, workers=True, verbose=False)
    fit = _fit(cfg, callbacks, ckpt_path)
    rollbacks: list[dict[str, Any]] = []
    skipped = fit.skipped_updates()
    while (request := fit.module.guard.rollback) is not None:  # guard.policy=rollback
        samples_per_step = fit.schedule.accumulation(request.bad_step) * cfg.data.batch_size
        rollback_path, skip, window, entry = plan_rollback(
            cfg.guard, RunDir(cfg.run.dir), request, len(rollbacks), samples_per_step
        )
        log.warning(
            "rolling back: step %d had %s; resuming from step %d and moving past %d "
            "batches (positions %s of each rank's sample stream)",
            request.bad_step,
            request.reason,
            entry["resumed_from_step"],
            entry["skipped_batches"],
            entry["skipped_positions"],
        )
        rollbacks.append(entry)
        fit = _fit(cfg, callbacks, str(rollback_path), skip_samples=skip, lr_window=window)
        skipped += fit.skipped_updates()
    trainer, module, datamodule = fit.trainer, fit.module, fit.datamodule

    out = Path(cfg.run.dir)
    weights_path, averaged_from = fit.output.written or (None, [])
    if fit.output.written is None and trainer.global_step >= fit.steps:
        # resumed at its final step: Lightning's fit loop ran no step and no
        # on_train_end, so the output is written here, from the restored weights
        weights_path, averaged_from = export_weights(cfg, trainer, module, out, fit.saver, fit.ema)

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    trackers = trackers_of(trainer.loggers)
    if trainer.is_global_zero:  # the resolved config, beside the metrics (W&B, MLflow)
        attach_files(trackers, [RunDir(out).config], "config")
    last = RunDir(out).last_checkpoint
    prepared = datamodule.prepared
    hf_path = None
    if trainer.is_global_zero and weights_path is not None:  # the folder loads on its own
        save_tokenizer_beside(cfg, out, prepared.tokenizer_path if prepared is not None else None)
        hf_path = export_run(cfg, out)
    return RunResult(
        output_dir=out,
        last_checkpoint=last if last.exists() else None,  # a folder when sharded
        global_step=trainer.global_step,
        tokens_seen=int(getattr(module, "tokens_seen", 0)),
        metrics=metrics,
        last_lr=_last_lr(trainer),
        tokenizer_path=prepared.tokenizer_path if prepared is not None else None,
        data_fingerprint=prepared.fingerprint if prepared is not None else None,
        seconds=fit.seconds,
        weights_path=weights_path,
        averaged_from=averaged_from,
        skipped_records=datamodule.skipped_records(),
        guard={"skipped_updates": skipped, "rollbacks": rollbacks},
        trackers=trackers,
        hf_path=hf_path,
        load_check=getattr(module.model, "load_check", None),
    )


@dataclass
class _Fit:
    """One ``trainer.fit`` of a run (a rollback starts another) and what it left."""

    trainer: L.Trainer
    module: CausalLMModule
    datamodule: ResumableDataModule
    steps: int
    schedule: BatchSchedule
    output: OutputWeights  # what it wrote as the final step ended
    seconds: float

    @property
    def saver(self) -> ModelCheckpoint | None:
        return self.output.saver

    @property
    def ema(self) -> WeightEMA | None:
        return self.output.ema

    def skipped_updates(self) -> int:
        """The updates the guard skipped in this fit."""
        skipped = self.module.guard.skipped
        return int(skipped) if skipped is not None else 0


def _fit(
    cfg: RunConfig,
    callbacks: Sequence[Callback],
    ckpt_path: str | None,
    *,
    skip_samples: int = 0,
    lr_window: tuple[int, int, float] | None = None,
) -> _Fit:
    """Build the trainer, data and module of ``cfg`` and fit them, resuming ``ckpt_path``;
    after a rollback, ``skip_samples`` more samples are moved past and the learning rate
    follows ``lr_window``."""
    ema = WeightEMA(cfg.stage.ema_decay) if cfg.stage.ema_decay is not None else None
    trainer = build_trainer(cfg, [*callbacks, *([ema] if ema is not None else [])])
    schedule = batch_schedule(cfg, trainer.world_size)  # token durations need the world size
    steps = total_steps(cfg, schedule)
    trainer.fit_loop.epoch_loop.max_steps = steps
    saver = prepare_averaging(cfg, trainer, steps, ckpt_path)
    if trainer.is_global_zero:
        _save_resolved_config(cfg, Path(cfg.run.dir), resumed=ckpt_path is not None)

    samples = schedule.micro_batches_before(steps) * cfg.data.batch_size
    datamodule = build_data(cfg, total_train_samples=samples)
    datamodule.batch_schedule = schedule
    datamodule.group_steps = not get_strategy(cfg.strategy.name).steps_in_engine
    datamodule.skip_samples(skip_samples)
    module = build_stage(
        cfg,
        total_steps=steps,
        tokens_per_step=tokens_per_step(cfg, trainer.world_size),
        lr_window=lr_window,
        batch_schedule=schedule,
    )
    output = OutputWeights(cfg, steps, saver, ema)
    # after the step savers (see OutputWeights)
    trainer.callbacks.append(output)  # type: ignore[attr-defined]
    started = time.perf_counter()
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    seconds = time.perf_counter() - started - output.seconds
    return _Fit(trainer, module, datamodule, steps, schedule, output, seconds)


def _last_lr(trainer: L.Trainer) -> float | None:
    """The LR the last optimizer step used (schedulers step after it, so read their record)."""
    if not trainer.lr_scheduler_configs:
        return None
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    get_last_lr = getattr(scheduler, "get_last_lr", None)  # torch's schedulers have it
    history = get_last_lr() if callable(get_last_lr) else None
    return float(history[0]) if history else None
