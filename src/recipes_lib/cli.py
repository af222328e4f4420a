"""Console scripts. Each is a Hydra app over the shipped ``conf/``, so ``--cfg job``,
``-m`` multirun, ``--help`` and shell completion (``-sc install=bash``) work as in any
Hydra application.

    recipes-train recipe=pretrain/tiny optim.lr=1e-3
    recipes-prepare recipe=pretrain/gpt_124m data=local_text data.sources.main.path=corpus/
    recipes-pipeline pipeline=demo stages.anneal.trainer.max_steps=200
    recipes-check recipe=pretrain/llama_1b trainer.max_steps=5000   (or run.launch_check=true)
    recipes-generate checkpoint=runs/tiny prompt="def " max_new_tokens=64
    recipes-eval checkpoint=runs/tiny tasks=stdlib_bodies,my_tasks.jsonl limit=100
    recipes-export checkpoint=runs/tiny out=tiny-hf dtype=bfloat16

The last three run one job each over a typed config of their own
(:mod:`recipes_lib.config.commands`) and write nothing but what they are asked for: no
``outputs/`` folder, no ``.hydra/`` copy, logging left as it is.

Each job's console shows one line per log record and hides library warnings
(:mod:`recipes_lib.console`); ``RECIPES_VERBOSE=1`` shows everything.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from recipes_lib.config import register_schema
from recipes_lib.config.commands import (
    EvalConfig,
    ExportConfig,
    GenerateConfig,
    check_command_overrides,
    command_line,
    register_command_schemas,
    to_command_config,
)
from recipes_lib.config.hydra_guard import check_hydra_app
from recipes_lib.config.overrides import check_command_line
from recipes_lib.config.schema import RunConfig
from recipes_lib.console import configure_console
from recipes_lib.errors import ConfigError, GateFailed, RecipesError
from recipes_lib.files import global_rank
from recipes_lib.pipeline.spec import PipelineConfig, register_pipeline_schema

log = logging.getLogger("recipes_lib")
CONFIG_PATH = "pkg://recipes_lib.conf"
EXIT_GATE_FAILED = 3  # recipes-pipeline: a stage did not meet one of its gates

register_schema()
register_pipeline_schema()
register_command_schemas()


def _with_job_output_dir(cfg: DictConfig) -> DictConfig:
    """Point ``run.dir`` at this job's folder (a multirun gives each job its own)."""
    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, False)
    cfg.run.dir = HydraConfig.get().runtime.output_dir
    return cfg


def _report(err: RecipesError) -> None:
    """The error on stderr, once; the log file gets it too (not the console a second time)."""
    log.error("%s", err, extra={"console": False})
    print(f"error: {err}", file=sys.stderr)


def _report_preempted(err: SystemExit) -> None:
    """A preemption (:class:`recipes_lib.callbacks.Preempted`) on stderr in one line, by
    rank 0 only (every rank stopped at the same step), before exiting with its status."""
    log.warning("%s", err, extra={"console": False})
    if global_rank() == 0:
        print(f"error: {err} (exit status {err.code})", file=sys.stderr)


def _join_submitit_job() -> None:
    """A sweep job's process under ``hydra/launcher=slurm`` or ``local``: its rank and the
    time-limit signal (:func:`recipes_lib.sweep.join_submitit_job`)."""
    if "SUBMITIT_EXECUTOR" in os.environ:
        from recipes_lib.sweep import join_submitit_job

        join_submitit_job()


def _launch_check(cfg: DictConfig) -> None:
    """The pre-launch check of ``cfg``: its table on stdout (rank 0), then exit status 1
    if any check failed. With ``data.chat.prove_masks`` the mask proof runs first; a
    record that differs ends the check with status 2."""
    from recipes_lib.launch_check import check_launch, print_report

    if cfg.data.chat.prove_masks:  # before the table: a difference is bad input
        try:
            _inspect_chat(cfg, show=False)
        except RecipesError as err:
            _report(err)
            sys.exit(2)
    report = check_launch(_with_job_output_dir(cfg))
    if global_rank() == 0:
        print_report(report, title=f"pre-launch check: {cfg.run.name} ({cfg.model.name})")
    if report.exit_code:
        problems = "; ".join(f"{r.check}: {r.figure}" for r in report.failed)
        log.error("pre-launch check failed: %s", problems, extra={"console": False})
        if global_rank() == 0:
            print(f"error: pre-launch check failed: {problems}", file=sys.stderr)
        sys.exit(report.exit_code)


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")
def _train(cfg: DictConfig) -> float | None:
    configure_console()
    _join_submitit_job()
    if cfg.run.launch_check:  # the pre-launch check instead of a run
        _launch_check(cfg)
        return None
    from recipes_lib.callbacks.preemption import Preempted
    from recipes_lib.train import run

    try:
        result = run(_with_job_output_dir(cfg))
    except RecipesError as err:
        _report(err)
        sys.exit(2)
    except Preempted as err:
        _report_preempted(err)
        raise
    log.info("finished at step %d; output in %s", result.global_step, result.output_dir)
    for line in result.summary_lines():  # the weights, the exported folder, what to run next
        log.info("%s", line)
    if result.skipped_records:
        reasons = "; ".join(f"{n} {reason}" for reason, n in result.skipped_records.items())
        log.info("  data: %d record(s) left out: %s", sum(result.skipped_records.values()), reasons)
    if result.compiled.get("graphs"):
        log.info(
            "  compiled: %d graph(s), %d recompile-limit hit(s)",
            result.compiled["graphs"],
            result.compiled["recompile_limit_hits"],
        )
    if result.attention:  # the kernel of each kind of attention layer
        kinds = ", ".join(f"{kind} layers {name}" for kind, name in result.attention.items())
        log.info("  attention: %s", kinds)
    if result.start:  # where the time to the first step went
        log.info("  start: %s", ", ".join(f"{k} {v:.1f}s" for k, v in result.start.items()))
    rollbacks = result.guard.get("rollbacks", [])
    if result.guard.get("skipped_updates") or rollbacks:
        moved = sum(r["skipped_batches"] for r in rollbacks)
        log.info(
            "  guard: %d update(s) skipped, %d rollback(s), %d batch(es) moved past",
            result.guard.get("skipped_updates", 0),
            len(rollbacks),
            moved,
        )
    for name, value in sorted(result.metrics.items()):
        log.info("  %s = %.4f", name, value)
    return result.metrics.get("val/loss")  # the value a sweeper optimises


def _inspect_chat(cfg: DictConfig, show: bool) -> None:
    """``data.chat.show`` (when ``show``) and ``data.chat.prove_masks`` on the SFT data of
    ``cfg``, set up as a run's would be (:mod:`recipes_lib.data.chat.show`,
    :mod:`recipes_lib.data.chat.proof`): the examples and counts, the proof's lines."""
    from recipes_lib.checkpoint.source import fill_model_from_init
    from recipes_lib.config import to_run_config
    from recipes_lib.data.chat.module import ChatDataModule
    from recipes_lib.data.chat.proof import prove_chat_data
    from recipes_lib.data.chat.show import show_chat_data
    from recipes_lib.objectives import build_data

    run_cfg = to_run_config(fill_model_from_init(_with_job_output_dir(cfg)))
    chat = run_cfg.data.chat
    datamodule = build_data(run_cfg, total_train_samples=1)
    if not isinstance(datamodule, ChatDataModule):
        raise ConfigError(
            "data.chat.prove_masks and data.chat.show read chat (SFT) data; "
            f"stage.objective={run_cfg.stage.objective} reads other data"
        )
    datamodule.prepare_data()
    datamodule.setup("fit")
    if show and chat.show:
        show_chat_data(datamodule, chat.show)
    if chat.prove_masks:
        for line in prove_chat_data(datamodule, chat.prove_masks):
            print(f"mask proof: {line}")


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")
def _prepare(cfg: DictConfig) -> None:
    configure_console()
    from recipes_lib.config import to_run_config
    from recipes_lib.data import prepare

    try:
        if cfg.data.chat.show or cfg.data.chat.prove_masks:
            _inspect_chat(cfg, show=True)
            return
        run_cfg = to_run_config(_with_job_output_dir(cfg))
        prepare(run_cfg.data, model_vocab_size=run_cfg.model.vocab_size)
    except RecipesError as err:
        _report(err)
        sys.exit(2)


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")
def _check(cfg: DictConfig) -> None:
    configure_console()
    _launch_check(cfg)


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="pipeline_root")
def _pipeline(cfg: DictConfig) -> float | None:
    configure_console()
    _join_submitit_job()
    from recipes_lib.callbacks.preemption import Preempted
    from recipes_lib.pipeline import run_pipeline

    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, False)
    cfg.dir = HydraConfig.get().runtime.output_dir  # a multirun gives each job its own
    try:
        result = run_pipeline(cfg)
    except GateFailed as err:  # a decision on the numbers, not a bad input
        _report(err)
        sys.exit(EXIT_GATE_FAILED)
    except RecipesError as err:
        _report(err)
        sys.exit(2)
    except Preempted as err:  # a stage stopped at a checkpoint; a rerun resumes it
        _report_preempted(err)
        raise
    if not result.stages:  # dry run
        return None
    log.info("pipeline %s finished; report in %s", result.name, result.report_dir)
    return result.stages[-1].manifest.metrics.val_loss  # the value a sweeper optimises


def _command(cfg: DictConfig, schema: type, module: str) -> None:
    """Run the ``command`` of ``module`` (imported only now: it imports torch) on the
    typed config; a bad input is one line on stderr and exit status 2."""
    try:
        typed = to_command_config(cfg, schema)
        importlib.import_module(module).command(typed)
    except RecipesError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="generate")
def _generate(cfg: DictConfig) -> None:
    _command(cfg, GenerateConfig, "recipes_lib.generate")


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="eval")
def _eval(cfg: DictConfig) -> None:
    _command(cfg, EvalConfig, "recipes_lib.evaluation.command")


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="export")
def _export(cfg: DictConfig) -> None:
    _command(cfg, ExportConfig, "recipes_lib.export")


def _quiet_other_ranks() -> None:
    """Under a multi-process launcher only rank 0 writes Hydra's config copy and log file;
    the other ranks still print errors (:func:`_report`)."""
    if global_rank() != 0 and not any(a.startswith("hydra.output_subdir") for a in sys.argv):
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled"]


def _close_process_group() -> None:
    """Tear down the distributed process group before the interpreter exits: left to
    interpreter shutdown, its communication threads can abort the process. A command that
    never imported torch (a refusal, ``--cfg job``) has none, and does not import it now."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _check_overrides(schema: type) -> None:
    """Exit with status 2 and one line when an override names a group option or key that
    does not exist, before Hydra's longer message (:mod:`recipes_lib.config.overrides`)."""
    try:
        check_command_line(sys.argv[1:], schema)
    except RecipesError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def _check_hydra_config(entry: Callable[[], object], config_name: str) -> None:
    """Exit with status 2 and one line when the composed config would have Hydra run code
    that is not shipped, or a file widens ``run.allowed_targets``, before Hydra acts on
    it (:mod:`recipes_lib.config.hydra_guard`)."""
    try:
        check_hydra_app(entry, CONFIG_PATH, config_name, sys.argv[1:])
    except RecipesError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def _run_and_exit(
    entry: Callable[[], object], schema: type = RunConfig, config_name: str = "config"
) -> NoReturn:
    """Run a command's ``entry`` (its overrides checked against ``schema``, and its
    composed ``config_name`` against what may run code, first) and end the process with
    its exit status, without the interpreter's own teardown.

    After a run, the interpreter would free what is left (the CUDA context, tensors,
    the compile workers' pipes, thousands of modules) object by object: seconds after a
    1B run on an H100, while the operating system takes it all back at once. The exit
    handlers still run (trackers flush there) and the log handlers and output streams
    are flushed first. An exception other than ``SystemExit`` is left to Python.
    """
    _quiet_other_ranks()
    status: int | str | None = 0
    try:
        _check_overrides(schema)
        _check_hydra_config(entry, config_name)
        entry()
    except SystemExit as stop:
        status = stop.code
    finally:
        _close_process_group()
    if isinstance(status, str):  # sys.exit("message"): printed, status 1
        print(status, file=sys.stderr)
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status if isinstance(status, int) else 0 if status is None else 1)


def run_command(
    script: str, entry: Callable[[], object], schema: type, config_name: str, argv: Sequence[str]
) -> int:
    """Run a single-job command (``recipes-generate``, ``-eval``, ``-export``) on
    ``argv`` in this process and return its exit status.

    Its text keys are taken as written and its list keys take comma-separated items
    (:func:`~recipes_lib.config.commands.command_line`); an override naming a missing
    key or holding a value of the wrong type, a sweep, or a config that would run code
    (:func:`~recipes_lib.config.hydra_guard.check_hydra_app`) is one line on stderr and
    status 2, before Hydra acts.
    """
    from hydra._internal.utils import get_args_parser
    from hydra.core.global_hydra import GlobalHydra

    argv = command_line(argv, schema)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args = get_args_parser().parse_args(argv)
    except SystemExit:
        args = None  # Hydra prints its usage and what it could not read
    try:
        if args is not None and args.multirun:
            raise ConfigError(f"--multirun: {script} runs one job")
        if args is not None and not (args.help or args.hydra_help or args.shell_completion):
            check_command_overrides(args.overrides, schema)
        check_hydra_app(entry, CONFIG_PATH, config_name, argv)
    except RecipesError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    saved = sys.argv
    sys.argv = [script, *argv]
    try:
        entry()
    except SystemExit as stop:
        if isinstance(stop.code, str):  # sys.exit("message"): printed, status 1
            print(stop.code, file=sys.stderr)
        return stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
    finally:
        sys.argv = saved
        GlobalHydra.instance().clear()
    return 0


def generate_command(argv: Sequence[str]) -> int:
    """``recipes-generate`` on ``argv``: print the prompt and its continuation; the exit
    status."""
    return run_command("recipes-generate", _generate, GenerateConfig, "generate", argv)


def eval_command(argv: Sequence[str]) -> int:
    """``recipes-eval`` on ``argv``: print the table (and write JSON); the exit status."""
    return run_command("recipes-eval", _eval, EvalConfig, "eval", argv)


def export_command(argv: Sequence[str]) -> int:
    """``recipes-export`` on ``argv``: write the folder and say where; the exit status."""
    return run_command("recipes-export", _export, ExportConfig, "export", argv)


def generate_main() -> NoReturn:
    """Entry point of ``recipes-generate``."""
    sys.exit(generate_command(sys.argv[1:]))


def eval_main() -> NoReturn:
    """Entry point of ``recipes-eval``."""
    sys.exit(eval_command(sys.argv[1:]))


def export_main() -> NoReturn:
    """Entry point of ``recipes-export``."""
    sys.exit(export_command(sys.argv[1:]))


def train_main() -> None:
    """Entry point of ``recipes-train``."""
    _run_and_exit(_train)


def prepare_main() -> None:
    """Entry point of ``recipes-prepare``: tokenize the configured data into shards; with
    ``data.chat.show=N`` print N rendered chat examples of each source, trained tokens
    marked, and with ``data.chat.prove_masks=N`` prove N records' masks."""
    _run_and_exit(_prepare)


def check_main() -> None:
    """Entry point of ``recipes-check``: the pre-launch check of a run's config (the
    same groups and overrides as ``recipes-train``), a table, non-zero on a problem;
    with ``data.chat.prove_masks=N``, N records of each chat source proved first."""
    _run_and_exit(_check)


def pipeline_main() -> None:
    """Entry point of ``recipes-pipeline``: run the stages of ``pipeline=NAME`` in order."""
    _run_and_exit(_pipeline, PipelineConfig, "pipeline_root")


if __name__ == "__main__":
    train_main()
