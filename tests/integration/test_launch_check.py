"""The pre-launch check end to end on the tiny recipe: ``recipes-check`` and
``recipes-train ... run.launch_check=true`` print a row per check and exit non-zero on a
problem, naming it; the live checks catch data repeated too often and a checkpoint that
does not load back."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
from integration_helpers import tiny_overrides

from recipes_lib.launch_check import check_launch
from recipes_lib.launch_check.check import CHECKS, FAIL, OK, SKIP, WARN


def _script(name: str) -> str:
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else (shutil.which(name) or name)


def _run(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "COLUMNS": "240"}
    return subprocess.run(
        [_script(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


def _rows(stdout: str) -> dict[str, str]:
    """check name -> status, from the printed table."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) >= 2 and cells[0] in CHECKS:
            rows[cells[0]] = cells[1]
    return rows


@pytest.mark.slow
def test_recipes_check_prints_every_check_and_exits_zero(tmp_path, shared_cache):
    proc = _run("recipes-check", *tiny_overrides(tmp_path, shared_cache), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(proc.stdout)
    assert list(rows) == list(CHECKS)
    assert rows["step time"] == SKIP  # no known card on a CPU
    assert all(rows[c] == OK for c in CHECKS if c != "step time"), rows
    assert "bitwise equal" in proc.stdout and "ready to launch" in proc.stdout
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing trained into run.dir


def test_recipes_check_names_a_missing_data_path(tmp_path, shared_cache):
    missing = tmp_path / "no-such-corpus"
    overrides = tiny_overrides(tmp_path, shared_cache, f"data.path={missing}")
    proc = _run("recipes-check", *overrides, cwd=tmp_path)
    assert proc.returncode != 0
    rows = _rows(proc.stdout)
    assert rows["data"] == FAIL and rows["pre-flight"] == OK
    assert rows["forward/backward"] == rows["checkpoint round trip"] == SKIP
    assert str(missing) in proc.stderr and "data" in proc.stderr


def test_recipes_check_fails_a_config_the_preflight_refuses(tmp_path, shared_cache):
    overrides = tiny_overrides(tmp_path, shared_cache, "data.seq_len=4096")
    proc = _run("recipes-check", *overrides, cwd=tmp_path)
    assert proc.returncode != 0
    rows = _rows(proc.stdout)
    assert rows["pre-flight"] == FAIL
    assert rows["data"] == SKIP and rows["memory"] == OK  # the figures are still given
    assert "data.seq_len=4096" in proc.stderr and "model.max_seq_len" in proc.stderr


@pytest.mark.slow
def test_recipes_train_with_run_launch_check_checks_and_trains_nothing(tmp_path, shared_cache):
    overrides = tiny_overrides(tmp_path, shared_cache, "run.launch_check=true")
    proc = _run("recipes-train", *overrides, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(_rows(proc.stdout)) == list(CHECKS)
    run_dir = tmp_path / "run"
    assert not (run_dir / "checkpoints").exists() and not (run_dir / "model.safetensors").exists()
    assert "finished at step" not in proc.stdout + proc.stderr


def test_run_refuses_to_train_with_run_launch_check(tiny_cfg):
    from recipes_lib.errors import ConfigError
    from recipes_lib.train import run

    with pytest.raises(ConfigError, match="run.launch_check=true"):
        run(tiny_cfg("run.launch_check=true"))


@pytest.mark.slow
def test_data_read_too_often_warns_and_a_checkpoint_that_does_not_load_fails(tiny_cfg, monkeypatch):
    # the tiny slice holds about 120 documents: a long run reads it many times over
    cfg = tiny_cfg("trainer.max_steps=20000")

    def load_nothing(self, checkpoint, strict=True):  # a resume that restores no weights
        return None

    strategy = L.pytorch.strategies.SingleDeviceStrategy
    monkeypatch.setattr(strategy, "load_model_state_dict", load_nothing)
    report = check_launch(cfg)
    statuses = {row.check: row.status for row in report.rows}
    assert statuses["data"] == WARN
    assert "times, more than 4" in next(r.figure for r in report.rows if r.check == "data")
    assert statuses["forward/backward"] == OK
    assert statuses["checkpoint round trip"] == FAIL
    trip = next(r.figure for r in report.rows if r.check == "checkpoint round trip")
    assert "differ after loading" in trip and "model.layers.0.attention" in trip
    assert report.exit_code == 1


def test_the_checkpoint_size_estimate_matches_a_checkpoint_written(tiny_cfg):
    from recipes_lib.config import to_run_config
    from recipes_lib.launch_check.disk import checkpoint_bytes
    from recipes_lib.train import run

    cfg = tiny_cfg("trainer.max_steps=8")
    result = run(cfg)
    written = (result.output_dir / "checkpoints" / "step000008.ckpt").stat().st_size
    assert 0.95 < written / checkpoint_bytes(to_run_config(cfg)) < 1.1
