"""What the planner decides for one stage (:class:`StagePlan`), and the places and
hand-offs every part of the runner reads from a plan."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from recipes_lib.checkpoint.manifest import StageManifest
from recipes_lib.config import RunConfig
from recipes_lib.pipeline.handoff import Handoff, handoff_from_manifest
from recipes_lib.pipeline.spec import PipelineSpec, StageSpec


@dataclass
class StagePlan:
    """What the runner will do with one stage, decided before anything trains.

    Attributes:
        spec: the parsed stage.
        config: its composed config before the hand-off.
        source_stage: the earlier stage it starts from, if any.
        source_file: the outside file it starts from, read when the plan was made.
        action: ``train`` | ``resume`` | ``rerun`` | ``skip`` | ``keep``; for an eval or
            promote stage, ``evaluate`` | ``promote`` | ``skip``.
        reason: why, in words.
        manifest: the stage's own manifest when it has a valid one.
        sources: an eval stage's source or a promote stage's candidates.
    """

    spec: StageSpec
    config: RunConfig
    source_stage: str | None = None
    source_file: Handoff | None = None
    action: str = "train"
    reason: str = ""
    manifest: StageManifest | None = None
    sources: tuple[str, ...] = ()


def stage_dir_of(pipeline: PipelineSpec, stage: StageSpec) -> Path:
    return pipeline.dir / stage.name


def source_handoff(plan: StagePlan, manifests: Mapping[str, StageManifest]) -> Handoff | None:
    if plan.source_file is not None:
        return plan.source_file
    if plan.source_stage is None:
        return None
    return handoff_from_manifest(manifests[plan.source_stage], f"stage {plan.source_stage}")
