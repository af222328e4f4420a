"""The SFT-against-TRL benchmark runs end to end on CPU (``--smoke``): the folder it
makes trains through the on-ramp, and TRL is measured where it is installed."""

from __future__ import annotations

import importlib.util

from run_helpers import benchmark_smoke


def test_sft_peer_smoke(tmp_path):
    out = tmp_path / "sft_peer.json"
    figures = benchmark_smoke("sft_peer.py", out, timeout=600)
    sides = figures["sides"]
    ours = sides["recipes_lib"]
    assert ours["tokens_per_sec"] > 0 and ours["timed_steps"] == 2
    assert 0 < ours["tokens_per_step"] <= 2 * 256  # real tokens of two packed rows
    if importlib.util.find_spec("trl") is None:
        assert "skipped" in sides["trl"]
    else:
        assert sides["trl"]["tokens_per_sec"] > 0
