"""recipes-lib: Lightning-based, Hydra-composed recipes for training language models.

The public API is the names in ``__all__`` below, importable from ``recipes_lib``
itself; their signatures change only with a line in ``CHANGELOG.md``. Everything else,
every submodule included, is internal: it may move or change in any release.

The errors are imported at once. Every other name is imported on first use, so that
``import recipes_lib``, which every console script does, stays cheap: the callbacks and
the training entry point bring in Lightning, which takes seconds.
"""

from __future__ import annotations

from recipes_lib.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    DataError,
    DiskFullError,
    GateFailed,
    RecipesError,
    RewardError,
    RunDirInUse,
    UnsupportedKernelError,
)

__version__ = "0.1.0"

# typing.TYPE_CHECKING without importing typing (2 ms); type checkers know the name
TYPE_CHECKING = False

# name -> the module it lives in, imported when the name is first used
_LAZY = {
    # run one stage, or a pipeline of stages
    "compose_config": "recipes_lib.config.store",
    "to_run_config": "recipes_lib.config.store",
    "RunConfig": "recipes_lib.config.schema",
    "run": "recipes_lib.train",
    "RunResult": "recipes_lib.train",
    "compose_pipeline": "recipes_lib.pipeline.spec",
    "run_pipeline": "recipes_lib.pipeline.runner",
    "PipelineResult": "recipes_lib.pipeline.runner",
    # check a launch before it starts
    "check_launch": "recipes_lib.launch_check.check",
    "LaunchReport": "recipes_lib.launch_check.check",
    # Hugging Face folders in and out
    "load_hf_checkpoint": "recipes_lib.checkpoint.hf",
    "export_hf_checkpoint": "recipes_lib.checkpoint.hf_export",
    # callbacks a config may add under callbacks.<name>._target_
    "DownstreamEval": "recipes_lib.callbacks",
    "GarbageCollection": "recipes_lib.callbacks",
    "GradNormMonitor": "recipes_lib.callbacks",
    "HangWatchdog": "recipes_lib.callbacks",
    "OptimizerStepCallback": "recipes_lib.callbacks",
    "ThroughputMonitor": "recipes_lib.callbacks",
    "TokenProgressBar": "recipes_lib.callbacks",
    "ValidateAtStart": "recipes_lib.callbacks",
}

__all__ = [
    "CheckpointError",
    "ConfigError",
    "CorruptCheckpointError",
    "DataError",
    "DiskFullError",
    "DownstreamEval",
    "GarbageCollection",
    "GateFailed",
    "GradNormMonitor",
    "HangWatchdog",
    "LaunchReport",
    "OptimizerStepCallback",
    "PipelineResult",
    "RecipesError",
    "RewardError",
    "RunConfig",
    "RunDirInUse",
    "RunResult",
    "ThroughputMonitor",
    "TokenProgressBar",
    "UnsupportedKernelError",
    "ValidateAtStart",
    "__version__",
    "check_launch",
    "compose_config",
    "compose_pipeline",
    "export_hf_checkpoint",
    "load_hf_checkpoint",
    "run",
    "run_pipeline",
    "to_run_config",
]


from recipes_lib.lazy import lazy_names  # noqa: E402

_getattr, _dir = lazy_names(globals(), _LAZY)


def __getattr__(name: str) -> object:
    return _getattr(name)


def __dir__() -> list[str]:
    return _dir()


if TYPE_CHECKING:  # what type checkers and editors see; nothing is imported at run time
    from recipes_lib.callbacks import (
        DownstreamEval,
        GarbageCollection,
        GradNormMonitor,
        HangWatchdog,
        OptimizerStepCallback,
        ThroughputMonitor,
        TokenProgressBar,
        ValidateAtStart,
    )
    from recipes_lib.checkpoint.hf import load_hf_checkpoint
    from recipes_lib.checkpoint.hf_export import export_hf_checkpoint
    from recipes_lib.config.schema import RunConfig
    from recipes_lib.config.store import compose_config, to_run_config
    from recipes_lib.launch_check.check import LaunchReport, check_launch
    from recipes_lib.pipeline.runner import PipelineResult, run_pipeline
    from recipes_lib.pipeline.spec import compose_pipeline
    from recipes_lib.train import RunResult, run
