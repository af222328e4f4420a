"""The optimizer benchmark runs end to end on CPU (``--smoke``): Muon's step through the
library's combined optimizer, its state read while training (the run releases it at its
end)."""

from __future__ import annotations

from run_helpers import benchmark_smoke


def test_optimizers_smoke_times_the_step_and_reads_the_state(tmp_path):
    out = tmp_path / "optimizers.json"
    result = benchmark_smoke(
        "optimizers.py", out, "--part=step", "--optimizers=muon", stdout_json=True
    )
    run = result["runs"]["muon"]
    assert run["optimizer_class"] == "CombinedOptimizer" and run["parameters"] > 0
    assert run["step_ms_median"] > run["optimizer_step_ms_median"] > 0
    # Muon's one momentum for the matrices, AdamW's two moments for the rest (fp32)
    assert 4.0 < run["optimizer_state_bytes_per_param"] < 8.0
