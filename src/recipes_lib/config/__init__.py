"""Config schema, composition and the one ``instantiate`` wrapper."""

from recipes_lib.config.instantiate import instantiate, instantiate_dict
from recipes_lib.config.schema import (
    DataConfig,
    KernelsConfig,
    ModelConfig,
    OptimConfig,
    PrecisionConfig,
    RopeScalingConfig,
    RunConfig,
    RunInfoConfig,
    SchedulerConfig,
    SourceConfig,
    StageConfig,
    StrategyConfig,
    TokenizerConfig,
    TrainerConfig,
)
from recipes_lib.config.store import (
    compose_config,
    conf_dir,
    list_group_options,
    list_recipes,
    register_schema,
    to_run_config,
)

__all__ = [
    "DataConfig",
    "KernelsConfig",
    "ModelConfig",
    "OptimConfig",
    "PrecisionConfig",
    "RopeScalingConfig",
    "RunConfig",
    "RunInfoConfig",
    "SchedulerConfig",
    "SourceConfig",
    "StageConfig",
    "StrategyConfig",
    "TokenizerConfig",
    "TrainerConfig",
    "compose_config",
    "conf_dir",
    "instantiate",
    "instantiate_dict",
    "list_group_options",
    "list_recipes",
    "register_schema",
    "to_run_config",
]
