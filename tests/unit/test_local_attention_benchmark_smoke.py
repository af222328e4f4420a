"""The local-vs-global layer benchmark runs end to end on CPU (``--smoke``)."""

from __future__ import annotations

from run_helpers import benchmark_smoke


def test_local_attention_smoke_times_both_layers_per_kernel(tmp_path):
    out = tmp_path / "local.json"
    result = benchmark_smoke("local_attention.py", out)
    assert result["settings"]["window"] == 32 and result["device"] == "cpu"
    for kernel in ("flex", "sdpa"):
        entry = result["kernels"][kernel]
        for layer in ("local", "global"):
            assert entry[layer]["ms_median"] > 0 and entry[layer]["steps"] == 2
        assert entry["local/global"] > 0
