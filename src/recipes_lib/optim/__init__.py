"""Optimizer and learning-rate schedules."""

from recipes_lib.optim.optimizer import (
    DECAY_GROUP,
    NO_DECAY_GROUP,
    ParameterGroups,
    build_optimizer,
    split_parameters,
)
from recipes_lib.optim.schedule import (
    DECAY_SHAPES,
    SCHEDULES,
    UNITS,
    build_lr_lambda,
    build_scheduler,
)

__all__ = [
    "DECAY_GROUP",
    "DECAY_SHAPES",
    "NO_DECAY_GROUP",
    "SCHEDULES",
    "UNITS",
    "ParameterGroups",
    "build_lr_lambda",
    "build_optimizer",
    "build_scheduler",
    "split_parameters",
]
