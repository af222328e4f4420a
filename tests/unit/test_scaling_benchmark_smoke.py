"""The scaling benchmark launches one torchrun job per configuration and summarises them
(``--smoke --gpus 2``: the tiny recipe on CPU over gloo, ``single`` on one process and
``ddp`` on two)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "scaling.py"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
        reason="needs torch.distributed with the gloo backend",
    ),
]


def test_scaling_smoke_runs_ddp_on_two_processes_against_one(tmp_path):
    out = tmp_path / "scaling.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARK), "--smoke", "--gpus", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    figures = json.loads(proc.stdout)  # stdout holds the JSON and nothing else
    assert proc.returncode == 0, json.dumps(figures["runs"], indent=1)[-6000:]
    assert json.loads(out.read_text()) == figures
    assert list(figures["runs"]) == ["single/1", "ddp/2"]
    settings = figures["settings"]
    for key, run in figures["runs"].items():
        strategy, n = key.split("/")
        assert run["world_size"] == int(n) and run["strategy"] == strategy
        assert run["measured_steps"] == settings["steps"]
        assert run["tokens_per_sec"] > 0
        assert run["tokens_per_sec_per_gpu"] == pytest.approx(run["tokens_per_sec"] / int(n), 1e-3)
        assert math.isfinite(run["final_loss_rank0"])
        # rank 0's step times, and each rank's collector pauses in the timed window
        assert len(run["step_time_ms"]["each"]) == settings["steps"]
        assert run["step_time_ms"]["min"] <= run["step_time_ms"]["median"]
        assert len(run["gc_pauses"]) == int(n)
        assert run["gc_every_n_steps"] == 10  # the GarbageCollection callback is on
    assert figures["runs"]["ddp/2"]["trainer_strategy"] == "DDPStrategy"
    summary = figures["summary"]
    assert summary["single/1"]["efficiency_vs_single"] == 1.0
    tps = figures["runs"]["ddp/2"]["tokens_per_sec"]
    single = figures["runs"]["single/1"]["tokens_per_sec"]
    assert summary["ddp/2"]["scaling_efficiency"] is None  # no ddp run on one process
    assert summary["ddp/2"]["efficiency_vs_single"] == pytest.approx(tps / (2 * single), abs=1e-3)
