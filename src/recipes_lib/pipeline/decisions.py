"""What a pipeline decides on numbers: evaluations, gates and promotions.

Before anything trains (:func:`check_decisions`, called by the planner), every gate's
metric must be one its stage produces (and, for ``from``, one its source produces), a
promote stage's metric one every candidate produces, and every task must resolve. Once
a stage is done (:func:`stage_values`, :func:`source_values`), its metrics are read
from its manifest and logs and its gates checked
(:func:`recipes_lib.pipeline.gates.check_gates`).

Which metrics a stage produces: ``eval/<task>/<metric>`` of the tasks in its
``evaluate`` (``acc`` and ``acc_norm`` of a choice task; whatever lm-eval reports for
its tasks, checked when they ran); ``val/...`` when a training stage validates
(``trainer.val_check_interval`` and ``limit_val_batches`` set); ``train/...`` when it
trains. An eval stage produces only its evaluation; a promote stage what its winner
produced.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from recipes_lib.checkpoint.manifest import FileRef, StageManifest, StageMetrics
from recipes_lib.config import RunConfig
from recipes_lib.errors import ConfigError, GateFailed, RecipesError
from recipes_lib.evaluation.choice import CHOICE_METRICS
from recipes_lib.evaluation.settings import METRIC_PREFIX, EvalSettings, evaluation_values
from recipes_lib.evaluation.tasks import TaskRef, resolve_tasks
from recipes_lib.pipeline.gates import GateResult, check_gates
from recipes_lib.pipeline.spec import StageSpec

VALIDATE_AT_START = "recipes_lib.callbacks.ValidateAtStart"
SPEED_SETTINGS = ("batch_size", "batch_tokens")  # what an evaluation's results do not depend on


def validates(config: RunConfig) -> bool:
    trainer = config.trainer
    return trainer.val_check_interval is not None and trainer.limit_val_batches != 0


def validates_at_start(config: RunConfig) -> bool:
    """Whether a stage logs its starting weights' held-out figures at its first step."""
    targets = [c.get("_target_") for c in config.callbacks.values() if isinstance(c, Mapping)]
    return validates(config) and VALIDATE_AT_START in targets


def _task_refs(spec: StageSpec) -> list[TaskRef]:
    if spec.evaluate is None:
        return []
    try:
        return resolve_tasks(spec.evaluate.tasks, spec.evaluate.task_dirs)
    except RecipesError as err:
        raise ConfigError(f"{spec.key}.evaluate: {err}") from err


Earlier = Mapping[str, tuple[StageSpec, RunConfig]]  # earlier stages by name


def missing_metric(spec: StageSpec, config: RunConfig, metric: str, earlier: Earlier):
    """Why stage ``spec`` cannot produce ``metric`` (None when it can, or may: an lm-eval
    task's metrics are known once it ran). A promote stage produces what every one of
    its candidates does (the winner's metrics, and its own evaluation's)."""
    root = metric.split("/")[0]
    if root == METRIC_PREFIX:
        _, task, name = metric.split("/")
        refs = _task_refs(spec)
        ref = next((r for r in refs if r.name == task), None)
        if ref is not None:
            if ref.kind == "choice" and name not in CHOICE_METRICS:
                return f"task {task!r} reports {', '.join(CHOICE_METRICS)}, not {name!r}"
            return None
        if spec.kind != "promote":
            tasks = ", ".join(r.name for r in refs) or "none"
            return f"it does not evaluate task {task!r} (its evaluate.tasks: {tasks})"
    if spec.kind == "promote":
        for name in spec.candidates:
            why = missing_metric(*earlier[name], metric, earlier)
            if why is not None:
                return f"its candidate {name} does not produce it: {why}"
        return None
    if root == METRIC_PREFIX:
        return None
    if not spec.trains:
        return f"{spec.kind} stages train nothing: they produce eval/<task>/<metric> only"
    if root == "val" and not validates(config):
        return "it does not validate (trainer.val_check_interval or limit_val_batches is off)"
    return None


def check_decisions(spec: StageSpec, config: RunConfig, source: str | None, earlier: Earlier):
    """Plan-time checks of a stage's tasks, gates and (promote) choice metric, against
    the earlier stages (``source``: the one it starts from, if any).

    Raises:
        ConfigError: one line naming the stage key and the metric or task at fault.
    """
    _task_refs(spec)  # every task resolves
    for gate in spec.gates:
        where = f"{spec.key}.gates.{gate.metric}"
        if (why := missing_metric(spec, config, gate.metric, earlier)) is not None:
            raise ConfigError(f"{where}: no such metric from stage {spec.name}: {why}")
        if not gate.from_source:
            continue
        if not spec.trains:  # its weights are its source's: "from" would compare them twice
            raise ConfigError(
                f"{where}={gate.condition!r}: {spec.kind} stages' gates compare with numbers"
            )
        if gate.metric.startswith("val/") and validates_at_start(config):
            continue  # compared with its own first validation: the starting weights
        if source is None:
            raise ConfigError(f"{where}={gate.condition!r}: stage {spec.name} starts from no stage")
        why = missing_metric(*earlier[source], gate.metric, earlier)
        if why is not None:
            raise ConfigError(
                f"{where}={gate.condition!r}: its source, stage {source}, produces no "
                f"{gate.metric}: {why}"
            )
    if spec.kind == "promote":
        by = spec.by or ""
        for name in spec.candidates:
            why = missing_metric(*earlier[name], by, earlier)
            if why is not None:
                raise ConfigError(
                    f"{spec.key}.by={by}: candidate stage {name} produces no such metric: {why}"
                )


# -------------------------------------------------------------------- values
def logged_values(series: Mapping[str, Sequence[tuple[int, float]]]) -> dict[str, float]:
    """The last value of every ``val/`` and ``train/`` metric a stage logged."""
    return {
        name: points[-1][1]
        for name, points in series.items()
        if points and name.split("/")[0] in ("val", "train")
    }


def stage_values(
    evaluation: Mapping[str, Any] | None, series: Mapping[str, Sequence[tuple[int, float]]]
) -> dict[str, float]:
    """Every metric a finished stage produced: its evaluation and its last logged values."""
    return {**logged_values(series), **evaluation_values(evaluation)}


def start_values(
    series: Mapping[str, Sequence[tuple[int, float]]], start_step: int
) -> dict[str, float]:
    """``val/`` values a stage logged at its start step: its starting weights on its own
    held-out data (``ValidateAtStart``)."""
    found = {}
    for name, points in series.items():
        if name.startswith("val/") and points and points[0][0] == start_step:
            found[name] = points[0][1]
    return found


# ---------------------------------------------------------------- evaluation
def evaluate_weights(folder: Path, settings: EvalSettings) -> dict[str, Any]:
    """Evaluate the weights of a stage folder (its manifest names weights and
    tokenizer) on the first GPU of this process, else the CPU; the manifest's
    ``evaluation`` entry."""
    import torch

    from recipes_lib.evaluation.run import evaluate_checkpoint

    cuda = torch.cuda.is_available()
    device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
    report = evaluate_checkpoint(
        folder, settings, device=device, dtype=torch.bfloat16 if cuda else torch.float32
    )
    return {"settings": asdict(settings), **report.to_json()}


def same_settings(evaluation: Mapping[str, Any] | None, settings: EvalSettings) -> bool:
    """Whether a recorded evaluation used ``settings`` (so it need not run again); the
    batch sizes change only its speed."""
    if not evaluation:
        return False
    recorded = {
        k: tuple(v) if isinstance(v, list) else v
        for k, v in (evaluation.get("settings") or {}).items()
        if k not in SPEED_SETTINGS
    }
    return recorded == evaluation_identity(settings)


# ------------------------------------------------------------------ planning
def decision_sources(stage: StageSpec, earlier: Sequence[str]) -> tuple[str, ...]:
    """The earlier stages an eval stage evaluates (one) or a promote stage chooses from.

    Raises:
        ConfigError: naming the key when one is not an earlier stage.
    """
    if stage.candidates:
        key, sources = "candidates", stage.candidates
    else:
        if stage.source is None and not earlier:
            raise ConfigError(f"{stage.key}: an eval stage evaluates an earlier stage")
        key, sources = "from", (stage.source or earlier[-1],)
    for name in sources:
        if name not in earlier:
            raise ConfigError(
                f"{stage.key}.{key}: {name!r} is not an earlier stage "
                f"({', '.join(earlier) or 'none'})"
            )
    return tuple(sources)


def evaluation_identity(settings: EvalSettings | None) -> dict[str, Any] | None:
    """What decides an evaluation's results: its settings less the batch sizes."""
    if settings is None:
        return None
    return {k: v for k, v in asdict(settings).items() if k not in SPEED_SETTINGS}


def decision_fingerprint(
    stage: StageSpec, source_weights: Mapping[str, Any]
) -> tuple[dict[str, Any], str]:
    """What an eval or promote stage decides from: its settings and, per source, its
    weights (and a candidate's evaluation settings)."""
    import hashlib
    import json

    payload = {
        "kind": stage.kind,
        "evaluate": evaluation_identity(stage.evaluate),
        "by": stage.by,
        "mode": stage.mode if stage.candidates else None,
        "inputs": dict(source_weights),
    }
    blob = json.dumps(payload, sort_keys=True, default=str).encode()
    return payload, hashlib.sha256(blob).hexdigest()


# ------------------------------------------------------------------- running
def with_evaluation(manifest: StageManifest, settings: EvalSettings, folder: Path):
    """``manifest`` with its ``evaluation`` under ``settings``: the recorded one when it
    used the same settings, else the weights evaluated now."""
    if same_settings(manifest.evaluation, settings):
        return manifest
    return replace(manifest, evaluation=evaluate_weights(folder, settings))


def decision_inputs(
    stage: StageSpec,
    sources: Sequence[str],
    manifests: Mapping[str, StageManifest],
    specs: Mapping[str, StageSpec],
) -> dict[str, Any]:
    """Per source of an eval or promote stage, what its decision depends on: the
    source's weights and, for a candidate, how it is evaluated."""
    return {
        s: [manifests[s].weights.sha256, evaluation_identity(specs[s].evaluate)]
        if stage.kind == "promote"
        else manifests[s].weights.sha256
        for s in sources
    }


def handed_on(
    stage: StageSpec,
    stage_dir: Path,
    pipeline: str,
    chosen: StageManifest,
    chosen_name: str,
    source_weights: Mapping[str, str],
    **fields: Any,
) -> StageManifest:
    """The manifest of an eval or promote stage: ``chosen``'s weights, tokenizer, model
    and schedule position handed on (its files stay in its folder), its own name, kind
    and decision."""
    payload, sha = decision_fingerprint(stage, source_weights)

    def pointer(ref: FileRef, path: Path) -> FileRef:
        return FileRef(os.path.relpath(path, stage_dir), ref.sha256)

    cleared: dict[str, Any] = {"gates": [], "evaluation": None, "promotion": None}
    return replace(
        chosen,
        directory=stage_dir,
        pipeline=pipeline,
        stage=stage.name,
        recipe=f"({stage.kind})",
        kind=stage.kind,
        weights=pointer(chosen.weights, chosen.weights_path),
        tokenizer=pointer(chosen.tokenizer, chosen.tokenizer_path),
        checkpoint=None,
        config=payload,
        config_sha256=sha,
        upstream={"stage": chosen_name, "weights_sha256": chosen.weights.sha256},
        averaged_from=[],
        metrics=StageMetrics(),
        guard={},
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **{**cleared, **fields},
    )


def choose(stage: StageSpec, values: Mapping[str, Mapping[str, float]]) -> tuple[str, dict]:
    """A promote stage's winner among its candidates' metric values, and the record.

    Raises:
        ConfigError: a candidate that did not produce the metric.
    """
    by = stage.by or ""
    scores = {}
    for name in stage.candidates:
        if by not in values[name]:
            produced = ", ".join(sorted(values[name])) or "none"
            raise ConfigError(
                f"{stage.key}.by={by}: candidate stage {name} produced no such metric "
                f"(it has: {produced})"
            )
        scores[name] = values[name][by]
        if not math.isfinite(scores[name]):
            raise ConfigError(
                f"{stage.key}.by={by}: candidate stage {name} scored {scores[name]}, which "
                "cannot be compared"
            )
    pick = max if stage.mode == "max" else min
    winner = pick(stage.candidates, key=lambda n: scores[n])  # the first of equals
    return winner, {"by": by, "mode": stage.mode, "candidates": scores, "winner": winner}


def gate_stage(
    stage: StageSpec,
    manifest: StageManifest,
    values: Mapping[str, float],
    source_values: Mapping[str, float],
    source_label: str | None,
) -> tuple[StageManifest, list[GateResult]]:
    """``manifest`` with its gates' outcomes recorded, and the outcomes."""
    results = check_gates(stage.name, stage.gates, values, source_values, source_label)
    return replace(manifest, gates=[asdict(r) for r in results]), results


def gate_failure(stage: StageSpec, results: Sequence[GateResult]) -> GateFailed | None:
    """The one-line error of the first failed gate, if any."""
    failed = [r for r in results if not r.passed]
    if not failed:
        return None
    return GateFailed(f"stage {stage.name} stopped the pipeline: gate {failed[0].describe()}")


def decide(
    stage: StageSpec,
    stage_dir: Path,
    pipeline: str,
    sources: Sequence[str],
    manifests: Mapping[str, StageManifest],
    values: Mapping[str, Mapping[str, float]],
    specs: Mapping[str, StageSpec],
) -> StageManifest:
    """Run an eval stage (hand on its source's weights) or a promote stage (hand on its
    best candidate's); the evaluation and gates follow in :func:`settle`."""
    weights = decision_inputs(stage, sources, manifests, specs)
    if stage.kind == "eval":
        return handed_on(stage, stage_dir, pipeline, manifests[sources[0]], sources[0], weights)
    winner, record = choose(stage, {s: values[s] for s in stage.candidates})
    return handed_on(
        stage, stage_dir, pipeline, manifests[winner], winner, weights, promotion=record
    )


def settle(
    stage: StageSpec,
    manifest: StageManifest,
    series: Mapping[str, Sequence[tuple[int, float]]],
    source: str | None,
    values: dict[str, dict[str, float]],
) -> tuple[StageManifest, list[GateResult]]:
    """Evaluate a finished stage's output (unless recorded with the same settings), read
    its metrics into ``values[stage]`` and check its gates.

    ``from`` reads the stage's own first validation where it logged one at its start
    step (:func:`start_values`), else the source stage's value.
    """
    if stage.evaluate is not None:  # an eval stage's weights lie in its source's folder
        weights = Path(os.path.normpath(manifest.weights_path))
        manifest = with_evaluation(manifest, stage.evaluate, weights)
    own = stage_values(manifest.evaluation, series)
    if stage.kind == "promote" and manifest.upstream:
        own = {**values.get(manifest.upstream["stage"], {}), **own}  # the winner's
    values[stage.name] = own
    if not stage.gates:
        return manifest, []
    source_values = {**values.get(source or "", {}), **start_values(series, manifest.start_step)}
    label = f"stage {source}" if source else None
    return gate_stage(stage, manifest, own, source_values, label)
