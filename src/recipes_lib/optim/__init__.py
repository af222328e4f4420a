"""Optimizer and learning-rate schedules."""

from recipes_lib.optim.choices import OPTIMIZERS, OptimizerSpec, get_optimizer_spec
from recipes_lib.optim.optimizer import (
    DECAY_GROUP,
    NO_DECAY_GROUP,
    ParameterGroups,
    build_optimizer,
    describe_parameters,
    optimizer_state_bytes,
    split_parameters,
)
from recipes_lib.optim.schedule import (
    DECAY_SHAPES,
    SCHEDULES,
    UNITS,
    build_lr_lambda,
    build_scheduler,
)
from recipes_lib.optim.state import ParameterInfo

__all__ = [
    "DECAY_GROUP",
    "DECAY_SHAPES",
    "NO_DECAY_GROUP",
    "OPTIMIZERS",
    "SCHEDULES",
    "UNITS",
    "OptimizerSpec",
    "ParameterGroups",
    "ParameterInfo",
    "build_lr_lambda",
    "build_optimizer",
    "build_scheduler",
    "describe_parameters",
    "get_optimizer_spec",
    "optimizer_state_bytes",
    "split_parameters",
]
