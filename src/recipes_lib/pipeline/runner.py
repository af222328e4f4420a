"""The stage runner: validate a whole pipeline, then train its stages in order.

``run_pipeline(cfg)`` reads top to bottom:

1. parse the pipeline, validate every stage and decide what to do with each
   (:func:`recipes_lib.pipeline.plan.plan_pipeline`): nothing trains before every
   stage has passed its checks;
2. train each stage that needs it with :func:`recipes_lib.train.run`, starting from
   the previous stage's manifest as its ``init`` says, and write its manifest; an eval
   or promote stage hands on an earlier stage's weights instead
   (:mod:`recipes_lib.pipeline.decisions`). The pipeline holds its folder's lock
   meanwhile (:mod:`recipes_lib.checkpoint.run_lock`): one pipeline at a time there;
3. evaluate the stage's output where it says ``evaluate`` and check its ``gates``: a
   gate that fails stops the pipeline after the report is written;
4. print a summary table and write ``<dir>/report/`` (plots and ``summary.json``).

Evaluations run on every rank of a multi-process pipeline (each on its own device, the
same weights and tasks), so that every rank reaches the same gate decisions with no
exchange; only rank 0 writes.

Only global rank 0 writes manifests, tokenizer copies and the report; other ranks
wait for the manifest a stage's successor reads.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback, Checkpoint
from omegaconf import DictConfig
from rich.console import Console

from recipes_lib.checkpoint.layout import RunDir
from recipes_lib.checkpoint.layout import report_dir as pipeline_report_dir
from recipes_lib.checkpoint.manifest import (
    FileRef,
    StageManifest,
    StageMetrics,
    git_revision,
    package_versions,
    read_manifest,
    relative_to,
    write_manifest,
)
from recipes_lib.checkpoint.resume import resume_checkpoint
from recipes_lib.checkpoint.run_lock import hold_run_dir
from recipes_lib.checkpoint.weights import checkpoint_step, sha256_file
from recipes_lib.config import RunConfig
from recipes_lib.data.text.prepare import resolve_sources
from recipes_lib.errors import CheckpointError, ConfigError, GateFailed
from recipes_lib.evaluation.settings import evaluation_values
from recipes_lib.files import copy_atomic, global_rank, move_aside, write_json_atomic
from recipes_lib.pipeline.decisions import decide, gate_failure, settle
from recipes_lib.pipeline.fingerprint import stage_fingerprint
from recipes_lib.pipeline.handoff import Handoff, apply_handoff
from recipes_lib.pipeline.plan import plan_pipeline
from recipes_lib.pipeline.report import (
    StageSeries,
    held_out_changes,
    read_stage_logs,
    stage_summary,
    write_plots,
    write_summary,
)
from recipes_lib.pipeline.spec import PipelineSpec, parse_pipeline
from recipes_lib.pipeline.stage_plan import StagePlan, source_handoff, stage_dir_of
from recipes_lib.pipeline.tables import print_plan, print_summary_table
from recipes_lib.trackers import attach_files, finish
from recipes_lib.train import RunResult, run

log = logging.getLogger("recipes_lib")


@dataclass
class StageResult:
    """One stage after the pipeline ran: its manifest and what happened to it."""

    name: str
    status: str  # trained | resumed | retrained | skipped | kept
    manifest: StageManifest
    manifest_path: Path
    run: RunResult | None = None


@dataclass
class PipelineResult:
    """Every stage's result, the pipeline folder and the report folder."""

    name: str
    dir: Path
    stages: list[StageResult] = field(default_factory=list)
    report_dir: Path | None = None
    summary: list[dict[str, Any]] = field(default_factory=list)

    def __getitem__(self, stage: str) -> StageResult:
        for result in self.stages:
            if result.name == stage:
                return result
        raise KeyError(stage)

    @property
    def weights_path(self) -> Path:
        """The last stage's output weights: the pipeline's product."""
        return self.stages[-1].manifest.weights_path


class FinalCheckpoint(Checkpoint):
    """Makes ``last.ckpt`` hold the final step: what ``init: full`` and
    ``init: weights+optimizer`` continue from, whatever the checkpoint interval.

    A ``Checkpoint`` callback, so Lightning runs it after every ``ModelCheckpoint`` (it
    moves checkpoint callbacks to the end, in their order; this one is added after the
    configured ones). By its ``on_train_end`` the saver has written all it will, its
    own end-of-training ``last.ckpt`` included, so a save here never makes the saver
    write ``last-v1.ckpt`` beside it; it only fills the gap the interval leaves.
    """

    def __init__(self, path: Path):
        self.path = Path(path)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.global_step < trainer.max_steps:
            return  # stopped early: the stage is not finished
        if self.path.exists() and checkpoint_step(self.path) == trainer.global_step:
            return
        trainer.save_checkpoint(self.path)


# ------------------------------------------------------------------------- run


def _resume_checkpoint(stage_dir: Path) -> Path:
    """The newest checkpoint of an interrupted stage that verifies (a newer one that does
    not is moved aside, in one line naming both)."""
    folder = RunDir(stage_dir).checkpoints
    found = resume_checkpoint(folder)
    if found is None:
        raise CheckpointError(f"no checkpoint to resume in {folder}")
    return found


def _wait_for(path: Path, timeout_s: float = 3600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.is_file():
        if time.monotonic() > deadline:
            raise CheckpointError(f"timed out waiting for rank 0 to write '{path}'")
        time.sleep(0.5)


def _finish_stage(
    pipeline: PipelineSpec,
    plan: StagePlan,
    cfg: RunConfig,
    result: RunResult,
    handoff: Handoff | None,
    payload: dict[str, Any],
    sha: str,
) -> StageManifest:
    """Copy the tokenizer beside the weights and write the stage's manifest (rank 0)."""
    stage = plan.spec
    stage_dir = stage_dir_of(pipeline, stage)
    if result.weights_path is None or result.tokenizer_path is None:
        raise CheckpointError(
            f"stage {stage.name} stopped at step {result.global_step} before its last step; "
            "rerun the pipeline to resume it"
        )
    run_dir = RunDir(stage_dir)
    tokenizer = run_dir.tokenizer
    if Path(result.tokenizer_path).resolve() != tokenizer.resolve():
        copy_atomic(result.tokenizer_path, tokenizer)
    continued = handoff if stage.init == "full" else None  # the run this stage continues
    start_step = continued.global_step if continued is not None else 0
    logs = read_stage_logs(stage_dir, stage.name, start_step)
    checkpoint = run_dir.last_checkpoint
    metrics = StageMetrics(
        train_loss_start=logs.first("train/loss"),
        train_loss_end=logs.last("train/loss"),
        val_loss=logs.last("val/loss"),
        val_ppl=logs.last("val/ppl"),
        tokens=result.tokens_seen - (continued.tokens_seen if continued is not None else 0),
        steps=result.global_step - start_step,
        seconds=result.seconds,
        skipped_records=sum(result.skipped_records.values()),
        compiled_graphs=result.compiled.get("graphs", 0),
        recompile_limit_hits=result.compiled.get("recompile_limit_hits", 0),
    )
    manifest = StageManifest(
        pipeline=pipeline.name,
        stage=stage.name,
        recipe=stage.recipe,
        weights=FileRef(
            relative_to(result.weights_path, stage_dir), sha256_file(result.weights_path)
        ),
        tokenizer=FileRef(tokenizer.name, sha256_file(tokenizer)),
        model=asdict(cfg.model),
        global_step=result.global_step,
        tokens_seen=result.tokens_seen,
        config=payload,
        config_sha256=sha,
        checkpoint=relative_to(checkpoint, stage_dir) if checkpoint.is_file() else None,
        start_step=start_step,
        last_lr=result.last_lr,
        data_fingerprint=result.data_fingerprint,
        data_sources={n: asdict(s) for n, s in resolve_sources(cfg.data).items()},
        upstream=None
        if handoff is None
        else {
            "stage" if plan.source_stage else "path": plan.source_stage or handoff.label,
            "weights_sha256": handoff.weights_sha256,
            **({"dequantized_from": handoff.dequantized} if handoff.dequantized else {}),
        },
        averaged_from=[relative_to(p, stage_dir) for p in result.averaged_from],
        versions=package_versions(),
        git_revision=git_revision(),
        metrics=metrics,
        guard=result.guard,
        memory_fit=result.memory_fit,
        load_check=result.load_check,
        attention=result.attention,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    attach_files(result.trackers, [write_manifest(manifest, stage_dir)], "manifest")
    return manifest


def _train_stage(
    pipeline: PipelineSpec,
    plan: StagePlan,
    manifests: Mapping[str, StageManifest],
    callbacks: Sequence[Callback],
) -> tuple[StageManifest, RunResult]:
    stage = plan.spec
    stage_dir = stage_dir_of(pipeline, stage)
    rank_zero = global_rank() == 0
    if plan.action == "rerun" and stage_dir.exists() and rank_zero:
        log.info("moved %s aside to %s", stage_dir, move_aside(stage_dir))
    handoff = source_handoff(plan, manifests)
    cfg = apply_handoff(pipeline, stage, plan.config, handoff)
    if stage.init == "full" and handoff is not None and cfg.stage.max_tokens is None:
        if cfg.trainer.max_steps <= handoff.global_step:
            raise ConfigError(
                f"{stage.key}.init=full continues from step {handoff.global_step} of "
                f"{handoff.label}; {stage.key}.trainer.max_steps={cfg.trainer.max_steps} must "
                "be larger"
            )
    payload, sha = stage_fingerprint(stage, cfg, handoff)
    if plan.action == "resume":
        cfg.stage.init_from = None
        cfg.stage.init_optimizer = False
        cfg.run.ckpt_path = str(_resume_checkpoint(stage_dir))
    if rank_zero:
        stage_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(
            RunDir(stage_dir).fingerprint,
            {
                "pipeline": pipeline.name,
                "stage": stage.name,
                "config_sha256": sha,
                "config": payload,
            },
        )
    log.info("stage %s: %s (recipe %s, init %s)", stage.name, plan.reason, stage.recipe, stage.init)
    final = FinalCheckpoint(RunDir(stage_dir).last_checkpoint)
    result = run(cfg, callbacks=[final, *callbacks])
    manifest_file = RunDir(stage_dir).manifest
    if rank_zero:
        manifest = _finish_stage(pipeline, plan, cfg, result, handoff, payload, sha)
    else:
        _wait_for(manifest_file)
        manifest = read_manifest(manifest_file, stage=stage.name, verify=False)
    return manifest, result


STATUS = {
    "train": "trained",
    "resume": "resumed",
    "rerun": "retrained",
    "skip": "skipped",
    "keep": "kept",
    "evaluate": "evaluated",
    "promote": "promoted",
}


def run_pipeline(
    cfg: DictConfig | PipelineSpec,
    stage_callbacks: Mapping[str, Sequence[Callback]] | None = None,
    console: Console | None = None,
    dry_run: bool = False,
) -> PipelineResult:
    """Validate and run a pipeline; see the module docstring for the order of work.

    Args:
        cfg: a composed pipeline config (``compose_pipeline([...])``) or a parsed spec.
        stage_callbacks: stage name -> extra Lightning callbacks for that stage's run.
        console: where the summary table goes (default: stdout).
        dry_run: validate and print the plan; train nothing.

    Returns:
        A :class:`PipelineResult` with every stage's manifest.

    Raises:
        RecipesError: a bad pipeline, caught before any training (see
            :func:`plan_pipeline`), or a stage that fails.
        GateFailed: a stage that did not meet a gate; the stages before it and its own
            manifest (with the gates' outcomes) and the report are written first.
    """
    pipeline = cfg if isinstance(cfg, PipelineSpec) else parse_pipeline(cfg)
    pipeline = dataclasses.replace(pipeline, dir=pipeline.dir.resolve())
    plans = plan_pipeline(pipeline)
    rank_zero = global_rank() == 0
    if rank_zero:
        print_plan(pipeline, plans, console)
    result = PipelineResult(name=pipeline.name, dir=pipeline.dir)
    if dry_run or pipeline.dry_run:
        return result
    # one pipeline at a time in its folder; each stage's run holds its own folder too
    with hold_run_dir(pipeline.dir):
        return _run_stages(pipeline, plans, result, stage_callbacks or {}, console)


def _run_stages(
    pipeline: PipelineSpec,
    plans: list[StagePlan],
    result: PipelineResult,
    callbacks: Mapping[str, Sequence[Callback]],
    console: Console | None,
) -> PipelineResult:
    """Train, decide and gate each planned stage in order, then write the report."""
    rank_zero = global_rank() == 0
    manifests: dict[str, StageManifest] = {}
    values: dict[str, dict[str, float]] = {}  # each stage's metrics: gates, promotions
    stopped: GateFailed | None = None
    trackers: list = []  # the last run's: the report goes to them
    specs = {p.spec.name: p.spec for p in plans}
    for plan in plans:
        stage = plan.spec
        stage_dir = stage_dir_of(pipeline, stage)
        run_result = None
        if plan.action in ("skip", "keep"):
            assert plan.manifest is not None
            log.info("stage %s: %s", stage.name, plan.reason)
            manifest = plan.manifest
        elif not stage.trains:
            manifest = decide(
                stage, stage_dir, pipeline.name, plan.sources, manifests, values, specs
            )
        else:
            manifest, run_result = _train_stage(
                pipeline, plan, manifests, callbacks.get(stage.name, ())
            )
        logged = read_stage_logs(stage_dir, stage.name, manifest.start_step).series
        settled, gates = settle(stage, manifest, logged, plan.source_stage, values)
        if rank_zero and (settled is not manifest or not stage.trains):
            write_manifest(settled, stage_dir)
        manifest = settled
        for gate in gates:
            log.info("stage %s: gate %s", stage.name, gate.describe())
        manifests[stage.name] = manifest
        if run_result is not None:
            finish(trackers)  # an earlier run's, done with
            trackers = run_result.trackers
        result.stages.append(
            StageResult(
                stage.name, STATUS[plan.action], manifest, RunDir(stage_dir).manifest, run_result
            )
        )
        stopped = gate_failure(stage, gates)
        if stopped is not None:
            break
    plans = plans[: len(result.stages)]
    series = [
        read_stage_logs(stage_dir_of(pipeline, plan.spec), r.name, r.manifest.start_step)
        for r, plan in zip(result.stages, plans, strict=True)
    ]
    result.summary = [
        stage_summary(
            r.manifest,
            r.status,
            r.manifest_path,
            plan.spec.init,
            plan.source_stage or (plan.source_file.label if plan.source_file else None),
            held_out=held_out_changes(logged),
        )
        for r, plan, logged in zip(result.stages, plans, series, strict=True)
    ]
    if rank_zero:
        result.report_dir = _write_report(pipeline, result, series, console)
        attach_files(trackers, sorted(result.report_dir.iterdir()), "report")
    finish(trackers)
    if stopped is not None:
        raise stopped
    return result


def _write_report(
    pipeline: PipelineSpec,
    result: PipelineResult,
    series: list[StageSeries],
    console: Console | None,
) -> Path:
    report_dir = pipeline_report_dir(pipeline.dir)
    evaluations = [evaluation_values(r.manifest.evaluation) for r in result.stages]
    plots = write_plots(series, report_dir, evaluations)
    write_summary(report_dir / "summary.json", pipeline.name, pipeline.dir, result.summary, plots)
    print_summary_table(pipeline.name, result.summary, console)
    log.info("report written to %s", report_dir)
    return report_dir
