"""The fallback-against-native benchmark runs end to end on CPU (``--smoke``): both paths
train on llama and qwen3 and their ratio is reported."""

from __future__ import annotations

from run_helpers import benchmark_smoke


def test_hf_fallback_smoke_times_both_paths(tmp_path):
    result = benchmark_smoke("hf_fallback.py", tmp_path / "fallback.json")
    assert result["settings"]["tiny"]
    for family in ("llama", "qwen3"):
        entry = result["families"][family]
        assert entry["native"]["tokens_per_sec"] > 0 and entry["fallback"]["tokens_per_sec"] > 0
        assert entry["ratio"] > 0
        # the same shape: the native family and transformers' own model count alike
        assert entry["native"]["parameters"] == entry["fallback"]["parameters"]
