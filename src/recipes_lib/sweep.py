"""Sweeps through Hydra's submitit launchers (``-m ... hydra/launcher=slurm`` or
``local``): the check before anything is submitted, and a job's processes.

A sweep's jobs start later, elsewhere, possibly hours after a queue, so what can be
seen from the config alone is refused before the launcher submits anything
(:class:`SweepCheck`, a Hydra callback run at the start of every multirun), the first
problem in one line naming the key, exit status 2:

- a launcher option the installed submitit does not take (the launcher plugin's options
  and submitit's signature drift apart between versions);
- a ``recipes-train`` job whose processes differ from what it will ask Lightning for:
  ``tasks_per_node`` against ``trainer.devices``, ``nodes`` against
  ``trainer.num_nodes``, and under SLURM fewer ``gpus_per_node`` than processes on GPUs;
- a job whose overrides make a bad config (an unknown key or a wrong type, an unallowed
  ``_target_``, a value wrong on its own; a ``recipes-pipeline`` job's spec).

What depends on the machine a job lands on (its GPUs, its packages) is checked by the
job's own pre-flight when it starts.

In a job's processes, :func:`join_submitit_job` runs first: under the local executor it
exports submitit's ranks as ``torch.distributed``'s variables (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; under SLURM Lightning reads ``srun``'s,
as for the ``srun`` command in docs/multi-gpu.md), and it passes submitit's time-limit signal
(SIGUSR2) on to the run's SIGUSR1 handler while it trains, on which it saves at the end
of its step and stops (:mod:`recipes_lib.callbacks.preemption`; under SLURM the job is
requeued and resumes); outside training submitit's own handler keeps it.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any, cast

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from recipes_lib.config import to_run_config
from recipes_lib.config.validate import check_values
from recipes_lib.errors import ConfigError, RecipesError
from recipes_lib.pipeline.spec import parse_pipeline
from recipes_lib.preflight.targets import check_run_targets

# hydra-submitit-launcher's own options (not submitit's): the folder and the retries
LAUNCHER_OWN = {"submitit_folder", "max_num_timeout", "_target_"}
GPU_ACCELERATORS = {"gpu", "cuda", "auto"}  # under SLURM; locally "auto" may mean the CPU
EXECUTORS = {"SlurmLauncher": "slurm", "LocalLauncher": "local"}


class SweepCheck(Callback):
    """Checks a sweep headed for a submitit launcher before any job is submitted
    (``hydra.callbacks.sweep_check``; other launchers are left alone)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        target = str(OmegaConf.select(config, "hydra.launcher._target_") or "")
        executor = EXECUTORS.get(target.rsplit(".", 1)[-1]) if "submitit" in target else None
        if executor is None:
            return
        name = kwargs.get("config_name")
        try:
            params = launcher_options(config)
            jobs = [(swept, _compose(name, job)) for swept, job in _jobs(config)]
            check_sweep(executor, params, jobs)
        except RecipesError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)


def launcher_options(config: DictConfig) -> dict[str, Any]:
    """``hydra.launcher`` resolved (its resources follow ``trainer.devices`` and
    ``trainer.num_nodes``, which must then be numbers)."""
    if "trainer" in config:
        _count(config.trainer.devices, "trainer.devices")
        _count(config.trainer.num_nodes, "trainer.num_nodes")
    try:
        # hydra.launcher is a mapping, whose container is a dict
        return cast(dict[str, Any], OmegaConf.to_container(config.hydra.launcher, resolve=True))
    except Exception as err:  # OmegaConf's: an interpolation that does not resolve
        raise ConfigError(f"hydra.launcher: {str(err).splitlines()[0]}") from err


def _jobs(config: DictConfig) -> list[tuple[str, list[str]]]:
    """Each job's overrides as Hydra's basic sweeper makes them (the command line's and
    ``hydra.sweeper.params``), with the swept ones; none for another sweeper, or for
    sweeps only the sweeper can expand (``glob()``, ranges of an optimiser's): those
    jobs are checked by their own pre-flight when they start."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not str(OmegaConf.select(config, "hydra.sweeper._target_") or "").endswith("BasicSweeper"):
        return []
    task = OmegaConf.to_container(config.hydra.overrides.task, resolve=False)
    overrides = [str(override) for override in cast(list[Any], task)]  # a list of strings
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    overrides += [f"{key}={value}" for key, value in params.items()]
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        jobs = BasicSweeper.split_arguments(parsed, None)[0]
    except Exception:  # Hydra's own (HydraException, a glob without its config loader)
        return []
    swept = {o.get_key_element() for o in parsed if o.is_sweep_override()}
    return [(" ".join(o for o in job if o.split("=", 1)[0] in swept), job) for job in jobs]


def _compose(config_name: str | None, overrides: list[str]) -> DictConfig:
    from hydra import compose

    try:
        return compose(config_name=config_name, overrides=overrides)
    except Exception as err:  # Hydra's own: an unknown key or group, a bad value
        raise ConfigError(str(err).splitlines()[0]) from err


def check_sweep(
    executor: str, params: Mapping[str, Any], jobs: Sequence[tuple[str, DictConfig]]
) -> None:
    """Refuse the sweep's first problem.

    Args:
        executor: ``"slurm"`` or ``"local"``.
        params: the launcher's options (``hydra.launcher``, resolved).
        jobs: each job's swept overrides (``optim.lr=1e-3``) and its composed config.

    Raises:
        ConfigError: naming the ``hydra.launcher`` key, or the job and its key.
    """
    check_submitit_options(executor, params)
    for number, (swept, job) in enumerate(jobs):
        try:
            if "trainer" in job:
                check_train_job(executor, params, job)
            else:
                check_pipeline_job(job)
        except ConfigError as err:
            raise ConfigError(f"sweep job #{number} ({swept}): {err}") from err


def check_submitit_options(executor: str, params: Mapping[str, Any]) -> None:
    """Every ``hydra.launcher`` option is one the installed submitit takes."""
    import submitit

    generic = submitit.AutoExecutor._valid_parameters()  # timeout_min, nodes, ...
    own = {"slurm": submitit.SlurmExecutor, "local": submitit.LocalExecutor}[executor]
    takes = set(own._valid_parameters())
    for key in params:
        if key in LAUNCHER_OWN or key in generic or key in takes:
            continue
        raise ConfigError(
            f"hydra.launcher.{key}: the installed submitit ({submitit.__version__}) takes no "
            f"{executor} option {key!r} (its options: {', '.join(sorted(generic | takes))})"
        )


def _count(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{key}={value}: a sweep job's processes are fixed when it is submitted; set "
            f"{key} to a number (one process per device)"
        )
    return value


def check_train_job(executor: str, params: Mapping[str, Any], job: DictConfig) -> None:
    """A ``recipes-train`` job: its config, and its processes against its trainer."""
    from recipes_lib.checkpoint.source import fill_model_from_init
    from recipes_lib.objectives import objective_names

    cfg = to_run_config(fill_model_from_init(job))  # model=from_init: the source's shape
    check_run_targets(cfg)
    check_values(cfg, objective_names())
    devices = _count(cfg.trainer.devices, "trainer.devices")
    nodes = _count(cfg.trainer.num_nodes, "trainer.num_nodes")
    tasks = params.get("tasks_per_node", 1)
    if tasks != devices:
        raise ConfigError(
            f"hydra.launcher.tasks_per_node={tasks} but trainer.devices={devices}: a job "
            "starts one process per device"
        )
    if params.get("nodes", 1) != nodes:
        raise ConfigError(
            f"hydra.launcher.nodes={params.get('nodes', 1)} but trainer.num_nodes={nodes}"
        )
    gpus = params.get("gpus_per_node") or 0
    accelerator = str(cfg.trainer.accelerator)
    on_gpus = accelerator in (GPU_ACCELERATORS if executor == "slurm" else {"gpu", "cuda"})
    if on_gpus and gpus < devices:
        raise ConfigError(
            f"hydra.launcher.gpus_per_node={gpus} but trainer.devices={devices} on "
            f"trainer.accelerator={accelerator}: each process needs its GPU"
        )


def check_pipeline_job(job: DictConfig) -> None:
    """A ``recipes-pipeline`` job: its spec (stages, sources, keys)."""
    parse_pipeline(job)


def join_submitit_job() -> None:
    """In a process that submitit started (a sweep job's), before the run: its rank for
    ``torch.distributed`` (local executor), and the time-limit signal passed on."""
    executor = os.environ.get("SUBMITIT_EXECUTOR")
    if executor not in ("slurm", "local"):
        return
    import submitit

    environment = submitit.JobEnvironment()
    if executor == "local" and environment.num_tasks > 1:
        # local jobs run at once: each its own port (submitit derives it from the job id),
        # not one inherited from the shell that started the sweep
        os.environ.pop("MASTER_PORT", None)
        submitit.helpers.TorchDistributedEnvironment().export(
            set_cuda_visible_devices=False, overwrite=True
        )
    own = getattr(signal, f"SIG{submitit.JobEnvironment.USR_SIG}", None)
    if own is None or own == signal.SIGUSR1:
        return
    earlier = signal.getsignal(own)  # submitit's: checkpoint and requeue

    def pass_on(signum: int, frame: Any) -> None:
        """To the run's SIGUSR1 handler while training (it saves at the end of the step
        and stops); outside training, where SIGUSR1 would end the process, to submitit's."""
        handler = signal.getsignal(signal.SIGUSR1)
        if callable(handler):
            handler(signal.SIGUSR1, frame)
        elif callable(earlier):
            earlier(signum, frame)

    signal.signal(own, pass_on)
