"""The multi-node examples are what their tools and the library accept: shell syntax,
SLURM's option names, torchrun's arguments, and overrides that compose into a run the
pre-flight passes, with as many processes as the run expects."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from recipes_lib.config import compose_config, to_run_config
from recipes_lib.preflight import check_strategy

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "multinode"
# sbatch's long options (`man sbatch`) that a training job uses
SBATCH_OPTIONS = {
    "account",
    "cpus-per-task",
    "gpus",
    "gpus-per-node",
    "job-name",
    "mem",
    "nodes",
    "ntasks",
    "ntasks-per-node",
    "output",
    "error",
    "partition",
    "qos",
    "requeue",
    "signal",
    "time",
    "exclusive",
    "constraint",
}


def _command(path: Path, program: str) -> list[str]:
    """The example's ``program`` command line, continuation lines joined, variables
    given stand-in values."""
    text = path.read_text().replace("\\\n", " ")
    (line,) = [row for row in text.splitlines() if row.strip().startswith(program)]
    line = line.replace('"$NODE_RANK"', "0").replace('"$MASTER_ADDR:29500"', "10.0.0.1:29500")
    return shlex.split(line)


def _run_overrides(tokens: list[str]) -> list[str]:
    return tokens[tokens.index("recipes_lib.cli") + 1 :]


@pytest.mark.parametrize("name", ["train.sbatch", "torchrun_rendezvous.sh"])
def test_the_scripts_are_valid_shell(name):
    assert subprocess.run(["bash", "-n", str(EXAMPLES / name)]).returncode == 0


def test_the_sbatch_script_uses_slurm_options_and_starts_every_rank():
    script = EXAMPLES / "train.sbatch"
    options = dict(
        re.fullmatch(r"--([a-z-]+)(?:=(.*))?", line.split()[1]).groups()
        for line in script.read_text().splitlines()
        if line.startswith("#SBATCH")
    )
    assert set(options) <= SBATCH_OPTIONS, set(options) - SBATCH_OPTIONS
    assert options["signal"].startswith("USR1@")  # the signal the run saves and exits on
    cfg = to_run_config(compose_config(_run_overrides(_command(script, "srun"))))
    tasks = int(options["nodes"]) * int(options["ntasks-per-node"])
    assert tasks == cfg.trainer.num_nodes * cfg.trainer.devices
    assert int(options["gpus-per-node"]) == cfg.trainer.devices
    check_strategy(cfg)


def test_the_torchrun_example_parses_and_starts_every_rank():
    from torch.distributed.run import get_args_parser

    tokens = _command(EXAMPLES / "torchrun_rendezvous.sh", "torchrun")
    args = get_args_parser().parse_args(tokens[1:])
    assert (args.rdzv_backend, args.rdzv_endpoint) == ("c10d", "10.0.0.1:29500")
    assert args.module and args.training_script == "recipes_lib.cli"
    cfg = to_run_config(compose_config(_run_overrides(tokens)))
    assert (
        int(args.nnodes) * int(args.nproc_per_node) == cfg.trainer.num_nodes * cfg.trainer.devices
    )
    check_strategy(cfg)
