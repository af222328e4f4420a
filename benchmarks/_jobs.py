"""Measurements that run in a child process, shared by the benchmark scripts.

A driver starts a child (one process, or a ``torchrun`` job of several ranks) running
the same script with a ``--fragment=PATH`` argument; the child writes its report there
as JSON, an error in place of the figures if it failed. The driver reads it back, or
records why there is none (a time limit, a crash) with the tail of the child's log.
Every report gets the job's ``wall_s``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch


def _quiet_run(work: Callable[[], dict]) -> dict:
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    with contextlib.redirect_stdout(sys.stderr):  # stdout is the driver's JSON
        return work()


def worker_main(work: Callable[[], dict], fragment: str) -> int:
    """A ``torchrun`` rank's entry: run ``work``; rank 0 writes the report (or
    ``{"error": "rank N: ..."}``, as every failing rank prints its traceback)."""
    rank = int(os.environ.get("RANK", 0))
    try:
        report = _quiet_run(work)
    except Exception as err:
        traceback.print_exc(file=sys.stderr)
        report = {"error": f"rank {rank}: {type(err).__name__}: {err}"[:2000]}
    if rank == 0:
        Path(fragment).write_text(json.dumps(report))
    return 1 if "error" in report else 0


def attempt_main(work: Callable[[], dict], fragment: str, error_key: str = "error") -> int:
    """A single process's entry: run ``work`` and write its report, or the error under
    ``error_key`` with ``out_of_memory`` set when the device ran out."""
    try:
        report = _quiet_run(work)
    except Exception as err:
        traceback.print_exc(file=sys.stderr)
        report = {error_key: f"{type(err).__name__}: {err}"[:1500]}
        if isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower():
            report["out_of_memory"] = True
    Path(fragment).write_text(json.dumps(report))
    return 1 if error_key in report else 0


def child_env(smoke: bool, gpus: str | None = None) -> dict[str, str]:
    """The child's environment: ``gpus`` visible (none under ``--smoke``)."""
    env = dict(os.environ)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    if smoke:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    """Stop the job a driver started (its own session), every process of it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=15)
            return
        except subprocess.TimeoutExpired:
            continue


def launch_torchrun(
    script: Path,
    processes: int,
    arguments: Sequence[str],
    *,
    smoke: bool,
    timeout_s: float,
    tail_chars: int,
    prefix: str,
    after: Callable[[], None] | None = None,
) -> dict:
    """``torchrun --standalone`` of ``script --worker --fragment=... arguments`` on
    ``processes`` ranks; rank 0's report, or an error with the log's tail. ``after``
    runs once the job has ended, within its wall time (removing what it wrote)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        fragment, log_path = Path(tmp) / "fragment.json", Path(tmp) / "log.txt"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={processes}",
            str(script),
            "--worker",
            f"--fragment={fragment}",
            *arguments,
        ]
        env = child_env(smoke)
        env.setdefault("OMP_NUM_THREADS", "1" if smoke else "4")
        started = time.perf_counter()
        try:
            with open(log_path, "w") as log:
                proc = subprocess.Popen(
                    command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
                try:
                    proc.wait(timeout=max(1.0, timeout_s))
                    timed_out = False
                except subprocess.TimeoutExpired:
                    _kill_group(proc)
                    timed_out = True
        finally:
            if after is not None:
                after()
        seconds = round(time.perf_counter() - started, 1)
        if fragment.is_file() and not timed_out:
            report = json.loads(fragment.read_text())
        elif timed_out:
            report = {"error": f"timed out after {timeout_s:.0f} s"}
        else:
            report = {"error": f"torchrun exited with status {proc.returncode}"}
        if "error" in report:
            report["log_tail"] = log_path.read_text(errors="replace")[-tail_chars:]
        report["wall_s"] = seconds
        return report


def launch_attempt(
    script: Path,
    arguments: Sequence[str],
    *,
    smoke: bool,
    timeout_s: float,
    tail_chars: int,
    prefix: str,
    gpus: str | None = None,
    error_key: str = "error",
) -> dict:
    """``script --attempt --fragment=... arguments`` in one process; its report, or an
    error under ``error_key`` (a time limit, a signal, no report) with its stderr's tail."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        fragment = Path(tmp) / "fragment.json"
        command = [sys.executable, str(script), "--attempt", f"--fragment={fragment}", *arguments]
        started = time.perf_counter()
        try:
            proc = subprocess.run(
                command,
                capture_output=True,
                text=True,
                timeout=max(1.0, timeout_s),
                env=child_env(smoke, gpus),
            )
        except subprocess.TimeoutExpired as err:
            tail = (err.stderr or b"")[-tail_chars:]
            tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
            return {
                error_key: f"timed out after {timeout_s:.0f} s",
                "log_tail": tail,
                "wall_s": round(time.perf_counter() - started, 1),
            }
        if fragment.is_file():
            report = json.loads(fragment.read_text())
        elif proc.returncode < 0:
            report = {error_key: f"killed by signal {-proc.returncode} (host out of memory?)"}
        else:
            report = {error_key: f"exited with status {proc.returncode} and no report"}
        if error_key in report:
            report["log_tail"] = proc.stderr[-tail_chars:]
        report["wall_s"] = round(time.perf_counter() - started, 1)
        return report
