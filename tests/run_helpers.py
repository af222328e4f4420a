"""Shared by the tests: the CSV metrics a run logs, ``torchrun`` jobs, and a benchmark's
``--smoke`` run."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path


def read_metrics(run_dir: Path) -> list[dict[str, str]]:
    """Rows of every CSV log version of a run (a resume starts a new version)."""
    rows: list[dict[str, str]] = []
    for path in sorted((Path(run_dir) / "logs").glob("version_*/metrics.csv")):
        with open(path) as f:
            rows.extend(csv.DictReader(f))
    return rows


def metric_series(rows: list[dict[str, str]], name: str) -> list[tuple[int, float]]:
    """``(step, value)`` of every row that logged ``name``."""
    return [(int(r["step"]), float(r[name])) for r in rows if r.get(name)]


def torchrun(
    processes: int, *args: str, timeout: float = 300, omp_threads: int = 4
) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=<processes> <args>``; fails the test with
    the end of its output when the job fails (or is stopped, with every worker, after
    ``timeout`` seconds)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={processes}",
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(omp_threads)}
    # its own session, so a job that hangs is stopped with every worker it started
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        status = f"exited with {proc.returncode}"
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        status = f"timed out after {timeout} s"
    except BaseException:  # an interrupt (timeout -s INT pytest ...): no worker outlives it
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)}\n{status}\n"
            f"--- stdout ---\n{stdout[-3000:]}\n--- stderr ---\n{stderr[-8000:]}"
        )
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_smoke(
    script: str, out: Path, *args: str, timeout: float, stdout_json: bool = False
) -> dict:
    """``python benchmarks/<script> --smoke --out <out> <args>``: the JSON it wrote. Fails
    the test with the end of its stderr when it exits non-zero; with ``stdout_json``, also
    when its standard output holds anything but that same JSON."""
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--smoke", "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    figures = json.loads(out.read_text())
    if stdout_json:
        assert json.loads(proc.stdout) == figures  # stdout holds the JSON and nothing else
    return figures
