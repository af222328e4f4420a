"""The README's commands are the ones that work: the main command trains the tiny recipe
on the embedded corpus and its loss falls well below where it started; the test command
is the one CI runs."""

from __future__ import annotations

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


def test_main_command_trains_tiny_model_on_embedded_corpus(tmp_path):
    command = readme_command("main-command").split("&&")[-1].strip()
    argv = shlex.split(command)
    assert argv[0] == "recipes-train"
    script = Path(sys.executable).parent / argv[0]
    proc = subprocess.run(
        [
            str(script),
            *argv[1:],
            f"run.dir={tmp_path / 'run'}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "trainer.enable_progress_bar=false",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    rows = read_metrics(tmp_path / "run")
    train = metric_series(rows, "train/loss")
    val = metric_series(rows, "val/loss")
    ppl = metric_series(rows, "val/ppl")
    assert train[-1][0] == 299  # 300 optimizer steps
    start = train[0][1]
    assert start > 7.0  # close to ln(4096) = 8.3 at the start
    assert val[-1][1] < start - 3.0, (start, val)
    assert [p for _, p in ppl] == sorted((p for _, p in ppl), reverse=True)  # keeps improving
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()
    assert (tmp_path / "run" / "config.yaml").is_file()
    tokens = metric_series(rows, "perf/tokens_per_sec")
    assert tokens and all(t > 0 for _, t in tokens)
