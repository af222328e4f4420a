"""The grouped-GEMM-against-loop benchmark runs end to end on CPU (``--smoke``), and
there the two paths give the same output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "moe_experts.py"


def test_moe_experts_smoke_times_both_paths(tmp_path):
    out = tmp_path / "moe.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARK), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["settings"]["smoke"]
    assert [(c["experts"], c["top_k"]) for c in result["cases"]] == [(8, 2), (64, 8)]
    for entry in result["cases"]:
        assert entry["grouped"]["median_ms"] > 0 and entry["loop"]["median_ms"] > 0
        assert entry["max_abs_diff"] < 1e-5 * max(1.0, entry["output_abs_mean"] * 1e3)
