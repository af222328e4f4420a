"""The checks between a stage and what it starts from that need no training: the
source exists and comes earlier, the models' shapes fit (or upcycle), a checkpoint is
there to continue, the learning rate and replay have something to go on from, and a
later stage reuses its source's tokenizer."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from recipes_lib.checkpoint.layout import RunDir
from recipes_lib.checkpoint.manifest import read_manifest
from recipes_lib.checkpoint.upcycle import upcycle_mismatches
from recipes_lib.errors import ConfigError
from recipes_lib.pipeline.compose import sets_key
from recipes_lib.pipeline.handoff import (
    apply_handoff,
    check_model_compatible,
    check_weights_fit,
    tokenizer_file_sha256,
)
from recipes_lib.pipeline.spec import PipelineSpec
from recipes_lib.pipeline.stage_plan import StagePlan


def source_of(pipeline: PipelineSpec, index: int) -> tuple[str | None, Path | None]:
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


def check_stage(pipeline: PipelineSpec, plans: dict[str, StagePlan], plan: StagePlan) -> None:
    """Checks between a stage and its source that need no training (see module docs)."""
    stage, cfg = plan.spec, plan.config
    source_plan = plans.get(plan.source_stage) if plan.source_stage else None
    external = plan.source_file
    source_model: dict[str, Any] | None
    if source_plan is not None:
        label, source_model = f"stage {plan.source_stage}", asdict(source_plan.config.model)
    elif external is not None:
        label, source_model = external.label, external.model
    else:
        return
    if stage.init == "upcycle":
        problems = upcycle_mismatches(cfg.model, source_model)
        if problems:
            raise ConfigError(
                f"stage {stage.name}: init=upcycle from {label}: {'; '.join(problems)}"
            )
    elif source_plan is not None:
        check_model_compatible(stage, cfg.model, label, asdict(source_plan.config.model))
    elif external is not None:  # always, without a source stage
        if external.model is not None:
            check_model_compatible(stage, cfg.model, external, external.model)
        elif stage.init != "scratch":
            check_weights_fit(stage, cfg.model, external.weights)

    if stage.init in ("weights+optimizer", "full") and source_plan and not source_plan.spec.trains:
        raise ConfigError(
            f"{stage.key}.init={stage.init} continues a Lightning checkpoint, but stage "
            f"{plan.source_stage} is {'an' if source_plan.spec.kind == 'eval' else 'a'} "
            f"{source_plan.spec.kind} stage, which hands on weights "
            "only; use init=weights"
        )
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
    theirs, origin = tokenizer_of(pipeline, plans, plan)
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


def tokenizer_of(
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
