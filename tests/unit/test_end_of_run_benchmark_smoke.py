"""The end-of-run benchmark runs recipes-train as a user would and splits the time from
the last step to the process's exit into the configured writes and the rest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_helpers import run_script

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "end_of_run.py"

pytestmark = pytest.mark.slow


def test_end_of_run_smoke_times_the_tail_of_a_run(tmp_path):
    out = tmp_path / "end.json"
    proc = run_script(  # the driver here; the run it times is recipes-train, a process
        BENCHMARK,
        "--smoke",
        "--runs",
        "pretrain",
        "--steps",
        "4",
        "--warmup-steps",
        "1",
        "--work-dir",
        str(tmp_path / "work"),
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    run = figures["runs"]["pretrain"]
    assert run["steps"] == 4 and run["step_s"] > 0
    tail = run["after_last_step_s"]
    assert 0 < tail < 60
    assert run["beyond_writes_s"] == pytest.approx(tail - run["writes_s"], abs=0.02)
    assert sum(run["phases_s"].values()) == pytest.approx(tail, abs=0.05)
    assert set(run["events_after_last_step_s"]) == {"on_train_end", "on_fit_end", "atexit"}
    assert (tmp_path / "work" / "pretrain" / "model.safetensors").is_file()
