"""``recipes-train -m ... hydra/launcher=slurm``: what reaches ``sbatch``, and what is
refused before it. ``srun`` and ``sbatch`` are stand-ins on ``PATH`` that record what
they are given (``sbatch`` then fails, so nothing waits for a job); the local executor's
real two-process jobs are in ``test_distributed_cpu.py``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")

from recipes_lib.errors import ConfigError  # noqa: E402
from recipes_lib.sweep import (  # noqa: E402
    check_submitit_options,
    check_sweep,
    launcher_options,
)

STAND_IN = """#!/bin/sh
cp "$1" "{record}" 2>/dev/null || echo "$@" > "{record}"
echo "{name}: stopped by the test" >&2
exit 1
"""


def _sweep(
    tmp_path: Path, *overrides: str, app: str = "train"
) -> tuple[subprocess.CompletedProcess, Path]:
    """The sweep (``recipes-train``, or ``recipes-pipeline`` with ``app="pipeline"``) with
    stand-ins for SLURM's commands; its result and where ``sbatch`` recorded its script."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    record = tmp_path / "sbatch_script.sh"
    for name in ("srun", "sbatch"):
        path = bin_dir / name
        path.write_text(
            STAND_IN.format(record=record if name == "sbatch" else "/dev/null", name=name)
        )
        path.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    entry = f"from recipes_lib.cli import {app}_main; {app}_main()"
    command = [sys.executable, "-c", entry, "-m", "hydra/launcher=slurm"]
    if app == "train":
        command += ["recipe=pretrain/tiny", f"run.dir={tmp_path / 'run'}"]
    else:
        command += [f"dir={tmp_path / 'run'}"]
    command += overrides
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    return proc, record


def test_each_job_is_one_array_task_of_srun_processes_one_per_gpu(tmp_path):
    proc, record = _sweep(
        tmp_path,
        "trainer.accelerator=gpu",
        "trainer.devices=4",
        "trainer.num_nodes=2",
        "hydra.launcher.partition=gpu",
        "hydra.launcher.account=lab",
        "hydra.launcher.timeout_min=90",
        "optim.lr=1e-3,2e-3",
    )
    assert record.is_file(), proc.stderr[-3000:]
    script = record.read_text()
    for line in (
        "#SBATCH --array=0-1",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=lab",
        "#SBATCH --time=90",
        "#SBATCH --signal=USR2@120",
    ):
        assert line in script, f"{line!r} not in:\n{script}"
    assert any(row.startswith("srun ") for row in script.splitlines()), script


def test_a_sweep_that_cannot_run_is_refused_before_anything_is_submitted(tmp_path):
    overrides = ["trainer.devices=2", "hydra.launcher.tasks_per_node=4", "optim.lr=1e-3,2e-3"]
    proc, record = _sweep(tmp_path, *overrides)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    expected = (
        "sweep job #0 (optim.lr=0.001): hydra.launcher.tasks_per_node=4 but trainer.devices=2"
    )
    assert len(errors) == 1 and expected in errors[0], proc.stderr[-3000:]
    assert not record.exists()
    assert not (tmp_path / "run" / "multirun" / ".submitit").exists()


def _job(*overrides: str, recipe: str = "pretrain/tiny"):
    """A ``recipes-train`` job's config with ``hydra.launcher=slurm`` (Hydra's own
    composition, as a sweep's job gets it)."""
    from hydra import compose, initialize_config_module

    from recipes_lib.config import register_schema

    register_schema()
    with initialize_config_module(config_module="recipes_lib.conf", version_base="1.3"):
        return compose(
            config_name="config",
            overrides=["hydra/launcher=slurm", f"recipe={recipe}", *overrides],
            return_hydra_config=True,
        )


def test_each_job_is_checked_in_order_and_named_by_its_swept_keys():
    good, bad = _job("trainer.devices=1", "optim.lr=1e-3"), _job("trainer.devices=1", "optim.lr=-1")
    params = launcher_options(good)
    assert params["tasks_per_node"] == params["gpus_per_node"] == 1 and params["nodes"] == 1
    with pytest.raises(ConfigError, match=r"^sweep job #1 \(optim.lr=-1\): optim.lr"):
        check_sweep("slurm", params, [("optim.lr=0.001", good), ("optim.lr=-1", bad)])
    gpu = _job("trainer.devices=2", "trainer.accelerator=gpu", "hydra.launcher.gpus_per_node=1")
    with pytest.raises(ConfigError, match=r"gpus_per_node=1 but trainer.devices=2"):
        check_sweep("slurm", launcher_options(gpu), [("", gpu)])


def test_a_job_starting_from_a_folder_is_checked_with_the_folders_model(hf_folder, tmp_path):
    """``recipe=sft/full stage.init_from=DIR``: the model's shape is the folder's, read
    before the check (as the run reads it), not an unresolved ``from_init`` field."""
    data = tmp_path / "chat.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    job = _job(
        f"stage.init_from={hf_folder}", f"data.path={data}", "trainer.devices=1", recipe="sft/full"
    )
    check_sweep("slurm", launcher_options(job), [("", job)])
    with pytest.raises(ConfigError, match=r"^sweep job #0 \(\): hydra.launcher.tasks_per_node"):
        check_sweep("slurm", {**launcher_options(job), "tasks_per_node": 2}, [("", job)])


def test_devices_left_to_lightning_are_refused_for_a_sweep():
    with pytest.raises(ConfigError, match=r"^trainer.devices=auto: a sweep job's processes"):
        launcher_options(_job("trainer.devices=auto"))


def test_a_pipeline_sweep_goes_to_sbatch_and_a_bad_stage_key_is_refused_first(tmp_path):
    proc, record = _sweep(
        tmp_path / "good", "pipeline=demo", "stages.anneal.trainer.max_steps=50,200", app="pipeline"
    )
    assert "#SBATCH --array=0-1" in record.read_text(), proc.stderr[-3000:]
    proc, record = _sweep(
        tmp_path / "bad", "pipeline=demo", "+stages.anneal.form=pretrain,sft", app="pipeline"
    )
    assert proc.returncode == 2 and not record.exists(), proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "sweep job #0" in errors[0] and "form" in errors[0], errors


def test_an_option_the_installed_submitit_does_not_take_is_named():
    with pytest.raises(ConfigError, match=r"^hydra.launcher.srun_argz: the installed submitit"):
        check_submitit_options("slurm", {"partition": "gpu", "srun_argz": ["-v"]})
    check_submitit_options("slurm", {"partition": "gpu", "tasks_per_node": 2, "timeout_min": 5})


def test_a_jobs_time_limit_signal_reaches_the_runs_handler_and_otherwise_submitits(
    monkeypatch,
):
    """In a job's process submitit's SIGUSR2 goes to the run's SIGUSR1 handler while one
    is installed (training), else to the handler that was there before (submitit's)."""
    import signal

    from recipes_lib.sweep import join_submitit_job

    local_job = {"SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_JOB_ID": "7"}
    local_job |= {"SUBMITIT_LOCAL_NTASKS": "1", "SUBMITIT_LOCAL_JOB_NUM_NODES": "1"}
    local_job |= {"SUBMITIT_LOCAL_NODEID": "0", "SUBMITIT_LOCAL_GLOBALID": "0"}
    for key, value in {**local_job, "SUBMITIT_LOCAL_LOCALID": "0"}.items():
        monkeypatch.setenv(key, value)
    seen: list[str] = []
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2)}
    try:
        signal.signal(signal.SIGUSR2, lambda *_: seen.append("submitit"))
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)  # not training
        join_submitit_job()
        signal.raise_signal(signal.SIGUSR2)
        signal.signal(signal.SIGUSR1, lambda *_: seen.append("run"))  # training
        signal.raise_signal(signal.SIGUSR2)
    finally:
        for number, handler in saved.items():
            signal.signal(number, handler)
    assert seen == ["submitit", "run"]
