"""The training guard end to end: a NaN or a spike injected into one step's batch never
reaches the weights; a rollback resumes from the checkpoint before it, moves the sampler
past the bad data and records it; the same command twice gives bitwise the same weights;
a run that diverges (lr=10) ends non-zero with only finite weights kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from integration_helpers import tiny_overrides

from recipes_lib.checkpoint.weights import load_weights, read_checkpoint
from recipes_lib.config import compose_config
from recipes_lib.pipeline import parse_pipeline, run_pipeline
from recipes_lib.train import run
from recipes_lib.training.guard import TrainingStopped

GUARD = ("guard.window=8", "guard.min_history=4", "guard.spikes=true")


def _run(tmp_path: Path, cache: Path, name: str, *extra: str):
    overrides = tiny_overrides(tmp_path / name, cache, *GUARD, *extra)
    return run(compose_config(overrides))


def _same_weights(a: Path, b: Path) -> None:
    first, second = load_weights(a), load_weights(b)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_an_injected_nan_is_skipped_and_counted(tmp_path, shared_cache):
    result = _run(tmp_path, shared_cache, "nan", "guard.inject_step=6", "guard.inject=nan")
    assert result.global_step == 16 and result.guard["skipped_updates"] == 1
    weights = load_weights(result.weights_path)
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_an_injected_spike_rolls_back_past_its_data_reproducibly(tmp_path, shared_cache):
    spike = (
        "guard.policy=rollback",
        "guard.inject_step=10",
        "guard.inject=spike",
        "guard.rollback_skip_batches=3",
        "run.checkpoint_every_n_steps=4",
    )
    first = _run(tmp_path, shared_cache, "a", *spike)
    second = _run(tmp_path, shared_cache, "b", *spike)
    assert first.global_step == 16
    (rollback,) = first.guard["rollbacks"]
    assert rollback["bad_step"] == 10 and rollback["resumed_from_step"] == 8
    start, end = rollback["skipped_positions"]
    assert end - start == 3 * 4  # 3 batches of 4 samples
    assert first.guard["skipped_updates"] == 1  # the spiking update itself
    checkpoints = tmp_path / "a" / "run" / "checkpoints"
    # the sampler really moved past the window: 16 steps of 4 samples, plus 12 skipped
    state = read_checkpoint(checkpoints / "last.ckpt")
    positions = [v for v in state.values() if isinstance(v, dict) and "sample_offset" in v]
    assert positions == [{"consumed_samples": 16 * 4 + 12, "sample_offset": 12}]
    _same_weights(first.weights_path, second.weights_path)
    assert first.guard == second.guard


def test_a_pipeline_stage_records_its_rollback_in_the_manifest(tmp_path, shared_cache):
    overrides = [
        o
        for o in tiny_overrides(tmp_path, shared_cache, *GUARD)
        if not o.startswith(("recipe=", "run.dir="))
    ]
    pipeline = parse_pipeline(
        {
            "name": "guarded",
            "dir": str(tmp_path / "pipe"),
            "overrides": [
                *overrides,
                "guard.policy=rollback",
                "guard.inject_step=10",
                "guard.inject=spike",
                "guard.rollback_skip_batches=3",
                "run.checkpoint_every_n_steps=4",
            ],
            "stages": {"pretrain": {"recipe": "pretrain/tiny"}},
        }
    )
    manifest = run_pipeline(pipeline)["pretrain"].manifest
    (rollback,) = manifest.guard["rollbacks"]
    assert rollback["resumed_from_step"] == 8 and manifest.guard["skipped_updates"] == 1


def test_a_stop_policy_saves_and_stops(tmp_path, shared_cache):
    with pytest.raises(TrainingStopped, match=r"step 5 had a non-finite loss.*policy=stop"):
        _run(tmp_path, shared_cache, "stop", "guard.policy=stop", "guard.inject_step=5")
    saved = read_checkpoint(tmp_path / "stop" / "run" / "checkpoints" / "step000006.ckpt")
    assert saved["global_step"] == 6


def test_divergence_ends_non_zero_and_keeps_only_finite_weights(tmp_path, shared_cache):
    script = Path(sys.executable).parent / "recipes-train"
    overrides = tiny_overrides(tmp_path, shared_cache, "optim.lr=10", "trainer.max_steps=60")
    proc = subprocess.run(
        [str(script), *overrides], capture_output=True, text=True, timeout=300, env=os.environ
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "training diverged" in errors[0], proc.stderr[-2000:]
    run_dir = tmp_path / "run"
    assert not (run_dir / "model.safetensors").exists()
    for checkpoint in (run_dir / "checkpoints").glob("*.ckpt"):
        state = read_checkpoint(checkpoint)["state_dict"]
        assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())
