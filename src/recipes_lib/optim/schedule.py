"""Learning-rate schedules as multipliers of the base learning rate.

Every schedule starts with a linear warmup: at step ``s < warmup`` the multiplier is
``(s + 1) / (warmup + 1)``, so the first optimizer step already moves the weights and
step ``warmup`` is the first at full rate. After warmup:

- ``cosine``: half a cosine from 1 down to ``min_lr_ratio`` at ``total_steps``;
- ``linear``: a straight line from 1 down to ``min_lr_ratio`` at ``total_steps``;
- ``constant``: 1;
- ``wsd`` (warmup-stable-decay): 1 until the last ``decay`` steps, which fall to
  ``min_lr_ratio`` at ``total_steps`` along ``decay_shape`` (``linear``, ``cosine`` or
  ``sqrt``, i.e. ``1 - sqrt(progress)``).

Steps past ``total_steps`` keep the final value. With ``unit: tokens`` the warmup and
decay lengths are token counts, converted to optimizer steps as
``ceil(tokens / tokens_per_step)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from recipes_lib.config.schema import SchedulerConfig
from recipes_lib.errors import ConfigError
from recipes_lib.optim.batch_ramp import BatchSchedule

SCHEDULES = ("cosine", "linear", "constant", "wsd")
UNITS = ("steps", "tokens")
DECAY_SHAPES = ("linear", "cosine", "sqrt")
WSD_DEFAULT_DECAY_FRACTION = 0.2


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"scheduler.{key}={value!r} is not one of {', '.join(choices)}")


def _to_steps(
    key: str, amount: int, unit: str, tokens_per_step: int, batches: BatchSchedule | None
) -> int:
    if amount < 0:
        raise ConfigError(f"scheduler.{key}={amount} must not be negative")
    if unit == "steps":
        return int(amount)
    if batches is not None and batches.ramp_steps:  # steps differ in size
        return batches.steps_for_tokens(amount) if amount else 0
    return math.ceil(amount / tokens_per_step)


def _decay_curve(shape: str, progress: float) -> float:
    """The fraction of the way from 1 down to the floor left at ``progress`` in [0, 1]."""
    if shape == "linear":
        return 1.0 - progress
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - math.sqrt(progress)  # sqrt


def build_lr_lambda(
    config: SchedulerConfig,
    total_steps: int,
    tokens_per_step: int,
    batches: BatchSchedule | None = None,
) -> Callable[[int], float]:
    """Return ``step -> multiplier`` of the base learning rate for ``config``.

    Args:
        config: The schedule (see the module docstring for each ``name``).
        total_steps: Optimizer steps in the run; the schedule reaches its floor here.
        tokens_per_step: Tokens consumed by one optimizer step, over all ranks and
            accumulated micro-batches; used when ``config.unit`` is ``tokens``.
        batches: the size of each step; under a batch ramp token lengths count the
            ramp's smaller steps, and with ``stage.batch_ramp.lr=sqrt`` the multiplier
            is scaled by its :meth:`~BatchSchedule.lr_factor`.

    Raises:
        ConfigError: naming ``scheduler.<key>`` for an unknown name, unit or decay shape,
            a negative length, a floor outside [0, 1], or warmup plus decay longer than
            the run.
    """
    _check_choice("name", config.name, SCHEDULES)
    _check_choice("unit", config.unit, UNITS)
    _check_choice("decay_shape", config.decay_shape, DECAY_SHAPES)
    if total_steps < 1:
        raise ConfigError(f"the schedule needs at least one step, got total_steps={total_steps}")
    if config.unit == "tokens" and tokens_per_step < 1:
        raise ConfigError(
            f"scheduler.unit=tokens needs tokens_per_step >= 1, got {tokens_per_step}"
        )
    if not 0.0 <= config.min_lr_ratio <= 1.0:
        raise ConfigError(f"scheduler.min_lr_ratio={config.min_lr_ratio} must lie in [0, 1]")

    warmup = _to_steps("warmup", config.warmup, config.unit, tokens_per_step, batches)
    if config.name == "wsd":
        if config.decay is None:
            decay = round(WSD_DEFAULT_DECAY_FRACTION * total_steps)
        else:
            decay = _to_steps("decay", config.decay, config.unit, tokens_per_step, batches)
    else:
        decay = 0
    if warmup + decay > total_steps:
        raise ConfigError(
            f"scheduler.warmup ({warmup} steps) plus scheduler.decay ({decay} steps) exceed "
            f"the run's {total_steps} steps (unit={config.unit}, tokens_per_step={tokens_per_step})"
        )

    floor = config.min_lr_ratio
    name = config.name
    shape = config.decay_shape
    decay_start = total_steps - decay

    def lr_lambda(step: int) -> float:
        return shape_at(step) * (batches.lr_factor(step) if batches is not None else 1.0)

    def shape_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if name == "constant":
            return 1.0
        if name == "wsd":
            if step < decay_start:
                return 1.0
            progress = min(1.0, (step - decay_start) / decay) if decay else 1.0
            return floor + (1.0 - floor) * _decay_curve(shape, progress)
        span = total_steps - warmup
        progress = min(1.0, (step - warmup) / span) if span else 1.0
        curve = "cosine" if name == "cosine" else "linear"
        return floor + (1.0 - floor) * _decay_curve(curve, progress)

    return lr_lambda


def build_scheduler(
    optimizer: Optimizer,
    config: SchedulerConfig,
    total_steps: int,
    tokens_per_step: int,
    batches: BatchSchedule | None = None,
) -> LambdaLR:
    """A :class:`LambdaLR` over ``optimizer`` following :func:`build_lr_lambda`; step it
    once per optimizer step."""
    lr_lambda = build_lr_lambda(config, total_steps, tokens_per_step, batches)
    return LambdaLR(optimizer, lr_lambda)
