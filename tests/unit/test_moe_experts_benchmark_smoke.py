"""The grouped-GEMM-against-loop benchmark runs end to end on CPU (``--smoke``), and
there the two paths give the same output."""

from __future__ import annotations

from run_helpers import benchmark_smoke


def test_moe_experts_smoke_times_both_paths(tmp_path):
    out = tmp_path / "moe.json"
    result = benchmark_smoke("moe_experts.py", out)
    assert result["settings"]["smoke"]
    assert [(c["experts"], c["top_k"]) for c in result["cases"]] == [(8, 2), (64, 8)]
    for entry in result["cases"]:
        assert entry["grouped"]["median_ms"] > 0 and entry["loop"]["median_ms"] > 0
        assert entry["max_abs_diff"] < 1e-5 * max(1.0, entry["output_abs_mean"] * 1e3)
