"""The throughput benchmark runs end to end on CPU (``--smoke``) and reports every trainer."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "pretrain_throughput.py"
TRAINERS = ("recipes_lib", "plain_pytorch", "hf_transformers")


def test_pretrain_throughput_smoke_reports_all_trainers(tmp_path):
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARK), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    figures = json.loads(proc.stdout)  # stdout holds the JSON and nothing else
    assert json.loads(out.read_text()) == figures

    tiny = figures["models"]["tiny"]
    assert tiny["tokens_per_step"] == tiny["batch_size"] * figures["settings"]["seq_len"]
    assert tiny["flops_per_token"] > 6 * tiny["num_params"] * 0.5
    has_transformers = importlib.util.find_spec("transformers") is not None
    for name in TRAINERS:
        report = tiny["trainers"][name]
        if name == "hf_transformers" and not has_transformers:
            assert "skipped" in report
            continue
        assert "error" not in report, report
        assert report["tokens_per_sec"] > 0
        assert report["measured_steps"] == 3
        assert 0 < report["step_time_ms"]["min"] <= report["step_time_ms"]["median"]
        assert math.isfinite(report["final_loss"])
        # random tokens: the loss stays near log(vocab) after a few steps
        assert abs(report["final_loss"] - math.log(tiny["config"]["vocab_size"])) < 1.5

    # Same model, same seed, same batches, same optimizer: the Lightning path and the
    # plain loop must train identically.
    trainers = tiny["trainers"]
    assert math.isclose(
        trainers["recipes_lib"]["final_loss"], trainers["plain_pytorch"]["final_loss"], rel_tol=1e-5
    )
    assert tiny["tokens_per_sec_ratios"]["recipes_lib/plain_pytorch"] > 0
