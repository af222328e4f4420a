"""Planning a pipeline: every check that needs no training, and what to do per stage.

:func:`plan_pipeline` composes every stage's config and checks, before anything
trains, that each recipe exists and composes, each ``from`` names an earlier stage or
an existing file, consecutive models have the same weight shapes, a later stage
reuses its source's tokenizer and ``init: full`` has steps left to run, and each
stage's config passes the run's own pre-flight (:mod:`recipes_lib.preflight`) as the
stage will start (a source stage's outputs stood in for by their paths). Then it
decides per stage, from what the stage folder holds:

- ``skip``: a valid manifest whose config fingerprint matches;
- ``resume``: checkpoints but no manifest (an interrupted stage);
- ``train``: nothing there yet;
- for a stage whose fingerprint changed (or whose source will be trained again),
  what ``on_change`` says: ``error`` stops here naming the changed keys, ``rerun``
  trains it again after moving its folder aside, ``keep`` uses what it has.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from recipes_lib.checkpoint.layout import RunDir
from recipes_lib.checkpoint.manifest import StageManifest, read_manifest
from recipes_lib.errors import ConfigError
from recipes_lib.objectives import objective_names
from recipes_lib.parallel.precision import resolve_device_choices
from recipes_lib.pipeline.checks import check_stage, source_of
from recipes_lib.pipeline.compose import compose_stage
from recipes_lib.pipeline.decisions import (
    check_decisions,
    decision_fingerprint,
    decision_inputs,
    decision_sources,
    handed_on,
)
from recipes_lib.pipeline.fingerprint import describe_changes, stage_fingerprint
from recipes_lib.pipeline.handoff import (
    apply_handoff,
    check_model_compatible,
    expected_start,
    handoff_from_path,
)
from recipes_lib.pipeline.spec import PipelineSpec, StageSpec
from recipes_lib.pipeline.stage_plan import StagePlan, source_handoff, stage_dir_of
from recipes_lib.preflight import check_run
from recipes_lib.preflight.targets import check_run_targets

TRAINING_ACTIONS = ("train", "resume", "rerun")


def _changes_against(
    pipeline: PipelineSpec,
    plan: StagePlan,
    manifests: Mapping[str, StageManifest],
    recorded: Mapping[str, Any],
    recorded_sha: str,
) -> list[str]:
    cfg = apply_handoff(pipeline, plan.spec, plan.config, source_handoff(plan, manifests))
    payload, sha = stage_fingerprint(plan.spec, cfg, source_handoff(plan, manifests))
    if sha == recorded_sha:
        return []
    # empty when the payloads differ only by keys the schema gained, at their defaults
    return describe_changes(recorded, payload)


def _read_marker(path: Path) -> dict[str, Any] | None:
    """The fingerprint a stage recorded when it started, if readable."""
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(recorded, dict) or not {"config", "config_sha256"} <= set(recorded):
        return None
    return recorded


def _decide(
    pipeline: PipelineSpec, plan: StagePlan, plans: dict[str, StagePlan], manifests: dict
) -> None:
    """Set ``plan.action`` from the stage folder's contents and ``on_change``."""
    stage = plan.spec
    stage_dir = stage_dir_of(pipeline, stage)
    if not stage.trains:
        _decide_decision(pipeline, plan, plans, manifests)
        return
    source_trains = plan.source_stage is not None and changes_weights(plans, plan.source_stage)
    manifest_file = RunDir(stage_dir).manifest
    if manifest_file.is_file():
        manifest = read_manifest(manifest_file, stage=stage.name)
        if source_trains:
            changes = [f"its source stage {plan.source_stage} will be trained again"]
        else:
            changes = _changes_against(
                pipeline, plan, manifests, manifest.config, manifest.config_sha256
            )
        if not changes:
            plan.action, plan.reason, plan.manifest = "skip", "complete, config unchanged", manifest
            manifests[stage.name] = manifest
            return
        done = "completed"
    elif RunDir(stage_dir).has_checkpoints():
        marker = RunDir(stage_dir).fingerprint
        changes = []
        if source_trains:
            changes = [f"its source stage {plan.source_stage} will be trained again"]
        elif (recorded := _read_marker(marker)) is not None:
            changes = _changes_against(
                pipeline, plan, manifests, recorded["config"], recorded["config_sha256"]
            )
        if not changes:
            plan.action, plan.reason = "resume", "interrupted: resume from its last checkpoint"
            return
        manifest = None
        done = "started"
    else:
        plan.action, plan.reason = "train", "not trained yet"
        return

    summary = "; ".join(changes)
    if pipeline.on_change == "error":
        raise ConfigError(
            f"stage {stage.name} changed since it {done} ({summary}); rerun with "
            "on_change=rerun to train it again (its folder is moved aside, not deleted) or "
            "on_change=keep to keep what it has"
        )
    if pipeline.on_change == "rerun":
        plan.action, plan.reason = "rerun", f"changed ({summary}): train again"
    elif manifest is not None:
        plan.action, plan.reason, plan.manifest = "keep", f"changed ({summary}): kept", manifest
        manifests[stage.name] = manifest
    else:
        plan.action, plan.reason = "resume", f"changed ({summary}): resumed with the new config"


def changes_weights(plans: Mapping[str, StagePlan], name: str) -> bool:
    """Whether stage ``name`` will hand on other weights than its manifest says: it
    trains, a promote stage decides again (it may choose another winner), or an eval
    stage's source changes."""
    plan = plans[name]
    if plan.action in (*TRAINING_ACTIONS, "promote"):
        return True
    return plan.action == "evaluate" and changes_weights(plans, plan.sources[0])


def _decide_decision(
    pipeline: PipelineSpec, plan: StagePlan, plans: dict[str, StagePlan], manifests: dict
) -> None:
    """An eval or promote stage is skipped when it decided already from the same weights
    with the same settings, and runs again otherwise (it loses no training). Its
    manifest is read without checking the files it points at: its sources' may have
    changed, which is what the fingerprint tells. An eval stage that runs again over
    unchanged weights stands, for the stages after it, as it will be written."""
    stage = plan.spec
    stage_dir = stage_dir_of(pipeline, stage)
    action = "evaluate" if stage.kind == "eval" else "promote"
    manifest_file = RunDir(stage_dir).manifest
    if any(changes_weights(plans, s) for s in plan.sources):
        plan.action, plan.reason = action, "its source stages will change"
        return
    specs = {name: p.spec for name, p in plans.items()}
    inputs = decision_inputs(stage, plan.sources, manifests, specs)
    if manifest_file.is_file():
        manifest = read_manifest(manifest_file, stage=stage.name, verify=False)
        if decision_fingerprint(stage, inputs)[1] == manifest.config_sha256:
            plan.action, plan.reason, plan.manifest = "skip", "decided, inputs unchanged", manifest
            manifests[stage.name] = manifest
            return
        plan.action, plan.reason = action, "its settings or inputs changed"
    else:
        plan.action, plan.reason = action, "not run yet"
    if stage.kind == "eval":
        source = plan.sources[0]
        manifests[stage.name] = handed_on(
            stage, stage_dir, pipeline.name, manifests[source], source, inputs
        )


def _plan_decision(pipeline: PipelineSpec, stage: StageSpec, plans: dict[str, StagePlan]):
    """The plan of an eval or promote stage: its sources, and the config of the first
    (the model and tokenizer it hands on); candidates must share their model's shape."""
    sources = decision_sources(stage, list(plans))
    first = plans[sources[0]]
    for other in sources[1:]:
        model = asdict(plans[other].config.model)
        check_model_compatible(stage, first.config.model, f"stage {other}", model)
    earlier = {name: (p.spec, p.config) for name, p in plans.items()}
    check_decisions(stage, first.config, sources[0], earlier)
    return StagePlan(stage, first.config, source_stage=sources[0], sources=sources)


def _preflight(pipeline: PipelineSpec, plan: StagePlan, plans: dict[str, StagePlan]) -> None:
    """The run's own pre-flight on the stage's config as it will start, so that a later
    stage's bad value stops the pipeline before the first stage trains. The hand-off of
    an outside file is applied as it will be; a source stage's is stood in for by the
    paths it will write (its weights are not read: :func:`check_stage` checked the
    models against each other)."""
    stage = plan.spec
    written = True
    if plan.source_file is not None:
        cfg = apply_handoff(pipeline, stage, plan.config, plan.source_file)
    elif plan.source_stage is not None:
        source_dir = stage_dir_of(pipeline, plans[plan.source_stage].spec)
        cfg, written = expected_start(stage, plan.config, source_dir), False
    else:
        cfg = plan.config
    try:
        check_run(resolve_device_choices(cfg), objective_names(), init_written=written)
    except ConfigError as err:
        raise ConfigError(f"stage {stage.name}: {err}") from err


def plan_pipeline(pipeline: PipelineSpec) -> list[StagePlan]:
    """Validate every stage and decide what to do with it; nothing is trained.

    Raises:
        ConfigError / CheckpointError: naming the stage and the reason, for an unknown
            recipe or stage, a missing ``from`` source, incompatible model shapes or
            tokenizers, an invalid manifest, or (``on_change=error``) a changed stage.
    """
    plans: dict[str, StagePlan] = {}
    for index, stage in enumerate(pipeline.stages):
        if not stage.trains:
            plans[stage.name] = _plan_decision(pipeline, stage, plans)
            continue
        source_stage, source_path = source_of(pipeline, index)
        source_file = handoff_from_path(source_path, stage) if source_path is not None else None
        source_model: dict[str, Any] | None
        if source_stage is not None:
            source_model = asdict(plans[source_stage].config.model)
            source_label = f"stage {source_stage}"
        else:
            source_model = source_file.model if source_file is not None else None
            source_label = source_file.label if source_file is not None else "no source"
        # model=from_init: the stage takes the model of what it starts from
        config = compose_stage(pipeline, stage, source_model, source_label)
        # an unallowed _target_ in any stage stops the pipeline before anything runs
        check_run_targets(config, stage.key)
        plan = StagePlan(stage, config, source_stage, source_file)
        check_stage(pipeline, plans, plan)
        earlier = {name: (p.spec, p.config) for name, p in plans.items()}
        check_decisions(stage, config, source_stage, earlier)
        _preflight(pipeline, plan, plans)
        plans[stage.name] = plan
    manifests: dict[str, StageManifest] = {}
    for plan in plans.values():
        _decide(pipeline, plan, plans, manifests)
    return list(plans.values())
