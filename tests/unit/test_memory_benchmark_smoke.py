"""The memory benchmark trains each preset in its own process and reports where each
strategy choice stops (``--smoke``: the tiny preset with ``single`` on CPU)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from run_helpers import benchmark_smoke

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "memory.py"


@pytest.mark.slow
def test_memory_smoke_trains_the_tiny_preset_in_a_subprocess(tmp_path):
    out = tmp_path / "memory.json"
    figures = benchmark_smoke("memory.py", out, stdout_json=True)
    assert [step["model"] for step in figures["ladder"]] == ["tiny"]
    assert list(figures["choices"]) == ["single"]
    single = figures["choices"]["single"]
    assert single["first_failure"] is None
    assert single["largest_model"] == "tiny" and single["largest_num_params"] > 0
    report = single["attempts"]["tiny"]
    assert report["trainer_strategy"] == "SingleDeviceStrategy"
    assert report["steps"] == figures["settings"]["steps"]
    assert math.isfinite(report["final_loss"]) and report["host_peak_rss_gib"] > 0
    assert report["peak_memory_gib"] is None  # no CUDA memory counter on CPU
    assert figures["summary"]["single"]["largest_model"] == "tiny"


def test_memory_sizes_the_ladder_and_leaves_unaffordable_offload_unattempted(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARK.parent))
    import memory

    sizes = {m: memory.num_params(m) for m in ("llama_1b", "llama_3b", "llama_8b", "llama2_13b")}
    assert sizes["llama_1b"] < sizes["llama_3b"] < sizes["llama_8b"] < sizes["llama2_13b"]
    assert sizes["llama_3b"] == pytest.approx(3.21e9, rel=0.01)  # Llama 3.2 3B
    assert sizes["llama_8b"] == pytest.approx(8.03e9, rel=0.01)  # Llama 3.1 8B
    assert sizes["llama2_13b"] == pytest.approx(13.0e9, rel=0.01)  # Llama 2 13B

    args = memory.parse_args(["--smoke"])
    entry = memory.try_choice(
        args,
        "fsdp_cpu_offload",
        [("huge", 10**15)],  # 16 PB of host memory: never started
        deadline=float("inf"),
        out=lambda: None,
    )
    assert entry["largest_model"] is None
    assert entry["attempts"]["huge"]["not_attempted"] is True
    assert entry["first_failure"]["model"] == "huge"
