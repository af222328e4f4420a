"""``run(cfg) -> RunResult``: the single entry used by the CLI, pipelines, tests and examples.

The order below matters and reads top to bottom:

1. convert the composed config to typed dataclasses and validate what can be checked
   without touching data or weights (bad keys already failed at compose time);
2. build the Trainer first: its world size fixes the tokens per optimizer step, which
   turns token durations into steps;
3. build the data module (tokenizer + shards are prepared once, on rank 0) and the
   objective's LightningModule (the model itself is built in ``configure_model``);
4. fit, resuming from ``run.ckpt_path`` when set;
5. export the stage's output weights to ``<run.dir>/model.safetensors`` (rank 0): the
   final weights, the mean of the last ``stage.average_last_k`` step checkpoints, or
   the ``stage.ema_decay`` moving average. With an adapter (LoRA/QLoRA) these are the
   base weights with the adapters merged in, and ``<run.dir>/adapter/`` holds the
   adapters alone in PEFT's format.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ModelSummary, ProgressBar
from omegaconf import DictConfig, OmegaConf

from recipes_lib.adapters import (
    has_adapter,
    merge_adapter,
    save_adapter,
)
from recipes_lib.callbacks.ema import WeightEMA
from recipes_lib.callbacks.summary import ModelSizeSummary
from recipes_lib.checkpoint.layout import RunDir
from recipes_lib.checkpoint.sharded import is_sharded_checkpoint
from recipes_lib.checkpoint.source import fill_model_from_init
from recipes_lib.checkpoint.weights import (
    average_checkpoints,
    list_step_checkpoints,
    save_weights,
)
from recipes_lib.config import RunConfig, instantiate_dict, to_run_config
from recipes_lib.data import PretrainDataModule
from recipes_lib.data.chat.module import build_chat_data
from recipes_lib.data.preference.module import build_preference_data
from recipes_lib.data.tokenizer import init_tokenizer_path
from recipes_lib.errors import CheckpointError, ConfigError
from recipes_lib.files import write_text_atomic
from recipes_lib.parallel import (
    build_strategy,
    get_strategy,
    trainer_devices,
)
from recipes_lib.parallel.fp8 import fp8_callbacks
from recipes_lib.parallel.precision import lightning_precision, resolve_device_choices
from recipes_lib.preflight import check_run
from recipes_lib.stages.causal_lm import CausalLMModule
from recipes_lib.stages.dpo import build_dpo_module
from recipes_lib.stages.sft import SFTModule


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


def tokens_per_step(cfg: RunConfig, world_size: int) -> int:
    """Tokens consumed by one optimizer step across all ranks."""
    return cfg.data.seq_len * cfg.data.batch_size * cfg.trainer.accumulate_grad_batches * world_size


def total_steps(cfg: RunConfig, step_tokens: int) -> int:
    """Optimizer steps of the run: ``stage.max_tokens`` when set, else ``trainer.max_steps``."""
    if cfg.stage.max_tokens is not None:
        return max(1, math.ceil(cfg.stage.max_tokens / step_tokens))
    return cfg.trainer.max_steps


def build_trainer(cfg: RunConfig, extra_callbacks: Sequence[Callback] = ()) -> L.Trainer:
    """A Lightning Trainer from ``cfg.trainer`` plus the configured callbacks and loggers."""
    kwargs: dict[str, Any] = dict(vars(cfg.trainer))
    accumulate = cfg.trainer.accumulate_grad_batches
    # Our validation interval counts optimizer steps; Lightning's counts micro-batches.
    val_every = kwargs.pop("val_check_interval")
    if val_every is not None:
        kwargs["val_check_interval"] = max(1, min(val_every, cfg.trainer.max_steps)) * accumulate
    else:
        kwargs["limit_val_batches"] = 0
    allowed = cfg.run.allowed_targets
    callbacks = instantiate_dict(cfg.callbacks, "callbacks", allowed) + list(extra_callbacks)
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
    loggers = instantiate_dict(cfg.logger, "logger", allowed)
    kwargs["devices"] = trainer_devices(cfg)
    return L.Trainer(
        **kwargs,
        strategy=build_strategy(cfg.strategy, micro_batch_size=cfg.data.batch_size),
        precision=lightning_precision(cfg.precision),
        callbacks=callbacks,
        logger=loggers if loggers else False,
        default_root_dir=cfg.run.dir,
        use_distributed_sampler=False,  # our sampler shards by rank and resumes mid-epoch
    )


def _pretrain_data(cfg: RunConfig, *, total_train_samples: int) -> L.LightningDataModule:
    # continued pretraining from weights reads the text with their tokenizer
    tokenizer = init_tokenizer_path(cfg.data, cfg.stage.init_from)
    return PretrainDataModule(
        dataclasses.replace(
            cfg.data, tokenizer=dataclasses.replace(cfg.data.tokenizer, path=tokenizer)
        ),
        model_vocab_size=cfg.model.vocab_size,
        model_max_seq_len=cfg.model.max_seq_len,
        total_train_samples=total_train_samples,
    )


@dataclass(frozen=True)
class Objective:
    """What one ``stage.objective`` trains with: its LightningModule and its data.

    Both builders take the typed run config; the module builder also gets the run's
    optimizer steps and tokens per step, the data builder the samples per rank.
    """

    module: Callable[..., L.LightningModule]
    data: Callable[..., L.LightningDataModule]


OBJECTIVES: dict[str, Objective] = {
    "pretrain": Objective(module=CausalLMModule.from_run_config, data=_pretrain_data),
    "sft": Objective(module=SFTModule.from_run_config, data=build_chat_data),
    "dpo": Objective(module=build_dpo_module, data=build_preference_data),
}


def build_stage(cfg: RunConfig, *, total_steps: int, tokens_per_step: int) -> L.LightningModule:
    """The LightningModule of ``cfg.stage.objective``."""
    objective = OBJECTIVES[cfg.stage.objective]
    return objective.module(cfg, total_steps=total_steps, tokens_per_step=tokens_per_step)


def _resolve_ckpt_path(cfg: RunConfig) -> str | None:
    path = cfg.run.ckpt_path
    if path is None or path in ("last", "hpc", "best"):
        return path
    if not (Path(path).is_file() or is_sharded_checkpoint(path)):
        raise CheckpointError(
            f"run.ckpt_path: '{path}' is neither a checkpoint file nor a sharded checkpoint folder"
        )
    return path


def _refuse_to_overwrite(cfg: RunConfig, ckpt_path: str | None) -> None:
    ckpt_dir = RunDir(cfg.run.dir).checkpoints
    if ckpt_path is None and cfg.stage.init_from is None and ckpt_dir.is_dir():
        if any(ckpt_dir.iterdir()):
            raise CheckpointError(
                f"run.dir={cfg.run.dir} already holds checkpoints in {ckpt_dir}; resume them "
                "with run.ckpt_path=last, or start afresh with another run.name or run.dir"
            )


def _save_resolved_config(cfg: RunConfig, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    write_text_atomic(RunDir(out).config, yaml)


def check_run_config(cfg: RunConfig) -> None:
    """Every check :func:`run` makes before touching data or weights (the pre-flight,
    :func:`recipes_lib.preflight.check_run`).

    Raises:
        ConfigError: the first problem found, naming its keys.
    """
    check_run(cfg, objectives=tuple(OBJECTIVES))


def run(cfg: RunConfig | DictConfig, callbacks: Sequence[Callback] = ()) -> RunResult:
    """Train one stage as configured and return where it ended.

    Args:
        cfg: a composed config (``compose_config([...])``) or a typed :class:`RunConfig`.
        callbacks: callback objects added to the configured ones (for programmatic use).

    Returns:
        A :class:`RunResult` with the output folder, last checkpoint and final metrics.

    Raises:
        RecipesError: a bad config, data path, tokenizer or checkpoint, before training.
    """
    if isinstance(cfg, DictConfig):
        cfg = fill_model_from_init(cfg)  # model=from_init: the shape of stage.init_from
    cfg = resolve_device_choices(to_run_config(cfg))
    check_run_config(cfg)
    ckpt_path = _resolve_ckpt_path(cfg)
    _refuse_to_overwrite(cfg, ckpt_path)
    L.seed_everything(cfg.run.seed, workers=True, verbose=False)

    ema = WeightEMA(cfg.stage.ema_decay) if cfg.stage.ema_decay is not None else None
    trainer = build_trainer(cfg, [*callbacks, *([ema] if ema is not None else [])])
    step_tokens = tokens_per_step(cfg, trainer.world_size)
    steps = total_steps(cfg, step_tokens)
    trainer.fit_loop.epoch_loop.max_steps = steps  # token durations need the world size
    saver = _prepare_averaging(cfg, trainer, steps, ckpt_path)
    out = Path(cfg.run.dir)
    if trainer.is_global_zero:
        _save_resolved_config(cfg, out)

    datamodule = OBJECTIVES[cfg.stage.objective].data(
        cfg, total_train_samples=steps * cfg.trainer.accumulate_grad_batches * cfg.data.batch_size
    )
    module = build_stage(cfg, total_steps=steps, tokens_per_step=step_tokens)
    started = time.perf_counter()
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    seconds = time.perf_counter() - started

    weights_path, averaged_from = None, []
    if trainer.global_step >= steps:
        weights_path, averaged_from = _export_weights(cfg, trainer, module, out, saver, ema)

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if v.numel() == 1}
    last = RunDir(out).last_checkpoint
    prepared = datamodule.prepared
    return RunResult(
        output_dir=out,
        last_checkpoint=last if last.exists() else None,  # a folder when sharded
        global_step=trainer.global_step,
        tokens_seen=int(getattr(module, "tokens_seen", 0)),
        metrics=metrics,
        last_lr=_last_lr(trainer),
        tokenizer_path=prepared.tokenizer_path if prepared is not None else None,
        data_fingerprint=prepared.fingerprint if prepared is not None else None,
        seconds=seconds,
        weights_path=weights_path,
        averaged_from=averaged_from,
        skipped_records=datamodule.skipped_records(),
    )


def _step_saver(cfg: RunConfig, trainer: L.Trainer) -> tuple[ModelCheckpoint, int] | None:
    """The checkpoint callback that saves every N optimizer steps and its N, if there is one.

    ModelCheckpoint keeps N to itself, so N is read from the ``callbacks`` entry the
    callback was built from: its ``every_n_train_steps``, which the shipped callback
    groups set to ``run.checkpoint_every_n_steps``.
    """
    every = next(
        (
            int(node["every_n_train_steps"])
            for node in cfg.callbacks.values()
            if isinstance(node, Mapping) and (node.get("every_n_train_steps") or 0) > 0
        ),
        None,
    )
    savers = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
    if every is None or not savers:
        return None
    return savers[0], every


def _prepare_averaging(
    cfg: RunConfig, trainer: L.Trainer, steps: int, ckpt_path: str | None
) -> ModelCheckpoint | None:
    """Check that ``stage.average_last_k`` step checkpoints will exist, and keep them all.

    Raises:
        ConfigError: no callback saves step checkpoints, the last step would not be
            saved, or a fresh run would save fewer than K of them.
    """
    k = cfg.stage.average_last_k
    if k is None:
        return None
    found = _step_saver(cfg, trainer)
    if found is None:
        raise ConfigError(
            f"stage.average_last_k={k} averages step checkpoints, but no ModelCheckpoint "
            "callback saves every N train steps (callbacks.checkpoint)"
        )
    saver, every = found
    if steps % every != 0:
        raise ConfigError(
            f"stage.average_last_k={k}: the run ends at step {steps}, which is not a multiple "
            f"of the checkpoint interval {every} (run.checkpoint_every_n_steps), so the "
            "average would leave out the final weights"
        )
    if ckpt_path is None and steps // every < k:
        raise ConfigError(
            f"stage.average_last_k={k}, but {steps} steps with a checkpoint every {every} "
            f"(run.checkpoint_every_n_steps) save only {steps // every}"
        )
    saver.save_top_k = -1  # keep every step checkpoint (with no monitor: all or one)
    return saver


def _export_weights(
    cfg: RunConfig,
    trainer: L.Trainer,
    module: L.LightningModule,
    out: Path,
    saver: ModelCheckpoint | None,
    ema: WeightEMA | None,
) -> tuple[Path, list[Path]]:
    """Write the stage's output weights (rank 0) and say which checkpoints they average.

    Raises:
        CheckpointError: fewer than ``stage.average_last_k`` step checkpoints up to the
            final step are on disk, or the newest is not the final step.
    """
    step = trainer.global_step
    chosen: list[Path] = []
    if saver is not None and saver.dirpath is not None:
        k = cfg.stage.average_last_k
        saved = [(s, p) for s, p in list_step_checkpoints(saver.dirpath) if s <= step]
        if len(saved) < k or saved[-1][0] != step:
            found = ", ".join(f"{p.name} (step {s})" for s, p in saved) or "none"
            raise CheckpointError(
                f"stage.average_last_k={k} needs the last {k} step checkpoints up to step "
                f"{step} in {saver.dirpath}; found: {found}"
            )
        chosen = [p for _, p in saved[-k:]]
    path = RunDir(out).weights
    # sharded weights are gathered by every rank together, onto rank 0
    final = get_strategy(cfg.strategy.name).gather_full_state_dict(module.model, trainer.strategy)
    if trainer.is_global_zero:
        if chosen:
            state, source = average_checkpoints(chosen), f"mean of {len(chosen)} checkpoints"
        elif ema is not None:
            state, source = ema.averaged_state_dict(module.model), f"ema decay {ema.decay}"
        else:
            state, source = final, "final"
        if has_adapter(module.model):
            save_adapter(module.model, RunDir(out).adapter, cfg.adapter, state=state)
            state, source = (
                merge_adapter(module.model, state),
                f"{source}, {cfg.adapter.kind} merged",
            )
        save_weights(state, path, metadata={"global_step": str(step), "weights": source})
    trainer.strategy.barrier("export_weights")
    return path, chosen


def _last_lr(trainer: L.Trainer) -> float | None:
    """The LR the last optimizer step used (schedulers step after it, so read their record)."""
    if not trainer.lr_scheduler_configs:
        return None
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    get_last_lr = getattr(scheduler, "get_last_lr", None)  # torch's schedulers have it
    history = get_last_lr() if callable(get_last_lr) else None
    return float(history[0]) if history else None
