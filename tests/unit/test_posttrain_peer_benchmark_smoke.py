"""The post-training-against-TRL benchmark runs end to end on CPU (``--smoke``): the
folder and pairs it makes train through the on-ramp DPO recipe (each side in its own
process), and TRL is measured where it is installed."""

from __future__ import annotations

import importlib.util

from run_helpers import benchmark_smoke


def test_posttrain_peer_smoke(tmp_path):
    out = tmp_path / "posttrain_peer.json"
    figures = benchmark_smoke(
        "posttrain_peer.py",
        out,
        "--cases",
        "dpo_live",
        "--sides",
        "recipes_lib,trl",
    )
    assert set(figures["cases"]) == {"dpo_live"}
    for case, rows in (("dpo_live", 2 * 2),):
        sides = figures["cases"][case]["sides"]
        ours = sides["recipes_lib"]
        assert ours["tokens_per_sec"] > 0 and ours["timed_steps"] == 2
        assert 0 < ours["tokens_per_step"] <= rows * 256  # real tokens of the rows
        assert ours["time_to_first_step_s"] > 0
        if importlib.util.find_spec("trl") is None:
            assert "skipped" in sides["trl"]
        else:
            assert sides["trl"]["tokens_per_sec"] > 0
