"""Shared by the tests: the CSV metrics a run logs, ``torchrun`` jobs, runs that
pytest-xdist's workers build once between them, a script run in this process as its
command line runs it, and a benchmark's ``--smoke`` run."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import runpy
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from filelock import FileLock

Built = TypeVar("Built", Path, dict[str, Path])


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


def built_once(tmp_path_factory, name: str, build: Callable[[Path], Built]) -> Built:
    """``build(folder)`` (the runs a module's tests read: a folder, or folders by name)
    once for the whole session, whichever pytest-xdist worker asks first.

    A module-scoped fixture runs again on every worker that runs one of its tests, and
    again on a worker that leaves the module and comes back; pytest-xdist's work
    stealing does both, to the minute-long multi-process fixtures too. Here the first
    asker builds into a folder the workers share (under the session's common temporary
    root) while holding its lock; the others wait for it, then read what it wrote. A
    build that fails says so to the later askers, which fail at once instead of building
    again over its half-written runs.
    """
    if os.environ.get("PYTEST_XDIST_WORKER") is None:  # one process: a folder of its own
        return build(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent / f"built-{name}"
    done, failed = shared / "built.json", shared.with_name(f"built-{name}.failed")
    with FileLock(f"{shared}.lock"):
        if failed.is_file():
            raise AssertionError(
                f"{name}: built on another worker, and failed: {failed.read_text()}"
            )
        if not done.is_file():
            shared.mkdir()
            try:
                result = build(shared)
            except BaseException as err:
                failed.write_text(f"{type(err).__name__}: {str(err)[:2000]}")
                raise
            paths = {"": str(result)} if isinstance(result, Path) else result
            done.write_text(json.dumps({k: str(v) for k, v in paths.items()}))
    read = {k: Path(v) for k, v in json.loads(done.read_text()).items()}
    return read[""] if list(read) == [""] else read  # type: ignore[return-value]


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_script(script: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python <script> <args>`` run in this process: its ``__main__`` block with
    ``sys.argv`` set and its folder first on ``sys.path``, as the command line runs it,
    without starting an interpreter that imports torch and Lightning again (seconds per
    script on a CPU). Its exit status is that of its ``SystemExit`` (0 when it returns);
    what it prints is captured. What a script may change of the process is put back
    afterwards: the working folder, the environment, ``sys.argv`` and ``sys.path``,
    warning filters, torch's random state, thread count and compiled graphs."""
    import torch

    saved_argv, saved_path = sys.argv[:], sys.path[:]
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    threads, rng = torch.get_num_threads(), torch.random.get_rng_state()
    stdout, stderr = io.StringIO(), io.StringIO()
    code: int | str | None = 0
    try:
        sys.argv = [str(script), *args]
        sys.path.insert(0, str(Path(script).parent))
        if cwd is not None:
            os.chdir(cwd)
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(stdout),
            contextlib.redirect_stderr(stderr),
        ):
            try:
                runpy.run_path(str(script), run_name="__main__")
            except SystemExit as stop:
                code = stop.code
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.argv, sys.path[:] = saved_argv, saved_path
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng)
        torch._dynamo.reset()
    if isinstance(code, str):  # sys.exit("message"): printed, status 1
        stderr.write(code + "\n")
        code = 1
    status = 0 if code is None else code
    return subprocess.CompletedProcess(
        [sys.executable, str(script), *args], status, stdout.getvalue(), stderr.getvalue()
    )


def benchmark_smoke(script: str, out: Path, *args: str, stdout_json: bool = False) -> dict:
    """``python benchmarks/<script> --smoke --out <out> <args>``, run in this process
    (:func:`run_script`): the JSON it wrote. Fails the test with the end of its stderr
    when it exits non-zero; with ``stdout_json``, also when its standard output holds
    anything but that same JSON."""
    proc = run_script(BENCHMARKS / script, "--smoke", "--out", str(out), *args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    figures = json.loads(out.read_text())
    if stdout_json:
        assert json.loads(proc.stdout) == figures  # stdout holds the JSON and nothing else
    return figures
