"""The schema's plain values, checked one key at a time before anything runs.

Types are checked by the schema at compose time; these catch values of the right type
that cannot be right (nan, a non-positive count, an unknown objective), each with its
key named. What depends on several keys is the pre-flight's (:mod:`recipes_lib.preflight`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import fields, is_dataclass
from typing import Any

from recipes_lib.config.schema import RunConfig
from recipes_lib.errors import ConfigError


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r} is not one of: {', '.join(choices)}")


# a folder's own config.json (the transformers fallback's), whose infinite values are
# meant (Falcon-H1's time_step_limit is (0.0, inf)); a nan is refused there too
FOLDER_VALUES = "model.hf_config"


def _non_finite(value: Any, key: str) -> Iterator[tuple[str, Any]]:
    """``(key, value)`` of every nan or infinite float in a config subtree (of every nan
    only, within :data:`FOLDER_VALUES`)."""
    refused = math.isnan if key.startswith(FOLDER_VALUES) else (lambda v: not math.isfinite(v))
    if is_dataclass(value):
        for f in fields(value):
            yield from _non_finite(getattr(value, f.name), f"{key}.{f.name}")
    elif isinstance(value, dict):
        for name, item in value.items():
            yield from _non_finite(item, f"{key}.{name}")
    elif isinstance(value, list | tuple):  # of scalars in this schema (optim.betas)
        if any(isinstance(v, float) and refused(v) for v in value):
            yield key, list(value)
    elif isinstance(value, float) and refused(value):
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


def _check_stage_outputs(cfg: RunConfig) -> None:
    stage = cfg.stage
    if stage.average_last_k is not None and stage.average_last_k < 1:
        raise ConfigError(f"stage.average_last_k={stage.average_last_k} must be 1 or more, or null")
    if stage.ema_decay is not None and not 0.0 < stage.ema_decay < 1.0:
        raise ConfigError(f"stage.ema_decay={stage.ema_decay} must lie strictly between 0 and 1")


def _check_checkpoints(cfg: RunConfig) -> None:
    run = cfg.run
    if run.keep_last_checkpoints == 0 or run.keep_last_checkpoints < -1:
        raise ConfigError(
            f"run.keep_last_checkpoints={run.keep_last_checkpoints} must be 1 or more (the "
            "newest checkpoint is always kept), or -1 to keep every one"
        )
    if run.keep_every_n_steps is not None and run.keep_every_n_steps < 1:
        raise ConfigError(f"run.keep_every_n_steps={run.keep_every_n_steps} must be 1 or more")


def check_values(cfg: RunConfig, objectives: tuple[str, ...] = ("pretrain",)) -> None:
    """Raise :class:`ConfigError` naming the key of the first value that is wrong on its
    own: an unknown objective, a non-finite float, a count or rate that must be
    positive, an output-weights setting out of range. Checks across keys are the
    pre-flight's (:mod:`recipes_lib.preflight`).

    Args:
        cfg: the typed run config.
        objectives: the objectives a LightningModule exists for (``stage.objective``).
    """
    _check_choice("stage.objective", cfg.stage.objective, objectives)
    _check_finite(cfg)
    _check_positive(cfg)
    _check_stage_outputs(cfg)
    _check_checkpoints(cfg)
