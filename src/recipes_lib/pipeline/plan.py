"""Planning a pipeline: every check that needs no training, and what to do per stage.

:func:`plan_pipeline` composes every stage's config and checks, before anything
trains, that each recipe exists and composes, each ``from`` names an earlier stage or
an existing file, consecutive models have the same weight shapes, a later stage
reuses its source's tokenizer and ``init: full`` has steps left to run. Then it
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from recipes_lib.checkpoint.layout import RunDir
from recipes_lib.checkpoint.manifest import StageManifest, read_manifest
from recipes_lib.checkpoint.upcycle import upcycle_mismatches
from recipes_lib.config import RunConfig
from recipes_lib.config.instantiate import check_targets
from recipes_lib.errors import ConfigError
from recipes_lib.pipeline.compose import compose_stage, sets_key
from recipes_lib.pipeline.decisions import (
    check_decisions,
    decision_fingerprint,
    decision_sources,
)
from recipes_lib.pipeline.fingerprint import describe_changes, stage_fingerprint
from recipes_lib.pipeline.handoff import (
    Handoff,
    apply_handoff,
    check_model_compatible,
    check_weights_fit,
    handoff_from_manifest,
    handoff_from_path,
    tokenizer_file_sha256,
)
from recipes_lib.pipeline.spec import PipelineSpec, StageSpec

# what makes a later stage's source change: a promote stage may choose another winner
TRAINING_ACTIONS = ("train", "resume", "rerun", "promote")


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


def _source_of(pipeline: PipelineSpec, index: int) -> tuple[str | None, Path | None]:
    """The earlier stage or the outside path stage ``index`` starts from (or neither)."""
    stage = pipeline.stages[index]
    names = pipeline.stage_names()
    if stage.source is None:
        if index == 0:
            if stage.init != "scratch":
                raise ConfigError(
                    f"{stage.key}.init={stage.init}: the first stage has no stage before it; "
                    f"set {stage.key}.from to a manifest or checkpoint"
                )
            return None, None
        return (names[index - 1], None) if stage.init != "scratch" else (None, None)
    if stage.source in names:
        if names.index(stage.source) >= index:
            raise ConfigError(
                f"{stage.key}.from={stage.source!r} is not an earlier stage; the stages run in "
                f"the order {names}"
            )
        return stage.source, None
    path = Path(stage.source).expanduser()
    if not path.exists():
        raise ConfigError(
            f"{stage.key}.from={stage.source!r} is neither an earlier stage "
            f"({', '.join(names[:index]) or 'none'}) nor an existing file"
        )
    return None, path


def _check_stage(pipeline: PipelineSpec, plans: dict[str, StagePlan], plan: StagePlan) -> None:
    """Checks between a stage and its source that need no training (see module docs)."""
    stage, cfg = plan.spec, plan.config
    source_plan = plans.get(plan.source_stage) if plan.source_stage else None
    external = plan.source_file
    if source_plan is None and external is None:
        return
    label = f"stage {plan.source_stage}" if source_plan is not None else external.label
    if stage.init == "upcycle":
        source_model = asdict(source_plan.config.model) if source_plan else external.model
        problems = upcycle_mismatches(cfg.model, source_model)
        if problems:
            raise ConfigError(
                f"stage {stage.name}: init=upcycle from {label}: {'; '.join(problems)}"
            )
    elif source_plan is not None:
        check_model_compatible(stage, cfg.model, label, asdict(source_plan.config.model))
    elif external.model is not None:
        check_model_compatible(stage, cfg.model, external, external.model)
    elif stage.init != "scratch":
        check_weights_fit(stage, cfg.model, external.weights)

    if stage.init in ("weights+optimizer", "full") and external is not None:
        if external.checkpoint is None:
            raise ConfigError(
                f"{stage.key}.init={stage.init} continues a Lightning checkpoint, but "
                f"{external.label} holds weights only; use init=weights"
            )
    if stage.init == "full":
        if stage.lr_from_previous:
            raise ConfigError(
                f"{stage.key}.lr_from_previous has no effect with init=full: the optimizer "
                "and schedule continue from the checkpoint; use init=weights+optimizer"
            )
        source_steps = (
            source_plan.config.trainer.max_steps
            if source_plan is not None and source_plan.config.stage.max_tokens is None
            else (external.global_step if external is not None else None)
        )
        if (
            source_steps is not None
            and cfg.stage.max_tokens is None
            and cfg.trainer.max_steps <= source_steps
        ):
            raise ConfigError(
                f"{stage.key}.init=full continues the step count of {label}, which ends at "
                f"step {source_steps}; {stage.key}.trainer.max_steps={cfg.trainer.max_steps} "
                "must be larger (it counts from the start of that stage)"
            )
    if stage.lr_from_previous and source_plan is not None:
        schedule = source_plan.config.scheduler
        if (
            schedule.name != "constant"
            and schedule.min_lr_ratio == 0
            and not sets_key(pipeline, stage, "optim.lr")
        ):
            raise ConfigError(
                f"{stage.key}.lr_from_previous: stage {plan.source_stage} decays its learning "
                f"rate to zero (scheduler {schedule.name}, min_lr_ratio 0), so there is no "
                f"rate to go on from; set {stage.key}.optim.lr"
            )
    if stage.replay_fraction > 0 and source_plan is None and not (external and external.manifest):
        raise ConfigError(
            f"{stage.key}.replay_fraction needs the data sources of its source, but "
            f"{label} has no manifest naming them"
        )

    if external is not None:  # read already: the whole hand-off can be tried now
        apply_handoff(pipeline, stage, cfg, external)
        return

    # Tokenizer: a later stage reuses its source's, which is a known file (named in a
    # config or a manifest) or the one the source stage trains.
    if cfg.data.tokenizer.path is None:
        return
    ours = tokenizer_file_sha256(cfg.data.tokenizer.path, f"{stage.key}.data.tokenizer.path")
    theirs, origin = _tokenizer_of(pipeline, plans, plan)
    if theirs is None:
        raise ConfigError(
            f"stage {stage.name}: data.tokenizer.path={cfg.data.tokenizer.path} is set, but "
            f"its tokenizer comes from stage {origin}, which trains its own; a later stage "
            f"must reuse the earlier stage's tokenizer: drop {stage.key}.data.tokenizer.path"
        )
    if ours != theirs:
        raise ConfigError(
            f"stage {stage.name}: data.tokenizer.path={cfg.data.tokenizer.path} is not the "
            f"tokenizer of {origin}; a later stage must reuse the earlier stage's tokenizer: "
            f"drop {stage.key}.data.tokenizer.path"
        )


def _tokenizer_of(
    pipeline: PipelineSpec, plans: dict[str, StagePlan], plan: StagePlan
) -> tuple[str | None, str]:
    """(sha256 or None when not trained yet, who it comes from) of a stage's source's
    tokenizer, following inherited tokenizers back to where they were made."""
    current = plan
    while True:
        if current.source_file is not None:
            return current.source_file.tokenizer_sha256, current.source_file.label
        if current.source_stage is None:
            return None, current.spec.name
        source = plans[current.source_stage]
        path = source.config.data.tokenizer.path
        if path is not None:
            key = f"{source.spec.key}.data.tokenizer.path"
            return tokenizer_file_sha256(path, key), f"stage {source.spec.name}"
        manifest_file = RunDir(pipeline.dir / source.spec.name).manifest
        if source.source_stage is None and source.source_file is None:
            if manifest_file.is_file():
                manifest = read_manifest(manifest_file, stage=source.spec.name)
                return manifest.tokenizer.sha256, f"stage {source.spec.name}"
            return None, source.spec.name
        current = source


def stage_dir_of(pipeline: PipelineSpec, stage: StageSpec) -> Path:
    return pipeline.dir / stage.name


def source_handoff(plan: StagePlan, manifests: Mapping[str, StageManifest]) -> Handoff | None:
    if plan.source_file is not None:
        return plan.source_file
    if plan.source_stage is None:
        return None
    return handoff_from_manifest(manifests[plan.source_stage], f"stage {plan.source_stage}")


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
        _decide_decision(plan, plans, manifests, RunDir(stage_dir).manifest)
        return
    source_trains = (
        plan.source_stage is not None and plans[plan.source_stage].action in TRAINING_ACTIONS
    )
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


def _decide_decision(
    plan: StagePlan, plans: dict[str, StagePlan], manifests: dict, manifest_file: Path
) -> None:
    """An eval or promote stage is skipped when it decided already from the same weights
    with the same settings, and runs again otherwise (it loses no training). A later
    stage sees an eval stage's source weights, unchanged, and a promote stage that runs
    again as a changed source (its winner may change)."""
    stage = plan.spec
    action = "evaluate" if stage.kind == "eval" else "promote"
    if any(plans[s].action in TRAINING_ACTIONS for s in plan.sources):
        plan.action, plan.reason = action, "its source stages will be trained"
    elif not manifest_file.is_file():
        plan.action, plan.reason = action, "not run yet"
    else:
        manifest = read_manifest(manifest_file, stage=stage.name)
        weights = {s: manifests[s].weights.sha256 for s in plan.sources}
        if decision_fingerprint(stage, weights)[1] == manifest.config_sha256:
            plan.action, plan.reason, plan.manifest = "skip", "decided, inputs unchanged", manifest
            manifests[stage.name] = manifest
            return
        plan.action, plan.reason = action, "its settings or inputs changed"
    if stage.kind == "eval" and plan.sources[0] in manifests:
        manifests[stage.name] = manifests[plan.sources[0]]  # the weights it hands on


def _plan_decision(pipeline: PipelineSpec, stage: StageSpec, plans: dict[str, StagePlan]):
    """The plan of an eval or promote stage: its sources, and the config of the first
    (the model and tokenizer it hands on); candidates must share their model's shape."""
    sources = decision_sources(stage, list(plans))
    first = plans[sources[0]]
    for other in sources[1:]:
        model = asdict(plans[other].config.model)
        check_model_compatible(stage, first.config.model, f"stage {other}", model)
    candidates = {s: (plans[s].spec, plans[s].config) for s in stage.candidates}
    check_decisions(stage, first.config, (first.spec, first.config), candidates)
    return StagePlan(stage, first.config, source_stage=sources[0], sources=sources)


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
        source_stage, source_path = _source_of(pipeline, index)
        source_file = handoff_from_path(source_path, stage) if source_path is not None else None
        if source_stage is not None:
            source_model = asdict(plans[source_stage].config.model)
            source_label = f"stage {source_stage}"
        else:
            source_model = source_file.model if source_file is not None else None
            source_label = source_file.label if source_file is not None else "no source"
        # model=from_init: the stage takes the model of what it starts from
        config = compose_stage(pipeline, stage, source_model, source_label)
        # an unallowed _target_ in any stage stops the pipeline before anything runs
        check_targets(asdict(config), stage.key, config.run.allowed_targets)
        plan = StagePlan(stage, config, source_stage, source_file)
        _check_stage(pipeline, plans, plan)
        source = plans[source_stage] if source_stage is not None else None
        check_decisions(stage, config, (source.spec, source.config) if source else None)
        plans[stage.name] = plan
    manifests: dict[str, StageManifest] = {}
    for plan in plans.values():
        _decide(pipeline, plan, plans, manifests)
    return list(plans.values())
