"""The README's commands are the ones that work: the main command runs the demo pipeline
(pretrain, then anneal) on the embedded corpus, the loss falls well below where it
started and the summary and report are written; the test command is the one CI runs."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from integration_helpers import metric_series, read_metrics

ROOT = Path(__file__).resolve().parents[2]


def readme_command(marker: str) -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"<!-- {marker} -->\s*```bash\n(.+?)\n```", text, re.S)
    assert match, f"README has no {marker} block"
    return match.group(1).strip()


def test_ci_runs_the_readme_test_command():
    test_command = readme_command("test-command").split("&&")[-1].strip()
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_main_command_runs_the_demo_pipeline_on_embedded_corpus(tmp_path):
    command = readme_command("main-command").split("&&")[-1].strip()
    argv = shlex.split(command)
    assert argv[0] == "recipes-pipeline"
    script = Path(sys.executable).parent / argv[0]
    out = tmp_path / "demo"
    proc = subprocess.run(
        [
            str(script),
            *argv[1:],
            f"dir={out}",
            "overrides=['trainer.enable_progress_bar=false']",
        ],
        cwd=tmp_path,
        env={**os.environ, "RECIPES_CACHE": str(tmp_path / "cache")},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    rows = read_metrics(out / "pretrain")
    train = metric_series(rows, "train/loss")
    val = metric_series(rows, "val/loss")
    ppl = metric_series(rows, "val/ppl")
    assert train[-1][0] == 299  # 300 optimizer steps
    start = train[0][1]
    assert start > 7.0  # close to ln(4096) = 8.3 at the start
    assert val[-1][1] < start - 3.0, (start, val)
    assert [p for _, p in ppl] == sorted((p for _, p in ppl), reverse=True)  # keeps improving
    assert (out / "pretrain" / "checkpoints" / "last.ckpt").is_file()
    assert (out / "pretrain" / "config.yaml").is_file()
    tokens = metric_series(rows, "perf/tokens_per_sec")
    assert tokens and all(t > 0 for _, t in tokens)

    # the anneal continues from the pretrained weights and lowers the validation loss
    anneal = read_metrics(out / "anneal")
    assert metric_series(anneal, "train/loss")[-1][0] == 99  # 100 more steps
    assert metric_series(anneal, "val/loss")[-1][1] < val[-1][1]
    for stage in ("pretrain", "anneal"):
        assert (out / stage / "manifest.json").is_file()
        assert (out / stage / "model.safetensors").is_file()

    # the summary table and the report
    assert "pipeline demo" in proc.stdout and "val ppl" in proc.stdout
    summary = json.loads((out / "report" / "summary.json").read_text())
    stages = {s["stage"]: s for s in summary["stages"]}
    assert list(stages) == ["pretrain", "anneal"]
    assert all(s["status"] == "trained" for s in stages.values())
    assert stages["pretrain"]["train_loss_end"] < stages["pretrain"]["train_loss_start"] - 3.0
    assert stages["anneal"]["last_lr"] == 0.0
    for name in ("loss.png", "lr.png", "throughput.png"):
        assert (out / "report" / name).read_bytes()[:4] == b"\x89PNG"
