"""Checks that need the whole run config, done before any data or weights are touched.

Single keys are already typed by the schema at compose time; these catch values and
combinations that are wrong together, each with the key(s) named.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

from recipes_lib.config.schema import RunConfig
from recipes_lib.errors import ConfigError


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of: {', '.join(choices)}")


def _non_finite(value: Any, key: str) -> Iterator[tuple[str, Any]]:
    """``(key, value)`` of every nan or infinite float in a config subtree."""
    if is_dataclass(value):
        for f in fields(value):
            yield from _non_finite(getattr(value, f.name), f"{key}.{f.name}")
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from _non_finite(item, f"{key}.{name}")
    elif isinstance(value, list | tuple):  # of scalars in this schema (optim.betas)
        if any(isinstance(v, float) and not math.isfinite(v) for v in value):
            yield key, list(value)
    elif isinstance(value, float) and not math.isfinite(value):
        yield key, value


def _check_finite(cfg: RunConfig) -> None:
    """No schema float may be nan or infinite: a nan passes every ``<=`` check and then
    poisons training silently. Callbacks and loggers take their own arguments, where an
    infinite threshold can be meant, so they are left to their classes."""
    for f in fields(cfg):
        if f.name in ("callbacks", "logger"):
            continue
        for key, value in _non_finite(getattr(cfg, f.name), f.name):
            what = "hold finite numbers" if isinstance(value, list) else "be a finite number"
            raise ConfigError(f"{key}={value} must {what}")


def _check_positive(cfg: RunConfig) -> None:
    for key, value in (
        ("data.seq_len", cfg.data.seq_len),
        ("data.batch_size", cfg.data.batch_size),
        ("trainer.max_steps", cfg.trainer.max_steps),
        ("trainer.accumulate_grad_batches", cfg.trainer.accumulate_grad_batches),
        ("model.vocab_size", cfg.model.vocab_size),
        ("optim.lr", cfg.optim.lr),
    ):
        if value <= 0:
            raise ConfigError(f"{key}={value} must be positive")


def _check_stage_io(cfg: RunConfig) -> None:
    """What a stage starts from and what it writes as its output weights."""
    stage = cfg.stage
    if stage.average_last_k is not None and stage.average_last_k < 1:
        raise ConfigError(f"stage.average_last_k={stage.average_last_k} must be 1 or more, or null")
    if stage.ema_decay is not None and not 0.0 < stage.ema_decay < 1.0:
        raise ConfigError(f"stage.ema_decay={stage.ema_decay} must lie strictly between 0 and 1")
    if stage.average_last_k is not None and stage.ema_decay is not None:
        raise ConfigError(
            f"stage.average_last_k={stage.average_last_k} and stage.ema_decay={stage.ema_decay} "
            "both choose the stage's output weights; set one of them"
        )
    if stage.init_optimizer:
        source = stage.init_from
        if source is None:
            raise ConfigError(
                "stage.init_optimizer=true needs stage.init_from, a Lightning .ckpt whose "
                "optimizer state starts this stage"
            )
        if Path(source).suffix == ".safetensors" or Path(source).expanduser().is_dir():
            raise ConfigError(
                f"stage.init_optimizer=true needs a Lightning .ckpt as stage.init_from; "
                f"{source!r} holds weights only"
            )


def validate_run_config(cfg: RunConfig, objectives: tuple[str, ...] = ("pretrain",)) -> None:
    """Raise :class:`ConfigError` naming the key(s) of the first problem found.

    Args:
        cfg: the typed run config.
        objectives: the objectives a LightningModule exists for (``stage.objective``).
    """
    from recipes_lib.kernels import get_attention_backend
    from recipes_lib.parallel.precision import check_precision

    _check_choice("stage.objective", cfg.stage.objective, objectives)
    _check_finite(cfg)
    _check_positive(cfg)
    check_precision(cfg)
    _check_stage_io(cfg)
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} is above model.max_seq_len={cfg.model.max_seq_len}"
        )
    # a stage that starts from weights uses their tokenizer (checked against the model
    # when it is loaded); vocab_size only sizes a tokenizer trained from scratch
    trains_tokenizer = cfg.data.tokenizer.path is None and cfg.stage.init_from is None
    if trains_tokenizer and cfg.data.tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"data.tokenizer.vocab_size={cfg.data.tokenizer.vocab_size} does not fit "
            f"model.vocab_size={cfg.model.vocab_size}"
        )
    backend = get_attention_backend(cfg.kernels.attention)
    if cfg.data.document_mask and not backend.capabilities.document_mask:
        raise ConfigError(
            f"data.document_mask=true needs an attention backend with document masking; "
            f"kernels.attention={cfg.kernels.attention} has none (use kernels.attention=flex)"
        )
    if cfg.run.ckpt_path is not None and cfg.stage.init_from is not None:
        raise ConfigError(
            "run.ckpt_path (resume this stage) and stage.init_from (start from other weights) "
            "are both set; choose one"
        )
