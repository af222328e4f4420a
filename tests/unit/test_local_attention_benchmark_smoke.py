"""The local-vs-global layer benchmark runs end to end on CPU (``--smoke``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "local_attention.py"


def test_local_attention_smoke_times_both_layers_per_kernel(tmp_path):
    out = tmp_path / "local.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARK), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["settings"]["window"] == 32 and result["device"] == "cpu"
    for kernel in ("flex", "sdpa"):
        entry = result["kernels"][kernel]
        for layer in ("local", "global"):
            assert entry[layer]["ms_median"] > 0 and entry[layer]["steps"] == 2
        assert entry["local/global"] > 0
