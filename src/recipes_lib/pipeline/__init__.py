"""Multi-stage pipelines: ordered stages, each a recipe run that starts from the
previous stage's manifest (see :mod:`recipes_lib.pipeline.runner`).

The runner (and with it Lightning) is imported on first use, so that importing the
config schema, as every console script does, stays cheap.
"""

from typing import Any

from recipes_lib.pipeline.spec import (
    PipelineConfig,
    PipelineSpec,
    StageSpec,
    compose_pipeline,
    parse_pipeline,
    register_pipeline_schema,
)

_LAZY = {
    "PipelineResult": "recipes_lib.pipeline.runner",
    "StageResult": "recipes_lib.pipeline.runner",
    "run_pipeline": "recipes_lib.pipeline.runner",
    "StagePlan": "recipes_lib.pipeline.plan",
    "plan_pipeline": "recipes_lib.pipeline.plan",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "PipelineConfig",
    "PipelineResult",
    "PipelineSpec",
    "StagePlan",
    "StageResult",
    "StageSpec",
    "compose_pipeline",
    "parse_pipeline",
    "plan_pipeline",
    "register_pipeline_schema",
    "run_pipeline",
]
