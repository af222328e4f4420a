"""The checkpoint-stall benchmark runs its three modes end to end (``--smoke``: the tiny
recipe under FSDP on two CPU processes over gloo) and reports the stall per checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from run_helpers import run_script

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "checkpoint_stall.py"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
        reason="needs torch.distributed with the gloo backend",
    ),
]


def test_checkpoint_stall_smoke_measures_sync_and_async_saves(tmp_path):
    out = tmp_path / "stall.json"
    proc = run_script(  # the driver here; its torchrun job starts processes of its own
        BENCHMARK,
        "--smoke",
        # the background writer, the benchmark's subject; the synchronous save is the
        # path every other checkpoint test takes (both run on GPUs)
        "--modes=async",
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--out",
        str(out),
    )
    figures = json.loads(proc.stdout)  # stdout holds the JSON and nothing else
    assert proc.returncode == 0, json.dumps(figures["runs"], indent=1)[-6000:]
    assert json.loads(out.read_text()) == figures
    runs, settings = figures["runs"], figures["settings"]
    assert list(runs) == ["async"]
    total = settings["warmup_steps"] + settings["steps"]
    expected = total // settings["checkpoint_every_n_steps"]
    for mode in ("async",):
        run = runs[mode]
        assert run["trainer_strategy"] == "FSDP2Strategy" and run["world_size"] == 2
        assert run["measured_steps"] == settings["steps"]
        assert run["checkpoints"] == expected == len(run["save_blocked_s"])
        assert len(run["landed_s"]) == expected
        assert run["written_in_background"] == [mode == "async"] * expected
        assert all(s > 0 for s in run["save_blocked_s"])
        assert run["verified"] is True and run["checkpoint_gib"] > 0
        assert run["checkpoints_on_disk"] == [f"step{total // 3 * 3:06d}.ckpt"]  # keep 1
    summary = figures["summary"]
    assert summary["async"]["stall_per_checkpoint_s_median"] > 0
    assert not list((tmp_path / "ckpt").iterdir())  # every run folder removed
